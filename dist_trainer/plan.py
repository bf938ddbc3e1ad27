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
from .precision import Precision

MIB = 2**20
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's smaller first bucket when bucket_cap_mb is left to it
DEFAULT_BUCKET_MB = 25.0


def expected_buckets(param_bytes: List[tuple[torch.dtype, int]], bucket_cap_mb: float | None) -> List[int]:
    """Sizes in bytes of DDP's gradient buckets, as DDP fills them.

    Gradients become ready roughly in reverse order of the parameters; DDP
    fills buckets in that order, one dtype per bucket, closing a bucket once it
    reaches its cap (the first is capped at 1 MiB when the cap is DDP's default).
    """
    cap = (bucket_cap_mb or DEFAULT_BUCKET_MB) * MIB
    first_cap = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    sizes: List[int] = []
    open_buckets: Dict[torch.dtype, int] = {}
    for dtype, nbytes in reversed(param_bytes):
        filled = open_buckets.get(dtype, 0) + nbytes
        if filled >= (first_cap if not sizes else cap):
            sizes.append(filled)
            filled = 0
        open_buckets[dtype] = filled
    return sizes + [b for b in open_buckets.values() if b > 0]


def plan_report(cfg: Config, world_size: int) -> str:
    plan = validate(cfg, world_size)
    dataset = build_dataset(cfg.data)
    step_plan = StepPlan.for_config(len(dataset), cfg, plan, rank=0)
    precision = Precision(cfg.precision, torch.device("cpu"))
    with torch.device("meta"):  # shapes and dtypes only: no memory, no initialisation cost
        model = precision.prepare(instantiate(cfg.model, _convert_="all"))
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    if precision.param_dtype is not None:  # master modes all-reduce the FP32 window sum
        grad_bytes = [(torch.float32, p.numel() * 4) for p in params]
    else:
        grad_bytes = [(p.dtype, p.numel() * p.element_size()) for p in params]
    buckets = expected_buckets(grad_bytes, cfg.dist.bucket_cap_mb)
    stats_bytes = (5 + world_size) * 8  # the step's one float64 all-reduce of totals and flags
    epochs = plan.max_steps / step_plan.steps_per_epoch
    return "\n".join([
        f"plan for world size {world_size} (no process group, nothing trained)",
        f"  micro batch {plan.micro_batch_size} x accum steps {plan.accum_steps} x world {world_size} "
        f"= global batch {plan.global_batch_size} samples per optimizer step",
        f"  lr {plan.base_lr:g} -> {plan.lr:g} (optim.lr_scaling={cfg.optim.lr_scaling}"
        + (f", optim.base_batch_size={cfg.optim.base_batch_size})" if cfg.optim.lr_scaling != "none" else ")"),
        f"  model {count:,} trainable parameters, precision {cfg.precision.name}",
        f"  gradient all-reduces per optimizer step: {len(buckets)} (DDP buckets, expected), "
        f"{sum(buckets) / MIB:.2f} MiB ({sum(buckets)} bytes); without no_sync it would be {len(buckets) * plan.accum_steps}",
        f"  plus 1 all-reduce of {stats_bytes} bytes (loss, item count, skip and stop flags)",
        f"  dataset {len(dataset):,} samples: {step_plan.steps_per_epoch} optimizer steps per epoch "
        f"(data.drop_last={cfg.data.get('drop_last', False)}); {plan.max_steps} steps = {epochs:.2f} epochs "
        f"= {math.ceil(epochs)} epoch(s) started",
    ])
