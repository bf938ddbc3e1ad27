"""``task=dpo``: Direct Preference Optimization, exact over any split of the step's pairs.

A sample is a pair; a micro-batch of B pairs is one batch of 2B rows, the chosen answers first, then the rejected
ones (``data=hf_preference``). Each row's log-probability of its answer (``HFModel.answer_logps``: the labelled
tokens' log-probabilities summed in FP32) is taken under the policy and under the reference; a pair's loss depends on
its two rows alone, so the micro-batch returns ``{"loss_sum": the pairs' losses summed, "num_items": B}`` and the
trainer's division by the step's pairs gives the mean over the step's pairs, whatever the split. With
z = (policy - reference log-probability of the chosen answer) - (the same of the rejected one), beta = rl.dpo.beta
and eps = rl.dpo.label_smoothing, a pair's loss is (TRL's definitions):

    sigmoid  -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)
    robust   (-(1 - eps) log sigmoid(beta z) + eps log sigmoid(-beta z)) / (1 - 2 eps)
    hinge    max(0, 1 - beta z)
    ipo      (z - 1 / (2 beta))^2, z from each answer's per-token mean log-probabilities

The reference (``rl.reference``) runs before the policy in the same micro-batch layout, without gradients and
without dropout: ``adapter`` is the policy with its LoRA adapters disabled (no second copy: at the first step the
adapters add exactly zero, so the implicit rewards are exactly 0), ``copy`` a frozen copy of the model as built
(the same at every resume, as the model is built the same), ``none`` log-probabilities of 0, ``precomputed`` the
values the model as built gave each pair alone before the first step, which the batch carries (``rl/precompute.py``:
no reference forward at all).

The step's figures, TRL's names, are sums over the counted pairs carried in the step's one all-reduce and divided
by the step's pairs: never a mean of micro-batch means.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, DPOConfig
from ..data.builtin import IGNORE_INDEX
from .checks import reference_kind

# The step's figures, summed over pairs in this order (metrics.jsonl's keys).
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
Reference = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


class NoObjective:
    """task=lm: the model's own loss; the step's all-reduce carries nothing more."""

    reference_passes = 0  # forward passes of the policy's own modules a micro-batch adds (plan mode counts them)

    def begin_step(self, device: torch.device, batches: Sequence[Mapping[str, torch.Tensor]],
                   counted: Sequence[bool], all_reduce: Callable[[torch.Tensor], None], step: int = 0) -> Sequence[Any]:
        """Before the step's first micro-batch (``step``: optimizer steps done): the micro-batches to run, made
        from the loader's (task=grpo samples its rows here); as they are for the others."""
        return batches

    def micro_batch(self, counted: bool) -> ContextManager:
        return nullcontext()

    def slots(self) -> int:
        return 0

    def local_stats(self, share: float) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def take_totals(self, values: Sequence[float], items: float) -> Dict[str, Any]:
        return {}

    def comm(self) -> Dict[str, int]:
        """Collectives the objective issued itself (a sharded reference copy's gathers), by metrics key."""
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint must hold for the next step (task=grpo's rollouts under rl.inner_steps > 1)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


class CountedObjective(NoObjective):
    """An objective whose step figures count only the micro-batches that count (a placeholder's do not)."""

    counting = True

    @contextmanager
    def micro_batch(self, counted: bool) -> Iterator[None]:
        """Whether this micro-batch counts in the step's figures."""
        self.counting = counted
        try:
            yield
        finally:
            self.counting = True


class DPO(CountedObjective):
    """The loss of a micro-batch of pairs (``HFModel.forward`` calls it with itself and the batch)."""

    def __init__(self, cfg: DPOConfig, reference: Reference):
        self.beta, self.kind, self.smoothing = float(cfg.beta), cfg.loss, float(cfg.label_smoothing)
        self.sft_weight = float(cfg.sft_weight)
        self.figures = FIGURES + (("nll_loss",) if self.sft_weight else ())
        self.pairs_per_token = 0.0  # the step's pairs over its chosen tokens, all ranks (with sft_weight)
        self.reference = reference
        self.reference_passes = int(reference is adapter_reference)  # the policy's modules, adapters disabled
        self.counting = True
        self._sums = torch.zeros(len(self.figures), dtype=torch.float64)

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        with torch.no_grad(), evaluation(model):  # the reference first: the policy's activations are the ones kept
            ref, _ = self.reference(model, batch)
        logps, tokens = model.answer_logps(batch)
        pairs = logps.shape[0] // 2
        # RPO's NLL on the chosen answers over the step's chosen tokens: the trainer divides every micro-batch's sum
        # by the step's pairs, so a token's term is weighted by pairs / tokens of the whole step (begin_step)
        nll = -logps[:pairs].sum() * self.pairs_per_token
        if self.kind == "ipo":  # IPO compares each answer's per-token mean log-probability
            logps, ref = logps / tokens.clamp(min=1), ref / tokens.clamp(min=1)
        chosen = logps[:pairs] - ref[:pairs]
        rejected = logps[pairs:] - ref[pairs:]
        losses = self._losses(chosen - rejected)
        if self.counting:
            c, r = self.beta * chosen.detach().double(), self.beta * rejected.detach().double()
            sums = [c.sum(), r.sum(), (c > r).double().sum(), (c - r).sum(), logps[:pairs].detach().double().sum(),
                    logps[pairs:].detach().double().sum()] + ([nll.detach().double()] if self.sft_weight else [])
            self._sums += torch.stack(sums)
        loss_sum = losses.sum() + self.sft_weight * nll if self.sft_weight else losses.sum()
        return {"loss_sum": loss_sum, "num_items": torch.tensor(pairs, device=losses.device)}

    def _losses(self, z: torch.Tensor) -> torch.Tensor:
        beta, eps = self.beta, self.smoothing
        if self.kind == "sigmoid":
            return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)
        if self.kind == "robust":
            return (-(1 - eps) * F.logsigmoid(beta * z) + eps * F.logsigmoid(-beta * z)) / (1 - 2 * eps)
        if self.kind == "hinge":
            return torch.relu(1 - beta * z)
        return (z - 1 / (2 * beta)) ** 2  # ipo

    def begin_step(self, device: torch.device, batches: Sequence[Mapping[str, torch.Tensor]],
                   counted: Sequence[bool], all_reduce: Callable[[torch.Tensor], None], step: int = 0) -> Sequence[Any]:
        """The figures from zero; with sft_weight the step's pairs and chosen tokens, every counted micro-batch of
        every rank, in one all-reduce (float64: exact counts). The micro-batches run as they are."""
        self._sums = torch.zeros(len(self.figures), dtype=torch.float64, device=device)
        if not self.sft_weight:
            return batches
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch, count in zip(batches, counted):
            if count:
                pairs = batch["labels"].shape[0] // 2
                totals[0] += pairs
                totals[1] += (batch["labels"][:pairs, 1:] != IGNORE_INDEX).sum()
        all_reduce(totals)
        self.pairs_per_token = (totals[0] / totals[1].clamp(min=1)).item()
        return batches

    def slots(self) -> int:
        return len(self.figures)

    def comm(self) -> Dict[str, int]:
        comm = getattr(self.reference, "comm", None)
        return comm() if comm is not None else {}

    def local_stats(self, share: float) -> torch.Tensor:
        return self._sums * share

    def take_totals(self, values: Sequence[float], items: float) -> Dict[str, Any]:
        return {name: (value / items if items > 0 else 0.0) for name, value in zip(self.figures, values)}


@contextmanager
def evaluation(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) for the reference's pass, then as it was."""
    training = model.training
    model.train(False)
    try:
        yield
    finally:
        model.train(training)


def adapter_reference(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple:
    """The policy with its LoRA adapters (and trainable token rows) disabled: the base model, no second copy."""
    with model.model.disable_adapter():
        return model.answer_logps(batch)


def no_reference(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple:
    rows = batch["input_ids"].shape[0]
    zeros = torch.zeros(rows, dtype=torch.float32, device=batch["input_ids"].device)
    return zeros, zeros


def precomputed_reference(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple:
    """rl.reference=precomputed: the batch's ``ref_logps`` (FP32 values, kept in float64), in its rows' order."""
    labels = batch["labels"]
    return batch["ref_logps"].to(labels.device).float(), (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


class CopyReference:
    """A frozen copy of the model as built, held outside the policy's module tree (no state_dict key, never
    trained): under ddp a deep copy of the policy before its first step; where the strategy cuts the model, the
    model built once more and sharded alike (``copy``: parallel.fsdp.FrozenShards), its gathers counted here."""

    def __init__(self, module: nn.Module, copy_of: Optional[Callable[[], Any]] = None,
                 measure: Optional[Callable[[nn.Module, Mapping[str, torch.Tensor]], Any]] = None):
        self.shards = copy_of() if copy_of is not None else None
        self.copy = self.shards.module if self.shards is not None else copy.deepcopy(module).requires_grad_(False)
        # its forward gives what the objective compares: each row's answer log-probability (DPO's), or each token's
        self.copy.objective = measure or answer_logps
        self.copy.eval()

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple:
        return self.copy(batch)

    def comm(self) -> Dict[str, int]:
        return self.shards.comm() if self.shards is not None else {}


def answer_logps(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple:
    return model.answer_logps(batch)


def build_objective(cfg: Config, module: nn.Module, copy_of: Optional[Callable[[], Any]] = None,
                    prompts: Any = None, autocast: Callable[[], ContextManager] = nullcontext,
                    lockstep: bool = False) -> NoObjective:
    """The task's objective for the strategy's module (``HFModel``), attached as its ``objective``; task=lm: none.
    Called once the strategy holds the model as built, before a checkpoint is loaded (a copy is of the model as
    built, at every resume alike). ``copy_of``: where the strategy cuts the model, builds a frozen copy sharded
    alike (rl.reference=copy); None: a deep copy of ``module``. task=grpo: ``prompts`` (data=hf_prompts; None in
    plan mode, which samples nothing), the precision's ``autocast`` the sampler runs under, and ``lockstep``: a
    forward is a collective (every rank samples alike many passes)."""
    if cfg.task == "grpo":
        from .grpo import build_grpo  # noqa: PLC0415 (the GRPO wing imports this module)

        return build_grpo(cfg, module, copy_of, prompts, autocast, lockstep)
    if cfg.task != "dpo":
        return NoObjective()
    kind = reference_kind(cfg)
    reference = {"adapter": lambda: adapter_reference, "none": lambda: no_reference,
                 "precomputed": lambda: precomputed_reference, "copy": lambda: CopyReference(module, copy_of)}[kind]()
    module.objective = DPO(cfg.rl.dpo, reference)
    module.items_are_tokens = False  # the step's items are its pairs: no tokens_per_s
    return module.objective


def objective_of(module: nn.Module) -> NoObjective:
    """The module's task objective (a DPO), or a NoObjective."""
    objective = getattr(module, "objective", None)
    return objective if isinstance(objective, NoObjective) else NoObjective()
