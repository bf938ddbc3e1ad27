"""``data=blend``: several sources in every global batch, each exactly its share, in an order that no split moves.

The dataset (``Blend``) puts the sources end to end: sample ``offset_k + i`` is source k's sample i, with
``source`` (k) added to it, so a batch says where each row came from (the per-source metrics read it).

The order (``BlendPlan``, in place of ``loader.StepPlan``) is planned per optimizer step. ``mixture.Mixture``
says how many samples each source gives the step; source k's samples are the next ones of its own stream:
position p of the stream is sample ``SampleOrder(len_k, key(seed, k's name, epoch))(p % len_k)`` of epoch
``p // len_k``, so each source wraps to a new keyed permutation of its own when it runs out, whatever the others
do. The step's samples, source by source, are then shuffled by a permutation keyed by (seed, step), and sample
j goes to rank j % world as in ``StepPlan``: the set of a step's samples, and the sample at each position, are
functions of (seed, step, source, index), the same on any world size, any split into micro-batches and after
any resume. A step costs what its own samples cost: a resume at step s replays the counts (microseconds a
step), never the samples.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch.utils.data import Dataset, default_collate

from ..config import BatchPlan, Config, ConfigError
from .loader import SampleOrder, Window, hash_key
from .mixture import NOT_KNOWN, SOURCE_KEYS, TARGETS, Mixture, changed_key, schedules_of, sources_of


class Blend(Dataset):
    """The sources end to end, each sample with its ``source`` index."""

    def __init__(self, names: Sequence[str], datasets: Sequence[Dataset], kinds: Sequence[str],
                 standalone: bool = False):
        self.names, self.datasets, self.kinds = list(names), list(datasets), list(kinds)
        # data.streaming=true alone (hf_text, hf_chat): a blend of one, its samples as the source gives them (no source
        # column, no per-source figures), its order a BlendPlan's like any streaming source's
        self.standalone = standalone
        self.streams = [bool(getattr(d, "streaming", False)) for d in datasets]
        self.lengths = [len(d) for d in datasets]  # a stream's: STREAMED, its positions not known until read
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self._starts = self.offsets.tolist()  # plain ints: bisect on a handful is faster than numpy
        self._ids = [torch.tensor(k, dtype=torch.long) for k in range(len(datasets))]  # never written to
        first = datasets[0]
        for attr in ("block_size", "vocab_size", "tokenizer", "items_are_tokens"):
            if hasattr(first, attr):
                setattr(self, attr, getattr(first, attr))
        own = [d for d in datasets if getattr(d, "collate", None) is not None]
        self._collate = own[0].collate if own else default_collate

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, index: int) -> int:
        return bisect.bisect_right(self._starts, index) - 1

    def __getitem__(self, index: int) -> Dict[str, Any]:
        k = self.source_of(index)
        sample = self.datasets[k][index - self._starts[k]]
        if self.standalone:
            return sample
        if not isinstance(sample, Mapping):
            raise TypeError(f"data.sources.{self.names[k]}: a blend's samples are dicts of tensors "
                            f"(got {type(sample).__name__})")
        return {**sample, "source": self._ids[k]}

    def collate(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        if self.standalone:
            return self._collate(samples)
        source = torch.stack([s["source"] for s in samples])
        batch = self._collate([{k: v for k, v in s.items() if k != "source"} for s in samples])
        return {**batch, "source": source}

    def close(self) -> None:
        """Stop the streaming sources' readers (the run is over)."""
        for dataset, stream in zip(self.datasets, self.streams):
            if stream:
                dataset.close()

    def describe(self) -> Dict[str, Dict[str, Any]]:
        """What a checkpoint records of the sources: a resume compares it with its own (mixture.changed_key)."""
        return {name: {"kind": kind, "length": length} if not stream else
                {"kind": kind, "length": NOT_KNOWN, "files": dataset.stream.identity()}
                for name, kind, length, stream, dataset
                in zip(self.names, self.kinds, self.lengths, self.streams, self.datasets)}


def _source_key(name: str) -> Callable[[str], str]:
    """A source's own error messages name its keys under data.sources.NAME (the shared ones stay data.X)."""
    def rename(message: str) -> str:
        return re.sub(r"\bdata\.(?!sources\.|block_size\b|tokenizer\b|vocab_size\b)(\w+)",
                      rf"data.sources.{name}.\1", message)
    return rename


def _build_source(name: str, node: Dict[str, Any], shared: Dict[str, Any], split: str) -> Optional[Dataset]:
    """Source ``name``'s dataset of ``split``; for val, None where it holds nothing out (a custom source is asked
    for val only if its node has a ``split`` key, as data=custom is)."""
    kind = node["kind"]
    target = node["_target_"] if kind == "custom" else TARGETS[kind]
    kwargs = {k: v for k, v in node.items() if k not in SOURCE_KEYS}
    if kind != "custom" or "split" in node:
        kwargs["split"] = split
    elif split == "val":
        return None
    if kind == "tokens":
        kwargs.update({k: shared[k] for k in ("block_size", "vocab_size") if k in shared})
    elif kind in ("hf_text", "hf_chat"):
        kwargs.update({k: shared[k] for k in ("block_size", "tokenizer", "task") if k in shared})
        if kind == "hf_text" and "seed" in shared:
            kwargs["seed"] = shared["seed"]
    try:
        dataset = instantiate({"_target_": target}, **kwargs, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise ConfigError(_source_key(name)(str(cause))) from None
        raise ConfigError(f"data.sources.{name}: {cause or err}") from err
    except ConfigError as err:
        raise ConfigError(_source_key(name)(str(err))) from None
    if dataset is None and split == "val":
        return None
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(f"data.sources.{name}: kind={kind} gave no map-style Dataset")
    if len(dataset) < 1:
        raise ConfigError(f"data.sources.{name}: the source has no sample")
    return dataset


def _vocabulary(dataset: Dataset) -> tuple:
    """(tokenizer, vocabulary size) as the source knows them; None where it does not say."""
    tok = getattr(dataset, "tokenizer", None)
    spec = getattr(tok, "spec", None)
    size = getattr(dataset, "vocab_size", None)
    path = getattr(dataset, "path", None)
    if path is not None and (spec is None or size is None):  # a token file: its meta.json, if any
        from .tokens import read_meta
        meta = read_meta(path)
        spec, size = spec or meta.get("tokenizer"), size or meta.get("vocab_size")
    return spec, size


def _check_vocabularies(names: Sequence[str], datasets: Sequence[Dataset], model_vocab: Optional[int]) -> None:
    """One tokenizer and one vocabulary size among the sources that say theirs; ids within the model's vocabulary
    (``data.vocab_size``, the model's: sampled, as data=tokens checks its file)."""
    known = [(name, *_vocabulary(d)) for name, d in zip(names, datasets)]
    for i, what in ((1, "tokenizer"), (2, "vocabulary size")):
        seen = [(k[0], k[i]) for k in known if k[i] is not None]
        if len({v for _, v in seen}) > 1:
            listing = ", ".join(f"{n}: {v}" for n, v in seen)
            raise ConfigError(f"data.sources: the sources' {what}s differ ({listing}); a blend shares one "
                              "vocabulary: tokenize every source with data.tokenizer")
    if model_vocab is None:
        return
    from .tokens import TokenFile

    for name, dataset in zip(names, datasets):  # token files check their ids as they open; text tokenized here too
        if isinstance(dataset, TokenFile) and type(dataset) is not TokenFile:
            dataset._check_vocab(int(model_vocab), f"data.sources.{name}.files")
        elif getattr(dataset, "streaming", False):  # a stream: each batch of ids as it is tokenized
            dataset.stream.check_ids(int(model_vocab), f"data.sources.{name}.files")


def blend(sources: Dict[str, Any], block_size: int, tokenizer: str = "bytes", vocab_size: Optional[int] = None,
          task: str = "causal_lm", seed: int = 0, blend: Optional[Dict[str, Any]] = None,
          split: str = "train") -> Optional[Blend]:
    """The ``data=blend`` dataset: every source built with the shared keys, their vocabularies compared.

    ``blend`` (data.blend.*) is the loader's and the resume's, read from the config there. ``split=val``: the
    sources that hold data out (a token source's ``val_path``, a text source's ``val_fraction``), each evaluated on
    its own (``eval_loss.NAME``); None if none does."""
    shared = {"block_size": block_size, "tokenizer": tokenizer, "vocab_size": vocab_size, "task": task, "seed": seed}
    nodes = sources_of({"sources": sources})
    built = {name: _build_source(name, node, shared, split) for name, node in nodes.items()}
    nodes = {name: node for name, node in nodes.items() if built[name] is not None}
    if not nodes:
        return None
    names, datasets = list(nodes), [built[name] for name in nodes]
    _check_vocabularies(names, datasets, vocab_size)
    # a stream's keys as it declares them: its first block is read when the run asks (a resume never reads it)
    keys = [set(d.sample_keys) if getattr(d, "streaming", False) else set(d[0]) if isinstance(d[0], Mapping)
            else None for d in datasets]
    for name, k in zip(names[1:], keys[1:]):
        if k != keys[0]:
            raise ConfigError(f"data.sources.{name}: its samples hold {sorted(k or [])}, the first source's "
                              f"({names[0]}) {sorted(keys[0] or [])}: a batch mixes only samples of one form")
    return Blend(names, datasets, [node["kind"] for node in nodes.values()])


class BlendPlan:
    """``StepPlan``'s part for a blend: which samples each rank uses in each micro-batch of each optimizer step.

    There are no epochs of the whole: ``windows(0, start)`` runs from global step ``start`` to the run's last
    (each source has epochs of its own, ``source_epoch``)."""

    def __init__(self, blend_set: Blend, mixture: Mixture, plan: BatchPlan, rank: int, seed: int, shuffle: bool,
                 allow_change: bool):
        self.blend, self.mixture, self.plan, self.rank = blend_set, mixture, plan, rank
        self.seed, self.shuffle, self.allow_change = seed, shuffle, allow_change
        self.num_samples = len(blend_set)
        for name, dataset, stream in zip(blend_set.names, blend_set.datasets, blend_set.streams):
            if stream:  # its order is keyed like the others' (seed, its name); its window holds two steps at least
                dataset.keyed_by(name, seed, shuffle, 2 * plan.global_batch_size)
        self.drop_last = False
        # The last steps' samples and the sources' epochs in use: the sampler and the loop both ask for a step's
        # window, and a source's epoch serves many steps.
        self._steps: Dict[int, np.ndarray] = {}
        self._orders: Dict[tuple, SampleOrder] = {}

    @classmethod
    def for_config(cls, blend_set: Blend, cfg: Config, plan: BatchPlan, rank: int) -> "BlendPlan":
        if blend_set.standalone:  # data.streaming=true alone: one source, every sample of every step
            names, schedules = blend_set.names, [[(1, 1.0)]]
        else:
            names, schedules = schedules_of(cfg.data)
        mixture = Mixture(names, schedules, plan.global_batch_size)
        return cls(blend_set, mixture, plan, rank, cfg.trainer.seed, cfg.data.get("shuffle", True),
                   bool((cfg.data.get("blend") or {}).get("allow_change", False)))

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.max_steps  # the run: a blend's "epoch" (position.epoch stays 0)

    def micro_batches(self, step: int) -> int:
        return self.plan.accum_steps  # every step is a full global batch

    def source_epoch(self, k: int, epoch: int) -> SampleOrder:
        """Source k's order in its own epoch ``epoch``: keyed by (seed, its name, epoch)."""
        order = self._orders.get((k, epoch))
        if order is None:
            if len(self._orders) > 4 * len(self.blend.names):
                self._orders.clear()
            key = hash_key(self.seed, "blend", self.blend.names[k], epoch) if self.shuffle else None
            order = self._orders[(k, epoch)] = SampleOrder(self.blend.lengths[k], key)
        return order

    def step_samples(self, step: int) -> np.ndarray:
        """The global batch of optimizer step ``step`` (1 the first): blend indices, position by position."""
        if step not in self._steps:
            if len(self._steps) >= 8:
                self._steps.pop(min(self._steps))
            self._steps[step] = self._step_samples(step)
        return self._steps[step]

    def _step_samples(self, step: int) -> np.ndarray:
        counts, taken = self.mixture.counts(step), self.mixture.taken(step - 1)
        parts = []
        for k, (count, before) in enumerate(zip(counts, taken)):
            if not count:
                continue
            n = self.blend.lengths[k]
            positions = np.arange(before, before + count, dtype=np.int64)
            if self.blend.streams[k]:  # a stream's position p is its block p, epochs its own (streaming.py)
                parts.append(positions + self.blend.offsets[k])
                continue
            epochs = positions // n
            indices = np.empty(count, dtype=np.int64)
            for epoch in np.unique(epochs).tolist():  # a source that wraps inside the step: two epochs' orders
                where = epochs == epoch
                indices[where] = self.source_epoch(k, epoch)(positions[where] % n)
            parts.append(indices + self.blend.offsets[k])
        samples = np.concatenate(parts)
        if self.shuffle:  # sources interleaved, keyed by (seed, step): each rank's share mixes them
            samples = samples[SampleOrder(len(samples), hash_key(self.seed, "blend-step", step))(
                np.arange(len(samples)))]
        return samples

    def windows(self, epoch: int, start_step: int = 0) -> Iterator[Window]:
        """This rank's windows from optimizer step ``start_step`` (done) on, each computed when asked."""
        world, micro = self.plan.data_ranks, self.plan.micro_batch_size
        for done in range(start_step, self.steps_per_epoch):
            mine = self.step_samples(done + 1)[self.rank::world].tolist()  # sample j of a step to rank j % world
            yield [mine[i * micro:(i + 1) * micro] for i in range(self.plan.accum_steps)]

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self, step: int) -> Dict[str, Any]:
        """The blend as this run has it, and each source's position after ``step`` (also derivable from the
        step: ``resume_from`` checks that they agree)."""
        state = self.mixture.state(step)
        # a stream's state at its position after the step: a resume seeks there, tokenizing nothing before it
        streams = {name: {"position": state["taken"][name], "state": list(dataset.state_at(state["taken"][name]))}
                   for name, dataset, stream in zip(self.blend.names, self.blend.datasets, self.blend.streams)
                   if stream}
        return {"sources": self.describe(), **state, "streams": streams}

    def describe_sources(self) -> str:
        """Each source and its samples, for the start-up line: ``web (40 samples), text (streamed: ...)``."""
        return ", ".join(f"{name} ({NOT_KNOWN if stream else f'{length} samples'})" for name, length, stream
                         in zip(self.blend.names, self.blend.lengths, self.blend.streams))

    def describe(self) -> Dict[str, Dict[str, Any]]:
        weights = dict(zip(self.mixture.names, self.mixture.schedules))
        return {name: {**value, "weight": [list(p) for p in weights[name]]}
                for name, value in self.blend.describe().items()}

    def resume_from(self, saved: Optional[Dict[str, Any]], step: int) -> None:
        """Continue after ``step`` of a checkpoint whose blend state is ``saved``: the same blend, checked; a
        changed one refused naming the key, unless data.blend.allow_change=true (then from the saved positions)."""
        now = self.describe()
        if saved is None:
            change = ("data.sources", "the checkpoint was not written by a data=blend run")
        else:
            change = changed_key(saved["sources"], now)
        if change is None:  # the same blend: its rounding from where the checkpoint's started, checked
            names, start = self.mixture.names, saved["start"]
            self.mixture = Mixture(names, self.mixture.schedules, self.mixture.total,
                                   (start["step"], [start["taken"][n] for n in names],
                                    [start["carry"][n] for n in names]))
            derived = self.mixture.state(step)
            if derived["taken"] != saved["taken"]:
                raise RuntimeError(f"step {step}: the blend's positions derived from the step {derived['taken']} "
                                   f"differ from the checkpoint's {saved['taken']}")
            self._seek_streams(saved, now)
            return
        key, why = change
        if self.blend.standalone:  # data.streaming=true alone: its files are data.files
            raise ConfigError(f"data.files: {why}. A resume reads the stream its checkpoint read: give the same "
                              "files (and tokenizer, data.block_size), or start a new run")
        if not self.allow_change:
            raise ConfigError(f"{key}: {why}. A resume keeps the checkpoint's blend; set "
                              "data.blend.allow_change=true to continue from this step with the new one")
        taken = [(saved or {}).get("taken", {}).get(n, 0) for n in self.mixture.names]
        # The new mixture's rounding starts afresh (carries 0); each kept source goes on from its position.
        self.mixture = Mixture(self.mixture.names, self.mixture.schedules, self.mixture.total,
                               (step, taken, [0.0] * len(taken)))
        self._seek_streams(saved or {}, now)

    def _seek_streams(self, saved: Dict[str, Any], now: Dict[str, Dict[str, Any]]) -> None:
        """Each streaming source to its saved state, at its saved position (a new one starts at its beginning; one
        whose files changed, under data.blend.allow_change, reads its new files from their beginning on from there).
        ``now``: this run's ``describe()``."""
        streams, before = saved.get("streams", {}), saved.get("sources", {})
        for name, dataset, stream in zip(self.blend.names, self.blend.datasets, self.blend.streams):
            if stream and name in streams and streams[name]["position"] == saved["taken"].get(name):
                same = before.get(name, {}).get("files") == now[name]["files"]
                dataset.seek(streams[name]["position"], streams[name]["state"] if same else (0, 0, 0, 0))


def plan_for(train_set: Dataset, cfg: Config, plan: BatchPlan, rank: int) -> Any:
    """The training order of ``train_set``: a blend's ``BlendPlan``, else ``StepPlan``."""
    from .loader import StepPlan

    if isinstance(train_set, Blend):
        return BlendPlan.for_config(train_set, cfg, plan, rank)
    return StepPlan.for_config(len(train_set), cfg, plan, rank)


# ------------------------------------------------------------------ the step's figures per source

class NoSources:
    """Not a blend: the step's all-reduce carries nothing more."""

    def begin_step(self, device: torch.device) -> None:
        pass

    def add(self, output: Any, batch: Any, counted: bool) -> None:
        pass

    def slots(self) -> int:
        return 0

    def local_stats(self, share: float) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.float64)

    def take_totals(self, values: Sequence[float]) -> Dict[str, Any]:
        return {}


class SourceFigures(NoSources):
    """Per source, the step's summed loss and its tokens (``source_loss.NAME``, ``source_tokens.NAME``): sums over
    every counted micro-batch of this rank, summed over ranks in the step's one all-reduce, the loss divided by
    the source's tokens of the whole step (token-weighted; never a mean of micro-batch means).

    The tokens are the rows' counted targets (``targets``, or ``labels`` past the first position); the loss needs
    the model's per-row sums (``sample_loss_sum``: the built-in GPT gives them for a blend's batch), and is left
    out where the model gives none."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.has_loss = False
        self._sums = torch.zeros(2 * len(self.names), dtype=torch.float64)

    def begin_step(self, device: torch.device) -> None:
        self._sums = torch.zeros(2 * len(self.names), dtype=torch.float64, device=device)

    def add(self, output: Any, batch: Any, counted: bool) -> None:
        if not counted or not isinstance(batch, Mapping) or "source" not in batch:
            return  # a placeholder micro-batch counts nowhere
        source = batch["source"].to(self._sums.device)
        n = len(self.names)
        rows = output.get("sample_items") if isinstance(output, Mapping) else None
        if rows is None:
            rows = _row_tokens(batch)
        self._sums[n:].index_add_(0, source, rows.detach().to(self._sums))
        losses = output.get("sample_loss_sum") if isinstance(output, Mapping) else None
        if losses is not None:
            self.has_loss = True
            self._sums[:n].index_add_(0, source, losses.detach().to(self._sums))

    def slots(self) -> int:
        return 2 * len(self.names)

    def local_stats(self, share: float) -> torch.Tensor:
        return self._sums * share

    def take_totals(self, values: Sequence[float]) -> Dict[str, Any]:
        n = len(self.names)
        figures: Dict[str, Any] = {f"source_tokens.{name}": int(values[n + k]) for k, name in enumerate(self.names)}
        if self.has_loss:
            figures.update({f"source_loss.{name}": (values[k] / values[n + k] if values[n + k] > 0 else None)
                            for k, name in enumerate(self.names)})
        return figures


def _row_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each row's counted targets, from the batch alone."""
    from .builtin import IGNORE_INDEX

    if "targets" in batch:
        return (batch["targets"] != IGNORE_INDEX).sum(dim=1)
    if "labels" in batch:  # a causal LM's labels: position t's label is predicted from t - 1
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    return torch.ones(batch["source"].shape[0], dtype=torch.long)


def source_figures(train_set: Dataset) -> NoSources:
    """The step's per-source figures for ``train_set`` (none unless it is a blend)."""
    return SourceFigures(train_set.names) if isinstance(train_set, Blend) and not train_set.standalone \
        else NoSources()
