"""``python -m dist_trainer.prepare`` (the command the contract names), and the old import path: data/prepare.py."""

from .data.prepare import (BYTES_EOT, JSONL_LINES, TOKENIZING_THREADS, PrepareError, batched,  # noqa: F401
                           documents, held_out, load, main, prepare, token_dtype, write_token_files)

if __name__ == "__main__":
    main()
