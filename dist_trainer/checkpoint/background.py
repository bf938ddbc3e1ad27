"""When a checkpoint is written: before the step returns, or while training goes on (``trainer.ckpt_async``).

A background save keeps every promise of a blocking one (``checkpoint.save``):

* The step that checkpoints copies the state into host memory (``stage``) and
  captures its RNG states before it returns: the next ``optimizer.step()``
  changes the weights in place, and the copy is what gets written.
* A thread writes, hashes and seals the copy with ``checkpoint.save``, through
  the same three phases. Their collectives run on a gloo group of their own,
  so that they never interleave with training's.
* At most one save is in flight: the next checkpoint step waits for it first.
  The final save (the last step, or a signal's stop) waits for it too, and is
  then written before the step returns, so nothing runs at exit.
* Every rank reports in each step's all-reduce whether its write still runs
  (``Trainer.train_step(busy=...)``). The first step at which no rank's does
  is the same on every rank: there every rank joins its thread, and either all
  log the sealed checkpoint or all raise the same CheckpointWriteError (a full
  disk, say). A rank that looked at its own thread alone could stop a step
  before the others and leave them waiting in a collective.
* The seal (manifest, rename, prune) comes after every rank's files are
  written, as before, so pruning never removes the last sealed checkpoint for
  one that is not. A process killed mid-write leaves a temporary directory
  that the next start removes.

A thread rather than a process: the write is file I/O and hashing, which
release the GIL, and a thread costs no start-up (torch's process-based
writer takes seconds to start) and no second copy of the state.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from ..distributed import DistEnv
from ..parallel.state import data_key, local_tensor
from . import capture_rng, save
from .storage import Location

log = logging.getLogger("dist_trainer")

MIB = 2**20
Figures = Dict[str, float]  # what metrics.jsonl gets for a checkpoint: ckpt_blocking_s, ckpt_write_s, ...


class Stager:
    """Copies a checkpoint's state into host memory, into the same buffers save after save.

    The buffers are allocated at the first save and kept (``ckpt_staging_mb``,
    which plan mode predicts): later saves only copy, with no allocation and
    no page faults, which for a GiB of state is most of the cost. They are
    free to refill because at most one save is in flight and it has finished
    before the next is staged. From a GPU the buffers are pinned and the
    copies asynchronous, waited for once at the end.
    """

    def __init__(self) -> None:
        self.buffers: Dict[tuple, torch.Tensor] = {}

    def stage(self, obj: Any, where: tuple = ()) -> tuple[Any, int]:
        """(a copy of ``obj`` whose tensors are in host memory, the bytes those copies take).

        Tensors that share their data (a tied weight under two names) are
        copied once and stay shared. A DTensor keeps its mesh and placements
        around a copy of its local shard, which is all DCP reads. ``where``
        names ``obj`` among the states staged (its buffers are kept under it).
        """
        copies: Dict[tuple, torch.Tensor] = {}
        size, from_gpu = [0], [False]

        def copy_tensor(where: tuple, t: torch.Tensor) -> torch.Tensor:
            local = local_tensor(t)
            key = data_key(local)
            if key in copies and key[0]:
                return copies[key]
            buffer = self.buffers.get(where)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                self.buffers[where] = buffer
            buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            from_gpu[0] |= local.is_cuda
            size[0] += buffer.numel() * buffer.element_size()
            copied = buffer
            if local is not t:  # a DTensor: the same layout around the copied shard
                from torch.distributed.tensor import DTensor

                copied = DTensor.from_local(buffer, t.device_mesh, t.placements, run_check=False,
                                            shape=t.shape, stride=t.stride())
            copies[key] = copied
            return copied

        def walk(where: tuple, value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return copy_tensor(where, value)
            if isinstance(value, dict):
                return type(value)((k, walk(where + (k,), v)) for k, v in value.items())
            if isinstance(value, (list, tuple)):
                return type(value)(walk(where + (i,), v) for i, v in enumerate(value))
            return copy.deepcopy(value)

        staged = walk(where, obj)
        if from_gpu[0]:
            torch.cuda.synchronize()  # every copy has landed before training changes the source
        return staged, size[0]


class BlockingSaves:
    """trainer.ckpt_async=false: every save is written, hashed and sealed before the step goes on."""

    group: Optional[dist.ProcessGroup] = None  # the save's collectives: training's group

    def __init__(self, env: DistEnv, keep: int, keep_every: int):
        self.env, self.keep, self.keep_every = env, keep, keep_every

    def busy(self) -> bool:
        return False

    def save(self, root: Location, step: int, shared: Dict[str, Any], sharded: Optional[Dict[str, Any]],
             final: bool, written: Callable[[Figures], None]) -> None:
        """Write the checkpoint of ``step``; ``written`` gets the step's figures once its files are written,
        before the seal, so that a sealed checkpoint always has its step's record in metrics.jsonl."""
        self._save_now(root, step, shared, sharded, written, time.perf_counter(), {})

    def _save_now(self, root: Location, step: int, shared: Dict[str, Any], sharded: Optional[Dict[str, Any]],
                  written: Callable[[Figures], None], began: float, figures: Figures) -> None:
        """The blocking save: ``written`` gets ``figures`` and the stall since ``began`` before the seal."""
        path = save(root, step, shared, self.env, self.keep, sharded, self.keep_every, group=self.group,
                    before_seal=lambda: written({**figures, "ckpt_blocking_s": time.perf_counter() - began}))
        log.info("step %d: checkpoint %s", step, path)

    def after_step(self, busy_anywhere: bool) -> Figures:
        return {}

    def close(self) -> None:
        pass


class BackgroundSaves(BlockingSaves):
    """trainer.ckpt_async=true: the step copies the state and a thread writes it (see the module's text)."""

    def __init__(self, env: DistEnv, keep: int, keep_every: int, timeout_s: float):
        super().__init__(env, keep, keep_every)
        # Every rank creates it, in the same order as its other groups: new_group is collective.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.thread: Optional[threading.Thread] = None
        self.result: Dict[str, Any] = {}
        self.stager = Stager()

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def save(self, root: Location, step: int, shared: Dict[str, Any], sharded: Optional[Dict[str, Any]],
             final: bool, written: Callable[[Figures], None]) -> None:
        began = time.perf_counter()
        figures = self._finish() if self.thread is not None else {}  # at most one save in flight
        if figures:
            figures["ckpt_wait_s"] = time.perf_counter() - began
        if final:  # nothing may run at exit: the last one is written before the step returns
            self._save_now(root, step, shared, sharded, written, began, figures)
            return
        rng = capture_rng(self.env.device)
        # Only rank 0 writes shared.pt; every rank writes its own shards.
        staged_shared, shared_bytes = self.stager.stage(shared, ("shared",)) if self.env.is_main else ({}, 0)
        staged_sharded, sharded_bytes = (self.stager.stage(sharded, ("sharded",)) if sharded is not None
                                         else (None, 0))
        self.thread = threading.Thread(target=self._write, name=f"checkpoint-step-{step}", daemon=True,
                                       args=(root, step, staged_shared, staged_sharded, rng))
        self.thread.start()
        written({**figures, "ckpt_staging_mb": (shared_bytes + sharded_bytes) / MIB,
                 "ckpt_blocking_s": time.perf_counter() - began})

    def _write(self, root: Location, step: int, shared: Dict[str, Any], sharded: Optional[Dict[str, Any]],
               rng: Dict[str, Any]) -> None:
        began = time.perf_counter()
        try:
            path = save(root, step, shared, self.env, self.keep, sharded, self.keep_every, rng=rng,
                        group=self.group)
            self.result = {"step": step, "path": path, "write_s": time.perf_counter() - began}
        except BaseException as err:  # handed to the training thread, which raises it on every rank
            self.result = {"step": step, "error": err}

    def after_step(self, busy_anywhere: bool) -> Figures:
        """At the first step where no rank's write runs (the same step on every rank): its outcome."""
        if self.thread is None or busy_anywhere:
            return {}
        return self._finish()

    def _finish(self) -> Figures:
        """Wait for the save in flight; raise its error, or log it sealed and give its write time."""
        self.thread.join()
        self.thread, result = None, self.result
        if "error" in result:
            raise result["error"]
        log.info("step %d: checkpoint %s (written in the background in %.2f s)", result["step"], result["path"],
                 result["write_s"])
        return {"ckpt_write_s": result["write_s"]}

    def close(self) -> None:
        """On the way out after an error: let a write in flight end (its collectives time out if a peer died)."""
        if self.thread is not None:
            self.thread.join()


def host_memory_problem(staging_mb: float, local_ranks: int, available: Optional[int]) -> Optional[str]:
    """Why this node cannot hold its ranks' copies of a checkpoint at once, or None if it can (or cannot tell)."""
    need = staging_mb * MIB * local_ranks
    if available is None or need <= available:
        return None
    return (f"trainer.ckpt_async=true copies each checkpoint into host memory: {staging_mb:,.1f} MiB on the largest "
            f"rank (ckpt_staging_mb in plan mode), {need / MIB:,.1f} MiB for this node's {local_ranks} rank(s), but "
            f"only {available / MIB:,.1f} MiB are available: set trainer.ckpt_async=false (blocking saves copy "
            "nothing), or shard the state over more ranks (dist.strategy=fsdp)")


def build(env: DistEnv, keep: int, keep_every: int, background: bool, timeout_s: float) -> BlockingSaves:
    """The saves of this run, chosen once."""
    return BackgroundSaves(env, keep, keep_every, timeout_s) if background else BlockingSaves(env, keep, keep_every)
