"""Which rank is slow: each step's slowest and fastest rank, and a warning when one lags for 20 steps.

Every rank puts its own data wait and compute time into its slots of the
step's one all-reduce (trainer._reduce_window), so every rank learns all of
them with no extra collective. A rank's compute time runs from its
micro-batches' arrival to the moment it issued its last gradient reduction:
what it did before it could wait for anyone. Under ddp that excludes every
wait for a peer (DDP only waits after the last bucket is issued); under fsdp
the forward's all-gathers can still wait for a slower peer, so a compute
straggler there shows in its peers' time as much as in its own.

Data wait is the time a rank waited for its micro-batches: a slow disk, a
slow transform or too few loader workers on one rank make it the straggler.
"""

from __future__ import annotations

import logging
import socket
import statistics
from typing import Dict, List, Sequence

import torch.distributed as dist

log = logging.getLogger("dist_trainer")

WINDOW_STEPS = 20  # steps a rank must lag over before it is named
LAG = 1.20  # slower than the median rank by more than 20 %
WARMUP_STEPS = 5  # the first steps of an attempt (compilation, allocator warm-up) are not judged


def figures(data_times: Sequence[float], compute_times: Sequence[float]) -> Dict[str, float]:
    """The slowest and fastest rank's data wait and compute time, and which ranks they were."""
    out: Dict[str, float] = {}
    for name, values in (("data_time", data_times), ("compute_time", compute_times)):
        if not values:
            continue
        slow = max(range(len(values)), key=values.__getitem__)
        fast = min(range(len(values)), key=values.__getitem__)
        out.update({f"{name}_max_s": values[slow], f"{name}_max_rank": slow,
                    f"{name}_min_s": values[fast], f"{name}_min_rank": fast})
    return out


def gather_hosts(world_size: int) -> List[str]:
    """Every rank's host name, once at start-up (every rank calls it)."""
    hosts: List[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts


class StragglerWatch:
    """Sums each rank's data wait and compute over windows of 20 steps and names a rank that lags."""

    def __init__(self, hosts: List[str], warn: bool):
        self.hosts, self.warn = hosts, warn
        self.warned: set = set()  # each rank is named once per attempt: the figures carry on in metrics.jsonl
        self._reset()

    def _reset(self) -> None:
        self.busy = [0.0] * len(self.hosts)
        self.data = [0.0] * len(self.hosts)
        self.steps, self.first = 0, None

    def after_step(self, step: int, seen: int, data_times: Sequence[float], compute_times: Sequence[float]) -> None:
        """``seen``: steps of this attempt so far (the first ones are not judged)."""
        if seen <= WARMUP_STEPS or len(data_times) < 2:
            return
        self.first = self.first or step
        for r, (d, c) in enumerate(zip(data_times, compute_times)):
            self.busy[r] += d + c
            self.data[r] += d
        self.steps += 1
        if self.steps == WINDOW_STEPS:
            self._judge(step)
            self._reset()

    def _judge(self, step: int) -> None:
        median = statistics.median(self.busy)
        slow = max(range(len(self.busy)), key=self.busy.__getitem__)
        if median <= 0 or self.busy[slow] <= LAG * median or slow in self.warned:
            return
        self.warned.add(slow)
        if self.warn:
            n = self.steps
            log.warning("straggler: rank %d (host %s) was %.0f%% slower than the median rank over steps %d-%d: "
                        "%.3f s a step against %.3f s (data wait %.3f s a step; the median rank's %.3f s). "
                        "metrics.jsonl has each step's slowest and fastest rank",
                        slow, self.hosts[slow], 100 * (self.busy[slow] / median - 1), self.first, step,
                        self.busy[slow] / n, median / n, self.data[slow] / n, statistics.median(self.data) / n)
