"""``data=hf_chat``: conversations, the loss on the answers only, padded or packed without cross-talk.

Input: local json/jsonl/parquet files, one conversation per record, either
``messages`` (a list of ``{"role", "content"}``, roles system, user and
assistant) or ``prompt`` and ``completion`` columns (a user turn and its
answer); ``data.messages_key``, ``data.prompt_key`` and ``data.completion_key``
name the columns.

Each conversation is rendered with the tokenizer's chat template (or the
default one, tokenizer.DEFAULT_CHAT_TEMPLATE). Where an assistant turn lies in
the rendered text is found by rendering the conversation up to that turn with
the generation prompt, and through it: the text between the two is the answer
(its content and the template's end of turn), everything else is prompt. Each
piece is tokenized on its own, so the trained tokens decode to exactly the
answers and all tokens to exactly the rendered text. Labels are -100 on the
prompt (``data.train_on=assistant``) and on each conversation's first token,
which nothing before it in the conversation predicts.

Samples: a conversation, padded to the micro-batch's longest (``collate``:
right padding, an attention mask, no loss on the padding); or with
``data.packing=true`` whole conversations packed in order into blocks of
``data.block_size`` tokens, with ``position_ids`` restarting at each
conversation. transformers then builds an attention mask that keeps every
token within its conversation (its packed-sequence detection, used when no
attention mask is given), so a packed block's summed loss is the sum of its
conversations' losses.

Tokenized once into the cache, like data=hf_text: ``<cache>/hf_chat/<key>``; or, with ``streaming``, as the run
reads (``streaming.ChatStream``: the same samples, no cache).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .. import distributed
from ..config import ConfigError
from .builtin import IGNORE_INDEX
from .hf_text import (OUTCOMES, Sources, agreed, build_cache, cache_root, check_common, files_key, load_table,
                      resolve_files)
from .prepare import held_out
from .tokenizer import TextTokenizer, load_tokenizer

log = logging.getLogger("dist_trainer")

ROLES = ("system", "user", "assistant")
TRAIN_ON = ("assistant", "all")
FORMATS = ("json", "parquet")
CACHE_VERSION = 1
BATCH_CONVERSATIONS = 500  # conversations per encode_batch call


@dataclass(frozen=True)
class Columns:
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"


def _records(path: Path, fmt: str, cache_dir: Path) -> Iterator[Tuple[str, Any]]:
    """(where, record) of each record. JSON is read as JSON (no column types inferred, exact line
    numbers): a jsonl file line by line, a .json file as a list of records (or one per line)."""
    if fmt == "parquet":
        table = load_table(path, fmt, cache_dir)
        for row, record in enumerate(table):
            yield f"{path} record {row + 1}", record
        return
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                records = json.load(f)
            except json.JSONDecodeError as err:
                raise ConfigError(f"data.files: {path} is not valid JSON ({err})") from err
            for row, record in enumerate(records):
                yield f"{path} record {row + 1}", record
            return
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"data.files: {path} line {line_no} is not valid JSON ({err})") from err
            yield f"{path} line {line_no}", record


def read_conversations(sources: Sources, columns: Columns, cache_dir: Path) -> Iterator[Tuple[str, List[dict]]]:
    """(where, messages) of every record, file by file, each checked: roles known, contents text."""
    for path, fmt in sources:
        for where, record in _records(path, fmt, cache_dir):
            if not isinstance(record, dict):
                raise ConfigError(f"data.files: {where}: a record must be an object with {columns.messages!r}, "
                                  f"or {columns.prompt!r} and {columns.completion!r}")
            if columns.messages in record:
                messages = record[columns.messages]
            elif columns.prompt in record and columns.completion in record:
                messages = [{"role": "user", "content": record[columns.prompt]},
                            {"role": "assistant", "content": record[columns.completion]}]
            else:
                raise ConfigError(f"data.files: {where} has neither {columns.messages!r} (data.messages_key) nor "
                                  f"{columns.prompt!r} and {columns.completion!r} (data.prompt_key, "
                                  f"data.completion_key); its keys: {', '.join(map(str, record))}")
            yield where, _checked(messages, where)


def _checked(messages: Any, where: str) -> List[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"data.files: {where}: a conversation must be a non-empty list of messages")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"data.files: {where}: each message needs a 'role' and a 'content'")
        if message["role"] not in ROLES:
            raise ConfigError(f"data.files: {where}: role {message['role']!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise ConfigError(f"data.files: {where}: a message's content must be text, not "
                              f"{type(message['content']).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatTemplate:
    """A chat template compiled once (Jinja, sandboxed, as transformers renders them)."""

    def __init__(self, source: str, tok: TextTokenizer):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        try:
            self.template = env.from_string(source)
        except TemplateError as err:
            raise ConfigError(f"data.chat_template: the template does not compile ({err})") from err
        self.names = {"eos_token": tok.token(tok.eos_id) or "", "bos_token": "",
                      "pad_token": tok.token(tok.pad_id) or ""}

    def render(self, messages: List[dict], add_generation_prompt: bool, where: str) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.names)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            raise ConfigError(f"data.chat_template: cannot render {where} ({type(err).__name__}: {err})") from err

    def pieces(self, messages: List[dict], where: str, train_on: str) -> List[Tuple[str, bool]]:
        """The rendered conversation as (text, trained) pieces, in order."""
        full = self.render(messages, False, where)
        if train_on == "all":
            return [(full, True)]
        pieces, done = [], 0
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = self.answer_span(messages, turn, full, done, where)
            pieces += [(full[done:start], False), (full[start:end], True)]
            done = end
        if not any(trained for _, trained in pieces):
            raise ConfigError(f"data.files: {where}: no assistant turn, so nothing to train on "
                              "(data.train_on=all trains on every token)")
        pieces.append((full[done:], False))
        return [(text, trained) for text, trained in pieces if text]

    def answer_span(self, messages: List[dict], turn: int, full: str, done: int, where: str,
                    remedy: str = "use data.chat_template=default, or data.train_on=all") -> Tuple[int, int]:
        """[start, end) of assistant turn ``turn`` in ``full`` (the conversation rendered): its content and the
        template's end of turn. Found by rendering up to the turn with the generation prompt, and through it;
        ``done``: where the previous answer ended (a template that rewrites earlier turns fails here)."""
        before = self.render(messages[:turn], True, where)
        through = self.render(messages[:turn + 1], False, where)
        if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
            raise ConfigError(f"data.chat_template: it does not render {where} turn by turn (the conversation "
                              f"up to turn {turn + 1} is not a prefix of the whole), so its answers cannot be "
                              f"located; {remedy}")
        return len(before), len(through)


def join(parts: List[Tuple[np.ndarray, bool]]) -> Tuple[np.ndarray, np.ndarray]:
    """One sequence's (ids, trained) from its pieces' (ids, trained), each piece tokenized on its own."""
    token_ids = np.concatenate([p for p, _ in parts]).astype(np.uint32)
    trained = np.concatenate([np.full(p.size, t, dtype=np.uint8) for p, t in parts])
    if trained.size:
        trained[0] = 0  # the first token: nothing in its conversation predicts it
    return token_ids, trained


def encode(tok: TextTokenizer, template: ChatTemplate, conversations: List[Tuple[str, List[dict]]],
           train_on: str) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(ids, trained) of each conversation: each piece tokenized on its own, so the split is exact."""
    pieces = [template.pieces(messages, where, train_on) for where, messages in conversations]
    flat = [text for conv in pieces for text, _ in conv]
    ids = iter(tok.encode_batch(flat))
    return [join([(next(ids), trained) for _, trained in conv]) for conv in pieces]


class Streams:
    """Tokenized sequences written one after another: ``out/<name>.ids`` (uint32), ``.trained`` (uint8) and, on
    ``close``, ``.offsets.npy`` (int64) for each name, the layout ``Conversations`` reads."""

    def __init__(self, out: Path, names: Sequence[str]):
        self.out = out
        self.files = {n: {kind: open(out / f"{n}.{kind}", "wb") for kind in ("ids", "trained")} for n in names}
        self.offsets: Dict[str, List[int]] = {n: [0] for n in names}

    def write(self, name: str, ids: np.ndarray, trained: np.ndarray) -> None:
        self.files[name]["ids"].write(ids.tobytes())
        self.files[name]["trained"].write(trained.tobytes())
        self.offsets[name].append(self.offsets[name][-1] + ids.size)

    def close(self) -> None:
        """Close every file (also after an error; ``save_offsets`` only once every sequence is written)."""
        for part in self.files.values():
            for f in part.values():
                f.close()

    def save_offsets(self) -> None:
        for name, offs in self.offsets.items():
            np.save(self.out / f"{name}.offsets.npy", np.asarray(offs, dtype=np.int64))


def write_in_batches(items: Iterator[Any], size: int, flush: Callable[[List[Any]], None]) -> None:
    """``flush`` each ``size`` items of ``items`` (the last batch shorter)."""
    batch: List[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            flush(batch)
            batch = []
    flush(batch)


def _write(out: Path, sources: Sources, tok: TextTokenizer, template: ChatTemplate, columns: Columns,
           train_on: str, max_length: int, val_fraction: float) -> Dict[str, Any]:
    """out/<split>.ids (uint32), .trained (uint8) and .offsets (int64) for train and val; returns their meta."""
    started = time.perf_counter()
    streams = Streams(out, ("train", "val"))
    counts = {s: {"conversations": 0, "tokens": 0, "trained_tokens": 0} for s in ("train", "val")}
    truncated = dropped = index = 0

    def flush(batch: List[Tuple[str, List[dict]]]) -> None:
        nonlocal truncated, dropped, index
        for ids, trained in encode(tok, template, batch, train_on):
            split = "val" if held_out(index, val_fraction) else "train"
            index += 1
            if ids.size > max_length:
                ids, trained, truncated = ids[:max_length], trained[:max_length], truncated + 1
            if not trained.any():
                dropped += 1
                continue
            streams.write(split, ids, trained)
            counts[split]["conversations"] += 1
            counts[split]["tokens"] += int(ids.size)
            counts[split]["trained_tokens"] += int(trained.sum())

    try:
        write_in_batches(read_conversations(sources, columns, out / "datasets"), BATCH_CONVERSATIONS, flush)
    finally:
        streams.close()
    streams.save_offsets()
    shutil.rmtree(out / "datasets", ignore_errors=True)  # datasets' arrow copies of parquet files
    return {"tokenizer": tok.spec, "vocab_size": tok.vocab_size, "inputs": [[str(p), f] for p, f in sources],
            "train_on": train_on, "max_length": max_length, "val_fraction": val_fraction, "truncated": truncated,
            "dropped": dropped, "seconds": time.perf_counter() - started, **counts}


def _cache_key(sources: Sources, tok: TextTokenizer, columns: Columns, train_on: str, max_length: int,
               val_fraction: float) -> str:
    return files_key(sources, tok, CACHE_VERSION, template=tok.chat_template,
                     columns=[columns.messages, columns.prompt, columns.completion], train_on=train_on,
                     max_length=max_length, val_fraction=float(val_fraction))


class Conversations(Dataset):
    """One conversation per sample: ``{"input_ids", "labels"}`` of its own length; ``collate`` pads."""

    def __init__(self, directory: Path, split: str, tok: TextTokenizer):
        self.directory, self.split, self.tokenizer = directory, split, tok
        self.vocab_size = tok.vocab_size
        self.offsets = np.load(directory / f"{split}.offsets.npy")
        self.pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id  # never attended to, never a label
        self._maps: Optional[Tuple[np.ndarray, np.ndarray]] = None

    def _arrays(self) -> Tuple[np.ndarray, np.ndarray]:
        if self._maps is None:  # opened in the process that reads (DataLoader workers open their own)
            self._maps = tuple(np.memmap(self.directory / f"{self.split}.{kind}", dtype=dtype, mode="r")
                               for kind, dtype in (("ids", np.uint32), ("trained", np.uint8)))
        return self._maps

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def conversation(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        ids, trained = self._arrays()
        start, end = self.offsets[index], self.offsets[index + 1]
        return np.asarray(ids[start:end], dtype=np.int64), np.asarray(trained[start:end], dtype=bool)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return conversation_sample(*self.conversation(int(index)))

    def collate(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return pad_collate(samples, self.pad_id)


def conversation_sample(ids: np.ndarray, trained: np.ndarray) -> Dict[str, torch.Tensor]:
    """One conversation's sample: its ids, and as labels those it trains on."""
    ids = ids.astype(np.int64)
    labels = np.where(trained.astype(bool), ids, IGNORE_INDEX)
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}


def pad_collate(samples: List[Dict[str, torch.Tensor]], pad_id: int) -> Dict[str, torch.Tensor]:
    """Right padding to the longest: the padding is never attended to and carries no loss."""
    longest = max(s["input_ids"].numel() for s in samples)
    batch = {"input_ids": torch.full((len(samples), longest), pad_id, dtype=torch.long),
             "labels": torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long),
             "attention_mask": torch.zeros((len(samples), longest), dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = sample["input_ids"].numel()
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["labels"][row, :n] = sample["labels"]
        batch["attention_mask"][row, :n] = 1
    return batch


def pack(lengths: np.ndarray, block_size: int) -> List[Tuple[int, int]]:
    """Conversations [first, last) of each block: whole conversations, in order, as many as fit."""
    blocks, first, used = [], 0, 0
    for index, length in enumerate(lengths.tolist()):
        if used + length > block_size and index > first:
            blocks.append((first, index))
            first, used = index, 0
        used += length
    if len(lengths) > first:
        blocks.append((first, len(lengths)))
    return blocks


class PackedConversations(Dataset):
    """Blocks of ``block_size`` tokens holding whole conversations; positions restart at each.

    No attention mask: transformers reads the restarting ``position_ids`` as
    packed sequences and keeps attention within each. The tail of a block is
    padding, a sequence of its own with no loss.
    """

    def __init__(self, conversations: Conversations, block_size: int):
        self.conversations, self.block_size = conversations, block_size
        self.tokenizer, self.vocab_size = conversations.tokenizer, conversations.vocab_size
        self.blocks = pack(conversations.lengths(), block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        first, last = self.blocks[int(index)]
        parts = [self.conversations.conversation(i) for i in range(first, last)]
        return packed_sample(parts, self.block_size, self.conversations.pad_id)


def packed_sample(parts: List[Tuple[np.ndarray, np.ndarray]], block_size: int, pad_id: int) -> Dict[str, torch.Tensor]:
    """Whole conversations' (ids, trained) in one block: positions restart at each; the tail is padding."""
    parts = [(i.astype(np.int64), t.astype(bool)) for i, t in parts]  # the cache's uint32 ids: signed labels
    ids = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([np.where(t, i, IGNORE_INDEX) for i, t in parts])
    positions = np.concatenate([np.arange(p[0].size) for p in parts])
    tail = block_size - ids.size
    block = {"input_ids": np.concatenate([ids, np.full(tail, pad_id)]),
             "labels": np.concatenate([labels, np.full(tail, IGNORE_INDEX)]),
             "position_ids": np.concatenate([positions, np.arange(tail)])}
    return {key: torch.from_numpy(value.astype(np.int64)) for key, value in block.items()}


def _check_args(files: Any, block_size: Any, max_length: Any, train_on: str, split: str, task: str,
                val_fraction: Any, format: Optional[str]) -> Tuple[List[str], int]:
    """Checks of the values alone: the same on every rank, so they may raise before any collective."""
    files = check_common(files, split, val_fraction)
    if format is not None and format not in FORMATS:
        raise ConfigError(f"data.format={format!r}: choose json or parquet, or null (from the extension)")
    if task != "causal_lm":
        raise ConfigError(f"data=hf_chat trains causal LMs; model.task={task} (use model=hf_causal_lm)")
    if train_on not in TRAIN_ON:
        raise ConfigError(f"data.train_on={train_on!r}: choose assistant (the answers) or all (every token)")
    return files, check_lengths(block_size, max_length)


def chat_sources(files: List[str], format: Optional[str]) -> Sources:
    """The files, resolved, each json, jsonl or parquet."""
    sources = resolve_files(files, format)
    for path, fmt in sources:
        if fmt not in FORMATS:
            raise ConfigError(f"data.files: {path} is {fmt}; conversations are read from json, jsonl or parquet")
    return sources


def check_lengths(block_size: Any, max_length: Any) -> int:
    """data.block_size and data.max_length (null: block_size); the longest sequence kept."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2:
        raise ConfigError(f"data.block_size={block_size!r}: must be an integer >= 2")
    max_length = block_size if max_length is None else max_length
    if not isinstance(max_length, int) or isinstance(max_length, bool) or not 2 <= max_length <= block_size:
        raise ConfigError(f"data.max_length={max_length!r}: must be an integer in [2, data.block_size={block_size}] "
                          "(null: data.block_size)")
    return max_length


def hf_chat(files: Sequence[str], block_size: int = 512, tokenizer: str = "bytes", chat_template: str = "auto",
            format: Optional[str] = None, messages_key: str = "messages", prompt_key: str = "prompt",
            completion_key: str = "completion", train_on: str = "assistant", max_length: Optional[int] = None,
            packing: bool = False, val_fraction: float = 0.0, split: str = "train", task: str = "causal_lm",
            cache_dir: Optional[str] = None, streaming: bool = False) -> Optional[Dataset]:
    """The ``data=hf_chat`` dataset of ``split``; None for val when nothing is held out. ``streaming``: tokenized
    as the run reads, each rank on its own (``streaming.ChatStream``)."""
    files, max_length = _check_args(files, block_size, max_length, train_on, split, task, val_fraction, format)
    if split == "val" and val_fraction == 0:
        return None
    columns = Columns(messages_key, prompt_key, completion_key)
    if streaming:
        from .streaming import ChatStream, StreamingDataset

        tok = load_tokenizer(tokenizer, chat_template=chat_template)
        return StreamingDataset(ChatStream(chat_sources(files, format), tok, block_size, ChatTemplate(
            tok.chat_template, tok), columns, train_on, max_length, packing))
    builds = distributed.local_rank() == 0  # one builder per node; the node's other ranks wait in agreed()

    def prepare() -> Tuple[TextTokenizer, Path]:
        tok = load_tokenizer(tokenizer, chat_template=chat_template)
        template = ChatTemplate(tok.chat_template, tok)
        sources = chat_sources(files, format)
        directory = cache_root(cache_dir) / "hf_chat" / _cache_key(sources, tok, columns, train_on, max_length,
                                                                  val_fraction)
        if builds:
            directory.parent.mkdir(parents=True, exist_ok=True)
            outcome = build_cache(directory, lambda tmp: _write(tmp, sources, tok, template, columns, train_on,
                                                                max_length, val_fraction))
            if split == "train":
                meta = json.loads((directory / "meta.json").read_text())
                log.info("hf_chat: %s the tokenized cache %s: %d conversations to train on (%d trained tokens of "
                         "%d), %d held out; %d cut to data.max_length=%d, %d dropped with no trained token left",
                         OUTCOMES[outcome], directory, meta["train"]["conversations"],
                         meta["train"]["trained_tokens"], meta["train"]["tokens"], meta["val"]["conversations"],
                         meta["truncated"], max_length, meta["dropped"])
        return tok, directory

    tok, directory = agreed(prepare)

    def open_split() -> Dataset:
        if not (directory / "meta.json").is_file():
            raise ConfigError(f"data.cache_dir: the tokenized cache {directory} is not there on this rank; the "
                              "ranks of a node must share it")
        data = Conversations(directory, split, tok)
        if len(data) == 0:
            raise ConfigError(f"data.files: the {split} split holds no conversation with a trained token")
        return PackedConversations(data, block_size) if packing else data

    return agreed(open_split)
