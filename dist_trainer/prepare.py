"""Text, jsonl or parquet files -> token files for ``data=tokens``.

    python -m dist_trainer.prepare --tokenizer bytes --out DIR FILE...
    python -m dist_trainer.prepare --tokenizer path/to/tokenizer.json --out DIR --val-fraction 0.01 FILE...

Documents: a ``.txt`` file is one document (``--split-lines``: each non-empty
line is one); a ``.jsonl`` line is one, its ``--text-key`` field (default
``text``); a ``.parquet`` row is one, that column (needs pyarrow). Each
document is tokenized and followed by the end-of-text id, and written in the
order given to ``DIR/train.bin``, or, for the documents held out
(``--val-fraction``, chosen by a hash of the document's index, so the same
files always give the same split), to ``DIR/val.bin``. ``DIR/meta.json``
records the tokenizer, dtype, vocabulary size, end-of-text id, token and
document counts and each file's sha256.

Tokenizers: ``bytes`` (ids 0-255 are the bytes of the UTF-8 text, 256 ends a
document: vocabulary 257, no files needed), or a Hugging Face ``tokenizers``
file (``tokenizer.json``, or a directory holding one; needs the tokenizers
package). Documents are tokenized in ``--workers`` processes, in chunks, with a
progress bar. Everything is written into a temporary directory beside DIR and
renamed to DIR only when complete: a killed prepare leaves no DIR that looks
finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .checkpoint import sha256_file

BYTES_EOT = 256
CHUNK_DOCS = 256  # documents per task sent to a worker


class PrepareError(ValueError):
    """Bad input to prepare: the message names the option or file to fix."""


def documents(files: Sequence[Path], text_key: str, split_lines: bool) -> Iterator[str]:
    for path in files:
        suffix = path.suffix.lower()
        if not path.is_file():
            raise PrepareError(f"{path}: no such file")
        if suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as err:
                        raise PrepareError(f"{path}:{number}: not a JSON line ({err})") from err
                    if text_key not in record:
                        raise PrepareError(f"{path}:{number}: no {text_key!r} field (set --text-key; "
                                           f"the line has {sorted(record)[:8]})")
                    yield str(record[text_key])
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as err:
                raise PrepareError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from err
            table = pq.read_table(path)
            if text_key not in table.column_names:
                raise PrepareError(f"{path}: no column {text_key!r} (set --text-key; columns: {table.column_names})")
            for batch in table.column(text_key).chunks:
                yield from (str(v) for v in batch.to_pylist())
        else:  # plain text
            text = path.read_text(encoding="utf-8", errors="replace")
            if split_lines:
                yield from (line for line in text.splitlines() if line.strip())
            else:
                yield text


class Tokenizer:
    """``bytes``, or a Hugging Face tokenizers file; picklable by its spec, loaded once per process."""

    def __init__(self, spec: str):
        self.spec = spec
        self._hf = None
        if spec == "bytes":
            self.name, self.vocab_size, self.eot = "bytes", BYTES_EOT + 1, BYTES_EOT
            return
        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise PrepareError(f"--tokenizer {spec}: not 'bytes', nor a tokenizer.json or a directory holding one")
        self.path = path
        hf = self._load()
        self.name, self.vocab_size = str(path), hf.get_vocab_size()
        eot = next((hf.token_to_id(t) for t in ("<|endoftext|>", "</s>", "[SEP]", "<eos>") if hf.token_to_id(t) is not None),
                   None)
        if eot is None:
            raise PrepareError(f"--tokenizer {spec}: it has no end-of-text token (<|endoftext|>, </s>, [SEP], <eos>)")
        self.eot = eot

    def _load(self):
        if self._hf is None:
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError as err:
                raise PrepareError("--tokenizer PATH needs the tokenizers package (pip install tokenizers), "
                                   "or use --tokenizer bytes") from err
            try:
                self._hf = HFTokenizer.from_file(str(self.path))
            except Exception as err:  # the library's own error type varies
                raise PrepareError(f"--tokenizer {self.spec}: cannot be read ({err})") from err
        return self._hf

    def __getstate__(self):
        return {**self.__dict__, "_hf": None}

    def encode(self, docs: List[str]) -> List[np.ndarray]:
        if self.spec == "bytes":
            return [np.frombuffer(d.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for d in docs]
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._load().encode_batch(docs, add_special_tokens=False)]


_WORKER: dict = {}


def _init(tokenizer: Tokenizer) -> None:
    _WORKER["tokenizer"] = tokenizer


def _encode(chunk: Tuple[int, List[str]]) -> Tuple[int, List[np.ndarray], int]:
    start, docs = chunk
    tokenizer = _WORKER["tokenizer"]
    return start, tokenizer.encode(docs), sum(len(d) for d in docs)


def _chunks(docs: Iterator[str]) -> Iterator[Tuple[int, List[str]]]:
    batch: List[str] = []
    start = 0
    for doc in docs:
        batch.append(doc)
        if len(batch) == CHUNK_DOCS:
            yield start, batch
            start, batch = start + len(batch), []
    if batch:
        yield start, batch


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` goes to val.bin: a hash of the index, the same on every run."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"prepare:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def prepare(files: Sequence[Path], out: Path, tokenizer_spec: str, val_fraction: float = 0.0,
            workers: int = 1, text_key: str = "text", split_lines: bool = False, force: bool = False,
            progress: bool = True) -> dict:
    if not files:
        raise PrepareError("no input FILE given")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if out.exists() and not force:
        raise PrepareError(f"--out {out} exists: remove it, or pass --force to replace it")
    tokenizer = Tokenizer(tokenizer_spec)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts = {"train": [0, 0], "val": [0, 0]}  # tokens, documents
    started, chars = time.perf_counter(), 0
    try:
        from tqdm import tqdm

        bar = tqdm(unit="doc", desc="tokenizing", disable=not progress, file=sys.stderr)
        with open(tmp / "train.bin", "wb") as train, open(tmp / "val.bin", "wb") as val:
            pool = mp.get_context("spawn").Pool(workers, _init, (tokenizer,)) if workers > 1 else None
            try:
                chunks = _chunks(documents(files, text_key, split_lines))
                if pool is None:
                    _init(tokenizer)
                    results = map(_encode, chunks)
                else:
                    results = pool.imap(_encode, chunks, chunksize=1)  # in order
                for start, encoded, n_chars in results:
                    chars += n_chars
                    for i, ids in enumerate(encoded):
                        split = "val" if held_out(start + i, val_fraction) else "train"
                        data = np.append(ids, tokenizer.eot).astype(dtype)
                        (val if split == "val" else train).write(data.tobytes())
                        counts[split][0] += data.size
                        counts[split][1] += 1
                    bar.update(len(encoded))
            finally:
                if pool is not None:
                    pool.terminate()
            for f in (train, val):
                f.flush()
                os.fsync(f.fileno())
        bar.close()
        seconds = time.perf_counter() - started
        if counts["train"][0] == 0:
            raise PrepareError("no document went to train.bin (empty input, or --val-fraction too high)")
        meta = {"tokenizer": tokenizer.name, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size,
                "eot_id": int(tokenizer.eot), "inputs": [str(f) for f in files],
                "train": {"tokens": counts["train"][0], "documents": counts["train"][1],
                          "sha256": sha256_file(tmp / "train.bin")},
                "val": {"tokens": counts["val"][0], "documents": counts["val"][1], "sha256": sha256_file(tmp / "val.bin")},
                "val_fraction": val_fraction, "characters": chars, "seconds": seconds,
                "tokens_per_s": (counts["train"][0] + counts["val"][0]) / max(seconds, 1e-9)}
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # the whole directory at once: complete, or not there
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--out", type=Path, required=True, help="directory to create (train.bin, val.bin, meta.json)")
    parser.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer.json (or its directory)")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="documents held out for val.bin")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: one per CPU for a tokenizer file; 1 for bytes, "
                             "which is faster than sending the documents to other processes)")
    parser.add_argument("--text-key", default="text", help="field of jsonl lines, column of parquet files")
    parser.add_argument("--split-lines", action="store_true", help="each line of a .txt file is a document")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        workers = args.workers or (1 if args.tokenizer == "bytes" else max(1, os.cpu_count() or 1))
        meta = prepare(args.files, args.out, args.tokenizer, args.val_fraction, workers, args.text_key,
                       args.split_lines, args.force)
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: {meta['train']['tokens']:,} train tokens ({meta['train']['documents']:,} documents), "
          f"{meta['val']['tokens']:,} val tokens ({meta['val']['documents']:,}), {meta['dtype']}, vocabulary "
          f"{meta['vocab_size']}; {meta['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
