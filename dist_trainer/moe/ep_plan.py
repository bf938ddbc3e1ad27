"""Expert parallelism's and the MoE layers' plan part: each MoE layer's all-to-alls (``moe.ep``: 3 a forward,
2 a backward) and their byte bounds, the experts' gradient reduction over the edp ranks (one all-reduce of whole
slices, or FSDP units of their own where fsdp cuts them again), the state of a rank's expert slices, the
routing's share of the step's all-reduce, the mesh dimensions and the printed line.

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from ..config import BatchPlan, Config, mib_text
from ..optim.plan import optimizer_state_bytes
from ..parallel.cp_plan import micro_batch_tokens
from ..parallel.dp_plan import add_unit_comm, shard_elements, unit_bytes, unit_collectives
from ..precision import Precision
from . import routing_of
from .ep import BACKWARD_ALL_TO_ALLS, FORWARD_ALL_TO_ALLS, expert_params, moe_layers


def ep_experts(plan: BatchPlan, model: nn.Module) -> List[torch.Tensor]:
    """The parameters expert parallelism cuts (none without it)."""
    return expert_params(model) if plan.mesh.ep > 1 else []


def expert_unit_bytes(plan: BatchPlan, layers: List[nn.Module], precision: Precision) -> List[Tuple[int, int]]:
    """(gathered, gradient) bytes of one rank's padded shard of each MoE layer's experts unit (FSDP over edp, of
    the 1/ep slice), where the experts are sharded; none otherwise."""
    if not plan.mesh.shards_experts:
        return []
    mesh = plan.mesh
    return [unit_bytes(params, mesh.expert_data_ranks, precision, {id(p): expert_slice(p, mesh.ep) for p in params})
            for params in ([layer.experts.gate_up_proj, layer.experts.down_proj] for layer in layers)]


def expert_allreduce_bytes(experts: List[torch.Tensor], ep: int) -> int:
    """Bytes of the one all-reduce of a rank's whole expert slices' gradients over its edp ranks."""
    return sum(p.numel() // ep * p.element_size() for p in experts)


def expert_slice(p: torch.Tensor, ep: int) -> torch.Size:
    return torch.Size([p.shape[0] // ep, *p.shape[1:]])


def ep_forwards(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """Forward passes of each MoE layer in a step: each micro-batch's, again in the counts' pass where the
    global aux term needs it (``Routing.needs_prepass``), again in activation checkpointing's recomputation."""
    accum = plan.accum_steps
    prepass = routing_of(model).needs_prepass(accum, plan.data_ranks)
    return accum * (1 + int(prepass) + int(cfg.dist.activation_checkpointing))


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """Stage group ``group``'s experts: where fsdp cuts them over edp, their units' gathers and reduce-scatters;
    its MoE layers' all-to-alls; and where the slices are whole, their one gradient all-reduce over edp."""
    mesh = plan.mesh
    if mesh.shards_experts:
        edp = replace(mesh, replicate=1, shard=mesh.expert_data_ranks)  # a 1-D mesh of the edp ranks
        gathers, scatters = unit_collectives(cfg, plan, model)
        for gathered, grad in expert_unit_bytes(plan, group["moe"], precision):
            add_unit_comm(counts, edp, gathered, grad, gathers, scatters)
    if mesh.ep == 1:
        return
    counts["all_to_alls"] = len(group["moe"]) * (ep_forwards(cfg, plan, model) * FORWARD_ALL_TO_ALLS
                                                 + plan.accum_steps * BACKWARD_ALL_TO_ALLS)
    if mesh.expert_data_ranks > 1 and not mesh.shards_experts and group["experts"]:
        counts["allreduces"] += 1
        counts["allreduce_bytes"] += expert_allreduce_bytes(group["experts"], mesh.ep)


def add_routing_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
                     counts: Dict[str, int]) -> None:
    counts.update(moe_step_allreduces(plan, model, counts))


def moe_step_allreduces(plan: BatchPlan, model: nn.Module, counts: Dict[str, int]) -> Dict[str, int]:
    """MoE layers' share of the step's own all-reduces (``moe.Routing``): their expert counts by layer, the
    aux and z sums and the dropped choices by layer ride the step's all-reduce (float64, ``Routing.slots``);
    the counts' pass, where the global aux term needs it, all-reduces its counts once more."""
    routing = routing_of(model)
    if not routing.layers:
        return {}
    counted = len(routing.layers) * routing.num_experts * 8  # the counts' pass all-reduces the counts alone
    prepass = routing.needs_prepass(plan.accum_steps, plan.data_ranks)
    return {"step_allreduces": counts["step_allreduces"] + int(prepass),
            "step_allreduce_bytes": counts["step_allreduce_bytes"] + routing.slots() * 8 + (counted if prepass else 0)}


def ep_all_to_all_bytes_max(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """The most ``all_to_all_bytes`` one rank's step can show. Per MoE layer and forward, for N tokens a
    micro-batch, top k, width H: the counts (E int64), the N k rows out, and back the rows its experts got,
    N k from each of the ep ranks at most; a backward the rows' gradients both ways. Activations FP32 at most."""
    tokens, ep = micro_batch_tokens(cfg, plan, model), plan.mesh.ep
    total = 0
    for layer in moe_layers(model):
        rows = tokens * layer.top_k * layer.experts.dim * 4
        total += ep_forwards(cfg, plan, model) * (layer.num_experts * 8 + (1 + ep) * rows)
        total += plan.accum_steps * (1 + ep) * rows
    return total


def ep_all_to_all_bytes_balanced(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """``all_to_all_bytes`` of one rank's step where every expert gets its share of the rows (the balance the
    balancing terms pull towards): per MoE layer and forward the counts, the N k rows out and N k back; a backward
    the same rows' gradients both ways. FP32 rows, as the bound counts them."""
    tokens = micro_batch_tokens(cfg, plan, model)
    total = 0
    for layer in moe_layers(model):
        rows = tokens * layer.top_k * layer.experts.dim * 4
        total += ep_forwards(cfg, plan, model) * (layer.num_experts * 8 + 2 * rows) + plan.accum_steps * 2 * rows
    return total


def expert_state_bytes(cfg: Config, experts: List[torch.Tensor], ep: int, edp: int = 1) -> int:
    """State of a rank's expert slices (FP32 parameter, gradient, optimizer state): 1/ep of each, and its padded
    shard of that over ``edp`` ranks where FSDP cuts it again."""
    sizes = [shard_elements(p, edp, expert_slice(p, ep)) for p in experts]  # 3-D: never Muon's
    return 8 * sum(sizes) + optimizer_state_bytes(cfg, sizes, [False] * len(sizes), [p.shape for p in experts])


def ep_numbers(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, Any]:
    """The bounds of the whole model's MoE layers' all-to-all bytes (a stage group's are of its own layers)."""
    if plan.mesh.ep == 1:
        return {}
    auto = cfg.batch.micro_batch_size == "auto"
    return {"ep_all_to_all_bytes_max": None if auto else ep_all_to_all_bytes_max(cfg, plan, model),
            "ep_all_to_all_bytes_balanced": None if auto else ep_all_to_all_bytes_balanced(cfg, plan, model)}


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    mesh = plan.mesh
    if mesh.ep == 1:
        return
    dims["all_to_alls"] = "ep"
    if mesh.shards_experts:
        for key in ("all_gathers", "reduce_scatters"):
            dims[key] = "; ".join(filter(None, [dims.get(key), "the experts': edp"]))
    elif mesh.expert_data_ranks > 1:
        dims["allreduces"] = "; ".join(filter(None, [dims.get("allreduces"), "the experts': edp"]))


def ep_comm_lines(numbers: Dict[str, Any]) -> List[str]:
    ep = numbers["mesh"].get("ep", 1)
    if ep == 1:
        return []
    edp = numbers["mesh"]["replicate"] * numbers["mesh"]["shard"] // ep
    if "the experts': edp" in numbers["comm_dims"].get("all_gathers", ""):
        held = (f"the experts: each ep slice cut again over the {edp} ranks holding the same experts, one FSDP unit "
                "a MoE layer (in the all-gathers and reduce-scatters above)")
    elif edp > 1:
        held = (f"the experts' gradients: one all-reduce over the {edp} ranks holding the same experts (in the "
                "all-reduces above)")
    else:
        held = "each rank's experts its own"
    return [f"  expert all-to-alls per optimizer step: {numbers['step']['all_to_alls']} (over each expert-parallel "
            f"group of {ep} data ranks: each MoE layer's forward 3, its backward 2), "
            f"{mib_text(numbers['ep_all_to_all_bytes_balanced'])} with every expert given its share, at most "
            f"{mib_text(numbers['ep_all_to_all_bytes_max'])} (all_to_all_bytes: the routing decides); {held}"]

