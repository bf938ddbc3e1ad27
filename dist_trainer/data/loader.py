"""Datasets and the order in which their samples reach ranks and micro-batches.

The order is planned per optimizer step, not per rank. Each epoch has one
seeded permutation of the dataset (the same whatever the world size), cut into
global batches of ``global_batch_size`` samples. The permutation is a keyed
bijection evaluated position by position (``SampleOrder``), never built: an
epoch starts, and a run resumes at any step, at the same cost for ten samples
or a billion, and a step costs what its own samples cost. Sample j of a step goes to rank
j % world_size, and each rank cuts its share into micro-batches. So the set of
samples in a step does not depend on how it is split over ranks and
micro-batches: that is what lets any split reproduce the one-big-batch update.

The last step of an epoch may hold fewer samples (``data.drop_last=false``, the
default): nothing is repeated to pad it (unlike DistributedSampler), and the
update is normalised by exactly the samples it holds. Every rank still runs as
many micro-batches as rank 0 (which gets the most): a rank with fewer samples
fills the rest with placeholder micro-batches whose loss counts zero. So every
rank issues the same collectives, including any inside the model's forward and
backward (synchronized BatchNorm all-reduces in both). With
``data.drop_last=true`` that remainder is dropped instead.
"""

from __future__ import annotations

import hashlib
import math
import signal
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from ..config import LOADER_KEYS, BatchPlan, Config, ConfigError
from ..signals import stop_signals

# One optimizer step on one rank: its micro-batches, each a list of dataset
# indices; an empty list is a placeholder that contributes nothing.
Window = List[List[int]]
STREAM_NAME = "stream"  # a standalone streaming dataset's name, a key of its order and of its checkpoint state


def build_dataset(node: Dict[str, Any], **overrides: Any) -> Dataset:
    kwargs = {k: v for k, v in node.items() if k not in LOADER_KEYS and k != "_target_"}
    kwargs.update(overrides)
    # data=blend builds its sources itself: a custom source's _target_ is its own, not for Hydra to call here
    recursive = node["_target_"] != "dist_trainer.data.blend.blend"
    try:
        dataset = instantiate({"_target_": node["_target_"]}, **kwargs, _convert_="all", _recursive_=recursive)
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):  # the dataset's own check, naming the key: as it is
            raise err.__cause__ from None
        raise
    if dataset is None and overrides.get("split") == "val":
        return None  # the dataset has no held-out part (data=tokens without data.val_path)
    if getattr(dataset, "streaming", False):  # data.streaming=true: a one-source blend, ordered by a BlendPlan
        from .blend import Blend

        dataset = Blend([STREAM_NAME], [dataset], [node["_target_"].rsplit(".", 1)[-1]], standalone=True)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"data._target_={node['_target_']} must return a map-style Dataset (with __len__ and __getitem__)")
    return dataset


class StepPlan:
    """Which samples each rank uses in each micro-batch of each optimizer step."""

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int, shuffle: bool, drop_last: bool,
                 group: int = 1, repeat: int = 1):
        if num_samples < 1:
            raise ConfigError("data._target_ returned an empty dataset: it has no sample to train on")
        if drop_last and num_samples < plan.global_batch_size:
            raise ConfigError(
                f"data.drop_last=true drops everything: the dataset has {num_samples} samples, fewer than "
                f"batch.global_batch_size={plan.global_batch_size}; lower batch.global_batch_size or set "
                "data.drop_last=false"
            )
        self.num_samples, self.plan, self.rank = num_samples, plan, rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        # Samples that go together (task=grpo: a prompt's completions): the order permutes whole groups of
        # ``group`` consecutive samples, so a group is never cut between two steps (the global batch is a
        # multiple of it); inside a step its samples still go to ranks one by one.
        if num_samples % group or plan.global_batch_size % group:
            raise ValueError(f"{num_samples} samples and a global batch of {plan.global_batch_size} are not whole "
                             f"groups of {group}")
        self.group = group
        # Optimizer steps per global batch (task=grpo's rl.inner_steps: each step's rollouts are trained by that
        # many updates): the order's step s is its batch s // repeat, so an epoch is that many times as long.
        self.repeat = repeat

    @classmethod
    def for_config(cls, num_samples: int, cfg: Config, plan: BatchPlan, rank: int) -> "StepPlan":
        """The plan the configuration asks for (data.shuffle defaults to true, data.drop_last to false)."""
        grpo = cfg.task == "grpo"
        return cls(num_samples, plan, rank, cfg.trainer.seed, cfg.data.get("shuffle", True),
                   cfg.data.get("drop_last", False), cfg.rl.group_size if grpo else 1, cfg.rl.inner_steps if grpo else 1)

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.plan.global_batch_size)
        return (full + (1 if rest and not self.drop_last else 0)) * self.repeat

    def sample_order(self, epoch: int) -> "SampleOrder":
        """Position in the epoch -> sample index: a seeded bijection, computed on the fly (O(1) to start)."""
        order = SampleOrder(self.num_samples // self.group, hash_key(self.seed, epoch) if self.shuffle else None)
        return order if self.group == 1 else GroupedOrder(order, self.group)

    def order(self, epoch: int) -> torch.Tensor:
        """The whole epoch's order, materialised (for inspection and tests; training never builds it)."""
        return torch.from_numpy(self.sample_order(epoch)(np.arange(self.num_samples)))

    def micro_batches(self, step: int) -> int:
        """Micro-batches every rank runs in step ``step`` of an epoch: rank 0's count (it gets the most)."""
        glob, world, micro = self.plan.global_batch_size, self.plan.data_ranks, self.plan.micro_batch_size
        size = min(glob, self.num_samples - step // self.repeat * glob)
        return max(1, math.ceil(math.ceil(size / world) / micro))

    def windows(self, epoch: int, start_step: int = 0) -> Iterator[Window]:
        """This rank's windows for the epoch, from optimizer step ``start_step`` on, each computed when asked."""
        order = self.sample_order(epoch)
        glob, world, micro = self.plan.global_batch_size, self.plan.data_ranks, self.plan.micro_batch_size
        for step in range(start_step, self.steps_per_epoch):
            begin = step // self.repeat * glob
            size = min(glob, self.num_samples - begin)
            # Positions rank, rank + world, ... of the step: sample j of a step goes to rank j % world.
            mine = order(np.arange(begin + self.rank, begin + size, world)).tolist()
            # Rank 0's count of micro-batches, on every rank: the missing ones are
            # empty, i.e. placeholders (only in a short last step).
            yield [mine[i * micro:(i + 1) * micro] for i in range(self.micro_batches(step))]


class GroupedOrder:
    """Position -> sample index where samples come in groups of ``group``: the groups permuted, each in order."""

    def __init__(self, groups: "SampleOrder", group: int):
        self.groups, self.group = groups, group

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        return self.groups(positions // self.group) * self.group + positions % self.group


class SampleOrder:
    """A seeded permutation of ``range(n)``, evaluated position by position: nothing is materialised.

    A balanced Feistel network (6 rounds of a splitmix64 mix, keyed by
    ``key``) permutes ``[0, 2**bits)`` for the smallest even ``bits`` with
    ``2**bits >= n``; cycle walking (encrypt again while the result is >= n)
    turns that into a permutation of ``[0, n)``, at most 4 encryptions per
    position on average. Pure integer arithmetic on uint64: the same order on
    every rank and machine. ``key=None``: the identity (no shuffle).
    """

    ROUNDS = 6

    def __init__(self, n: int, key: Optional[int]):
        self.n, self.key = n, key
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        self.keys = [np.uint64(hash_key(key, r)) for r in range(self.ROUNDS)] if key is not None else []

    @staticmethod
    def _mix(z: np.ndarray) -> np.ndarray:
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (self._mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if self.key is None or x.size == 0:
            return x.astype(np.int64)
        with np.errstate(over="ignore"):  # the mix multiplies modulo 2**64 on purpose
            x = self._encrypt(x)
            outside = x >= self.n
            while outside.any():
                x[outside] = self._encrypt(x[outside])
                outside = x >= self.n
        return x.astype(np.int64)


class _MicroBatchSampler(Sampler[List[tuple]]):
    """Feeds the DataLoader one micro-batch of keys at a time, in window order, computed as it goes.

    A key is ``(epoch, start_step, index)``: it travels to the DataLoader
    worker with the index, so a worker that lives across epochs knows which
    epoch (and which resumed start) a sample belongs to. ``epoch`` and
    ``start_step`` are set by :class:`TrainLoader` before each pass.
    """

    def __init__(self, step_plan: StepPlan, epoch: int, start_step: int, placeholder_index: int):
        self.step_plan, self.epoch, self.start_step = step_plan, epoch, start_step
        self.placeholder_index = placeholder_index

    def __iter__(self) -> Iterator[List[tuple]]:
        epoch, start = self.epoch, self.start_step
        for window in self.step_plan.windows(epoch, start):
            for indices in window:
                yield [(epoch, start, i) for i in (indices or [self.placeholder_index])]

    def __len__(self) -> int:
        plan, steps = self.step_plan, self.step_plan.steps_per_epoch
        if steps <= self.start_step:
            return 0
        # Every step but the last holds a full global batch: accum_steps micro-batches.
        return (steps - 1 - self.start_step) * plan.plan.accum_steps + plan.micro_batches(steps - 1)


class _Keyed(Dataset):
    """The dataset as the training loader sees it: items by ``(epoch, start_step, index)`` keys.

    A dataset that declares ``keyed_by_epoch`` (its items depend on the epoch,
    e.g. masked-LM masks) gets ``(epoch, index)``; any other gets ``index``.
    In a DataLoader worker the process RNGs (torch, random, numpy) are
    reseeded when the first sample of a new pass arrives: workers persist
    across epochs, and random transforms must still differ by epoch, rank and
    trainer.seed. In the main process (data.num_workers=0) nothing is
    reseeded: the samples draw from the main RNG, which checkpoints restore.
    """

    def __init__(self, dataset: Dataset, seed: int, rank: int):
        self.dataset, self.seed, self.rank = dataset, seed, rank
        self.by_epoch = bool(getattr(dataset, "keyed_by_epoch", False))
        self._pass: Optional[tuple] = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple) -> Any:
        epoch, start, index = key
        if self._pass != (epoch, start):
            self._pass = (epoch, start)
            worker = torch.utils.data.get_worker_info()
            if worker is not None:
                _seed_process(hash_key(1_000_003, self.seed, self.rank, epoch, start, worker.id))
        return self.dataset[(epoch, index) if self.by_epoch else index]


def _seed_process(seed: int) -> None:
    import random

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class TrainLoader:
    """One DataLoader for the whole run: its workers start once and serve every epoch.

    With ``num_workers > 0`` the workers persist (a new epoch, or the pass
    after a resume, reuses them), each keeps ``prefetch_factor`` micro-batches
    ready, and batches land in pinned memory on CUDA so the copy to the device
    can be asynchronous.
    """

    def __init__(self, dataset: Dataset, step_plan: StepPlan, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: Optional[int] = None):
        self.step_plan = step_plan
        self.sampler = _MicroBatchSampler(step_plan, 0, 0, 0)
        workers = {"persistent_workers": True, "prefetch_factor": prefetch_factor or 2} if num_workers else {}
        self.loader = DataLoader(_Keyed(dataset, step_plan.seed, step_plan.rank), batch_sampler=self.sampler,
                                 num_workers=num_workers, pin_memory=pin_memory, worker_init_fn=_ignore_stop_signals,
                                 generator=_own_generator(step_plan.seed, step_plan.rank),
                                 collate_fn=collate_of(dataset), **workers)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[Window, List[Any]]]:
        """Yield (window, its collated micro-batches) for each remaining step of ``epoch``."""
        self.sampler.epoch, self.sampler.start_step = epoch, start_step
        batches = iter(self.loader)
        for window in self.step_plan.windows(epoch, start_step):  # the sampler's windows, computed again: cheap
            yield window, [next(batches) for _ in window]


def epoch_batches(dataset: Dataset, step_plan: StepPlan, epoch: int, start_step: int,
                  num_workers: int, pin_memory: bool) -> Iterator[tuple[Window, List[Any]]]:
    """One epoch's (window, micro-batches) from a loader of its own (tests and benchmarks)."""
    loader = TrainLoader(dataset, step_plan, num_workers, pin_memory)
    yield from loader.epoch(epoch, start_step)


def eval_loader(dataset: Dataset, micro_batch_size: int, max_batches: int, rank: int,
                world_size: int, num_workers: int, lockstep: bool = False) -> DataLoader:
    """The first ``max_batches`` micro-batches per rank of the held-out split, in order.

    ``lockstep``: every rank the same number of batches, the split cut to a multiple of the ranks (at most
    ``world_size - 1`` samples fewer): where a forward is a collective (fsdp's and hsdp's gathers, tp's and pp's
    exchanges, expert parallelism's all-to-alls), so that no rank waits in one the others never issue."""
    count = min(len(dataset), max_batches * micro_batch_size * world_size)
    if lockstep:
        count -= count % world_size
    indices = list(range(rank, count, world_size))  # no padding: nothing counted twice
    batches = [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, generator=_own_generator(-1, rank),
                      worker_init_fn=_ignore_stop_signals, persistent_workers=num_workers > 0,
                      collate_fn=collate_of(dataset))


def collate_of(dataset: Dataset) -> Callable[[List[Any]], Any]:
    """The dataset's own ``collate`` (samples of different lengths, e.g. data=hf_chat pads), else PyTorch's."""
    return getattr(dataset, "collate", None) or default_collate


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore the stop signals; the main process finishes the step and stops them.

    torchrun forwards a signal to each worker's whole process group, and Slurm
    and Kubernetes signal every process: a worker killed by SIGTERM would fail
    the main process ("DataLoader worker exited unexpectedly") before it could
    write its checkpoint.
    """
    for sig in (*stop_signals(), signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _own_generator(*key: int) -> torch.Generator:
    """The generator a DataLoader draws its base seed from, seeded by ``key``.

    Without its own generator a DataLoader draws that seed from the global RNG
    each time it is iterated, which would shift dropout's random stream, and a
    resumed run would differ. (The training loader's workers are reseeded per
    pass by ``_Keyed`` from trainer.seed, the rank, the epoch and the start
    step: a resumed epoch's workers start new streams, the samples and their
    order continue exactly.)
    """
    return torch.Generator().manual_seed(hash_key(1_000_003, *key))


def hash_key(*values: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike hash())."""
    digest = hashlib.sha256(",".join(str(v) for v in values).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
