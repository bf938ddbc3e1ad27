"""Distributed wrapping as plain functions: the model code knows nothing of it."""

# No "from __future__ import annotations": DDP inspects the hook's real annotations.

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import DistConfig
from .distributed import DistEnv


ReduceBucket = Callable[[dist.GradBucket, Optional[dist.ProcessGroup]], torch.futures.Future]


@dataclass
class AllreduceCounter:
    """Gradient all-reduces issued by DDP, counted by its communication hook."""

    reduce: ReduceBucket  # how a bucket is all-reduced (the precision mode decides)
    process_group: Optional[dist.ProcessGroup] = None
    calls: int = 0
    bytes: int = 0


def _counting_hook(counter: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    counter.calls += 1
    counter.bytes += buffer.numel() * buffer.element_size()
    return counter.reduce(bucket, counter.process_group)


def apply_ddp(model: nn.Module, env: DistEnv, cfg: DistConfig) -> DDP:
    """Move to the device, convert BatchNorm if asked, wrap in DDP."""
    model = model.to(env.device)
    if cfg.sync_batchnorm:
        from .sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, env.device)
    return DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        # None keeps DDP's own bucketing (a small first bucket); an explicit 25 does not.
        bucket_cap_mb=cfg.bucket_cap_mb,
    )


def count_allreduces(ddp: DDP, reduce: ReduceBucket) -> AllreduceCounter:
    """Route DDP's gradient all-reduce through ``reduce`` and count its calls and bytes."""
    counter = AllreduceCounter(reduce)
    ddp.register_comm_hook(counter, _counting_hook)
    return counter
