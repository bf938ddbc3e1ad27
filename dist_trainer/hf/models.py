"""Kept for configurations and checkpoints that name ``dist_trainer.hf.models``: the adapter lives in models/hf.py."""

from ..models.hf import IGNORE_INDEX, MODEL_INPUTS, TASKS, HFModel, hf_model, token_loss, with_lora  # noqa: F401
