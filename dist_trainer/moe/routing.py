"""The routing statistics of a model's MoE layers over one optimizer step, and the balancing terms they give.

Every term is written as a sum over the step's tokens, so that the trainer's one division by the step's
items (its valid tokens) makes it the big batch's, however the step is split::

    aux (global)   coef * E * (c . S) / sum(c)       c: the step's expert counts, over every micro-batch and rank
    aux (sequence) the same per sequence, c and S that sequence's: each sequence's term weighted by its tokens
    aux (micro_batch) the same per micro-batch and rank: transformers' term, which moves with the split
    z              coef * sum_t logsumexp(logits_t)^2

where ``S_e`` sums the router's probabilities of expert ``e`` over the tokens in question (for a sigmoid
router, the scores normalised over experts, as DeepSeek-V3 does). Divided by the step's tokens ``T`` (with
``sum(c) = k T``) the global term is Switch's ``coef * E * sum_e f_e P_e``, ``f_e = c_e / (k T)``,
``P_e = S_e / T``: the one of a single batch of every token of the step.

Its counts ``c`` must be known before the first micro-batch's backward: the step's forward passes are run
once without gradients first (``count_window``: a forward more per micro-batch; only where the step has
more than one micro-batch or data rank), the counts summed over ranks. The terms reach the gradients
through ``AttachLoss`` at each MoE layer's output (so a pipeline stage would need no loss of its own), with
the factor the trainer gives the language-model loss. Positions whose target is ignored (padding, prompts),
and placeholder micro-batches, count nowhere.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from ..config import Config, ConfigError, require
from ..recompute import recomputing

SCOPES = ("global", "sequence", "micro_batch")
NO_CONTEXT = nullcontext()  # a dense model's micro-batch context: reused, nothing to enter


def unit_factor() -> float:
    return 1.0


@dataclass(frozen=True)
class BalanceConfig:
    """``model.moe.aux_loss.*``, ``model.moe.z_loss.coef``, ``model.moe.bias_update.rate``."""
    aux_coef: float = 0.0
    aux_scope: str = "global"
    z_coef: float = 0.0
    bias_rate: float = 0.0

    @classmethod
    def from_dict(cls, moe: Optional[Mapping[str, Any]]) -> "BalanceConfig":
        moe = dict(moe or {})
        aux = dict(moe.get("aux_loss") or {})
        cfg = cls(float(aux.get("coef", 0.0) or 0.0), str(aux.get("scope", "global")),
                  float(dict(moe.get("z_loss") or {}).get("coef", 0.0) or 0.0),
                  float(dict(moe.get("bias_update") or {}).get("rate", 0.0) or 0.0))
        if cfg.aux_scope not in SCOPES:
            raise ConfigError(f"model.moe.aux_loss.scope={cfg.aux_scope!r}: must be one of {', '.join(SCOPES)}")
        for key, value in (("aux_loss.coef", cfg.aux_coef), ("z_loss.coef", cfg.z_coef),
                           ("bias_update.rate", cfg.bias_rate)):
            if not value >= 0.0:
                raise ConfigError(f"model.moe.{key}={value}: must be >= 0")
        return cfg


def check_moe(cfg: Config) -> None:
    """``model.moe``: the balancing keys (any MoE model), the built-in GPT's layer shape."""
    moe = cfg.model.get("moe")
    if not isinstance(moe, dict):
        return
    BalanceConfig.from_dict(moe)  # the one reader of the balancing keys
    capacity = moe.get("capacity_factor")
    number = isinstance(capacity, (int, float)) and not isinstance(capacity, bool)
    require(capacity is None or (number and capacity > 0), "model.moe.capacity_factor", capacity,
            "must be null (no token dropped) or a number > 0")
    experts = moe.get("num_experts") or 0
    if not experts:
        return
    top_k = moe.get("top_k", 2)
    require(isinstance(experts, int) and experts >= 1, "model.moe.num_experts", experts, "must be an integer >= 0")
    require(isinstance(top_k, int) and 1 <= top_k <= experts, "model.moe.top_k", top_k,
            f"must be between 1 and model.moe.num_experts ({experts})")
    require(moe.get("router", "softmax") in ("softmax", "sigmoid"), "model.moe.router", moe.get("router"),
            "choose softmax or sigmoid")


class AttachLoss(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward, gives ``loss`` the gradient the trainer gives a loss sum.

    The factor is read from ``routing`` when backward runs (``Routing.micro_batch`` says where from)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, routing: "Routing") -> torch.Tensor:
        ctx.routing, ctx.dtype = routing, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.full((), ctx.routing.loss_factor(), dtype=ctx.dtype, device=grad.device), None


class Routing:
    """One per model, shared by its MoE layers (each registers and gets its index).

    Per step: ``begin_step`` (and ``count_window``); each micro-batch runs in its ``micro_batch`` context, and
    the model sets its ``token_mask``; at the step's all-reduce ``local_stats`` goes in and ``take_totals`` reads
    the sums; after an applied update ``after_update`` moves the selection biases."""

    def __init__(self, cfg: BalanceConfig) -> None:
        self.cfg = cfg
        self.layers: List[Any] = []  # the MoE layers, in construction order
        self.token_mask: Optional[torch.Tensor] = None  # bool, the micro-batch's positions that count
        self.counting = True  # False for a placeholder micro-batch
        # What the step multiplies a micro-batch's loss sum by before its backward (its balancing terms' factor)
        self.loss_factor: Callable[[], float] = unit_factor
        self.window_counts: Optional[torch.Tensor] = None  # float64 [L, E]: the step's counts, all ranks
        self.prepass = False
        self.totals: dict = {}  # the last step's, summed over ranks (take_totals)
        self._counts: Optional[torch.Tensor] = None
        self._dropped: List[int] = []  # valid choices a capacity dropped in the step, by layer
        self._terms: Optional[torch.Tensor] = None  # this rank's aux and z sums in the step

    def register(self, layer: Any) -> int:
        self.layers.append(layer)
        return len(self.layers) - 1

    @property
    def num_experts(self) -> int:
        return max(layer.num_experts for layer in self.layers)

    # -- per step --------------------------------------------------------------------------------------------

    def needs_prepass(self, micro_batches: int, data_ranks: int) -> bool:
        """Whether the global term needs the step's counts before its first backward."""
        return self.cfg.aux_coef > 0 and self.cfg.aux_scope == "global" and micro_batches * data_ranks > 1

    @contextmanager
    def micro_batch(self, counted: bool, loss_factor: Callable[[], float] = unit_factor) -> Iterator[None]:
        """The context of one micro-batch's forward and backward: whether its tokens count (a placeholder's route,
        but count nowhere), and where its balancing terms' backward reads the factor the step gives its loss sum
        (read when the backward runs: the run's first factor is known only after its first forward)."""
        self.counting, self.loss_factor = counted, loss_factor
        try:
            yield
        finally:
            self.counting, self.loss_factor = True, unit_factor

    def begin_step(self, device: torch.device) -> None:
        self._counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=device)
        self._terms = torch.zeros(2, dtype=torch.float64, device=device)
        self._dropped = [0] * len(self.layers)
        self.window_counts, self.counting = None, True

    def count_window(self, forward: Callable[[], Any], all_reduce: Callable[[torch.Tensor], None],
                     device: torch.device) -> None:
        """The step's expert counts, every micro-batch and rank, from ``forward``: the window's forward passes
        (each micro-batch in its ``micro_batch`` context), run here without gradients.

        The generators are put back afterwards, so the step's own forward passes draw the same dropout."""
        counts = torch.zeros(len(self.layers), self.num_experts, dtype=torch.float64, device=device)
        self.prepass, saved = True, self._counts
        self._counts = counts
        cuda = [device] if device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=cuda):
                forward()
        finally:
            self.prepass, self._counts = False, saved
        all_reduce(counts)
        self.window_counts = counts

    def slots(self) -> int:
        """How many float64 slots ``local_stats`` adds to the step's all-reduce."""
        return len(self.layers) * (self.num_experts + 1) + 2

    def local_stats(self, share: float) -> torch.Tensor:
        """This rank's slots of the step's all-reduce: counts by layer and expert, then the aux and z sums."""
        dropped = torch.tensor(self._dropped, dtype=torch.float64, device=self._terms.device)
        return torch.cat([self._counts.flatten(), self._terms, dropped]) * share

    def take_totals(self, values: Sequence[float], items: float) -> dict:
        """The step's figures from the summed slots (equal however the step was split)."""
        L, E = len(self.layers), self.num_experts
        counts = torch.tensor(values[:L * E], dtype=torch.float64).view(L, E)
        self._counts = counts.to(self._counts.device)  # the global counts: what the bias update reads
        aux, z = values[L * E:L * E + 2]
        dropped = values[L * E + 2:L * E + 2 + L]
        mean = counts.mean(dim=1).clamp(min=1e-12)
        self.totals = {
            "aux_loss": aux / items if items > 0 else 0.0, "z_loss": z / items if items > 0 else 0.0,
            "expert_tokens": [[int(round(c)) for c in row] for row in counts.tolist()],
            "expert_load_max": float((counts.max(dim=1).values / mean).max()),  # the busiest expert / the mean
            "dead_experts": int((counts == 0).sum()),
            "dropped_tokens": int(round(sum(dropped))),  # choices a capacity dropped, all layers (0: none)
        }
        return self.totals

    def after_update(self) -> None:
        """Aux-loss-free balancing: each layer's selection bias moves towards the experts given less than the
        mean, by ``rate`` (DeepSeek-V3), from the step's global counts; once per applied update."""
        if self.cfg.bias_rate <= 0:
            return
        with torch.no_grad():
            for index, layer in enumerate(self.layers):
                counts = self._counts[index, :layer.num_experts]
                bias = layer.selection_bias()
                bias += (self.cfg.bias_rate * torch.sign(counts.mean() - counts)).to(bias)

    # -- per MoE layer forward ---------------------------------------------------------------------------------

    def drop(self, index: int, dropped: int) -> None:
        """A layer's valid choices dropped by its capacity in one micro-batch (once: not in recomputation)."""
        if self._counts is not None and not self.prepass and not recomputing():
            self._dropped[index] += dropped

    def mask(self, tokens: int, device: torch.device) -> torch.Tensor:
        if not self.counting:
            return torch.zeros(tokens, dtype=torch.bool, device=device)
        if self.token_mask is None or self.token_mask.numel() != tokens:
            return torch.ones(tokens, dtype=torch.bool, device=device)
        return self.token_mask.reshape(-1).to(device)

    def observe(self, index: int, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor,
                mask: torch.Tensor, sequences: int) -> Optional[torch.Tensor]:
        """Counts this layer's choices (once per micro-batch); its balancing terms' sum over the micro-batch's
        tokens, or None. ``logits`` and ``probs`` [N, E] float32, ``experts`` [N, k], ``mask`` [N]."""
        E = logits.shape[-1]
        # Counted once per micro-batch of a step (not in recomputation, not outside a step: evaluation).
        record = self._counts is not None and not recomputing()
        with torch.no_grad():
            chosen = experts[mask].reshape(-1)
            counts = torch.bincount(chosen, minlength=E).to(torch.float64)
            if record:
                self._counts[index, :E] += counts
        if self.prepass:
            return None
        cfg, weight = self.cfg, mask.to(probs.dtype)
        terms = []
        if cfg.aux_coef > 0:
            if cfg.aux_scope == "sequence":
                # Per sequence: its own counts and probability sums, [B, E].
                seq_mask = weight.view(sequences, -1, 1)
                seq_probs = (probs.view(sequences, -1, E) * seq_mask).sum(dim=1)
                one_hot = F.one_hot(experts.view(sequences, -1, experts.shape[-1]), E).sum(dim=2)
                seq_counts = (one_hot * seq_mask.to(one_hot.dtype)).sum(dim=1).to(probs.dtype)
                total = seq_counts.sum(dim=1).clamp(min=1.0)
                aux = ((seq_counts * seq_probs).sum(dim=1) / total).sum()
            else:
                own = counts if cfg.aux_scope == "micro_batch" or self.window_counts is None else \
                    self.window_counts[index, :E]
                sums = (probs * weight[:, None]).sum(dim=0)
                aux = (own.to(probs.dtype) * sums).sum() / own.sum().clamp(min=1.0).to(probs.dtype)
            terms.append(cfg.aux_coef * E * aux)
            if record:
                self._terms[0] += terms[-1].detach().to(torch.float64)
        if cfg.z_coef > 0:
            z = (torch.logsumexp(logits, dim=-1).square() * weight).sum() * cfg.z_coef
            terms.append(z)
            if record:
                self._terms[1] += z.detach().to(torch.float64)
        return sum(terms) if terms else None


class NoRouting:
    """A model with no MoE layer: nothing to count, nothing to add."""
    layers: List[Any] = []
    totals: dict = {}
    counting = True

    def needs_prepass(self, micro_batches: int, data_ranks: int) -> bool:
        return False

    def micro_batch(self, counted: bool, loss_factor: Callable[[], float] = unit_factor) -> ContextManager:
        return NO_CONTEXT

    def begin_step(self, device: torch.device) -> None:
        pass

    def slots(self) -> int:
        """None: ``local_stats`` adds nothing to the step's all-reduce."""
        return 0

    def local_stats(self, share: float) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def take_totals(self, values: Sequence[float], items: float) -> dict:
        return {}

    def after_update(self) -> None:
        pass


def routing_of(module: torch.nn.Module) -> Any:
    """The model's ``Routing``, or a ``NoRouting``."""
    routing = getattr(module, "routing", None)
    return routing if isinstance(routing, Routing) else NoRouting()
