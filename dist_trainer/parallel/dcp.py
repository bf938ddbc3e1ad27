"""Checkpoints of a model whose tensors are cut over ranks (fsdp, hsdp, expert slices): sharded, through DCP.

Every tensor keeps the name and whole shape it has in one process (a DTensor's), so DCP reshards a checkpoint
of any mesh into any other, and a ddp run reads every shard whole (``DDPStrategy.load_checkpoint_state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict, set_state_dict)

from ..checkpoint import load_shards
from ..precision import frozen_names
from .state import named_optimizer_state, optimizer_param_names


def checkpointed(module: nn.Module) -> StateDictOptions:
    """What checkpoints hold: every trained parameter and the optimizer's state, not frozen ones (a LoRA
    model's base: the model is built with it, and the checkpoint records its digest). Strict without them."""
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen_names(module))


def dcp_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(what rank 0 writes into shared.pt, the sharded tensors every rank writes its part of).

    The optimizer's state is keyed by parameter name, so that any layout (another mesh, another world size,
    or ddp) can find its part; DCP writes each replicated shard once.
    """
    model, optim = get_state_dict(module, optimizer, options=checkpointed(module))
    return {"param_groups": optim["param_groups"]}, {"model": model, "optim": optim["state"]}


def dcp_load_checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer, weights: Any,
                              saved: Dict[str, Any], shards: Optional[Path]) -> None:
    """Continue from a checkpoint of any strategy and mesh: sharded (DCP reshards), or a ddp one (whole FP32
    tensors on every rank; each keeps its part)."""
    if shards is not None:
        model, optim = get_state_dict(module, optimizer, options=checkpointed(module))  # templates
        state = {"model": model, "optim": optim["state"]}
        load_shards(state, shards)
        set_state_dict(module, optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": saved["param_groups"]},
                       options=checkpointed(module))
        return
    full = StateDictOptions(full_state_dict=True, strict=not frozen_names(module))
    set_model_state_dict(module, saved["model"], options=full)
    names = optimizer_param_names(optimizer, weights, module)
    set_optimizer_state_dict(module, optimizer, named_optimizer_state(saved["optimizer"], names), options=full)
