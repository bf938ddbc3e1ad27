"""task=dpo's plan numbers (no tensor, no process group): what its objective adds to a step's collectives."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from torch import nn

from ..config import BatchPlan, Config
from ..parallel import dp_plan
from ..parallel.tp import local_shapes
from ..precision import Precision
from .checks import reference_kind
from .dpo import objective_of


def reference_bytes(cfg: Config, holds: List[nn.Parameter], shard: int, cut: Dict[int, torch.Size]) -> int:
    """What a rank holds of a reference copy (rl.reference=copy) of the parameters ``holds``: FP32 shards where
    FSDP shards the policy, else whole in their dtype (a deep copy of the policy as prepared)."""
    if cfg.task != "dpo" or reference_kind(cfg) != "copy":
        return 0
    unique = {id(p): p for p in holds}.values()
    if dp_plan.sharded_by_fsdp(cfg):
        return 4 * sum(dp_plan.shard_elements(p, shard, cut.get(id(p))) for p in unique)
    return sum(p.numel() * p.element_size() for p in unique)


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """The objective's figures ride the step's all-reduce (float64 slots). A reference copy under fsdp gathers each
    of its units once a micro-batch (nothing ahead, resharded after its forward). A reference that is the policy itself
    (rl.reference=adapter) runs its blocks once more per micro-batch, without gradients: under fsdp with
    dist.fsdp.reshard=micro_batch each block is gathered again for it (the root, gathered for the whole forward,
    is not), and with dist.fsdp.prefetch > 0 one block more is gathered ahead for each reference pass (under
    reshard=step once a step), whatever the reshard (measured: 2 and 3 blocks, prefetch 0 and 1, each reshard)."""
    objective = objective_of(model)
    counts["step_allreduce_bytes"] += objective.slots() * 8
    if getattr(objective, "sft_weight", 0):  # the step's pairs and chosen tokens, before its first backward
        counts["step_allreduces"] += 1
        counts["step_allreduce_bytes"] += 16
    passes = objective.reference_passes
    if not dp_plan.sharded_by_fsdp(cfg):
        return
    cut = local_shapes(model, cfg.dist.tp)
    if reference_kind(cfg) == "copy" and cfg.task == "dpo":  # its own units, each gathered once a forward
        for unit in group["units"]:
            dp_plan.add_unit_comm(counts, plan.mesh, dp_plan.unit_bytes(unit, plan.mesh.shard, precision, cut)[0], 0,
                                  plan.accum_steps, 0)
    if not passes:
        return
    blocks = [dp_plan.unit_bytes(unit, plan.mesh.shard, precision, cut)[0] for unit in group["units"][:-1]]
    again = passes * plan.accum_steps
    if cfg.dist.fsdp.reshard == "micro_batch":
        for gathered in blocks:
            dp_plan.add_unit_comm(counts, plan.mesh, gathered, 0, again, 0)
    if cfg.dist.fsdp.prefetch > 0 and blocks:  # reshard=step gathers the blocks once a step: once
        dp_plan.add_unit_comm(counts, plan.mesh, blocks[0], 0, passes if cfg.dist.fsdp.reshard == "step" else again,
                              0)


REFERENCE_TEXT = {"adapter": "the policy with its LoRA adapters disabled, no second copy",
                  "copy": "a frozen copy of the model as built", "precomputed": "log-probabilities read from the data cache",
                  "none": "none: log-probabilities of 0"}


def rl_lines(cfg: Config, numbers: Dict[str, Any], model: nn.Module) -> List[str]:
    """Plan mode's lines of task=dpo: the reference, what it adds to the step's collectives and to memory."""
    if cfg.task != "dpo":
        return []
    objective, kind = objective_of(model), reference_kind(cfg)
    extra = ("; with rl.dpo.sft_weight 1 all-reduce more, of 16 bytes (the step's pairs and chosen tokens)"
             if getattr(objective, "sft_weight", 0) else "")
    lines = [f"  task=dpo, rl.dpo.loss={cfg.rl.dpo.loss}: the mean over the step's pairs; rl.reference={kind} "
             f"({REFERENCE_TEXT[kind]}); its figures add {objective.slots()} float64 slots to the step's "
             f"all-reduce{extra}"]
    if kind == "copy":
        lines.append(f"  the reference copy and any frozen base held per rank: {numbers['frozen_mb']:.2f} MiB "
                     "(frozen_mb)")
    return lines
