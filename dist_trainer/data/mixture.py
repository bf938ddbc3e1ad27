"""``data=blend``'s arithmetic: each source's weight at a step, and how many samples each source gives each step.

No tensor and no process group here: validation, plan mode and the loader (``blend.py``) all read the same
numbers from this module, so what plan mode prints is what a run takes.

A source's weight is a number or a list of ``[step, weight]`` points (linearly interpolated between points,
held flat before the first and after the last; steps are the trainer's, 1 the first). At step ``s`` the
weights are normalised to sum 1, and the global batch of ``G`` samples is apportioned as

    quota_k = G * w_k(s) + carry_k           carry_k: what source k is owed (or was over-served) so far
    count_k = floor(quota_k) (at least 0), then the samples still missing go one by one to the largest
              quota_k - count_k (ties: the source listed first), any surplus leaves the smallest
    carry_k = quota_k - count_k

so every step holds exactly ``G`` samples, and the carries sum to zero: a source's count over steps 1..s
differs from ``G * (w_k(1) + ... + w_k(s))`` by its carry. With every weight at least 1 / G the quotas are
positive and this is the largest-remainder rule, so each carry stays within (-1, 1); with weights of exactly 0
too it stayed below 1 on random schedules (tests/test_blend.py; 0.87 at worst in 3,000 more, not proven). A
weight between 0 and 1 / G can overshoot it by a fraction of a sample (1.04 seen): a source cannot be given
less than nothing in a step. (Weights here are the normalised ones.)

The rounding is sequential, so a source's position at step s is a function of the step (replayed from step 1 at
a resume, microseconds a step); a checkpoint also holds it, a resume checks the two agree, and with
``data.blend.allow_change=true`` continues from the saved positions with the new weights.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..config import Config, ConfigError, MeshShape, require

KINDS = ("tokens", "hf_text", "hf_chat", "custom")
TARGETS = {"tokens": "dist_trainer.data.tokens.token_file", "hf_text": "dist_trainer.data.hf_text.hf_text",
           "hf_chat": "dist_trainer.data.hf_chat.hf_chat"}
BLEND_TARGET = "dist_trainer.data.blend.blend"
# The blend's own keys of a source's node; the others are the kind's arguments.
SOURCE_KEYS = ("kind", "weight", "_target_")
# Shared by every source: set on data, never on a source.
SHARED_KEYS = ("block_size", "tokenizer", "vocab_size", "seed", "task")
Points = List[Tuple[int, float]]
# A streaming source's length in a Blend (data/streaming.py): its position p is its block p, no wrap by length;
# what it holds is not known until read, and plan mode and describe() say so.
STREAMED = 2**48
NOT_KNOWN = "streamed: not known until read"


def is_blend(data: Mapping[str, Any]) -> bool:
    return data.get("_target_") == BLEND_TARGET


def parse_weight(value: Any, key: str) -> Points:
    """A weight as its points ``[(step, weight), ...]``; a ConfigError naming ``key``."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if number(value):
        return [(1, float(value))]
    require(isinstance(value, (list, tuple)) and len(value) > 0, key, value,
            "must be a number >= 0 or a list of [step, weight] points, e.g. [[1, 0.5], [1000, 0.1]]")
    points: Points = []
    for i, point in enumerate(value):
        ok = (isinstance(point, (list, tuple)) and len(point) == 2 and isinstance(point[0], int)
              and not isinstance(point[0], bool) and point[0] >= 1 and number(point[1]))
        require(ok, f"{key}[{i}]", point, "must be [step, weight]: an integer step >= 1 and a number >= 0")
        require(not points or point[0] > points[-1][0], f"{key}[{i}]", point,
                "steps must increase from one point to the next")
        points.append((int(point[0]), float(point[1])))
    return points


def weight_at(points: Points, step: int) -> float:
    """The weight at ``step``: linear between points, flat outside them."""
    if step <= points[0][0]:
        return points[0][1]
    for (s0, w0), (s1, w1) in zip(points, points[1:]):
        if step <= s1:
            return w0 + (w1 - w0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def apportion(total: int, weights: Sequence[float], carry: Sequence[float]) -> Tuple[List[int], List[float]]:
    """(each source's count, its carry after this step) for one step of ``total`` samples (the module's rule)."""
    quota = [total * w + c for w, c in zip(weights, carry)]
    counts = [max(0, math.floor(q)) for q in quota]
    short = total - sum(counts)
    while short > 0:  # the most owed first; the first listed on a tie
        k = max(range(len(quota)), key=lambda i: (quota[i] - counts[i], -i))
        counts[k] += 1
        short -= 1
    while short < 0:  # over-served (a quota below zero was held at zero): the least owed gives one back
        k = min((i for i in range(len(quota)) if counts[i] > 0), key=lambda i: (quota[i] - counts[i], i))
        counts[k] -= 1
        short += 1
    return counts, [q - n for q, n in zip(quota, counts)]


class Mixture:
    """Counts per source per step, from ``start`` on: ``start`` is (the step done, each source's samples taken so
    far, its carry), (0, zeros, zeros) for a run from the beginning.

    The rounding runs forward step by step; the last ``KEEP`` steps' results are kept (the loader asks for the
    step it is at and a few ahead), and a step before them is replayed from ``start``: memory stays bounded
    however long the run."""

    KEEP = 4096

    def __init__(self, names: Sequence[str], schedules: Sequence[Points], global_batch_size: int,
                 start: Optional[Tuple[int, Sequence[int], Sequence[float]]] = None):
        self.names, self.schedules, self.total = list(names), list(schedules), global_batch_size
        step, taken, carry = start or (0, [0] * len(names), [0.0] * len(names))
        self.first = step  # steps 1..first are before this mixture: asked about, they are an error
        self.start = (step, list(taken), list(carry))
        self._rewind()

    def _rewind(self) -> None:
        step, taken, carry = self.start
        # step -> (each source's samples taken in steps 1..step, its carry after step, its count in step)
        self._done: Dict[int, Tuple[List[int], List[float], List[int]]] = {step: (list(taken), list(carry), [])}
        self._last = step

    def weights(self, step: int) -> List[float]:
        """The normalised weights at ``step``."""
        raw = [weight_at(points, step) for points in self.schedules]
        total = sum(raw)
        if total <= 0:
            raise ConfigError(f"data.sources: every weight is 0 at step {step}; give some source a weight > 0 there")
        return [w / total for w in raw]

    def _at(self, step: int) -> Tuple[List[int], List[float], List[int]]:
        if step < self.first:
            raise ValueError(f"step {step} is before this mixture's first step {self.first + 1}")
        if step not in self._done and step < self._last:  # before the steps kept: replay from the start
            self._rewind()
        while self._last < step:
            taken, carry, _ = self._done[self._last]
            self._last += 1
            counts, carry = apportion(self.total, self.weights(self._last), carry)
            self._done[self._last] = ([t + c for t, c in zip(taken, counts)], carry, counts)
            self._done.pop(self._last - self.KEEP, None)
        return self._done[step]

    def counts(self, step: int) -> List[int]:
        """Each source's samples in step ``step`` (1 the first)."""
        if step <= self.first:
            raise ValueError(f"step {step} is before this mixture's first step {self.first + 1}")
        return self._at(step)[2]

    def taken(self, step: int) -> List[int]:
        """Each source's samples in steps 1..step (its position in its own stream after ``step``)."""
        return self._at(step)[0]

    def carry(self, step: int) -> List[float]:
        """Each source's carry after ``step``: what it is owed (above 0) or was given ahead (below)."""
        return list(self._at(step)[1])

    def state(self, step: int) -> Dict[str, Any]:
        """What a checkpoint at ``step`` holds of the blend: each source's position and carry, by name."""
        def named(values: Sequence[Any]) -> Dict[str, Any]:
            return dict(zip(self.names, values))

        taken, carry = self.taken(step), self.carry(step)
        # where this mixture's rounding started (step 0, or a resume that changed the blend): a resume of the same
        # blend replays from there
        first, taken0, carry0 = self.start
        start = {"step": first, "taken": named(taken0), "carry": named(carry0)}
        return {"step": step, "taken": named(taken), "carry": named(carry), "start": start}


# ----------------------------------------------------------------------------- the keys (validation's wing)

def sources_of(data: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """data.sources as name -> node, checked: each a node with a known kind and a weight."""
    sources = data.get("sources")
    require(isinstance(sources, Mapping) and len(sources) > 0, "data.sources", sources,
            "must name at least one source: data.sources={web:{kind:tokens,path:web.bin,weight:0.7},...}")
    out = {}
    for name, node in sources.items():
        key = f"data.sources.{name}"
        require(isinstance(name, str) and name.isidentifier(), key, name,
                "a source's name must be a plain identifier (letters, digits, _): it names its metrics")
        require(isinstance(node, Mapping), key, node, "must be a node with kind, weight and the kind's own keys")
        kind = node.get("kind")
        require(kind in KINDS, f"{key}.kind", kind, f"choose one of {list(KINDS)}")
        require("weight" in node, f"{key}.weight", None, "is missing: a number >= 0 or [[step, weight], ...]")
        parse_weight(node["weight"], f"{key}.weight")
        target = node.get("_target_")
        if kind == "custom":
            require(isinstance(target, str) and bool(target), f"{key}._target_", target,
                    "kind=custom needs _target_: an importable callable returning a map-style Dataset")
        else:
            require(target is None, f"{key}._target_", target, f"kind={kind} builds its own dataset; use "
                    "kind=custom to name a callable")
        for shared in SHARED_KEYS if kind != "custom" else ():  # a custom source's keys are all its own
            require(shared not in node, f"{key}.{shared}", node.get(shared),
                    f"is shared by every built-in source: set data.{shared}"
                    + (" (a batch mixes samples of one vocabulary and length)" if shared != "seed" else ""))
        out[name] = dict(node)
    return out


def check_blend(cfg: Config) -> None:
    """data=blend's keys, before anything is built: the sources, their weights, data.blend.*."""
    data = cfg.data
    if not is_blend(data):
        return
    sources = sources_of(data)
    opts = data.get("blend") or {}
    require(isinstance(opts, Mapping) and set(opts) <= {"allow_change"}, "data.blend", opts,
            "takes one key: allow_change")
    require(isinstance(opts.get("allow_change", False), bool), "data.blend.allow_change",
            opts.get("allow_change"), "must be true or false")
    require(not data.get("drop_last", False), "data.drop_last", True,
            "a blend's every step is a full global batch (each source wraps on its own): drop it")
    schedules = [parse_weight(node["weight"], f"data.sources.{name}.weight") for name, node in sources.items()]
    for step in sorted({s for points in schedules for s, _ in points}):
        require(sum(weight_at(p, step) for p in schedules) > 0, "data.sources.*.weight", f"all 0 at step {step}",
                "some source needs a weight > 0 at every step")


def check_blend_mesh(cfg: Config, mesh: MeshShape) -> None:
    """A blend's batches carry each row's source; pipeline stages and context parallelism cut batches their own
    way, which no test has run with a blend yet: refused rather than trusted."""
    if not is_blend(cfg.data):
        return
    for dim, size in (("pp", mesh.pp), ("cp", mesh.cp)):
        require(size == 1, f"dist.{dim}.size", size, f"is not supported with data=blend yet: set dist.{dim}.size=1")


def schedules_of(data: Mapping[str, Any]) -> Tuple[List[str], List[Points]]:
    sources = sources_of(data)
    return list(sources), [parse_weight(node["weight"], f"data.sources.{name}.weight")
                           for name, node in sources.items()]


def changed_key(saved: Mapping[str, Any], now: Mapping[str, Any]) -> Optional[Tuple[str, str]]:
    """The first key whose value differs between a checkpoint's blend (``describe``) and this run's, and how."""
    for name in list(saved) + [n for n in now if n not in saved]:
        if name not in now:
            return f"data.sources.{name}", "is in the checkpoint's blend and not in this run's"
        if name not in saved:
            return f"data.sources.{name}", "is new: the checkpoint's blend has no such source"
        was, now_ = saved[name], now[name]
        if was.get("kind") != now_.get("kind"):
            return f"data.sources.{name}.kind", f"was {was.get('kind')} in the checkpoint, now {now_.get('kind')}"
        if was.get("weight") != now_.get("weight"):
            return (f"data.sources.{name}.weight", f"was {was.get('weight')} in the checkpoint, now "
                    f"{now_.get('weight')}")
        if was.get("files") != now_.get("files"):  # a stream's files and what cuts them (streaming.identity)
            return (f"data.sources.{name}.files", "the stream's files (paths, sizes, modification times), its "
                    "tokenizer or its block size differ from the checkpoint's")
        if was.get("length") != now_.get("length"):
            return (f"data.sources.{name}", f"its data had {was.get('length')} samples in the checkpoint, now "
                    f"{now_.get('length')}")
    return None


# ----------------------------------------------------------------------------- plan mode's wing

def add_step(cfg: Config, plan: Any, model: Any, precision: Any, group: Dict[str, Any], counts: Dict[str, int]) -> None:
    """A blend's per-source loss and tokens ride the step's all-reduce: two float64 slots a source."""
    if is_blend(cfg.data):
        counts["step_allreduce_bytes"] += 2 * 8 * len(sources_of(cfg.data))


def taken_table(mixture: Mixture, max_steps: int) -> np.ndarray:
    """Each source's samples taken in steps 1..s, for s = 0..max_steps: one pass of the rounding."""
    return np.array([mixture.taken(s) for s in range(mixture.first, max_steps + 1)], dtype=np.int64)


def wrap_steps(taken: np.ndarray, length: int, first: int = 0) -> List[int]:
    """The steps at which a source of ``length`` samples starts a new epoch (takes sample ``e * length`` of its
    stream, e = 1, 2, ...), from its column of ``taken_table`` (row i: after step first + i)."""
    bounds = np.arange(length, int(taken[-1]), length)  # the epochs' first positions that the run reaches
    rows = np.searchsorted(taken, bounds, side="right")  # the first step that took position b: taken > b
    return sorted(set((rows + first).tolist()))


def plan_lines(mixture: Mixture, lengths: Sequence[int], kinds: Sequence[str], max_steps: int,
               show: int = 8) -> List[str]:
    """Each source's share per step, its epoch in steps and the steps at which it wraps, over the run."""
    lines = [f"  blend of {len(lengths)} sources, {mixture.total} samples a step (data.sources; counts exact each "
             f"step, order keyed by trainer.seed, step, source, index):"]
    table = taken_table(mixture, max_steps)
    steps = max(max_steps - mixture.first, 1)
    for k, name in enumerate(mixture.names):
        per_step = np.diff(table[:, k])
        total = int(per_step.sum())
        points = mixture.schedules[k]
        weight = (f"weight {points[0][1]:g}" if len(points) == 1 else
                  "weight " + " -> ".join(f"{w:g}@{s}" for s, w in points))
        low, high = (int(per_step.min()), int(per_step.max())) if per_step.size else (0, 0)
        share = f"{low}" if low == high else f"{low}-{high}"
        if lengths[k] >= STREAMED:
            lines.append(f"    {name} ({kinds[k]}, {NOT_KNOWN}): {weight}, {share} samples a step "
                         f"({total / steps:.2f} on average, {total:,} in {steps} steps); an epoch and its wraps: "
                         f"{NOT_KNOWN}")
            continue
        epoch = f"{lengths[k] * steps / total:.1f} steps" if total else "never reached"
        wraps = wrap_steps(table[:, k], lengths[k], mixture.first)
        wrap_text = ("never wraps" if not wraps else "wraps at steps " + ", ".join(map(str, wraps[:show]))
                     + (f", ... ({len(wraps)} in all)" if len(wraps) > show else ""))
        lines.append(f"    {name} ({kinds[k]}, {lengths[k]:,} samples): {weight}, {share} samples a step "
                     f"({total / steps:.2f} on average, {total:,} in {steps} steps); "
                     f"an epoch = {epoch}; {wrap_text}")
    return lines
