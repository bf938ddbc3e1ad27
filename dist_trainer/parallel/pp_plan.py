"""Pipeline parallelism's plan part: what each stage group holds (its stages, their blocks and FSDP units, its
MoE layers and expert slices, the modules whose collectives it issues), the sends and receives of activations
and their gradients, the tied weight's all-reduce between the first and last stage groups, what a group holds
unsharded at the step's peak under its schedule, ``pp_bubble`` and ``pp_stage_groups``, and the printed lines.

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

from ..config import BatchPlan, Config, mib_text, pp_v_shape
from ..fp8 import gathered_in_float8
from ..moe import routing_of
from ..moe.ep import expert_params, moe_layers
from ..precision import Precision
from .blocks import find_blocks
from .cp_plan import rank_tokens
from .dp_plan import shard_elements, unit_bytes
from .pp import (check_stage_api, cut_stages, held_along, pp_bubble, pp_inflight, schedule_orders,
                 stage_indices)
from .tp import local_shapes, resolve_plan

PP_COMM_KEYS = ("p2p_sends", "p2p_send_bytes", "p2p_recvs", "p2p_recv_bytes")


def pp_stage_groups(cfg: Config, model: nn.Module) -> List[Dict[str, Any]]:
    """Per stage group (pp rank): its stages, their blocks, and the parameters of each FSDP unit it holds
    (each held block's, then each stage's root: the first stage's embedding, the last's norm and head, a tied
    weight copied into the last), with the keys ``plan.stage_groups`` describes."""
    pp, per_rank = cfg.dist.pp.size, cfg.dist.pp.stages_per_rank
    check_stage_api(model, pp)  # plan mode fails as training would
    blocks = find_blocks(model, cfg.dist.blocks)
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    stages = pp * per_rank
    cuts = cut_stages(block_names, stages, cfg.dist.pp.split, f"dist.pp.size={pp} x dist.pp.stages_per_rank={per_rank}")
    groups = []
    # Expert slices (dist.ep.size): never FSDP's, so in no unit; each group's own, and its MoE layers.
    experts = {id(p) for p in expert_params(model)} if cfg.dist.ep.size > 1 else set()
    for r in range(pp):
        held = stage_indices(r, pp, per_rank, pp_v_shape(cfg.dist.pp))
        own = [blocks[i] for s in held for i in cuts[s]]
        units = [[p for p in block.parameters() if id(p) not in experts] for block in own]
        unit_stages = [s for s in held for _ in cuts[s]]
        first, last = 0 in held, stages - 1 in held
        for s in held:
            roots = (list(model.pp_first) if s == 0 else []) + (list(model.pp_last) if s == stages - 1 else [])
            units.append([p for n in roots for p in model.get_submodule(n).parameters()])
            unit_stages.append(s)
        own_names = [block_names[i] for s in held for i in cuts[s]]
        roots = own_names + (list(model.pp_first) if first else []) + (list(model.pp_last) if last else [])
        # a weight tied across the first and last stages is two tensors where one group holds both (the V's 0)
        trained = [p for unit in units for p in unit if p.requires_grad]
        groups.append({"stages": held, "blocks": [[block_names[i] for i in cuts[s]] for s in held],
                       "units": units, "unit_stages": unit_stages, "first": first, "last": last,
                       "moe": [m for b in own for m in moe_layers(b)],
                       "experts": [p for b in own for p in b.parameters() if id(p) in experts],
                       "modules": lambda name, roots=roots: any(name == r or name.startswith(r + ".") for r in roots),
                       "attention": [m for m in model.context_modules()
                                     if any(names[id(m)].startswith(b + ".") for b in own_names)]
                       if hasattr(model, "context_modules") else None,
                       "trained": trained, "staged": trained, "buffer_bytes": 0,
                       "holds": [p for unit in units for p in unit]})
    return groups


def tied_across(model: nn.Module) -> List[torch.Tensor]:
    """Parameters shared between the model's first-stage and last-stage modules (the GPT's embedding and head)."""
    first = {id(p) for n in model.pp_first for p in model.get_submodule(n).parameters()}
    return [p for n in model.pp_last for p in model.get_submodule(n).parameters() if id(p) in first]


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """Stage group ``group``'s tied weight all-reduce (the first stage on this group, the last on another; not
    the V placement's 0, which holds both), and its sends and receives."""
    if plan.mesh.pp == 1:
        return
    counts.update({key: counts.get(key, 0) for key in PP_COMM_KEYS})
    if group["first"] != group["last"]:
        cut = local_shapes(model, cfg.dist.tp)
        for p in tied_across(model):
            counts["allreduces"] += 1
            counts["allreduce_bytes"] += shard_elements(p, plan.mesh.shard, cut.get(id(p))) * 4
    add_p2p(cfg, plan, model, precision, group, counts)


def add_p2p(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any],
            counts: Dict[str, int]) -> None:
    """The sends and receives of activations and their gradients between stage group ``g``'s stages and the
    others'. The stages' fixed shape: micro-batch rows x the model's block_size (shorter sequences padded to
    it); under sequence parallelism a rank sends its sequence shard."""
    mesh, accum = plan.mesh, plan.accum_steps
    stages = mesh.pp * cfg.dist.pp.stages_per_rank
    stream = (precision.param_dtype or torch.float32).itemsize
    shards = mesh.tp if mesh.tp > 1 and cfg.dist.tp.sequence_parallel else 1
    activation = rank_tokens(cfg, plan, model) // shards * model.stage_dims()[0] * stream
    # The MoE counting pass (the global aux term's): every micro-batch forward through the stages first, its
    # activations sent on as in the step's forward.
    forwards = 2 if routing_of(model).needs_prepass(accum, plan.data_ranks) else 1
    for s in g["stages"]:
        # A neighbour stage on this rank (the V's turn) takes the tensor without a send.
        apart = lambda t, held=g["stages"]: 0 <= t < stages and t not in held  # noqa: E731
        for kind, exists in (("send", apart(s + 1)), ("recv", apart(s - 1))):  # forward: the activation
            if exists:
                counts[f"p2p_{kind}s"] += forwards * accum
                counts[f"p2p_{kind}_bytes"] += forwards * accum * activation
        for kind, exists in (("send", apart(s - 1)), ("recv", apart(s + 1))):  # backward: its gradient
            if exists:
                counts[f"p2p_{kind}s"] += accum
                counts[f"p2p_{kind}_bytes"] += accum * activation


def pp_peak_extra_bytes(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any],
                        r: int) -> int:
    """What stage group ``g`` (pp rank ``r``) holds unsharded at the step's peak: every unit stays gathered (a
    shard group of one rank too: FSDP2 still unshards into its own buffer) and keeps its unsharded gradient from
    its first backward to the step's reduction; under zero_bubble a stage is reduced and resharded in the step,
    after its last backward."""
    mesh, accum, pp = plan.mesh, plan.accum_steps, cfg.dist.pp
    S = mesh.shard
    cut, float8 = local_shapes(model, cfg.dist.tp), gathered_in_float8(model, cfg.precision)
    # A row-wise Embedding's gradient is made by torch's masked embedding backward over the whole vocabulary: its
    # tp shard is a view of a whole-sized tensor, which is what the rank holds until the step's reduction.
    rowwise_embeddings = {id(model.get_submodule(name).weight) for name, style in
                          (resolve_plan(model, cfg.dist.tp).items() if mesh.tp > 1 else ())
                          if style == "rowwise" and isinstance(model.get_submodule(name), nn.Embedding)}
    grad_cut = {k: v for k, v in cut.items() if k not in rowwise_embeddings}
    stage_gathered, stage_grads = dict.fromkeys(g["stages"], 0), dict.fromkeys(g["stages"], 0)
    for unit, s in zip(g["units"], g["unit_stages"]):
        stage_gathered[s] += S * unit_bytes(unit, S, precision, cut, float8)[0]
        stage_grads[s] += S * unit_bytes(unit, S, precision, grad_cut)[1]  # what the rank holds, not what it reduces
    if pp.schedule != "zero_bubble":
        return sum(stage_gathered.values()) + (sum(stage_grads.values()) if accum > 1 else 0)
    orders = schedule_orders(pp.schedule, mesh.pp, pp.stages_per_rank, accum)
    # In master modes a weight pass's gradients are in the parameters' dtype until FSDP folds them into its FP32
    # accumulation; otherwise one tensor holds them.
    half = (precision.param_dtype.itemsize / 4 if precision.param_dtype is not None
            and precision.param_dtype.itemsize != 4 else None)
    size = {"full": 1.0, "half": half or 1.0, "both": 1.0 + half if half else 1.0}
    return max(sum(stage_gathered[s] for s in gathered) +
               int(sum(stage_grads[s] * size[form] for s, form in forms.items()))
               for gathered, forms in held_along(orders[r]))


def pp_numbers(cfg: Config, plan: BatchPlan, parts: List[Dict[str, Any]], groups: List[Dict[str, Any]]
               ) -> Dict[str, Any]:
    """Under pipeline stages: the schedule's predicted idle fraction, and each stage group's stages, blocks,
    collectives, state and micro-batches in flight (``parts``: ``pp_stage_groups``; ``groups``: their numbers)."""
    pp = cfg.dist.pp
    inflight = pp_inflight(pp.schedule, plan.mesh.pp, pp.stages_per_rank, plan.accum_steps)
    return {"pp_bubble": pp_bubble(pp.schedule, plan.mesh.pp, pp.stages_per_rank, plan.accum_steps),
            "pp_stage_groups": [{"stages": g["stages"], "blocks": g["blocks"], "first": g["first"], "last": g["last"],
                                 "step": n["step"], "state_mb": n["state_mb"], "inflight": inflight[r],
                                 "muon_ns_flops": n["muon_ns_flops"], "step_peak_state_mb": n["step_peak_state_mb"],
                                 "ckpt_staging_mb": n["ckpt_staging_mb"], "load_host_peak_mb": n["load_host_peak_mb"],
                                 "frozen_mb": n["frozen_mb"]}
                                for r, (g, n) in enumerate(zip(parts, groups))]}


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    if plan.mesh.pp == 1:
        return
    dims.update({"p2p_sends": "pp", "p2p_recvs": "pp"})
    if tied_across(model):
        dims["allreduces"] = dims.get("allreduces", "replicate") + "; the tied weight's: first and last stage groups"


def pp_lines(numbers: Dict[str, Any]) -> List[str]:
    """Under pipeline stages: each stage group's blocks, sends and receives, and the schedule's bubble."""
    if numbers["mesh"].get("pp", 1) == 1:
        return []
    lines = [f"  pipeline: {numbers['mesh']['pp']} stage groups, dist.pp.schedule={numbers['dist.pp.schedule']} "
             f"x {numbers['dist.pp.stages_per_rank']} stages a rank; predicted idle fraction (pp_bubble) "
             f"{numbers['pp_bubble']:.3f} (the collectives above are stage group 0's)"]
    for r, g in enumerate(numbers["pp_stage_groups"]):
        step = g["step"]
        lines.append(f"    stage group {r}: stages {g['stages']} (blocks {sum(len(b) for b in g['blocks'])}); sends "
                     f"{step['p2p_sends']}, {mib_text(step['p2p_send_bytes'])}; receives {step['p2p_recvs']}, "
                     f"{mib_text(step['p2p_recv_bytes'])}; state {g['state_mb']:.2f} MiB; activations of "
                     f"{g['inflight']} micro-batches held at once")
    return lines

