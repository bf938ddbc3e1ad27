"""Tokenizing: ``python -m dist_trainer.prepare`` against the tokenizers library's own ``encode_batch``.

    python bench/prepare.py                 # 100,000 documents, 5 rounds
    python bench/prepare.py --docs 20000 --rounds 1

The same documents both ways: 100,000 of one to three consecutive paragraphs
of CPython's reference text (``pydoc_data.topics``, 466 KB), drawn with a
fixed seed, in a jsonl file; a byte-level BPE of ``--vocab-size`` trained on
that text by ``dist_trainer.data.tokenizer.train_bpe`` (what ``python -m
dist_trainer.tokenizer`` trains). Each measurement runs in a fresh process
(so that none inherits another's heap), alternated over rounds:

* ``library``: the documents already in a list in memory, then one call of
  ``tokenizers.Tokenizer.encode_batch`` (its threads, one per CPU): the
  library alone, with nothing read and nothing written, and the ids not even
  taken out of its objects; ``library_fast`` the same with
  ``encode_batch_fast`` (no character offsets), which prepare calls;
* ``prepare``: ``prepare()`` end to end: reading the jsonl, tokenizing,
  holding out 1 %, writing train.bin and val.bin, hashing them, fsync;
* ``one document``: the whole reference text as one .txt document, by
  ``prepare()`` (cut into pieces tokenized in parallel) and by the library's
  ``encode`` of the whole string (one thread).

Printed: tokens per second of each, and the ratios, per round and as medians;
the CPU seconds of each (all threads) show how much of a difference is the
machine's: a shared machine's speed drifts by 10-30 % within minutes.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dist_trainer.data.builtin import reference_text_bytes  # noqa: E402
from dist_trainer.data.prepare import prepare  # noqa: E402
from dist_trainer.data.tokenizer import train_bpe  # noqa: E402


def corpus(root: Path, docs: int, vocab_size: int) -> None:
    text = reference_text_bytes().decode()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    rng = random.Random(0)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(docs):
            start = rng.randrange(len(paragraphs))
            f.write(json.dumps({"text": "\n\n".join(paragraphs[start:start + rng.randint(1, 3)])}) + "\n")
    (root / "reference.txt").write_text(text)
    train_bpe([paragraphs], vocab_size).save(root / "bpe")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, the library's too
    return usage.ru_utime + usage.ru_stime


def library(jsonl: Path, bpe: Path, call: str = "encode_batch") -> tuple:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    docs = [json.loads(line)["text"] for line in open(jsonl)]
    cpu, started = cpu_seconds(), time.perf_counter()
    encoded = getattr(tok, call)(docs, add_special_tokens=False)
    seconds = time.perf_counter() - started
    return (sum(len(e.ids) for e in encoded) + len(docs)) / seconds, cpu_seconds() - cpu  # with prepare's end-of-text


def through_prepare(path: Path, bpe: Path, out: Path, val_fraction: float) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cpu, started = cpu_seconds(), time.perf_counter()
    meta = prepare([path], out, str(bpe), val_fraction=val_fraction, progress=False)
    seconds = time.perf_counter() - started
    return (meta["train"]["tokens"] + meta["val"]["tokens"]) / seconds, cpu_seconds() - cpu


def whole(path: Path, bpe: Path) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe / "tokenizer.json"))
    text = path.read_text()
    cpu, started = cpu_seconds(), time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False).ids
    return (len(ids) + 1) / (time.perf_counter() - started), cpu_seconds() - cpu


MEASURES = {"library": lambda root: library(root / "docs.jsonl", root / "bpe"),
            "library_fast": lambda root: library(root / "docs.jsonl", root / "bpe", "encode_batch_fast"),
            "prepare": lambda root: through_prepare(root / "docs.jsonl", root / "bpe", root / "out", 0.01),
            "one_doc_prepare": lambda root: through_prepare(root / "reference.txt", root / "bpe", root / "one", 0.0),
            "one_doc_library": lambda root: whole(root / "reference.txt", root / "bpe")}


def measure(name: str, root: Path) -> dict:
    """One measurement in a process of its own: (tokens per second, CPU seconds)."""
    proc = subprocess.run([sys.executable, __file__, "--measure", name, "--root", str(root)],
                          capture_output=True, text=True, check=True)
    rate, cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"rate": rate, "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--measure", choices=sorted(MEASURES), help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(MEASURES[args.measure](args.root)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        root = Path(scratch)
        corpus(root, args.docs, args.vocab_size)
        rows = []
        for round_ in range(args.rounds):
            names = list(MEASURES) if round_ % 2 == 0 else list(reversed(MEASURES))  # drift hits both alike
            results = {name: measure(name, root) for name in names}
            row = {name: results[name]["rate"] for name in MEASURES}
            row["cpu_s"] = cpu = {name: results[name]["cpu"] for name in MEASURES}
            row["ratio"] = row["prepare"] / row["library"]
            row["ratio_fast"] = row["prepare"] / row["library_fast"]
            row["one_doc_ratio"] = row["one_doc_prepare"] / row["one_doc_library"]
            rows.append(row)
            print(f"round {round_ + 1}: library {row['library']:,.0f} tokens/s (_fast {row['library_fast']:,.0f}), "
                  f"prepare {row['prepare']:,.0f} (x{row['ratio']:.3f}, x{row['ratio_fast']:.3f}); one document: prepare {row['one_doc_prepare']:,.0f}, library's "
                  f"encode {row['one_doc_library']:,.0f} (x{row['one_doc_ratio']:.2f}); CPU s: library "
                  f"{cpu['library']:.1f}, prepare {cpu['prepare']:.1f}", flush=True)
        median = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "cpu_s"}
        print(f"median of {len(rows)}: prepare / encode_batch x{median['ratio']:.3f}, prepare / encode_batch_fast "
              f"x{median['ratio_fast']:.3f}; one document x{median['one_doc_ratio']:.2f}")
        print(json.dumps({"docs": args.docs, "vocab_size": args.vocab_size, "rounds": rows, "median": median}))


if __name__ == "__main__":
    main()
