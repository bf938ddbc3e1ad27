"""Kept for code that imports ``dist_trainer.hf.tokenizer``: the tokenizer loader lives in data/tokenizer.py."""

from ..data.tokenizer import (BYTES_EOS, DEFAULT_CHAT_TEMPLATE, DEFAULT_CHAT_TOKENS, MIN_VOCAB,  # noqa: F401
                              SPECIAL_TOKENS, BytesTokenizer, TextTokenizer, byte_alphabet, load_tokenizer, train_bpe)
