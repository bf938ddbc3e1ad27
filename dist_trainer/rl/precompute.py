"""``rl.reference=precomputed``: the reference's log-probabilities taken once, before the first step, by the model as
built, kept beside the pairs' tokens in the data cache and reused by every later run and resume of the same model
on the same data, so no reference forward runs while training.

Each pair is measured alone: one batch of its two rows, padded to its own longer side only, without gradients and
in eval mode (no dropout), under the run's autocast. So a pair's two values depend neither on the world size nor on
how a step is split, and every rank of every later run reads the same numbers. Pair i is measured on rank i % world;
every rank runs as many forward passes (under fsdp each is a collective), a rank short of pairs measuring one again
and dropping its values. An all_reduce of a zero [N, 2] float64 tensor in which each rank wrote its own rows then
gives every rank all of them, exactly (x + 0 = x, and FP32 values are exact in float64).

The cache: ``<the pairs' cache>/ref_logps.<split>.<key>.npy``, float64 [N, 2] (chosen, rejected), the key a sha256
of the model as built (every parameter, whole, by name: under fsdp gathered one tensor at a time, so ddp and fsdp
give the same), ``model`` resolved (what shapes the forward beyond the weights: rope, attention), the precision's
name and the split. Written atomically (a name of its own, then os.replace) by each node's first rank: the ranks of
a node share the pairs' cache, as data=hf_preference requires; every rank already holds the values it writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..checkpoint import digest_of
from ..compiling import eager_eval
from ..config import Config
from ..data.hf_text import agreed
from ..parallel.state import WholeTensors
from ..precision import Precision
from .checks import reference_kind
from .dpo import answer_logps, evaluation

log = logging.getLogger("dist_trainer")

CACHE_VERSION = 1


def attach(cfg: Config, strategy: Any, precision: Precision, device: torch.device, train_set: Any,
           eval_set: Any) -> Tuple[Any, Any]:
    """The train and val pairs with their reference values (``Pairs.with_reference``), read from the cache or
    computed now; the datasets as they are unless rl.reference=precomputed. Every rank calls it, before the loader
    is made and before a checkpoint is loaded (the values are the model's as built, at every resume alike)."""
    if cfg.task != "dpo" or reference_kind(cfg) != "precomputed":
        return train_set, eval_set
    weights = model_digest(strategy.module, device)
    return tuple(None if data is None else data.with_reference(reference_values(cfg, data, weights, strategy,
                                                                                precision, device))
                 for data in (train_set, eval_set))


def model_digest(module: nn.Module, device: torch.device) -> str:
    """sha256 of every parameter of the model, whole, by sorted name (checkpoint.digest_of), equal on every rank:
    rank 0 is given each whole tensor (a shard's gathered first: a collective of every rank) and broadcasts it."""
    params = dict(sorted(module.named_parameters()))
    digest = [digest_of(WholeTensors(params, {}, device))]  # rank 0's is of the model; the others', of nothing
    dist.broadcast_object_list(digest, src=0)
    return digest[0]


def cache_path(cfg: Config, data: Any, weights: str) -> Path:
    """Where the values of ``data``'s split live: beside its tokens, keyed by the model as built and the run's
    forward (the resolved model config, the precision)."""
    key = hashlib.sha256(json.dumps({"version": CACHE_VERSION, "weights": weights, "model": cfg.model,
                                     "precision": cfg.precision.name, "split": data.split},
                                    sort_keys=True, default=str).encode()).hexdigest()
    return Path(data.directory) / f"ref_logps.{data.split}.{key}.npy"


def reference_values(cfg: Config, data: Any, weights: str, strategy: Any, precision: Precision,
                     device: torch.device) -> np.ndarray:
    """float64 [N, 2] of ``data``'s pairs: the cache's if every rank finds it, else computed and written."""
    path, main = cache_path(cfg, data, weights), dist.get_rank() == 0
    values = agreed(lambda: _read(path, len(data)))
    found = torch.tensor([float(values is not None)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)  # all ranks compute, or none: the forwards are collectives
    if found.item():
        if main:
            log.info("rl.reference=precomputed: reused the %s split's reference log-probabilities of %d pairs "
                     "from %s", data.split, len(data), path)
        return values
    started = time.perf_counter()
    values = compute(data, strategy, precision, device, cfg.trainer.compile)
    agreed(lambda: _write(path, values) if distributed.local_rank() == 0 else None)
    if main:
        log.info("rl.reference=precomputed: computed the %s split's reference log-probabilities of %d pairs in "
                 "%.1f s (%d forward passes a rank), saved to %s", data.split, len(data),
                 time.perf_counter() - started, math.ceil(len(data) / dist.get_world_size()), path)
    return values


def compute(data: Any, strategy: Any, precision: Precision, device: torch.device, compiled: bool) -> np.ndarray:
    """Each pair's (chosen, rejected) log-probabilities under the model as it is, the pair alone in its batch:
    pair i on rank i % world, then every rank given all of them."""
    count, world, rank = len(data), dist.get_world_size(), dist.get_rank()
    values = torch.zeros(count, 2, dtype=torch.float64, device=device)
    module = strategy.module
    with torch.no_grad(), evaluation(module), strategy.evaluation(), measuring(module), eager_eval(compiled):
        for index in range(rank, rank + world * math.ceil(count / world), world):
            # Every rank runs as many passes: past the end, a pair again, its values dropped.
            batch = {key: t.to(device) for key, t in data.collate([data[index % count]]).items()}
            with precision.autocast():
                logps, _ = module(batch)
            if index < count:
                values[index] = logps.double()
    dist.all_reduce(values)  # each row written by one rank, zero on the others: the sum is that rank's value
    return values.cpu().numpy()


@contextmanager
def measuring(module: nn.Module) -> Iterator[None]:
    """The module's forward gives each row's answer log-probability (its objective for the measurement, as a
    reference copy's is): the forward, not ``answer_logps`` directly, so fsdp's root gathers what it holds."""
    objective = module.objective
    module.objective = answer_logps
    try:
        yield
    finally:
        module.objective = objective


def _read(path: Path, count: int) -> Optional[np.ndarray]:
    if not path.is_file():
        return None
    values = np.load(path)
    if values.shape != (count, 2) or values.dtype != np.float64:
        raise RuntimeError(f"{path} holds {values.dtype} {values.shape}, not the float64 ({count}, 2) of these "
                           "pairs' reference log-probabilities: delete it to compute them again")
    return values


def _write(path: Path, values: np.ndarray) -> None:
    """Atomically: a reader finds the whole file or none (nodes sharing one file system each write their own)."""
    tmp = path.parent / f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.npy"
    try:
        np.save(tmp, values)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
