"""float8's plan part: the amax all-reduces of float8 casts over a tp-cut dimension, the float8 all-gather's
scale all-reduces, the mesh dimensions and the printed lines (what converts; FSDP's gathers with and without
the float8 all-gather).

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Collection, Dict, List, Optional

from torch import nn

from .config import BatchPlan, Config, master_mode, mib_text
from .fp8 import RECIPES, gathered_in_float8
from .parallel.blocks import find_blocks
from .parallel.cp_plan import rank_tokens
from .parallel.dp_plan import sharded_by_fsdp
from .parallel.tp import FP8_AMAX_KEYS, local_shapes, resolve_plan
from .precision import Precision


def fp8_amax_comm(cfg: Config, plan: BatchPlan, model: nn.Module, tokens: int,
                  held: Optional[Callable[[str], bool]] = None) -> Dict[str, int]:
    """float8 linears under tp: the amax all-reduces of their casts over a cut dimension in one full step
    (fp8.tp_amax_allreduces, each micro-batch's; a checkpointed block's forward casts again in backward).
    ``held``: the modules that count (a stage group's). None without float8 or tp."""
    from .fp8 import float8_linears, tp_amax_allreduces

    if plan.mesh.tp == 1 or cfg.precision.name not in RECIPES or cfg.precision.name == "fp8-mxfp8":
        return {}  # MXFP8's scales are its blocks', each within one rank's slice: no amax crosses a cut
    styles = resolve_plan(model, cfg.dist.tp)
    blocks = find_blocks(model, cfg.dist.blocks) if cfg.dist.activation_checkpointing else []
    names = {id(m): name for name, m in model.named_modules()}
    checkpointed = [names[id(b)] for b in blocks]
    counts = dict.fromkeys(FP8_AMAX_KEYS, 0)
    for name, linear in float8_linears(model, cfg.precision).items():
        if held is not None and not held(name):
            continue
        again = any(name.startswith(b + ".") for b in checkpointed)
        for nbytes, forward in tp_amax_allreduces(linear, cfg.precision.name, styles.get(name, ""), tokens,
                                                  cfg.precision.fp8.all_gather):
            times = plan.accum_steps * (2 if forward and again else 1)
            counts[FP8_AMAX_KEYS[0]] += times
            counts[FP8_AMAX_KEYS[1]] += times * nbytes
    return counts


def fp8_scale_comm(model: nn.Module, cfg: Config, held: Optional[Collection[int]] = None) -> Dict[str, int]:
    """The float8 all-gather's scales, agreed after each update (fp8.ScaleSync): the float32 amaxes of the
    float8 weights of one mesh in one stack, all-reduced once over each mesh dimension that shards them: fsdp's
    shard group, and under tp the tp-cut weights' tp group too (those the tp plan leaves whole are a stack of
    their own, on fsdp's mesh alone). ``held``: id() of the weights this rank holds (default all). None without
    the float8 all-gather."""
    float8 = [i for i in gathered_in_float8(model, cfg.precision) if held is None or i in held]
    cut = local_shapes(model, cfg.dist.tp)
    counts = dict.fromkeys(("fp8_scale_allreduces", "fp8_scale_allreduce_bytes"), 0)
    for group, dims in (([i for i in float8 if i in cut], 2), ([i for i in float8 if i not in cut], 1)):
        if group:
            counts["fp8_scale_allreduces"] += dims
            counts["fp8_scale_allreduce_bytes"] += dims * 4 * len(group)
    return counts if float8 else {}


def add_amax_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
                  counts: Dict[str, int]) -> None:
    """The amax all-reduces of the float8 linears stage group ``group`` holds, under tp (of a micro-batch's
    tokens on a rank: under cp its share of each sequence)."""
    if plan.mesh.tp > 1:
        counts.update(fp8_amax_comm(cfg, plan, model, rank_tokens(cfg, plan, model), group["modules"]))


def add_scale_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
                   counts: Dict[str, int]) -> None:
    """The float8 all-gather's scale all-reduces, of the float8 weights stage group ``group`` holds."""
    counts.update(fp8_scale_comm(model, cfg, {id(p) for p in group["holds"]}))


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    if gathered_in_float8(model, cfg.precision):  # the float8 all-gather's amaxes, over each shard group
        dims["fp8_scale_allreduces"] = "shard, then tp (the tp-cut weights')" if plan.mesh.tp > 1 else "shard"


def fp8_lines(cfg: Config, plan: BatchPlan, numbers: Dict[str, Any], model: nn.Module,
              plan_numbers: Callable[[Config, BatchPlan], Dict[str, Any]]) -> List[str]:
    """What converts to float8 and what stays; under FSDP with fp8-tensorwise, FSDP's gathers with and without
    the float8 all-gather (``plan_numbers``: plan mode's, for the other setting)."""
    from .fp8 import describe

    if cfg.precision.name not in RECIPES:
        return []
    lines = [f"  precision {describe(model, cfg.precision.fp8, cfg.precision.name)}; the rest in "
             f"{cfg.precision.fp8.compute}" + (" with FP32 masters" if master_mode(cfg.precision) else "")]
    step = numbers["step"] or (numbers.get("pp_stage_groups") or [{}])[0].get("step")
    if cfg.precision.name == "fp8-tensorwise" and sharded_by_fsdp(cfg) and step:  # with the float8 all-gather, without
        other = replace(cfg, precision=replace(cfg.precision, fp8=replace(cfg.precision.fp8,
                                                                            all_gather=not cfg.precision.fp8.all_gather)))
        on, off = (numbers, plan_numbers(other, plan))[::1 if cfg.precision.fp8.all_gather else -1]
        steps = [n["step"] or n["pp_stage_groups"][0]["step"] for n in (on, off)]
        # FSDP's own: the totals less tp's activation all-gathers (the same with and without)
        gathered = [s["all_gather_bytes"] - s.get("tp_all_gather_bytes", 0) for s in steps]
        scales = steps[0].get("fp8_scale_allreduces", 0)
        lines.append(f"  FSDP's all-gathers per optimizer step: {mib_text(gathered[0])} with the float8 all-gather, "
                     f"{mib_text(gathered[1])} without (precision.fp8.all_gather={str(cfg.precision.fp8.all_gather).lower()})"
                     + (f"; plus the float8 weights' amaxes, {scales} all-reduce{'s' if scales != 1 else ''} a step "
                        "(fp8_scale_allreduces)" if cfg.precision.fp8.all_gather else ""))
    return lines

