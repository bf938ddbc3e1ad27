"""The run's last outputs: the trained weights as ``final_model.pt`` (or ``final_model/``) and ``hf_model/``.

Every rank walks the whole model once, tensor by tensor, through its strategy's
``full_tensors()`` (``parallel.state.WholeTensors``); rank 0 gets each tensor
whole, in FP32, and hands it to the writers, so no rank holds the model whole
unless it is to be written whole:

* ``final_model.pt``, one ``torch.save`` of the plain FP32 state_dict (the
  contract), where the whole model fits in rank 0's host memory: below half of
  what ``hostmem.available_bytes()`` reports there (or ``$DIST_TRAINER_FINAL_MODEL_MAX_MB``,
  MiB). Rank 0 decides from the layout, before anything is gathered, and every
  rank learns its decision.
* ``final_model/`` otherwise: the same names and values as safetensors files
  with ``model.safetensors.index.json`` (``models.export``), and one line in the
  log saying why and where.
* ``hf_model/`` for a Hugging Face model, from the same walk (``hf.export.HFModelWriter``).

Files of at most ``$DIST_TRAINER_MAX_SHARD_MB`` MiB (default
``models.export.DEFAULT_SHARD_MB``). Each output is written under a temporary
name and renamed when complete; one that cannot be written (a full disk)
stops every rank alike with one message, after every rank has finished the walk.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint, hostmem
from .distributed import DistEnv
from .models.export import DEFAULT_SHARD_MB, Entry, SafetensorsWriter, replace_dir, temporary_dir
from .parallel.state import WholeTensors

log = logging.getLogger("dist_trainer")

FINAL_PT, FINAL_DIR, HF_DIR = "final_model.pt", "final_model", "hf_model"
MAX_MB_ENV = "DIST_TRAINER_FINAL_MODEL_MAX_MB"  # final_model.pt only for a model of at most this many MiB
SHARD_MB_ENV = "DIST_TRAINER_MAX_SHARD_MB"  # the largest safetensors file written, MiB


def save_final_model(strategy: Any, module: nn.Module, run_dir: Path, env: DistEnv, step: int) -> None:
    """Every rank calls it once training is done; rank 0 writes the outputs, whole or not at all."""
    from .hf.export import is_lora

    if is_lora(module):  # peft writes the adapters and the merged model from a whole copy (hf.export.save_pretrained)
        _save_whole(strategy.full_state_dict(), module, run_dir, env, step)
        return
    tensors = strategy.full_tensors()  # every rank learns the layout; nothing is gathered yet
    whole = _fits(tensors.nbytes, env)
    shard_mb = float(os.environ.get(SHARD_MB_ENV) or DEFAULT_SHARD_MB)
    writers: List[Any] = []
    failure: Optional[str] = None
    if env.is_main:
        failure = _guard(lambda: writers.extend(_writers(tensors, module, run_dir, whole, shard_mb)))
    for name, tensor in tensors:  # rank 0 alone gets each tensor; every rank walks to the end
        if failure is None:
            failure = _guard(lambda: [w.add(name, tensor) for w in writers])
        del tensor
    if env.is_main and failure is None:
        failure = _guard(lambda: _finish(writers, run_dir, whole))
    if env.is_main:
        if failure is not None:
            for w in writers:
                w.abandon()
        else:
            _report(tensors, run_dir, whole, writers)
    _raise_if_failed(failure, run_dir, env, step)


def _fits(nbytes: int, env: DistEnv) -> bool:
    """Whether final_model.pt is written (the whole model held on rank 0): rank 0 decides, every rank agrees."""
    decision = [True]
    if env.is_main:
        decision = [nbytes <= _bound()[0]]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def _bound() -> tuple[float, str]:
    """(the most bytes final_model.pt may hold, why that much), on rank 0."""
    if os.environ.get(MAX_MB_ENV):
        return float(os.environ[MAX_MB_ENV]) * 2**20, f"{MAX_MB_ENV}={os.environ[MAX_MB_ENV]}"
    available = hostmem.available_bytes()
    if available is None:  # nothing to go by: as before, the whole state dict
        return float("inf"), "rank 0's host memory could not be read"
    return available / 2, f"half of rank 0's available host memory ({available / 2**20:,.0f} MiB)"


class _StateFile:
    """final_model.pt: the walk's tensors collected into one state dict, saved whole, renamed into place."""

    def __init__(self, tensors: WholeTensors, run_dir: Path):
        self.tensors, self.state = tensors, {}
        self.path, self.tmp = run_dir / FINAL_PT, run_dir / f".tmp-{FINAL_PT}"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors.collect(self.state, name, tensor)

    def close(self) -> None:
        _save_state(self.state, self.tmp, self.path)

    def abandon(self) -> None:
        self.tmp.unlink(missing_ok=True)


class _StateDir:
    """final_model/: the plain state_dict's names and values in safetensors files (and an index)."""

    def __init__(self, layout: list, out: Path, shard_mb: float):
        self.out, self.tmp = out, temporary_dir(out)
        self.writer = SafetensorsWriter(self.tmp, [Entry(i.name, i.shape, i.dtype) for i in layout],
                                        int(shard_mb * 2**20))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.writer.write(name, tensor)

    def close(self) -> None:
        self.writer.close()
        replace_dir(self.tmp, self.out)

    def abandon(self) -> None:
        self.writer.abandon()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _save_state(state: Dict[str, torch.Tensor], tmp: Path, path: Path) -> None:
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _writers(tensors: WholeTensors, module: nn.Module, run_dir: Path, whole: bool, shard_mb: float) -> List[Any]:
    writers: List[Any] = [_StateFile(tensors, run_dir) if whole
                          else _StateDir(tensors.layout, run_dir / FINAL_DIR, shard_mb)]
    if hasattr(module, "tokenizer_spec"):  # dist_trainer.hf.models.HFModel
        from .hf.export import HFModelWriter

        writers.append(HFModelWriter(module, tensors.layout, run_dir / HF_DIR, shard_mb))
    return writers


def _finish(writers: List[Any], run_dir: Path, whole: bool) -> None:
    """Every writer closed (renamed into place); the other form of the final model, from an earlier
    attempt in this run directory, goes: one of final_model.pt and final_model/ is there, never both."""
    for w in writers:
        w.close()
    if whole:
        shutil.rmtree(run_dir / FINAL_DIR, ignore_errors=True)
    else:
        (run_dir / FINAL_PT).unlink(missing_ok=True)


def _report(tensors: WholeTensors, run_dir: Path, whole: bool, writers: List[Any]) -> None:
    size = f"the FP32 model ({tensors.nbytes / 2**20:.3g} MiB)"
    largest = f"one tensor at a time (the largest {tensors.largest_bytes / 2**20:.3g} MiB)"
    if whole:
        log.info("final_model.pt: %s is within %s: gathered whole on rank 0, %s", size, _bound()[1], largest)
        return
    files = len(writers[0].writer.names)
    log.warning("final_model/ instead of final_model.pt: %s is larger than %s, so no rank gathers it whole; its "
                "weights (the state_dict's names) are in %s, %d safetensors file(s) with "
                "model.safetensors.index.json where several, written as rank 0 got them, %s",
                size, _bound()[1], run_dir / FINAL_DIR, files, largest)


def _guard(action: Any) -> Optional[str]:
    """None, or what failed on rank 0: not raised at once, as the other ranks are still in the walk (and
    waiting for rank 0 in its collectives); ``_raise_if_failed`` raises on every rank after it."""
    try:
        action()
    except Exception as err:
        if not isinstance(err, checkpoint.WRITE_ERRORS):
            log.exception("writing the final model failed")  # not the disk: the traceback says where
        return f"{type(err).__name__}: {err}"
    return None


def _raise_if_failed(failure: Optional[str], run_dir: Path, env: DistEnv, step: int) -> None:
    """Every rank learns whether rank 0 could write; all raise alike."""
    message = [failure]
    dist.broadcast_object_list(message, src=0)
    if message[0]:
        raise checkpoint.CheckpointWriteError(
            f"the final model (final_model.pt or final_model/, hf_model/) could not be written in {run_dir} "
            f"({message[0]}). Training finished and the checkpoint of step {step} is intact: free space or make "
            "the directory writable, then start the run again in the same directory; it resumes at its end and "
            "writes the final model.")


def _save_whole(state: Dict[str, torch.Tensor], module: nn.Module, run_dir: Path, env: DistEnv, step: int) -> None:
    """A LoRA model: final_model.pt and peft's hf_adapter/ and merged hf_model/ from the state dict gathered on
    rank 0 (its base is frozen and rebuilt from the configuration; what trains is small beside it)."""
    failure = None
    if env.is_main:
        def write() -> None:
            from .hf.export import save_pretrained

            _save_state(state, run_dir / f".tmp-{FINAL_PT}", run_dir / FINAL_PT)
            save_pretrained(module, state, run_dir / HF_DIR)

        failure = _guard(write)
    _raise_if_failed(failure, run_dir, env, step)
