"""``final_model.pt`` written as ``torch.save`` writes a state dict, one tensor at a time.

``torch.save`` pickles the whole dict at once, so the writer would hold the whole
model. Its format is a zip archive (stored, not compressed): ``data.pkl``, the
pickled dict whose tensors refer to storages by key, and one record
``data/<key>`` of raw bytes per storage, each 64-byte aligned so that
``torch.load(..., mmap=True)`` can map it. Here each tensor's record is appended
as the tensor arrives and dropped; ``data.pkl`` is pickled last from the names,
dtypes and shapes alone. ``torch.load(path, weights_only=True)`` reads the file
as it reads one ``torch.save`` wrote (tested: equal tensors, equal names, the
same dict). A weight tied under two names (a GPT's embedding and head) is one
storage under both, as ``torch.save`` stores it, where the two values are equal
(a digest of the first is kept, not the tensor).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

ALIGNMENT = 64  # torch.serialization's storage alignment: records start on it (mmap loads need it)
PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
FORMAT_VERSION = "3"  # the archive version torch.save writes (caffe2 serialize's kProducedFileFormatVersion)


class _Storage:
    """A storage of the archive by key (pickled as torch's persistent id: never its bytes)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """A tensor of the archive, pickled as ``torch.save`` pickles one: ``_rebuild_tensor_v2`` over its storage."""

    def __init__(self, storage: _Storage, shape: Tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> Any:
        stride, step = [], 1
        for n in reversed(self.shape):
            stride.append(step)
            step *= n
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Optional[tuple]:
        if isinstance(obj, _Storage):
            # torch's legacy typed storage class of the dtype (FloatStorage, ...), as torch.save records it
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class TorchSaveWriter:
    """``write(name, tensor[, tied_to])`` in any order of names, then ``close()``; ``abandon()`` on failure."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.prefix = self.path.stem or "archive"  # torch.save names the archive's folder after the file
        self.zip = zipfile.ZipFile(self.path, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.state: Dict[str, _Tensor] = {}
        self.digests: Dict[str, str] = {}  # name -> sha256 of its bytes, for a later tied name
        self.largest_bytes = 0

    def write(self, name: str, tensor: torch.Tensor, tied_to: Optional[str] = None) -> None:
        t = tensor.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        digest = hashlib.sha256(memoryview(data)).hexdigest()
        first = self.state.get(tied_to) if tied_to else None
        if first is not None and self.digests[tied_to] == digest and first.shape == tuple(t.shape):
            self.state[name] = first  # one storage under both names, as torch.save keeps a tie
        else:
            storage = _Storage(str(len({id(s.storage) for s in self.state.values()})), t.dtype, t.numel())
            self._record(f"data/{storage.key}", memoryview(data))
            self.state[name] = _Tensor(storage, tuple(t.shape))
        self.digests[name] = digest
        self.largest_bytes = max(self.largest_bytes, t.numel() * t.element_size())

    def _record(self, name: str, data: Any) -> None:
        info = zipfile.ZipInfo(f"{self.prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        # Pad the local header's extra field so the bytes start on ALIGNMENT (torch's writer does the same).
        start = self.zip.fp.tell() + 30 + len(info.filename.encode()) + 4
        size = len(data)
        if size >= 2**31 - 1:
            start += 20  # the zip64 extra field the header will carry
        pad = -start % ALIGNMENT
        info.extra = struct.pack("<HH", 0xFB4A, pad) + b"\0" * pad
        with self.zip.open(info, "w", force_zip64=size >= 2**31 - 1) as out:
            out.write(data)

    def close(self) -> None:
        buf = _pickled({name: tensor for name, tensor in self.state.items()})
        self._record("data.pkl", buf)
        for name, value in ((".format_version", "1"), (".storage_alignment", str(ALIGNMENT)),
                            ("byteorder", sys.byteorder), ("version", FORMAT_VERSION)):
            self._record(name, value.encode())
        self.zip.close()

    def abandon(self) -> None:
        self.zip.close()
        self.path.unlink(missing_ok=True)


def _pickled(state: Dict[str, _Tensor]) -> bytes:
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(state)
    return buf.getvalue()


def sizes(path: Path) -> List[Tuple[str, int]]:
    """The archive's records and their sizes (for tests)."""
    with zipfile.ZipFile(path) as z:
        return [(i.filename, i.file_size) for i in z.infolist()]
