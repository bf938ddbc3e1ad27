"""Data-parallel strategies: the one owner of wrapping. The model code knows nothing of it.

A strategy is chosen once, at build time (``build_strategy``), and answers the
few questions the optimizer step asks, the same way for every strategy:

* ``model``: what the step calls; ``module``: the user's model as built;
* ``weights``: where the optimizer's FP32 weights and the step's gradients live
  (``grads()`` gives what this rank holds: whole gradients under ddp, this
  rank's shard under fsdp; ``grads_sharded`` says which);
* ``micro_batch(last)``: the context of one micro-batch's forward and backward,
  which decides whether its backward reduces gradients;
* ``comm()``: the collectives it issued so far, counted where they are issued;
* the full FP32 state dict (``final_model.pt``) and the checkpointed state.

``ddp`` wraps in DistributedDataParallel: one all-reduce per step (``no_sync``
for the first N-1 micro-batches), through a counting communication hook.
``fsdp`` shards with FSDP2's ``fully_shard`` (each block its own unit, then the
root), reduce-scattering once per step (``dist.fsdp.accum_sync=last``) or with
every micro-batch (``every``).
"""

# No "from __future__ import annotations": DDP inspects the hook's real annotations.

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .compiling import compile_blocks
from .config import ConfigError, DistConfig
from .distributed import DistEnv
from .precision import MasterWeights, ModelWeights, Precision


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


def _counting_hook(counter: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    counter.calls += 1
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


# ----------------------------------------------------------------------------- blocks

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
        if type(module).__name__ in wanted:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    if configured is not None and names and not found:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(f"dist.blocks={names}: no module of the model has that class; "
                          f"its classes are {classes}")
    return found


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (a view of its storage), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Non-reentrant activation checkpointing of each block, keeping its parameter names.

    The block's forward runs under ``torch.utils.checkpoint.checkpoint``: its
    activations are freed after forward and recomputed in backward, with the
    RNG state of the forward (the same dropout masks).
    """
    from torch.utils.checkpoint import checkpoint

    if not blocks:
        raise ConfigError("dist.activation_checkpointing=true: the model declares no blocks to checkpoint; "
                          "set dist.blocks to the class names of its repeated blocks")
    for block in blocks:
        forward = block.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed  # an instance attribute: state_dict keys are unchanged


# ----------------------------------------------------------------------------- strategies

class DDPStrategy:
    """Every rank holds the whole model; one gradient all-reduce per optimizer step."""

    name = "ddp"
    grads_sharded = False

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, precision: Precision, compile: bool = False):
        precision.prepare(model)  # master modes: half parameters, FP32 norm layers
        if cfg.activation_checkpointing:
            checkpoint_blocks(find_blocks(model, cfg.blocks))
        if compile:  # after activation checkpointing (compiled with it), before DDP's hooks
            compile_blocks(find_blocks(model, cfg.blocks), model)
        self.model = apply_ddp(model, env, cfg)
        self.module = self.model.module
        self.weights = precision.weights(self.module)
        if isinstance(self.weights, ModelWeights) and bucket_views(cfg):
            self.weights.keep_grad_buffers = True
        self.counter = count_allreduces(self.model, self.weights.reduce_bucket, self.weights.sent_element_size)

    def micro_batch(self, last: bool) -> ContextManager:
        # no_sync must cover forward AND backward: DDP decides during forward
        # whether the backward of that graph all-reduces. Only the window's
        # last backward syncs, carrying the sum of all micro-batches' grads.
        return nullcontext() if last else self.model.no_sync()

    def comm(self) -> Dict[str, int]:
        return {"allreduces": self.counter.calls, "allreduce_bytes": self.counter.bytes}

    def consistency_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        """What must be bit-identical on every rank: parameters, buffers, FP32 masters."""
        module = self.module
        named = list(module.named_parameters()) + list(module.named_buffers())
        if isinstance(self.weights, MasterWeights):
            names = {p: name for name, p in module.named_parameters()}
            named += [(f"{names[p]} (FP32 master)", m) for p, m in zip(self.weights.params, self.weights.masters)]
        return named

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The FP32 state dict of the unwrapped model (every rank has it whole)."""
        return self.weights.fp32_state_dict(self.module)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], None]:
        """(what rank 0 writes into shared.pt, nothing sharded): the whole FP32 model and optimizer."""
        return {"model": self.full_state_dict(), "optimizer": optimizer.state_dict()}, None

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        if shards is None:  # a ddp checkpoint
            self.weights.load_fp32_state_dict(self.module, saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            return
        # An fsdp checkpoint: every ddp rank holds the whole model anyway, so each reads every shard.
        from .checkpoint import load_shards, shard_tensor_shapes

        whole = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shard_tensor_shapes(shards).items()}
        load_shards(whole, shards)
        model = {key[len("model."):]: value for key, value in whole.items() if key.startswith("model.")}
        self.weights.load_fp32_state_dict(self.module, model)
        names = optimizer_param_names(optimizer, self.weights, self.module)
        optimizer.load_state_dict(indexed_optimizer_state(
            names, {name: _state_of(whole, name) for name in names}, saved["param_groups"]))


# ----------------------------------------------------------------------------- optimizer state by name

def optimizer_param_names(optimizer: torch.optim.Optimizer, weights: Any, module: nn.Module) -> List[str]:
    """The parameter name of each tensor the optimizer steps, in its state_dict's index order.

    ``weights.optimizer_params()[i]`` stands for ``weights.params[i]`` (itself, or its FP32 master).
    """
    name_of = {p: name for name, p in module.named_parameters()}
    stands_for = {t: p for t, p in zip(weights.optimizer_params(), weights.params)}
    return [name_of[stands_for[t]] for group in optimizer.param_groups for t in group["params"]]


def _state_of(flat: Dict[str, torch.Tensor], name: str) -> Dict[str, torch.Tensor]:
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
    """Keyed by parameter name -> torch's index-keyed optimizer state_dict, for ``names``' order."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state.items() if value},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in groups]}


def build_strategy(model: nn.Module, env: DistEnv, cfg: DistConfig, precision: Precision, compile: bool = False):
    """The strategy of ``dist.strategy``, wrapping ``model`` (on the CPU, as instantiated); ``compile``: trainer.compile."""
    if cfg.strategy == "fsdp":
        from .fsdp import FSDPStrategy

        return FSDPStrategy(model, env, cfg, precision, compile)
    return DDPStrategy(model, env, cfg, precision, compile)


class ConsistencyError(RuntimeError):
    """Ranks that should hold identical tensors do not."""


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_consistency(named: List[Tuple[str, torch.Tensor]], step: int) -> None:
    """Raise, on every rank alike, naming the first tensor not bit-identical to rank 0's.

    One broadcast per dtype of everything concatenated; compared as integers,
    so NaNs and signed zeros count too. Each rank finds its first mismatch, and
    a MIN all-reduce makes every rank raise about the same tensor.
    """
    first_bad = len(named)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, (_, t) in enumerate(named):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        mine = torch.cat([named[i][1].detach().reshape(-1) for i in indices])
        ref = mine.clone()
        dist.broadcast(ref, src=0)
        as_int = _SAME_SIZE_INT[mine.element_size()]
        equal = mine.view(as_int) == ref.view(as_int)
        offset = 0
        for i in indices:
            n = named[i][1].numel()
            if not bool(equal[offset:offset + n].all()):
                first_bad = min(first_bad, i)
                break
            offset += n
    flag = torch.tensor([first_bad], dtype=torch.int64, device=named[0][1].device if named else None)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() < len(named):
        raise ConsistencyError(
            f"step {step}: {named[flag.item()][0]} is not bit-identical across ranks (checked against rank 0; "
            f"dist.check_consistency_every found it). Ranks have diverged: look for rank-dependent code in "
            "the model or optimizer, or non-deterministic kernels."
        )
