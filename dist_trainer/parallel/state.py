"""Tensors by name across layouts: the local part of a sharded tensor, optimizer state keyed by name, and the
whole model walked tensor by tensor.

A checkpoint written under one layout (ddp, fsdp, hsdp, any world size) is read
under another by naming each parameter's optimizer state after the parameter.
An export (``final_model``, ``hf_model/``) reads the whole model one tensor at a
time (``WholeTensors``), whatever the layout, so no rank ever holds it all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (a view of its storage), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def data_key(t: torch.Tensor) -> tuple:
    """What names a tensor's data: two tensors with one key are one (a tied weight under two names).

    Its storage's address is 0 for an empty tensor, which never matches another.
    """
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def optimizer_param_names(optimizer: torch.optim.Optimizer, weights: Any, module: nn.Module) -> List[str]:
    """The parameter name of each tensor the optimizer steps, in its state_dict's index order.

    ``weights.optimizer_params()[i]`` stands for ``weights.params[i]`` (itself, or its FP32 master).
    """
    name_of = {p: name for name, p in module.named_parameters()}
    stands_for = {t: p for t, p in zip(weights.optimizer_params(), weights.params)}
    return [name_of[stands_for[t]] for group in optimizer.param_groups for t in group["params"]]


def state_of(flat: Dict[str, torch.Tensor], name: str) -> Dict[str, torch.Tensor]:
    """The optimizer state of parameter ``name`` in a flat DCP dict (``optim.<name>.<key>``)."""
    prefix = f"optim.{name}."
    return {key[len(prefix):]: value for key, value in flat.items()
            if key.startswith(prefix) and "." not in key[len(prefix):]}


def named_optimizer_state(optimizer_state: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """torch's index-keyed optimizer state_dict -> keyed by parameter name (param_groups too)."""
    state = {names[i]: value for i, value in optimizer_state["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def indexed_optimizer_state(names: List[str], state: Dict[str, Dict[str, torch.Tensor]],
                            groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Keyed by parameter name -> torch's index-keyed optimizer state_dict, for ``names``' order.

    torch's ``load_state_dict`` pairs the saved groups' parameters with the optimizer's by position, so each
    group lists its indices in ``names``' order, whatever order the checkpoint named them in (a pipeline's
    stage groups name theirs rank by rank: under interleaving or the V, not the model's order)."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state.items() if value},
            "param_groups": [{**g, "params": sorted(index[name] for name in g["params"])} for g in groups]}


# ----------------------------------------------------------------------------- the whole model, tensor by tensor

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the whole model as an export writes it: FP32 where floating, whole, on the CPU."""

    name: str  # the plain model's state_dict name
    shape: Tuple[int, ...]  # whole
    dtype: torch.dtype  # as written: float32 for every floating tensor
    holder: int  # the lowest rank holding it (0 where rank 0 does): where rank 0 gets it from
    tied_to: Optional[str] = None  # an earlier name of the same weight in the model as built (a tied head)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parameter_ties(module: nn.Module) -> Dict[str, str]:
    """Each later name of a parameter held under several names (a tied head) -> its first name."""
    first: Dict[int, str] = {}
    ties = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[name] = first[id(p)]
        first.setdefault(id(p), name)
    return ties


def _written_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype


def whole(t: Any) -> torch.Tensor:
    """A DTensor made whole on every rank of its mesh: ``full_tensor()``, but on CPU for a tensor cut along dim 0
    over one mesh dimension (FSDP's and hsdp's shards), each rank's part broadcast into its place in the whole.
    ``full_tensor()`` on gloo gathers into a buffer and copies it: twice the tensor (measured: 48 MiB above the
    resident set for a 24 MiB tensor, 24 this way), which an export paid at its largest tensor."""
    cut = [i for i, p in enumerate(t.placements) if not p.is_replicate()]
    if (t.device.type != "cpu" or t.ndim == 0 or len(cut) != 1 or type(t.placements[cut[0]]) is not Shard
            or t.placements[cut[0]].dim != 0):
        return t.full_tensor()
    group = t.device_mesh.get_group(cut[0])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = -(-t.shape[0] // world)  # DTensor cuts dim 0 as torch.chunk does: this many rows a rank, the last fewer
    out = torch.empty((world * rows, *t.shape[1:]), dtype=t.dtype)
    local = t.to_local()
    out[rank * rows:rank * rows + local.shape[0]].copy_(local)
    for src in range(world):
        dist.broadcast(out[src * rows:(src + 1) * rows], group=group, group_src=src)
    return out[:t.shape[0]]


class WholeTensors:
    """The whole model, one tensor at a time, on rank 0: the seam every export goes through.

    ``local`` is this rank's tensors by the whole model's names (a DTensor: this
    rank's shard; a pipeline stage: its own names only). Construction is a
    collective: every rank learns ``layout``, the whole model's tensors in one
    order (rank by rank, each rank's in its state_dict's order, the first holder
    of a name giving it), before anything is gathered, so an export can plan
    (which file holds which tensor, which names are one tie) from it alone.

    Iterating is a collective too: every rank iterates in full, in the same
    order. For each tensor its holders make it whole (a DTensor's
    ``full_tensor()``, within its own mesh: every holder takes part) and, where
    rank 0 holds none of it (another pipeline stage), the lowest holder sends it
    to rank 0. Rank 0 alone is given ``(name, tensor)``: FP32 (floating) on the
    CPU; the others are given nothing. So no rank holds more than its own shards
    and one whole tensor (two on rank 0 while it copies one off a device).
    """

    def __init__(self, local: Dict[str, torch.Tensor], ties: Dict[str, str], device: torch.device):
        self.local, self.device = local, device
        self.rank = dist.get_rank()
        mine = [(name, tuple(t.shape), _written_dtype(t), ties.get(name)) for name, t in local.items()]
        every: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # names and shapes only: a few bytes a tensor
        layout: Dict[str, TensorInfo] = {}
        for rank, entries in enumerate(every):
            for name, shape, dtype, tied_to in entries:
                if name not in layout:
                    layout[name] = TensorInfo(name, shape, dtype, rank, tied_to)
        self.layout: List[TensorInfo] = list(layout.values())
        self.by_name = layout
        self.largest_bytes = 0  # the largest tensor rank 0 was given: what it held at once beyond its own state

    @property
    def nbytes(self) -> int:
        """The whole model's bytes as written (FP32 floating tensors)."""
        return sum(info.nbytes for info in self.layout)

    @torch.no_grad()
    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        for info in self.layout:
            t = self.local.get(info.name)
            if t is not None and hasattr(t, "full_tensor"):
                t = whole(t)  # a collective of every rank of its mesh, all of which hold this name
            if t is not None and self.rank in (0, info.holder):
                t = t.to(info.dtype)
            if self.rank == 0:
                if t is None:  # held by another pipeline stage only: its lowest rank sends it
                    t = torch.empty(info.shape, dtype=info.dtype, device=self.device)
                    dist.recv(t, src=info.holder)
                t = t.cpu() if t.device.type != "cpu" else t
                self.largest_bytes = max(self.largest_bytes, info.nbytes)
                yield info.name, t
            elif self.rank == info.holder:
                dist.send(t.contiguous(), dst=0)
            del t  # one whole tensor at a time

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Every rank calls it; rank 0 gets the whole FP32 state dict, the others an empty one."""
        state: Dict[str, torch.Tensor] = {}
        for name, t in self:
            self.collect(state, name, t)
        return state

    def collect(self, state: Dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
        """Put what rank 0 was given for ``name`` into ``state``: a copy, never the model's own tensor (training
        may go on), and one copy for the names of a tied weight where their values are equal (always, but for a
        pipeline's two copies of a weight tied across stages, which take the same updates), so a file holds it
        once, as a one-process model's state_dict does."""
        own = self.local.get(name)
        if own is not None and t.data_ptr() == local_tensor(own).data_ptr():
            t = t.clone()  # rank 0's own FP32 tensor (ddp, or a mesh of one rank)
        first = self.by_name[name].tied_to
        state[name] = state[first] if first in state and torch.equal(state[first], t) else t
