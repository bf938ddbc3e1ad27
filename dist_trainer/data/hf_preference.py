"""``data=hf_preference``: preference pairs for DPO, a prompt with a chosen and a rejected answer.

Input: local json/jsonl/parquet files, one pair per record, in TRL's preference
format (``data.prompt_key``, ``data.chosen_key`` and ``data.rejected_key`` name
the columns):

- all text: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``, the
  prompt a user turn, each answer the assistant's;
- conversational: ``prompt`` a list of ``{"role", "content"}`` messages (system,
  user and assistant turns, ending with a user turn), ``chosen`` and
  ``rejected`` each a list of one assistant message (or its text);
- implicit prompt: no ``prompt``; ``chosen`` and ``rejected`` whole
  conversations, the prompt their longest common start, what follows it on
  each side one assistant message.

Each side is the prompt and its answer rendered with the chat template, and
only that answer is trained: its content and the template's end of turn,
located as data=hf_chat locates an assistant turn (ChatTemplate.answer_span).
Earlier assistant turns inside the prompt are prompt. The prompt and the
answer are tokenized on their own, so the trained tokens decode to exactly the
rendered answer and both sides share the prompt's tokens, token for token.

A side longer than ``data.max_length`` is cut to it (its start kept); a pair
where a side has no trained token left is dropped. Tokenized once into the
cache, like data=hf_chat: ``<cache>/hf_preference/<key>``, each side of each
split stored as data=hf_chat stores conversations.

Samples: a pair, ``{"chosen_ids", "chosen_labels", "rejected_ids",
"rejected_labels"}``; ``collate`` makes B pairs one batch of 2B rows, the B
chosen first, then the B rejected in the same order, right-padded to the
longest row, with an attention mask and no loss on the padding. With the
reference's log-probabilities attached (``Pairs.with_reference``,
rl.reference=precomputed), a sample also holds ``ref_logps`` [2] and a batch
``ref_logps`` [2B] (float64, in an ``Exact``), in its rows' order.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import distributed
from ..config import ConfigError
from .builtin import IGNORE_INDEX
from .exact import Exact
from .hf_chat import (FORMATS, ChatTemplate, Conversations, Streams, _checked, _records, check_lengths, join,
                      write_in_batches)
from .hf_text import OUTCOMES, Sources, agreed, build_cache, cache_root, check_common, files_key, resolve_files
from .prepare import held_out
from .tokenizer import TextTokenizer, load_tokenizer

log = logging.getLogger("dist_trainer")

SIDES = ("chosen", "rejected")
CACHE_VERSION = 1
BATCH_PAIRS = 250  # pairs per encode_batch call (6 pieces each)

# A pair: (where, prompt messages, {side: its answer message}).
Pair = Tuple[str, List[dict], Dict[str, dict]]


@dataclass(frozen=True)
class Columns:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    def named(self, side: str) -> str:
        """The column and the key that names it, for errors: 'chosen' (data.chosen_key)."""
        return f"{getattr(self, side)!r} (data.{side}_key)"


def read_pairs(sources: Sources, columns: Columns, cache_dir: Path) -> Iterator[Pair]:
    """Every record's pair, file by file, each checked."""
    for path, fmt in sources:
        for where, record in _records(path, fmt, cache_dir):
            yield where, *_pair(record, columns, where)


def _pair(record: Any, columns: Columns, where: str) -> Tuple[List[dict], Dict[str, dict]]:
    if not isinstance(record, dict):
        raise ConfigError(f"data.files: {where}: a record must be an object with {columns.named('chosen')} and "
                          f"{columns.named('rejected')}, and {columns.named('prompt')} unless they share it")
    missing = [columns.named(side) for side in SIDES if getattr(columns, side) not in record]
    if missing:
        raise ConfigError(f"data.files: {where} has no {' nor '.join(missing)}; its keys: "
                          f"{', '.join(map(str, record))}")
    if columns.prompt not in record:
        return _implicit(record, columns, where)
    prompt = record[columns.prompt]
    if isinstance(prompt, str):  # all text: a user turn and two answers
        for side in SIDES:
            if not isinstance(record[getattr(columns, side)], str):
                raise ConfigError(f"data.files: {where}: {columns.named(side)} must be text, as the prompt is "
                                  "(an answer given as messages follows a prompt given as messages)")
        return ([{"role": "user", "content": prompt}],
                {side: {"role": "assistant", "content": record[getattr(columns, side)]} for side in SIDES})
    where_prompt = f"{where}, {columns.named('prompt')}"
    prompt = _prompt(_checked(prompt, where_prompt), where_prompt)
    return prompt, {side: _answer(record[getattr(columns, side)], f"{where}, {columns.named(side)}")
                    for side in SIDES}


def _prompt(messages: List[dict], where: str) -> List[dict]:
    if not messages or messages[-1]["role"] != "user":
        last = f"its last message's role is {messages[-1]['role']}" if messages else "it has no message"
        raise ConfigError(f"data.files: {where}: the prompt must end with a user turn ({last})")
    return messages


def _answer(value: Any, where: str) -> dict:
    """An answer: its text, or a list of one assistant message."""
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    messages = _checked(value, where)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ConfigError(f"data.files: {where}: an answer is one assistant message (or its text), not "
                          f"{', '.join(m['role'] for m in messages)}")
    return messages[0]


def _implicit(record: dict, columns: Columns, where: str) -> Tuple[List[dict], Dict[str, dict]]:
    """No prompt column: the prompt is what the two conversations share, each answer what follows it."""
    sides = {}
    for side in SIDES:
        value = record[getattr(columns, side)]
        if not isinstance(value, list):
            raise ConfigError(f"data.files: {where}: with no {columns.named('prompt')}, {columns.named(side)} must "
                              f"be a whole conversation (a list of messages), not {type(value).__name__}")
        sides[side] = _checked(value, f"{where}, {columns.named(side)}")
    chosen, rejected = sides["chosen"], sides["rejected"]
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    for side, messages in sides.items():
        rest = messages[shared:]
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            raise ConfigError(f"data.files: {where}: with no {columns.named('prompt')}, the prompt is the {shared} "
                              f"messages {columns.named('chosen')} and {columns.named('rejected')} start with; what "
                              f"follows them in {columns.named(side)} must be one assistant message, not "
                              f"{', '.join(m['role'] for m in rest) or 'nothing'}")
    where_shared = f"{where}, the start {columns.named('chosen')} and {columns.named('rejected')} share"
    return _prompt(chosen[:shared], where_shared), {side: messages[-1] for side, messages in sides.items()}


def _pieces(template: ChatTemplate, prompt: List[dict], answer: dict, where: str) -> List[Tuple[str, bool]]:
    """One side rendered as (prompt, False), (answer and end of turn, True), (what the template adds after, False)."""
    messages = prompt + [answer]
    full = template.render(messages, False, where)
    start, end = template.answer_span(messages, len(prompt), full, 0, where, remedy="use data.chat_template=default")
    return [(full[:start], False), (full[start:end], True), (full[end:], False)]


def encode(tok: TextTokenizer, template: ChatTemplate, columns: Columns,
           pairs: List[Pair]) -> List[Dict[str, Tuple[np.ndarray, np.ndarray]]]:
    """{side: (ids, trained)} of each pair: each piece tokenized on its own, so the split is exact."""
    pieces = [{side: _pieces(template, prompt, answers[side], f"{where}, {columns.named(side)}") for side in SIDES}
              for where, prompt, answers in pairs]
    flat = [text for pair in pieces for side in SIDES for text, _ in pair[side]]
    ids = iter(tok.encode_batch(flat))
    out = []
    for (where, _, _), pair in zip(pairs, pieces):
        parts = {side: [(next(ids), trained) for _, trained in pair[side]] for side in SIDES}
        # What DPO compares is the two answers after one prompt: a template that rendered the
        # prompt otherwise before one answer would compare two different contexts.
        if not np.array_equal(parts["chosen"][0][0], parts["rejected"][0][0]):
            raise ConfigError(f"data.chat_template: it renders the prompt of {where} differently before "
                              f"{columns.named('chosen')} and {columns.named('rejected')}; the two sides must "
                              "share the prompt's tokens (use data.chat_template=default)")
        out.append({side: join(parts[side]) for side in SIDES})
    return out


def _write(out: Path, sources: Sources, tok: TextTokenizer, template: ChatTemplate, columns: Columns,
           max_length: int, val_fraction: float) -> Dict[str, Any]:
    """out/<split>.<side>.ids (uint32), .trained (uint8) and .offsets.npy (int64): a side of a split is stored
    as data=hf_chat stores conversations, so Conversations reads it. Returns the meta."""
    started = time.perf_counter()
    streams = Streams(out, [f"{split}.{side}" for split in ("train", "val") for side in SIDES])
    counts = {split: {"pairs": 0, **{f"{side}_{what}": 0 for side in SIDES for what in ("tokens", "trained_tokens")}}
              for split in ("train", "val")}
    truncated = dropped = index = 0

    def flush(batch: List[Pair]) -> None:
        nonlocal truncated, dropped, index
        for sides in encode(tok, template, columns, batch):
            split = "val" if held_out(index, val_fraction) else "train"
            index += 1
            for side, (ids, trained) in sides.items():
                if ids.size > max_length:
                    sides[side], truncated = (ids[:max_length], trained[:max_length]), truncated + 1
            if not all(trained.any() for _, trained in sides.values()):
                dropped += 1  # a pair compares two answers: both must keep a trained token
                continue
            for side, (ids, trained) in sides.items():
                streams.write(f"{split}.{side}", ids, trained)
                counts[split][f"{side}_tokens"] += int(ids.size)
                counts[split][f"{side}_trained_tokens"] += int(trained.sum())
            counts[split]["pairs"] += 1

    try:
        write_in_batches(read_pairs(sources, columns, out / "datasets"), BATCH_PAIRS, flush)
    finally:
        streams.close()
    streams.save_offsets()
    shutil.rmtree(out / "datasets", ignore_errors=True)  # datasets' arrow copies of parquet files
    return {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "inputs": [[str(p), f] for p, f in sources],
            "columns": [columns.prompt, columns.chosen, columns.rejected], "max_length": max_length,
            "val_fraction": val_fraction, "truncated": truncated, "dropped": dropped,
            "seconds": time.perf_counter() - started, **counts}


def _cache_key(sources: Sources, tok: TextTokenizer, columns: Columns, max_length: int, val_fraction: float) -> str:
    return files_key(sources, tok, CACHE_VERSION, template=tok.chat_template,
                     columns=[columns.prompt, columns.chosen, columns.rejected], max_length=max_length,
                     val_fraction=float(val_fraction))


class Pairs(Dataset):
    """One preference pair per sample; ``collate`` makes one batch of the chosen rows, then the rejected rows."""

    pairs_per_sample = 1  # a sample is one pair: B samples collate to 2B rows
    ref_logps: Optional[np.ndarray] = None  # float64 [N, 2]: each pair's reference (chosen, rejected), if attached

    def __init__(self, directory: Path, split: str, tok: TextTokenizer):
        self.directory, self.split, self.tokenizer = directory, split, tok
        self.vocab_size = tok.vocab_size
        self.sides = {side: Conversations(directory, f"{split}.{side}", tok) for side in SIDES}
        self.pad_id = self.sides["chosen"].pad_id  # never attended to, never a label

    def __len__(self) -> int:
        return len(self.sides["chosen"])

    def lengths(self) -> np.ndarray:
        """Each pair's longer side, in tokens."""
        return np.maximum(self.sides["chosen"].lengths(), self.sides["rejected"].lengths())

    def pair(self, index: int) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """{side: (ids, trained)} of pair ``index``."""
        return {side: data.conversation(index) for side, data in self.sides.items()}

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        sample = {}
        for side, (ids, trained) in self.pair(int(index)).items():
            sample[f"{side}_ids"] = torch.from_numpy(ids)
            sample[f"{side}_labels"] = torch.from_numpy(np.where(trained, ids, IGNORE_INDEX))
        if self.ref_logps is not None:
            sample["ref_logps"] = torch.from_numpy(self.ref_logps[int(index)].copy())
        return sample

    def with_reference(self, values: np.ndarray) -> "Pairs":
        """These pairs with each one's reference log-probabilities (float64 [N, 2]: chosen, rejected), which its
        samples and batches then carry as ``ref_logps``."""
        if values.shape != (len(self), 2):
            raise ValueError(f"the {self.split} split's reference values are {values.shape}, not ({len(self)}, 2)")
        pairs = copy.copy(self)
        pairs.ref_logps = values
        return pairs

    def collate(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """B pairs -> ``input_ids``, ``attention_mask``, ``labels`` of [2B, L]: rows 0..B-1 the chosen answers,
        rows B..2B-1 the rejected ones in the same order; right padding to the longest of the 2B rows, never
        attended to (the mask is by position) and with no loss. ``ref_logps`` (attached values): [2B], the B chosen
        values, then the B rejected ones, as the rows."""
        rows = [{"input_ids": s[f"{side}_ids"], "labels": s[f"{side}_labels"]} for side in SIDES for s in samples]
        batch = self.sides["chosen"].collate(rows)
        if "ref_logps" in samples[0]:
            # [2, B]: rows; float64 kept as it is through an fsdp root's input cast (data/exact.py)
            batch["ref_logps"] = Exact(torch.stack([s["ref_logps"] for s in samples], dim=1).reshape(-1))
        return batch


def _check_args(files: Any, block_size: Any, max_length: Any, split: str, task: str, val_fraction: Any,
                format: Optional[str]) -> Tuple[List[str], int]:
    """Checks of the values alone: the same on every rank, so they may raise before any collective."""
    files = check_common(files, split, val_fraction)
    if format is not None and format not in FORMATS:
        raise ConfigError(f"data.format={format!r}: choose json or parquet, or null (from the extension)")
    if task != "causal_lm":
        raise ConfigError(f"data=hf_preference trains causal LMs; model.task={task} (use model=hf_causal_lm)")
    return files, check_lengths(block_size, max_length)


def hf_preference(files: Sequence[str], block_size: int = 512, tokenizer: str = "bytes", chat_template: str = "auto",
                  format: Optional[str] = None, prompt_key: str = "prompt", chosen_key: str = "chosen",
                  rejected_key: str = "rejected", max_length: Optional[int] = None, val_fraction: float = 0.0,
                  split: str = "train", task: str = "causal_lm", cache_dir: Optional[str] = None) -> Optional[Pairs]:
    """The ``data=hf_preference`` dataset of ``split``; None for val when nothing is held out."""
    files, max_length = _check_args(files, block_size, max_length, split, task, val_fraction, format)
    if split == "val" and val_fraction == 0:
        return None
    columns = Columns(prompt_key, chosen_key, rejected_key)
    builds = distributed.local_rank() == 0  # one builder per node; the node's other ranks wait in agreed()

    def prepare() -> Tuple[TextTokenizer, Path]:
        tok = load_tokenizer(tokenizer, chat_template=chat_template)
        template = ChatTemplate(tok.chat_template, tok)
        sources = resolve_files(files, format)
        for path, fmt in sources:
            if fmt not in FORMATS:
                raise ConfigError(f"data.files: {path} is {fmt}; preference pairs are read from json, jsonl or "
                                  "parquet")
        directory = cache_root(cache_dir) / "hf_preference" / _cache_key(sources, tok, columns, max_length,
                                                                         val_fraction)
        if builds:
            directory.parent.mkdir(parents=True, exist_ok=True)
            outcome = build_cache(directory, lambda tmp: _write(tmp, sources, tok, template, columns, max_length,
                                                                val_fraction))
            if split == "train":
                meta = json.loads((directory / "meta.json").read_text())
                train = meta["train"]
                log.info("hf_preference: %s the tokenized cache %s: %d pairs to train on (trained tokens: %d of %d "
                         "chosen, %d of %d rejected), %d held out; %d sides cut to data.max_length=%d, %d pairs "
                         "dropped with a side with no trained token left", OUTCOMES[outcome], directory,
                         train["pairs"], train["chosen_trained_tokens"], train["chosen_tokens"],
                         train["rejected_trained_tokens"], train["rejected_tokens"], meta["val"]["pairs"],
                         meta["truncated"], max_length, meta["dropped"])
        return tok, directory

    tok, directory = agreed(prepare)

    def open_split() -> Pairs:
        if not (directory / "meta.json").is_file():
            raise ConfigError(f"data.cache_dir: the tokenized cache {directory} is not there on this rank; the "
                              "ranks of a node must share it")
        data = Pairs(directory, split, tok)
        if len(data) == 0:
            raise ConfigError(f"data.files: the {split} split holds no pair with a trained token on both sides")
        return data

    return agreed(open_split)
