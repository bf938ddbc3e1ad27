"""The optimizer step: accumulation over micro-batches, exact normalisation, skipping.

One optimizer step, as pseudocode::

    zero grads
    for each micro-batch of the window:
        (in the strategy's micro-batch context: ddp's no_sync, or fsdp's gradient sync switch)
        autocast forward, then backward of loss_sum * scale / divisor  # scale and divisor fixed for the window
    one all-reduce: [loss_sum, items, samples, stop flag, squared gradient norm shares, non-finite flags,
                     each rank's data wait and compute time]
    if any gradient is non-finite anywhere: skip (every rank alike), back the scale off
    if the step holds no items at all: skip it, the scale untouched
    else: grads *= world * divisor / (scale * items), clipped, in one multiply
          set the lr of this update, optimizer step, count the update

Gradients are therefore those of (sum of every loss term in the step) / (number
of items in the step) over all micro-batches and ranks: one big batch's mean,
however the step is split.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # a subclass's inner tensors

from .config import BatchPlan, OptimConfig, TrainerConfig
from .data import Window
from .data.blend import NoSources
from .distributed import DistEnv
from .moe import routing_of
from .optim import lr_at, set_lr
from .parallel.state import local_tensor
from .precision import Precision
from .rl import objective_of

log = logging.getLogger("dist_trainer")

# The step all-reduce's slots before the per-rank ones: loss, items, samples, stop flag, norm share, busy count.
STEP_FIXED_SLOTS = 6


class NonFiniteError(RuntimeError):
    """Non-finite gradients with no loss scaler to absorb them."""


@dataclass
class StepOutcome:
    loss: float  # mean over the items (or samples) of the effective batch
    items: int  # items the step's loss averages over (tokens, or samples)
    samples: int  # samples in the step, all ranks
    lr: float  # the rate this step used (or would have used, if skipped)
    loss_scale: Optional[float]  # the scale this step used; None without dynamic scaling
    grad_norm: Optional[float]  # global norm of the unscaled gradients, before clipping
    skipped: bool
    item_form: bool  # the forward returned {"loss_sum", "num_items"}
    stop_requested: bool  # some rank was asked to stop (SIGTERM/SIGUSR1): all ranks stop after this step
    allreduces: int  # gradient all-reduce calls issued by DDP in this step
    allreduce_bytes: int
    skip_reason: Optional[str] = None  # "nonfinite" (an overflow in fp16) or "no_items"; None if applied
    # Every collective the strategy issued for gradients and parameters in this step, by kind:
    # allreduces (ddp; hsdp across replicas), reduce_scatters and all_gathers (fsdp, hsdp), and
    # their bytes; then the step's own small all-reduces (step_allreduces, step_allreduce_bytes).
    comm: Dict[str, int] = field(default_factory=dict)
    state_mb: Optional[float] = None  # model state of the largest rank after the update (see Trainer.state_mb)
    # state_mb plus the most gathered parameters and unsharded gradients held at once during a step
    step_peak_state_mb: Optional[float] = None
    # Every rank's wait for this step's micro-batches, and its compute until its last gradient
    # reduction was issued (health/stragglers.py), by rank.
    data_times: List[float] = field(default_factory=list)
    compute_times: List[float] = field(default_factory=list)
    # Pipeline stages: each rank's idle seconds within the schedule, and the schedule's wall seconds, by rank.
    pp_idle_times: List[float] = field(default_factory=list)
    pp_schedule_times: List[float] = field(default_factory=list)
    # ... and the most micro-batches whose activations each rank's stages held at once, by rank.
    pp_inflight: List[float] = field(default_factory=list)
    busy: bool = False  # some rank's background work (a checkpoint's write) still ran at this step's all-reduce
    # Mixture of experts: the step's expert counts, load, aux and z terms, summed over ranks (moe.Routing.totals).
    moe: Dict[str, Any] = field(default_factory=dict)
    # task=dpo: the step's rewards and log-probabilities, means over its pairs (rl.dpo.FIGURES); empty for task=lm
    rl: Dict[str, Any] = field(default_factory=dict)
    # data=blend: each source's token-weighted loss and tokens in the step (source_loss.NAME, source_tokens.NAME)
    sources: Dict[str, Any] = field(default_factory=dict)


def _leading_dim(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        return _leading_dim(value)
    raise ValueError("cannot count samples in an empty batch")


def loss_terms(output: Any, batch: Any, count: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, number of items) of one micro-batch, from either forward form.

    A scalar output is a mean over samples, so it is weighted by the sample
    count. ``count=False`` marks a placeholder micro-batch: it runs so that
    this rank joins the all-reduce, but contributes nothing.
    """
    if isinstance(output, Mapping):
        loss_sum = local_tensor(output["loss_sum"]).float()  # a loss-parallel loss is replicated: take it whole
        items = torch.as_tensor(output["num_items"], device=loss_sum.device).to(torch.float64)
    else:
        if not isinstance(output, torch.Tensor) or output.ndim != 0:
            raise TypeError("the model's forward must return a scalar mean loss or {'loss_sum', 'num_items'}")
        samples = _leading_dim(batch)
        loss_sum = output.float() * samples
        # A fill on the device, not a copy from the host (which would wait for the GPU's queue).
        items = torch.full((), float(samples), dtype=torch.float64, device=loss_sum.device)
    if not count:
        return loss_sum * 0.0, items * 0.0
    return loss_sum, items


class Trainer:
    """Holds what the step needs; built once, before the loop."""

    def __init__(self, strategy: Any, optimizer: torch.optim.Optimizer, precision: Precision, env: DistEnv,
                 plan: BatchPlan, optim_cfg: OptimConfig, trainer_cfg: TrainerConfig, partial_step: str = "mean",
                 scales: Any = None):
        self.strategy, self.optimizer, self.precision = strategy, optimizer, precision
        self.scales = scales  # the float8 all-gather's scales (fp8.ScaleSync), counted with the step's collectives
        self.model, self.module, self.weights = strategy.model, strategy.module, strategy.weights
        self.env, self.plan = env, plan
        self.optim_cfg, self.trainer_cfg, self.partial_step = optim_cfg, trainer_cfg, partial_step
        self.names = {p: name for name, p in self.module.named_parameters()}
        self.updates = 0  # applied optimizer updates: drives the lr schedule
        self.consecutive_skips = 0
        self.skipped_total = 0
        self.item_form = False
        # Divides each micro-batch's summed loss so that its gradient has the size
        # of a per-item mean: the items of an average micro-batch in the previous
        # step (None before the first). Only the loss scaler's range depends on
        # it, the update is exact for any value; it must be equal on all ranks.
        self.loss_divisor: Optional[float] = None
        # MiB of model state on the largest rank, measured after the first applied update:
        # the tensors' sizes do not change after it (the optimizer state exists from then on).
        self.state_mb: Optional[float] = None
        self.step_peak_state_mb: Optional[float] = None
        # The trainer's own all-reduces (totals and flags; once, the first divisor and state_mb),
        # counted where they are issued, as the strategy counts its collectives.
        self.own_comm = {"step_allreduces": 0, "step_allreduce_bytes": 0}
        # 1 on the rank whose micro-batches count in the step's totals, 0 on the other ranks of its
        # tensor-parallel group (which ran the same ones) and on every pipeline stage but the last (which
        # computes the loss); 1 everywhere without tp or pp.
        self.batch_share = float(plan.mesh is None or plan.mesh.counts_batch(env.rank))
        # Samples likewise, and once per context-parallel group: its ranks hold parts of the same sequences
        # (their tokens, and so the loss and the items, count on each).
        self.sample_share = float(plan.mesh is None or plan.mesh.counts_samples(env.rank))
        # Pipeline stages: the strategy's schedule runs the window's forward and backward passes (None: the step).
        staged = hasattr(strategy, "run_window")
        self.pipeline = self._pipeline_window if staged else None
        # MoE layers' routing statistics and balancing terms (a NoRouting for a dense model); their counting pass
        # runs the window's forward passes as the step does.
        self.routing = routing_of(self.module)
        self.forward_window = self._forward_stages if staged else self._forward_micro_batches
        # Its counts and balancing sums are of this rank's MoE layers (a pipeline stage holds its own only), so
        # they count on one rank of each (stage, data rank) group: the first of its tensor-parallel group.
        self.routing_share = float(plan.mesh is None or env.rank % plan.mesh.tp == 0)
        # The task's objective (task=dpo: the pairs' loss, its figures summed in the step's all-reduce; else none).
        self.objective = objective_of(self.module)
        # data=blend's per-source figures, summed in the step's all-reduce (run.build sets them; none otherwise)
        self.sources: Any = NoSources()

    def optimizer_comm(self) -> Dict[str, int]:
        """The optimizer's own collectives (Muon's gathers of sharded matrices; the float8 all-gather's scales,
        agreed after each update); none for the others."""
        comm = getattr(self.optimizer, "comm", None)
        return {**(comm() if comm is not None else {}), **(self.scales.comm() if self.scales is not None else {})}

    def train_step(self, batches: List[Any], window: Window, step: int,
                   stop_requested: Callable[[], bool] = lambda: False, data_time_s: float = 0.0,
                   busy: Callable[[], bool] = lambda: False) -> StepOutcome:
        """``data_time_s``: how long this rank waited for ``batches`` (shared with the others in the all-reduce);
        ``busy``: whether this rank's background work (a checkpoint's write) still runs: the outcome says whether
        any rank's does, so that every rank learns that it ended at the same step."""
        strategy, scale = self.strategy, self.precision.scaler.scale
        began, comm0 = time.perf_counter(), self._comm()
        strategy.track_peak(self.state_mb is None)  # until the step that measures state_mb
        self.weights.zero_grad()
        counted = [bool(indices) for indices in window]  # a placeholder micro-batch runs, but counts nowhere
        # the step's figures from zero (task=grpo: its rollouts, which become the micro-batches); MoE's global aux
        # term: its counts, first
        batches = self._begin_step(batches, counted, step)
        if self.pipeline is not None:  # pipeline stages: the schedule runs every micro-batch, the last stage the loss
            loss_sum, items = self.pipeline(batches, counted)
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
            items = torch.zeros((), dtype=torch.float64, device=self.env.device)
            for i, (batch, count) in enumerate(zip(batches, counted)):
                last = i == len(batches) - 1
                # whether this backward reduces gradients; whether the MoE layers and the objective count it
                with strategy.micro_batch(last), self.routing.micro_batch(count, self.loss_factor), \
                        self.objective.micro_batch(count):
                    with self.precision.autocast():
                        output = self.model(batch)
                    mb_loss_sum, mb_items = loss_terms(output, batch, count)
                    self.sources.add(output, batch, count)
                    if self.loss_divisor is None:  # the run's first micro-batch: its items, averaged over ranks
                        self.loss_divisor = self._first_divisor(mb_items)
                    (mb_loss_sum * self.loss_factor()).backward()
                if not last:
                    self.weights.accumulate()  # master modes: into the FP32 buffers
                loss_sum += mb_loss_sum.detach()
                items += mb_items
            self.item_form = isinstance(output, Mapping)
        ready = strategy.grads_ready_at()  # when this rank issued its last gradient reduction
        times = (data_time_s, (ready if ready > began else time.perf_counter()) - began)
        totals = self._reduce_window(loss_sum, items, sum(len(ix) for ix in window), stop_requested, times, busy)
        applied = self._apply(totals, scale, step)
        if self.state_mb is None and not applied["skipped"]:
            self.state_mb, self.step_peak_state_mb = self._measure_state_mb()
            strategy.track_peak(False)
        return StepOutcome(**totals["outcome"], **applied, **self._comm_since(comm0), item_form=self.item_form,
                           state_mb=self.state_mb, step_peak_state_mb=self.step_peak_state_mb)

    def loss_factor(self) -> float:
        """What each micro-batch's summed loss is multiplied by before its backward: the loss scale over the
        divisor, both fixed for the window (the MoE balancing terms' backward takes it too)."""
        return self.precision.scaler.scale / self.loss_divisor

    def _comm(self) -> Dict[str, int]:
        """Every collective counted so far: the strategy's (with the objective's: a sharded reference copy's
        gathers), the step's own, the optimizer's."""
        counts = dict(self.strategy.comm())
        for key, value in self.objective.comm().items():
            counts[key] = counts.get(key, 0) + value
        return {**counts, **self.own_comm, **self.optimizer_comm()}

    def _comm_since(self, comm0: Dict[str, int]) -> Dict[str, Any]:
        """The step's collectives, by kind; DDP's gradient all-reduces also on their own."""
        comm = {key: count - comm0[key] for key, count in self._comm().items()}
        return {"comm": comm, "allreduces": comm.get("allreduces", 0),
                "allreduce_bytes": comm.get("allreduce_bytes", 0)}

    def _begin_step(self, batches: List[Any], counted: List[bool], step: int) -> List[Any]:
        """The objective's figures and MoE's expert counts start from zero; where the global aux term needs the
        counts before the first backward, the window's forward passes run first without gradients to count them,
        summed over ranks. The micro-batches to run: the objective's (task=grpo: its rollouts' rows)."""
        batches = list(self.objective.begin_step(self.env.device, batches, counted, self._all_reduce, step))
        self.sources.begin_step(self.env.device)
        self.routing.begin_step(self.env.device)
        if self.routing.needs_prepass(len(counted), self.plan.data_ranks):
            self.routing.count_window(lambda: self.forward_window(batches, counted), self._reduce_counts,
                                      self.env.device)
        return batches

    def _forward_micro_batches(self, batches: List[Any], counted: List[bool]) -> None:
        """Each micro-batch's forward without gradients, as the step runs it (the MoE counts' pass)."""
        for batch, count in zip(batches, counted):
            # evaluation(): under tp the vocabulary-sharded loss; under fsdp nothing left gathered after it
            with self.routing.micro_batch(count), self.strategy.evaluation(), self.precision.autocast():
                self.model(batch)

    def _forward_stages(self, batches: List[Any], counted: List[bool]) -> None:
        """Pipeline stages: the window forward through them as one (each sets its micro-batches' token masks,
        placeholders' empty), the MoE counts' pass."""
        self.strategy.forward_window(batches, counted, self.precision.autocast, self.plan.accum_steps,
                                     self.plan.micro_batch_size)

    def _pipeline_window(self, batches: List[Any], counted: List[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pipeline stages: the schedule runs every micro-batch's forward and backward, the last stage the loss."""
        if self.loss_divisor is None:  # the first micro-batch's items, which every stage knows from its targets
            self.loss_divisor = self._first_divisor(self.strategy.items_of(batches[0]) * float(counted[0]))
        self.item_form = True
        with self.routing.micro_batch(True, self.loss_factor):  # the balancing terms': each micro-batch loss's factor
            return self.strategy.run_window(batches, counted, self.loss_factor(), self.precision.autocast,
                                            self.plan.accum_steps, self.plan.micro_batch_size)

    def _reduce_counts(self, counts: torch.Tensor) -> None:
        """The counting pass's expert counts summed over ranks, each layer's once per data rank."""
        self._all_reduce(counts.mul_(self.routing_share))

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """The trainer's own all-reduce, counted."""
        self.own_comm["step_allreduces"] += 1
        self.own_comm["step_allreduce_bytes"] += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor, op=op)

    def _first_divisor(self, items: torch.Tensor) -> float:
        """Items of the first micro-batch, averaged over ranks: once, at the first step."""
        total = items.detach().clone().to(torch.float64) * self.batch_share
        self._all_reduce(total)
        divisor = max(total.item() / self.plan.data_ranks, 1.0)
        if self.precision.pow2_backward:
            # float8 rounds each gradient to 2-3 mantissa bits after a power-of-two scale: a factor that is not a
            # power of two (the first micro-batch's items differ between splits) would move that rounding
            divisor = 2.0 ** round(math.log2(divisor))
        return divisor

    def _reduce_window(self, loss_sum: torch.Tensor, items: torch.Tensor, samples: int,
                       stop_requested: Callable[[], bool], times: tuple[float, float],
                       busy: Callable[[], bool] = lambda: False) -> dict:
        """One all-reduce of the step's totals, non-finite flags and stop requests.

        Gradients are already identical on all ranks here (the last backward
        all-reduced them), but the flags are summed anyway so that the skip
        decision is the same on every rank by construction, whatever happened
        locally; a stop request (a signal reaches one rank first) likewise.
        float64 keeps item counts exact far beyond 2**24. Each rank's (data wait,
        compute) go in its own slots, so the sum holds every rank's: the straggler
        figures cost no collective of their own.
        """
        world, B = self.env.world_size, STEP_FIXED_SLOTS
        pipeline = self.pipeline is not None  # two more slots a rank: idle and schedule seconds
        own = B + (6 if pipeline else 3) * world
        stats = torch.zeros(own, dtype=torch.float64, device=self.env.device)
        # Read the stop flag now, at the step's end: a signal that came during
        # this step stops the run after it, not after the next one.
        # The ranks of one tensor-parallel group ran the same micro-batches: the first speaks for them.
        share = self.batch_share
        stats[0], stats[1], stats[2] = loss_sum * share, items * share, samples * self.sample_share
        stats[3] = float(stop_requested())
        stats[5] = float(busy())
        # The strategy knows what this rank holds (the whole gradient, or a shard, maybe
        # replicated): its shares add up over ranks to the squared norm of the whole gradient.
        stats[4] = self.strategy.grad_norm_sq(self.weights.grads())
        stats[B + self.env.rank] = (~torch.isfinite(loss_sum)).to(torch.float64)
        stats[B + world + self.env.rank], stats[B + 2 * world + self.env.rank] = times
        if pipeline:
            stats[B + 3 * world + self.env.rank] = self.strategy.pp_idle_s
            stats[B + 4 * world + self.env.rank] = self.strategy.pp_schedule_s
            stats[B + 5 * world + self.env.rank] = self.strategy.pp_inflight
        # MoE: the step's expert counts and balancing sums ride along (none for a dense model).
        stats = torch.cat([stats, self.routing.local_stats(self.routing_share).to(stats.device),
                           self.objective.local_stats(share).to(stats.device),
                           self.sources.local_stats(share).to(stats.device)])
        self._all_reduce(stats)
        values = stats.tolist()  # the step's one host sync
        pp = values[B + 3 * world:own]  # pipeline stages' slots (none without)
        bad_ranks = [r for r in range(world) if values[B + r] > 0]
        # An inf or NaN in any rank's gradients makes the sum non-finite on every rank.
        norm = math.sqrt(values[4]) if math.isfinite(values[4]) else float("nan")
        loss_sum, items = values[0], values[1]
        return {"items": items, "samples": int(values[2]),
                "nonfinite": not math.isfinite(norm) or bool(bad_ranks), "bad_ranks": bad_ranks,
                "raw_norm": norm,  # norm of the grads as they stand: scaled, not yet normalised
                # what the step's outcome reports of them, by StepOutcome's names
                "outcome": {"loss": loss_sum / items if items > 0 else float("nan"), "items": int(items),
                            "samples": int(values[2]), "stop_requested": values[3] > 0, "busy": values[5] > 0,
                            "data_times": values[B + world:B + 2 * world],
                            "compute_times": values[B + 2 * world:B + 3 * world],
                            "pp_idle_times": pp[:world], "pp_schedule_times": pp[world:2 * world],
                            "pp_inflight": pp[2 * world:], "moe": self.routing.take_totals(values[own:], items),
                            "rl": self.objective.take_totals(values[own + self.routing.slots():], items),
                            "sources": self.sources.take_totals(
                                values[own + self.routing.slots() + self.objective.slots():])}}

    def _apply(self, totals: dict, scale: float, step: int) -> Dict[str, Any]:
        """Skip, or normalise, clip and step; what the outcome reports of it, by StepOutcome's names."""
        lr = lr_at(self.updates, self.plan.lr, self.optim_cfg, self.plan.max_steps)
        items = totals["items"]
        divisor = self.loss_divisor  # the one this step's losses were divided by
        # The next step's: items of an average micro-batch of this one, if it was a full
        # step. A short last step (1 sample, say) would shrink it and make the next full
        # step's scaled losses overflow fp16, skipping that step and halving the scale.
        if items > 0 and totals["samples"] == self.plan.global_batch_size:
            self.loss_divisor = items / (self.plan.data_ranks * self.plan.accum_steps)
        outcome = {"lr": lr, "loss_scale": scale if self.precision.scaler.dynamic else None, "grad_norm": None,
                   "skipped": True}
        if totals["nonfinite"]:
            self.skipped_total += 1
            self._skip(totals, step)
            return {**outcome, "skip_reason": "nonfinite"}
        if items <= 0:  # e.g. every target of the step ignored: nothing to average, nothing overflowed
            self.skipped_total += 1
            self.weights.zero_grad()
            log.warning("step %d holds no items to learn from (every target ignored?); nothing was updated", step)
            return {**outcome, "skip_reason": "no_items"}
        # The reduction averaged over the data-parallel ranks (their cp ranks too); undo that, the loss scale
        # and the divisor, and divide by the true item count of the whole step: one multiply.
        grad_ranks = self.plan.data_ranks if self.plan.mesh is None else self.plan.mesh.grad_ranks
        factor = grad_ranks * divisor / (scale * items)
        if self.partial_step == "scaled":  # a short last step counts by the samples it holds
            factor *= totals["samples"] / self.plan.global_batch_size
        grad_norm = totals["raw_norm"] * factor
        clip = self.optim_cfg.grad_clip
        if clip is not None and grad_norm > clip:
            factor *= clip / (grad_norm + 1e-6)
        grads = [g for _, g in self.weights.grads()]
        torch._foreach_mul_(grads, factor)  # one fused multiply (the kernel torch.optim uses)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.weights.after_step()  # master modes: FP32 masters -> half parameters
        self.routing.after_update()  # MoE aux-loss-free balancing: the selection biases, from the step's counts
        self.updates += 1
        self.consecutive_skips = 0
        self.precision.scaler.update(found_inf=False, step=step)
        return {**outcome, "grad_norm": grad_norm, "skipped": False}

    def consistency_tensors(self) -> List[tuple[str, torch.Tensor]]:
        """What must be bit-identical on every rank (the strategy knows what is replicated)."""
        return self.strategy.consistency_tensors()

    def _measure_state_mb(self) -> tuple[float, float]:
        """MiB of model state (parameters, gradients, optimizer state, FP32 masters) on the largest rank,
        and that plus the step's peak of gathered parameters and unsharded gradients, in one all-reduce."""
        state = float(state_bytes(self.strategy, self.optimizer))
        local = torch.tensor([state, state + self.strategy.peak_bytes()], dtype=torch.float64, device=self.env.device)
        self._all_reduce(local, op=dist.ReduceOp.MAX)
        state_mb, peak_mb = (local / 2**20).tolist()
        return state_mb, peak_mb

    def checkpoint_state(self) -> tuple[dict, Optional[dict]]:
        """(everything the step needs to continue exactly, in shared.pt; the sharded tensors or None).

        The loop adds its position. Which strategy wrote it is recorded, so a
        resume with the other one knows what it reads.
        """
        state, sharded = self.strategy.checkpoint_state(self.optimizer)
        return {**state, **self.counters(), "strategy": self.strategy.name}, sharded

    def counters(self) -> dict:
        """The step's own state: loss scaler, schedule position, skip counts, loss divisor."""
        return {
            "scaler": self.precision.scaler.state_dict(),
            "updates": self.updates,
            "consecutive_skips": self.consecutive_skips,
            "skipped_total": self.skipped_total,
            "loss_divisor": self.loss_divisor,
            "objective": self.objective.state_dict(),  # task=grpo's rollouts across rl.inner_steps
        }

    def load_checkpoint_state(self, state: dict, shards: Optional[Path]) -> None:
        """Continue from a checkpoint written by either strategy, on any world size."""
        self.strategy.load_checkpoint_state(self.optimizer, state, shards)
        self.load_counters(state)

    def load_counters(self, state: dict) -> None:
        self.precision.scaler.load_state_dict(state["scaler"])
        self.updates = state["updates"]
        self.consecutive_skips = state["consecutive_skips"]
        self.skipped_total = state["skipped_total"]
        self.loss_divisor = state["loss_divisor"]
        self.objective.load_state_dict(state.get("objective") or {})  # absent from checkpoints before it

    def nonfinite_names(self, limit: int = 5) -> List[str]:
        """Names of the first parameters whose gradient holds inf or NaN (costs a sync each)."""
        bad = [self.names.get(p, "?") for p, g in self.weights.grads() if not torch.isfinite(g).all()]
        return bad[:limit]

    def _skip(self, totals: dict, step: int) -> None:
        """Skip the update on every rank: parameters, optimizer and lr schedule stay put."""
        if self.precision.debug_overflow:
            log.warning("step %d: non-finite gradients in %s", step, ", ".join(self.nonfinite_names()) or "none")
        self.weights.zero_grad()
        scaler = self.precision.scaler
        if scaler.dynamic:
            scaler.update(found_inf=True, step=step)  # may raise LossScaleError at min_scale
            return
        self.consecutive_skips += 1
        where = f"non-finite loss on ranks {totals['bad_ranks']}" if totals["bad_ranks"] else "non-finite gradients"
        if self.trainer_cfg.nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: {where} in precision {self.precision.name}; nothing was updated. "
                "Lower optim.lr or set optim.grad_clip; trainer.nonfinite=skip skips such steps instead."
            )
        if self.consecutive_skips > self.trainer_cfg.max_consecutive_skips:
            raise NonFiniteError(
                f"step {step}: {where}, {self.consecutive_skips} steps in a row, more than "
                f"trainer.max_consecutive_skips={self.trainer_cfg.max_consecutive_skips}; training is diverging."
            )


def _stored(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors holding ``t``'s data: ``t``, or those a wrapper subclass keeps (torchao's 8-bit optimizer
    state: its codes, scales and table)."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _stored(local_tensor(getattr(t, name)))]
    return [t]


def state_bytes(strategy: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of model state this rank holds: parameters, gradients, optimizer state, FP32 masters.

    Each storage counts once (tied weights, views), measured from the tensors themselves.
    """
    tensors: List[torch.Tensor] = []
    for p in strategy.module.parameters():
        tensors += [p] + ([p.grad] if p.grad is not None else [])
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [p] + ([p.grad] if p.grad is not None else [])
            tensors += [v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for local in [inner for t in tensors for inner in _stored(local_tensor(t))]:
        storage = local.untyped_storage()
        key = (storage.data_ptr(), local.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total
