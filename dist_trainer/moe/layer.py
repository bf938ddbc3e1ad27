"""The mixture-of-experts layer: a router, the routed experts, optional shared experts.

One implementation serves the built-in GPT and the Hugging Face MoE models (``moe.hf`` swaps theirs for it,
keeping their parameter names): the same routing, the same balancing terms (``routing.py``), the same
expert parallelism (``dispatch``). Parameter layout as transformers' (v5) experts: ``gate_up_proj``
``[E, 2 I, H]`` (the gate's rows, then the up projection's) and ``down_proj`` ``[E, H, I]``, so that a
Hugging Face checkpoint loads and exports by name.

The forward, for ``N`` tokens of width ``H``::

    logits = x W_r^T                  [N, E], float32
    scores = softmax or sigmoid       the selection adds the aux-loss-free bias (never the weights)
    top-k experts and their weights   normalised to sum 1 where configured, times a scaling factor
    tokens sorted by expert -> each expert's rows through its SwiGLU -> weighted, added back per token
"""

from __future__ import annotations

import math
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.state import local_tensor
from .routing import AttachLoss, Routing

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Router(nn.Module):
    """Scores each token against every expert and picks its ``top_k``.

    ``score``: ``softmax`` (Mixtral, Qwen-MoE, OLMoE) or ``sigmoid`` (DeepSeek-V3). ``n_group`` /
    ``topk_group``: DeepSeek-V3's group-limited choice (experts of the best groups only). With
    ``selection_bias`` the router holds ``e_score_correction_bias`` (DeepSeek-V3's name): added to the scores
    for the choice only, moved by the aux-loss-free update (``Routing.after_update``), saved with the model.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str = "softmax", norm_topk: bool = True,
                 scaling: float = 1.0, n_group: int = 1, topk_group: int = 1, selection_bias: bool = False) -> None:
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"model.moe.router must be softmax or sigmoid, got {score!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.moe.top_k ({top_k}) must be between 1 and model.moe.num_experts ({num_experts})")
        self.num_experts, self.top_k, self.score = num_experts, top_k, score
        self.norm_topk, self.scaling = norm_topk, scaling
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.normal_(self.weight, std=0.02)
        if selection_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple:
        """(logits [N, E] float32, probabilities the balancing terms read [N, E], weights [N, k], experts [N, k])."""
        logits = F.linear(x, self.weight.to(x.dtype)).float()
        scores = logits.softmax(dim=-1) if self.score == "softmax" else logits.sigmoid()
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.float()
        if self.n_group > 1:
            choice = self._best_groups(choice)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        probs = scores if self.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return logits, probs, weights * self.scaling, experts

    def _best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Scores outside the ``topk_group`` best groups (each by its two best scores) set to -inf."""
        N, E = choice.shape
        groups = choice.view(N, self.n_group, E // self.n_group)
        group_scores = groups.topk(min(2, E // self.n_group), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        # -inf, not 0: with the selection bias a kept expert's score may be below 0 (DeepSeek-V3 masks so too).
        return groups.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(N, E)


class Experts(nn.Module):
    """``num_experts`` SwiGLU feed-forward experts as two 3-D parameters (transformers' layout).

    ``forward(x, counts)``: rows of ``x`` sorted by expert, ``counts[e]`` rows each; each expert's rows
    through its own weights. Under expert parallelism this module holds a rank's experts only."""

    def __init__(self, num_experts: int, dim: int, hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.act_name, self.act_fn = act, ACTIVATIONS[act]
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        # Under expert parallelism the weights are DTensors of the ep group: this rank's slice computes.
        return self.rows(x, counts, local_tensor(self.gate_up_proj), local_tensor(self.down_proj))

    def rows(self, x: torch.Tensor, counts: List[int], gate_up_proj: torch.Tensor,
             down_proj: torch.Tensor) -> torch.Tensor:
        """``x``'s rows through experts ``0 .. len(counts) - 1`` of the given weights (expert parallelism passes
        a rank's own slice of them)."""
        # One matrix product per expert over its contiguous rows; unbind's backward stacks the experts'
        # gradients once (indexing would add a whole-size zero gradient per expert).
        gate_up, down = gate_up_proj.unbind(0), down_proj.unbind(0)
        outputs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                rows = x[start:start + n]
                gate, up = F.linear(rows, gate_up[e].to(x.dtype)).chunk(2, dim=-1)
                outputs.append(F.linear(self.act_fn(gate) * up, down[e].to(x.dtype)))
            start += n
        return torch.cat(outputs) if outputs else x[:0]


class SharedExperts(nn.Module):
    """The experts every token goes through: one SwiGLU MLP (DeepSeek's shared experts, merged)."""

    def __init__(self, dim: int, hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LocalDispatch:
    """Every expert on this rank: the sorted rows go straight through them."""
    all_to_alls = 0  # the collectives a forward issues (expert parallelism's dispatch counts its own)

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(x, counts.tolist())


class MoE(nn.Module):
    """Router, routed experts, shared experts (optional); ``forward`` [B, T, H] -> [B, T, H].

    ``shared_gate``: Qwen2-MoE's sigmoid gate on the shared experts' output (a ``Linear(H, 1)``).
    ``shared_name``: the shared experts' attribute, which names their parameters (Qwen2-MoE: ``shared_expert``)."""

    def __init__(self, routing: Routing, dim: int, hidden: int, num_experts: int, top_k: int,
                 shared: Optional[nn.Module] = None, shared_gate: bool = False, act: str = "silu",
                 shared_name: str = "shared_experts", capacity_factor: Optional[float] = None,
                 **router: Any) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        # None: no token dropped. Else each expert takes at most ceil(factor x valid tokens x top_k / E) of a
        # micro-batch's choices on this rank (``within_capacity``).
        self.capacity_factor = capacity_factor
        self.gate = Router(dim, num_experts, top_k, **router)
        self.experts = Experts(num_experts, dim, hidden, act)
        self.shared_name = shared_name
        setattr(self, shared_name, shared)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.routing = routing
        self.index = routing.register(self)
        # How sorted rows reach their experts: here, or by all-to-all under dist.ep.size (moe.ep).
        self.dispatch: Callable = LocalDispatch()

    def selection_bias(self) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        if bias is None:
            raise RuntimeError("model.moe.bias_update.rate > 0 needs a router with a selection bias")
        return bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits, probs, weights, experts = self.gate(x)
        mask = self.routing.mask(x.shape[0], x.device)
        terms = self.routing.observe(self.index, logits, probs, experts, mask, shape[0] if hidden.ndim == 3 else 1)
        # Sort the (token, choice) pairs by expert, stably: each expert's rows in token order.
        flat = experts.reshape(-1)
        if self.capacity_factor is None:
            pair = flat.argsort(stable=True)
        else:  # the pairs within capacity only; a dropped choice adds nothing to its token's output
            kept = self.within_capacity(flat, mask).nonzero().squeeze(-1)
            pair = kept[flat[kept].argsort(stable=True)]
            flat = flat[kept]
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = pair // self.top_k
        out_sorted = self.dispatch(self.experts, x[token], counts)
        out_sorted = out_sorted * weights.reshape(-1)[pair].unsqueeze(-1).to(out_sorted.dtype)
        out = torch.zeros_like(x).index_add_(0, token, out_sorted.to(x.dtype))
        shared_experts = getattr(self, self.shared_name)
        if shared_experts is not None:
            shared = shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if terms is not None and torch.is_grad_enabled():
            out = AttachLoss.apply(out, terms, self.routing)
        return out.view(shape)

    @torch.no_grad()
    def within_capacity(self, flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Which (token, choice) pairs an expert takes: the first ``capacity`` of its valid ones in token order,
        then padding's while room is left (so padding never displaces a token that counts). Counts the valid
        choices dropped (``Routing.drop``). Per micro-batch and rank: the drops depend on the split."""
        k, E = self.top_k, self.num_experts
        valid = mask.repeat_interleave(k)
        capacity = math.ceil(self.capacity_factor * int(mask.sum()) * k / E)
        order = (flat * 2 + (~valid).long()).argsort(stable=True)  # by expert, valid first, then token order
        ranked = flat[order]
        first = torch.bincount(flat, minlength=E).cumsum(0) - torch.bincount(flat, minlength=E)
        position = torch.arange(flat.numel(), device=flat.device) - first[ranked]
        keep = torch.empty_like(valid).scatter_(0, order, position < capacity)
        self.routing.drop(self.index, int((valid & ~keep).sum()))
        return keep

    def active_params(self) -> int:
        """Parameters one token goes through: the router, ``top_k`` routed experts, the shared ones."""
        # From shapes: a parameter may be a shard (fsdp) or hold this rank's experts only (expert parallelism).
        per_expert = sum(math.prod(p.shape[1:]) for p in (self.experts.gate_up_proj, self.experts.down_proj))
        rest = sum(math.prod(p.shape) for name, p in self.named_parameters() if not name.startswith("experts."))
        return rest + self.top_k * per_expert


def inactive_params(model: nn.Module) -> int:
    """Parameters of routed experts a token does not go through, over the model's MoE layers (0: dense)."""
    return sum(sum(math.prod(p.shape) for p in layer.parameters()) - layer.active_params()
               for layer in model.modules() if isinstance(layer, MoE))
