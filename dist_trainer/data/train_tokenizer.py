"""Train a byte-level BPE tokenizer on local files, for ``data.tokenizer=DIR``.

    python -m dist_trainer.tokenizer --vocab-size 8192 --out DIR FILE...

FILE: text (a document per paragraph), json/jsonl, parquet or csv, read as
``data=hf_text`` reads them (``--format``, ``--text-key``). The vocabulary holds
``<|endoftext|>``, ``<pad>``, ``<mask>`` (ids 0, 1, 2), every byte, then the
merges learned. DIR gets tokenizer.json and the configs that
``transformers.AutoTokenizer.from_pretrained(DIR)`` reads. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from itertools import islice
from pathlib import Path
from typing import Optional, Sequence

from ..config import ConfigError

SAMPLE_BATCHES = 10  # batches of documents re-encoded for the tokens-per-character figure


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", metavar="FILE")
    parser.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, specials included")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the tokenizer to")
    parser.add_argument("--min-frequency", type=int, default=2, help="occurrences a pair needs to be merged")
    parser.add_argument("--format", default=None, help="text, json, parquet or csv (default: from each extension)")
    parser.add_argument("--text-key", default="text", help="column holding the text (json, parquet, csv)")
    args = parser.parse_args(argv)
    try:
        tok, per_char = train(args.files, args.vocab_size, args.out, args.min_frequency, args.format, args.text_key)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: vocabulary {tok.vocab_size}, {per_char:.3f} tokens per character")


def train(files: Sequence[str], vocab_size: int, out: Path, min_frequency: int = 2, format: Optional[str] = None,
          text_key: str = "text"):
    """Train, save to ``out``; return (the tokenizer, tokens per character on the first documents)."""
    from .hf_text import Names, read_documents, resolve_files
    from .tokenizer import MIN_VOCAB, train_bpe

    names = Names(files="FILE", format="--format", text_key="--text-key")
    if not files:
        raise ConfigError("no input FILE given")
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB} (256 bytes and 3 special tokens)")
    if min_frequency < 1:
        raise ConfigError(f"--min-frequency {min_frequency}: must be >= 1")
    sources = resolve_files(files, format, names)
    with tempfile.TemporaryDirectory(prefix="dist_trainer-tokenizer-") as scratch:  # datasets' arrow copies
        def batches():
            return read_documents(sources, text_key, Path(scratch), names)

        if not any(batch for batch in batches()):
            raise ConfigError(f"{' '.join(files)}: no text to train on")
        tok = train_bpe(batches(), vocab_size, min_frequency)
        sample = [doc for batch in islice(batches(), SAMPLE_BATCHES) for doc in batch]
    tokens = sum(ids.size for ids in tok.encode_text(sample))
    tok.save(out)
    return tok, tokens / max(1, sum(map(len, sample)))


if __name__ == "__main__":
    main()
