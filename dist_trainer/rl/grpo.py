"""``task=grpo``: the GRPO family (GRPO, RLOO, DAPO, Dr. GRPO) on completions the policy samples, exact over any split.

A step holds ``rl.prompts_per_step`` prompts and ``rl.group_size`` completions of each: its global batch is their
product, in sequences, cut over ranks and micro-batches as any other (a group may straddle both). Before the first
micro-batch (``begin_step``) the step's completions are sampled and rewarded (``rl/rollout.py``), and every rank
is given all of them; each rank computes every advantage itself, in float64, in one canonical order (by prompt,
then sample), so every rank holds the same bits whatever the split:

    grpo   A = r - the group's mean reward
    rloo   A = r - the mean of the group's other rewards
    mean   A = r - the step's mean reward
    then, by rl.advantage.scale: group: / (the group's standard deviation + 1e-4); batch: / (the step's + 1e-4);
    none: as is. A group of one completion has advantage 0.

A completion's tokens (through its first end of turn, by position: never by token value) are trained with the
clipped surrogate, ``-min(ratio A, clip(ratio, 1 - rl.clip.low, 1 + rl.clip.high) A)``, plus ``rl.kl.coef`` times
the KL estimator against the reference and minus ``rl.entropy_coef`` times the token's entropy. The log-probabilities
are of the logits over ``rl.rollout.temperature``, as the sampler drew them. With one optimizer step per rollout
(``rl.inner_steps=1``) the old log-probabilities are the current ones detached: the ratio is exactly 1.

The per-token terms become the step's loss by ``rl.loss.agg``; each is a sum over the micro-batch divided by a count
over the whole step (the trainer's ``{loss_sum, num_items}``), so no split changes it:

    token-mean (dapo)                 sum of every token's term / the step's completion tokens
    seq-mean-token-mean (grpo)        sum over sequences of (its terms' mean over its tokens) / the step's sequences
    seq-mean-token-sum                sum over sequences of its terms' sum / the step's sequences
    seq-mean-token-sum-norm (dr_grpo) sum over sequences of its terms' sum / rl.loss.max_tokens / the step's sequences
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import LOSS_AGG_ALIASES, Config
from ..data.builtin import IGNORE_INDEX
from ..data.exact import Exact
from .dpo import CountedObjective, evaluation
from .rollout import Sampled, Sampler, gather_objects, roll_out

# The figures summed over the step's completion tokens (slots of the step's all-reduce), then divided by them.
TOKEN_FIGURES = ("kl", "clip_frac", "entropy")
STD_EPS = 1e-4  # added to a standard deviation before dividing by it (a group whose rewards are all equal)
TokenReference = Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]


def advantages(rewards: torch.Tensor, estimator: str, scale: str) -> torch.Tensor:
    """``rewards`` float64 ``[prompts, group_size]`` in canonical order -> the advantages, the same shape."""
    groups, size = rewards.shape
    if size == 1:  # nothing to compare a completion with
        return torch.zeros_like(rewards)
    if estimator == "rloo":
        centred = rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (size - 1)
    elif estimator == "mean":
        centred = rewards - rewards.mean()
    else:
        centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        return centred / (rewards.std(dim=1, keepdim=True) + STD_EPS)
    if scale == "batch":
        return centred / (rewards.std() + STD_EPS)
    return centred


def kl_terms(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimates from the sampled token's log-probabilities."""
    d = ref - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.exp(d) - d - 1  # k3


class GRPO(CountedObjective):
    """The clipped policy-gradient loss of a micro-batch of completions (``HFModel.forward`` calls it)."""

    def __init__(self, cfg: Config, reference: Optional[TokenReference], sampler: Optional[Sampler] = None,
                 prompts: Any = None, reward: Optional[Callable[[dict, str], float]] = None):
        rl = cfg.rl
        self.agg = LOSS_AGG_ALIASES.get(rl.loss.agg, rl.loss.agg)
        self.max_tokens = float(rl.loss.max_tokens or rl.rollout.max_new_tokens)
        self.low, self.high = float(rl.clip.low), float(rl.clip.high)
        self.kl_coef, self.kl_estimator = float(rl.kl.coef), rl.kl.estimator
        self.entropy_coef = float(rl.entropy_coef)
        self.temperature = float(rl.rollout.temperature)
        self.estimator, self.scale = rl.advantage.estimator, rl.advantage.scale
        self.group_size = int(rl.group_size)
        self.reference = reference if self.kl_coef else None  # no KL term: no reference pass
        self.reference_passes = int(self.reference is not None and getattr(reference, "is_policy", False))
        self.sampler, self.prompts, self.reward = sampler, prompts, reward
        # rl.inner_steps: optimizer steps on each step's rollouts. The rollouts, and (past the first) each
        # completion's log-probabilities at the step that sampled it, are kept until the next are sampled, and
        # saved in checkpoints (``state_dict``): a resume between two inner steps goes on with them.
        self.inner_steps = int(rl.inner_steps)
        self.rollout: Dict[str, Any] = {}  # {"step", "sampled", "old"}: the rollouts the current steps train on
        self._old_here: Dict[tuple, List[float]] = {}  # this rank's completions' log-probabilities at sampling
        self._recording = False
        self.counting = True
        self.step_figures: Dict[str, float] = {}
        self._sums = torch.zeros(len(TOKEN_FIGURES) + 1, dtype=torch.float64)
        self._ratio = [-math.inf, -math.inf]  # this rank's largest ratio and -(its smallest)
        self.gathers = 0  # all_gather_object calls (the step's prompts, its completions and rewards)
        self.reductions = 0  # the ratio's max and min, one all-reduce a step
        self.sampled: Sampled = {}
        self._began = 0.0

    # -- the micro-batch's loss ---------------------------------------------------------------------------------
    def __call__(self, model: nn.Module, batch: Mapping[str, Any]) -> Any:
        if "decode" in batch:  # the sampler's step, through the strategy's module (its gathers under fsdp)
            return model.decode_step(batch["decode"], batch["cache"])
        ref = None
        if self.reference is not None:
            with torch.no_grad(), evaluation(model):  # the reference first: the policy's activations are the ones kept
                ref = self.reference(model, batch)
        logp, entropy = model.token_logps(batch, self.temperature, entropy=True, entropy_grad=self.entropy_coef > 0)
        mask = (batch["labels"][:, 1:] != IGNORE_INDEX).to(logp.dtype)
        adv = batch["advantages"].to(logp.device).to(logp.dtype).unsqueeze(1)
        old = batch.get("old_logps")  # past a rollout's first step: its log-probabilities when it was sampled
        ratio = torch.exp(logp - (logp.detach() if old is None else old.to(logp.device)))
        if self._recording and self.counting:  # the rollout's first step: these are the old ones of the next
            self._record_old(batch, logp.detach(), mask)
        clipped = ratio.clamp(1 - self.low, 1 + self.high)
        terms = -torch.minimum(ratio * adv, clipped * adv)
        kl = kl_terms(logp, ref, self.kl_estimator) if ref is not None else None
        if kl is not None:
            terms = terms + self.kl_coef * kl
        if self.entropy_coef:
            terms = terms - self.entropy_coef * entropy
        terms = terms * mask
        lengths = mask.sum(dim=1)
        rows = logp.shape[0]
        if self.agg == "token-mean":
            loss_sum, items = terms.sum(), mask.sum()
        elif self.agg == "seq-mean-token-mean":
            loss_sum, items = (terms.sum(dim=1) / lengths.clamp(min=1)).sum(), torch.tensor(float(rows))
        elif self.agg == "seq-mean-token-sum":
            loss_sum, items = terms.sum(), torch.tensor(float(rows))
        else:  # seq-mean-token-sum-norm
            loss_sum, items = terms.sum() / self.max_tokens, torch.tensor(float(rows))
        if self.counting:
            self._count(ratio.detach(), adv, mask, kl, entropy)
        return {"loss_sum": loss_sum, "num_items": items.to(loss_sum.device)}

    @torch.no_grad()
    def _count(self, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, kl: Optional[torch.Tensor],
               entropy: torch.Tensor) -> None:
        on = mask > 0
        clipped = ((ratio < 1 - self.low) & (adv < 0)) | ((ratio > 1 + self.high) & (adv > 0))
        sums = [kl.detach().double()[on].sum() if kl is not None else torch.zeros((), dtype=torch.float64),
                clipped[on].double().sum(), entropy.detach().double()[on].sum(), mask.double().sum()]
        self._sums += torch.stack(sums).cpu()
        if on.any():
            self._ratio = [max(self._ratio[0], float(ratio[on].max())), max(self._ratio[1], -float(ratio[on].min()))]

    # -- the step -----------------------------------------------------------------------------------------------
    def begin_step(self, device: torch.device, batches: Sequence[Mapping[str, torch.Tensor]],
                   counted: Sequence[bool], all_reduce: Callable[[torch.Tensor], None], step: int = 0) -> List[Any]:
        """The step's completions sampled and rewarded, the advantages computed, and this rank's micro-batches made
        into rows: the prompt and its completion, the completion's tokens labelled, each row's advantage."""
        self._sums = torch.zeros(len(TOKEN_FIGURES) + 1, dtype=torch.float64)
        self._ratio = [-math.inf, -math.inf]
        inner = (step - 1) % self.inner_steps  # the loader hands the same prompts to each of a rollout's steps
        self._recording = inner == 0 and self.inner_steps > 1
        world = dist.get_world_size() if dist.is_initialized() else 1
        gen_s = score_s = 0.0
        if inner == 0:
            mine = sorted({int(p) for batch, count in zip(batches, counted) if count
                           for p in batch["prompt_index"].tolist()})
            step_prompts = sorted(set().union(*map(set, gather_objects(mine))))  # canonical: by prompt index
            rank = dist.get_rank() if dist.is_initialized() else 0
            sampled, gen_s, score_s = roll_out(self.sampler, self.prompts, step_prompts, step, rank, world,
                                               self.reward, device)
            self.gathers += 2 if world > 1 else 0
            self.rollout, self._old_here = {"step": step, "sampled": sampled, "old": {}}, {}
        elif self.rollout.get("step") != step - inner:
            raise RuntimeError(f"step {step} trains the rollouts of step {step - inner}, which are not held "
                               f"(rl.inner_steps={self.inner_steps}); a checkpoint written by this run holds them")
        sampled = self.rollout["sampled"]
        step_prompts = sorted(sampled)
        self.sampled = sampled  # the step's rollouts: prompt -> (its completions' tokens, their rewards)
        rewards = torch.tensor([sampled[p][1] for p in step_prompts], dtype=torch.float64)
        adv = advantages(rewards, self.estimator, self.scale)
        by_slot = {(p, s): (sampled[p][0][s], float(adv[i, s])) for i, p in enumerate(step_prompts)
                   for s in range(self.group_size)}
        lengths = [len(c) for p in step_prompts for c in sampled[p][0]]
        stops = set(self.prompts.stop_ids)
        truncated = [not any(t in stops for t in c) for p in step_prompts for c in sampled[p][0]]
        flat = rewards.reshape(-1)
        self.step_figures = {
            "reward_mean": float(flat.mean()), "reward_std": float(flat.std(unbiased=False)),
            "frac_zero_std_groups": float((rewards.max(dim=1).values == rewards.min(dim=1).values).double().mean()),
            "advantage_mean": float(adv.mean()), "completion_len_mean": sum(lengths) / len(lengths),
            "truncated_frac": sum(truncated) / len(truncated), "gen_s": gen_s, "score_s": score_s}
        self._began = time.perf_counter()
        old = self.rollout["old"] if inner else None
        return [self.rows(batch, by_slot, device, old) for batch in batches]

    def rows(self, batch: Mapping[str, torch.Tensor], by_slot: Dict[tuple, tuple], device: torch.device,
             old: Optional[Dict[tuple, List[float]]] = None) -> Dict[str, torch.Tensor]:
        """A micro-batch of slots as rows: ``input_ids``, ``attention_mask`` and ``labels`` ``[B, L]`` (right
        padding, masked by position), ``advantages`` ``[B]``, ``slots`` ``[B, 2]`` (prompt, sample); with ``old``
        (past a rollout's first step) ``old_logps`` ``[B, L - 1]``, each completion token's log-probability when
        it was sampled. A placeholder's slot (not one of the step's) gets an end of turn as its completion and
        advantage 0: it runs, and counts nowhere."""
        prompts, pad = self.prompts, self.prompts.pad_id
        rows, slots = [], list(zip(batch["prompt_index"].tolist(), batch["sample"].tolist()))
        for p, s in slots:
            completion, advantage = by_slot.get((p, s), ([prompts.stop_ids[0]], 0.0))
            prompt = prompts.ids[p].tolist()
            rows.append((prompt + completion, len(prompt), advantage))
        length = max(len(ids) for ids, _, _ in rows)
        input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(rows), length), dtype=torch.long)
        before = torch.zeros((len(rows), length - 1), dtype=torch.float32)
        for i, (ids, start, _) in enumerate(rows):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, start:len(ids)] = torch.tensor(ids[start:])
            attention[i, :len(ids)] = 1
            if old is not None and slots[i] in old:  # position t - 1 predicts token t
                before[i, start - 1:len(ids) - 1] = torch.tensor(old[slots[i]], dtype=torch.float32)
        # the advantages (float64) and old log-probabilities (FP32) kept so through an fsdp root's input cast
        out = {"input_ids": input_ids.to(device), "attention_mask": attention.to(device), "labels": labels.to(device),
               "advantages": Exact(torch.tensor([a for _, _, a in rows], dtype=torch.float64, device=device)),
               "slots": torch.tensor(slots, dtype=torch.long).reshape(-1, 2)}
        if old is not None:
            out["old_logps"] = Exact(before.to(device))
        return out

    def _record_old(self, batch: Mapping[str, torch.Tensor], logp: torch.Tensor, mask: torch.Tensor) -> None:
        """Each completion's log-probabilities at the step that sampled it (the later inner steps' old ones)."""
        for (p, s), row, on in zip(batch["slots"].tolist(), logp.float().cpu(), mask.cpu() > 0):
            self._old_here[(p, s)] = row[on].tolist()

    def slots(self) -> int:
        return len(TOKEN_FIGURES) + 1

    def local_stats(self, share: float) -> torch.Tensor:
        return self._sums * share

    def take_totals(self, values: Sequence[float], items: float) -> Dict[str, Any]:
        """The token figures over the step's completion tokens; the ratio's extremes over every rank (one
        all-reduce); the step's rollout figures, which every rank computed alike."""
        tokens = values[len(TOKEN_FIGURES)]
        out = {name: (value / tokens if tokens > 0 else 0.0) for name, value in zip(TOKEN_FIGURES, values)}
        extremes = torch.tensor(self._ratio, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
            self.reductions += 1
        out["ratio_max"], out["ratio_min"] = float(extremes[0]), -float(extremes[1])
        if self._recording:  # every rank holds every completion's old log-probabilities (a resume reads them)
            for part in gather_objects(self._old_here):
                self.rollout["old"].update(part)
            self.gathers += 1 if dist.is_initialized() and dist.get_world_size() > 1 else 0
            self._recording = False
        out["train_s"] = time.perf_counter() - self._began
        return {**self.step_figures, **out}

    def state_dict(self) -> Dict[str, Any]:
        """The rollouts the next steps train on (rl.inner_steps > 1); nothing otherwise (a step samples its own)."""
        if self.inner_steps == 1 or not self.rollout:
            return {}
        return {"step": self.rollout["step"],
                "sampled": [[p, c, r] for p, (c, r) in sorted(self.rollout["sampled"].items())],
                "old": [[p, s, v] for (p, s), v in sorted(self.rollout["old"].items())]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not state:
            return
        self.rollout = {"step": state["step"], "sampled": {p: (c, r) for p, c, r in state["sampled"]},
                        "old": {(p, s): v for p, s, v in state["old"]}}

    def comm(self) -> Dict[str, int]:
        comm = getattr(self.reference, "comm", None)
        counts = dict(comm()) if comm is not None else {}
        counts["rl_object_gathers"] = self.gathers
        counts["rl_allreduces"] = self.reductions
        return counts


def adapter_tokens(temperature: float) -> TokenReference:
    """The policy with its LoRA adapters disabled, per token."""

    def reference(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with model.model.disable_adapter():
            return model.token_logps(batch, temperature)[0]

    reference.is_policy = True  # type: ignore[attr-defined]
    return reference


def copy_tokens(temperature: float) -> Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]:
    """What a reference copy's forward returns under task=grpo: its per-token log-probabilities."""
    return lambda model, batch: model.token_logps(batch, temperature)[0]


def build_grpo(cfg: Config, module: nn.Module, copy_of: Optional[Callable[[], Any]], prompts: Any,
               autocast: Callable[[], Any], lockstep: bool) -> GRPO:
    """task=grpo's objective on ``module``, with its reference (only where rl.kl.coef is set), sampler and reward."""
    from .checks import reference_kind
    from .dpo import CopyReference
    from .rewards import build_reward

    rl = cfg.rl
    temperature = float(rl.rollout.temperature)
    reference: Optional[TokenReference] = None
    if rl.kl.coef:
        kind = reference_kind(cfg)
        if kind == "adapter":
            reference = adapter_tokens(temperature)
        elif kind == "copy":
            reference = CopyReference(module, copy_of, copy_tokens(temperature))
        else:  # none: a reference of log-probability 0 per token
            reference = lambda model, batch: torch.zeros(  # noqa: E731
                batch["labels"][:, 1:].shape, dtype=torch.float32, device=batch["labels"].device)
    sampler = reward = None
    if prompts is not None:
        sampler = Sampler(module, cfg.trainer.seed, rl.group_size, rl.rollout.max_new_tokens, temperature,
                          prompts.stop_ids, lockstep, autocast)
        reward = build_reward(rl.reward, prompts.prompt_key)
    module.objective = GRPO(cfg, reference, sampler, prompts, reward)
    module.items_are_tokens = False  # the step's items depend on rl.loss.agg: no tokens_per_s
    return module.objective
