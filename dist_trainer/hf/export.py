"""Trained weights back to Hugging Face: ``hf_model/`` at the end of a run, or from any checkpoint.

    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR     (a checkpoint, or a run directory: its newest)

The model is rebuilt from the configuration every checkpoint records
(``model_config`` in shared.pt), so only the checkpoint is needed.

The directory is ``save_pretrained``'s (config.json, model.safetensors) with
the FP32 weights (the masters in master modes) and the tokenizer's files when
the data had a tokenizer: ``AutoModelFor*.from_pretrained(OUT_DIR)`` gives the
trained model. It is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

from .. import checkpoint
from ..config import ConfigError

PREFIX = "model."  # HFModel holds the transformers model as .model


def save_pretrained(module: torch.nn.Module, state: Dict[str, torch.Tensor], out: Path) -> None:
    """Write ``state`` (the framework's full FP32 state dict of an HFModel) as a Hugging Face directory."""
    hf_state = {key[len(PREFIX):]: value for key, value in state.items() if key.startswith(PREFIX)}
    tmp = out.parent / f".tmp-{out.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        module.model.save_pretrained(tmp, state_dict=hf_state)
        if module.tokenizer_spec:
            from .tokenizer import load_tokenizer

            load_tokenizer(module.tokenizer_spec, chat_template=module.chat_template).save(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checkpoint_of(path: Path) -> Path:
    """A checkpoint directory as given, or a run directory's newest valid one."""
    if (path / checkpoint.MANIFEST).is_file():
        return path
    found = [ckpt for ckpt in reversed(checkpoint.list_checkpoints(path / "checkpoints"))
             if checkpoint.verify(ckpt) is None]
    if not found:
        raise ConfigError(f"{path}: neither a checkpoint (no {checkpoint.MANIFEST}) nor a run directory "
                          "with a valid checkpoint")
    return found[0]


def export(path: Path, out: Path) -> Path:
    """Rebuild the model from the configuration the checkpoint records, load its weights, write ``out``."""
    from hydra.utils import instantiate

    ckpt = _checkpoint_of(path)
    shared, state = checkpoint.read_model(ckpt)
    model_cfg = shared.get("model_config") or {}
    if model_cfg.get("_target_") != "dist_trainer.hf.models.hf_model":
        raise ConfigError(f"model._target_={model_cfg.get('_target_')}: export writes Hugging Face models "
                          "(model=hf_causal_lm or model=hf_masked_lm); use final_model.pt for this one")
    module = instantiate(model_cfg, _convert_="all")
    module.load_state_dict(state)
    save_pretrained(module, state, out)
    return ckpt


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT_DIR", help="a checkpoint, or a run directory")
    parser.add_argument("out", type=Path, metavar="OUT_DIR")
    args = parser.parse_args(argv)
    try:
        ckpt = export(args.checkpoint, args.out)
    except (ConfigError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: Hugging Face model from {ckpt}")
