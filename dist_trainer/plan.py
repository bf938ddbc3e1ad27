"""Plan mode: the derived numbers of a job, without training and without a process group.

``python -m dist_trainer plan.only=true plan.world_size=64`` validates the
config exactly as the trainer would for 64 ranks (an impossible split fails
the same way) and prints what one optimizer step costs.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
from hydra.utils import instantiate

from .config import Config, validate
from .data import StepPlan, build_dataset
from .parallel import find_blocks
from .precision import Precision

MIB = 2**20
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's smaller first bucket when bucket_cap_mb is left to it
DEFAULT_BUCKET_MB = 25.0


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


def _optimizer_state_elements(cfg: Config, elements: int, tensors: int) -> int:
    """FP32 elements of optimizer state for ``elements`` weights in ``tensors`` tensors."""
    if cfg.optim.name == "adamw":
        return 2 * elements + tensors  # exp_avg, exp_avg_sq, and one scalar step per tensor
    return elements if cfg.optim.momentum > 0 else 0  # SGD's momentum buffer


def expected_state_bytes(cfg: Config, params: List[torch.Tensor], world_size: int) -> int:
    """Model state one rank holds after an optimizer step (what ``state_mb`` measures), on the largest rank.

    ddp: every rank holds the parameters and their gradients in the parameters' dtype,
    the FP32 masters and their FP32 gradients in master modes, and the optimizer's
    FP32 state. fsdp: each tensor is cut in ``world_size`` chunks along its first
    dimension (rank 0's is the largest); rank 0 holds its chunk of the FP32 parameter
    (which is the master in master modes), of its FP32 gradient and of the optimizer state.
    """
    tensors = len(params)
    if cfg.dist.strategy == "fsdp":
        local = 0
        for p in params:
            rows = p.shape[0] if p.ndim else 1
            local += min(math.ceil(rows / world_size), rows) * (p.numel() // max(rows, 1))
        return 4 * (2 * local + _optimizer_state_elements(cfg, local, tensors))
    elements = sum(p.numel() for p in params)
    own = 2 * sum(p.numel() * p.element_size() for p in params)  # parameters and their gradients
    masters = 2 * 4 * elements if cfg.precision.name.endswith("-master") else 0
    return own + masters + 4 * _optimizer_state_elements(cfg, elements, tensors)


def plan_report(cfg: Config, world_size: int) -> str:
    plan = validate(cfg, world_size)
    dataset = build_dataset(cfg.data)
    step_plan = StepPlan.for_config(len(dataset), cfg, plan, rank=0)
    precision = Precision(cfg.precision, torch.device("cpu"))
    with torch.device("meta"):  # shapes and dtypes only: no memory, no initialisation cost
        model = instantiate(cfg.model, _convert_="all")
        if cfg.dist.strategy == "ddp":  # fsdp keeps FP32 shards and casts when it gathers
            precision.prepare(model)
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    buckets = expected_buckets(params, cfg.dist.bucket_cap_mb)
    sent = precision.weights_type.sent_element_size  # master modes send FP32 copies of half buckets
    bucket_bytes = [n * (sent or dtype.itemsize) for dtype, n in buckets]
    stats_bytes = (5 + world_size) * 8  # the step's one float64 all-reduce of totals and flags
    epochs = plan.max_steps / step_plan.steps_per_epoch
    auto = cfg.batch.micro_batch_size == "auto"
    split = (f"  micro batch auto (the largest that fits, chosen on the GPU at start-up) x accum steps "
             f"{plan.global_batch_size // world_size} / micro x world {world_size}"
             if auto else f"  micro batch {plan.micro_batch_size} x accum steps {plan.accum_steps} x world {world_size}")
    no_sync = ("accum steps times that" if auto else f"{len(buckets) * plan.accum_steps}")
    state = expected_state_bytes(cfg, params, world_size)
    if cfg.dist.strategy == "fsdp":
        units = len(find_blocks(model, cfg.dist.blocks)) + 1
        every = cfg.dist.fsdp.accum_sync == "every"
        comm = (f"  gradient reduce-scatters per optimizer step: {units * plan.accum_steps if every else units} "
                f"(FSDP units: each block, then the root{', with every micro-batch' if every else ', once'}; "
                f"dist.fsdp.accum_sync={cfg.dist.fsdp.accum_sync}), {4 * count / MIB:.2f} MiB of FP32 gradients "
                "each time all units reduce; no gradient all-reduce")
    else:
        comm = (f"  gradient all-reduces per optimizer step: {len(buckets)} (DDP buckets, expected), "
                f"{sum(bucket_bytes) / MIB:.2f} MiB ({sum(bucket_bytes)} bytes); without no_sync it would be {no_sync}")
    return "\n".join([
        f"plan for world size {world_size} (no process group, nothing trained)",
        f"{split} = global batch {plan.global_batch_size} samples per optimizer step"
        + (f" ({plan.global_batch_size * dataset.block_size:,} tokens of data.block_size={dataset.block_size})"
           if isinstance(getattr(dataset, "block_size", None), int) else ""),
        f"  lr {plan.base_lr:g} -> {plan.lr:g} (optim.lr_scaling={cfg.optim.lr_scaling}"
        + (f", optim.base_batch_size={cfg.optim.base_batch_size})" if cfg.optim.lr_scaling != "none" else ")"),
        f"  model {count:,} trainable parameters, precision {cfg.precision.name}",
        comm,
        f"  plus 1 all-reduce of {stats_bytes + 8 * (cfg.dist.strategy == 'fsdp')} bytes "
        "(loss, item count, skip and stop flags" + (", squared shard norms)" if cfg.dist.strategy == "fsdp" else ")"),
        f"  model state per rank after an optimizer step: {state / MIB:.2f} MiB ({state} bytes; state_mb, "
        f"dist.strategy={cfg.dist.strategy}, parameters, gradients, optimizer state"
        + (", FP32 masters)" if cfg.precision.name.endswith("-master") else ")"),
        f"  dataset {len(dataset):,} samples: {step_plan.steps_per_epoch} optimizer steps per epoch "
        f"(data.drop_last={cfg.data.get('drop_last', False)}); {plan.max_steps} steps = {epochs:.2f} epochs "
        f"= {math.ceil(epochs)} epoch(s) started",
    ])
