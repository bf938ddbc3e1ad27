"""Kept for configurations and checkpoints that name ``dist_trainer.datasets``: now data/builtin.py."""

from .data.builtin import (BYTE_VOCAB_SIZE, IGNORE_INDEX, CharTextDataset, DigitsDataset,  # noqa: F401
                           RegressionDataset, char_text, digits, reference_text_bytes, regression)
