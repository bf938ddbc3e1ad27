"""Expert parallelism (``dist.ep.size``): each rank of an expert-parallel group holds 1/ep of every MoE layer's
routed experts, and the sorted rows reach them by all-to-all.

The layout (``config.MeshShape``): the data ranks are a mesh (edp, ep), ep innermost, so an expert-parallel
group is ``ep`` consecutive data ranks and rank ``i`` of it holds experts ``i * E/ep .. (i + 1) * E/ep - 1`` of
each layer. Those slices are DTensors ``Shard(0)`` on the group's mesh: a state dict names and shapes them as
without ep, ``full_tensor()`` makes them whole, DCP saves and reshards them, so a checkpoint moves between ep
degrees (and to one process) as it moves between fsdp meshes.

One MoE layer's forward (``AllToAllDispatch``), for the rows a rank routed, sorted by expert::

    counts [E]          -> all_to_all_single: how many rows each rank sends each of my experts
    rows                -> all_to_all (uneven): each row to the rank holding its expert
    received rows       -> sorted by my expert, through my experts' SwiGLU, back to the senders' order
    outputs             -> all_to_all (uneven): each row back to its token's rank

No row is dropped. Both row exchanges are differentiable (``all_to_all_single_autograd``): backward sends the
gradients the opposite way, two all-to-alls more. Calls and bytes are counted where issued (a backward's
through an identity whose backward runs just before it), under the metrics keys ``EP_COMM_KEYS``.

Gradients (``ExpertParallel.reduce_grads``, after a step's last backward). An expert's gradient on its rank
already sums the rows of its whole ep group's micro-batches; the edp group's ranks hold the same experts for
the other ep groups' rows, so the gradient is their SUM, divided by the data ranks (not by the edp ranks):
the mean over data ranks that DDP and FSDP give every other parameter, which the trainer's multiply by
``data_ranks`` undoes. Dividing by the edp ranks instead would leave it ep times too large (pytorch#160285,
Megatron-LM#5956).

Under ddp (and pipeline stages) the experts are neither DDP's nor FSDP's: DDP ignores them, FSDP2 is given
them as ``ignored_params``; each rank keeps its slice whole, and ``reduce_grads`` all-reduces it over the edp
ranks. The global gradient norm counts each expert once: on the ranks of the first ep group
(``MeshShape.counts_experts``).

Under fsdp (``sharded``, where there are several edp ranks) each MoE layer's experts are an FSDP2 unit of their
own over the edp ranks (torchtitan's layout): the ep slice is cut again over edp, so a rank holds
1/(ep x edp) = 1/data_ranks of every expert's state, and each forward gathers its slice over edp. FSDP
reduce-scatters the gradient over edp as its mean over them; ``reduce_grads`` divides it by ep once more, which
makes it the sum divided by the data ranks (FSDP's own divide factor is a PREMUL_SUM, which gloo lacks).
Every data rank then holds a different part of every expert: each counts in the norm (the first rank of a tp
group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config, ConfigError, MeshShape, divisors, master_mode, require
from .layer import MoE

EP_COMM_KEYS = ("all_to_alls", "all_to_all_bytes")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# All-to-alls of one MoE layer: a forward's (the counts, the rows out, the rows back), a backward's (the rows'
# gradients both ways). Plan mode predicts a step's from these.
FORWARD_ALL_TO_ALLS, BACKWARD_ALL_TO_ALLS = 3, 2


def moe_layers(model: nn.Module) -> List[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_params(model: nn.Module) -> List[nn.Parameter]:
    """The routed experts' parameters of every MoE layer: what expert parallelism cuts."""
    return [getattr(layer.experts, name) for layer in moe_layers(model) for name in EXPERT_PARAMS]


@dataclass
class AllToAllCounter:
    calls: int = 0
    bytes: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.calls += 1
        self.bytes += t.numel() * t.element_size()


class _CountBackward(torch.autograd.Function):
    """Identity; its backward counts the gradient that the all-to-all before it is about to send."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counter: AllToAllCounter) -> torch.Tensor:
        ctx.counter = counter
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        ctx.counter.add(grad)
        return grad, None


class AllToAllDispatch:
    """``MoE.dispatch`` under expert parallelism: rows to the ranks holding their experts and back."""

    all_to_alls = FORWARD_ALL_TO_ALLS  # a forward's (LocalDispatch: 0)

    def __init__(self, group: dist.ProcessGroup, ep: int, counter: AllToAllCounter) -> None:
        self.group, self.ep, self.counter = group, ep, counter

    def _exchange(self, x: torch.Tensor, output_splits: List[int], input_splits: List[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        self.counter.add(x)
        y = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, self.group)
        return _CountBackward.apply(y, self.counter)

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, counts.numel() // self.ep
        # Every rank sends every other the counts of its rows for that rank's experts: [source rank, my expert].
        received = torch.empty_like(counts)
        self.counter.add(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        sent_by_rank = counts.view(ep, local).sum(dim=1).tolist()
        by_source = received.view(ep, local)
        received_by_rank = by_source.sum(dim=1).tolist()
        rows = self._exchange(x, received_by_rank, sent_by_rank)  # by source rank, each by my expert
        # Into expert order (each expert's rows by source rank, so in the order one process would have them).
        chunk = torch.repeat_interleave(torch.arange(ep * local, device=x.device), by_source.reshape(-1))
        order = ((chunk % local) * ep + chunk // local).argsort(stable=True)
        out = experts(rows[order], by_source.sum(dim=0).tolist())  # its forward: FSDP gathers it (sharded)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return self._exchange(out[inverse], sent_by_rank, received_by_rank)


class NoExperts:
    """No expert parallelism: every parameter is DDP's or FSDP's, nothing more is issued."""

    params: List[nn.Parameter] = []
    ignored: Optional[set] = None
    groups: List[Any] = []
    norm_share = 1.0

    def shard(self, **fsdp: Any) -> List[nn.Module]:
        return []

    def weights(self, weights: Any) -> Any:
        return weights

    def reduce_grads(self) -> None:
        pass

    def comm(self) -> Dict[str, int]:
        return {}

    def norm_sq(self, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[list, torch.Tensor]:
        return grads, torch.zeros((), dtype=torch.float64)


class LocalGrads:
    """A precision mode's weights whose ``grads()`` give an expert's local slice (a view of its DTensor
    gradient), so the trainer's in-place multiply and norm act on plain tensors."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def grads(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(p, g.to_local() if hasattr(g, "to_local") else g) for p, g in self.inner.grads()]


def check_ep_size(cfg: Config, mesh: MeshShape) -> None:
    """``dist.ep.size`` against the model: the built-in GPT's MoE layers, their experts cut evenly."""
    if mesh.ep == 1:
        return
    moe = cfg.model.get("moe")
    if isinstance(moe, dict) and "num_experts" not in moe:
        return  # a Hugging Face MoE model brings its experts: moe.ep checks them once it is built
    experts = (moe.get("num_experts") or 0) if isinstance(moe, dict) else 0
    require(isinstance(experts, int) and experts > 0, "dist.ep.size", mesh.ep,
            "needs a model with MoE layers (model.moe.num_experts > 0, the built-in GPT's); this one has none: "
            "set dist.ep.size=1")
    require(experts % mesh.ep == 0, "dist.ep.size", mesh.ep,
            f"must divide model.moe.num_experts={experts} (each rank of an expert-parallel group holds "
            f"num_experts / dist.ep.size of them): one of {[d for d in divisors(experts) if mesh.data_ranks % d == 0]}")
    require(not (mesh.strategy == "ddp" and master_mode(cfg.precision)), "precision.name",
            cfg.precision.name, f"with dist.ep.size={mesh.ep} under dist.strategy=ddp is not supported yet (the "
            "experts' FP32 masters would be whole): use a *-mixed precision, or dist.strategy=fsdp")


def check_ep(model: nn.Module, mesh: MeshShape) -> None:
    """The whole model has MoE layers whose experts ``dist.ep.size`` divides; ConfigError naming it otherwise."""
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"dist.ep.size={mesh.ep}: the model has no MoE layer whose experts it could split; "
                          "set dist.ep.size=1")
    for layer in layers:
        if layer.num_experts % mesh.ep:
            raise ConfigError(f"dist.ep.size={mesh.ep} must divide the {layer.num_experts} experts of every "
                              "MoE layer")


class ExpertParallel:
    """The experts of ``model`` cut over each ep group (in place), their dispatch by all-to-all, and the
    reduction of their gradients over the edp group.

    Under pipeline stages ``model`` is a stage group's part (checked whole with ``check_ep`` before it was cut,
    ``check=False``): its own MoE layers, maybe none. The ep and edp groups are then made of the data ranks of
    one stage group (pp outermost): each stage's experts are cut over its own data ranks, and the all-to-alls of
    a stage are issued by its data ranks alone, which run one schedule in one order."""

    def __init__(self, model: nn.Module, mesh: MeshShape, rank: int, device_type: str, check: bool = True,
                 sharded: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        if check:
            check_ep(model, mesh)
        layers = moe_layers(model)
        # Under tp each tp rank runs the MoE layers whole (tp.py's replicate): the ep and edp groups are made of
        # the data ranks' tp ranks of one index (tp innermost, as config.MeshShape numbers the ranks), and the
        # tp ranks of a group issue the same all-to-alls, each within its own ep group.
        dims = (*((("pp", mesh.pp),) * (mesh.pp > 1)), ("edp", mesh.expert_data_ranks), ("ep", mesh.ep),
                *((("tp", mesh.tp),) * (mesh.tp > 1)))
        root = init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))
        self.ep_mesh, self.edp_mesh = root["ep"], root["edp"]
        self.edp_group = root["edp"].get_group() if mesh.expert_data_ranks > 1 else None
        self.sharded = sharded  # FSDP's over edp (``shard``; MeshShape.shards_experts): see the module
        self.counter = AllToAllCounter()
        self.reduced = {"allreduces": 0, "allreduce_bytes": 0}
        self.data_ranks, self.ep = mesh.data_ranks, mesh.ep
        self.norm_share = float(rank % mesh.tp == 0) if self.sharded else float(mesh.counts_experts(rank))
        dispatch = AllToAllDispatch(self.ep_mesh.get_group(), mesh.ep, self.counter)
        for layer in layers:
            for name in EXPERT_PARAMS:
                p = getattr(layer.experts, name)
                # Each rank keeps its slice of the tensor every rank built alike (the same seed; on the meta
                # device the construction replays into the slice): nothing is sent.
                sliced = distribute_tensor(p.data, self.ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(layer.experts, name, nn.Parameter(sliced, requires_grad=p.requires_grad))
            layer.dispatch = dispatch
        self.params = expert_params(model)
        self.layers = layers
        self.ignored = None if self.sharded else set(self.params)
        self.groups = [g for g in (self.ep_mesh.get_group(), self.edp_group) if g is not None]

    def shard(self, **fsdp: Any) -> List[nn.Module]:
        """Under ``sharded``: each MoE layer's experts an FSDP2 unit over the edp ranks (``fsdp``: fully_shard's
        other arguments), before the blocks around them; returns the units (none otherwise)."""
        from torch.distributed.fsdp import fully_shard

        if not self.sharded:
            return []
        units = []
        for layer in self.layers:
            unit = fully_shard(layer.experts, mesh=self.edp_mesh, **fsdp)
            # A rank whose experts no row reached in a step still takes part, with zeros, in the reduce-scatter.
            unit.set_reduce_scatter_unused_params(True)
            units.append(unit)
        self.params = expert_params(nn.ModuleList(self.layers))  # FSDP's parameters now (each cut over edp)
        return units

    def weights(self, weights: Any) -> Any:
        return LocalGrads(weights)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """After the step's last backward: SUM over the edp group, divided by the data ranks (see the module);
        under ``sharded`` FSDP has reduced them to their mean over edp: divided by ep once more."""
        if self.sharded:
            grads = [p.grad.to_local() for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(self.ep))
            return
        for p in self.params:
            if p.grad is None:  # no row reached this rank's experts in the whole step: a zero gradient, as
                p.grad = torch.zeros_like(p)  # one process's unbind gives an expert without rows
        grads = [p.grad.to_local() for p in self.params]
        if not grads:  # a pipeline stage without MoE layers
            return
        if self.edp_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.reduced["allreduces"] += 1
            self.reduced["allreduce_bytes"] += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=self.edp_group)
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]),
                                                                       grads)])
        torch._foreach_div_(grads, float(self.data_ranks))

    def comm(self) -> Dict[str, int]:
        """The all-to-alls, and the edp all-reduces (added to the strategy's ``allreduces``)."""
        return {"all_to_alls": self.counter.calls, "all_to_all_bytes": self.counter.bytes,
                **({} if self.sharded else self.reduced)}

    def norm_sq(self, grads: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[list, torch.Tensor]:
        """(the pairs that are not experts', this rank's float64 share of the experts' squared norm)."""
        experts = set(self.params)
        mine = [g for p, g in grads if p in experts]
        rest = [(p, g) for p, g in grads if p not in experts]
        if not mine:
            return rest, torch.zeros((), dtype=torch.float64)
        norms = torch.stack(torch._foreach_norm(mine)).double().square().sum()
        return rest, norms * self.norm_share


def apply_ep(model: nn.Module, mesh: MeshShape, rank: int, device_type: str, sharded: bool = False,
             check: bool = True) -> Any:
    """Expert parallelism on ``model`` (before activation checkpointing, compile and wrapping), or a
    ``NoExperts`` where ``mesh.ep`` is 1. ``sharded``: the experts FSDP's over the edp ranks
    (``MeshShape.shards_experts``, for fsdp). ``check=False``: ``check_ep`` passed on the whole model already."""
    return ExpertParallel(model, mesh, rank, device_type, check=check, sharded=sharded) if mesh.ep > 1 else NoExperts()
