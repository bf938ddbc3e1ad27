"""``model.pretrained=DIR`` under fsdp, hsdp, tp and pp: each rank reads only the slices it holds.

The model is built from the directory's configuration on the meta device and
sharded (``construct``); then every tensor the safetensors files hold is read
into this rank's shard: the rows of its box (a contiguous range of the file
where the shard cuts rows, blocks of whole rows with the columns kept where it
cuts columns), or the whole tensor, one at a time, where the shard is not a box
(FSDP's strided shards over a tensor-parallel cut). The files are read with
plain reads, not mapped: mapped pages would count in the process's resident
memory, twice the shard's size while it is copied. What the files do not hold (rotary frequencies, rows a
chat template's tokens add) comes from the recorded constructor, except the
added rows, which get the mean of the file's rows, as ``resize_token_embeddings``
gives them (without its small random spread: a row the tokenizer adds is the
same on every rank and every mesh).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import ConfigError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
BLOCK_BYTES = 4 << 20  # rows read at once when a shard keeps only some columns of them


class SafetensorsFile:
    """One safetensors file: its header (name -> dtype, shape, byte range), and reads of a box of a tensor."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.start = 8 + size
        self.tensors = header

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self.tensors[key]["shape"])

    def read(self, key: str, box: Tuple[slice, ...], into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The box of tensor ``key`` (slices of each dimension, step 1), in the file's dtype: read straight into
        ``into`` where it is contiguous, of that dtype and the box's size (no copy held beside it)."""
        entry = self.tensors[key]
        dtype, shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin = self.start + entry["data_offsets"][0]
        size = [b.stop - b.start for b in box]
        direct = (into is not None and into.dtype == dtype and into.is_contiguous() and
                  into.numel() == math.prod(size) and into.device.type == "cpu")
        out = into.view(size) if direct else torch.empty(size, dtype=dtype)
        if out.numel() == 0:
            return out
        rows = box[0] if box else slice(0, 1)
        row_elems = math.prod(shape[1:])
        item = out.element_size()
        whole_rows = all(b.start == 0 and b.stop == n for b, n in zip(box[1:], shape[1:]))
        with open(self.path, "rb", buffering=0) as f:
            if whole_rows:  # one contiguous range
                f.seek(begin + rows.start * row_elems * item)
                f.readinto(out.view(torch.uint8).numpy())
                return out
            step = max(1, BLOCK_BYTES // (row_elems * item))
            for first in range(rows.start, rows.stop, step):
                last = min(rows.stop, first + step)
                block = torch.empty((last - first, *shape[1:]), dtype=dtype)
                f.seek(begin + first * row_elems * item)
                f.readinto(block.view(torch.uint8).numpy())
                out[first - rows.start:last - rows.start] = block[(slice(None), *box[1:])]
        return out


# Where peft's LoRA model keeps a base tensor: the base model under "base_model.model.", a targeted layer's
# weight in its "base_layer", a module to save both as it was ("original_module") and as it trains.
PEFT_WRAPPER = "base_model.model."
PEFT_SEGMENTS = (".base_layer.", ".original_module.", ".modules_to_save.default.")


def base_name(name: str) -> str:
    """A LoRA model's tensor name as the base model names it (what its files hold)."""
    if name.startswith(PEFT_WRAPPER):
        name = name[len(PEFT_WRAPPER):]
    for segment in PEFT_SEGMENTS:
        name = name.replace(segment, ".")
    return name


class SafetensorsSource:
    """The tensors of a ``save_pretrained`` directory, by the model's parameter names (``prefix`` + file key).

    ``lora``: the model is peft's LoRA model over the files' one: its base tensors are read from the base's keys
    (a module to save, both of its copies); the adapters are not in the files and keep their initialisation.
    """

    def __init__(self, directory: Path, prefix: str = "model.", lora: bool = False):
        self.directory, self.prefix = Path(directory), prefix
        self.file_name = base_name if lora else (lambda name: name)
        if (self.directory / INDEX).exists():
            weight_map = json.loads((self.directory / INDEX).read_text())["weight_map"]
            self.files = {key: self.directory / name for key, name in weight_map.items()}
        elif (self.directory / SINGLE).exists():
            self.files = dict.fromkeys(SafetensorsFile(self.directory / SINGLE).tensors, self.directory / SINGLE)
        else:
            raise ConfigError(f"model.pretrained={directory}: holds neither {SINGLE} nor {INDEX} (saved with "
                              "save_pretrained(..., safe_serialization=True)?)")

    def key(self, names: List[str]) -> Optional[str]:
        """The file key of a tensor known by ``names`` (tied tensors have several), or None."""
        for name in names:
            key = self.file_name(name[len(self.prefix):]) if name.startswith(self.prefix) else None
            if key in self.files:
                return key
        return None

    def load_into(self, model: nn.Module, aliases: Dict[str, List[str]]) -> int:
        """Read every tensor of ``model`` the files hold into this rank's part of it; returns the most bytes
        held at once beyond the model (the largest whole tensor read, 0 if only slices were read).

        ``aliases``: each tensor name -> every name of the same tensor in the model as built (a tie).
        """
        held = dict(model.named_parameters(remove_duplicate=False))
        held.update(model.named_buffers(remove_duplicate=False))
        by_file: Dict[Path, List[Tuple[str, str]]] = {}
        for name in held:
            key = self.key(aliases.get(name, [name]))
            if key is not None:
                by_file.setdefault(self.files[key], []).append((name, key))
        peak = 0
        with torch.no_grad():
            for path, pairs in by_file.items():
                f = SafetensorsFile(path)
                for name, key in pairs:
                    peak = max(peak, _read(f, key, held[name], name))
        return peak

    def check_covers(self, aliases: Dict[str, List[str]]) -> None:
        """Every file key is a tensor of the model (no silent drop of a weight)."""
        names = {self.file_name(n[len(self.prefix):]) for group in aliases.values() for n in group
                 if n.startswith(self.prefix)}
        unknown = sorted(key for key in self.files if key not in names)
        if unknown:
            raise ConfigError(f"model.pretrained={self.directory}: the files hold {unknown[:3]}, which the model "
                              f"built from its config.json has no tensor for")


def _read(f: SafetensorsFile, key: str, target: torch.Tensor, name: str) -> int:
    """Copy this rank's part of one file tensor into ``target``; returns the bytes of a whole read (0: a box)."""
    from torch.distributed.tensor import DTensor

    local = target.to_local() if isinstance(target, DTensor) else target
    file_shape = f.shape(key)
    shape = tuple(target.shape)
    if file_shape != shape and not (len(shape) == 2 and file_shape[1:] == shape[1:] and file_shape[0] < shape[0]):
        raise ConfigError(f"model.pretrained: {name} is {list(file_shape)} in the files and {list(shape)} in the "
                          "model built from their config.json")
    box = _box(target) if file_shape == shape else None
    if box is not None:
        read = f.read(key, box, into=local)
        if read.data_ptr() != local.data_ptr():
            local.copy_(read.view(local.shape))  # casts the file's dtype
        return 0
    whole = f.read(key, tuple(slice(0, n) for n in file_shape)).to(torch.float32)
    if file_shape != shape:  # rows a tokenizer added: the mean of the others (resize_token_embeddings' mean)
        whole = torch.cat([whole, whole.mean(0, keepdim=True).expand(shape[0] - file_shape[0], -1)])
    from .construct import local_part

    local.copy_(local_part(whole.to(local.dtype), target))
    return whole.numel() * whole.element_size()


def _box(target: torch.Tensor) -> Optional[Tuple[slice, ...]]:
    """The slices of the whole tensor this rank holds, where they form one box; None where they do not."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    # torch.distributed.tensor._utils: the one place DTensor computes a shard's offset (no public API yet).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    mesh = target.device_mesh
    # A placement over a mesh dimension of one rank cuts nothing (FSDP2 over a tp cut with a shard group of one
    # places a strided shard there).
    placements = [Replicate() if mesh.size(dim) == 1 else p for dim, p in enumerate(target.placements)]
    if any(type(p).__name__ == "_StridedShard" or (p.is_shard() and not isinstance(p, Shard)) for p in placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))

