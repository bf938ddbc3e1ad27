"""``model.pretrained=DIR`` under fsdp, hsdp, tp and pp: each rank reads only the slices it holds.

The model is built from the directory's configuration on the meta device and
sharded (``construct``); then every tensor the safetensors files hold is read
into this rank's shard: a slice of the file (``safe_open(...).get_slice``, which
reads those bytes and no others) where the shard is a box of the whole tensor,
the whole tensor, one at a time, where it is not (FSDP's strided shards over a
tensor-parallel cut). What the files do not hold (rotary frequencies, rows a
chat template's tokens add) comes from the recorded constructor, except the
added rows, which get the mean of the file's rows, as ``resize_token_embeddings``
gives them (without its small random spread: a row the tokenizer adds is the
same on every rank and every mesh).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import ConfigError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


class SafetensorsSource:
    """The tensors of a ``save_pretrained`` directory, by the model's parameter names (``prefix`` + file key)."""

    def __init__(self, directory: Path, prefix: str = "model."):
        self.directory, self.prefix = Path(directory), prefix
        if (self.directory / INDEX).exists():
            weight_map = json.loads((self.directory / INDEX).read_text())["weight_map"]
            self.files = {key: self.directory / name for key, name in weight_map.items()}
        elif (self.directory / SINGLE).exists():
            from safetensors import safe_open

            with safe_open(str(self.directory / SINGLE), "pt") as f:
                self.files = {key: self.directory / SINGLE for key in f.keys()}
        else:
            raise ConfigError(f"model.pretrained={directory}: holds neither {SINGLE} nor {INDEX} (saved with "
                              "save_pretrained(..., safe_serialization=True)?)")

    def key(self, names: List[str]) -> Optional[str]:
        """The file key of a tensor known by ``names`` (tied tensors have several), or None."""
        for name in names:
            if name.startswith(self.prefix) and name[len(self.prefix):] in self.files:
                return name[len(self.prefix):]
        return None

    def load_into(self, model: nn.Module, aliases: Dict[str, List[str]]) -> int:
        """Read every tensor of ``model`` the files hold into this rank's part of it; returns the most bytes
        held at once beyond the model (the largest whole tensor read, 0 if only slices were read).

        ``aliases``: each tensor name -> every name of the same tensor in the model as built (a tie).
        """
        from safetensors import safe_open

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
                with safe_open(str(path), "pt") as f:
                    for name, key in pairs:
                        peak = max(peak, _read(f.get_slice(key), held[name], name))
        return peak

    def check_covers(self, aliases: Dict[str, List[str]]) -> None:
        """Every file key is a tensor of the model (no silent drop of a weight)."""
        names = {n for group in aliases.values() for n in group}
        unknown = sorted(key for key in self.files if self.prefix + key not in names)
        if unknown:
            raise ConfigError(f"model.pretrained={self.directory}: the files hold {unknown[:3]}, which the model "
                              f"built from its config.json has no tensor for")


def _read(sliced: object, target: torch.Tensor, name: str) -> int:
    """Copy this rank's part of one file tensor into ``target``; returns the bytes of a whole read (0: a slice)."""
    from torch.distributed.tensor import DTensor

    local = target.to_local() if isinstance(target, DTensor) else target
    file_shape = tuple(sliced.get_shape())  # type: ignore[attr-defined]
    shape = tuple(target.shape)
    if file_shape != shape and not (len(shape) == 2 and file_shape[1:] == shape[1:] and file_shape[0] < shape[0]):
        raise ConfigError(f"model.pretrained: {name} is {list(file_shape)} in the files and {list(shape)} in the "
                          "model built from their config.json")
    box = _box(target) if file_shape == shape else None
    if box is not None:
        local.copy_(sliced[box].to(local.dtype).view(local.shape))  # type: ignore[index]
        return 0
    whole = sliced[:].to(torch.float32)  # type: ignore[index]
    if file_shape != shape:  # rows a tokenizer added: the mean of the others (resize_token_embeddings' mean)
        whole = torch.cat([whole, whole.mean(0, keepdim=True).expand(shape[0] - file_shape[0], -1)])
    from .construct import local_part

    local.copy_(local_part(whole.to(local.dtype), target))
    return whole.numel() * whole.element_size()


def _box(target: torch.Tensor) -> Optional[Tuple[slice, ...]]:
    """The slices of the whole tensor this rank holds, where they form one box; None where they do not."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(target, DTensor):
        return tuple(slice(0, n) for n in target.shape)
    if any(type(p).__name__ == "_StridedShard" or (not isinstance(p, Shard) and p.is_shard())
           for p in target.placements):
        return None
    # torch.distributed.tensor._utils: the one place DTensor computes a shard's offset (no public API yet).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))

