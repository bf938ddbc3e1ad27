"""Weights out as safetensors files, tensor by tensor: what ``hf_model/`` holds.

The directory is the layout transformers' ``from_pretrained`` reads (and
``pretrained.SafetensorsSource`` reads back): one ``model.safetensors``, or
``model-0000K-of-0000N.safetensors`` files and ``model.safetensors.index.json``
(``weight_map``: tensor name -> file). Every tensor's name, shape and dtype is
known before any value is (``parallel.state.WholeTensors.layout``), so the files
are planned up front: a file's header is written when it is opened and each
tensor's bytes are appended as the tensor arrives. The writer keeps no buffer:
what it holds is the one tensor being written. A file is cut where the next
tensor would take it past ``max_shard_bytes`` (as transformers cuts them); a
tensor larger than that gets a file of its own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .pretrained import DTYPES, INDEX, SINGLE

SAFETENSORS_DTYPES = {dtype: name for name, dtype in DTYPES.items()}
DEFAULT_SHARD_MB = 5 * 1024  # transformers 4's default max_shard_size: files the Hugging Face Hub takes whole


@dataclass(frozen=True)
class Entry:
    """One tensor a file will hold, known before its value."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_files(entries: Sequence[Entry], max_shard_bytes: int) -> List[List[Entry]]:
    """The entries cut into files in order: a file ends where the next tensor would take it past the bound."""
    files: List[List[Entry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return files


def _header(entries: Sequence[Entry]) -> bytes:
    """A safetensors header: its length (8 bytes, little-endian), then the JSON, padded to 8 bytes with spaces."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}  # transformers refuses a file without it
    offset = 0
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{e.name}: safetensors has no dtype {e.dtype}")
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # as the reference writer aligns the data that follows
    return len(raw).to_bytes(8, "little") + raw


class SafetensorsWriter:
    """Writes ``entries`` into ``directory`` as they come, in their order (``write``), then the index (``close``)."""

    def __init__(self, directory: Path, entries: Sequence[Entry], max_shard_bytes: int):
        self.directory = Path(directory)
        self.files = plan_files(entries, max_shard_bytes)
        n = len(self.files)
        self.names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._order: Iterator[Tuple[int, Entry]] = iter([(i, e) for i, f in enumerate(self.files) for e in f])
        self._open: Optional[Tuple[int, BinaryIO]] = None
        self.written = 0  # tensors written
        self.largest_bytes = 0  # the largest tensor written: all the writer held at once

    def write(self, name: str, tensor: torch.Tensor) -> None:
        index, entry = next(self._order, (None, None))
        if entry is None or entry.name != name:
            raise ValueError(f"{name} written where the plan expects {entry.name if entry else 'nothing more'}")
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, planned {entry.shape} {entry.dtype}")
        if self._open is None or self._open[0] != index:
            self._close_file()
            f = open(self.directory / self.names[index], "wb")
            f.write(_header(self.files[index]))
            self._open = (index, f)
        if entry.nbytes:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            self._open[1].write(memoryview(data.numpy()))
        self.written += 1
        self.largest_bytes = max(self.largest_bytes, entry.nbytes)

    def _close_file(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def close(self) -> None:
        """The last file closed (every planned tensor written), then the index where there are several files."""
        self._close_file()
        expected = sum(len(f) for f in self.files)
        if self.written != expected:
            raise ValueError(f"{self.written} of {expected} planned tensors written in {self.directory}")
        if not self.files[0]:  # nothing to hold: an empty file still says so
            (self.directory / SINGLE).write_bytes(_header([]))
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for f in self.files for e in f)},
                     "weight_map": {e.name: self.names[i] for i, f in enumerate(self.files) for e in f}}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def abandon(self) -> None:
        self._close_file()


def temporary_dir(out: Path) -> Path:
    """A fresh ``.tmp-NAME`` beside ``out``, for a directory written whole or not at all (``replace_dir``)."""
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """``tmp``, complete, becomes ``out`` (an older ``out`` goes)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
