"""task=dpo's and task=grpo's plan numbers (no tensor, no process group): what the objective adds to a step's
collectives."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from torch import nn

from ..config import BatchPlan, Config
from ..parallel import dp_plan
from ..parallel.tp import local_shapes
from ..precision import Precision
from .checks import reference_kind
from .dpo import objective_of


def holds_copy(cfg: Config) -> bool:
    """A frozen copy of the model is held and run: task=dpo with rl.reference=copy, or task=grpo's KL term."""
    return reference_kind(cfg) == "copy" and (cfg.task == "dpo" or (cfg.task == "grpo" and bool(cfg.rl.kl.coef)))


def reference_bytes(cfg: Config, holds: List[nn.Parameter], shard: int, cut: Dict[int, torch.Size]) -> int:
    """What a rank holds of a reference copy (rl.reference=copy) of the parameters ``holds``: FP32 shards where
    FSDP shards the policy, else whole in their dtype (a deep copy of the policy as prepared)."""
    if not holds_copy(cfg):
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
    dist.fsdp.reshard=micro_batch each unit but the root is gathered again for it (the root, gathered for the
    whole forward, is not). Nothing more: the first block gathers none ahead in its backward
    (fsdp.set_prefetch), where FSDP2's own choice was the block after it in its record of both forwards, one
    gather more per reference pass."""
    objective = objective_of(model)
    counts["step_allreduce_bytes"] += objective.slots() * 8
    if cfg.task == "grpo":
        add_rollouts(cfg, plan, precision, group, counts)
    if getattr(objective, "sft_weight", 0):  # the step's pairs and chosen tokens, before its first backward
        counts["step_allreduces"] += 1
        counts["step_allreduce_bytes"] += 16
    passes = objective.reference_passes
    if not dp_plan.sharded_by_fsdp(cfg):
        return
    cut = local_shapes(model, cfg.dist.tp)
    # a frozen copy's own units, each gathered once a forward (task=grpo runs it only for its KL term)
    if holds_copy(cfg):
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


def sampling_passes(cfg: Config, plan: BatchPlan) -> int:
    """task=grpo: the forward passes a rank's sampling runs in a step where every rank runs alike many (a forward
    is a collective): as many groups as the rank with the most, rl.rollout.max_new_tokens passes each."""
    return -(-cfg.rl.prompts_per_step // plan.mesh.world_size) * cfg.rl.rollout.max_new_tokens


def add_rollouts(cfg: Config, plan: BatchPlan, precision: Precision, group: Dict[str, Any],
                 counts: Dict[str, int]) -> None:
    """A step's own: one all-reduce of the ratio's extremes over ranks; and the sampling's (``sampling_comm``: a
    step that samples). A reference copy's gathers are add_step's, as DPO's."""
    if plan.mesh.world_size > 1:
        counts["rl_allreduces"] = counts.get("rl_allreduces", 0) + 1
    for key, value in sampling_comm(cfg, plan, precision, group).items():
        counts[key] = counts.get(key, 0) + value


def sampling_comm(cfg: Config, plan: BatchPlan, precision: Precision, group: Dict[str, Any]) -> Dict[str, int]:
    """What a step that samples its rollouts adds: the gathers of objects over ranks (the step's prompts; the
    completions and rewards; with rl.inner_steps > 1 the completions' log-probabilities, after the step); under
    fsdp each sampling pass gathers every unit once (none ahead: no gradient, each resharded after its forward)."""
    counts: Dict[str, int] = {"all_gathers": 0, "all_gather_bytes": 0, "reduce_scatters": 0,
                              "reduce_scatter_bytes": 0, "allreduces": 0, "allreduce_bytes": 0}
    if plan.mesh.world_size > 1:
        counts["rl_object_gathers"] = 2 + (cfg.rl.inner_steps > 1)
    if dp_plan.sharded_by_fsdp(cfg):
        for unit in group["units"]:
            gathered = dp_plan.unit_bytes(unit, plan.mesh.shard, precision, {})[0]
            dp_plan.add_unit_comm(counts, plan.mesh, gathered, 0, sampling_passes(cfg, plan), 0)
    return {k: v for k, v in counts.items() if v}


def rl_numbers(cfg: Config, plan: BatchPlan, model: nn.Module, group: Dict[str, Any],
               step: Optional[Dict[str, int]]) -> Dict[str, Any]:
    """plan.json's ``inner_step`` (task=grpo with rl.inner_steps > 1): a step that trains its rollout again issues
    ``step``'s collectives less the sampling's."""
    if cfg.task != "grpo" or cfg.rl.inner_steps == 1 or step is None:
        return {}
    precision = Precision(cfg.precision, torch.device("cpu"))
    sampling = sampling_comm(cfg, plan, precision, group)
    return {"inner_step": {k: v - sampling.get(k, 0) for k, v in step.items()}}


REFERENCE_TEXT = {"adapter": "the policy with its LoRA adapters disabled, no second copy",
                  "copy": "a frozen copy of the model as built", "precomputed": "log-probabilities read from the data cache",
                  "none": "none: log-probabilities of 0"}


def rl_lines(cfg: Config, numbers: Dict[str, Any], model: nn.Module) -> List[str]:
    """Plan mode's lines of task=dpo and task=grpo: the reference, what each adds to the step's collectives and to
    memory."""
    if cfg.task == "grpo":
        return grpo_lines(cfg, numbers, model)
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


def grpo_lines(cfg: Config, numbers: Dict[str, Any], model: nn.Module) -> List[str]:
    rl, objective = cfg.rl, objective_of(model)
    kind = reference_kind(cfg) if rl.kl.coef else "none"
    world = numbers["world_size"]
    lines = [f"  task=grpo: {rl.prompts_per_step} prompts x {rl.group_size} completions a step (at most "
             f"{rl.rollout.max_new_tokens} new tokens, temperature {rl.rollout.temperature:g}), rl.loss.agg="
             f"{rl.loss.agg}, rl.advantage={rl.advantage.estimator}/{rl.advantage.scale}; rl.kl.coef={rl.kl.coef:g}"
             f" (reference: {REFERENCE_TEXT[kind]}); its figures add {objective.slots()} float64 slots to the "
             "step's all-reduce"
             + (", and each step 2 gathers of objects (its prompts; completions and rewards) and 1 all-reduce of 16 "
                "bytes (the ratio's extremes) over the ranks" if world > 1 else "")]
    if dp_plan.sharded_by_fsdp(cfg):
        lines.append(f"  sampling under fsdp: every rank runs {-(-rl.prompts_per_step // world)} group(s) x "
                     f"{rl.rollout.max_new_tokens} passes a step, each gathering every unit (in all-gathers above)")
    if rl.inner_steps > 1:
        lines.append(f"  rl.inner_steps={rl.inner_steps}: a step in {rl.inner_steps} samples; the others train its "
                     "rollouts again and issue none of the sampling's collectives (plan.json: inner_step)")
    return lines
