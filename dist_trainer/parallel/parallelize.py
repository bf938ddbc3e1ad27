"""The model's dimensions applied in one order, the same under every strategy (torchtitan's ``parallelize``).

``parallelize`` transforms the model in place, each step on what the previous one left::

    1. tensor parallelism     (tp.apply_tp)      each layer cut over its tp group, as the plan says
       [pipeline stages: this rank keeps its own stages; tp planned the whole model, the rest acts on what it holds]
    2. context parallelism    (cp.apply_cp)      the batch cut to this rank's positions, the attention exchanged
    3. expert parallelism     (moe.ep.apply_ep)  the experts cut over each ep group, their gradients its own
    4. activation checkpointing, per block      (blocks.prepare_blocks)
    5. compile, per block                       (after checkpointing: the checkpoint is traced into the graph)

Then each strategy wraps what it got, once: DDP (ddp.py), ``fully_shard`` per block and root (fsdp.py), or each
pipeline stage an FSDP2 root (pp.py). Where the strategies differ, they say so in the arguments: the tp mesh
(none under ddp), whether fsdp shards the experts over their edp ranks, and the pipeline's cut to its stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import DistConfig, MeshShape
from ..distributed import DistEnv
from ..moe.ep import apply_ep, check_ep
from .blocks import find_blocks, prepare_blocks
from .cp import ContextParallel, apply_cp
from .tp import TensorParallel, apply_tp


@dataclass
class Applied:
    """What ``parallelize`` applied, as the strategy needs it: each dimension's handle, and the blocks."""

    tp: Optional[TensorParallel]  # None without tensor parallelism
    cp: ContextParallel  # its size is 1 without context parallelism
    ep: Any  # moe.ep.ExpertParallel, or a NoExperts
    blocks: List[nn.Module]  # the blocks this rank holds: checkpointed and compiled as asked, FSDP's units


def parallelize(model: nn.Module, mesh: MeshShape, cfg: DistConfig, env: DistEnv,
                tp_mesh: Optional[DeviceMesh] = None, compile: bool = False, sharded_experts: bool = False,
                keep_stages: Optional[Callable[[nn.Module], None]] = None) -> Applied:
    """Apply tp, cp, ep, activation checkpointing and compile to ``model`` in place, in that order.

    ``tp_mesh``: the tp sub-mesh (None: no tensor parallelism). ``compile``: trainer.compile (tp's collectives
    are then not counted: they run inside the graphs). ``sharded_experts``: FSDP2 shards the experts again over
    their edp ranks (``MeshShape.shards_experts``). ``keep_stages``: the pipeline's cut of the model to this
    rank's stages, after tp and before the rest.
    """
    if mesh.ep > 1:  # the whole model's experts, checked before anything is cut
        check_ep(model, mesh)
    tp = (apply_tp(model, tp_mesh, cfg.tp, find_blocks(model, cfg.blocks), count=not compile)
          if tp_mesh is not None else None)
    if keep_stages is not None:
        keep_stages(model)
    cp = apply_cp(model, mesh, cfg.cp, env.rank, env.device.type)
    ep = apply_ep(model, mesh, env.rank, env.device.type, sharded=sharded_experts, check=False)
    blocks = prepare_blocks(model, cfg.blocks, cfg.activation_checkpointing, compile)  # before any wrapper's hooks
    return Applied(tp, cp, ep, blocks)
