"""Datasets and the order in which their samples reach ranks and micro-batches.

The order is planned per optimizer step, not per rank. Each epoch has one
seeded permutation of the dataset (the same whatever the world size), cut into
global batches of ``global_batch_size`` samples. Sample j of a step goes to rank
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
from typing import Any, Dict, Iterator, List

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import LOADER_KEYS, BatchPlan, Config, ConfigError
from .signals import STOP_SIGNALS

# One optimizer step on one rank: its micro-batches, each a list of dataset
# indices; an empty list is a placeholder that contributes nothing.
Window = List[List[int]]


def build_dataset(node: Dict[str, Any], **overrides: Any) -> Dataset:
    kwargs = {k: v for k, v in node.items() if k not in LOADER_KEYS and k != "_target_"}
    kwargs.update(overrides)
    try:
        dataset = instantiate({"_target_": node["_target_"]}, **kwargs, _convert_="all")
    except InstantiationException as err:
        if isinstance(err.__cause__, ConfigError):  # the dataset's own check, naming the key: as it is
            raise err.__cause__ from None
        raise
    if dataset is None and overrides.get("split") == "val":
        return None  # the dataset has no held-out part (data=tokens without data.val_path)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise TypeError(f"data._target_={node['_target_']} must return a map-style Dataset (with __len__ and __getitem__)")
    return dataset


class StepPlan:
    """Which samples each rank uses in each micro-batch of each optimizer step."""

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int, shuffle: bool, drop_last: bool):
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

    @classmethod
    def for_config(cls, num_samples: int, cfg: Config, plan: BatchPlan, rank: int) -> "StepPlan":
        """The plan the configuration asks for (data.shuffle defaults to true, data.drop_last to false)."""
        return cls(num_samples, plan, rank, cfg.trainer.seed,
                   cfg.data.get("shuffle", True), cfg.data.get("drop_last", False))

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.plan.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def windows(self, epoch: int, start_step: int = 0) -> Iterator[Window]:
        """This rank's windows for the epoch, from optimizer step ``start_step`` on."""
        order = self.order(epoch).tolist()
        glob, world, micro = self.plan.global_batch_size, self.plan.world_size, self.plan.micro_batch_size
        for step in range(start_step, self.steps_per_epoch):
            samples = order[step * glob:(step + 1) * glob]
            mine = samples[self.rank::world]
            # Rank 0's count of micro-batches, on every rank: the missing ones are
            # empty, i.e. placeholders (only in a short last step).
            rank0_samples = math.ceil(len(samples) / world)
            count = max(1, math.ceil(rank0_samples / micro))
            yield [mine[i * micro:(i + 1) * micro] for i in range(count)]


class _MicroBatchSampler(Sampler[List[int]]):
    """Feeds the DataLoader one micro-batch of indices at a time, in window order."""

    def __init__(self, windows: List[Window], placeholder_index: int):
        self.windows, self.placeholder_index = windows, placeholder_index

    def __iter__(self) -> Iterator[List[int]]:
        for window in self.windows:
            for indices in window:
                yield indices or [self.placeholder_index]

    def __len__(self) -> int:
        return sum(len(w) for w in self.windows)


def epoch_batches(dataset: Dataset, step_plan: StepPlan, epoch: int, start_step: int,
                  num_workers: int, pin_memory: bool) -> Iterator[tuple[Window, List[Any]]]:
    """Yield (window, its collated micro-batches) for each remaining step of an epoch."""
    windows = list(step_plan.windows(epoch, start_step))
    loader = DataLoader(dataset, batch_sampler=_MicroBatchSampler(windows, 0), num_workers=num_workers,
                        pin_memory=pin_memory, worker_init_fn=_ignore_stop_signals,
                        generator=_own_generator(step_plan.seed, step_plan.rank, epoch, start_step))
    batches = iter(loader)
    for window in windows:
        yield window, [next(batches) for _ in window]


def eval_loader(dataset: Dataset, micro_batch_size: int, max_batches: int, rank: int,
                world_size: int, num_workers: int) -> DataLoader:
    """The first ``max_batches`` micro-batches per rank of the held-out split, in order."""
    count = min(len(dataset), max_batches * micro_batch_size * world_size)
    indices = list(range(rank, count, world_size))  # no padding: nothing counted twice
    batches = [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, generator=_own_generator(-1, rank),
                      worker_init_fn=_ignore_stop_signals)


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers ignore the stop signals; the main process finishes the step and stops them.

    torchrun forwards a signal to each worker's whole process group, and Slurm
    and Kubernetes signal every process: a worker killed by SIGTERM would fail
    the main process ("DataLoader worker exited unexpectedly") before it could
    write its checkpoint.
    """
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _own_generator(*key: int) -> torch.Generator:
    """The generator a DataLoader draws its workers' base seed from, seeded by ``key``.

    Without its own generator a DataLoader draws that seed from the global RNG,
    which would shift dropout's random stream whenever a loader starts, and a
    resumed run (which starts one mid-epoch) would differ. The key holds
    trainer.seed, the rank, the epoch and the step the loader starts at, so
    random transforms run in workers (data.num_workers > 0) differ between
    ranks, seeds and epochs. A resumed epoch's workers start new streams: the
    samples and their order continue exactly, random transforms in workers do
    not (with data.num_workers=0 they run on the main process's RNG, which
    checkpoints save and restore).
    """
    return torch.Generator().manual_seed(hash_key(1_000_003, *key))


def hash_key(*values: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike hash())."""
    digest = hashlib.sha256(",".join(str(v) for v in values).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
