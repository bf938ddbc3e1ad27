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

Tokenizers (``data.tokenizer.load_tokenizer``, the loader data=hf_text
and hf_chat use): ``bytes`` (ids 0-255 are the bytes of the UTF-8 text, 256
ends a document; the vocabulary is 259, with 257 and 258 the padding and mask
tokens hf_text uses, which never appear here; no package needed), or a Hugging
Face ``tokenizers`` file (``tokenizer.json``, or a directory holding one; needs
the tokenizers package). The text of a special token inside a document is
text. Batches of documents are tokenized in the library's threads
(``--workers``), the next batch read while one is tokenized; a document longer
than 32 K characters is tokenized in pieces, in parallel, with the ids it has
whole. ``--processes N`` tokenizes the files in N processes, a file each at a
time, and writes their ids in the order given: the same files byte for byte as
one process (held-out documents are chosen by their index in the whole input).
Everything is written into a temporary directory beside DIR and renamed
to DIR only when complete: a killed prepare leaves no DIR that looks finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..config import ConfigError

if TYPE_CHECKING:
    from .tokenizer import TextTokenizer

BYTES_EOT = 256
BATCH_DOCS, BATCH_CHARS = 1000, 8_000_000  # a batch of documents ends at either
JSONL_LINES = 1000  # parsed in one json.loads call: half the time of one call per line
# Batches in the library at once: while one thread turns a batch's ids into arrays
# (holding the GIL), the other's batch keeps the library's threads busy.
TOKENIZING_THREADS = 2


class PrepareError(ConfigError):
    """Bad input to prepare: the message names the option or file to fix."""


def documents(files: Sequence[Path], text_key: str, split_lines: bool) -> Iterator[str]:
    for path in files:
        suffix = path.suffix.lower()
        if not path.is_file():
            raise PrepareError(f"{path}: no such file")
        if suffix == ".jsonl":
            yield from _jsonl(path, text_key)
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


def _jsonl(path: Path, text_key: str) -> Iterator[str]:
    """The ``text_key`` field of each line, JSONL_LINES lines parsed in one call."""
    with open(path, encoding="utf-8") as f:
        first = 1  # the number of the chunk's first line
        while lines := list(islice(f, JSONL_LINES)):
            filled = [line for line in lines if line.strip()]
            try:
                records = json.loads("[" + ",".join(filled) + "]")
                texts = [str(r[text_key]) for r in records] if len(records) == len(filled) else None
            except (ValueError, TypeError, KeyError):
                texts = None
            if texts is None:  # something in these lines is wrong: find it, line by line
                texts = [_jsonl_line(path, number, line, text_key)
                         for number, line in enumerate(lines, first) if line.strip()]
            yield from texts
            first += len(lines)


def _jsonl_line(path: Path, number: int, line: str, text_key: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise PrepareError(f"{path}:{number}: not a JSON line ({err})") from err
    if not isinstance(record, dict):
        raise PrepareError(f"{path}:{number}: not a JSON object but {type(record).__name__}")
    if text_key not in record:
        raise PrepareError(f"{path}:{number}: no {text_key!r} field (set --text-key; "
                           f"the line has {sorted(record)[:8]})")
    return str(record[text_key])


def with_eos(ids: np.ndarray, lengths: np.ndarray, eos_id: int, dtype: Any) -> np.ndarray:
    """A batch's token stream as the token files hold it: each document's ids, then end-of-text."""
    return np.insert(ids.astype(dtype), np.cumsum(lengths), dtype(eos_id))


def batched(docs: Iterable[str], max_docs: int = BATCH_DOCS, max_chars: int = BATCH_CHARS) -> Iterator[List[str]]:
    """Lists of consecutive documents, each ending at ``max_docs`` documents or ``max_chars`` characters."""
    batch: List[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) == max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` goes to val.bin: a hash of the index, the same on every run."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"prepare:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def token_dtype(vocab_size: int) -> Any:
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def write_token_files(out: Path, batches: Iterable[List[str]], tok: "TextTokenizer", val_fraction: float,
                      progress: bool = True, desc: str = "tokenizing",
                      encoded: Optional[Iterable[Tuple[np.ndarray, np.ndarray, int]]] = None) -> Dict[str, Any]:
    """Each document's ids then end-of-text, into ``out/train.bin`` or (held out) ``out/val.bin``, in order.

    ``encoded``: batches already tokenized (ids, each document's length, its characters), in order, written in
    place of ``batches`` (``prepare``'s processes).

    The library tokenizes a batch in its own threads, without the GIL, while
    this thread reads the next batch and writes the one before: reading and
    writing cost no time of their own. Returns the meta the files need
    (dtype, vocabulary, end-of-text, per split: tokens, documents, sha256).
    """
    from tqdm import tqdm

    dtype = token_dtype(tok.vocab_size)
    counts = {"train": [0, 0], "val": [0, 0]}  # tokens, documents
    digests = {split: hashlib.sha256() for split in counts}
    index, chars, started = 0, 0, time.perf_counter()
    with tqdm(unit="doc", desc=desc, disable=not progress, file=sys.stderr) as bar, \
            open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val, \
            ThreadPoolExecutor(TOKENIZING_THREADS, thread_name_prefix="tokenize") as pool:
        files = {"train": train, "val": val}

        def write(encoded: Tuple[np.ndarray, np.ndarray]) -> None:
            nonlocal index
            ids, lengths = encoded
            held = np.fromiter((held_out(index + i, val_fraction) for i in range(lengths.size)), dtype=bool,
                               count=lengths.size)
            index += lengths.size
            stream = with_eos(ids, lengths, tok.eos_id, dtype)
            in_val = np.repeat(held, lengths + 1)
            for split, chosen, docs in (("train", ~in_val, ~held), ("val", in_val, held)):
                tokens = stream[chosen]
                data = tokens.tobytes()
                files[split].write(data)
                digests[split].update(data)
                counts[split][0] += tokens.size
                counts[split][1] += int(docs.sum())
            bar.update(lengths.size)

        for ids, lengths, characters in encoded or ():
            chars += characters
            write((ids, lengths))
        pending: deque = deque()
        for docs in batches if encoded is None else ():
            pending.append(pool.submit(tok.encode_flat, docs))
            chars += sum(map(len, docs))
            if len(pending) > TOKENIZING_THREADS:  # batches in the library's hands, the oldest written meanwhile
                write(pending.popleft().result())
        while pending:
            write(pending.popleft().result())
        for f in (train, val):
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    tokens = counts["train"][0] + counts["val"][0]
    return {"dtype": np.dtype(dtype).name, "vocab_size": tok.vocab_size, "eot_id": int(tok.eos_id),
            **{split: {"tokens": counts[split][0], "documents": counts[split][1],
                       "sha256": digests[split].hexdigest()} for split in counts},
            "characters": chars, "seconds": seconds, "tokens_per_s": tokens / max(seconds, 1e-9)}


def load(tokenizer_spec: str) -> "TextTokenizer":
    """The tokenizer, its errors naming --tokenizer."""
    try:
        from .tokenizer import load_tokenizer

        return load_tokenizer(tokenizer_spec, key="--tokenizer")
    except ConfigError as err:
        raise PrepareError(str(err)) from err
    except ImportError as err:
        raise PrepareError(f"--tokenizer {tokenizer_spec}: {err}; or use --tokenizer bytes") from err


def _tokenize_file(path: Path, part: Path, tokenizer_spec: str, text_key: str, split_lines: bool) -> int:
    """One file's documents tokenized into ``part``.ids (end to end, the token dtype) and ``part``.len.npy (each
    document's length); its characters. A process of ``prepare``'s pool."""
    tok = load(tokenizer_spec)
    dtype, lengths, chars = token_dtype(tok.vocab_size), [], 0
    with open(part.with_suffix(".ids"), "wb") as f:
        for docs in batched(documents([path], text_key, split_lines)):
            ids, sizes = tok.encode_flat(docs)
            f.write(ids.astype(dtype).tobytes())
            lengths.append(sizes)
            chars += sum(map(len, docs))
    np.save(part.with_suffix(".len.npy"), np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64))
    return chars


def _tokenized(files: Sequence[Path], parts: Path, tokenizer_spec: str, text_key: str, split_lines: bool,
               processes: int) -> Iterator[Tuple[np.ndarray, np.ndarray, int]]:
    """The files tokenized by ``processes`` processes, one file a task, handed on in file order (the held-out
    split hashes each document's index in the whole input, so only the order matters): batches of documents."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    dtype = token_dtype(load(tokenizer_spec).vocab_size)
    parts.mkdir()
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        tasks = [pool.submit(_tokenize_file, path, parts / f"{i:06d}", tokenizer_spec, text_key, split_lines)
                 for i, path in enumerate(files)]
        for i, task in enumerate(tasks):
            chars, part = task.result(), parts / f"{i:06d}"
            ids = np.fromfile(part.with_suffix(".ids"), dtype=dtype)
            lengths = np.load(part.with_suffix(".len.npy"))
            ends = np.cumsum(lengths)
            for first in range(0, lengths.size, BATCH_DOCS):
                last = min(first + BATCH_DOCS, lengths.size)
                begin = int(ends[first - 1]) if first else 0
                yield ids[begin:int(ends[last - 1])], lengths[first:last], chars if last == lengths.size else 0
            part.with_suffix(".ids").unlink()
            part.with_suffix(".len.npy").unlink()


def prepare(files: Sequence[Path], out: Path, tokenizer_spec: str, val_fraction: float = 0.0,
            text_key: str = "text", split_lines: bool = False, force: bool = False,
            progress: bool = True, processes: int = 1) -> dict:
    if not files:
        raise PrepareError("no input FILE given")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction}: must be in [0, 1)")
    if out.exists() and not force:
        raise PrepareError(f"--out {out} exists: remove it, or pass --force to replace it")
    tok = load(tokenizer_spec)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        encoded = (_tokenized(files, tmp / "parts", tokenizer_spec, text_key, split_lines, processes)
                   if processes > 1 else None)
        written = write_token_files(tmp, batched(documents(files, text_key, split_lines)), tok, val_fraction,
                                    progress, encoded=encoded)
        shutil.rmtree(tmp / "parts", ignore_errors=True)
        if written["train"]["tokens"] == 0:
            raise PrepareError("no document went to train.bin (empty input, or --val-fraction too high)")
        meta = {"tokenizer": tok.spec, "inputs": [str(f) for f in files], "val_fraction": val_fraction, **written}
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
                        help="threads the tokenizers library encodes in (default: one per CPU; "
                             "bytes needs none)")
    parser.add_argument("--processes", type=int, default=1,
                        help="processes that tokenize the files, a file each at a time (the output is the same "
                             "byte for byte); 1: this one")
    parser.add_argument("--text-key", default="text", help="field of jsonl lines, column of parquet files")
    parser.add_argument("--split-lines", action="store_true", help="each line of a .txt file is a document")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        if args.workers is not None:
            if args.workers < 1:
                raise PrepareError(f"--workers {args.workers}: must be >= 1")
            os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # read when the library first encodes
        if args.processes < 1:
            raise PrepareError(f"--processes {args.processes}: must be >= 1")
        meta = prepare(args.files, args.out, args.tokenizer, args.val_fraction, args.text_key,
                       args.split_lines, args.force, processes=args.processes)
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: {meta['train']['tokens']:,} train tokens ({meta['train']['documents']:,} documents), "
          f"{meta['val']['tokens']:,} val tokens ({meta['val']['documents']:,}), {meta['dtype']}, vocabulary "
          f"{meta['vocab_size']}; {meta['tokens_per_s']:,.0f} tokens/s")


if __name__ == "__main__":
    main()
