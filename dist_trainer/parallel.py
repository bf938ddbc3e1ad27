"""Distributed wrapping as plain functions: the model code knows nothing of it."""

# No "from __future__ import annotations": DDP inspects the hook's real annotations.

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

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
    # Bytes per gradient element that ``reduce`` sends: None, the bucket's own dtype;
    # 4 in master modes, which all-reduce an FP32 copy of half-precision buckets.
    sent_element_size: Optional[int] = None


def _counting_hook(counter: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    counter.calls += 1
    counter.bytes += buffer.numel() * (counter.sent_element_size or buffer.element_size())
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


def count_allreduces(ddp: DDP, reduce: ReduceBucket, sent_element_size: Optional[int] = None) -> AllreduceCounter:
    """Route DDP's gradient all-reduce through ``reduce`` and count its calls and bytes."""
    counter = AllreduceCounter(reduce, sent_element_size=sent_element_size)
    ddp.register_comm_hook(counter, _counting_hook)
    return counter


class ConsistencyError(RuntimeError):
    """Ranks that should hold identical tensors do not."""


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_consistency(named: List[Tuple[str, torch.Tensor]], step: int) -> None:
    """Raise, on every rank alike, naming the first tensor not bit-identical to rank 0's.

    One broadcast per dtype of everything concatenated; compared as integers,
    so NaNs and signed zeros count too. Each rank finds its first mismatch, and
    a MIN all-reduce makes every rank raise about the same tensor.
    """
    first_bad = len(named)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        mine = torch.cat([named[i][1].detach().reshape(-1) for i in indices])
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        as_int = _SAME_SIZE_INT[mine.element_size()]
        equal = mine.view(as_int) == ref.view(as_int)
        offset = 0
        for i in indices:
            n = named[i][1].numel()
            if not bool(equal[offset:offset + n].all()):
                first_bad = min(first_bad, i)
                break
            offset += n
    flag = torch.tensor([first_bad], dtype=torch.int64, device=named[0][1].device if named else None)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < len(named):
        raise ConsistencyError(
            f"step {step}: {named[flag.item()][0]} is not bit-identical across ranks (checked against rank 0; "
            f"dist.check_consistency_every found it). Ranks have diverged: look for rank-dependent code in "
            "the model or optimizer, or non-deterministic kernels."
        )
