"""The shapes derived from a configuration: the mesh (``MeshShape``, ``derive_mesh``), the batch plan
(``BatchPlan``, ``derive_batch``, ``scaled_lr``) and the modes chosen for keys left at auto (``resolve_reshard``).

Pure arithmetic on the schema, decided once and printed by plan mode: it imports ``schema`` alone. Each raises a
ConfigError naming the key where the numbers cannot fit.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .schema import (BatchConfig, ConfigError, CPConfig, DistConfig, EPConfig, OptimConfig, PPConfig, divisors,
                     pp_v_shape, require)

log = logging.getLogger("dist_trainer")

MIB = 2**20  # plan mode's figures are in MiB (metrics' *_mb keys)


def mib_text(n: int) -> str:
    """Bytes as plan mode prints them: MiB, and the exact count."""
    return f"{n / MIB:.2f} MiB ({n} bytes)"


@dataclass(frozen=True)
class MeshShape:
    """The shape of the world, decided once (``derive_mesh``) and handed to the strategy.

    ``pp`` x ``replicate`` x ``shard`` x ``tp`` = world size, pp outermost, tp
    innermost: rank ``((p * replicate + r) * shard + s) * tp + t`` is
    tensor-parallel rank ``t`` of data-parallel rank ``r * shard + s`` in
    pipeline stage group ``p``. The ``pp`` ranks that differ in ``p`` alone hold
    the model's stages and see the same micro-batches. The ``tp`` ranks of one group cut each layer between
    them and see the same micro-batches; the data-parallel ranks
    (``replicate`` x ``shard``) see different ones. Data-parallel ranks
    ``r * shard ... r * shard + shard - 1`` form shard group ``r`` (consecutive:
    one node's under ``shard_size=node``); rank ``s`` of every group holds the
    same shard. ddp shards nothing (shard 1).

    ``ep`` divides the data-parallel ranks without multiplying the world (torchtitan's layout): data ranks
    ``g * ep ... g * ep + ep - 1`` form expert-parallel group ``g``, each holding 1/ep of every MoE layer's routed
    experts (rank ``i`` of a group the ``i``-th slice); the ranks with the same ``i`` in every group hold the same
    experts and form its expert-data-parallel group (``expert_data_ranks`` of them), over which those experts'
    gradients are reduced. Every rank still sees its own micro-batches.
    """

    strategy: str  # ddp | fsdp
    replicate: int
    shard: int
    tp: int = 1
    pp: int = 1
    # The stages' placement: stage group r holds stages r, r + pp, ... (loop), or r and 2 pp - 1 - r (the V of
    # dist.pp.schedule=zero_bubble with 2 stages a rank), where the first and the last stage are both group 0's.
    pp_v: bool = False
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage group: replicate x shard x tp."""
        return self.replicate * self.shard * self.tp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline stage group global ``rank`` is in (0 holds the first stage)."""
        return rank // self.stage_ranks

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are averaged (replicate x shard): the data ranks' cp ranks included."""
        return self.replicate * self.shard

    @property
    def data_ranks(self) -> int:
        """Ranks that see different micro-batches: the batch plan's unit."""
        return self.replicate * self.shard // self.cp

    def counts_batch(self, rank: int) -> bool:
        """Whether ``rank``'s micro-batches count in the step's totals: one rank per tensor-parallel group,
        in the group of the last pipeline stage (which computes the loss)."""
        return rank % self.tp == 0 and self.pp_rank(rank) == self.last_stage_group

    @property
    def last_stage_group(self) -> int:
        """The stage group holding the last stage (and the loss): pp - 1, or 0 under the V placement."""
        return 0 if self.pp_v else self.pp - 1

    def grad_rank(self, rank: int) -> int:
        """Global ``rank``'s index among the gradient ranks of its stage group (replicate x shard)."""
        return (rank % self.stage_ranks) // self.tp

    def data_rank(self, rank: int) -> int:
        """Which micro-batches global ``rank`` sees: the same for every rank of a tensor-parallel group, of a
        context-parallel group and for every stage of a pipeline."""
        return self.grad_rank(rank) // self.cp

    def cp_rank(self, rank: int) -> int:
        """Which part of each sequence's tokens global ``rank`` holds (0 without context parallelism)."""
        return self.grad_rank(rank) % self.cp

    def counts_samples(self, rank: int) -> bool:
        """Whether ``rank`` counts its micro-batches' samples: one rank of a context-parallel group (its cp
        ranks hold parts of the same sequences), where ``counts_batch`` holds."""
        return self.counts_batch(rank) and self.cp_rank(rank) == 0

    def ep_rank(self, rank: int) -> int:
        """Which slice of the experts global ``rank`` holds (0 without expert parallelism)."""
        return self.data_rank(rank) % self.ep

    @property
    def expert_data_ranks(self) -> int:
        """Ranks holding the same experts (one per expert-parallel group): their gradients are reduced over these."""
        return self.data_ranks // self.ep

    @property
    def shards_experts(self) -> bool:
        """Whether each expert slice is cut again over the edp ranks, FSDP units of their own (fsdp and hsdp
        without pipeline stages, where there are several edp ranks; ``moe.ep``), rather than whole on its rank."""
        return self.ep > 1 and self.kind != "ddp" and self.pp == 1 and self.expert_data_ranks > 1

    def counts_experts(self, rank: int) -> bool:
        """Whether ``rank``'s expert gradients count in the global norm: each expert once, in the first
        expert-parallel group (the others hold copies)."""
        return self.data_rank(rank) < self.ep and rank % self.tp == 0  # tp ranks hold the same experts whole

    @property
    def cuts_model(self) -> bool:
        """Whether the strategy cuts the model over ranks (fsdp, hsdp, tp, pp): no rank needs it whole."""
        return self.strategy == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def holds_part(self) -> bool:
        """Whether a rank holds a part of the model, not all of it: the model cut (cuts_model), or the experts,
        most of an MoE model, sliced over ep."""
        return self.cuts_model or self.ep > 1

    @property
    def kind(self) -> str:
        """ddp, fsdp (one shard group of every data-parallel rank) or hsdp (shard groups replicated)."""
        if self.strategy == "ddp":
            return "ddp"
        return "fsdp" if self.replicate == 1 else "hsdp"

    def describe(self) -> str:
        if self.kind == "ddp":
            text = f"ddp: {self.replicate} replicas"
        elif self.kind == "fsdp":
            text = f"fsdp: 1 shard group of {self.shard} ranks"
        else:
            text = f"hsdp: {self.replicate} replicas x shard groups of {self.shard} ranks"
        if self.tp > 1:
            text = f"{text}, each rank a tensor-parallel group of {self.tp} ranks"
        if self.ep > 1:
            text = (f"{text}; experts split over expert-parallel groups of {self.ep} data ranks, their gradients "
                    f"reduced over {self.expert_data_ranks}"
                    + (" (fsdp: each slice sharded over them)" if self.shards_experts else ""))
        if self.cp > 1:
            text = (f"{text}; each sequence's tokens split over context-parallel groups of {self.cp} of them "
                    f"({self.data_ranks} data-parallel ranks)")
        return text if self.pp == 1 else f"pipeline of {self.pp} stage groups, each {text}"


def derive_mesh(dist: "DistConfig", world_size: int, local_world_size: int) -> MeshShape:
    """The mesh of ``dist.pp.size``, ``dist.tp.size``, ``dist.strategy``, ``dist.fsdp.shard_size`` and
    ``dist.ep.size`` and ``dist.cp.size``; ConfigError naming the key."""
    cp = dist.cp.size
    require(isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1, "dist.cp.size", cp,
            "must be an integer >= 1 (1: no context parallelism)")
    if cp > 1:  # taken from the gradient ranks: the shape without it, then cp groups within each shard group
        shape = derive_mesh(replace(dist, cp=CPConfig()), world_size, local_world_size)
        inner = shape.shard if shape.strategy == "fsdp" else shape.replicate
        require(inner % cp == 0, "dist.cp.size", cp,
                f"must divide the {inner} ranks of a " + ("shard group (dist.fsdp.shard_size)" if shape.strategy ==
                                                           "fsdp" else "data-parallel world")
                + f" (one of {divisors(inner)}): a context-parallel group is made of data-parallel ranks")
        return replace(shape, cp=cp)
    ep = dist.ep.size
    require(isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1, "dist.ep.size", ep,
            "must be an integer >= 1 (1: no expert parallelism)")
    if ep > 1:  # taken from the data-parallel ranks: the shape without it, then ep within its data ranks
        shape = derive_mesh(replace(dist, ep=EPConfig()), world_size, local_world_size)
        require(shape.data_ranks % ep == 0, "dist.ep.size", ep,
                f"must divide the {shape.data_ranks} data-parallel ranks (one of {divisors(shape.data_ranks)}): "
                "expert-parallel groups are made of data ranks")
        return replace(shape, ep=ep)
    pp = dist.pp.size
    require(world_size % pp == 0, "dist.pp.size", pp,
            f"must divide the world size {world_size} (one of {divisors(world_size)})")
    if pp > 1:
        # Each stage group is a mesh of its own: consecutive ranks, a node's (or part of one).
        shape = derive_mesh(replace(dist, pp=PPConfig()), world_size // pp, min(local_world_size, world_size // pp))
        return replace(shape, pp=pp, pp_v=pp_v_shape(dist.pp))
    tp = dist.tp.size
    require(world_size % tp == 0, "dist.tp.size", tp,
            f"must divide the world size {world_size} (one of {divisors(world_size)})")
    if tp > 1 and local_world_size % tp:
        log.warning("dist.tp.size=%d does not divide the %d ranks of a node: tensor-parallel groups span nodes, "
                    "and every layer's activations cross the slower link twice per forward and backward", tp,
                    local_world_size)
    data, node = world_size // tp, max(local_world_size // tp, 1)
    if dist.strategy == "ddp":
        return MeshShape("ddp", data, 1, tp)
    size = dist.fsdp.shard_size
    if size is None:
        return MeshShape("fsdp", 1, data, tp)
    if size == "node":
        require(data % node == 0 and local_world_size % tp == 0, "dist.fsdp.shard_size", size,
                f"the world size {world_size} is not a whole number of nodes of {local_world_size} ranks"
                + (f" in tensor-parallel groups of dist.tp.size={tp}" if tp > 1 else ""))
        return MeshShape("fsdp", data // node, node, tp)
    require(isinstance(size, int) and not isinstance(size, bool) and size >= 1 and data % size == 0,
            "dist.fsdp.shard_size", size, f"must be null, node, or a divisor of the {data} data-parallel ranks "
            f"(one of {divisors(data)})" + (f"; world size {world_size} / dist.tp.size={tp}" if tp > 1 else ""))
    return MeshShape("fsdp", data // size, size, tp)


@dataclass(frozen=True)
class BatchPlan:
    """The derived numbers of one optimizer step, for a given world size."""

    world_size: int
    micro_batch_size: int
    accum_steps: int
    global_batch_size: int
    base_lr: float
    lr: float  # after scaling for the effective batch
    max_steps: int
    mesh: Optional[MeshShape] = None  # always set by validate; None only in plans built by hand for the data order
    # What validate chose for keys left at auto, as printed at start-up and by plan mode
    # (e.g. "dist.fsdp.reshard=auto -> forward (dist.pp.size=2)").
    chosen: Tuple[str, ...] = ()

    @property
    def data_ranks(self) -> int:
        """Ranks that see different micro-batches (world / tp / pp / cp): micro x accum x data ranks = global."""
        return self.world_size if self.mesh is None else self.mesh.data_ranks

    def describe(self) -> str:
        ranks = (f"world size {self.world_size}" if self.data_ranks == self.world_size else
                 f"data-parallel ranks {self.data_ranks} (world size {self.world_size}"
                 + (f" / tp {self.mesh.tp}" if self.mesh.tp > 1 else "")
                 + (f" / pp {self.mesh.pp}" if self.mesh.pp > 1 else "")
                 + (f" / cp {self.mesh.cp}" if self.mesh.cp > 1 else "") + ")")
        return (
            f"{ranks} x micro batch {self.micro_batch_size} "
            f"x accum steps {self.accum_steps} = global batch {self.global_batch_size} "
            f"samples per optimizer step; lr {self.base_lr:g} -> {self.lr:g} after scaling; "
            f"{self.max_steps} optimizer steps" + "".join(f"; {line}" for line in self.chosen)
        )


def derive_batch(batch: BatchConfig, world_size: int, ranks: str = "world size") -> tuple[int, int]:
    """Return (accum_steps, global_batch_size); micro x accum x world = global.

    ``world_size``: the ranks that see different micro-batches (world / dist.tp.size), called ``ranks``.
    """
    micro = batch.micro_batch_size
    require(isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1, "batch.micro_batch_size",
            micro, "must be an integer >= 1, or auto")
    if batch.accum_steps is not None:
        require(batch.accum_steps >= 1, "batch.accum_steps", batch.accum_steps, "must be >= 1")
    if batch.global_batch_size is None:
        accum = batch.accum_steps or 1
        return accum, micro * accum * world_size
    glob = batch.global_batch_size
    require(glob >= 1, "batch.global_batch_size", glob, "must be >= 1")
    per_rank, rest = divmod(glob, micro * world_size)
    if rest or per_rank == 0:
        # Suggestions that pass this check as they stand: with batch.accum_steps set,
        # micro x world x accum must make the global batch.
        accum = batch.accum_steps or 1
        micros = [m for m in divisors(glob) if glob % (m * world_size * accum) == 0
                  and (batch.accum_steps is None or glob // (m * world_size) == accum)]
        step = micro * world_size * accum
        lower = max(glob // step, 1) * step
        hint = (
            f"batch.micro_batch_size in {micros[-6:]} would divide it"
            if micros
            else f"no micro batch divides it over {world_size} ranks"
            + (f" in batch.accum_steps={accum}" if batch.accum_steps is not None else "")
        )
        other_global = (f"batch.global_batch_size to a multiple of {step} (e.g. {lower} or {lower + step})"
                        if batch.accum_steps is None else
                        f"batch.global_batch_size={step} (micro x world x batch.accum_steps), or drop batch.accum_steps")
        raise ConfigError(
            f"batch.global_batch_size={glob} is not batch.micro_batch_size={micro} x "
            f"{ranks} {world_size} x batch.accum_steps: {hint}; or set {other_global}"
        )
    if batch.accum_steps is not None and batch.accum_steps != per_rank:
        raise ConfigError(
            f"batch.accum_steps={batch.accum_steps} contradicts batch.global_batch_size={glob} "
            f"/ (batch.micro_batch_size={micro} x {ranks} {world_size}) = {per_rank}; "
            "set one of them, or make them agree"
        )
    return per_rank, glob


def scaled_lr(optim: OptimConfig, global_batch_size: int) -> float:
    if optim.lr_scaling == "none":
        return optim.lr
    ratio = global_batch_size / optim.base_batch_size
    return optim.lr * (ratio if optim.lr_scaling == "linear" else math.sqrt(ratio))


def resolve_reshard(dist: DistConfig) -> Optional[str]:
    """``dist.fsdp.reshard=auto`` made a mode, in place, so that everything after validate sees the mode alone.

    micro_batch (the lowest memory) where the mesh supports it; forward under fsdp with pipeline stages, where
    micro_batch is refused (``parallel.checks.check_pp``: torch's stages keep each unit gathered from its first
    backward to the step's end, so forward gathers as often and holds no more). Returns the line saying what was chosen
    where it matters (fsdp), else None.
    """
    f = dist.fsdp
    if f.reshard != "auto":
        return None
    pipeline = isinstance(dist.pp.size, int) and dist.pp.size > 1
    f.reshard = "forward" if dist.strategy == "fsdp" and pipeline else "micro_batch"
    if dist.strategy != "fsdp":
        return None  # ddp gathers nothing: the mode changes no number there
    why = f"micro_batch is not supported with dist.pp.size={dist.pp.size}" if pipeline else "this mesh supports it"
    return f"dist.fsdp.reshard=auto -> {f.reshard} ({why})"
