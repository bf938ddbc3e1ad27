"""Data parallelism's plan part (ddp, fsdp, hsdp; FSDP2 under tp and pp too): DDP's buckets, FSDP's units and
their collectives, the model state a rank holds and the gathered parameters and gradients at the step's peak,
and the printed lines of the gradients' collectives.

Shapes and dtypes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Collection, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import MIB, BatchPlan, Config, MeshShape, master_mode, mib_text
from ..fp8 import gathered_in_float8
from ..moe import routing_of
from ..optim.plan import optimizer_state_bytes
from ..precision import Precision
from .blocks import find_blocks
from .tied_head import extra_collectives, tied_head
from .tp import local_shapes

FIRST_BUCKET_BYTES = 1 * MIB  # DDP's smaller first bucket when bucket_cap_mb is left to it
DEFAULT_BUCKET_MB = 25.0
# Which mesh dimension each kind of collective runs over (hsdp: shard groups, replicas).
COMM_DIMS = {"ddp": {"allreduces": "all ranks"},
             "fsdp": {"all_gathers": "shard", "reduce_scatters": "shard"},
             "hsdp": {"all_gathers": "shard", "reduce_scatters": "shard", "allreduces": "replicate"}}


def expected_buckets(params: List[torch.Tensor], bucket_cap_mb: float | None) -> List[tuple[torch.dtype, int]]:
    """(dtype, number of elements) of DDP's gradient buckets, as DDP fills them.

    Gradients become ready roughly in reverse order of the parameters; DDP
    fills buckets in that order, one dtype per bucket (so master modes' half
    weights and FP32 norm layers never share one), closing a bucket once its
    bytes in that dtype reach the cap (the first is capped at 1 MiB when the
    cap is DDP's default).
    """
    cap = (bucket_cap_mb or DEFAULT_BUCKET_MB) * MIB
    first_cap = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    closed: List[tuple[torch.dtype, int]] = []
    open_buckets: Dict[torch.dtype, int] = {}
    for p in reversed(params):
        filled = open_buckets.get(p.dtype, 0) + p.numel()
        if filled * p.element_size() >= (first_cap if not closed else cap):
            closed.append((p.dtype, filled))
            filled = 0
        open_buckets[p.dtype] = filled
    return closed + [(dtype, n) for dtype, n in open_buckets.items() if n > 0]


def shard_elements(p: torch.Tensor, shard: int, shape: Optional[torch.Size] = None) -> int:
    """Elements of one rank's (padded) shard: FSDP2 cuts dim 0 as torch.chunk does, rank 0's the largest.

    ``shape``: what this rank holds of ``p`` before FSDP cuts it (its tp cut; default the whole shape).
    """
    shape = p.shape if shape is None else shape
    rows = shape[0] if len(shape) else 1
    return math.ceil(rows / shard) * (math.prod(shape) // max(rows, 1))


def sharded_by_fsdp(cfg: Config) -> bool:
    """fsdp, hsdp, and ddp's replicas under tensor or pipeline parallelism (FSDP2 with shard groups of one)."""
    return cfg.dist.strategy == "fsdp" or cfg.dist.tp.size > 1 or cfg.dist.pp.size > 1


def splits_frozen(model: nn.Module, mesh: MeshShape, experts: bool = False) -> bool:
    """Whether a frozen base's layers are FSDP units of their own (``unit_modules``): under fsdp or hsdp without
    tp, pp or expert slices, on a model that trains part of itself and keeps the rest frozen (a LoRA base)."""
    if mesh.strategy != "fsdp" or mesh.tp > 1 or mesh.pp > 1 or experts:
        return False
    trains = [p.requires_grad for p in model.parameters()]
    return any(trains) and not all(trains)


def unit_modules(model: nn.Module, blocks: List[nn.Module], split_frozen: bool = False) -> List[nn.Module]:
    """The modules ``fully_shard`` makes units of, inner ones first: each block, then the root (the rest).

    ``split_frozen`` (``splits_frozen``): inside each block every frozen linear layer (a LoRA layer's base) is a
    unit before its block, and outside the blocks every frozen module with weights of its own that no other
    module shares (the final norm) is one before the root; the root keeps the embedding (and a head tied to it).
    A frozen layer gathers no gradient and reduces none, so a unit of it costs one all-gather where it runs,
    and the most a rank holds gathered at once is a layer, not a block (LoRA on a 216 MiB qwen2: a block's 25
    MiB, gathered ahead and copied out of its gather buffer, against a 6 MiB projection; docs/large_models.md).
    """
    if not split_frozen:
        return [*blocks, model]
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))

    def frozen(module: nn.Module, recurse: bool = True) -> bool:
        params = list(module.parameters(recurse=recurse))
        return bool(params) and not any(p.requires_grad or uses[id(p)] > 1 for p in params)

    units: List[nn.Module] = []
    inside: set = set()
    for block in blocks:
        for sub in block.modules():
            if isinstance(sub, nn.Linear) and id(sub) not in inside and frozen(sub):
                units.append(sub)
                inside.update(id(m) for m in sub.modules())
        units.append(block)
        inside.update(id(m) for m in block.modules())
    units += [m for m in model.modules() if id(m) not in inside and m is not model and not list(m.children())
              and not isinstance(m, (nn.Embedding, nn.Linear)) and frozen(m, recurse=False)]
    return [*units, model]


def frozen_root(model: nn.Module, root_params: List[torch.Tensor]) -> Optional[Tuple[nn.Module, nn.Module]]:
    """(embedding, head) where the root unit's one parameter is a frozen embedding tied to a head (a LoRA base's
    under ``unit_modules``' split), which the fsdp strategy gathers only where it is read (fsdp.FrozenRoot:
    an all-gather more per training forward); else None. Not with the chunked loss, which reads the head's
    weight without calling the head."""
    chunked = getattr(getattr(model, "loss_options", None), "chunked", False)
    if chunked or len(root_params) != 1 or root_params[0].requires_grad:
        return None
    users = [m for m in model.modules()
             if m is not model and any(p is root_params[0] for p in m.parameters(recurse=False))]
    embedding = [m for m in users if isinstance(m, nn.Embedding)]
    head = [m for m in users if isinstance(m, nn.Linear)]
    return (embedding[0], head[0]) if len(users) == 2 and len(embedding) == 1 and len(head) == 1 else None


def forward_only_units(cfg: Config, model: nn.Module, mesh: MeshShape) -> set:
    """Indices of the units (``unit_modules``) FSDP gathers for the forward alone: frozen layers whose output
    carries no gradient (they read only what no trained parameter made: under LoRA the first block's query, key
    and value bases), which no backward gathers again. Found by a forward on fake tensors (shapes only, as plan
    mode's activations are) on one short sequence, of ``model``: a meta model of its own (``plan.meta_model``),
    whose tensors this replaces. Under activation checkpointing a block's recomputation gathers each of its
    units in the backward anyway: only units outside the blocks can be forward-only then."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..activations import fake_cpu, sample_batch

    blocks = find_blocks(model, cfg.dist.blocks)
    modules = unit_modules(model, blocks, splits_frozen(model, mesh))[:-1]
    recomputed = {id(m) for block in blocks for m in block.modules()} if cfg.dist.activation_checkpointing else set()
    carries: Dict[int, bool] = {}

    def record(module: nn.Module, args: Any, output: Any) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        carries[id(module)] = any(isinstance(t, torch.Tensor) and t.requires_grad for t in outputs)

    for m in modules:
        if id(m) not in recomputed:
            m.register_forward_hook(record)
    with FakeTensorMode():
        fake_cpu(model)
        model.train()
        model(sample_batch(model, 1, min(8, cfg.data.get("block_size") or 8)))
    return {i for i, m in enumerate(modules) if carries.get(id(m)) is False}


def fsdp_units(model: nn.Module, blocks: List[nn.Module], skip: Optional[set] = None,
               split_frozen: bool = False) -> List[List[nn.Parameter]]:
    """The parameters of each FSDP unit (``unit_modules``): each block's, then the root's (the rest; tied ones
    once). ``skip``: ids of parameters FSDP is told to ignore (expert slices)."""
    seen: set = set(skip or ())
    units = []
    for module in unit_modules(model, blocks, split_frozen):
        params = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        units.append(params)
    return units


def unit_bytes(unit: List[torch.Tensor], shard: int, precision: Precision,
               cut: Optional[Dict[int, torch.Size]] = None, float8: Collection[int] = ()) -> Tuple[int, int]:
    """(gathered, gradient) bytes of one rank's padded shard of one FSDP unit (``cut``: the tp shapes;
    ``float8``: id() of the weights gathered in float8, a byte an element)."""
    cut = cut or {}
    return (sum(shard_elements(p, shard, cut.get(id(p))) * (1 if id(p) in float8 else
                                                            (precision.param_dtype or p.dtype).itemsize)
                for p in unit),
            sum(shard_elements(p, shard, cut.get(id(p))) for p in unit if p.requires_grad) * 4)


def add_unit_comm(counts: Dict[str, int], mesh: MeshShape, gathered: int, grad: int, gathers: int,
                  scatters: int) -> None:
    """One FSDP unit's collectives of a step into ``counts``: ``gathers`` all-gathers and ``scatters``
    reduce-scatters over its shard group (none in a group of one rank), one all-reduce across replicas."""
    if not gathered:
        return  # a root with every parameter in blocks: FSDP has nothing to gather for it
    S = mesh.shard
    if S > 1:
        counts["all_gathers"] += gathers
        counts["all_gather_bytes"] += gathers * S * gathered
        if grad:
            counts["reduce_scatters"] += scatters
            counts["reduce_scatter_bytes"] += scatters * S * grad
    if mesh.replicate > 1 and grad:
        counts["allreduces"] += 1
        counts["allreduce_bytes"] += grad


def unit_collectives(cfg: Config, plan: BatchPlan, model: nn.Module) -> Tuple[int, int]:
    """All-gathers and reduce-scatters of each FSDP unit in a step. Pipeline stages keep a unit gathered through
    backward: one gather a forward (the MoE counts' pass adds one), one reduce-scatter. Otherwise, for K
    micro-batches: gathers 2K (reshard=micro_batch, plus K for the MoE counts' pass), K (forward) or 1 (step);
    reduce-scatters 1 (accum_sync=last) or K (every)."""
    accum = plan.accum_steps
    prepass = routing_of(model).needs_prepass(accum, plan.data_ranks)
    if plan.mesh.pp > 1:
        return 1 + int(prepass), 1
    gathers = {"micro_batch": 2 * accum, "forward": accum, "step": 1}[cfg.dist.fsdp.reshard]
    if cfg.dist.fsdp.reshard == "micro_batch" and prepass:
        gathers += accum  # a forward more per micro-batch, each unit gathered anew
    return gathers, 1 if cfg.dist.fsdp.accum_sync == "last" else accum


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """The gradients' collectives of stage group ``group``'s step: ddp's one all-reduce per bucket (bytes as the
    hook sends them), or each FSDP unit's gathers and reduce-scatters over its shard group and all-reduce across
    replicas."""
    if not sharded_by_fsdp(cfg):
        sent = precision.weights_type.sent_element_size  # master modes send FP32 copies of half buckets
        buckets = expected_buckets(group["trained"], cfg.dist.bucket_cap_mb)
        counts["allreduces"] = len(buckets)
        counts["allreduce_bytes"] = sum(n * (sent or dtype.itemsize) for dtype, n in buckets)
        return
    cut, float8 = local_shapes(model, cfg.dist.tp), gathered_in_float8(model, cfg.precision)
    gathers, scatters = unit_collectives(cfg, plan, model)
    # a unit gathered for the forward alone (frozen, its output carries no gradient): no backward gathers it
    backward = plan.accum_steps if cfg.dist.fsdp.reshard == "micro_batch" else 0
    forward_only, root = group.get("forward_only", ()), len(group["units"]) - 1
    for i, unit in enumerate(group["units"]):
        # and a frozen root of the embedding alone gathered again for the head (fsdp.FrozenRoot)
        again = backward if i == root and group.get("frozen_root") else 0
        add_unit_comm(counts, plan.mesh, *unit_bytes(unit, plan.mesh.shard, precision, cut, float8),
                      gathers - backward * (i in forward_only) + again, scatters)
    head = tied_head(model, find_blocks(model, cfg.dist.blocks), plan.mesh, "cpu" if runs_on_cpu(cfg) else "cuda",
                     cfg.trainer.compile)
    if head is not None:  # its part of the tied weight's gradient reduced on its own (parallel/tied_head.py)
        extra = extra_collectives(cfg.dist.fsdp.accum_sync, plan.mesh, plan.accum_steps,
                                  shard_elements(head.weight, plan.mesh.shard))
        for key, value in extra.items():
            counts[key] += value


def runs_on_cpu(cfg: Config) -> bool:
    """Whether the run this config describes trains on CPU (trainer.device, or auto on a machine without CUDA)."""
    return cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available())


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    """The gradients' collectives' mesh dimensions: under tp and pp, ddp's replicas are FSDP2's shard groups of
    one rank."""
    mesh = plan.mesh
    dims.update(COMM_DIMS["hsdp" if mesh.kind == "ddp" and (mesh.tp > 1 or mesh.pp > 1) else mesh.kind])


def expected_peak_extra_bytes(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
                              group: Dict[str, Any], expert_units: List[Tuple[int, int]]) -> int:
    """Gathered parameters and unsharded gradients held at once at the step's peak, on one rank, without
    pipeline stages (``group``: the whole model; ``expert_units``: its experts' units over edp, where FSDP cuts
    them, as ``moe.ep_plan.expert_unit_bytes`` gives them).

    ddp: none (nothing is gathered; the whole gradient is part of state_mb).
    fsdp/hsdp, with G a unit's gathered size in the compute dtype and R its
    unsharded FP32 gradient: gathered at once, ``micro_batch`` holds the root
    and 1 + prefetch blocks (a unit being used and those gathered ahead), ``forward`` and
    ``step`` every unit. Gradients: with ``accum_sync=last`` and K > 1 every
    unit's R is kept between micro-batches while the next forward gathers;
    otherwise one unit's gradient is reduced as it is made, and takes the place
    of its freed parameters, except under ``step``, where nothing is freed
    before the last backward (the largest unit's R on top, K > 1).
    """
    mesh = plan.mesh
    if not sharded_by_fsdp(cfg):
        return 0
    S = mesh.shard
    cut, float8 = local_shapes(model, cfg.dist.tp), gathered_in_float8(model, cfg.precision)
    units = [unit_bytes(unit, S, precision, cut, float8) for unit in group["units"]]
    # A shard group of one rank computes with its shards as they are, unless they must be cast.
    gathered = [0 if S == 1 and precision.param_dtype is None else S * g for g, _ in units]
    grads = [S * r for _, r in units]
    blocks, root = gathered[:-1], gathered[-1]
    # Experts sharded over edp: a unit inside each MoE block, counted as a block of its own.
    experts = [(mesh.expert_data_ranks * g, mesh.expert_data_ranks * r) for g, r in expert_units]
    blocks, gathered = blocks + [g for g, _ in experts], gathered + [g for g, _ in experts]
    grads += [r for _, r in experts]
    reshard, accum = cfg.dist.fsdp.reshard, plan.accum_steps
    if reshard == "micro_batch":
        held = root + sum(sorted(blocks, reverse=True)[:1 + cfg.dist.fsdp.prefetch])
    else:
        held = sum(gathered)
    if cfg.dist.fsdp.accum_sync == "last" and accum > 1:
        return held + sum(grads)
    if reshard == "step" and accum > 1:
        return held + max(grads)
    return held


def expected_state_bytes(cfg: Config, params: List[torch.Tensor], shard: int,
                         cut: Optional[Dict[int, torch.Size]] = None, muon: Collection[int] = ()) -> int:
    """Model state one rank holds after an optimizer step (what ``state_mb`` measures), on the largest rank.

    ddp: every rank holds the parameters and their gradients in the parameters' dtype,
    the FP32 masters and their FP32 gradients in master modes, and the optimizer's
    FP32 state. fsdp/hsdp: each tensor is cut in ``shard`` chunks (the shard group) along its first
    dimension (rank 0's is the largest); rank 0 holds its chunk of the FP32 parameter
    (which is the master in master modes), of its FP32 gradient and of the optimizer state.
    ``cut``: id(parameter) -> what a rank holds of it under tp (tp_local_shapes), before FSDP's cut.
    """
    cut = cut or {}
    is_muon = [id(p) in muon for p in params]
    if sharded_by_fsdp(cfg):
        sizes = [shard_elements(p, shard, cut.get(id(p))) for p in params]
        return 8 * sum(sizes) + optimizer_state_bytes(cfg, sizes, is_muon, [p.shape for p in params])
    sizes = [p.numel() for p in params]
    own = 2 * sum(p.numel() * p.element_size() for p in params)  # parameters and their gradients
    masters = 2 * 4 * sum(sizes) if master_mode(cfg.precision) else 0
    return own + masters + optimizer_state_bytes(cfg, sizes, is_muon, [p.shape for p in params])


def frozen_bytes(cfg: Config, holds: List[nn.Parameter], shard: int, cut: Dict[int, torch.Size]) -> int:
    """What a rank holds of the parameters that do not train (a LoRA base) among ``holds`` (its stage group's),
    which state_mb leaves out: their FP32 shards under fsdp, else whole in their dtype."""
    frozen = [p for p in {id(p): p for p in holds}.values() if not p.requires_grad]
    if sharded_by_fsdp(cfg):
        return 4 * sum(shard_elements(p, shard, cut.get(id(p))) for p in frozen)
    return sum(math.prod(cut.get(id(p), p.shape)) * p.element_size() for p in frozen)


def dp_comm_lines(numbers: Dict[str, Any], step: Dict[str, int], kind: str, accum_steps: Optional[int]) -> List[str]:
    if kind == "ddp":
        return [f"  gradient all-reduces per optimizer step: {step['allreduces']} (DDP buckets, expected), "
                f"{mib_text(step['allreduce_bytes'])}; without no_sync it would be {step['allreduces'] * accum_steps}"]
    lines = [f"  all-gathers per optimizer step: {step['all_gathers']} (over each shard group, "
             f"dist.fsdp.reshard={numbers['dist.fsdp.reshard']}), {mib_text(step['all_gather_bytes'])}",
             f"  gradient reduce-scatters per optimizer step: {step['reduce_scatters']} (over each shard group, "
             f"dist.fsdp.accum_sync={numbers['dist.fsdp.accum_sync']}), {mib_text(step['reduce_scatter_bytes'])}"]
    if kind == "hsdp":
        tied = "; and a weight tied between the first and last stage groups, where they are apart" \
            if numbers["mesh"].get("pp", 1) > 1 else ""
        lines.append(f"  gradient all-reduces per optimizer step: {step['allreduces']} (across the "
                     f"{numbers['mesh']['replicate']} replicas, once per step{tied}), {mib_text(step['allreduce_bytes'])}")
    else:
        lines.append("  no gradient all-reduce")
    return lines

