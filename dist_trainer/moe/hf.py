"""Hugging Face MoE models through the project's MoE layer: the same routing, balancing terms and counts as the
built-in GPT's, with no model code changed.

``swap_moe_blocks(model, moe)`` replaces each transformers sparse-MoE block (Qwen3-MoE, Mixtral, OLMoE,
DeepSeek-V3, Qwen2-MoE) with a ``MoE`` that holds the block's own tensors under the block's own names
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``, DeepSeek-V3's
``mlp.gate.e_score_correction_bias`` and ``mlp.shared_experts.*``, Qwen2-MoE's ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate.weight``), so checkpoints, ``hf_model/`` and ``model.pretrained`` keep working by name.
Each family's router is mapped as its modeling file computes it:

    family       score    weights normalised          scale                     choice
    qwen3_moe    softmax  norm_topk_prob              1                         top-k
    qwen2_moe    softmax  norm_topk_prob              1                         top-k; a sigmoid-gated shared expert
    olmoe        softmax  norm_topk_prob              1                         top-k
    mixtral      softmax  always                      1                         top-k
    deepseek_v3  sigmoid  norm_topk_prob (+1e-20)     routed_scaling_factor     top-k of the topk_group best of
                                                                                n_group groups, with the bias

The swap runs inside the model's construction, which may be recorded on the meta device and replayed
(``models.construct``): it draws nothing from the random generator (the new modules' initialisers are
switched off, their placeholder tensors dropped) and moves tensors only by reference.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from torch import nn

from ..config import ConfigError
from .layer import ACTIVATIONS, MoE
from .routing import BalanceConfig, Routing


def _softmax_router(block: nn.Module, norm: Optional[bool] = None) -> Dict[str, Any]:
    gate = block.gate
    return {"score": "softmax", "norm_topk": bool(gate.norm_topk_prob if norm is None else norm)}


def _deepseek_router(block: nn.Module) -> Dict[str, Any]:
    gate = block.gate
    return {"score": "sigmoid", "norm_topk": bool(gate.norm_topk_prob), "scaling": float(gate.routed_scaling_factor),
            "n_group": int(gate.num_group or 1), "topk_group": int(gate.topk_group or 1), "selection_bias": True}


# Block class -> (the router's arguments, the shared experts' attribute or None, whether a gate scales them).
FAMILIES: Dict[str, Tuple[Callable[[nn.Module], Dict[str, Any]], Optional[str], bool]] = {
    "Qwen3MoeSparseMoeBlock": (_softmax_router, None, False),
    "OlmoeSparseMoeBlock": (_softmax_router, None, False),
    "MixtralSparseMoeBlock": (lambda block: _softmax_router(block, norm=True), None, False),
    "Qwen2MoeSparseMoeBlock": (_softmax_router, "shared_expert", True),
    "DeepseekV3MoE": (_deepseek_router, "shared_experts", False),
}


def moe_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The model's transformers sparse-MoE blocks, in layer order: (qualified name, block)."""
    return [(name, module) for name, module in model.named_modules() if type(module).__name__ in FAMILIES]


def swap_moe_blocks(model: nn.Module, moe: Optional[Mapping[str, Any]] = None) -> Optional[Routing]:
    """Every sparse-MoE block of ``model`` replaced by a ``MoE`` on the same tensors; the ``Routing`` they share
    (built from ``model.moe``: ``balance_config``), or None where the model has no such block."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    routing = Routing(balance_config(moe, config, len(blocks), blocks[0][1].gate.top_k))
    for name, block in blocks:
        if routing.cfg.bias_rate > 0 and not FAMILIES[type(block).__name__][0](block).get("selection_bias"):
            raise ConfigError(f"model.moe.bias_update.rate={routing.cfg.bias_rate}: {type(block).__name__} has no "
                              "selection bias to move (DeepSeek-V3's e_score_correction_bias); set it to 0")
        parent, _, attr = name.rpartition(".")
        layer = moe_layer(block, config, routing)
        layer.capacity_factor = dict(moe or {}).get("capacity_factor")  # model.moe.capacity_factor (null: none)
        setattr(model.get_submodule(parent), attr, layer)
    return routing


def moe_layer(block: nn.Module, config: Any, routing: Routing) -> MoE:
    """The project's layer on ``block``'s own parameters and buffers (the same tensors, not copies)."""
    from transformers.initialization import no_init_weights

    router_args, shared_name, shared_gate = FAMILIES[type(block).__name__]
    gate, experts = block.gate, block.experts
    act = str(getattr(config, "hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise ConfigError(f"model.config.hidden_act={act}: the MoE layer knows {', '.join(ACTIVATIONS)}")
    if float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise ConfigError("model.config.router_jitter_noise > 0: the MoE layer adds no jitter; set it to 0")
    router = router_args(block)
    if gate.top_k == 1 and router["norm_topk"]:  # transformers' weight is then 1; the layer keeps the probability
        raise ConfigError(f"model.config: {type(block).__name__} with one expert a token and normalised weights "
                          "is not supported by the MoE layer (set norm_topk_prob=false or 2 experts a token)")
    shared = getattr(block, shared_name) if shared_name else None
    # The layer's own tensors are placeholders, replaced below: no initialiser runs (nothing drawn), so a build
    # recorded on the meta device and one built whole leave the generator alike.
    with no_init_weights():
        layer = MoE(routing, experts.hidden_dim, experts.intermediate_dim, experts.num_experts, gate.top_k,
                    shared=shared, shared_gate=shared_gate, act=act, shared_name=shared_name or "shared_experts",
                    **router)
    layer.gate.weight = gate.weight
    if router.get("selection_bias"):
        layer.gate.e_score_correction_bias = gate.e_score_correction_bias
    layer.experts.gate_up_proj, layer.experts.down_proj = experts.gate_up_proj, experts.down_proj
    if shared_gate:
        layer.shared_expert_gate = block.shared_expert_gate
    return layer


def balance_config(moe: Optional[Mapping[str, Any]], config: Any, layers: int, top_k: int) -> BalanceConfig:
    """``model.moe``'s balancing terms; a null coefficient takes the Hugging Face configuration's.

    transformers adds ``router_aux_loss_coef * E * sum_e F_e P_e`` once, ``F`` and ``P`` averaged over every
    layer's tokens and ``F`` summing to ``top_k``; ``Routing``'s term is Switch's per layer (``f`` summing to 1),
    summed over the layers: ``layers / top_k`` times as large for the same routing. A null ``aux_loss.coef`` is
    therefore ``router_aux_loss_coef * top_k / layers`` (0 where the configuration has none), so that the
    balancing pull is the one the model's configuration asks for; a number is taken as it is, as for the GPT.
    """
    moe = dict(moe or {})
    aux, z = dict(moe.get("aux_loss") or {}), dict(moe.get("z_loss") or {})
    if aux.get("coef") is None:
        aux["coef"] = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) * top_k / layers
    if z.get("coef") is None:
        z["coef"] = float(getattr(config, "router_z_loss_coef", 0.0) or 0.0)
    return BalanceConfig.from_dict({**moe, "aux_loss": aux, "z_loss": z})
