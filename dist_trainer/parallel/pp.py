"""``dist.pp.size`` > 1: the model cut into pipeline stages, run by torch's schedules, exact.

The mesh is pp x replicate x shard x tp (``config.MeshShape``): each of the ``pp``
stage groups holds some of the model's stages, cut by its tp plan over each tp
group, and sharded or replicated over its data-parallel ranks as fsdp, hsdp or
ddp would (ddp as FSDP2 with shard groups of one rank, as under tensor
parallelism). The ranks that differ in their stage group alone see the same
micro-batches, so each stage reads a micro-batch's attention mask and position
ids from its own copy of the batch; only the stream is sent.

Stages. The blocks (``dist.blocks``) are cut into ``size x stages_per_rank``
stages, evenly (``dist.pp.split=auto``) or where the named blocks begin; the
model's ``pp_first`` modules (the embedding) go with the first stage and its
``pp_last`` ones (final norm, head) with the last, which also computes the loss.
A stage group holds stages ``r, r + pp, ...`` (loop placement). Each rank keeps one copy of the model
pruned to what its stages hold, with the parameter names of the whole model,
so checkpoints move between meshes; each stage is a view of it (an FSDP root
of its own). Weights tied across stages (the GPT's embedding and head) are
untied into one copy per stage, and their gradients summed between the two
stages after the schedule's backward: both copies take the same update.

Exactness. torch's schedules divide each micro-batch's loss by their number
(``scale_grads``); that is a mean of micro-batch means. Here the schedule runs
with ``scale_grads=False`` and the loss of each micro-batch is its summed loss
times ``scale / divisor``, as in every other strategy; the trainer then divides
by the step's total items, over every micro-batch and data-parallel rank.
Placeholder micro-batches (a short last step) run with every target ignored.

Counting. Each stage counts the sends and receives it issues (calls and the
tensors' bytes) and the seconds it computes; the rest of the schedule's wall
time is its idle time (the bubble, and waits for peers).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.distributed.tensor import DTensor

from ..checkpoint import load_shards
from ..config import ConfigError, DistConfig, MeshShape
from ..distributed import DistEnv
from ..moe import routing_of
from ..optim import decay_split
from ..precision import Precision, frozen_names
from .blocks import find_blocks
from .fsdp import FSDPStrategy, PeakMeter, ShardedWeights, checkpointed, count_units, mp_policy
from .parallelize import parallelize
from .state import WholeTensors, local_tensor, named_optimizer_state, parameter_ties
from .tp import tp_sharded

P2P_KEYS = ("p2p_sends", "p2p_send_bytes", "p2p_recvs", "p2p_recv_bytes")
# What a model declares to be cut into stages (models.GPT; models.hf.HFModel for decoders laid out as Llama's).
STAGE_API = ("pp_first", "pp_last", "stage_dims", "stage_targets", "stage_forward", "loss_terms")
SIDE_INPUTS = ("attention_mask", "position_ids")  # per micro-batch, read by every stage from its own batch
IGNORE_INDEX = -100


def check_stage_api(model: nn.Module, pp: int) -> None:
    """ConfigError naming dist.pp.size unless the model declares its stages (``STAGE_API``)."""
    if not all(hasattr(model, a) for a in STAGE_API):
        raise ConfigError(f"dist.pp.size={pp}: the model {getattr(model, 'name', type(model).__name__)} does not "
                          f"declare its pipeline stages ({', '.join(STAGE_API)}; the built-in GPT and "
                          "model=hf_causal_lm decoders laid out as Llama's, such as llama, qwen2 and mistral, do): "
                          "set dist.pp.size=1")


def stage_indices(pp_rank: int, pp: int, per_rank: int, v: bool = False) -> List[int]:
    """The stages stage group ``pp_rank`` holds: ``r, r + pp, ...`` (loop: the first on group 0, the last on
    pp - 1), or ``r, 2 pp - 1 - r`` (``v``: ZBV's placement, the first and the last both on group 0)."""
    if v:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def cut_stages(block_names: Sequence[str], stages: int, split: Any, keys: str) -> List[List[int]]:
    """Which blocks (indices into ``block_names``) each of ``stages`` stages holds; ConfigError naming the keys."""
    count = len(block_names)
    if split == "auto":
        if count < stages:
            raise ConfigError(f"{keys} make {stages} pipeline stages, but the model has {count} blocks "
                              f"({list(block_names)}): every stage needs one at least; lower dist.pp.size or "
                              "dist.pp.stages_per_rank, or set dist.blocks to smaller repeated modules")
        bounds = [i * count // stages for i in range(stages + 1)]
    else:
        names = list(split)
        if len(names) != stages - 1:
            raise ConfigError(f"dist.pp.split={names}: {keys} make {stages} stages, so it names the {stages - 1} "
                              f"blocks where stages 1..{stages - 1} begin (blocks: {list(block_names)})")
        unknown = [n for n in names if n not in block_names]
        if unknown:
            raise ConfigError(f"dist.pp.split={names}: {unknown} are not blocks of the model; its blocks are "
                              f"{list(block_names)}")
        starts = [block_names.index(n) for n in names]
        if starts != sorted(set(starts)) or starts[0] == 0:
            raise ConfigError(f"dist.pp.split={names}: the blocks must be in the model's order, without the first "
                              f"block ({block_names[0]}, where stage 0 begins), each stage holding one block at least")
        bounds = [0, *starts, count]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(stages)]


def untie_across(model: nn.Module, first: Sequence[str], last: Sequence[str]) -> List[Tuple[str, str]]:
    """Give each parameter shared between a ``first`` and a ``last`` module a copy of its own in the last.

    Returns the (first name, last name) pairs: their gradients are summed between the stages.
    """
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    inside = lambda name, roots: any(name == r or name.startswith(r + ".") for r in roots)  # noqa: E731
    ties = []
    for group in names.values():
        a = [n for n in group if inside(n, first)]
        b = [n for n in group if inside(n, last)]
        for name in b if a else []:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            setattr(module, attr, nn.Parameter(getattr(module, attr).detach().clone()))
            ties.append((a[0], name))
    return ties


def prune_stages(model: nn.Module, names: Sequence[str], held: set, first: bool, last: bool) -> None:
    """Delete the blocks (``names``, by index) this rank does not hold, and the first and last stages' own modules
    where it holds neither; the names of what is left stay the whole model's."""
    for i, name in enumerate(names):
        if i not in held:
            parent, _, child = name.rpartition(".")
            del model.get_submodule(parent)._modules[child]
    for keep, parts in ((first, model.pp_first), (last, model.pp_last)):
        for part in parts if not keep else ():
            parent, _, child = part.rpartition(".")
            delattr(model.get_submodule(parent), child)


class StageModule(nn.Module):
    """One stage: a view of the pruned model (its modules are the model's own), run by ``stage_forward``."""

    def __init__(self, model: nn.Module, index: int, blocks: List[nn.Module], first: bool, last: bool):
        super().__init__()
        self.index, self.first, self.last = index, first, last
        held = ([model.get_submodule(n) for n in model.pp_first] if first else []) + list(blocks) + \
               ([model.get_submodule(n) for n in model.pp_last] if last else [])
        self.held = nn.ModuleList(held)
        self._blocks = list(blocks)
        object.__setattr__(self, "_model", model)  # not a child: its names are the model's, not the view's
        # The micro-batch the schedule runs (``select``) and the window's side inputs (attention masks, position
        # ids: each stage's rank reads them from its own copy of the batch) and, with MoE layers, each
        # micro-batch's positions that count (its targets != -100).
        self.chunk, self.side, self.masks = 0, [], []

    def select(self, chunk: int) -> None:
        """The micro-batch this stage runs next: before its forward, and before its backward, in which activation
        checkpointing recomputes the forward (after other micro-batches' forwards) and must see the same mask.
        A placeholder's targets are all ignored: its mask is empty, so it counts nowhere."""
        self.chunk = chunk
        if self.masks:
            routing_of(self._model).token_mask = self.masks[chunk]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = self.side[self.chunk] if self.side else None
        return self._model.stage_forward(x, self._blocks, self.first, self.last, **({"side": side} if side else {}))


class _CountingStage(PipelineStage):
    """torch's stage, counting the sends and receives it issues and the seconds it computes."""

    def __init__(self, *args: Any, counts: Dict[str, float], meter: PeakMeter, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.counts, self.meter = counts, meter
        self.peers: List["_CountingStage"] = [self]  # this rank's stages

    def _count(self, ops: List[dist.P2POp], kind: str) -> List[dist.P2POp]:
        for op in ops:
            self.counts[f"p2p_{kind}s"] += 1
            self.counts[f"p2p_{kind}_bytes"] += op.tensor.numel() * op.tensor.element_size()
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> List[dist.P2POp]:
        return self._count(super().get_fwd_recv_ops(fwd_chunk_id), "recv")

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> List[dist.P2POp]:
        return self._count(super().get_bwd_recv_ops(bwd_chunk_id), "recv")

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> List[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id), "send")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> List[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id), "send")

    def _timed(self, run: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        try:
            return run()
        finally:
            self.counts["compute_s"] += time.perf_counter() - began
            self.meter.sample()  # what FSDP holds unsharded after each forward and backward (until state_mb's step)
            # Micro-batches whose activations this rank's stages hold: forwarded, and not yet through their
            # backward (or, after a backward to the input, their weight pass).
            live = sum(len(s.fwd_cache) + len(getattr(s, "backward_state", ())) for s in self.peers)
            self.counts["inflight"] = max(self.counts["inflight"], live)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.select(fwd_chunk_id)  # the micro-batch whose side inputs and token mask the forward takes
        return self._timed(lambda: super(_CountingStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.select(bwd_chunk_id)  # activation checkpointing recomputes this micro-batch's forward
        return self._timed(lambda: super(_CountingStage, self).backward_one_chunk(bwd_chunk_id, *args, **kwargs))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.submod.select(bwd_chunk_id)
        return self._timed(lambda: super(_CountingStage, self).backward_weight_one_chunk(bwd_chunk_id, *args,
                                                                                          **kwargs))


def _pad(ids: torch.Tensor, targets: torch.Tensor, side: Dict[str, torch.Tensor], rows: int,
         seq: int) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """A micro-batch padded to the stages' fixed shape, ``rows`` x ``seq``, with every added target ignored.

    Added positions come after a row's own (attention is causal: they change nothing before them) and
    are masked out where the batch has an attention mask; added rows are token 0, attending causally at
    positions 0, 1, ... A row's loss depends on its own tokens only, so padding changes no number."""
    if ids.shape[1] > seq:
        raise ConfigError(f"a micro-batch of {ids.shape[1]} tokens a row is longer than the pipeline stages' "
                          f"{seq} (the model's block_size): set data.block_size <= model.block_size")

    def added(v: torch.Tensor, key: str, shape: Tuple[int, int], mask: int) -> torch.Tensor:
        if key == "position_ids":  # a segment of its own
            return torch.arange(shape[1], dtype=v.dtype).expand(*shape)
        return v.new_full(shape, mask)  # the attention mask: added positions masked, added rows attending

    extra = seq - ids.shape[1]
    if extra:
        ids = torch.cat([ids, ids.new_zeros((ids.shape[0], extra))], 1)
        targets = torch.cat([targets, targets.new_full((targets.shape[0], extra), IGNORE_INDEX)], 1)
        side = {k: torch.cat([v, added(v, k, (v.shape[0], extra), 0)], 1) for k, v in side.items()}
    short = rows - ids.shape[0]
    if short:
        ids = torch.cat([ids, ids.new_zeros((short, seq))])
        targets = torch.cat([targets, targets.new_full((short, seq), IGNORE_INDEX)])
        side = {k: torch.cat([v, added(v, k, (short, seq), 1)]) for k, v in side.items()}
    return ids, targets, side


def pp_bubble(schedule: str, pp: int, per_rank: int, accum: int) -> float:
    """The schedule's idle fraction: (p - 1) / (m + p - 1) for gpipe and 1f1b; interleaving v stages per rank
    cuts the warm-up and drain by v: (p - 1) / (v m + p - 1); zero_bubble's is its order's, simulated
    (``simulated_idle``), the mean over stage groups."""
    if schedule == "zero_bubble":
        idle = simulated_idle(schedule, pp, per_rank, accum)
        return sum(idle) / len(idle)
    v = per_rank if schedule != "gpipe" else 1
    return (pp - 1) / (v * accum + pp - 1)


def schedule_orders(schedule: str, pp: int, per_rank: int, accum: int) -> Dict[int, List[Any]]:
    """The order of actions torch's multi-stage schedule gives each stage group (interleaved_1f1b, zero_bubble:
    ZBV for 2 stages a rank, the interleaved one for more), computed as the schedule computes it on every rank
    (None: an idle slot)."""
    from types import SimpleNamespace

    if schedule == "zero_bubble" and per_rank == 2:
        cls, attrs = ScheduleZBVZeroBubble, {"pp_group_size": pp, "num_stages": 2 * pp, "_n_microbatches": accum}
    else:
        rounds = max(1, accum // pp)
        cls = ScheduleInterleavedZeroBubble if schedule == "zero_bubble" else ScheduleInterleaved1F1B
        attrs = {"pp_group_size": pp, "n_local_stages": per_rank, "_n_microbatches": accum,
                 "number_of_rounds": rounds, "microbatches_per_round": accum // rounds}
    return {r: cls._calculate_single_rank_operations(SimpleNamespace(**attrs), r) for r in range(pp)}


# A unit of time per forward, per backward to the input (I) and per backward to the weights (W); a full
# backward (B) is both: the zero-bubble paper's model, in which 1f1b's bubble is (p - 1) / (m + p - 1).
ACTION_COST = {"F": 1, "I": 1, "W": 1, "B": 2}


def simulated_idle(schedule: str, pp: int, per_rank: int, accum: int) -> List[float]:
    """Each stage group's idle fraction of the step under ``schedule_orders``: its actions run in their order,
    each when its input is ready (a forward after the previous stage's forward of that micro-batch, a backward
    after the next stage's backward, the last stage's after its forward), at ``ACTION_COST``; sends take no
    time. Idle is the share of the step's length a group does not compute. (For interleaved_1f1b this gives
    its formula.)"""
    orders = {r: [a for a in actions if a is not None]
              for r, actions in schedule_orders(schedule, pp, per_rank, accum).items()}
    last = pp * per_rank - 1
    done: Dict[Tuple[int, str, int], float] = {}  # (stage, "F" or "B", micro-batch) -> when it ended
    clock, busy, at = [0.0] * pp, [0.0] * pp, [0] * pp
    while any(at[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(orders[r]):
                a = orders[r][at[r]]
                kind, s, m = a.computation_type.value, a.stage_index, a.microbatch_index
                need = ((s - 1, "F", m) if kind == "F" and s > 0 else
                        ((s + 1, "B", m) if s < last else (s, "F", m)) if kind in ("I", "B") else None)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done[need] if need is not None else 0.0)
                clock[r] = start + ACTION_COST[kind]
                busy[r] += ACTION_COST[kind]
                if kind != "W":
                    done[(s, "F" if kind == "F" else "B", m)] = clock[r]
                at[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"torch's {schedule} order deadlocks for pp {pp} x {per_rank} with {accum} "
                               "micro-batches")
    span = max(clock)
    return [1 - b / span for b in busy]


def pp_inflight(schedule: str, pp: int, per_rank: int, accum: int) -> List[int]:
    """Per stage group: the most micro-batches whose activations its stages hold for backward at once (a
    stage's activation memory is this many times one micro-batch's). gpipe: every micro-batch; 1f1b: its
    warm-up, p - r on group r; the multi-stage schedules: along torch's order, a micro-batch held from its
    forward on a stage to its backward there (under zero_bubble, to its weight pass, which needs the graph)."""
    if schedule == "gpipe":
        return [accum] * pp
    if schedule == "1f1b":
        return [min(accum, pp - r) for r in range(pp)]
    peaks = []
    for r, order in schedule_orders(schedule, pp, per_rank, accum).items():
        live: set = set()
        peak = 0
        for a in order:
            if a is None:
                continue
            kind, key = a.computation_type.value, (a.stage_index, a.microbatch_index)
            if kind == "F":
                live.add(key)
            elif kind in ("B", "W"):
                live.discard(key)
            peak = max(peak, len(live))
        peaks.append(peak)
    return peaks


def held_along(order: Sequence[Any]) -> List[Tuple[set, Dict[int, str]]]:
    """After each action of a stage group's zero-bubble order: the stages it holds gathered, and the form of
    each stage's unsharded gradients. torch's runtime gathers every stage at the step's start, and reduces a
    stage's gradients and reshards it right after its last weight pass. A weight pass leaves gradients in
    the parameters' dtype (``half`` in master modes) beside those already accumulated in FP32 (``both``);
    FSDP folds them into the FP32 accumulation (``full``) at the stage's next backward to the input, or at
    once on the first stage, whose weight pass is its whole backward."""
    acts = [a for a in order if a is not None]
    made = [i for i, a in enumerate(acts) if a.computation_type.value in ("W", "B")]
    last = {acts[i].stage_index: i for i in made}
    first_stage = min((a.stage_index for a in acts), default=0) == 0
    forms: Dict[int, str] = {}
    out = []
    for i, a in enumerate(acts):
        kind, s = a.computation_type.value, a.stage_index
        if kind == "I" and s in forms:
            forms[s] = "full"
        elif kind in ("W", "B"):
            folded_now = kind == "B" or (first_stage and s == 0)
            forms[s] = "full" if folded_now else ("both" if s in forms else "half")
        out.append(({t for t in last if last[t] >= i}, dict(forms)))
        if kind in ("W", "B") and last[s] == i:
            del forms[s]  # reduced and resharded
    return out


def schedule_class(schedule: str, per_rank: int) -> Any:
    """torch's schedule for ``dist.pp.schedule`` (zero_bubble: ZBV with 2 stages a rank, else interleaved)."""
    if schedule == "zero_bubble":
        return ScheduleZBVZeroBubble if per_rank == 2 else ScheduleInterleavedZeroBubble
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[schedule]


class PipelineStrategy(FSDPStrategy):
    """The stages of one stage group, each an FSDP2 root over its data-parallel ranks, run by a schedule.

    The step asks it what it asks every strategy (norm shares, collectives,
    checkpoints) and, instead of calling the model per micro-batch, ``run_window``.
    """

    name = "fsdp"  # checkpoints are DCP shards, as fsdp's: any mesh reads them

    def __init__(self, model: nn.Module, env: DistEnv, cfg: DistConfig, mesh: MeshShape, precision: Precision,
                 compile: bool = False, materialise: Optional[Callable[[nn.Module], None]] = None):
        pp, per_rank, schedule = mesh.pp, cfg.pp.stages_per_rank, cfg.pp.schedule
        check_stage_api(model, pp)
        model = model if materialise is not None else model.to(env.device)  # a meta model: its stages' shards
        self.env, self.mesh, self.precision = env, mesh, precision
        dims = (("pp", pp), ("replicate", mesh.replicate), ("shard", mesh.shard), *((("tp", mesh.tp),) * (mesh.tp > 1)))
        root = init_device_mesh(env.device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
        dmesh = root["shard"] if mesh.replicate == 1 else root["replicate", "shard"]
        tp_mesh = root["tp"] if mesh.tp > 1 else None
        self.pp_group = root["pp"].get_group()
        self.pp_rank = mesh.pp_rank(env.rank)
        stages = pp * per_rank
        self.stage_ids = stage_indices(self.pp_rank, pp, per_rank, mesh.pp_v)
        blocks = find_blocks(model, cfg.blocks)
        block_name = {id(m): n for n, m in model.named_modules()}
        names = [block_name[id(b)] for b in blocks]
        cuts = cut_stages(names, stages, cfg.pp.split,
                          f"dist.pp.size={pp} x dist.pp.stages_per_rank={per_rank}")
        # The whole model's parameter names in its optimizer's order, by which a ddp checkpoint's optimizer
        # state is indexed.
        name_of = {p: n for n, p in model.named_parameters()}
        self.whole_names = [name_of[p] for group in decay_split([p for p in name_of if p.requires_grad])
                            for p in group]
        self.width, self.vocab = model.stage_dims()
        # model.loss.chunked: the last stage returns its micro-batch's summed loss, never the logits
        self.chunked_loss = bool(getattr(getattr(model, "loss_options", None), "chunked", False))
        self.stream_dtype = precision.param_dtype or torch.float32  # what stages send: activations, their grads
        self.stream_shape: Tuple[int, ...] = ()  # micro-batch rows x tokens (a tp rank's shard) x width, built
        held = {i for s in self.stage_ids for i in cuts[s]}

        def keep_stages(model: nn.Module) -> None:
            # Tensor parallelism cut the whole model (its plan names every block), and the stages are cut from it:
            # a tie across stages is cut alike on both sides (the embedding by rows, the head by rows).
            self.ties = untie_across(model, model.pp_first, model.pp_last)
            prune_stages(model, names, held, 0 in self.stage_ids, stages - 1 in self.stage_ids)

        # tp on the whole model, then this rank's stages kept, then on them cp (each window's micro-batches are cut
        # in _window), ep (the experts cut over the stage group's ep ranks, left out of FSDP, their gradients
        # reduced over the edp ranks after the schedule) and checkpointing; compile is refused (checks.py).
        applied = parallelize(model, mesh, cfg, env, tp_mesh, compile, keep_stages=keep_stages)
        self.tp, self.cp, self.ep, held_blocks = applied.tp, applied.cp, applied.ep, applied.blocks
        self.sequence_shards = mesh.tp if self.tp is not None and cfg.tp.sequence_parallel else 1
        self.views = [StageModule(model, s, [b for i, b in enumerate(blocks) if i in cuts[s]], s == 0,
                                  s == stages - 1) for s in self.stage_ids]
        policy = mp_policy(precision)
        # micro_batch is a ConfigError under fsdp; under ddp, shard groups of one gather nothing. zero_bubble keeps
        # every unit gathered from forward to its weight pass: torch's backward to the input finds the parameters
        # the weight pass computes gradients for in the stage module, and finds none if they were resharded (their
        # gradients would be lost without an error).
        after_forward = cfg.fsdp.reshard == "micro_batch" and schedule != "zero_bubble"
        for unit in [*held_blocks, *self.views]:  # each block in one stage; each stage a root over the rest
            fully_shard(unit, mesh=dmesh, reshard_after_forward=after_forward, mp_policy=policy,
                        ignored_params=self.ep.ignored)
        if materialise is not None:  # each rank allocates and initialises the shards of its own stages only
            materialise(model)
        self.units: List[FSDPModule] = [m for v in self.views for m in v.modules() if isinstance(m, FSDPModule)]
        self.meter, self.counter = count_units(self.units, mesh.replicate)
        self.model = self.module = model
        self.weights = ShardedWeights(model)
        first_replica = mesh.grad_rank(env.rank) < mesh.shard
        first_of_tp = env.rank % mesh.tp == 0
        tied_copies = {b for _, b in self.ties}
        params = dict(model.named_parameters())
        self.norm_share = {p: float(first_replica and name not in tied_copies and
                                    (first_of_tp or tp_sharded(p, tp_mesh)))
                           for name, p in params.items() if p.requires_grad}
        self.norm_share.update({p: self.ep.norm_share for p in self.ep.params})  # each expert once
        self._shares_cache = ((), None)
        self.tie_pairs = [(params.get(a), params.get(b)) for a, b in self.ties]
        self._tie_group = self._tie_groups() if self.ties else None
        self.groups = [dist.group.WORLD, *dmesh.get_all_groups(), *(tp_mesh.get_all_groups() if tp_mesh else []),
                       self.pp_group,
                       *([self._tie_group] if self._tie_group is not None else []), *self.ep.groups,
                       *self.cp.groups]
        self.counts: Dict[str, float] = {**dict.fromkeys(P2P_KEYS, 0), "compute_s": 0.0, "inflight": 0}
        self.schedule_name, self.per_rank, self.n_stages = schedule, per_rank, stages
        self.bubble: Optional[float] = None  # the predicted idle fraction, once the step's micro-batches are known
        self.schedule: Any = None  # built at the first step, from its micro-batches' shapes
        self.accum_steps = self.micro_batch_size = self.seq_len = 0  # a window's shape (the plan's; the model's
        # block_size: shorter sequences are padded)
        self.pp_idle_s = self.pp_schedule_s = 0.0  # this rank's idle and wall seconds in the last step's schedule
        self.pp_inflight = 0  # the most micro-batches whose activations this rank held at once in it
        self._losses: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._loss_factor = 1.0
        self._comm_extra = {"allreduces": 0, "allreduce_bytes": 0}

    def _tie_groups(self) -> Optional[dist.ProcessGroup]:
        """The group of the first and last stage's ranks at this rank's data-parallel position (every rank makes
        every group, in one order, as torch requires); None on ranks in neither, and where one stage group holds
        both stages (the V placement: the copies are summed on the rank)."""
        per, last = self.mesh.stage_ranks, self.mesh.last_stage_group
        if last == 0:
            return None
        mine = None
        for offset in range(per):
            ranks = [offset, last * per + offset]
            group = dist.new_group(ranks)
            if self.env.rank in ranks:
                mine = group
        return mine

    # -- the step ---------------------------------------------------------------------------------------------

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.chunked_loss:  # the last stage computed the summed loss itself (model.loss.chunked)
            terms = {"loss_sum": output.sum(), "num_items": (target != IGNORE_INDEX).sum()}
        else:
            terms = self.model.loss_terms(output, target)
        loss_sum = terms["loss_sum"].float()
        recorded = loss_sum.detach()
        self._losses.append((recorded.full_tensor() if isinstance(recorded, DTensor) else recorded,
                             terms["num_items"].detach()))
        return loss_sum * self._loss_factor

    def _build(self, seq: int) -> None:
        """torch's stages (static shapes: micro-batch rows x ``seq`` tokens) and the schedule, at the first step."""
        mb, n = self.micro_batch_size, self.accum_steps
        stream, vocab = self.stream_dtype, self.vocab
        # Under sequence parallelism the stream between blocks, and so between stages, is this rank's sequence
        # shard.
        self.stream_shape = (mb, seq // self.sequence_shards, self.width)
        # Gradients flow through the stream (requires_grad), not through token ids.
        meta = lambda *shape, dtype=stream: torch.empty(shape, dtype=dtype, device="meta",  # noqa: E731
                                                         requires_grad=dtype.is_floating_point)
        stages = []
        for view in self.views:
            s = view.index
            inp = meta(mb, seq, dtype=torch.long) if s == 0 else meta(*self.stream_shape)
            logits = meta(1, dtype=torch.float32) if self.chunked_loss else meta(mb, seq, vocab)
            out = logits if s == self.n_stages - 1 else meta(*self.stream_shape)
            stages.append(_CountingStage(view, s, self.n_stages, self.env.device, input_args=inp, output_args=out,
                                         group=self.pp_group, counts=self.counts, meter=self.meter))
        for stage in stages:
            stage.peers = stages
        cls = schedule_class(self.schedule_name, self.per_rank)
        self.bubble = pp_bubble(self.schedule_name, self.mesh.pp, self.per_rank, n)
        try:
            self.schedule = cls(stages[0] if self.per_rank == 1 else stages, n_microbatches=n, loss_fn=self._loss,
                                scale_grads=False)
        except ValueError as err:  # validate() checks the known rules; torch's own say what else it needs
            raise ConfigError(f"dist.pp.schedule={self.schedule_name} with batch.accum_steps={n}: {err}") from err

    def run_window(self, batches: List[Any], counted: List[bool], factor: float, autocast: Callable[[], Any],
                   accum_steps: int, micro_batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """One step's forward and backward over every micro-batch through the schedule; gradients reduced.

        ``factor`` (scale / divisor) multiplies each micro-batch's summed loss; ``accum_steps`` and
        ``micro_batch_size`` are the plan's (a full step's shape, also when this step is a short one). Returns
        the window's summed loss and items on the last stage's ranks (zeros elsewhere), float64.
        """
        self._build_once(batches, accum_steps, micro_batch_size)
        inputs, targets = self._window(batches, counted)
        self._losses, self._loss_factor = [], factor
        began, compute0 = time.perf_counter(), self.counts["compute_s"]
        self.counts["inflight"] = 0
        with autocast(), self._tp_context():
            self.schedule.step(inputs, target=targets, return_outputs=False)
        self.pp_inflight = int(self.counts["inflight"])
        self.pp_schedule_s = time.perf_counter() - began
        self.pp_idle_s = max(self.pp_schedule_s - (self.counts["compute_s"] - compute0), 0.0)
        if self.schedule_name == "zero_bubble":
            self._check_weight_pass()
        self._sum_tied_grads()
        self.ep.reduce_grads()  # the expert slices' gradients, accumulated outside FSDP, reduced once
        return self._totals(self._losses)

    def _build_once(self, batches: List[Any], accum_steps: int, micro_batch_size: int) -> None:
        if self.schedule is None:
            self.accum_steps, self.micro_batch_size = accum_steps, micro_batch_size
            self.seq_len = getattr(self.model, "block_size", None) or batches[0]["input_ids"].shape[1]
            if self.cp.size > 1:  # the stages run on this rank's share of each (padded) sequence
                self.seq_len = self.cp.padded(self.seq_len)
            self._build(self.seq_len // self.cp.size)

    def forward_window(self, batches: List[Any], counted: List[bool], autocast: Callable[[], Any],
                       accum_steps: int, micro_batch_size: int) -> None:
        """Every micro-batch of the window forward through this rank's stages, in order, with no loss: the MoE
        layers' counting pass (``Routing.count_window``, which runs it without gradients). Its sends and
        receives are counted with the step's."""
        self._build_once(batches, accum_steps, micro_batch_size)
        inputs, targets = self._window(batches, counted)
        with self.evaluation(), autocast(), self._tp_context(count=False):  # nothing left gathered after it
            self._forward_only(inputs, targets, loss=False)

    def _check_weight_pass(self) -> None:
        """torch's zero-bubble weight pass computes gradients for the parameters that its backward to the input
        found in the stage, and drops any other without an error (a parameter resharded between forward and
        backward, or one the forward does not use). Every trainable parameter of this rank's stages has its
        gradient after the schedule, or the step stops here, before the optimizer."""
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise RuntimeError(f"dist.pp.schedule=zero_bubble: {len(missing)} trainable parameters have no gradient "
                               f"after the schedule (first: {missing[:3]}); zero_bubble needs every parameter used "
                               "in each stage's forward: use dist.pp.schedule=interleaved_1f1b")

    def _totals(self, losses: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The summed loss and items of the micro-batches the last stage recorded (zeros on other stages), float64."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for loss, items in losses:
            totals += torch.stack([loss.double(), items.double()])
        return totals[0], totals[1]

    def _window(self, batches: List[Any], counted: List[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
        """A full window as one batch for the schedule to cut: missing micro-batches (a short step's) run as
        placeholders, with every target ignored; short ones are padded to the micro-batch size with ignored rows
        (the stages' shapes are fixed). A row's loss depends on its own tokens only, so padding changes nothing."""
        rows, missing = self.micro_batch_size, self.accum_steps - len(batches)
        batches, counted = list(batches) + [batches[-1]] * missing, list(counted) + [False] * missing
        inputs, targets, sides = [], [], []
        for b, keep in zip(batches, counted):
            ids, tgt = b["input_ids"][:rows], self.model.stage_targets(b)[:rows]
            tgt = tgt if keep else torch.full_like(tgt, IGNORE_INDEX)
            side = {k: b[k][:rows] for k in SIDE_INPUTS if k in b}
            ids, tgt, side = _pad(ids, tgt, side, rows, self.seq_len)
            if self.cp.size > 1:  # this rank's positions of every row, and those positions for the stages
                side = self.cp.cut({"input_ids": ids, "targets": tgt, **side})
                ids, tgt = side.pop("input_ids"), side.pop("targets")
            if self.chunked_loss:  # the last stage computes the loss from them
                side = {**side, "targets": tgt}
            inputs.append(ids)
            targets.append(tgt)
            sides.append(side)
        masks = [t != IGNORE_INDEX for t in targets] if routing_of(self.model).layers else []
        for view in self.views:
            view.side, view.masks = sides if any(sides) else [], masks
        return torch.cat(inputs), torch.cat(targets)

    def items_of(self, batch: Any) -> torch.Tensor:
        """The items of one micro-batch, known to every stage from its targets (the first step's divisor)."""
        return (self.model.stage_targets(batch) != IGNORE_INDEX).sum().to(torch.float64)

    def _sum_tied_grads(self) -> None:
        """Both copies of a weight tied across stages get the sum of their gradients (this rank's shards): the
        first stage group holds one, the last the other."""
        for a, b in self.tie_pairs:
            mine = [p for p in (a, b) if p is not None and p.grad is not None]
            if len(mine) == 2:  # both copies on this rank (the V placement)
                total = local_tensor(a.grad) + local_tensor(b.grad)
                local_tensor(a.grad).copy_(total)
                local_tensor(b.grad).copy_(total)
            elif mine:
                grad = local_tensor(mine[0].grad)
                self._comm_extra["allreduces"] += 1
                self._comm_extra["allreduce_bytes"] += grad.numel() * grad.element_size()
                dist.all_reduce(grad, group=self._tie_group)

    @contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:  # the schedule runs the micro-batches
        raise RuntimeError("pipeline stages run through run_window")
        yield

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.reshard_all()

    def eval_window(self, batches: List[Any], autocast: Callable[[], Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Forward only over held-out micro-batches, ``accum_steps`` at a time through the schedule (after the
        first step, which built it). The summed loss and items on the last stage's ranks, zeros elsewhere."""
        losses: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for start in range(0, len(batches), self.accum_steps):
            group = batches[start:start + self.accum_steps]
            inputs, targets = self._window(group, [True] * len(group))
            self._losses, self._loss_factor = [], 1.0
            with autocast(), self._tp_context(count=False):
                if self.schedule_name == "zero_bubble":
                    self._forward_only(inputs, targets)
                else:
                    self.schedule.eval(inputs, target=targets)
            losses += self._losses
        return self._totals(losses)

    def _forward_only(self, inputs: torch.Tensor, targets: torch.Tensor, loss: bool = True) -> None:
        """Every micro-batch forward through this rank's stages in stage order, the last stage's loss recorded
        (``loss``; else the sends and receives counted: the MoE counting pass is part of the step).
        torch's zero-bubble runtime cannot run forward alone (at the V's turn it hands a backward over in eval
        too). Each stage waits only for a lower one, so the ranks cannot wait on each other in a circle."""
        n = self.accum_steps
        owner = {s: r for r in range(self.mesh.pp)
                 for s in stage_indices(r, self.mesh.pp, self.per_rank, self.mesh.pp_v)}
        peer = lambda s: dist.get_global_rank(self.pp_group, owner[s])  # noqa: E731
        xs, ts = inputs.chunk(n), targets.chunk(n)
        here: List[torch.Tensor] = []  # the previous stage's outputs, where it is this rank's
        sent: List[Tuple[Any, torch.Tensor]] = []
        for view in self.views:  # in stage order
            s, outputs = view.index, []
            for m in range(n):
                if s == 0:
                    x = xs[m]
                elif s - 1 in self.stage_ids:
                    x = here[m]
                else:
                    x = torch.empty(self.stream_shape, dtype=self.stream_dtype, device=self.env.device)
                    dist.recv(x, src=peer(s - 1), group=self.pp_group)
                    self._count_p2p("recv", x, not loss)
                view.select(m)
                y = view(x)
                if s == self.n_stages - 1:
                    if loss:
                        self._loss(y, ts[m])
                elif s + 1 in self.stage_ids:
                    outputs.append(y)
                else:
                    y = y.contiguous()
                    sent.append((dist.isend(y, dst=peer(s + 1), group=self.pp_group), y))
                    self._count_p2p("send", y, not loss)
            here = outputs
        for work, _ in sent:
            work.wait()

    def _count_p2p(self, kind: str, tensor: torch.Tensor, count: bool) -> None:
        if count:
            self.counts[f"p2p_{kind}s"] += 1
            self.counts[f"p2p_{kind}_bytes"] += tensor.numel() * tensor.element_size()

    def comm(self) -> Dict[str, int]:
        counts = super().comm()  # FSDP's collectives and, under tp, the activations'
        for key in P2P_KEYS:
            counts[key] = int(self.counts[key])
        for key, value in self._comm_extra.items():
            counts[key] += value
        return counts

    def full_tensors(self) -> WholeTensors:
        """The FP32 model tensor by tensor: each stage group's tensors gathered within it, then sent by its
        lowest rank to rank 0. The last stage's copy of a weight tied across stages keeps its own name (a
        one-process model's state_dict names it too) and is marked tied to the first's."""
        ties = {**parameter_ties(self.module), **{b: a for a, b in self.ties}}
        return WholeTensors(self.module.state_dict(), ties, self.env.device)

    # -- checkpoints: the whole model's names, so that any mesh reads what any other wrote ----------------------

    def _tie_names(self) -> Tuple[Dict[str, str], Dict[str, str]]:
        """(alias, twins), each a tied weight's copy name -> the first stage's name (the one name a whole model
        gives it). alias: the copy is saved under the first's name where this rank does not hold that name
        itself. twins: the copy is held beside the first's on this rank (the V placement); its optimizer state
        is the first's (the same gradients, the same updates), saved once, under the first's name."""
        held = {n for n, _ in self.module.named_parameters()}
        alias = {b: a for a, b in self.ties if a not in held}
        twins = {b: a for a, b in self.ties if a in held and b in held}
        return alias, twins

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        model, optim = get_state_dict(self.module, optimizer, options=checkpointed(self.module))
        alias, twins = self._tie_names()
        state = {alias.get(k, k): v for k, v in optim["state"].items() if k not in twins}
        groups = [{**g, "params": [alias.get(n, n) for n in g["params"] if n not in twins]}
                  for g in optim["param_groups"]]
        every: List[Any] = [None] * self.env.world_size
        dist.all_gather_object(every, groups)  # the param_groups of the whole model, for shared.pt
        merged = [{**g, "params": list(dict.fromkeys(n for rank in every for n in rank[i]["params"]))}
                  for i, g in enumerate(groups)]
        return {"param_groups": merged}, {"model": model, "optim": state}

    def load_checkpoint_state(self, optimizer: torch.optim.Optimizer, saved: Dict[str, Any],
                              shards: Optional[Path]) -> None:
        model, optim = get_state_dict(self.module, optimizer, options=checkpointed(self.module))
        alias, twins = self._tie_names()
        back = {v: k for k, v in alias.items()}
        if shards is not None:  # a sharded checkpoint of any mesh: DCP reshards
            state = {"model": model, "optim": {alias.get(k, k): v for k, v in optim["state"].items() if k not in twins}}
            load_shards(state, shards)
            model, loaded = state["model"], {back.get(k, k): v for k, v in state["optim"].items()}
            saved_groups, options = saved["param_groups"], checkpointed(self.module)
        else:  # a ddp checkpoint: whole FP32 tensors (a tied weight under each of its names), the optimizer's
            # state by the whole model's parameter order
            model = {k: saved["model"][k] for k in model}
            named = named_optimizer_state(saved["optimizer"], self.whole_names)
            loaded = {k: named["state"][alias.get(k, k)] for k in optim["state"]
                      if k not in twins and alias.get(k, k) in named["state"]}
            saved_groups = named["param_groups"]
            options = StateDictOptions(full_state_dict=True, strict=not frozen_names(self.module))
        for b, a in twins.items():  # the copy's state: the first's, as saved once
            if a in loaded:
                loaded[b] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in loaded[a].items()}
        groups = [{**s, "params": c["params"]} for c, s in zip(optim["param_groups"], saved_groups)]  # ours, their lr
        set_state_dict(self.module, optimizer, model_state_dict=model,
                       optim_state_dict={"state": loaded, "param_groups": groups}, options=options)
