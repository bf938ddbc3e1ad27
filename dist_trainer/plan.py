"""Plan mode: the derived numbers of a job, without training and without a process group.

``python -m dist_trainer plan.only=true plan.world_size=64`` validates the
config exactly as the trainer would for 64 ranks (an impossible split fails
the same way) and prints what one optimizer step costs: every collective, its
calls and bytes, and the model state per rank. The same numbers go to
``plan.json`` under the keys metrics.jsonl uses, and a run's full steps match
them exactly (tests hold them to it).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

import torch
from hydra.utils import instantiate
from torch import nn

from . import hostmem
from .config import BatchPlan, Config, ConfigError, MeshShape, master_mode, pp_v_shape
from .data import StepPlan, build_dataset
from .fp8 import RECIPES, gathered_in_float8
from .models.hf import TARGETS as HF_TARGETS
from .moe import routing_of
from .moe.ep import BACKWARD_ALL_TO_ALLS, FORWARD_ALL_TO_ALLS, expert_params, moe_layers
from .parallel.blocks import find_blocks
from .parallel.comm import COMM_KEYS as GRADIENT_COMM_KEYS
from .parallel.cp import attention_work, expected_cp_comm, padded_length
from .parallel.pp import held_along, pp_bubble, pp_inflight, schedule_orders
from .activations import predicted_bytes
from .parallel.tp import FP8_AMAX_KEYS, TP_COMM_KEYS, expected_tp_comm, local_shapes, norm_activation_bytes, resolve_plan
from .precision import Precision
from .trainer import STEP_FIXED_SLOTS
from .validation import validate

MIB = 2**20
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's smaller first bucket when bucket_cap_mb is left to it
DEFAULT_BUCKET_MB = 25.0
COMM_KEYS = GRADIENT_COMM_KEYS + ("step_allreduces", "step_allreduce_bytes")  # and the step's own all-reduce
PP_COMM_KEYS = ("p2p_sends", "p2p_send_bytes", "p2p_recvs", "p2p_recv_bytes")
# Which mesh dimension each kind of collective runs over (hsdp: shard groups, replicas).
COMM_DIMS = {"ddp": {"allreduces": "all ranks"},
             "fsdp": {"all_gathers": "shard", "reduce_scatters": "shard"},
             "hsdp": {"all_gathers": "shard", "reduce_scatters": "shard", "allreduces": "replicate"}}


def expected_buckets(params: List[torch.Tensor], bucket_cap_mb: float | None) -> List[tuple[torch.dtype, int]]:
    """(dtype, number of elements) of DDP's gradient buckets, as DDP fills them.

    Gradients become ready roughly in reverse order of the parameters; DDP
    fills buckets in that order, one dtype per bucket (so master modes' half
    weights and FP32 norm layers never share one), closing a bucket once its
    bytes in that dtype reach the cap (the first is capped at 1 MiB when the
    cap is DDP's default).
    """
    cap = (bucket_cap_mb or DEFAULT_BUCKET_MB) * MIB
    first_cap = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    closed: List[tuple[torch.dtype, int]] = []
    open_buckets: Dict[torch.dtype, int] = {}
    for p in reversed(params):
        filled = open_buckets.get(p.dtype, 0) + p.numel()
        if filled * p.element_size() >= (first_cap if not closed else cap):
            closed.append((p.dtype, filled))
            filled = 0
        open_buckets[p.dtype] = filled
    return closed + [(dtype, n) for dtype, n in open_buckets.items() if n > 0]


def shard_elements(p: torch.Tensor, shard: int, shape: Optional[torch.Size] = None) -> int:
    """Elements of one rank's (padded) shard: FSDP2 cuts dim 0 as torch.chunk does, rank 0's the largest.

    ``shape``: what this rank holds of ``p`` before FSDP cuts it (its tp cut; default the whole shape).
    """
    shape = p.shape if shape is None else shape
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / shard) * (math.prod(shape) // max(rows, 1))


def sharded_by_fsdp(cfg: Config) -> bool:
    """fsdp, hsdp, and ddp's replicas under tensor or pipeline parallelism (FSDP2 with shard groups of one)."""
    return cfg.dist.strategy == "fsdp" or cfg.dist.tp.size > 1 or cfg.dist.pp.size > 1


def fsdp_units(model: nn.Module, blocks: List[nn.Module], skip: Optional[set] = None) -> List[List[nn.Parameter]]:
    """The parameters of each FSDP unit: each block's, then the root's (the rest; tied ones once). ``skip``: ids
    of parameters FSDP is told to ignore (expert slices)."""
    seen: set = set(skip or ())
    units = []
    for module in [*blocks, model]:
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append(params)
    return units


def unit_bytes(unit: List[torch.Tensor], shard: int, precision: Precision,
               cut: Optional[Dict[int, torch.Size]] = None, float8: Collection[int] = ()) -> Tuple[int, int]:
    """(gathered, gradient) bytes of one rank's padded shard of one FSDP unit (``cut``: the tp shapes;
    ``float8``: id() of the weights gathered in float8, a byte an element)."""
    cut = cut or {}
    return (sum(shard_elements(p, shard, cut.get(id(p))) * (1 if id(p) in float8 else
                                                            (precision.param_dtype or p.dtype).itemsize)
                for p in unit),
            sum(shard_elements(p, shard, cut.get(id(p))) for p in unit if p.requires_grad) * 4)


def add_unit_comm(counts: Dict[str, int], mesh: MeshShape, gathered: int, grad: int, gathers: int,
                  scatters: int) -> None:
    """One FSDP unit's collectives of a step into ``counts``: ``gathers`` all-gathers and ``scatters``
    reduce-scatters over its shard group (none in a group of one rank), one all-reduce across replicas."""
    if not gathered:
        return  # a root with every parameter in blocks: FSDP has nothing to gather for it
    S = mesh.shard
    if S > 1:
        counts["all_gathers"] += gathers
        counts["all_gather_bytes"] += gathers * S * gathered
        if grad:
            counts["reduce_scatters"] += scatters
            counts["reduce_scatter_bytes"] += scatters * S * grad
    if mesh.replicate > 1 and grad:
        counts["allreduces"] += 1
        counts["allreduce_bytes"] += grad


def step_stats_bytes(world_size: int, pipeline: bool = False) -> int:
    """The step's own all-reduce: float64 loss, items, samples, stop flag, norm share, background-busy count;
    per rank a non-finite flag, its data wait and its compute time (pipeline stages: its idle and schedule
    seconds and its micro-batches in flight too)."""
    return (STEP_FIXED_SLOTS + (6 if pipeline else 3) * world_size) * 8


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


def muon_comm(cfg: Config, mesh: MeshShape, model: nn.Module, held: Optional[Collection[int]] = None
              ) -> Dict[str, int]:
    """Muon's gathers in one step (optim.name=muon; none otherwise): each of its matrices that a rank holds a
    slice of is all-gathered whole once per cut mesh dimension, the tp cut first, then FSDP's rows (bytes: the
    gathered tensor, FP32, padded as the cut pads). ``held``: id() of the parameters this rank steps (all)."""
    from .optim.muon import COMM_KEYS

    if cfg.optim.name != "muon":
        return {}
    counts = dict.fromkeys(COMM_KEYS, 0)
    cut, muon = local_shapes(model, cfg.dist.tp), muon_ids(cfg, model)
    shards = mesh.shard if sharded_by_fsdp(cfg) else 1
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
    group = mesh.tp if mesh.tp > 1 else mesh.shard if sharded_by_fsdp(cfg) else 1
    if cfg.optim.muon.dist != "owner" or group == 1:
        return sum(flops)
    return max(sum(f for i, f in enumerate(flops) if i % group == r) for r in range(group))


def _activation_size(precision: Precision) -> int:
    """Bytes of an activation element: the autocast dtype's, else the parameters'."""
    dtype = precision.autocast_dtype or precision.param_dtype or torch.float32
    return dtype.itemsize


def cp_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
            layers: Optional[List[nn.Module]] = None) -> Dict[str, int]:
    """Context parallelism's exchanges in a step (``parallel.cp.expected_cp_comm``), for micro-batches of whole
    sequences of ``data.block_size`` tokens (pipeline stages: the model's block_size); activation checkpointing's
    recomputation runs each forward again. ``layers``: the attention modules that count (a stage group's)."""
    forwards = 1 + int(cfg.dist.activation_checkpointing)
    return expected_cp_comm(layers if layers is not None else model.context_modules(), cfg.dist.cp,
                            plan.micro_batch_size, _sequence_length(cfg, plan, model), plan.accum_steps, forwards,
                            _activation_size(precision), plan.mesh.tp)


def _sequence_length(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's sequence length: the data's block_size (the model's where the data has none); under
    pipeline stages the stages' fixed shape, the model's block_size."""
    if plan.mesh.pp > 1:  # the stages' fixed shape
        return getattr(model, "block_size", None) or cfg.data.get("block_size") or 1
    return _micro_batch_tokens(cfg, plan, model) // plan.micro_batch_size


def _rank_tokens(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's tokens on a rank: under cp its share of every sequence, padded to the layout's unit."""
    mesh, length = plan.mesh, _sequence_length(cfg, plan, model)
    if mesh.cp == 1:
        return plan.micro_batch_size * length
    return plan.micro_batch_size * padded_length(length, mesh.cp, cfg.dist.cp.layout, mesh.tp) // mesh.cp


def moe_step_allreduces(plan: BatchPlan, model: nn.Module, counts: Dict[str, int]) -> Dict[str, int]:
    """MoE layers' share of the step's own all-reduces (``moe.Routing``): their expert counts by layer, the
    aux and z sums and the dropped choices by layer ride the step's all-reduce (float64, ``Routing.slots``); the counts' pass, where the global aux term needs it,
    all-reduces its counts once more."""
    routing = routing_of(model)
    if not routing.layers:
        return {}
    counted = len(routing.layers) * routing.num_experts * 8  # the counts' pass all-reduces the counts alone
    prepass = routing.needs_prepass(plan.accum_steps, plan.data_ranks)
    return {"step_allreduces": counts["step_allreduces"] + int(prepass),
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + routing.slots() * 8 + (counted if prepass else 0)}


def ep_experts(plan: BatchPlan, model: nn.Module) -> List[torch.Tensor]:
    """The parameters expert parallelism cuts (none without it)."""
    return expert_params(model) if plan.mesh.ep > 1 else []


def expert_unit_bytes(plan: BatchPlan, layers: List[nn.Module], precision: Precision) -> List[Tuple[int, int]]:
    """(gathered, gradient) bytes of one rank's padded shard of each MoE layer's experts unit (FSDP over edp, of
    the 1/ep slice), where the experts are sharded; none otherwise."""
    if not plan.mesh.shards_experts:
        return []
    mesh = plan.mesh
    return [unit_bytes(params, mesh.expert_data_ranks, precision, {id(p): _slice(p, mesh.ep) for p in params})
            for params in ([layer.experts.gate_up_proj, layer.experts.down_proj] for layer in layers)]


def expert_allreduce_bytes(experts: List[torch.Tensor], ep: int) -> int:
    """Bytes of the one all-reduce of a rank's whole expert slices' gradients over its edp ranks."""
    return sum(p.numel() // ep * p.element_size() for p in experts)


def _slice(p: torch.Tensor, ep: int) -> torch.Size:
    return torch.Size([p.shape[0] // ep, *p.shape[1:]])


def ep_forwards(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """Forward passes of each MoE layer in a step: each micro-batch's, again in the counts' pass where the
    global aux term needs it (``Routing.needs_prepass``), again in activation checkpointing's recomputation."""
    accum = plan.accum_steps
    prepass = routing_of(model).needs_prepass(accum, plan.data_ranks)
    return accum * (1 + int(prepass) + int(cfg.dist.activation_checkpointing))


def ep_all_to_all_bytes_max(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """The most ``all_to_all_bytes`` one rank's step can show. Per MoE layer and forward, for N tokens a
    micro-batch, top k, width H: the counts (E int64), the N k rows out, and back the rows its experts got,
    N k from each of the ep ranks at most; a backward the rows' gradients both ways. Activations FP32 at most."""
    tokens, ep = _micro_batch_tokens(cfg, plan, model), plan.mesh.ep
    total = 0
    for layer in moe_layers(model):
        rows = tokens * layer.top_k * layer.experts.dim * 4
        total += ep_forwards(cfg, plan, model) * (layer.num_experts * 8 + (1 + ep) * rows)
        total += plan.accum_steps * (1 + ep) * rows
    return total


def ep_all_to_all_bytes_balanced(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """``all_to_all_bytes`` of one rank's step where every expert gets its share of the rows (the balance the
    balancing terms pull towards): per MoE layer and forward the counts, the N k rows out and N k back; a backward
    the same rows' gradients both ways. FP32 rows, as the bound counts them."""
    tokens = _micro_batch_tokens(cfg, plan, model)
    total = 0
    for layer in moe_layers(model):
        rows = tokens * layer.top_k * layer.experts.dim * 4
        total += ep_forwards(cfg, plan, model) * (layer.num_experts * 8 + 2 * rows) + plan.accum_steps * 2 * rows
    return total


def stage_groups(cfg: Config, plan: BatchPlan, model: nn.Module) -> List[Dict[str, Any]]:
    """What each stage group (pp rank) holds, the one path every number is built on: its stages and their blocks,
    the parameters of each FSDP unit (``units``, the experts left out), the parameters it steps (``trained``,
    the experts left out; without stages in the model's order, DDP's buckets follow it), its expert slices and MoE layers, and the modules (``modules``: a
    predicate on names) and attention layers (``attention``) whose collectives it issues (None: the model's all).
    Without pipeline stages one group holds the whole model: each block's unit, then the root's (the rest)."""
    if plan.mesh.pp > 1:
        return pp_stage_groups(cfg, model)
    experts = ep_experts(plan, model)
    skip = {id(p) for p in experts}
    units = fsdp_units(model, find_blocks(model, cfg.dist.blocks), skip)
    return [{"stages": [0], "blocks": None, "units": units, "unit_stages": [0] * len(units), "first": True,
             "last": True, "moe": moe_layers(model), "experts": experts, "modules": None, "attention": None,
             "trained": [p for p in model.parameters() if p.requires_grad and id(p) not in skip],
             # a checkpoint copies every trainable parameter (expert slices whole) and the buffers
             "staged": [p for p in model.parameters() if p.requires_grad],
             "buffer_bytes": persistent_buffer_bytes(model), "holds": list(model.parameters())}]


def pp_stage_groups(cfg: Config, model: nn.Module) -> List[Dict[str, Any]]:
    """Per stage group (pp rank): its stages, their blocks, and the parameters of each FSDP unit it holds
    (each held block's, then each stage's root: the first stage's embedding, the last's norm and head, a tied
    weight copied into the last)."""
    from .parallel.pp import check_stage_api, cut_stages, stage_indices

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


def unit_collectives(cfg: Config, plan: BatchPlan, model: nn.Module) -> Tuple[int, int]:
    """All-gathers and reduce-scatters of each FSDP unit in a step. Pipeline stages keep a unit gathered through
    backward: one gather a forward (the MoE counts' pass adds one), one reduce-scatter. Otherwise, for K
    micro-batches: gathers 2K (reshard=micro_batch, plus K for the MoE counts' pass), K (forward) or 1 (step);
    reduce-scatters 1 (accum_sync=last) or K (every)."""
    accum = plan.accum_steps
    prepass = routing_of(model).needs_prepass(accum, plan.data_ranks)
    if plan.mesh.pp > 1:
        return 1 + int(prepass), 1
    gathers = {"micro_batch": 2 * accum, "forward": accum, "step": 1}[cfg.dist.fsdp.reshard]
    if cfg.dist.fsdp.reshard == "micro_batch" and prepass:
        gathers += accum  # a forward more per micro-batch, each unit gathered anew
    return gathers, 1 if cfg.dist.fsdp.accum_sync == "last" else accum


def group_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any]
               ) -> Dict[str, int]:
    """Calls and bytes of every collective of stage group ``g``'s full optimizer step after the first, by
    metrics key: the data-parallel gradients' (DDP's buckets, FSDP's units), expert parallelism's, the tied
    weight's between stage groups, pipeline sends and receives, tp's, cp's, the step's own all-reduce of totals
    and flags (float64), Muon's and float8's."""
    mesh, accum = plan.mesh, plan.accum_steps
    pipeline = mesh.pp > 1
    counts = dict.fromkeys(COMM_KEYS + (PP_COMM_KEYS if pipeline else ()) + (TP_COMM_KEYS if mesh.tp > 1 else ()), 0)
    cut, float8 = local_shapes(model, cfg.dist.tp), gathered_in_float8(model, cfg.precision)
    if not sharded_by_fsdp(cfg):  # one all-reduce per bucket (bytes as the hook sends them)
        sent = precision.weights_type.sent_element_size  # master modes send FP32 copies of half buckets
        buckets = expected_buckets(g["trained"], cfg.dist.bucket_cap_mb)
        counts["allreduces"] = len(buckets)
        counts["allreduce_bytes"] = sum(n * (sent or dtype.itemsize) for dtype, n in buckets)
    else:
        gathers, scatters = unit_collectives(cfg, plan, model)
        for unit in g["units"]:
            add_unit_comm(counts, mesh, *unit_bytes(unit, mesh.shard, precision, cut, float8), gathers, scatters)
        edp = replace(mesh, replicate=1, shard=mesh.expert_data_ranks)  # a 1-D mesh of the edp ranks
        for gathered, grad in expert_unit_bytes(plan, g["moe"], precision):
            add_unit_comm(counts, edp, gathered, grad, gathers, scatters)
    if mesh.ep > 1:  # the group's MoE layers' all-to-alls, and its experts' one reduction over edp
        counts["all_to_alls"] = len(g["moe"]) * (ep_forwards(cfg, plan, model) * FORWARD_ALL_TO_ALLS
                                                 + accum * BACKWARD_ALL_TO_ALLS)
        if mesh.expert_data_ranks > 1 and not mesh.shards_experts and g["experts"]:
            counts["allreduces"] += 1
            counts["allreduce_bytes"] += expert_allreduce_bytes(g["experts"], mesh.ep)
    if g["first"] != g["last"]:  # the first stage on this group, the last on another (not the V placement's 0)
        for p in _tied_across(model):
            counts["allreduces"] += 1
            counts["allreduce_bytes"] += shard_elements(p, mesh.shard, cut.get(id(p))) * 4
    if pipeline:
        add_p2p(cfg, plan, model, precision, g, counts)
    tokens = _rank_tokens(cfg, plan, model)
    if mesh.tp > 1:  # the activations' collectives of the modules the group holds, counted apart and in the totals
        for key, value in tp_comm(cfg, plan, model, precision, g["modules"], tokens).items():
            counts[key] += value
            counts[key[len("tp_"):]] += value
        counts.update(fp8_amax_comm(cfg, plan, model, tokens if pipeline else _micro_batch_tokens(cfg, plan, model),
                                    g["modules"]))
    if mesh.cp > 1:  # attention's exchanges over each cp group, counted apart
        counts.update(cp_comm(cfg, plan, model, precision, g["attention"]))
    counts["step_allreduces"] = 1
    counts["step_allreduce_bytes"] = step_stats_bytes(mesh.world_size, pipeline)
    counts.update(moe_step_allreduces(plan, model, counts))
    counts.update(muon_comm(cfg, mesh, model, {id(p) for p in g["trained"]}))
    counts.update(fp8_scale_comm(model, cfg, {id(p) for p in g["holds"]}))
    return counts


def add_p2p(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any],
            counts: Dict[str, int]) -> None:
    """The sends and receives of activations and their gradients between stage group ``g``'s stages and the
    others'. The stages' fixed shape: micro-batch rows x the model's block_size (shorter sequences padded to
    it); under sequence parallelism a rank sends its sequence shard."""
    mesh, accum = plan.mesh, plan.accum_steps
    stages = mesh.pp * cfg.dist.pp.stages_per_rank
    stream = (precision.param_dtype or torch.float32).itemsize
    shards = mesh.tp if mesh.tp > 1 and cfg.dist.tp.sequence_parallel else 1
    activation = _rank_tokens(cfg, plan, model) // shards * model.stage_dims()[0] * stream
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


def group_state_bytes(cfg: Config, plan: BatchPlan, model: nn.Module, g: Dict[str, Any]) -> int:
    """Model state stage group ``g``'s rank holds after an optimizer step: its parameters' and its expert slices'
    (1/ep of each, whole on its rank, or cut over edp too where FSDP shards them)."""
    mesh = plan.mesh
    cut = local_shapes(model, cfg.dist.tp)
    return (expected_state_bytes(cfg, g["trained"], mesh.shard, cut, muon_ids(cfg, model))
            + expert_state_bytes(cfg, g["experts"], mesh.ep, mesh.expert_data_ranks if mesh.shards_experts else 1))


def group_numbers(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any],
                  r: int) -> Dict[str, Any]:
    """Stage group ``g`` (pp rank ``r``)'s full step and memory: its collectives (None while
    batch.micro_batch_size=auto waits for the finder), state_mb and the step's peak, a checkpoint's staging
    copy, the build's host peak and Muon's Newton-Schulz work."""
    mesh = plan.mesh
    auto = cfg.batch.micro_batch_size == "auto"  # the split, and so K, is known only once the finder has run
    cut, muon = local_shapes(model, cfg.dist.tp), muon_ids(cfg, model)
    state = group_state_bytes(cfg, plan, model, g)
    extra = None if auto else (pp_peak_extra_bytes(cfg, plan, model, precision, g, r) if mesh.pp > 1 else
                               expected_peak_extra_bytes(cfg, plan, model, precision, g))
    return {"step": None if auto else group_comm(cfg, plan, model, precision, g), "state_mb": state / MIB,
            "step_peak_state_mb": None if extra is None else (state + extra) / MIB,
            "ckpt_staging_mb": expected_staging_bytes(cfg, g["staged"], g["buffer_bytes"], mesh.shard, cut,
                                                      muon) / MIB,
            "load_host_peak_mb": expected_load_bytes(cfg, mesh, model, cut, g["holds"]) / MIB,
            "muon_ns_flops": muon_ns_flops(cfg, mesh, model, {id(p) for p in g["trained"]})}


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


def _tied_across(model: nn.Module) -> List[torch.Tensor]:
    """Parameters shared between the model's first-stage and last-stage modules (the GPT's embedding and head)."""
    first = {id(p) for n in model.pp_first for p in model.get_submodule(n).parameters()}
    return [p for n in model.pp_last for p in model.get_submodule(n).parameters() if id(p) in first]


def _micro_batch_tokens(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's tokens: micro batch x data.block_size (the model's block_size if the data has none;
    1 where neither has: one activation row per sample)."""
    return plan.micro_batch_size * (cfg.data.get("block_size") or getattr(model, "block_size", None) or 1)


def tp_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
            held: Optional[Callable[[str], bool]] = None, tokens: Optional[int] = None) -> Dict[str, int]:
    """The tp collectives of one full step, for micro-batches of whole sequences (``_micro_batch_tokens``).
    Padded batches of shorter sequences send less. ``held``: the modules that count (a stage group's);
    ``tokens``: a micro-batch's, where it is not the data's (pipeline stages run at the model's block_size)."""
    param_bytes = (precision.param_dtype or torch.float32).itemsize
    linear_bytes = _activation_size(precision)
    blocks = find_blocks(model, cfg.dist.blocks) if cfg.dist.activation_checkpointing else []
    names = {id(m): name for name, m in model.named_modules()}
    loss = getattr(model, "loss_options", None)  # the built-in GPT's model.loss
    return expected_tp_comm(model, cfg.dist.tp, tokens or _micro_batch_tokens(cfg, plan, model), plan.accum_steps,
                            param_bytes, linear_bytes, [names[id(b)] for b in blocks],
                            plan.accum_steps if cfg.dist.fsdp.accum_sync == "every" else 1, held,
                            loss.chunk_tokens if loss is not None and loss.chunked else None)


def expected_peak_extra_bytes(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
                              group: Dict[str, Any]) -> int:
    """Gathered parameters and unsharded gradients held at once at the step's peak, on one rank, without
    pipeline stages (``group``: the whole model).

    ddp: none (nothing is gathered; the whole gradient is part of state_mb).
    fsdp/hsdp, with G a unit's gathered size in the compute dtype and R its
    unsharded FP32 gradient: gathered at once, ``micro_batch`` holds the root
    and 1 + prefetch blocks (a unit being used and those gathered ahead), ``forward`` and
    ``step`` every unit. Gradients: with ``accum_sync=last`` and K > 1 every
    unit's R is kept between micro-batches while the next forward gathers;
    otherwise one unit's gradient is reduced as it is made, and takes the place
    of its freed parameters, except under ``step``, where nothing is freed
    before the last backward (the largest unit's R on top, K > 1).
    """
    mesh = plan.mesh
    if not sharded_by_fsdp(cfg):
        return 0
    S = mesh.shard
    cut, float8 = local_shapes(model, cfg.dist.tp), gathered_in_float8(model, cfg.precision)
    units = [unit_bytes(unit, S, precision, cut, float8) for unit in group["units"]]
    # A shard group of one rank computes with its shards as they are, unless they must be cast.
    gathered = [0 if S == 1 and precision.param_dtype is None else S * g for g, _ in units]
    grads = [S * r for _, r in units]
    blocks, root = gathered[:-1], gathered[-1]
    # Experts sharded over edp: a unit inside each MoE block, counted as a block of its own.
    experts = [(mesh.expert_data_ranks * g, mesh.expert_data_ranks * r)
               for g, r in expert_unit_bytes(plan, group["moe"], precision)]
    blocks, gathered = blocks + [g for g, _ in experts], gathered + [g for g, _ in experts]
    grads += [r for _, r in experts]
    reshard, accum = cfg.dist.fsdp.reshard, plan.accum_steps
    if reshard == "micro_batch":
        held = root + sum(sorted(blocks, reverse=True)[:1 + cfg.dist.fsdp.prefetch])
    else:
        held = sum(gathered)
    if cfg.dist.fsdp.accum_sync == "last" and accum > 1:
        return held + sum(grads)
    if reshard == "step" and accum > 1:
        return held + max(grads)
    return held


def resumed_step_comm(counts: Dict[str, int]) -> Dict[str, int]:
    """The first step after a resume measures state_mb (with its step peak) on its mesh again: one 16-byte all-reduce."""
    return {**counts, "step_allreduces": counts["step_allreduces"] + 1,
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + 16}


def first_step_comm(counts: Dict[str, int]) -> Dict[str, int]:
    """Step 1 adds two one-time float64 all-reduces: the first loss divisor, and state_mb with its step peak."""
    return {**counts, "step_allreduces": counts["step_allreduces"] + 2,
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + 8 + 16}


def _optimizer_state_bytes(cfg: Config, sizes: List[int], muon: List[bool],
                           shapes: Optional[List[torch.Size]] = None) -> int:
    """Bytes of optimizer state for tensors of ``sizes`` elements each on a rank; ``muon``: which Muon steps;
    ``shapes``: the tensors' whole shapes (Adafactor's factors)."""
    o = cfg.optim
    if o.name == "sgd":
        return 4 * sum(sizes) if o.momentum > 0 else 0  # SGD's momentum buffer
    if o.name == "adafactor":  # a matrix's row and column means (of its last two dimensions), a vector's variance
        return 4 * sum((math.prod(s[:-2]) * (s[-2] + s[-1]) if len(s) >= 2 else n) + 1 for n, s in zip(sizes, shapes))
    # AdamW: exp_avg, exp_avg_sq and one FP32 scalar step a tensor; Muon (optim.name=muon): its momentum and step
    moment = {"fp32": lambda n: 4 * n, "bf16": lambda n: 2 * n, "int8": _int8_moment_bytes}[o.state_dtype]
    return sum(4 * n + 4 if m else 2 * moment(n) + 4 for n, m in zip(sizes, muon))


def _int8_moment_bytes(n: int) -> int:
    """torchao's 8-bit moment of ``n`` elements (on a rank): a byte an element, an FP32 scale a block of 256 and
    its 256-entry FP32 table, where the tensor has 4096 elements or more in whole blocks; FP32 otherwise."""
    from .optim.lowmem import INT8_BLOCK, INT8_MIN_ELEMENTS

    if n >= INT8_MIN_ELEMENTS and n % INT8_BLOCK == 0:
        return n + 4 * (n // INT8_BLOCK) + 4 * 256
    return 4 * n


def muon_ids(cfg: Config, model: nn.Module) -> set:
    """id() of the parameters Muon steps (optim.name=muon; none otherwise)."""
    if cfg.optim.name != "muon":
        return set()
    from .optim import muon_split

    return {id(p) for _, p in muon_split(list(model.named_parameters()), cfg.optim)[0]}


def expected_state_bytes(cfg: Config, params: List[torch.Tensor], shard: int,
                         cut: Optional[Dict[int, torch.Size]] = None, muon: Collection[int] = ()) -> int:
    """Model state one rank holds after an optimizer step (what ``state_mb`` measures), on the largest rank.

    ddp: every rank holds the parameters and their gradients in the parameters' dtype,
    the FP32 masters and their FP32 gradients in master modes, and the optimizer's
    FP32 state. fsdp/hsdp: each tensor is cut in ``shard`` chunks (the shard group) along its first
    dimension (rank 0's is the largest); rank 0 holds its chunk of the FP32 parameter
    (which is the master in master modes), of its FP32 gradient and of the optimizer state.
    ``cut``: id(parameter) -> what a rank holds of it under tp (tp_local_shapes), before FSDP's cut.
    """
    cut = cut or {}
    is_muon = [id(p) in muon for p in params]
    if sharded_by_fsdp(cfg):
        sizes = [shard_elements(p, shard, cut.get(id(p))) for p in params]
        return 8 * sum(sizes) + _optimizer_state_bytes(cfg, sizes, is_muon, [p.shape for p in params])
    sizes = [p.numel() for p in params]
    own = 2 * sum(p.numel() * p.element_size() for p in params)  # parameters and their gradients
    masters = 2 * 4 * sum(sizes) if master_mode(cfg.precision) else 0
    return own + masters + _optimizer_state_bytes(cfg, sizes, is_muon, [p.shape for p in params])


def frozen_bytes(cfg: Config, model: nn.Module, shard: int, cut: Dict[int, torch.Size]) -> int:
    """What a rank holds of the parameters that do not train (a LoRA base), which state_mb leaves out: their FP32
    shards under fsdp, else whole in their dtype."""
    frozen = [p for p in {id(p): p for p in model.parameters()}.values() if not p.requires_grad]
    if sharded_by_fsdp(cfg):
        return 4 * sum(shard_elements(p, shard, cut.get(id(p))) for p in frozen)
    return sum(math.prod(cut.get(id(p), p.shape)) * p.element_size() for p in frozen)


def expert_state_bytes(cfg: Config, experts: List[torch.Tensor], ep: int, edp: int = 1) -> int:
    """State of a rank's expert slices (FP32 parameter, gradient, optimizer state): 1/ep of each, and its padded
    shard of that over ``edp`` ranks where FSDP cuts it again."""
    sizes = [shard_elements(p, edp, _slice(p, ep)) for p in experts]  # 3-D: never Muon's
    return 8 * sum(sizes) + _optimizer_state_bytes(cfg, sizes, [False] * len(sizes), [p.shape for p in experts])


def expected_staging_bytes(cfg: Config, params: List[torch.Tensor], buffer_bytes: int, shard: int,
                           cut: Optional[Dict[int, torch.Size]] = None, muon: Collection[int] = ()) -> int:
    """Host memory a background checkpoint copies on the largest rank (``ckpt_staging_mb``, trainer.ckpt_async).

    ddp: rank 0 copies the FP32 model (the masters in master modes; a tied weight
    once) and the optimizer's FP32 state; the other ranks only their RNG states.
    fsdp/hsdp (and tp, pp): every rank copies its shards of both, rank 0's the
    largest. Persistent buffers (``buffer_bytes``) are copied whole; frozen
    parameters are left out of checkpoints, so out of ``params``.
    """
    cut = cut or {}
    if sharded_by_fsdp(cfg):
        sizes = [shard_elements(p, shard, cut.get(id(p))) for p in params]
    else:
        sizes = [p.numel() for p in params]
    state = _optimizer_state_bytes(cfg, sizes, [id(p) in muon for p in params], [p.shape for p in params])
    return 4 * sum(sizes) + state + buffer_bytes


def persistent_buffer_bytes(model: nn.Module) -> int:
    """Bytes of the buffers a state dict holds, as checkpoints copy them (floating ones in FP32)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return sum(t.numel() * (4 if t.is_floating_point() else t.element_size())
               for name, t in model.state_dict().items() if name not in params)


def meta_model(cfg: Config, precision: Precision) -> nn.Module:
    """The model as the strategy would hold it, on the meta device: shapes and dtypes, no memory."""
    # a pretrained Hugging Face model from its configuration alone: its files are read by a run, not by a plan
    unread = {"load_weights": False} if cfg.model.get("pretrained") and cfg.model.get("_target_") in HF_TARGETS else {}
    with torch.device("meta"):
        model = instantiate(cfg.model, _convert_="all", **unread)
        if not sharded_by_fsdp(cfg):  # fsdp keeps FP32 shards and casts when it gathers
            precision.prepare(model)
    return model


def expected_load_bytes(cfg: Config, mesh: MeshShape, model: nn.Module, cut: Dict[int, torch.Size],
                        held: Optional[List[torch.Tensor]] = None) -> int:
    """Host memory building (or loading) the model adds to the rank that holds the most.

    Under fsdp, hsdp, tp and pp (built on the meta device, ``models.construct``): the rank's FP32 shards of its
    parameters (``held``: a pipeline stage group's; default all) and its buffers whole, and beside them one
    tensor at a time: from the recorded constructor the largest whole tensor (each is drawn whole, as one
    process draws it); from pretrained files nothing where they hold FP32 (a shard is read straight into its
    storage), else the largest shard in the files' dtype. Built whole (ddp, or ``dist.meta_init=false``): an
    estimate, twice the whole model (the model, and either DDP's buckets or, from pretrained files, the pages
    transformers' loader maps, which depend on its version).
    """
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    whole = sum(t.numel() * 4 for t in tensors)
    source = cfg.model.get("pretrained")
    if not mesh.cuts_model or not cfg.dist.meta_init:
        return 2 * whole
    ids = {id(p) for p in held} if held is not None else None
    params = [p for p in {id(p): p for p in model.parameters()}.values() if ids is None or id(p) in ids]
    shards = [shard_elements(p, mesh.shard, cut.get(id(p))) for p in params]
    buffers = sum(b.numel() * 4 for b in model.buffers())
    if source:
        from .models.pretrained import BLOCK_BYTES

        itemsize = pretrained_itemsize(Path(source).expanduser())
        beside = 0 if itemsize == 4 else max(shards, default=0) * itemsize
        # a shard that keeps some columns (a row-wise Linear under tp) is read in blocks of whole rows into a
        # buffer of its own size, then copied
        columns = [math.prod(cut[id(p)]) for p in params if id(p) in cut and p.ndim > 1 and
                   tuple(cut[id(p)])[1:] != tuple(p.shape)[1:]]
        beside = max(beside, BLOCK_BYTES + max(columns) * 4 if columns else 0)
    else:
        beside = max((t.numel() * 4 for t in tensors), default=0)
    return sum(shards) * 4 + buffers + beside


def expected_export_bytes(mesh: MeshShape, model: nn.Module) -> int:
    """The most host memory writing the final model may add to a rank (``final.py``): the tensors are walked one
    at a time, so under fsdp, hsdp, tp and pp the largest one whole: an all-gather's output and input, and
    where the parameter is placed on two mesh dimensions (tp under FSDP2, even with shard groups of one) a
    second gather and the reordering of FSDP's strided shard, which DTensor runs one dimension after the
    other: four copies at most. Under ddp nothing (rank 0 writes its own FP32 tensors as they are), but for
    expert slices (dist.ep.size), each gathered whole. An upper
    bound: memory the allocator kept from training serves part of it, so a run measures up to it."""
    if not mesh.cuts_model:  # but expert slices (dist.ep.size): the largest gathered whole, and its FP32 copy
        return 2 * max((p.numel() * 4 for p in expert_params(model)), default=0) if mesh.ep > 1 else 0
    return 4 * max((t.numel() * 4 for t in [*model.parameters(), *model.buffers()]), default=0)


def pretrained_itemsize(directory: Path) -> int:
    """The largest element size of the floating tensors in a save_pretrained directory (their headers only)."""
    from .models.pretrained import DTYPES, SafetensorsFile, SafetensorsSource

    files = {path: SafetensorsFile(path) for path in set(SafetensorsSource(directory).files.values())}
    return max((DTYPES[entry["dtype"]].itemsize for f in files.values() for entry in f.tensors.values()
                if DTYPES[entry["dtype"]].is_floating_point), default=4)


def plan_numbers(cfg: Config, plan: BatchPlan, model: Optional[nn.Module] = None,
                 host_baseline_mb: Optional[float] = None) -> Dict[str, Any]:
    """What plan.json holds: the mesh, the split, and each metrics.jsonl key a full step will show.

    Built over the stage groups (no pipeline: one group, the whole model): the step's keys are stage group 0's
    (rank 0's, as metrics.jsonl), each memory figure the largest group's; under pipeline stages
    ``pp_stage_groups`` holds each group's stages, blocks, collectives and state.
    ``model``: the strategy's module of a run (only shapes, dtypes and blocks are read; a
    sharded parameter's shape is its whole shape); None builds one on the meta device (always under pipeline
    stages: a pipeline rank's module holds its stages only).
    ``host_baseline_mb``: what the process held with its data ready, before the model was built, where the
    run is on CPU (None elsewhere): with it, ``run_host_peak_mb``.
    """
    precision = Precision(cfg.precision, torch.device("cpu"))
    mesh, pipeline = plan.mesh, plan.mesh.pp > 1
    if model is None or pipeline:
        model = meta_model(cfg, precision)
    auto = cfg.batch.micro_batch_size == "auto"  # the split, and so K, is known only once the finder has run
    parts = stage_groups(cfg, plan, model)
    groups = [group_numbers(cfg, plan, model, precision, g, r) for r, g in enumerate(parts)]
    step = groups[0]["step"]
    widest = lambda key: max(g[key] for g in groups)  # noqa: E731
    numbers = {
        "world_size": plan.world_size,
        "mesh": {"kind": mesh.kind, "replicate": mesh.replicate, "shard": mesh.shard, "tp": mesh.tp, "pp": mesh.pp,
                 **({"ep": mesh.ep} if mesh.ep > 1 else {}), **({"cp": mesh.cp} if mesh.cp > 1 else {})},
        **(cp_numbers(cfg, plan, model) if mesh.cp > 1 else {}),
        **(ep_numbers(cfg, plan, model) if mesh.ep > 1 else {}),
        "comm_dims": comm_dims(cfg, plan, model),
        "micro_batch_size": None if auto else plan.micro_batch_size, "accum_steps": None if auto else plan.accum_steps,
        "global_batch_size": plan.global_batch_size,
        "dist.fsdp.reshard": cfg.dist.fsdp.reshard if mesh.kind != "ddp" else None,
        "dist.fsdp.accum_sync": cfg.dist.fsdp.accum_sync if mesh.kind != "ddp" else None,
        **({"dist.pp.schedule": cfg.dist.pp.schedule, "dist.pp.stages_per_rank": cfg.dist.pp.stages_per_rank}
           if pipeline else {}),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "state_mb": widest("state_mb"),
        "step_peak_state_mb": None if auto else widest("step_peak_state_mb"),
        # What the sequence-parallel norms save for backward per micro-batch on a rank (cut by tp under sp); and
        # what autograd keeps for backward from one micro-batch's forward on a rank (fake tensors at its shape).
        # A stage's forward is not run alone in plan mode.
        "norm_activation_mb": (norm_activation_bytes(model, cfg.dist.tp, _rank_tokens(cfg, plan, model),
                                                     (precision.param_dtype or torch.float32).itemsize) / MIB
                               if mesh.tp > 1 and not auto and not pipeline else None),
        "activation_mb": _mib_or_none(None if auto or pipeline else predicted_bytes(cfg, plan, precision)),
        "muon_ns_flops": None if cfg.optim.name != "muon" else widest("muon_ns_flops"),
        "ckpt_staging_mb": widest("ckpt_staging_mb"),
        "load_host_peak_mb": widest("load_host_peak_mb"),
        "export_host_peak_mb": expected_export_bytes(mesh, model) / MIB,
        **({} if pipeline else {"frozen_mb": frozen_bytes(cfg, model, mesh.shard, local_shapes(model, cfg.dist.tp))
                                / MIB}),
        **(pp_numbers(cfg, plan, parts, groups) if pipeline else {}),
        "step": step, "first_step": None if step is None else first_step_comm(step),
        "resumed_step": None if step is None else resumed_step_comm(step),
    }
    numbers["host_baseline_mb"] = host_baseline_mb
    numbers["run_host_peak_mb"] = run_host_peak_mb(cfg, plan, numbers, host_baseline_mb)
    return numbers


def pp_numbers(cfg: Config, plan: BatchPlan, parts: List[Dict[str, Any]], groups: List[Dict[str, Any]]
               ) -> Dict[str, Any]:
    """Under pipeline stages: the schedule's predicted idle fraction, and each stage group's stages, blocks,
    collectives (also of the first step and the first after a resume), state and micro-batches in flight."""
    pp = cfg.dist.pp
    inflight = pp_inflight(pp.schedule, plan.mesh.pp, pp.stages_per_rank, plan.accum_steps)
    return {"pp_bubble": pp_bubble(pp.schedule, plan.mesh.pp, pp.stages_per_rank, plan.accum_steps),
            "pp_stage_groups": [{"stages": g["stages"], "blocks": g["blocks"], "first": g["first"], "last": g["last"],
                                 "step": n["step"], "state_mb": n["state_mb"], "inflight": inflight[r],
                                 "muon_ns_flops": n["muon_ns_flops"], "step_peak_state_mb": n["step_peak_state_mb"],
                                 "ckpt_staging_mb": n["ckpt_staging_mb"], "load_host_peak_mb": n["load_host_peak_mb"],
                                 "first_step": first_step_comm(n["step"]), "resumed_step": resumed_step_comm(n["step"])}
                                for r, (g, n) in enumerate(zip(parts, groups))]}


def cp_numbers(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, Any]:
    """(query, key) pairs of one sequence each cp rank's attention computes: equal under zigzag."""
    auto = cfg.batch.micro_batch_size == "auto"
    return {"cp_attention_work": None if auto else attention_work(_sequence_length(cfg, plan, model), plan.mesh.cp,
                                                                  cfg.dist.cp.layout)}


def ep_numbers(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, Any]:
    """The bounds of the whole model's MoE layers' all-to-all bytes (a stage group's are of its own layers)."""
    auto = cfg.batch.micro_batch_size == "auto"
    return {"ep_all_to_all_bytes_max": None if auto else ep_all_to_all_bytes_max(cfg, plan, model),
            "ep_all_to_all_bytes_balanced": None if auto else ep_all_to_all_bytes_balanced(cfg, plan, model)}


def comm_dims(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, str]:
    """Which mesh dimension each kind of collective runs over."""
    mesh = plan.mesh
    # under tp and pp, ddp's replicas are FSDP2's shard groups of one rank
    dims = dict(COMM_DIMS["hsdp" if mesh.kind == "ddp" and (mesh.tp > 1 or mesh.pp > 1) else mesh.kind])
    if mesh.pp > 1:
        dims.update({"p2p_sends": "pp", "p2p_recvs": "pp"})
    if mesh.tp > 1:
        dims.update({key: "tp" for key in TP_COMM_KEYS + FP8_AMAX_KEYS if not key.endswith("_bytes")})
    if muon_ids(cfg, model) and mesh.pp == 1:  # whole matrices gathered over the dimensions that cut them
        over = "tp, then shard" if mesh.tp > 1 and sharded_by_fsdp(cfg) else "tp" if mesh.tp > 1 else "shard"
        for kind in ("gathers", "scatters") if cfg.optim.muon.dist == "owner" else ("all_gathers",):
            dims[f"muon_{kind}"] = over
    if gathered_in_float8(model, cfg.precision):  # the float8 all-gather's amaxes, over each shard group
        dims["fp8_scale_allreduces"] = "shard, then tp (the tp-cut weights')" if mesh.tp > 1 else "shard"
    if mesh.pp > 1 and _tied_across(model):
        dims["allreduces"] = dims.get("allreduces", "replicate") + "; the tied weight's: first and last stage groups"
    if mesh.ep > 1:
        dims["all_to_alls"] = "ep"
        if mesh.shards_experts:
            for key in ("all_gathers", "reduce_scatters"):
                dims[key] = "; ".join(filter(None, [dims.get(key), "the experts': edp"]))
        elif mesh.expert_data_ranks > 1:
            dims["allreduces"] = "; ".join(filter(None, [dims.get("allreduces"), "the experts': edp"]))
    if mesh.cp > 1:
        dims.update({"cp_sends": "cp", "cp_all_to_alls": "cp"})
    return dims


def run_host_peak_mb(cfg: Config, plan: BatchPlan, numbers: Dict[str, Any],
                     baseline_mb: Optional[float]) -> Optional[float]:
    """A CPU rank's peak resident memory over the whole run (hostmem.expected_run_peak_mb), or None where the
    run is not on CPU or the split waits for the finder."""
    if baseline_mb is None or numbers["step_peak_state_mb"] is None:
        return None
    mode = hostmem.mode_for(cfg.trainer.tune_malloc, plan.mesh)
    whole = not plan.mesh.cuts_model or not cfg.dist.meta_init
    frozen = numbers.get("frozen_mb") or 0.0  # held through the run beside the state (a LoRA base)
    return hostmem.expected_run_peak_mb(baseline_mb, mode, whole, numbers["load_host_peak_mb"],
                                        numbers["step_peak_state_mb"] + frozen, numbers["activation_mb"] or 0.0,
                                        numbers["state_mb"] + frozen, numbers["export_host_peak_mb"])


def runs_on_cpu(cfg: Config) -> bool:
    """Whether the run this config describes trains on CPU (trainer.device, or auto on a machine without CUDA)."""
    return cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available())


def _fp8_lines(cfg: Config, plan: BatchPlan, numbers: Dict[str, Any]) -> List[str]:
    from .fp8 import describe

    if cfg.precision.name not in RECIPES:
        return []
    precision = Precision(cfg.precision, torch.device("cpu"))
    model = meta_model(cfg, precision)
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
        lines.append(f"  FSDP's all-gathers per optimizer step: {_mib(gathered[0])} with the float8 all-gather, "
                     f"{_mib(gathered[1])} without (precision.fp8.all_gather={str(cfg.precision.fp8.all_gather).lower()})"
                     + (f"; plus the float8 weights' amaxes, {scales} all-reduce{'s' if scales != 1 else ''} a step "
                        "(fp8_scale_allreduces)" if cfg.precision.fp8.all_gather else ""))
    return lines


def _muon_lines(cfg: Config, numbers: Dict[str, Any]) -> List[str]:
    from .optim import optimizer_line

    line = optimizer_line(list(meta_model(cfg, Precision(cfg.precision, torch.device("cpu"))).named_parameters()),
                          cfg.optim)
    if not line:
        return []
    step = numbers["step"] or (numbers.get("pp_stage_groups") or [{}])[0].get("step") or {}
    owner = cfg.optim.muon.dist == "owner"
    key = "muon_gathers" if owner else "muon_all_gathers"
    over = numbers["comm_dims"].get(key, "no cut dimension")
    gathers = ("" if step.get(key) is None else
               f"; {step[key]} {'gathers to an owner and scatters back' if owner else 'all-gathers'} of whole "
               f"matrices per optimizer step ({_mib(step[key[:-1] + '_bytes'])} each way, {key} over {over})")
    flops = numbers.get("muon_ns_flops")
    iterations = "" if flops is None else \
        f"; Newton-Schulz {flops / 1e9:.3f} GFLOP a step on the busiest rank (muon_ns_flops)"
    return [f"  optimizer: {line}{gathers}{iterations}"]


def _activation_shape(cfg: Config, plan: BatchPlan) -> str:
    cp, loss = plan.mesh.cp, (cfg.model.get("loss") or {}) if isinstance(cfg.model, dict) else {}
    return ", ".join([f"{plan.micro_batch_size} sequences"]
                     + ([f"a cp-th of each sequence's tokens (dist.cp.size={cp})"] if cp > 1 else [])
                     + (["the loss in chunks"] if loss.get("chunked") else [])
                     + (["checkpointed blocks keep their inputs"] if cfg.dist.activation_checkpointing else []))


def _mib_or_none(n: Optional[int]) -> Optional[float]:
    return None if n is None else n / MIB


def write_plan_json(numbers: Dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(numbers, indent=1) + "\n")


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB ({n} bytes)"


def comm_lines(numbers: Dict[str, Any], accum_steps: Optional[int]) -> List[str]:
    """The printout of one full step's collectives."""
    step, kind = numbers["step"], numbers["mesh"]["kind"]
    if step is None:
        return ["  collectives per optimizer step: known once batch.micro_batch_size=auto has chosen the split"]
    tp = numbers["mesh"].get("tp", 1)
    if (tp > 1 or numbers["mesh"].get("pp", 1) > 1) and kind == "ddp":
        kind = "hsdp"  # under tp and pp, ddp's replicas are FSDP2's shard groups of one rank
    if tp > 1:  # the data-parallel dimensions' collectives first (the totals less tp's), then tp's
        step = {key: value - step.get(f"tp_{key}", 0) for key, value in step.items() if not key.startswith("tp_")}
        return [*_dp_comm_lines(numbers, step, kind, accum_steps), *_tp_comm_lines(numbers["step"], tp),
                *_cp_comm_lines(numbers)]
    return [*_dp_comm_lines(numbers, step, kind, accum_steps), *_ep_comm_lines(numbers), *_cp_comm_lines(numbers)]


def _cp_comm_lines(numbers: Dict[str, Any]) -> List[str]:
    cp = numbers["mesh"].get("cp", 1)
    if cp == 1:
        return []
    step, work = numbers["step"], numbers["cp_attention_work"]
    if step["cp_sends"]:
        what = f"ring: {step['cp_sends']} sends of keys and values or their gradients, {_mib(step['cp_send_bytes'])}"
    else:
        what = f"ulysses: {step['cp_all_to_alls']} all-to-alls, {_mib(step['cp_all_to_all_bytes'])}"
    return [f"  context parallelism per optimizer step (over each cp group of {cp} ranks): {what}; attention "
            f"work per cp rank (query-key pairs of a sequence) {work}"]


def _ep_comm_lines(numbers: Dict[str, Any]) -> List[str]:
    ep = numbers["mesh"].get("ep", 1)
    if ep == 1:
        return []
    edp = numbers["mesh"]["replicate"] * numbers["mesh"]["shard"] // ep
    if "the experts': edp" in numbers["comm_dims"].get("all_gathers", ""):
        held = (f"the experts: each ep slice cut again over the {edp} ranks holding the same experts, one FSDP unit "
                "a MoE layer (in the all-gathers and reduce-scatters above)")
    elif edp > 1:
        held = (f"the experts' gradients: one all-reduce over the {edp} ranks holding the same experts (in the "
                "all-reduces above)")
    else:
        held = "each rank's experts its own"
    return [f"  expert all-to-alls per optimizer step: {numbers['step']['all_to_alls']} (over each expert-parallel "
            f"group of {ep} data ranks: each MoE layer's forward 3, its backward 2), "
            f"{_mib(numbers['ep_all_to_all_bytes_balanced'])} with every expert given its share, at most "
            f"{_mib(numbers['ep_all_to_all_bytes_max'])} (all_to_all_bytes: the routing decides); {held}"]


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
                     f"{step['p2p_sends']}, {_mib(step['p2p_send_bytes'])}; receives {step['p2p_recvs']}, "
                     f"{_mib(step['p2p_recv_bytes'])}; state {g['state_mb']:.2f} MiB; activations of "
                     f"{g['inflight']} micro-batches held at once")
    return lines


def _tp_comm_lines(step: Dict[str, int], tp: int) -> List[str]:
    return [f"  tensor-parallel collectives per optimizer step (activations, over each tp group of {tp}): "
            f"all-reduces {step['tp_allreduces']}, {_mib(step['tp_allreduce_bytes'])}; all-gathers "
            f"{step['tp_all_gathers']}, {_mib(step['tp_all_gather_bytes'])}; reduce-scatters "
            f"{step['tp_reduce_scatters']}, {_mib(step['tp_reduce_scatter_bytes'])} (also in the totals: all_gathers, "
            "reduce_scatters, allreduces)"]


def _dp_comm_lines(numbers: Dict[str, Any], step: Dict[str, int], kind: str, accum_steps: Optional[int]) -> List[str]:
    if kind == "ddp":
        return [f"  gradient all-reduces per optimizer step: {step['allreduces']} (DDP buckets, expected), "
                f"{_mib(step['allreduce_bytes'])}; without no_sync it would be {step['allreduces'] * accum_steps}"]
    lines = [f"  all-gathers per optimizer step: {step['all_gathers']} (over each shard group, "
             f"dist.fsdp.reshard={numbers['dist.fsdp.reshard']}), {_mib(step['all_gather_bytes'])}",
             f"  gradient reduce-scatters per optimizer step: {step['reduce_scatters']} (over each shard group, "
             f"dist.fsdp.accum_sync={numbers['dist.fsdp.accum_sync']}), {_mib(step['reduce_scatter_bytes'])}"]
    if kind == "hsdp":
        tied = "; and a weight tied between the first and last stage groups, where they are apart" \
            if numbers["mesh"].get("pp", 1) > 1 else ""
        lines.append(f"  gradient all-reduces per optimizer step: {step['allreduces']} (across the "
                     f"{numbers['mesh']['replicate']} replicas, once per step{tied}), {_mib(step['allreduce_bytes'])}")
    else:
        lines.append("  no gradient all-reduce")
    return lines


def plan_report(cfg: Config, world_size: int, local_world_size: Optional[int] = None,
                json_path: Optional[Path] = None) -> str:
    if cfg.dist.strategy == "fsdp" and cfg.dist.fsdp.shard_size == "node" and local_world_size is None:
        raise ConfigError("dist.fsdp.shard_size=node: plan mode needs the ranks per node; set plan.nproc_per_node")
    plan = validate(cfg, world_size, local_world_size)
    dataset = build_dataset(cfg.data)
    step_plan = StepPlan.for_config(len(dataset), cfg, plan, rank=0)
    # the data ready and no model yet: a run's rank 0 holds the same when it builds its model
    numbers = plan_numbers(cfg, plan, host_baseline_mb=hostmem.resident_mb() if runs_on_cpu(cfg) else None)
    if json_path is not None:
        write_plan_json(numbers, json_path)
    epochs = plan.max_steps / step_plan.steps_per_epoch
    auto = cfg.batch.micro_batch_size == "auto"
    ranks = (f"world {world_size}" if plan.data_ranks == world_size else
             f"data-parallel ranks {plan.data_ranks} (world {world_size}"
             + "".join(f" / dist.{k}.size={n}" for k, n in (("tp", plan.mesh.tp), ("pp", plan.mesh.pp),
                                                            ("cp", plan.mesh.cp)) if n > 1) + ")")
    split = (f"  micro batch auto (the largest that fits, chosen on the GPU at start-up) x accum steps "
             f"{plan.global_batch_size // world_size} / micro x world {world_size}"
             if auto else f"  micro batch {plan.micro_batch_size} x accum steps {plan.accum_steps} x {ranks}")
    state = int(numbers["state_mb"] * MIB)
    return "\n".join([
        f"plan for world size {world_size} (no process group, nothing trained); mesh {plan.mesh.describe()}",
        *(f"  {line}" for line in plan.chosen),  # keys left at auto, as validate resolved them
        f"{split} = global batch {plan.global_batch_size} samples per optimizer step"
        + (f" ({plan.global_batch_size * dataset.block_size:,} tokens of data.block_size={dataset.block_size})"
           if isinstance(getattr(dataset, "block_size", None), int) else ""),
        f"  lr {plan.base_lr:g} -> {plan.lr:g} (optim.lr_scaling={cfg.optim.lr_scaling}"
        + (f", optim.base_batch_size={cfg.optim.base_batch_size})" if cfg.optim.lr_scaling != "none" else ")"),
        f"  model {numbers['parameters']:,} trainable parameters, precision {cfg.precision.name}",
        *_muon_lines(cfg, numbers),
        *_fp8_lines(cfg, plan, numbers),
        *comm_lines(numbers, plan.accum_steps),
        *pp_lines(numbers),
        f"  plus 1 all-reduce of {step_stats_bytes(world_size, plan.mesh.pp > 1)} bytes (loss, item count, squared gradient norm, "
        "skip, stop and background-write flags, each rank's data wait and compute time"
        + (", its idle and schedule seconds and micro-batches in flight" if plan.mesh.pp > 1 else "")
        + "; step_allreduces; step 1 adds 2, of 8 and 16 bytes; the first after a resume 1, of 16)",
        f"  model state per rank after an optimizer step: {state / MIB:.2f} MiB ({state} bytes; state_mb, "
        f"dist.strategy={cfg.dist.strategy}, parameters, gradients, optimizer state"
        + (", FP32 masters)" if master_mode(cfg.precision) else ")"),
        *([f"  at the step's peak, with gathered parameters and unsharded gradients: "
           f"{numbers['step_peak_state_mb']:.2f} MiB (step_peak_state_mb)"] if numbers["step_peak_state_mb"] else []),
        *([f"  activations a micro-batch's forward keeps for backward on a rank: {numbers['activation_mb']:.2f} MiB "
           f"(activation_mb; {_activation_shape(cfg, plan)})"] if numbers["activation_mb"] is not None else []),
        *([f"  host memory per rank over the whole run, at its peak: {numbers['run_host_peak_mb']:.0f} MiB "
           f"(run_host_peak_mb: this process's {numbers['host_baseline_mb']:.0f} MiB with the data loaded, the step's "
           f"runtime, and the largest of the load ({numbers['load_host_peak_mb']:.0f}), a step at its peak and the "
           f"export)"] if numbers.get("run_host_peak_mb") is not None else []),
        f"  a checkpoint's copy in host memory per rank under trainer.ckpt_async=true: "
        f"{numbers['ckpt_staging_mb']:.2f} MiB (ckpt_staging_mb; the model in FP32 and the optimizer state)",
        f"  dataset {len(dataset):,} samples: {step_plan.steps_per_epoch} optimizer steps per epoch "
        f"(data.drop_last={cfg.data.get('drop_last', False)}); {plan.max_steps} steps = {epochs:.2f} epochs "
        f"= {math.ceil(epochs)} epoch(s) started",
        *([f"  plan.json: {json_path}"] if json_path is not None else []),
    ])
