"""Tensors by name across layouts: the local part of a sharded tensor, and optimizer state keyed by name.

A checkpoint written under one layout (ddp, fsdp, hsdp, any world size) is read
under another by naming each parameter's optimizer state after the parameter.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (a view of its storage), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def data_key(t: torch.Tensor) -> tuple:
    """What names a tensor's data: two tensors with one key are one (a tied weight under two names).

    Its storage's address is 0 for an empty tensor, which never matches another.
    """
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def optimizer_param_names(optimizer: torch.optim.Optimizer, weights: Any, module: nn.Module) -> List[str]:
    """The parameter name of each tensor the optimizer steps, in its state_dict's index order.

    ``weights.optimizer_params()[i]`` stands for ``weights.params[i]`` (itself, or its FP32 master).
    """
    name_of = {p: name for name, p in module.named_parameters()}
    stands_for = {t: p for t, p in zip(weights.optimizer_params(), weights.params)}
    return [name_of[stands_for[t]] for group in optimizer.param_groups for t in group["params"]]


def state_of(flat: Dict[str, torch.Tensor], name: str) -> Dict[str, torch.Tensor]:
    """The optimizer state of parameter ``name`` in a flat DCP dict (``optim.<name>.<key>``)."""
    prefix = f"optim.{name}."
    return {key[len(prefix):]: value for key, value in flat.items()
            if key.startswith(prefix) and "." not in key[len(prefix):]}


def named_optimizer_state(optimizer_state: Dict[str, Any], names: List[str]) -> Dict[str, Any]:
    """torch's index-keyed optimizer state_dict -> keyed by parameter name (param_groups too)."""
    state = {names[i]: value for i, value in optimizer_state["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    return {"state": state, "param_groups": groups}


def indexed_optimizer_state(names: List[str], state: Dict[str, Dict[str, torch.Tensor]],
                            groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Keyed by parameter name -> torch's index-keyed optimizer state_dict, for ``names``' order.

    torch's ``load_state_dict`` pairs the saved groups' parameters with the optimizer's by position, so each
    group lists its indices in ``names``' order, whatever order the checkpoint named them in (a pipeline's
    stage groups name theirs rank by rank: under interleaving or the V, not the model's order)."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state.items() if value},
            "param_groups": [{**g, "params": sorted(index[name] for name in g["params"])} for g in groups]}
