"""The optimizers' plan part: the state each keeps per tensor (AdamW's moments in fp32, bf16 or int8, SGD's
momentum, Adafactor's factors, Muon's momentum), Muon's gathers of whole matrices and its Newton-Schulz work,
and the printed optimizer line.

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

import math
from typing import Any, Collection, Dict, List, Optional

import torch
from torch import nn

from ..config import BatchPlan, Config, MeshShape, mib_text
from ..parallel.tp import local_shapes


def optimizer_state_bytes(cfg: Config, sizes: List[int], muon: List[bool],
                           shapes: Optional[List[torch.Size]] = None) -> int:
    """Bytes of optimizer state for tensors of ``sizes`` elements each on a rank; ``muon``: which Muon steps;
    ``shapes``: the tensors' whole shapes (Adafactor's factors)."""
    o = cfg.optim
    if o.name == "sgd":
        return 4 * sum(sizes) if o.momentum > 0 else 0  # SGD's momentum buffer
    if o.name == "adafactor":  # a matrix's row and column means (of its last two dimensions), a vector's variance
        return 4 * sum((math.prod(s[:-2]) * (s[-2] + s[-1]) if len(s) >= 2 else n) + 1 for n, s in zip(sizes, shapes))
    # AdamW: exp_avg, exp_avg_sq and one FP32 scalar step a tensor; Muon (optim.name=muon): its momentum and step
    moment = {"fp32": lambda n: 4 * n, "bf16": lambda n: 2 * n, "int8": int8_moment_bytes}[o.state_dtype]
    return sum(4 * n + 4 if m else 2 * moment(n) + 4 for n, m in zip(sizes, muon))


def int8_moment_bytes(n: int) -> int:
    """torchao's 8-bit moment of ``n`` elements (on a rank): a byte an element, an FP32 scale a block of 256 and
    its 256-entry FP32 table, where the tensor has 4096 elements or more in whole blocks; FP32 otherwise."""
    from .lowmem import INT8_BLOCK, INT8_MIN_ELEMENTS

    if n >= INT8_MIN_ELEMENTS and n % INT8_BLOCK == 0:
        return n + 4 * (n // INT8_BLOCK) + 4 * 256
    return 4 * n


def muon_ids(cfg: Config, model: nn.Module) -> set:
    """id() of the parameters Muon steps (optim.name=muon; none otherwise)."""
    if cfg.optim.name != "muon":
        return set()
    from . import muon_split

    return {id(p) for _, p in muon_split(list(model.named_parameters()), cfg.optim)[0]}


def muon_comm(cfg: Config, mesh: MeshShape, model: nn.Module, held: Optional[Collection[int]] = None
              ) -> Dict[str, int]:
    """Muon's gathers in one step (optim.name=muon; none otherwise): each of its matrices that a rank holds a
    slice of is all-gathered whole once per cut mesh dimension, the tp cut first, then FSDP's rows (bytes: the
    gathered tensor, FP32, padded as the cut pads). ``held``: id() of the parameters this rank steps (all)."""
    from .muon import COMM_KEYS

    if cfg.optim.name != "muon":
        return {}
    counts = dict.fromkeys(COMM_KEYS, 0)
    cut, muon = local_shapes(model, cfg.dist.tp), muon_ids(cfg, model)
    shards = mesh.shard  # 1 under ddp, which shards nothing
    # gather: an all-gather of each cut; owner: a gather to the owner and a scatter back, of the same bytes
    kinds = ("gather", "scatter") if cfg.optim.muon.dist == "owner" else ("all_gather",)

    def add(nbytes: int) -> None:
        for kind in kinds:
            counts[f"muon_{kind}s"] += 1
            counts[f"muon_{kind}_bytes"] += nbytes

    for p in model.parameters():
        if id(p) not in muon or (held is not None and id(p) not in held):
            continue
        rows, cols = p.shape
        if id(p) in cut:  # tp's gather of the cut dimension, padded to a multiple of tp (of FSDP's rows, if cut)
            local_rows, local_cols = cut[id(p)]
            rows, cols = (local_rows * mesh.tp, cols) if local_rows != rows else (rows, local_cols * mesh.tp)
            add(4 * -(-rows // shards) * cols)
        if shards > 1:  # FSDP's rows, padded to a multiple of the shard group
            add(4 * -(-rows // shards) * shards * cols)
    return counts


def muon_ns_flops(cfg: Config, mesh: MeshShape, model: nn.Module,
                  held: Optional[Collection[int]] = None) -> Optional[int]:
    """The Newton-Schulz FLOPs of one step on the busiest rank (optim.name=muon; None otherwise): per matrix of
    sides a <= b, each iteration's three products (the Gram matrix 2a^2 b, its square 2a^3, the update 2a^2 b).
    gather: every rank orthogonalises every matrix; owner: a cut matrix on its owner only (the i-th on rank i mod
    the cut group's size), a whole one where it is. ``held``: id() of the parameters this rank steps (all)."""
    if cfg.optim.name != "muon":
        return None
    muon = {i for i in muon_ids(cfg, model) if held is None or i in held}
    sizes = [sorted(p.shape) for p in model.parameters() if id(p) in muon]
    flops = [cfg.optim.muon.ns_steps * (4 * a * a * b + 2 * a ** 3) for a, b in sizes]
    group = mesh.tp if mesh.tp > 1 else mesh.shard  # shard 1 under ddp
    if cfg.optim.muon.dist != "owner" or group == 1:
        return sum(flops)
    return max(sum(f for i, f in enumerate(flops) if i % group == r) for r in range(group))


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Any, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """Muon's gathers of the matrices stage group ``group`` steps."""
    counts.update(muon_comm(cfg, plan.mesh, model, {id(p) for p in group["trained"]}))


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    """Muon's whole matrices, gathered over the dimensions that cut them."""
    mesh = plan.mesh
    if muon_ids(cfg, model):
        over = "tp, then shard" if mesh.tp > 1 else "shard"
        for kind in ("gathers", "scatters") if cfg.optim.muon.dist == "owner" else ("all_gathers",):
            dims[f"muon_{kind}"] = over


def muon_lines(cfg: Config, numbers: Dict[str, Any], model: nn.Module) -> List[str]:
    """The optimizer's line (where it is not plain AdamW or SGD): what Muon steps, its gathers and its work."""
    from . import optimizer_line

    line = optimizer_line(list(model.named_parameters()), cfg.optim)
    if not line:
        return []
    step = numbers["step"] or (numbers.get("pp_stage_groups") or [{}])[0].get("step") or {}
    owner = cfg.optim.muon.dist == "owner"
    key = "muon_gathers" if owner else "muon_all_gathers"
    over = numbers["comm_dims"].get(key, "no cut dimension")
    gathers = ("" if step.get(key) is None else
               f"; {step[key]} {'gathers to an owner and scatters back' if owner else 'all-gathers'} of whole "
               f"matrices per optimizer step ({mib_text(step[key[:-1] + '_bytes'])} each way, {key} over {over})")
    flops = numbers.get("muon_ns_flops")
    iterations = "" if flops is None else \
        f"; Newton-Schulz {flops / 1e9:.3f} GFLOP a step on the busiest rank (muon_ns_flops)"
    return [f"  optimizer: {line}{gathers}{iterations}"]

