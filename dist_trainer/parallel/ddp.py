"""``dist.strategy=ddp``: every rank holds the whole model; one gradient all-reduce per optimizer step.

DistributedDataParallel with ``no_sync`` for the first N-1 micro-batches, its
all-reduce routed through a counting communication hook (the precision mode
decides how a bucket is reduced: master modes send FP32 copies of half buckets).
"""

# No "from __future__ import annotations": DDP inspects the hook's real annotations.

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import DistConfig, MeshShape
from ..distributed import DistEnv
from ..precision import MasterWeights, ModelWeights, Precision, frozen_names
from .comm import COMM_KEYS
from .dcp import dcp_checkpoint_state, dcp_load_checkpoint_state
from .parallelize import parallelize
from .state import WholeTensors, indexed_optimizer_state, optimizer_param_names, parameter_ties, state_of

ReduceBucket = Callable[[dist.GradBucket, Optional[dist.ProcessGroup]], torch.futures.Future]


@dataclass
class AllreduceCounter:
    """Gradient all-reduces issued by DDP, counted by its communication hook."""

    reduce: ReduceBucket  # how a bucket is all-reduced (the precision mode decides)
    process_group: Optional[dist.ProcessGroup] = None
    calls: int = 0
    bytes: int = 0
    # Bytes per gradient element that ``reduce`` sends: None, the bucket's own dtype;
    # 4 in master modes, which all-reduce an FP32 copy of half-precision buckets.
    sent_element_size: Optional[int] = None
    last_issued: float = 0.0  # time.perf_counter() of the latest call: this rank's gradients were ready


def _counting_hook(counter: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    counter.calls += 1
    counter.last_issued = time.perf_counter()
    counter.bytes += buffer.numel() * (counter.sent_element_size or buffer.element_size())
    return counter.reduce(bucket, counter.process_group)


def apply_ddp(model: nn.Module, env: DistEnv, cfg: DistConfig) -> DDP:
    """Move to the device, convert BatchNorm if asked, wrap in DDP."""
    model = model.to(env.device)
    if cfg.sync_batchnorm:
        from .sync_batchnorm import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, env.device)
    return DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=cfg.find_unused_parameters,
        # None keeps DDP's own bucketing (a small first bucket); an explicit 25 does not.
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=bucket_views(cfg),
    )


def bucket_views(cfg: DistConfig) -> bool:
    """Whether gradients live in DDP's buckets (one gradient-sized copy less per rank).

    Not with find_unused_parameters: a parameter no rank used would get a zero
    view in place of no gradient, and AdamW would then step it (decay, momentum).
    """
    return cfg.gradient_as_bucket_view and not cfg.find_unused_parameters


def count_allreduces(ddp: DDP, reduce: ReduceBucket, sent_element_size: Optional[int] = None) -> AllreduceCounter:
    """Route DDP's gradient all-reduce through ``reduce`` and count its calls and bytes."""
    counter = AllreduceCounter(reduce, sent_element_size=sent_element_size)
    ddp.register_comm_hook(counter, _counting_hook)
    return counter


class DDPStrategy:
    """Every rank holds the whole model; one gradient all-reduce per optimizer step."""

    name = "ddp"

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, mesh: MeshShape, precision: Precision,
                 compile: bool = False):
        precision.prepare(model)  # master modes: half parameters, FP32 norm layers
        # cp, ep, checkpointing and compile per block (no tp: tp's meshes are FSDP2's), then DDP's hooks.
        applied = parallelize(model.to(env.device), mesh, cfg, env, compile=compile)
        self.cp, self.ep = applied.cp, applied.ep
        if self.ep.params:
            # An expert slice is not replicated over the ranks: DDP must neither broadcast nor all-reduce it
            # (ExpertParallel reduces it over its edp group). This static method is how torch's own composites
            # tell DDP to leave parameters alone; there is no public one.
            names = {id(p): name for name, p in model.named_parameters()}
            DDP._set_params_and_buffers_to_ignore_for_model(model, [names[id(p)] for p in self.ep.params])
        self.model = apply_ddp(model, env, cfg)
        self.module = self.model.module
        self.mesh, self.is_first_replica = mesh, env.rank == 0
        self.weights = precision.weights(self.module)
        if isinstance(self.weights, ModelWeights) and bucket_views(cfg):
            self.weights.keep_grad_buffers = True
        self.counter = count_allreduces(self.model, self.weights.reduce_bucket, self.weights.sent_element_size)
        self.weights = self.ep.weights(self.weights)  # expert gradients as their local slices
        # every other collective runs on the default group
        self.groups = [dist.group.WORLD, *self.ep.groups, *self.cp.groups]

    @contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        # no_sync must cover forward AND backward: DDP decides during forward
        # whether the backward of that graph all-reduces. Only the window's
        # last backward syncs, carrying the sum of all micro-batches' grads.
        with nullcontext() if last else self.model.no_sync():
            yield
        if last:  # the experts' gradients, which accumulated outside DDP, reduced once like DDP's
            self.ep.reduce_grads()

    def evaluation(self) -> ContextManager:
        return nullcontext()

    def track_peak(self, on: bool) -> None:
        pass  # nothing is gathered, and the whole gradient is part of state_mb

    def peak_bytes(self) -> int:
        return 0

    def grad_norm_sq(self, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's share of the squared global norm: the sum over ranks is the norm squared.

        Every rank holds the same whole (all-reduced) gradient, so rank 0 gives
        its norm squared and the others zero times theirs: the sum is exact
        (sqrt gives back the FP32 norm bit for bit), and a non-finite norm on
        any rank still makes it non-finite (inf x 0 is NaN).
        """
        grads, experts = self.ep.norm_sq(grads)  # an expert slice counts on its first holder
        norm = (torch.nn.utils.get_total_norm([g for _, g in grads], error_if_nonfinite=False) if grads
                else torch.zeros(()))
        return norm.double().square() * float(self.is_first_replica) + experts.to(norm.device)

    def grads_ready_at(self) -> float:
        return self.counter.last_issued

    def comm(self) -> Dict[str, int]:
        ep = self.ep.comm()  # the experts' all-to-alls and edp all-reduces (nothing without ep)
        return {**dict.fromkeys(COMM_KEYS, 0), **ep, "allreduces": self.counter.calls + ep.get("allreduces", 0),
                "allreduce_bytes": self.counter.bytes + ep.get("allreduce_bytes", 0), **self.cp.comm()}

    def consistency_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """What must be bit-identical on every rank: parameters (but expert slices), buffers, FP32 masters."""
        module = self.module
        experts = set(self.ep.params)
        named = [(n, p) for n, p in module.named_parameters() if p not in experts] + list(module.named_buffers())
        if isinstance(self.weights, MasterWeights):
            names = {p: name for name, p in module.named_parameters()}
            named += [(f"{names[p]} (FP32 master)", m) for p, m in zip(self.weights.params, self.weights.masters)]
        return named

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The FP32 state dict of the unwrapped model (every rank has it whole, but for expert slices)."""
        if self.ep.params:
            return self.full_tensors().state_dict()
        return self.weights.fp32_state_dict(self.module)

    def full_tensors(self) -> WholeTensors:
        """The FP32 model (the masters in master modes) tensor by tensor: rank 0 holds it all, nothing is sent."""
        return WholeTensors(self.weights.fp32_tensors(self.module), parameter_ties(self.module),
                            next(self.module.parameters()).device)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], None]:
        """(what rank 0 writes into shared.pt, nothing sharded): the FP32 model and optimizer.

        Frozen parameters (a LoRA model's base) are left out, not even copied:
        the model is built with them, and the checkpoint records their digest
        (checkpoint.frozen_digest).
        """
        if self.ep.params:  # expert slices: sharded like fsdp's, so any layout reads it
            return dcp_checkpoint_state(self.module, optimizer)
        model = self.weights.fp32_state_dict(self.module, leave_out=frozen_names(self.module))
        return {"model": model, "optimizer": optimizer.state_dict()}, None

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        if self.ep.params:  # DCP puts each expert slice where it lives, from any checkpoint
            dcp_load_checkpoint_state(self.module, optimizer, self.weights, saved, shards)
            return
        if shards is None:  # a ddp checkpoint
            self.weights.load_fp32_state_dict(self.module, saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            return
        # A sharded checkpoint (fsdp or hsdp): every ddp rank holds the whole model anyway, so each reads every shard.
        from ..checkpoint import load_shards, shard_tensor_shapes

        whole = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shard_tensor_shapes(shards).items()}
        load_shards(whole, shards)
        model = {key[len("model."):]: value for key, value in whole.items() if key.startswith("model.")}
        self.weights.load_fp32_state_dict(self.module, model)
        names = optimizer_param_names(optimizer, self.weights, self.module)
        optimizer.load_state_dict(indexed_optimizer_state(
            names, {name: state_of(whole, name) for name in names}, saved["param_groups"]))
