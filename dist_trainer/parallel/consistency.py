"""``dist.check_consistency_every``: what should be replicated is bit-identical on every rank."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist


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
