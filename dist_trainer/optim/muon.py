"""Muon (``optim.name=muon``): the hidden layers' 2-D matrices take Muon's orthogonalised momentum, every other
parameter AdamW with the ``optim.*`` keys, in one optimizer (one state dict, one schedule, one skip).

Muon's update of a matrix is ``NS(momentum)``, Newton-Schulz's approximation of the nearest semi-orthogonal
matrix, a function of the WHOLE matrix: its singular values, not its elements. A sharded weight (FSDP's rows, a
tensor-parallel slice) orthogonalised shard by shard is another optimizer, and no error says so. Here the momentum
is kept sharded like its parameter (its update is element-wise), and each step every Muon matrix's momentum
update is all-gathered whole (``DTensor.full_tensor``: one all-gather per sharded mesh dimension), orthogonalised
on every rank alike, and each rank keeps its own slice of the result: the update one process makes, up to the
gradients' rounding. The gathers are counted (``muon_all_gathers``, ``muon_all_gather_bytes``) and plan mode
predicts them.

Newton-Schulz runs in ``optim.muon.ns_dtype``: fp32 by default. torch.optim.Muon always runs it in bf16, which
turns a split's last-bit gradient difference (1e-7) into an update difference of about 1e-2; bf16 is opt-in here
for the speed and documented as not split-invariant.

Learning rates: ``optim.muon.lr`` for the matrices and ``optim.lr`` for the rest, both following the schedule
(warmup, decay, batch-size scaling) as one ratio; ``adjust_lr``: ``original`` (Keller Jordan's
``sqrt(max(1, rows / cols))``) or ``match_rms_adamw`` (Moonshot's ``0.2 sqrt(max(rows, cols))``, so AdamW's lr and
weight decay carry over).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam  # AdamW's own functional update (AdamW is Adam with decoupled decay)

from ..config import Config, require
from ..parallel.tp import count_collectives

# Keller Jordan's quintic: the slope at zero made as large as converges in 5 steps (torch.optim.Muon's too)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ADJUST_LR = ("original", "match_rms_adamw")
# Matrices that are not hidden layers: the embeddings (token and position) and the output head, by name.
DEFAULT_EXCLUDE = ("*emb*", "*wte*", "*wpe*", "*head.weight")
COMM_KEYS = ("muon_all_gathers", "muon_all_gather_bytes", "muon_gathers", "muon_gather_bytes", "muon_scatters",
             "muon_scatter_bytes")
DIST = ("gather", "owner")


def check_muon(cfg: Config) -> None:
    """``optim.muon.*``: Muon's keys, checked whatever optim.name is."""
    m = cfg.optim.muon
    require(m.lr > 0, "optim.muon.lr", m.lr, "must be > 0")
    require(0 <= m.momentum < 1, "optim.muon.momentum", m.momentum, "must be in [0, 1)")
    require(isinstance(m.ns_steps, int) and 1 <= m.ns_steps < 100, "optim.muon.ns_steps", m.ns_steps,
            "must be an integer in [1, 100)")
    require(m.ns_dtype in ("fp32", "bf16"), "optim.muon.ns_dtype", m.ns_dtype, "choose fp32 or bf16")
    require(m.adjust_lr in ("original", "match_rms_adamw"), "optim.muon.adjust_lr", m.adjust_lr,
            "choose original or match_rms_adamw")
    require(isinstance(m.exclude, (list, tuple)) and all(isinstance(x, str) for x in m.exclude),
            "optim.muon.exclude", m.exclude, "must be a list of name patterns")
    require(m.dist in ("gather", "owner"), "optim.muon.dist", m.dist, "choose gather or owner")


def takes_muon(name: str, param: torch.Tensor, exclude: Sequence[str]) -> bool:
    """Whether the parameter ``name`` is a hidden layer's matrix: 2-D and matched by no ``exclude`` pattern."""
    return param.ndim == 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude)


def orthogonalise(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's semi-orthogonal approximation of ``update`` (2-D), computed in ``dtype``, returned in
    ``update``'s (the operations of torch.optim.Muon's, which runs them in bf16)."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # the Gram matrix of the shorter side
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * (0.2 * math.sqrt(max(rows, cols)))


class MuonAdamW(torch.optim.AdamW):
    """AdamW's groups stepped by torch's AdamW; groups with ``muon: True`` by Muon (state: ``momentum_buffer`` and
    ``step``)."""

    def __init__(self, groups: List[Dict[str, Any]], lr: float, betas: tuple, eps: float) -> None:
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        # the gathers and scatters of owner mode, and what DTensor's counter keeps under this prefix
        self.counts = dict.fromkeys(COMM_KEYS + ("muon_allreduces", "muon_allreduce_bytes", "muon_reduce_scatters",
                                                 "muon_reduce_scatter_bytes"), 0)

    def comm(self) -> Dict[str, int]:
        return {key: self.counts[key] for key in COMM_KEYS}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            if group.get("muon"):
                self._muon(group)
            else:
                self._adamw(group)

    def _updates(self, group: Dict[str, Any]) -> List[tuple]:
        """(parameter, its momentum's update: sharded as the parameter) of each matrix with a gradient, the
        momentum moved."""
        momentum, out = group["momentum"], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:  # sharded like the gradient: its update is element-wise
                state["momentum_buffer"] = torch.zeros_like(p.grad)
                # Muon's updates so far: Adam's loading reads a step in every tensor's state (a float32 scalar)
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            out.append((p, p.grad.lerp(buf, momentum) if group["nesterov"] else buf))
        return out

    def _adamw(self, group: Dict[str, Any]) -> None:
        """torch.optim.AdamW's step of one group (its own state initialisation and functional update)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
            has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
            eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
            differentiable=group["differentiable"], fused=group["fused"], decoupled_weight_decay=True)

    def _muon(self, group: Dict[str, Any]) -> None:
        dtype, steps = NS_DTYPES[group["ns_dtype"]], group["ns_steps"]
        updates = self._updates(group)
        if group.get("dist") == "owner":
            results = owner_orthogonalise([u for _, u in updates], steps, dtype, self.counts)
        else:
            results = [self._whole(u, steps, dtype) for _, u in updates]
        for (p, _), step in zip(updates, results):
            p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled, with the group's scheduled lr
            p.add_(step, alpha=-adjusted_lr(group["lr"], group["adjust_lr"], p.shape))

    def _whole(self, update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
        """The orthogonalised update of the whole matrix, laid out as ``update`` is (this rank's slice of it)."""
        if not isinstance(update, DTensor):
            return orthogonalise(update, steps, dtype)
        with count_collectives(self.counts, "muon_"):
            whole = update.full_tensor()  # the same whole matrix on every rank of its mesh
        # every rank computed the same whole result: each keeps its slice, no communication (src_data_rank=None)
        return distribute_tensor(orthogonalise(whole, steps, dtype), update.device_mesh, update.placements,
                                 src_data_rank=None)


def _cut(update: DTensor) -> tuple:
    """(the mesh dimension that cuts ``update``, the tensor dimension it cuts): one Shard placement."""
    mesh = update.device_mesh  # a dimension of one rank cuts nothing (tp's data-parallel dimension of 1)
    cuts = [(i, placement.dim) for i, placement in enumerate(update.placements)
            if placement.is_shard() and mesh.size(i) > 1]
    if len(cuts) != 1:
        raise ValueError(f"optim.muon.dist=owner: a matrix cut over {len(cuts)} mesh dimensions "
                         f"({update.placements}); use optim.muon.dist=gather")
    return cuts[0]


def owner_orthogonalise(updates: List[torch.Tensor], steps: int, dtype: torch.dtype,
                        counts: Dict[str, int]) -> List[torch.Tensor]:
    """``optim.muon.dist=owner``: each cut matrix gathered on one rank of its group (matrix i on rank i mod the
    group's size), orthogonalised there, its result scattered back as slices; a whole matrix orthogonalised
    where it is. Every rank orthogonalises a group-size-th of the cut matrices instead of all of them, for the
    same bytes (a gather and a scatter of the padded matrix, against one all-gather)."""
    results: List[Optional[torch.Tensor]] = [None] * len(updates)
    owned: Dict[int, tuple] = {}  # index -> (the group, the dimension, the gathered padded slices)
    for i, update in enumerate(updates):
        if not isinstance(update, DTensor):
            results[i] = orthogonalise(update, steps, dtype)
            continue
        mesh_dim, dim = _cut(update)
        group = update.device_mesh.get_group(mesh_dim)
        size, me = dist.get_world_size(group), dist.get_rank(group)
        owner = i % size
        mine = _padded(update.to_local(), dim, -(-update.shape[dim] // size))
        pieces = [torch.empty_like(mine) for _ in range(size)] if me == owner else None
        dist.gather(mine, pieces, group_dst=owner, group=group)
        _count(counts, "gather", mine.numel() * mine.element_size() * size)
        owned[i] = (group, dim, size, me == owner, pieces, mine)
    for i, (group, dim, size, is_owner, pieces, mine) in owned.items():  # each rank its own matrices' iterations
        if is_owner:
            whole = torch.cat(pieces, dim=dim).narrow(dim, 0, updates[i].shape[dim])
            pieces = list(_padded(orthogonalise(whole, steps, dtype), dim, mine.shape[dim] * size)
                          .split(mine.shape[dim], dim=dim))
        piece = torch.empty_like(mine)
        dist.scatter(piece, [t.contiguous() for t in pieces] if is_owner else None, group_src=i % size, group=group)
        _count(counts, "scatter", mine.numel() * mine.element_size() * size)
        local = piece.narrow(dim, 0, updates[i].to_local().shape[dim])  # this rank's rows (or columns), unpadded
        results[i] = DTensor.from_local(local, updates[i].device_mesh, updates[i].placements,
                                        shape=updates[i].shape, stride=updates[i].stride())
    return results


def _padded(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``length`` (the group's equal slices: the last rank's may be short)."""
    pad = length - t.shape[dim]
    if pad == 0:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _count(counts: Dict[str, int], kind: str, nbytes: int) -> None:
    counts[f"muon_{kind}s"] += 1
    counts[f"muon_{kind}_bytes"] += nbytes
