"""``dist.strategy=fsdp``: FSDP2 (``fully_shard``) with exact accumulation.

Each block (``dist.blocks``, default what the model declares) is its own FSDP
unit, then the root takes the rest (embeddings, head, final norm). Parameters,
gradients, optimizer state and so the FP32 weights are sharded over all ranks.

Accumulation. ``dist.fsdp.accum_sync=last``: the first N-1 backward passes run
with ``set_requires_gradient_sync(False)``, so each unit keeps its unsharded
gradient and adds the next micro-batch into it; the last backward
reduce-scatters the window's sum once. ``every``: each backward
reduce-scatters its micro-batch, and the sharded gradients add up (the least
memory, N times the communication). Either way the trainer then sees the sum
of every micro-batch's gradient averaged over ranks, as under ddp, and applies
the same exact normalisation.

Precision. fp32 and the *-mixed modes keep FP32 shards (autocast computes in
half). The *-master modes use ``MixedPrecisionPolicy(param_dtype=half,
reduce_dtype=float32)``: the sharded FP32 parameters are the masters, there is
no second copy, and gradients are reduced in FP32.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from .config import DistConfig
from .distributed import DistEnv
from .checkpoint import load_shards
from .compiling import compile_blocks
from .parallel import (checkpoint_blocks, find_blocks, local_tensor, named_optimizer_state,
                       optimizer_param_names)
from .precision import Precision


class CommCounter:
    """Calls and bytes of the collectives FSDP issues, counted where it issues them."""

    def __init__(self) -> None:
        self.counts = {"reduce_scatters": 0, "reduce_scatter_bytes": 0, "all_gathers": 0, "all_gather_bytes": 0}


class _CountingAllGather(DefaultAllGather):
    """FSDP's own all-gather, counted: bytes are the gathered (unsharded) size."""

    def __init__(self, counter: CommCounter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.counts["all_gathers"] += 1
        self.counter.counts["all_gather_bytes"] += output_tensor.numel() * output_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(DefaultReduceScatter):
    """FSDP's own reduce-scatter, counted: bytes are the reduced (unsharded) size."""

    def __init__(self, counter: CommCounter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.counts["reduce_scatters"] += 1
        self.counter.counts["reduce_scatter_bytes"] += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class ShardedWeights:
    """The optimizer steps the model's own FP32 shards; gradients are this rank's shards.

    ``grads()`` gives the local shard of each gradient (a view of the DTensor's
    storage), so the trainer's in-place normalisation and clipping act on what
    the optimizer then reads.
    """

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def optimizer_params(self) -> List[torch.Tensor]:
        return self.params

    def accumulate(self) -> None:
        pass  # FSDP keeps (last) or reduces and adds (every) the micro-batches' gradients itself

    def grads(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(p, local_tensor(p.grad)) for p in self.params if p.grad is not None]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def after_step(self) -> None:
        pass  # the next forward all-gathers (and casts) the updated shards

    def fp32_state_dict(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The whole FP32 state dict on rank 0 (empty elsewhere), gathered one tensor at a time to CPU."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        return {k: (v.float() if v.is_floating_point() else v).detach().clone() for k, v in state.items()}

    def load_fp32_state_dict(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        """Each rank keeps its shard of a full state dict that every rank holds."""
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


class FSDPStrategy:
    """Parameters, gradients and optimizer state sharded over all ranks (FSDP2)."""

    name = "fsdp"
    grads_sharded = True

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, precision: Precision, compile: bool = False):
        model = model.to(env.device)
        blocks = find_blocks(model, cfg.blocks)
        if cfg.activation_checkpointing:
            checkpoint_blocks(blocks)
        if compile:  # after activation checkpointing, before fully_shard: its hooks stay eager
            compile_blocks(blocks, model)
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        policy = (MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=torch.float32)
                  if precision.param_dtype is not None else MixedPrecisionPolicy())
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=cfg.fsdp.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=cfg.fsdp.reshard_after_forward, mp_policy=policy)
        self.counter = CommCounter()
        for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
            unit.set_custom_all_gather(_CountingAllGather(self.counter))
            unit.set_custom_reduce_scatter(_CountingReduceScatter(self.counter))
        if cfg.find_unused_parameters:
            # A parameter some rank did not use still takes part (with zeros) in the reduce-scatter.
            model.set_reduce_scatter_unused_params(True)
        self.model = self.module = model
        self.root: FSDPModule = model  # type: ignore[assignment]
        self.accum_sync = cfg.fsdp.accum_sync
        self.weights = ShardedWeights(model)

    def micro_batch(self, last: bool) -> ContextManager:
        if self.accum_sync == "last":
            self.root.set_requires_gradient_sync(last)  # every unit: keep unsharded grads until the last
        return nullcontext()

    def comm(self) -> Dict[str, int]:
        return dict(self.counter.counts)

    def consistency_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return list(self.module.named_buffers())  # parameters are sharded: only buffers are replicated

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every rank calls it; rank 0 gets the whole FP32 state dict, the others an empty one."""
        return self.weights.fp32_state_dict(self.module)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(what rank 0 writes into shared.pt, the sharded tensors every rank writes its part of).

        The optimizer's state is keyed by parameter name, so that any layout
        (another world size, or ddp) can find its part.
        """
        model, optim = get_state_dict(self.module, optimizer)
        return {"param_groups": optim["param_groups"]}, {"model": model, "optim": optim["state"]}

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        if shards is not None:  # an fsdp checkpoint of any world size: DCP reshards
            model, optim = get_state_dict(self.module, optimizer)  # templates (creates the optimizer state)
            state = {"model": model, "optim": optim["state"]}
            load_shards(state, shards)
            set_state_dict(self.module, optimizer, model_state_dict=state["model"],
                           optim_state_dict={"state": state["optim"], "param_groups": saved["param_groups"]})
            return
        # A ddp checkpoint: whole FP32 tensors on every rank; each keeps its shard.
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.module, saved["model"], options=full)
        names = optimizer_param_names(optimizer, self.weights, self.module)
        set_optimizer_state_dict(self.module, optimizer, named_optimizer_state(saved["optimizer"], names),
                                 options=full)


