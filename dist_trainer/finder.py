"""batch.micro_batch_size=auto: the largest micro-batch that fits, agreed by every rank.

Trials run forward and backward on the unwrapped model (no DDP collective
inside, so a rank that runs out of memory cannot leave another waiting in an
all-reduce), with ballast the size of the optimizer state that training will
hold. After each trial one MIN all-reduce of "it fitted" makes every rank take
the same branch of the search, so all ranks pick the same size. A trial leaves
no trace: the module's buffers (BatchNorm's running statistics) and the RNG
streams (dropout, random transforms) are put back as they were, so training
starts exactly as it would have with that micro-batch size given explicitly.
"""

from __future__ import annotations

import gc
import logging
import traceback
from typing import Callable, List

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from .checkpoint import capture_rng, restore_rng
from .data import collate_of

log = logging.getLogger("dist_trainer")


def _fits_everywhere(trial: Callable[[int], None], size: int, device: torch.device) -> bool:
    fitted = 1
    try:
        trial(size)
    except torch.OutOfMemoryError as err:
        fitted = 0
        traceback.clear_frames(err.__traceback__)  # the frames hold the tensors that did not fit
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flag = torch.tensor([fitted], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def find_micro_batch_size(trial: Callable[[int], None], limit: int, device: torch.device, start: int = 1) -> int:
    """Largest size <= limit for which trial(size) fits on every rank (0 if none does).

    Doubles from ``start`` until a trial fails on some rank or the limit is
    reached, then bisects between the last size that fitted and the first that did not.
    """
    good, bad, size = 0, limit + 1, min(start, limit)
    while size <= limit:
        if not _fits_everywhere(trial, size, device):
            bad = size
            break
        good = size
        if size == limit:
            return good
        size = min(size * 2, limit)
    while bad - good > 1:
        middle = (good + bad) // 2
        if _fits_everywhere(trial, middle, device):
            good = middle
        else:
            bad = middle
    return good


def model_trial(model: nn.Module, dataset: Dataset, autocast: Callable, optimizer_params: List[torch.Tensor],
                states_per_param: int, device: torch.device) -> Callable[[int], None]:
    """A trial that runs one forward and backward of ``size`` samples with optimizer-state ballast."""

    def trial(size: int) -> None:
        buffers = [b.detach().clone() for b in model.buffers()]
        rng = capture_rng(device)  # python, numpy and torch: the dataset's transforms draw too
        try:
            ballast = [torch.empty_like(p) for p in optimizer_params for _ in range(states_per_param)]
            batch = collate_of(dataset)([dataset[i % len(dataset)] for i in range(size)])
            batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)
            with autocast():
                output = model(batch)
            loss = output["loss_sum"] if isinstance(output, dict) else output
            loss.float().backward()
            del ballast, batch, output, loss
        finally:
            for p in model.parameters():
                p.grad = None
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers):
                    b.copy_(saved)
            restore_rng(rng, device)

    return trial


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The micro-batch must divide the per-rank share of the global batch."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)
