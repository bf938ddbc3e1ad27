"""Data-parallel strategies: the one owner of wrapping. The model code knows nothing of it.

The tree, top to bottom (nothing imports what is above it)::

    parallel/__init__.py   the Strategy protocol and build_strategy
    pp.py                  pipeline stages, each an FSDP2 root, run by torch's schedules
    ddp.py, fsdp.py        DistributedDataParallel; FSDP2 flat (fsdp) or hybrid (hsdp)
    parallelize.py         tp, cp, ep, activation checkpointing and compile, in one order, for every strategy
    cp.py                  context parallelism: each sequence's tokens over a cp group, ring or ulysses attention
    sync_batchnorm.py      BatchNorm statistics over all ranks (ddp)
    blocks.py, state.py    the model's blocks (sharding, activation checkpointing, compile);
                           optimizer state by parameter name, local shards, the whole model
                           tensor by tensor (exports)
    comm.py                the metrics keys of the collectives every strategy counts
    dcp.py                 sharded checkpoints through DCP (fsdp, hsdp, and ddp's expert slices)
    consistency.py         dist.check_consistency_every

Each strategy calls ``parallelize.parallelize`` once, which transforms the model in one order (torchtitan's):
tp, then context parallelism (``cp.apply_cp``: the batch cut to this rank's positions, the attention exchanged),
then expert parallelism (``moe.ep.apply_ep``: the experts cut over ``dist.ep.size`` data ranks, their gradients
reduced by it, outside DDP and FSDP), then activation checkpointing and compile per block; the strategy then
wraps the result in DDP, FSDP or pipeline stages.

A strategy is chosen once, at build time, on the mesh ``validate`` derived
(``config.MeshShape``), and answers the few questions the optimizer step asks,
the same way for every strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from ..config import DistConfig, MeshShape
from ..distributed import DistEnv
from ..precision import Precision
from .consistency import ConsistencyError, check_consistency
from .state import WholeTensors

__all__ = ["Strategy", "build_strategy", "ConsistencyError", "check_consistency"]


class Strategy(Protocol):
    name: str  # what checkpoints record: ddp or fsdp
    mesh: MeshShape
    model: nn.Module  # what the step calls
    module: nn.Module  # the user's model as built (its parameter names)
    weights: Any  # where the optimizer's FP32 weights and the step's gradients live: grads(), zero_grad(), ...
    groups: List[Any]  # every process group its collectives run on (the default one first)

    def micro_batch(self, last: bool) -> ContextManager:
        """The context of one micro-batch's forward and backward: whether its backward reduces gradients."""

    def evaluation(self) -> ContextManager:
        """The context of evaluation's forward passes (leaves nothing gathered behind)."""

    def grad_norm_sq(self, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's float64 share of the squared global gradient norm from (parameter, gradient) pairs:
        summed over ranks, the norm squared."""

    def track_peak(self, on: bool) -> None:
        """Start (or stop) measuring what the step holds beyond the model state: gathered parameters, unsharded grads."""

    def peak_bytes(self) -> int:
        """The most such bytes held at once while tracked (0: nothing beyond the state)."""

    def grads_ready_at(self) -> float:
        """time.perf_counter() when this rank last issued a gradient reduction: its compute was done."""

    def comm(self) -> Dict[str, int]:
        """Collectives issued so far, counted where they are issued: calls and bytes by kind."""

    def consistency_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """What must be bit-identical on every rank."""

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole FP32 state dict (on rank 0 at least); every rank calls it."""

    def full_tensors(self) -> WholeTensors:
        """The whole FP32 model one tensor at a time on rank 0 (``state.WholeTensors``); every rank calls it and
        iterates it in full. What exports go through: no rank ever holds the whole model."""

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """(what rank 0 writes into shared.pt, the sharded tensors every rank writes its part of, or None)."""

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        """Continue from a checkpoint written by any strategy and mesh."""


def build_strategy(model: nn.Module, env: DistEnv, cfg: DistConfig, mesh: MeshShape, precision: Precision,
                   compile: bool = False, materialise: Optional[Callable[[nn.Module], None]] = None) -> Strategy:
    """The strategy of ``dist.strategy`` on ``mesh``, wrapping ``model`` (on the CPU, as instantiated).

    ``materialise``: ``model`` is on the meta device; once it is cut and sharded, this gives each rank's shards
    their storage and initial values (``models.construct``), before anything holds a reference to them.

    Under tensor parallelism (``mesh.tp`` > 1) ddp's replicas are FSDP2's too, with shard groups of one
    data-parallel rank: FSDP2 takes parameters already cut over the tp dimension, DDP does not.
    """
    precision.fp32_norms(model)  # before any strategy cuts or wraps it: its LayerNorms are FP32LayerNorms
    if mesh.pp > 1:
        from .pp import PipelineStrategy

        return PipelineStrategy(model, env, cfg, mesh, precision, compile, materialise)
    if mesh.strategy == "fsdp" or mesh.tp > 1:
        from .fsdp import FSDPStrategy

        return FSDPStrategy(model, env, cfg, mesh, precision, compile, materialise)
    if materialise is not None:  # ddp: every rank holds the whole model
        materialise(model)
    from .ddp import DDPStrategy

    return DDPStrategy(model, env, cfg, mesh, precision, compile)
