"""Trained weights back to Hugging Face: ``hf_model/`` at the end of a run, or from any checkpoint.

    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR     (a checkpoint, or a run directory: its newest)
    python -m dist_trainer.export s3://bucket/prefix OUT_DIR  (a trainer.ckpt_dir, a path or a URL: its newest)
    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR --adapter-out ADAPTER_DIR    (a LoRA model)

The model is rebuilt from the configuration every checkpoint records
(``model_config`` in shared.pt), so only the checkpoint is needed.

The directory is ``save_pretrained``'s (config.json, model.safetensors) with
the FP32 weights (the masters in master modes) and the tokenizer's files when
the data had a tokenizer: ``AutoModelFor*.from_pretrained(OUT_DIR)`` gives the
trained model. It is written under a temporary name and renamed when complete.

A LoRA model (model.lora.r) gives two: the merged model (the adapters folded
into the base weights: a plain transformers model) in OUT_DIR, and the
adapters alone, peft's ``save_pretrained`` (``PeftModel.from_pretrained(base,
ADAPTER_DIR)``), in ADAPTER_DIR (the run directory's ``hf_adapter/``). A LoRA
checkpoint holds the adapters only; the base comes from the recorded model
configuration and must have the digest the checkpoint records.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence, Union

import torch

from .. import checkpoint
from ..config import ConfigError

PREFIX = "model."  # HFModel holds the transformers model as .model


def save_pretrained(module: torch.nn.Module, state: Dict[str, torch.Tensor], out: Path,
                    adapter_out: Optional[Path] = None) -> None:
    """Write ``state`` (the framework's full FP32 state dict of an HFModel) as a Hugging Face directory.

    A LoRA model: the merged model in ``out``, the adapters in ``adapter_out``
    (default: ``hf_adapter`` beside ``out``).
    """
    hf_state = {key[len(PREFIX):]: value for key, value in state.items() if key.startswith(PREFIX)}
    if _is_peft(module.model):
        lora = _peft_copy(module, hf_state)
        _write(lambda tmp: (lora.save_pretrained(tmp), _save_tokenizer(module, tmp)),
               adapter_out or out.parent / "hf_adapter")
        merged = lora.merge_and_unload()
        _write(lambda tmp: (merged.save_pretrained(tmp), _save_tokenizer(module, tmp)), out)
        return
    _write(lambda tmp: (module.model.save_pretrained(tmp, state_dict=hf_state), _save_tokenizer(module, tmp)), out)


def _write(fill, out: Path) -> None:
    """``fill(tmp)``, then ``tmp`` renamed to ``out``: a directory complete, or not there."""
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fill(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(module: torch.nn.Module, directory: Path) -> None:
    if module.tokenizer_spec:
        from .tokenizer import load_tokenizer

        load_tokenizer(module.tokenizer_spec, chat_template=module.chat_template).save(directory)


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _peft_copy(module: torch.nn.Module, hf_state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of the LoRA model holding ``hf_state``: merging it leaves the training model as it is
    (under fsdp its parameters are shards, and training may go on)."""
    import copy

    import peft
    import transformers

    from .models import TASKS

    base = module.model.get_base_model()
    auto = getattr(transformers, TASKS[module.task])
    copy_model = peft.get_peft_model(auto.from_config(copy.deepcopy(base.config), dtype=torch.float32),
                                     copy.deepcopy(module.model.peft_config["default"]))
    copy_model.load_state_dict(hf_state)
    return copy_model


def _checkpoint_of(path: checkpoint.Location) -> checkpoint.Location:
    """A checkpoint as given, or the newest valid one of a run directory or of a trainer.ckpt_dir (path or URL)."""
    if (path / checkpoint.MANIFEST).is_file():
        return path
    found = [ckpt for root in (path / "checkpoints", path) for ckpt in checkpoint.list_checkpoints(root)
             if checkpoint.verify(ckpt) is None]  # newest first
    if not found:
        raise ConfigError(f"{path}: neither a checkpoint (no {checkpoint.MANIFEST}) nor a run directory "
                          "or trainer.ckpt_dir with a valid checkpoint")
    return found[0]


def export(path: Union[str, Path], out: Path, adapter_out: Optional[Path] = None) -> checkpoint.Location:
    """Rebuild the model from the configuration the checkpoint records, load its weights, write ``out``."""
    from hydra.utils import instantiate

    from ..precision import load_trained

    ckpt = _checkpoint_of(checkpoint.location(path))
    shared, state = checkpoint.read_model(ckpt)
    model_cfg = shared.get("model_config") or {}
    if model_cfg.get("_target_") != "dist_trainer.hf.models.hf_model":
        raise ConfigError(f"model._target_={model_cfg.get('_target_')}: export writes Hugging Face models "
                          "(model=hf_causal_lm or model=hf_masked_lm); use final_model.pt for this one")
    torch.manual_seed(shared.get("model_seed", 0))  # as the run built it: the same weights where none are loaded
    module = instantiate(model_cfg, _convert_="all")
    checkpoint.check_frozen(shared.get("frozen"), checkpoint.frozen_digest(module), ckpt)
    load_trained(module, state)  # a LoRA checkpoint: the adapters; the base is the configuration's
    save_pretrained(module, module.state_dict(), out, adapter_out)  # hf_model builds in FP32
    return ckpt


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoint, a run directory, or a trainer.ckpt_dir (a path or a URL: s3://bucket/prefix)")
    parser.add_argument("out", type=Path, metavar="OUT_DIR")
    parser.add_argument("--adapter-out", type=Path, metavar="ADAPTER_DIR",
                        help="a LoRA model's adapters (default: hf_adapter beside OUT_DIR)")
    args = parser.parse_args(argv)
    try:
        ckpt = export(args.checkpoint, args.out, args.adapter_out)
    except (ConfigError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: Hugging Face model from {ckpt}")
