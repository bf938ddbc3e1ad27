"""The run's last outputs: the trained weights as ``final_model.pt`` and ``hf_model/``.

Every rank walks the whole model once, tensor by tensor, through its strategy's
``full_tensors()`` (``parallel.state.WholeTensors``); rank 0 gets each tensor
whole, in FP32, and hands it to the writers, which write it and let it go, so no
rank ever holds the model whole:

* ``final_model.pt``: the plain FP32 state_dict (the contract) in ``torch.save``'s
  format, each tensor's bytes appended as it arrives and the pickled dict written
  last (``models.torchsave``): ``torch.load(path, weights_only=True)`` reads it,
  and ``mmap=True`` maps it, as it reads one ``torch.save`` wrote, for a model of
  any size.
* ``hf_model/`` for a Hugging Face model, from the same walk (``hf.export.HFModelWriter``):
  safetensors files of at most ``$DIST_TRAINER_MAX_SHARD_MB`` MiB (default
  ``models.export.DEFAULT_SHARD_MB``) with an index where there are several.

Each output is written under a temporary name and renamed when complete; one
that cannot be written (a full disk) stops every rank alike with one message,
after every rank has finished the walk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint
from .distributed import DistEnv
from .models.export import DEFAULT_SHARD_MB
from .models.torchsave import TorchSaveWriter
from .parallel.state import WholeTensors

log = logging.getLogger("dist_trainer")

FINAL_PT, HF_DIR = "final_model.pt", "hf_model"
SHARD_MB_ENV = "DIST_TRAINER_MAX_SHARD_MB"  # the largest safetensors file written, MiB


def save_final_model(strategy: Any, module: nn.Module, run_dir: Path, env: DistEnv, step: int) -> None:
    """Every rank calls it once training is done; rank 0 writes the outputs, whole or not at all."""
    from .hf import export as hf_export

    lora = hf_export.is_lora(module)
    if lora and not hf_export.streams(module):  # peft's other settings: from a whole copy (hf.export.save_pretrained)
        _save_whole(strategy.full_state_dict(), module, run_dir, env, step)
        return
    tensors = strategy.full_tensors()  # every rank learns the layout; nothing is gathered yet
    adapters = whole_adapters(tensors, module) if lora else None
    failure, writers = walk(tensors, lambda: _writers(tensors, module, run_dir, max_shard_mb(), adapters),
                            env.is_main, "writing the final model")
    if env.is_main and failure is None:
        log.info("final_model.pt%s: the FP32 model (%.3g MiB) written tensor by tensor, the largest %.3g MiB "
                 "held at once", " and hf_model/" if len(writers) > 1 else "", tensors.nbytes / 2**20,
                 tensors.largest_bytes / 2**20)
    _raise_if_failed(failure, run_dir, env, step)


def max_shard_mb() -> float:
    return float(os.environ.get(SHARD_MB_ENV) or DEFAULT_SHARD_MB)


def whole_adapters(tensors: WholeTensors, module: nn.Module) -> Dict[str, torch.Tensor]:
    """A LoRA model's adapters whole on rank 0 (small; a collective, every rank calls it) before the walk, so each
    base weight is merged with its own as it arrives."""
    from .hf.export import adapter_names

    names = set(adapter_names(module))
    return dict(WholeTensors({n: t for n, t in tensors.local.items() if n in names}, {}, tensors.device))


def walk(tensors: WholeTensors, make_writers: Callable[[], List[Any]], is_main: bool,
         what: str) -> Tuple[Optional[str], List[Any]]:
    """Every rank walks ``tensors`` in full; rank 0 hands each tensor to the writers ``make_writers()`` gives it
    and closes them at the end, or abandons them once one fails. (None or what failed on rank 0, the writers)."""
    writers: List[Any] = []
    failure: Optional[str] = None
    if is_main:
        failure = _guard(lambda: writers.extend(make_writers()), what)
    for name, tensor in tensors:  # rank 0 alone gets each tensor; every rank walks to the end
        if failure is None:
            failure = _guard(lambda: [w.add(name, tensor) for w in writers], what)
        del tensor
    if is_main and failure is None:
        failure = _guard(lambda: [w.close() for w in writers], what)
    if is_main and failure is not None:
        for w in writers:
            w.abandon()
    return failure, writers


class _StateFile:
    """final_model.pt, streamed (``models.torchsave``) under a temporary name, renamed into place when closed."""

    def __init__(self, tensors: WholeTensors, run_dir: Path):
        self.tensors = tensors
        self.path, self.tmp = run_dir / FINAL_PT, run_dir / f".tmp-{FINAL_PT}"
        self.writer = TorchSaveWriter(self.tmp)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        # the names of a tied weight share one storage where their values are equal, as in torch.save
        self.writer.write(name, tensor, self.tensors.by_name[name].tied_to)

    def close(self) -> None:
        self.writer.close()
        os.replace(self.tmp, self.path)

    def abandon(self) -> None:
        self.writer.abandon()


def _save_state(state: Dict[str, torch.Tensor], tmp: Path, path: Path) -> None:
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _writers(tensors: WholeTensors, module: nn.Module, run_dir: Path, shard_mb: float,
             adapters: Optional[Dict[str, torch.Tensor]] = None) -> List[Any]:
    writers: List[Any] = [_StateFile(tensors, run_dir)]
    if adapters is not None:  # a LoRA model: hf_adapter/ now, hf_model/ merged tensor by tensor
        from .hf.export import LoraWriter

        writers.append(LoraWriter(module, tensors.layout, adapters, run_dir / HF_DIR, run_dir / "hf_adapter",
                                  shard_mb))
    elif hasattr(module, "tokenizer_spec"):  # dist_trainer.models.hf.HFModel
        from .hf.export import HFModelWriter

        writers.append(HFModelWriter(module, tensors.layout, run_dir / HF_DIR, shard_mb))
    return writers


def _guard(action: Any, what: str = "writing the final model") -> Optional[str]:
    """None, or what failed on rank 0: not raised at once, as the other ranks are still in the walk (and
    waiting for rank 0 in its collectives); ``_raise_if_failed`` raises on every rank after it."""
    try:
        action()
    except Exception as err:
        if not isinstance(err, checkpoint.WRITE_ERRORS):
            log.exception("%s failed", what)  # not the disk: the traceback says where
        return f"{type(err).__name__}: {err}"
    return None


def _raise_if_failed(failure: Optional[str], run_dir: Path, env: DistEnv, step: int) -> None:
    """Every rank learns whether rank 0 could write; all raise alike."""
    message = [failure]
    dist.broadcast_object_list(message, src=0)
    if message[0]:
        raise checkpoint.CheckpointWriteError(
            f"the final model (final_model.pt, hf_model/) could not be written in {run_dir} "
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
