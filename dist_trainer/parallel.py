"""Distributed wrapping as plain functions: the model code knows nothing of it."""

# No "from __future__ import annotations": DDP inspects the hook's real annotations.

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import DistConfig
from .distributed import DistEnv


@dataclass
class AllreduceCounter:
    """Gradient all-reduces issued by DDP, counted by its communication hook."""

    process_group: dist.ProcessGroup | None = None
    calls: int = 0
    bytes: int = 0


def _counting_allreduce(counter: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    counter.calls += 1
    counter.bytes += buffer.numel() * buffer.element_size()
    # The default hook: divide by world size, then all-reduce (sum) the bucket.
    return default_hooks.allreduce_hook(counter.process_group, bucket)


def apply_ddp(model: nn.Module, env: DistEnv, cfg: DistConfig) -> tuple[DDP, AllreduceCounter]:
    """Move to the device, convert BatchNorm if asked, wrap in DDP, count all-reduces."""
    model = model.to(env.device)
    if cfg.sync_batchnorm:
        from .sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, env.device)
    ddp = DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        # None keeps DDP's own bucketing (a small first bucket); an explicit 25 does not.
        bucket_cap_mb=cfg.bucket_cap_mb,
    )
    counter = AllreduceCounter()
    ddp.register_comm_hook(counter, _counting_allreduce)
    return ddp, counter
