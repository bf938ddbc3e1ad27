"""Kept for configurations and checkpoints that name ``dist_trainer.tokens``: token files live in data/tokens.py."""

from .data.tokens import DTYPES, TokenFile, read_meta, token_file  # noqa: F401
