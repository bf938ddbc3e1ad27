"""Plan mode: the derived numbers of a job, without training and without a process group.

``python -m dist_trainer plan.only=true plan.world_size=64`` validates the
config exactly as the trainer would for 64 ranks (an impossible split fails
the same way) and prints what one optimizer step costs: every collective, its
calls and bytes, and the model state per rank. The same numbers go to
``plan.json`` under the keys metrics.jsonl uses, and a run's full steps match
them exactly (tests hold them to it).

This module composes; each feature keeps its own plan part beside its runtime code (``parallel/dp_plan``,
``moe/ep_plan``, ``parallel/pp_plan``, ``parallel/tp_plan``, ``fp8_plan``, ``parallel/cp_plan``,
``optim/plan``, ``checkpoint/plan``, ``model_plan``, ``data/mixture``: a blend's lines and its slots). Every
number is built on one path, over the stage groups (``stage_groups``; no pipeline: one group holding the whole
model), by the wings of ``STEP`` and ``DIMS`` in their order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from . import fp8_plan, hostmem
from .activations import predicted_bytes
from .checkpoint.plan import expected_staging_bytes, persistent_buffer_bytes
from .config import MIB, BatchPlan, Config, ConfigError, master_mode
from .data import BlendPlan, build_dataset, plan_for
from .data import mixture
from .model_plan import expected_export_bytes, expected_load_bytes
from .models.hf import TARGETS as HF_TARGETS
from .moe import ep_plan
from .moe.ep import moe_layers
from .optim import plan as optim_plan
from .parallel import cp_plan, dp_plan, pp_plan, tp_plan
from .parallel.blocks import find_blocks
from .parallel.comm import COMM_KEYS as GRADIENT_COMM_KEYS
from .parallel.dp_plan import runs_on_cpu
from .parallel.pp_plan import pp_stage_groups
from .parallel.tp import local_shapes
from .precision import Precision
from .rl import build_objective
from .rl import plan as rl_plan
from .trainer import STEP_FIXED_SLOTS
from .validation import validate

COMM_KEYS = GRADIENT_COMM_KEYS + ("step_allreduces", "step_allreduce_bytes")  # and the step's own all-reduce


def add_step_allreduce(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
                       counts: Dict[str, int]) -> None:
    """The step's own all-reduce of totals and flags (float64)."""
    counts["step_allreduces"] = 1
    counts["step_allreduce_bytes"] = step_stats_bytes(plan.mesh.world_size, plan.mesh.pp > 1)


# Each wing's share of a stage group's step, in order: (cfg, plan, model, precision, group, counts) -> None. A
# wing whose dimension is 1 adds nothing.
STEP = (dp_plan.add_step,  # the gradients': DDP's buckets, or FSDP's units
        ep_plan.add_step,  # the experts' units or all-reduce over edp, the MoE layers' all-to-alls
        pp_plan.add_step,  # the tied weight's between stage groups, the sends and receives
        tp_plan.add_step,  # the activations' collectives
        fp8_plan.add_amax_step,  # float8 casts' amaxes over a tp cut
        cp_plan.add_step,  # attention's exchanges
        add_step_allreduce,
        rl_plan.add_step,  # task=dpo: its figures in the step's all-reduce, the reference's pass under fsdp
        mixture.add_step,  # data=blend: each source's loss and tokens in the step's all-reduce
        ep_plan.add_routing_step,  # the routing's counts ride the step's all-reduce
        optim_plan.add_step,  # Muon's gathers of whole matrices
        fp8_plan.add_scale_step)  # the float8 all-gather's scales
# Which mesh dimension each kind of collective runs over: (cfg, plan, model, dims) -> None, in order.
DIMS = (dp_plan.add_dims, pp_plan.add_dims, tp_plan.add_dims, optim_plan.add_dims, fp8_plan.add_dims,
        ep_plan.add_dims, cp_plan.add_dims)


def step_stats_bytes(world_size: int, pipeline: bool = False) -> int:
    """The step's own all-reduce: float64 loss, items, samples, stop flag, norm share, background-busy count;
    per rank a non-finite flag, its data wait and its compute time (pipeline stages: its idle and schedule
    seconds and its micro-batches in flight too)."""
    return (STEP_FIXED_SLOTS + (6 if pipeline else 3) * world_size) * 8


def first_step_comm(counts: Dict[str, int]) -> Dict[str, int]:
    """Step 1 adds two one-time float64 all-reduces: the first loss divisor, and state_mb with its step peak."""
    return {**counts, "step_allreduces": counts["step_allreduces"] + 2,
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + 8 + 16}


def resumed_step_comm(counts: Dict[str, int]) -> Dict[str, int]:
    """The first step after a resume measures state_mb (with its step peak) on its mesh again: one 16-byte
    all-reduce."""
    return {**counts, "step_allreduces": counts["step_allreduces"] + 1,
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + 16}


def stage_groups(cfg: Config, plan: BatchPlan, model: nn.Module) -> List[Dict[str, Any]]:
    """What each stage group (pp rank) holds, the one path every number is built on: its stages and their
    blocks, the parameters of each FSDP unit (``units``, the experts left out), the parameters it steps
    (``trained``, the experts left out; without stages in the model's order, which DDP's buckets follow), its
    expert slices and MoE layers, the modules (``modules``: a predicate on names) and attention layers
    (``attention``) whose collectives it issues (None: all the model's), what a checkpoint copies of it
    (``staged``, ``buffer_bytes``) and what it builds (``holds``). Without pipeline stages one group holds the
    whole model: each block's unit, then the root's (the rest); under them ``pp_stage_groups``."""
    if plan.mesh.pp > 1:
        return pp_stage_groups(cfg, model)
    experts = ep_plan.ep_experts(plan, model)
    skip = {id(p) for p in experts}
    blocks, split = find_blocks(model, cfg.dist.blocks), dp_plan.splits_frozen(model, plan.mesh, experts=bool(skip))
    units = dp_plan.fsdp_units(model, blocks, skip, split)
    # found by the model's own forward, on a copy of its own: the forward on fake tensors replaces its parameters
    forward_only = set()
    if split:
        own = meta_model(cfg, Precision(cfg.precision, torch.device("cpu")), objective=False)
        forward_only = dp_plan.forward_only_units(cfg, own, plan.mesh)
    return [{"stages": [0], "blocks": None, "units": units, "unit_stages": [0] * len(units), "first": True,
             "forward_only": forward_only, "frozen_root": split and cfg.dist.fsdp.reshard == "micro_batch"
             and dp_plan.frozen_root(model, units[-1]) is not None,
             "last": True, "moe": moe_layers(model), "experts": experts, "modules": None, "attention": None,
             "trained": [p for p in model.parameters() if p.requires_grad and id(p) not in skip],
             # a checkpoint copies every trainable parameter (expert slices whole) and the buffers
             "staged": [p for p in model.parameters() if p.requires_grad],
             "buffer_bytes": persistent_buffer_bytes(model), "holds": list(model.parameters())}]


def meta_model(cfg: Config, precision: Precision, objective: bool = True) -> nn.Module:
    """The model as the strategy would hold it, on the meta device: shapes and dtypes, no memory.
    ``objective=False``: without the task's objective (task=dpo's reference, its forward of pairs): the model's
    own forward."""
    # a pretrained Hugging Face model from its configuration alone: its files are read by a run, not by a plan
    unread = {"load_weights": False} if cfg.model.get("pretrained") and cfg.model.get("_target_") in HF_TARGETS else {}
    with torch.device("meta"):
        model = instantiate(cfg.model, _convert_="all", **unread)
        if not dp_plan.sharded_by_fsdp(cfg):  # fsdp keeps FP32 shards and casts when it gathers
            precision.prepare(model)
        if objective:
            build_objective(cfg, model)  # task=dpo: its reference's passes and figures count in the step
    return model


def group_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any]
               ) -> Dict[str, int]:
    """Calls and bytes of every collective of stage group ``group``'s full optimizer step after the first, by
    metrics key: each wing's share, in ``STEP``'s order."""
    counts = dict.fromkeys(COMM_KEYS, 0)
    for add in STEP:
        add(cfg, plan, model, precision, group, counts)
    return counts


def group_state_bytes(cfg: Config, plan: BatchPlan, model: nn.Module, g: Dict[str, Any]) -> int:
    """Model state stage group ``g``'s rank holds after an optimizer step: its parameters' and its expert slices'
    (1/ep of each, whole on its rank, or cut over edp too where FSDP shards them)."""
    mesh = plan.mesh
    cut = local_shapes(model, cfg.dist.tp)
    return (dp_plan.expected_state_bytes(cfg, g["trained"], mesh.shard, cut, optim_plan.muon_ids(cfg, model))
            + ep_plan.expert_state_bytes(cfg, g["experts"], mesh.ep,
                                         mesh.expert_data_ranks if mesh.shards_experts else 1))


def group_numbers(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, g: Dict[str, Any],
                  r: int) -> Dict[str, Any]:
    """Stage group ``g`` (pp rank ``r``)'s full step and memory: its collectives (None while
    batch.micro_batch_size=auto waits for the finder), state_mb and the step's peak, a checkpoint's staging
    copy, the build's host peak and Muon's Newton-Schulz work."""
    mesh = plan.mesh
    auto = cfg.batch.micro_batch_size == "auto"  # the split, and so K, is known only once the finder has run
    cut, muon = local_shapes(model, cfg.dist.tp), optim_plan.muon_ids(cfg, model)
    state = group_state_bytes(cfg, plan, model, g)
    # what the group holds unsharded at the step's peak: under the stages' schedule, or FSDP's reshard policy
    if auto:
        extra = None
    elif mesh.pp > 1:
        extra = pp_plan.pp_peak_extra_bytes(cfg, plan, model, precision, g, r)
    else:
        experts = ep_plan.expert_unit_bytes(plan, g["moe"], precision)
        extra = dp_plan.expected_peak_extra_bytes(cfg, plan, model, precision, g, experts)
    return {"step": None if auto else group_comm(cfg, plan, model, precision, g), "state_mb": state / MIB,
            "step_peak_state_mb": None if extra is None else (state + extra) / MIB,
            "ckpt_staging_mb": expected_staging_bytes(cfg, g["staged"], g["buffer_bytes"], mesh.shard, cut,
                                                      muon) / MIB,
            "load_host_peak_mb": expected_load_bytes(cfg, mesh, model, cut, g["holds"]) / MIB,
            # a LoRA base, and a reference copy (task=dpo): held through the run beside the state
            "frozen_mb": (dp_plan.frozen_bytes(cfg, g["holds"], mesh.shard, cut)
                          + rl_plan.reference_bytes(cfg, g["holds"], mesh.shard, cut)) / MIB,
            "muon_ns_flops": optim_plan.muon_ns_flops(cfg, mesh, model, {id(p) for p in g["trained"]})}


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
        **cp_plan.cp_numbers(cfg, plan, model),
        **ep_plan.ep_numbers(cfg, plan, model),
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
        "norm_activation_mb": tp_plan.norm_activation_mb(cfg, plan, model, precision),
        "activation_mb": _mib_or_none(None if auto or pipeline else predicted_bytes(cfg, plan, precision)),
        "muon_ns_flops": None if cfg.optim.name != "muon" else widest("muon_ns_flops"),
        "ckpt_staging_mb": widest("ckpt_staging_mb"),
        "load_host_peak_mb": widest("load_host_peak_mb"),
        "export_host_peak_mb": expected_export_bytes(mesh, model) / MIB,
        "frozen_mb": widest("frozen_mb"),
        **(_with_first_steps(pp_plan.pp_numbers(cfg, plan, parts, groups)) if pipeline else {}),
        "step": step, "first_step": None if step is None else first_step_comm(step),
        "resumed_step": None if step is None else resumed_step_comm(step),
        **rl_plan.rl_numbers(cfg, plan, model, parts[0], step),
    }
    numbers["host_baseline_mb"] = host_baseline_mb
    numbers["run_host_peak_mb"] = run_host_peak_mb(cfg, plan, numbers, host_baseline_mb)
    return numbers


def _with_first_steps(pp: Dict[str, Any]) -> Dict[str, Any]:
    """``pp_stage_groups`` with each group's first step and first step after a resume."""
    return {**pp, "pp_stage_groups": [{**g, "first_step": first_step_comm(g["step"]),
                                       "resumed_step": resumed_step_comm(g["step"])} for g in pp["pp_stage_groups"]]}


def comm_dims(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, str]:
    """Which mesh dimension each kind of collective runs over: each wing's, in ``DIMS``' order."""
    dims: Dict[str, str] = {}
    for add in DIMS:
        add(cfg, plan, model, dims)
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


def comm_lines(numbers: Dict[str, Any], accum_steps: Optional[int]) -> List[str]:
    """The printout of one full step's collectives."""
    step, kind = numbers["step"], numbers["mesh"]["kind"]
    if step is None:
        return ["  collectives per optimizer step: known once batch.micro_batch_size=auto has chosen the split"]
    tp = numbers["mesh"].get("tp", 1)
    if (tp > 1 or numbers["mesh"].get("pp", 1) > 1) and kind == "ddp":
        kind = "hsdp"  # under tp and pp, ddp's replicas are FSDP2's shard groups of one rank
    # the data-parallel dimensions' collectives first (under tp the totals less tp's), then each wing's
    dp_step = step if tp == 1 else {key: value - step.get(f"tp_{key}", 0) for key, value in step.items()
                                    if not key.startswith("tp_")}
    lines = dp_plan.dp_comm_lines(numbers, dp_step, kind, accum_steps)
    lines += tp_plan.tp_comm_lines(step, tp) if tp > 1 else []
    return lines + ep_plan.ep_comm_lines(numbers) + cp_plan.cp_comm_lines(numbers)


def plan_report(cfg: Config, world_size: int, local_world_size: Optional[int] = None,
                json_path: Optional[Path] = None) -> str:
    if cfg.dist.strategy == "fsdp" and cfg.dist.fsdp.shard_size == "node" and local_world_size is None:
        raise ConfigError("dist.fsdp.shard_size=node: plan mode needs the ranks per node; set plan.nproc_per_node")
    plan = validate(cfg, world_size, local_world_size)
    dataset = build_dataset(cfg.data)
    step_plan = plan_for(dataset, cfg, plan, rank=0)
    # the data ready and no model yet: a run's rank 0 holds the same when it builds its model
    numbers = plan_numbers(cfg, plan, host_baseline_mb=hostmem.resident_mb() if runs_on_cpu(cfg) else None)
    if json_path is not None:
        write_plan_json(numbers, json_path)
    epochs = plan.max_steps / step_plan.steps_per_epoch
    model = meta_model(cfg, Precision(cfg.precision, torch.device("cpu")))  # for the wings' lines
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
        *optim_plan.muon_lines(cfg, numbers, model),
        *fp8_plan.fp8_lines(cfg, plan, numbers, model, plan_numbers),
        *comm_lines(numbers, plan.accum_steps),
        *pp_plan.pp_lines(numbers),
        *rl_plan.rl_lines(cfg, numbers, model),
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
        *([f"  dataset {mixture.NOT_KNOWN} (data.streaming=true): {plan.max_steps} steps "
           f"of {plan.global_batch_size} samples, {plan.max_steps * plan.global_batch_size:,} in all"]
          if getattr(dataset, "standalone", False) else
          mixture.plan_lines(step_plan.mixture, dataset.lengths, dataset.kinds, plan.max_steps)
          if isinstance(step_plan, BlendPlan) else
          [f"  dataset {len(dataset):,} samples: {step_plan.steps_per_epoch} optimizer steps per epoch "
           f"(data.drop_last={cfg.data.get('drop_last', False)}); {plan.max_steps} steps = {epochs:.2f} epochs "
           f"= {math.ceil(epochs)} epoch(s) started"]),
        *([f"  plan.json: {json_path}"] if json_path is not None else []),
    ])

