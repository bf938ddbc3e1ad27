"""``dist.strategy=fsdp``: FSDP2 (``fully_shard``) with exact accumulation, flat (fsdp) or hybrid (hsdp).

Each block (``dist.blocks``, default what the model declares) is its own FSDP
unit, then the root takes the rest (embeddings, head, final norm).

Mesh (``dist.fsdp.shard_size``). fsdp: one shard group of every rank; parameters,
gradients and optimizer state are cut over all of them. hsdp: a 2-D mesh
(replicate, shard); each shard group (one node's ranks under ``node``) holds a
whole copy of the model cut over its ranks. Gradients reduce-scatter within the
shard group, then the shards all-reduce across replicas.

Accumulation (``dist.fsdp.accum_sync``). ``last``: the first N-1 backward passes
run with ``set_requires_gradient_sync(False)``, so each unit keeps its unsharded
gradient and adds the next micro-batch into it; the last backward
reduce-scatters (and, hsdp, all-reduces) the window's sum once. ``every``: each
backward reduce-scatters its micro-batch and the sharded gradients add up (the
least memory); under hsdp the replica all-reduce still waits for the last
(``set_requires_all_reduce``). Either way the trainer then sees the sum of every
micro-batch's gradient averaged over all ranks, as under ddp, and applies the
same exact normalisation.

Gathered parameters (``dist.fsdp.reshard``). ``micro_batch``: freed after each
unit's forward and again after its backward (2K all-gathers per unit for K
micro-batches, the root unit too: it is given ``reshard_after_forward=True``
explicitly); ``forward``: kept from a micro-batch's forward to its backward (K);
``step``: kept from the step's first forward to its last backward (1). The
optimizer steps the sharded FP32 parameters, not the gathered copy: every unit
is resharded after the step's last backward and after evaluation, so the next
forward gathers the updated shards.

Precision. fp32 and the *-mixed modes keep FP32 shards (autocast computes in
half). The *-master modes use ``MixedPrecisionPolicy(param_dtype=half,
reduce_dtype=float32)``: the sharded FP32 parameters are the masters, there is
no second copy, and gradients are reduced in FP32.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
# torch has no public way to count FSDP's collectives; its own default collectives,
# subclassed, are counted where FSDP issues them (set_custom_all_gather / _reduce_scatter).
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param import alloc_storage

from ..config import DistConfig, MeshShape
from ..distributed import DistEnv
from ..precision import Precision
from .comm import COMM_KEYS
from .dp_plan import frozen_root, splits_frozen, unit_modules
from .dcp import checkpointed, dcp_checkpoint_state, dcp_load_checkpoint_state  # noqa: F401 (pp imports it here)
from .parallelize import parallelize
from .state import WholeTensors, local_tensor, parameter_ties
from .tied_head import TiedHeadReduction, tied_head
from .tp import tp_sharded


def _param_groups(unit: FSDPModule) -> list:
    """FSDP2's parameter groups of one unit: a list in torch 2.13; one group or None in earlier releases (2.11)."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


class PeakMeter:
    """The peak bytes of gathered parameters and unsharded gradients, sampled while ``active``.

    Sampled where they change most: at each all-gather (plus the buffer being
    gathered into), each reduce-scatter (plus its input, the unit's unsharded
    gradient in the reduce dtype) and at the end of each micro-batch. torch has
    no public view of what FSDP holds unsharded, so this reads FSDP2's own
    per-parameter state (all-gather outputs, unsharded gradients); it costs a
    walk over the parameters per sample, so it runs until the first applied
    step only, as ``state_mb``'s measurement does.
    """

    def __init__(self, units: List[FSDPModule]):
        self.params = [fp for unit in units for group in _param_groups(unit) for fp in group.fsdp_params]
        self.active, self.peak = False, 0

    def held(self) -> int:
        seen, total = set(), 0
        for fp in self.params:
            unsharded = getattr(fp, "_unsharded_param", None)
            tensors = [*fp.all_gather_outputs, fp.unsharded_accumulated_grad,
                       None if unsharded is None else unsharded.grad]
            for t in tensors:
                if t is None:
                    continue
                storage = local_tensor(t).untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    def sample(self, extra: Optional[torch.Tensor] = None) -> None:
        if self.active:
            now = self.held() + (0 if extra is None else extra.numel() * extra.element_size())
            self.peak = max(self.peak, now)


class CommCounter:
    """Calls and bytes of the collectives FSDP issues, counted where it issues them."""

    def __init__(self, meter: PeakMeter) -> None:
        self.counts = dict.fromkeys(COMM_KEYS, 0)
        self.meter = meter  # samples what is held unsharded at each collective
        self.last_reduce_scatter = 0.0  # time.perf_counter() of the latest: this rank's gradients were ready

    def all_reduced(self, reduce_output: torch.Tensor) -> None:
        """FSDP's all-reduce hook: under hsdp it runs right after each replica all-reduce, on its output."""
        self.counts["allreduces"] += 1
        self.counts["allreduce_bytes"] += reduce_output.numel() * reduce_output.element_size()


class _CountingAllGather(DefaultAllGather):
    """FSDP's own all-gather, counted: bytes are the gathered (unsharded, padded) size.

    A unit of one parameter cut by rows (a frozen base's layer, a root that holds the embedding alone) is
    gathered straight into that parameter's own gathered storage on CPU: FSDP lays its gather buffer out rank
    by rank, which for one parameter cut by rows is the parameter itself, so its copy out of the buffer is a
    copy onto itself and the buffer is no second copy of the unit (measured: LoRA on a 216 MiB qwen2, the
    root's 24 MiB embedding held once, not twice, while it is gathered).
    """

    def __init__(self, counter: CommCounter, unit: FSDPModule):
        self.counter = counter
        # the unit's parameters, listed once (its groups exist once fully_shard has run)
        self.params = [fp for group in _param_groups(unit) for fp in group.fsdp_params]
        self._into: Optional[Tuple[torch.Tensor, int]] = None  # (the parameter's tensor, its version) while gathered into

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        target = self._own_storage(size, dtype, device)
        if target is None:
            return super().allocate(size, dtype=dtype, device=device)
        alloc_storage(target)
        # FSDP copies this rank's shard in and the gather writes the rest, in place: the version autograd saw
        # when the forward saved the parameter (FSDP's own copy-out keeps it so) is restored after the gather.
        self._into = (target, target._version)
        return target

    def _own_storage(self, size, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The unit's one parameter's gathered tensor where the gather may go straight into it, else None."""
        if device.type != "cpu" or len(self.params) != 1:
            return None  # several parameters
        param = self.params[0]
        if param.fsdp_placement.dim != 0 or len(param.all_gather_outputs) != 1:
            return None  # cut by columns, or not gathered yet (FSDP makes the tensor then)
        target = param.all_gather_outputs[0]
        if target.dtype != dtype or target.device != device or (target.numel(),) != tuple(size):
            return None
        return target

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.counter.counts["all_gathers"] += 1
        self.counter.counts["all_gather_bytes"] += output_tensor.numel() * output_tensor.element_size()
        self.counter.meter.sample(output_tensor)
        into, self._into = self._into, None
        if output_tensor.device.type == "cpu" and not async_op:
            all_gather_by_broadcasts(output_tensor, input_tensor, group)
            if into is not None and into[0] is output_tensor:
                torch._C._autograd._unsafe_set_version_counter((output_tensor,), (into[1],))
            return None
        return super().__call__(output_tensor, input_tensor, group, async_op)


class _CountingReduceScatter(DefaultReduceScatter):
    """FSDP's own reduce-scatter, counted: bytes are the reduced (unsharded, padded) size."""

    def __init__(self, counter: CommCounter):
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.counter.counts["reduce_scatters"] += 1
        self.counter.last_reduce_scatter = time.perf_counter()
        self.counter.counts["reduce_scatter_bytes"] += input_tensor.numel() * input_tensor.element_size()
        self.counter.meter.sample(input_tensor)
        on_cpu = input_tensor.device.type == "cpu"
        if on_cpu and not async_op and op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            work = reduce_scatter_in_place(output_tensor, input_tensor, group, op)
        else:
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if not async_op and on_cpu:
            # The input is a copy of the unit's whole gradient. FSDP keeps it until the next unit's
            # reduce-scatter (reduce_scatter_states: so that a GPU's caching allocator cannot hand its block to
            # another stream while the collective may still read it). On CPU the collective has finished when
            # the call returns, so the copy goes now, not after the next unit's backward: under fsdp on 2
            # ranks that was a tenth of an 8-layer model held at the backward's peak.
            input_tensor.untyped_storage().resize_(0)
        return work


def all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """gloo's all-gather, without its buffer: each rank broadcasts its part into its place in the output.

    gloo gathers into a buffer of its own and copies it into the output: a unit's gathered size more at every
    gather (measured on 2 ranks, the output's pages already touched: 24 MiB for a 24 MiB output; 0 this way, and
    24-26 ms against 77-102 ms for gloo's on the same loaded machine). FSDP2 copies this rank's input into its
    place in the output already (the input is a view of it); the bytes each rank receives are the same.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat, part = output.view(-1), input.numel()
    mine = flat.narrow(0, rank * part, part)
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.view(-1))
    for src in range(world):
        dist.broadcast(flat.narrow(0, src * part, part), group=group, group_src=src)


def reduce_scatter_in_place(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                            op: dist.ReduceOp) -> None:
    """gloo's reduce-scatter, without its copy of the input: the input all-reduced in place, this rank's part
    copied out (and divided, for AVG).

    gloo reduce-scatters by all-reducing a copy of its input and dividing it: a whole unit's gradient more, plus
    the output, at the moment the backward holds the most (measured on 2 ranks: 36 MiB for a 24 MiB input, 2 MiB
    this way). FSDP's input is a buffer of its own, which it frees after the call, so it may be overwritten. The
    same all-reduce runs, so the result is bit-equal to gloo's (checked on 2 and 4 ranks, SUM and AVG) and the
    bytes on the wire are the same.
    """
    dist.all_reduce(input, op=dist.ReduceOp.SUM, group=group)
    world = dist.get_world_size(group)
    output.copy_(input.view(world, -1)[dist.get_rank(group)])
    if op == dist.ReduceOp.AVG:
        output.div_(world)


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

    def load_fp32_state_dict(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        """Each rank keeps its shard of a full state dict that every rank holds."""
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def mp_policy(precision: Precision) -> MixedPrecisionPolicy:
    """Master modes gather half parameters and reduce FP32 gradients; the rest keeps FP32 (autocast computes in half)."""
    return (MixedPrecisionPolicy(param_dtype=precision.param_dtype, reduce_dtype=torch.float32)
            if precision.param_dtype is not None else MixedPrecisionPolicy())


def count_units(units: List[FSDPModule], replicate: int,
                one_dim: Sequence[nn.Module] = ()) -> Tuple[PeakMeter, CommCounter]:
    """FSDP's collectives of ``units``, counted where issued, and the meter of what they hold unsharded.
    ``one_dim``: units on a 1-D mesh of their own under hsdp (the experts over edp), which all-reduce nothing."""
    meter = PeakMeter(units)
    counter = CommCounter(meter)
    flat = {id(u) for u in one_dim}
    for unit in units:
        unit.set_custom_all_gather(_CountingAllGather(counter, unit))
        unit.set_custom_reduce_scatter(_CountingReduceScatter(counter))
        # Only hsdp all-reduces; on a 1-D mesh the hook would follow the reduce-scatter.
        if replicate > 1 and id(unit) not in flat:
            unit.set_all_reduce_hook(counter.all_reduced)
    return meter, counter


def device_mesh(mesh: MeshShape, device_type: str) -> Tuple[DeviceMesh, Optional[DeviceMesh]]:
    """(the data-parallel mesh, the tensor-parallel one or None).

    fsdp: a 1-D mesh of every rank; hsdp: (replicate, shard), shard groups of
    consecutive ranks. With dist.tp.size > 1 both are cut from one
    (replicate, shard, tp) mesh, tp innermost (FSDP2 needs the parameters'
    tp mesh and its own to share a root).
    """
    if mesh.tp == 1:
        if mesh.replicate == 1:
            return init_device_mesh(device_type, (mesh.shard,), mesh_dim_names=("shard",)), None
        return init_device_mesh(device_type, (mesh.replicate, mesh.shard),
                                mesh_dim_names=("replicate", "shard")), None
    root = init_device_mesh(device_type, (mesh.replicate, mesh.shard, mesh.tp),
                            mesh_dim_names=("replicate", "shard", "tp"))
    data = root["shard"] if mesh.replicate == 1 else root["replicate", "shard"]
    return data, root["tp"]


def set_prefetch(blocks: List[nn.Module], units: List[nn.Module], ahead: int) -> None:
    """Each block gathers the next ``ahead`` blocks in forward and the previous ``ahead`` in backward.

    0: no unit gathers another ahead, in either direction: each is gathered when it runs (on CPU, where gloo's
    collectives block the rank, gathering ahead overlaps nothing and only holds one more unit). FSDP2 has no
    public switch for its own backward prefetch (one unit ahead wherever a unit's explicit list is empty), so
    each unit's list names the unit itself, gathered already when its backward starts: a list that prefetches
    nothing.
    """
    if not ahead:
        for unit in units:
            unit.set_modules_to_backward_prefetch([unit])
        return
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
        # the first block's list names itself: left empty, FSDP2 would gather the unit after it in its record of
        # forwards, which a second forward of the micro-batch (DPO's or GRPO's adapter reference) makes a block
        # no backward is left to read
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(i - ahead, 0):i])) or [block])


def tied_reduction(model: nn.Module, blocks: List[nn.Module], mesh: MeshShape, device_type: str, compile: bool,
                   dmesh: DeviceMesh, counts: Dict[str, int]) -> Optional[TiedHeadReduction]:
    """The tied head's own reduction (parallel/tied_head.py) where it applies, else None."""
    head = tied_head(model, blocks, mesh, device_type, compile)
    if head is None:
        return None
    weight = head.weight  # the sharded parameter, until a forward sets the gathered one
    fsdp_param = next(fp for group in _param_groups(model) for fp in group.fsdp_params if fp.sharded_param is weight)
    if mesh.replicate == 1:
        return TiedHeadReduction(head, fsdp_param, dmesh.get_group(), None, counts)
    return TiedHeadReduction(head, fsdp_param, dmesh.get_group("shard"), dmesh.get_group("replicate"), counts)


class FrozenRoot:
    """A frozen root that holds the embedding alone (a LoRA base's, tied to its head; its other layers are units
    of their own), gathered only where it is read: freed after the embedding's forward and gathered again for
    the head, and in the backward freed once the head's has run (the embedding's needs nothing).

    FSDP keeps a root gathered from its forward's first layer to its last, and in the backward until its end, so
    the embedding (a tenth of a qwen2) sat beside every layer gathered after it. It costs one all-gather more per
    training forward, which plan mode counts. Forwards without gradients (evaluation, a reference's pass) are
    left as FSDP runs them.
    """

    def __init__(self, root: FSDPModule, embedding: nn.Module, head: nn.Module):
        self.root = root
        embedding.register_forward_hook(self._after_embedding)
        head.register_forward_pre_hook(self._before_head)
        head.register_full_backward_hook(self._after_head_backward)

    @staticmethod
    def of(model: nn.Module) -> Optional["FrozenRoot"]:
        """The hooks on the root's embedding and head where ``dp_plan.frozen_root`` finds them; else None."""
        found = frozen_root(model, [fp.sharded_param for group in _param_groups(model) for fp in group.fsdp_params])
        return None if found is None else FrozenRoot(model, *found)  # type: ignore[arg-type]

    def _after_embedding(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.root.reshard()

    def _before_head(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self.root.unshard()

    def _after_head_backward(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self.root.reshard()


class FrozenShards:
    """A frozen model sharded over ``dmesh`` as the fsdp strategy shards its own (each block a unit, then the
    root), for forward passes without gradients (rl.reference=copy): each unit gathered when it runs and freed
    after its forward, none gathered ahead, its all-gathers counted (``comm``)."""

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, mesh: MeshShape, precision: Precision,
                 dmesh: DeviceMesh, materialise: Optional[Callable[[nn.Module], None]] = None):
        from .blocks import find_blocks

        model = (model if materialise is not None else model.to(env.device)).requires_grad_(False)
        blocks = find_blocks(model, cfg.blocks)
        policy = mp_policy(precision)
        for block in blocks:
            fully_shard(block, mesh=dmesh, reshard_after_forward=True, mp_policy=policy)
        fully_shard(model, mesh=dmesh, reshard_after_forward=True, mp_policy=policy)
        if materialise is not None:
            materialise(model)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        set_prefetch(blocks, units, 0)
        self.meter, self.counter = count_units(units, mesh.replicate)
        self.module = model.eval()

    def comm(self) -> Dict[str, int]:
        return dict(self.counter.counts)


class FSDPStrategy:
    """Parameters, gradients and optimizer state sharded over each shard group (FSDP2)."""

    name = "fsdp"

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, mesh: MeshShape, precision: Precision,
                 compile: bool = False, materialise: Optional[Callable[[nn.Module], None]] = None):
        model = model if materialise is not None else model.to(env.device)  # a meta model: its shards, below
        dmesh, tp_mesh = device_mesh(mesh, env.device.type)
        # tp, cp, ep, checkpointing and compile per block (parallelize.py), then fully_shard. The experts' slices
        # are cut again over their edp ranks, as FSDP units of their own (moe/ep.py).
        applied = parallelize(model, mesh, cfg, env, tp_mesh, compile, sharded_experts=mesh.shards_experts)
        self.tp, self.cp, self.ep, blocks = applied.tp, applied.cp, applied.ep, applied.blocks
        self.mesh, self.device, self.dmesh = mesh, env.device, dmesh
        policy = mp_policy(precision)
        self.reshard = cfg.fsdp.reshard
        after_forward = self.reshard == "micro_batch"  # given explicitly, to the root too
        expert_units = self.ep.shard(reshard_after_forward=after_forward, mp_policy=policy)
        # each block a unit, then the root; a frozen base's layers units of their own (dp_plan.unit_modules)
        split = splits_frozen(model, mesh, experts=bool(self.ep.ignored))
        modules = unit_modules(model, blocks, split)
        for module in modules:
            fully_shard(module, mesh=dmesh, reshard_after_forward=after_forward, mp_policy=policy,
                        ignored_params=self.ep.ignored)
        if materialise is not None:  # each rank allocates and initialises its own shards, and nothing more
            materialise(model)
        self.units: List[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
        set_prefetch(blocks, self.units, cfg.fsdp.prefetch)
        for module in modules[:-1]:
            if not any(module is block for block in blocks):
                # A frozen layer's unit gathers none ahead in backward: FSDP's own choice (the unit before it in
                # the forward) may be one no backward uses, a gather plan mode does not count and a layer more held
                module.set_modules_to_backward_prefetch([module])
        self.meter, self.counter = count_units(self.units, mesh.replicate, one_dim=expert_units)
        self.tied = tied_reduction(model, blocks, mesh, env.device.type, compile, dmesh, self.counter.counts)
        self.frozen_root = FrozenRoot.of(model) if split and self.reshard == "micro_batch" else None
        if cfg.find_unused_parameters:
            # A parameter some rank did not use still takes part (with zeros) in the reduce-scatter.
            model.set_reduce_scatter_unused_params(True)
        self.model = self.module = model
        self.root: FSDPModule = model  # type: ignore[assignment]
        self.accum_sync = cfg.fsdp.accum_sync
        # Replicas hold equal shards: the first replica's ranks alone give the gradient norm. Of a
        # parameter whole on every rank of a tp group (a norm's), the group's first rank alone.
        first_replica = mesh.grad_rank(env.rank) < mesh.shard
        self.weights = ShardedWeights(model)
        first_of_tp = env.rank % mesh.tp == 0
        self.norm_share = {p: float(first_replica and (first_of_tp or tp_sharded(p, tp_mesh)))
                           for p in self.weights.params}
        self.norm_share.update({p: self.ep.norm_share for p in self.ep.params})  # each expert once
        self._shares_cache: Tuple[tuple, Optional[torch.Tensor]] = ((), None)
        self.groups = [dist.group.WORLD, *dmesh.get_all_groups(), *(tp_mesh.get_all_groups() if tp_mesh else []),
                       *self.ep.groups, *self.cp.groups]

    @contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        with self._tp_context():  # tp: the vocabulary-sharded loss in forward and backward, tp collectives counted
            yield from self._micro_batch(last)

    def _tp_context(self, count: bool = True) -> ContextManager:
        """tp's context of a forward and backward (nothing without tp)."""
        return self.tp.context(count) if self.tp is not None else nullcontext()

    def _micro_batch(self, last: bool) -> Iterator[None]:
        if self.accum_sync == "last":
            self.root.set_requires_gradient_sync(last)  # every unit: keep unsharded grads until the last
        elif self.mesh.replicate > 1:
            self.root.set_requires_all_reduce(last)  # every: reduce-scatter now, all-reduce replicas once
        if self.reshard == "step":
            self.root.set_reshard_after_backward(last)  # keep every unit gathered until the last backward
        if self.tied is not None:  # the tied head's part reduced where FSDP's backward reduces (and frees) too
            self.tied.arm(reduces=last or (self.accum_sync == "every" and self.mesh.replicate == 1),
                          frees=self.reshard != "step" or last)
        yield
        if self.tied is not None:
            self.tied.add_to_gradient()
        self.meter.sample()  # 'last' keeps every unit's unsharded gradient from here to the next micro-batch
        if last:
            self.reshard_all()  # the optimizer steps the shards: the next forward must gather them anew
            self.ep.reduce_grads()  # the expert slices' gradients, accumulated outside FSDP, reduced once

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        try:
            with self._tp_context(count=False):
                yield
        finally:  # forward without backward: reshard=forward/step would leave units gathered
            self.reshard_all()

    def track_peak(self, on: bool) -> None:
        """Sample what FSDP holds unsharded (on), or stop (off: no cost)."""
        self.meter.active = on

    def peak_bytes(self) -> int:
        """The most bytes of gathered parameters and unsharded gradients held at once while tracked."""
        return self.meter.peak

    def reshard_all(self) -> None:
        """Free every unit's gathered parameters (nothing to do for units already resharded)."""
        for unit in self.units:
            unit.reshard()

    def grad_norm_sq(self, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's share of the squared global norm: its shards' squared norms, each counted once.

        The shards of one shard group make the whole gradient; other replicas
        hold the same shards and give zero times theirs (a non-finite value
        anywhere still makes the sum non-finite: inf x 0 is NaN). Under tp a
        parameter cut over the tp group counts on each of its ranks; one whole
        on each (a norm's) on the group's first rank only.
        """
        if not grads:
            return torch.zeros((), dtype=torch.float64)
        norms = torch.stack(torch._foreach_norm([g for _, g in grads])).double().square()
        return (norms * self._shares([p for p, _ in grads], norms.device)).sum()

    def _shares(self, params: List[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The norm shares of ``params`` as a tensor on ``device``, made once per list of parameters (a copy from
        the host every step would wait for the device's queue)."""
        key = tuple(id(p) for p in params)
        if self._shares_cache[0] != key:
            shares = torch.tensor([self.norm_share[p] for p in params], dtype=torch.float64, device=device)
            self._shares_cache = (key, shares)
        return self._shares_cache[1]

    def grads_ready_at(self) -> float:
        return self.counter.last_reduce_scatter

    def comm(self) -> Dict[str, int]:
        """FSDP's collectives and, under tp, the activations' (also apart, under tp_* keys; not counted
        under trainer.compile, where they run inside compiled graphs: the keys are then absent)."""
        counts = dict(self.counter.counts)
        for key, value in self.ep.comm().items():  # the experts' all-to-alls and edp all-reduces
            counts[key] = counts.get(key, 0) + value
        counts.update(self.cp.comm())  # context parallelism's exchanges (nothing without it)
        if self.tp is not None and self.tp.counting:
            for key, value in self.tp.comm().items():
                counts[key] = value
                if key.startswith("tp_"):  # in the totals too
                    counts[key[len("tp_"):]] += value
        return counts

    def consistency_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return list(self.module.named_buffers())  # parameters are sharded: only buffers are replicated

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every rank calls it; rank 0 gets the whole FP32 state dict, the others an empty one."""
        return self.full_tensors().state_dict()

    def full_tensors(self) -> WholeTensors:
        """The FP32 model tensor by tensor (its sharded parameters are the FP32 masters in master modes): each
        gathered within its mesh, on rank 0 alone once whole."""
        return WholeTensors(self.module.state_dict(), parameter_ties(self.module), self.device)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(what rank 0 writes into shared.pt, the sharded tensors every rank writes its part of): ``dcp``."""
        return dcp_checkpoint_state(self.module, optimizer)

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        """From a sharded checkpoint of any mesh (DCP reshards), or a ddp one (each rank keeps its shard)."""
        dcp_load_checkpoint_state(self.module, optimizer, self.weights, saved, shards)
