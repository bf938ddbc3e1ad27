"""A model's repeated blocks: one notion used by sharding, activation checkpointing and compilation.

Each block (``dist.blocks``, default what the model declares) is an FSDP unit,
the unit of activation checkpointing and the unit ``trainer.compile`` compiles.
These helpers act on the model in place, before a strategy wraps it, and know
nothing of which strategy that is.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..config import ConfigError


def class_name(module: nn.Module) -> str:
    """The module's own class name, also once ``fully_shard`` has wrapped it.

    FSDP2 swaps a unit's class for ``FSDP<Name>(FSDPModule, <Name>)``; the
    blocks of a sharded model are still found by the names the model declares.
    """
    cls = type(module)
    if isinstance(module, FSDPModule) and len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        cls = cls.__bases__[1]
    return cls.__name__


def find_blocks(model: nn.Module, configured: Optional[Sequence[str]]) -> List[nn.Module]:
    """The model's repeated blocks, outermost first (none nested in another).

    Their class names are ``dist.blocks`` (``configured``) or, when that is null,
    what the model declares, as Hugging Face models do, in ``_no_split_modules``.
    """
    declared = getattr(model, "_no_split_modules", None) or []
    names = list(configured) if configured is not None else [str(name) for name in declared]
    wanted = set(names)
    found: List[nn.Module] = []
    inside: set = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if class_name(module) in wanted:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if configured is not None and names and not found:
        classes = sorted({class_name(m) for m in model.modules()})
        raise ConfigError(f"dist.blocks={names}: no module of the model has that class; "
                          f"its classes are {classes}")
    return found


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Non-reentrant activation checkpointing of each block, keeping its parameter names.

    The block's forward runs under ``torch.utils.checkpoint.checkpoint``: its
    activations are freed after forward and recomputed in backward, with the
    RNG state of the forward (the same dropout masks).
    """
    from torch.utils.checkpoint import checkpoint

    from ..recompute import recomputation

    # The recomputation says so (recompute.py): what a forward counts as a side effect is counted once.
    contexts = lambda: (contextlib.nullcontext(), recomputation())  # noqa: E731
    if not blocks:
        raise ConfigError("dist.activation_checkpointing=true: the model declares no blocks to checkpoint; "
                          "set dist.blocks to the class names of its repeated blocks")
    for block in blocks:
        forward = block.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # Compiled, the backward recomputes from its own graph (this Python forward does not run again),
                # and torch.compile takes TorchDispatchModes as context_fn, nothing else: none is passed.
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)

        block.forward = checkpointed  # an instance attribute: state_dict keys are unchanged


def _batch_dim_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the leading (batch) dimension of the positional tensor inputs varies."""
    for arg in args:
        for value in (arg.values() if isinstance(arg, dict) else (arg,)):
            if isinstance(value, torch.Tensor) and value.ndim >= 1:
                torch._dynamo.maybe_mark_dynamic(value, 0)  # a hint: no error where the size is 0 or 1


def compile_blocks(blocks: Sequence[nn.Module], model: nn.Module) -> None:
    """Compile each block's forward in place; the whole model's forward when it declares no blocks.

    After activation checkpointing (compiled with it), before DDP or FSDP wrap
    the model: their hooks run eagerly around the compiled code.
    """
    for module in blocks or [model]:
        module.register_forward_pre_hook(_batch_dim_dynamic, with_kwargs=True)
        module.forward = torch.compile(module.forward)


def prepare_blocks(model: nn.Module, configured: Optional[Sequence[str]], activation_checkpointing: bool,
                   compile: bool) -> List[nn.Module]:
    """Find the blocks, checkpoint them, compile them, in that order (torchtitan's); returns the blocks."""
    blocks = find_blocks(model, configured)
    if activation_checkpointing:
        checkpoint_blocks(blocks)
    if compile:
        from ..moe.ep import moe_layers

        if moe_layers(model):
            # Measured: a compiled MoE GPT's weights after 3 steps are 0.14 of their scale off eager's in one
            # process (the routing's per-step state is read outside the graph): refused rather than wrong.
            raise ConfigError("trainer.compile=true with MoE layers is not supported yet (compiled routing does not "
                              "equal eager routing): set trainer.compile=false")
        compile_blocks(blocks, model)
    return blocks
