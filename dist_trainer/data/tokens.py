"""``data=tokens``: a flat binary file of token ids, memory-mapped.

Sample ``i`` is tokens ``[i * block_size, (i + 1) * block_size + 1)`` of the
file: ``input_ids`` the first ``block_size``, ``targets`` the same shifted by
one (the next tokens). Nothing is read until a sample is asked for, and each
process (a rank, a DataLoader worker) maps the file itself: opening a file of
any size costs the same.

``python -m dist_trainer.prepare`` writes such files (``train.bin``,
``val.bin``) with a ``meta.json`` beside them that names their dtype; without
one the dtype is ``data.dtype``, else uint16.

Checked at start, cheaply: a size that is not a whole number of tokens, fewer
tokens than one sample, and (on a sample of the file: at most 64 slices of
4096 tokens) ids beyond the model's vocabulary, each a ConfigError naming the
key to change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import ConfigError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECK_SLICES, SLICE_TOKENS = 64, 4096


def read_meta(path: Path) -> Dict[str, Any]:
    """meta.json beside a token file (written by dist_trainer.prepare), or {}."""
    meta = path.parent / "meta.json"
    if not meta.is_file():
        return {}
    try:
        return json.loads(meta.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.path={path}: {meta} is unreadable ({err}); fix or remove it") from err


class TokenFile(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens of a memory-mapped token file."""

    items_are_tokens = True

    def __init__(self, path: str, block_size: int, dtype: Optional[str] = None, vocab_size: Optional[int] = None,
                 key: str = "data.path"):
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{key}={path}: no such file")
        meta = read_meta(self.path)
        name = dtype or meta.get("dtype") or "uint16"
        if name not in DTYPES:
            raise ConfigError(f"data.dtype={name!r}: choose one of {sorted(DTYPES)}")
        if dtype and meta.get("dtype") and dtype != meta["dtype"]:
            raise ConfigError(f"data.dtype={dtype} but {self.path.parent / 'meta.json'} says {meta['dtype']}: "
                              "drop data.dtype (the file's own is used) or make them agree")
        self.dtype = DTYPES[name]
        itemsize = np.dtype(self.dtype).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise ConfigError(f"{key}={path}: {size} bytes is not a whole number of {name} tokens "
                              f"({itemsize} bytes each); is data.dtype right, or the file cut short?")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"data.block_size={block_size!r}: must be an integer >= 1")
        self.block_size = block_size
        self.num_tokens = size // itemsize
        if self.num_tokens < block_size + 1:
            raise ConfigError(f"{key}={path} holds {self.num_tokens} tokens, fewer than one sample of "
                              f"data.block_size={block_size} + 1: lower data.block_size or use a larger file")
        self._len = (self.num_tokens - 1) // block_size
        self._tokens: Optional[np.memmap] = None
        if vocab_size is not None:
            self._check_vocab(int(vocab_size), key)

    def _map(self) -> np.memmap:
        if self._tokens is None:  # per process: a map is never pickled into a worker
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_tokens": None}

    def _check_vocab(self, vocab_size: int, key: str) -> None:
        tokens = self._map()
        starts = np.linspace(0, max(self.num_tokens - SLICE_TOKENS, 0), num=CHECK_SLICES, dtype=np.int64)
        for start in np.unique(starts):
            chunk = np.asarray(tokens[start:start + SLICE_TOKENS])
            if chunk.size and int(chunk.max()) >= vocab_size:
                where = int(start + int(np.argmax(chunk >= vocab_size)))
                raise ConfigError(
                    f"{key}={self.path}: token id {int(chunk[where - start])} at position {where} is beyond "
                    f"model.vocab_size={vocab_size}: set model.vocab_size to the tokenizer's "
                    f"({read_meta(self.path).get('vocab_size', 'see meta.json')}), or check data.dtype")

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        start = index * self.block_size
        chunk = torch.from_numpy(np.array(self._map()[start:start + self.block_size + 1], dtype=np.int64))
        return {"input_ids": chunk[:-1], "targets": chunk[1:]}


def token_file(path: str, block_size: int, dtype: Optional[str] = None, val_path: Optional[str] = None,
               vocab_size: Optional[int] = None, split: str = "train") -> Optional[TokenFile]:
    """The dataset of ``data=tokens``: ``path`` for training, ``val_path`` (if any) held out."""
    if split == "val":
        if val_path is None:
            return None  # no held-out set: no eval loss
        return TokenFile(val_path, block_size, dtype, vocab_size, key="data.val_path")
    if split != "train":
        raise ConfigError(f"data.split={split!r}: choose train or val")
    return TokenFile(path, block_size, dtype, vocab_size)
