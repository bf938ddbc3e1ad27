"""``data.streaming=true``: ``hf_text`` and ``hf_chat`` tokenized as the run reads, one shard at a time, with
exact resume.

The stream. The shards are the resolved ``files``, each read with its kind's own reader (``hf_text``'s
documents, ``hf_chat``'s conversations), one file at a time. In the stream's epoch e the shards come in the
order of a permutation keyed by (seed, source name, "shards", e), and a shard's documents in the order of one
keyed by (seed, name, e, the shard's file index); in file order without ``shuffle``. Position p of the stream is
its p-th item counted over every epoch: epoch after epoch, no length known up front.

- ``TextStream`` (hf_text): each document tokenized as the prepared path does it (its ids, then end-of-text:
  ``prepare.write_token_files``), the epoch's documents concatenated; block b of the epoch is its tokens
  ``[b * T, (b + 1) * T + 1)``, ``TokenFile``'s sample b, the tail shorter than that dropped as ``TokenFile``
  drops it. Without shuffle every epoch's blocks are those of hf_text's cache of the same files.
- ``ChatStream`` (hf_chat): a conversation per item, or with packing a block of whole conversations, exactly as
  hf_chat's cache holds them; without shuffle every epoch's items are the cache's.

The state at an item's start, ``StreamState(epoch, shard, doc, offset)`` (the shard's place in the epoch's
order, the document's place in the shard's order, the token inside the document's ids and end-of-text; 0 for a
conversation), is all a reader needs to go on from there: a checkpoint holds it for each streaming source
(``BlendPlan``), and a resume seeks there directly, tokenizing nothing before it.

Reading (``StreamingDataset``): a thread tokenizes forward (the ``tokenizers`` library releases the GIL; the
bytes tokenizer is NumPy) into a window of items around the positions the rank asks for, ``hold`` behind the
highest and ``hold`` ahead; a position the window has dropped re-seeks from the nearest state kept (one every
``MARK`` items). Each rank reads the whole stream itself and keeps its own items: no rank waits for another, and
each tokenizes every item of the run (the cost, docs/data.md). The thread is the loader's worker: DataLoader
worker processes could not give a checkpoint the reader's state, so ``data.num_workers>0`` is refused.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from itertools import chain
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import Config, ConfigError, require
from .loader import SampleOrder, hash_key
from .mixture import STREAMED
from .prepare import batched, token_dtype, with_eos

TARGETS = ("dist_trainer.data.hf_text.hf_text", "dist_trainer.hf.text.hf_text")
CHAT_TARGETS = ("dist_trainer.data.hf_chat.hf_chat", "dist_trainer.hf.chat.hf_chat")
BATCH_DOCS, BATCH_CHARS = 256, 1_000_000  # tokenized in one call: small, so the first block comes soon
HOLD = 1024  # blocks kept behind the highest position asked, and read ahead of it (at least two steps' worth)
MARK = 256  # a state kept every MARK blocks, for a position the window has dropped
MARKS = 4096  # the most kept
_READING = threading.Lock()
JOIN_S = 10.0  # at exit, how long a reader may take to reach its next block and stop


class StreamState(NamedTuple):
    """Where a block starts: epoch, the shard's place in the epoch, the document's in the shard, the token in it."""

    epoch: int
    shard: int
    doc: int
    offset: int


class ShardedStream:
    """What every stream shares: its shards, their order in each epoch, and their documents' order.

    A stream kind gives ``read(shard_file, scratch)`` (a file's documents, in file order), ``blocks(position,
    state)`` (its items from a state on), ``sample(item)`` and ``sample_keys``; ``collate`` if it pads."""

    sample_keys: Tuple[str, ...] = ()

    def __init__(self, shards: Sequence[Tuple[Path, str]], tokenizer: Any, block_size: int):
        self.shards, self.tokenizer, self.block_size = list(shards), tokenizer, block_size
        self.seed, self.name, self.shuffle = 0, "stream", False  # the order's keys: BlendPlan's (keyed_by)
        self.vocab: Optional[Tuple[int, str]] = None  # (the model's vocabulary, the key naming the files)

    def check_ids(self, vocab_size: int, key: str) -> None:
        """Ids at or beyond ``vocab_size`` (the model's) are a ConfigError naming ``key``, found as they are read."""
        self.vocab = (vocab_size, key)

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        if self.vocab is not None and ids.size and int(ids.max()) >= self.vocab[0]:
            raise ConfigError(f"{self.vocab[1]}: token id {int(ids.max())} is beyond model.vocab_size="
                              f"{self.vocab[0]}: set model.vocab_size to the tokenizer's ({self.tokenizer.vocab_size})")
        return ids

    def read(self, shard: Tuple[Path, str], scratch: Path) -> List[Any]:
        raise NotImplementedError

    def options(self) -> Dict[str, Any]:
        """What, besides the files and the tokenizer, makes its items what they are (a resume compares them)."""
        return {"block_size": self.block_size}

    def identity(self) -> str:
        """sha256 of the shards (paths, sizes, modification times, formats), the tokenizer and ``options()``: a
        resume whose stream would read other items is refused (mixture.changed_key)."""
        from .hf_text import files_key

        return files_key(self.shards, self.tokenizer, 1, kind=type(self).__name__, **self.options())

    def shard_order(self, epoch: int) -> List[int]:
        """The files' indices in epoch ``epoch``'s order."""
        n = len(self.shards)
        key = hash_key(self.seed, self.name, "shards", epoch) if self.shuffle else None
        return SampleOrder(n, key)(np.arange(n)).tolist()

    def documents(self, epoch: int, shard: int) -> List[Any]:
        """The documents of the epoch's ``shard``-th shard, in their keyed order: one file in memory."""
        index = self.shard_order(epoch)[shard]
        scratch = Path(tempfile.mkdtemp(prefix="dist_trainer-stream-"))
        try:  # datasets' arrow copy of this one file, removed once read; one read at a time in a process, so
            with _READING:  # that datasets' progress-bar switch (load_table's) is not raced by another source's
                docs = self.read(self.shards[index], scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if self.shuffle and len(docs) > 1:
            order = SampleOrder(len(docs), hash_key(self.seed, self.name, epoch, index))(np.arange(len(docs)))
            docs = [docs[i] for i in order.tolist()]
        return docs


class TextStream(ShardedStream):
    """hf_text's stream: documents tokenized and concatenated, cut into TokenFile's blocks epoch by epoch."""

    sample_keys = ("input_ids", "targets")

    def __init__(self, shards: Sequence[Tuple[Path, str]], tokenizer: Any, block_size: int, text_key: str):
        super().__init__(shards, tokenizer, block_size)
        self.text_key = text_key
        self.dtype = token_dtype(tokenizer.vocab_size)

    def options(self) -> Dict[str, Any]:
        return {"block_size": self.block_size, "text_key": self.text_key}

    def read(self, shard: Tuple[Path, str], scratch: Path) -> List[str]:
        from .hf_text import read_documents

        return list(chain.from_iterable(read_documents([shard], self.text_key, scratch)))

    def sample(self, block: np.ndarray) -> Dict[str, torch.Tensor]:
        chunk = torch.from_numpy(block.astype(np.int64))
        return {"input_ids": chunk[:-1], "targets": chunk[1:]}

    def _batches(self, state: StreamState) -> Iterator[Tuple[int, int, np.ndarray, np.ndarray]]:
        """(shard, first document, ids, lengths) of the state's epoch from the state's document on, tokenized."""
        for shard in range(state.shard, len(self.shards)):
            docs = self.documents(state.epoch, shard)
            first = state.doc if shard == state.shard else 0
            for batch in batched(docs[first:], BATCH_DOCS, BATCH_CHARS):
                ids, lengths = self.tokenizer.encode_flat(batch)
                yield shard, first, ids, lengths
                first += len(batch)

    def blocks(self, position: int, state: StreamState) -> Iterator[Tuple[int, StreamState, np.ndarray]]:
        """(position, the state at its start, its T + 1 tokens) from ``state``, block ``position``, on."""
        need, eos = self.block_size + 1, self.tokenizer.eos_id
        while True:
            buf = np.zeros(0, dtype=self.dtype)  # the epoch's tokens not yet passed, from ``head``
            starts = np.zeros(0, dtype=np.int64)  # where each document's tokens begin in buf
            where: List[Tuple[int, int]] = []  # each one's (shard, doc)
            head, made = state.offset, 0
            for shard, first, ids, lengths in self._batches(state):
                tokens = self._checked(with_eos(ids, lengths, eos, self.dtype))
                keep = int(np.searchsorted(starts, head, side="right")) - 1 if starts.size else 0
                cut = int(starts[keep]) if starts.size else 0  # drop what is passed, the head's document kept
                starts = np.concatenate([starts[keep:] - cut, buf.size - cut + np.concatenate(
                    [[0], np.cumsum(lengths + 1)[:-1]])]).astype(np.int64)
                where = where[keep:] + [(shard, first + i) for i in range(lengths.size)]
                buf, head = np.concatenate([buf[cut:], tokens]), head - cut
                while buf.size - head >= need:
                    doc = int(np.searchsorted(starts, head, side="right")) - 1
                    at = StreamState(state.epoch, *where[doc], head - int(starts[doc]))
                    yield position, at, buf[head:head + need].copy()  # not a view holding the whole buf
                    position, head, made = position + 1, head + self.block_size, made + 1
            if made == 0 and state == StreamState(state.epoch, 0, 0, 0):
                raise ConfigError(f"data.block_size={self.block_size}: an epoch of data.files holds fewer tokens "
                                  f"than one sample (block_size + 1); lower data.block_size or add text")
            state = StreamState(state.epoch + 1, 0, 0, 0)  # the tail shorter than a block is dropped


class ChatStream(ShardedStream):
    """hf_chat's stream: item p is a conversation (padded by ``collate``), or with ``packing`` a block of whole
    conversations, packed greedily in the epoch's order as ``hf_chat.pack`` packs the cache (a block's state is
    its first conversation's: packing from there gives the same blocks). Cut to max_length, and dropped with no
    trained token left, as the cache does; an epoch ends with its last conversation (a packed tail is padded)."""

    def __init__(self, shards: Sequence[Tuple[Path, str]], tokenizer: Any, block_size: int, template: Any,
                 columns: Any, train_on: str, max_length: int, packing: bool):
        super().__init__(shards, tokenizer, block_size)
        self.template, self.columns, self.train_on = template, columns, train_on
        self.max_length, self.packing = max_length, packing
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.sample_keys = ("input_ids", "labels", "position_ids") if packing else ("input_ids", "labels")
        self.collate = None if packing else self._pad

    def options(self) -> Dict[str, Any]:
        return {"block_size": self.block_size, "template": self.tokenizer.chat_template,
                "columns": [self.columns.messages, self.columns.prompt, self.columns.completion], "train_on": self.train_on, "max_length": self.max_length,
                "packing": self.packing}

    def read(self, shard: Tuple[Path, str], scratch: Path) -> List[Any]:
        from .hf_chat import read_conversations

        return list(read_conversations([shard], self.columns, scratch))

    def _conversations(self, state: StreamState) -> Iterator[Tuple[StreamState, np.ndarray, np.ndarray]]:
        """(state, ids, trained) of each kept conversation of the state's epoch from its conversation on."""
        from .hf_chat import BATCH_CONVERSATIONS, encode

        for shard in range(state.shard, len(self.shards)):
            records = self.documents(state.epoch, shard)
            for first in range(state.doc if shard == state.shard else 0, len(records), BATCH_CONVERSATIONS):
                batch = records[first:first + BATCH_CONVERSATIONS]
                for doc, (ids, trained) in enumerate(encode(self.tokenizer, self.template, batch, self.train_on),
                                                     first):
                    ids, trained = self._checked(ids[:self.max_length]), trained[:self.max_length]
                    if trained.any():
                        yield StreamState(state.epoch, shard, doc, 0), ids, trained

    def blocks(self, position: int, state: StreamState) -> Iterator[Tuple[int, StreamState, List[Any]]]:
        while True:
            made, pending, used, at = 0, [], 0, state
            for here, ids, trained in self._conversations(state):
                if not self.packing or (pending and used + ids.size > self.block_size):
                    if pending:
                        yield position, at, pending
                        position, made, pending, used = position + 1, made + 1, [], 0
                if not pending:
                    at = here
                pending.append((ids, trained))
                used += ids.size
            if pending:
                yield position, at, pending
                position, made = position + 1, made + 1
            if made == 0 and state == StreamState(state.epoch, 0, 0, 0):
                raise ConfigError("data.files: no conversation with a trained token to stream")
            state = StreamState(state.epoch + 1, 0, 0, 0)

    def sample(self, parts: List[Tuple[np.ndarray, np.ndarray]]) -> Dict[str, torch.Tensor]:
        from .hf_chat import conversation_sample, packed_sample

        return packed_sample(parts, self.block_size, self.pad_id) if self.packing else conversation_sample(*parts[0])

    def _pad(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        from .hf_chat import pad_collate

        return pad_collate(samples, self.pad_id)


class StreamingDataset(Dataset):
    """Sample p: item p of the stream (``stream.sample`` of it), read by a thread of the rank."""

    streaming = True

    def __init__(self, stream: ShardedStream, hold: int = HOLD):
        self.stream, self.hold = stream, hold
        self.block_size, self.tokenizer = stream.block_size, stream.tokenizer
        self.vocab_size, self.sample_keys = stream.tokenizer.vocab_size, stream.sample_keys
        self.items_are_tokens = isinstance(stream, TextStream)  # a causal LM's blocks of tokens
        if getattr(stream, "collate", None) is not None:  # conversations of their own lengths: padded
            self.collate = stream.collate
        self._cond = threading.Condition()
        self._blocks: Dict[int, Tuple[StreamState, np.ndarray]] = {}
        self._marks: "OrderedDict[int, StreamState]" = OrderedDict({0: StreamState(0, 0, 0, 0)})
        self._start = (0, StreamState(0, 0, 0, 0))  # where the next reader begins
        self._asked = -1  # the highest position asked for (a re-read: the one that asked for it)
        self._next = 0  # the next position the reader gives
        self._reader: Optional[threading.Thread] = None
        self._generation = 0  # a reader of an older generation stops
        self._error: Optional[BaseException] = None
        _OPEN.add(self)

    def __len__(self) -> int:
        return STREAMED

    def __getitem__(self, position: int) -> Dict[str, torch.Tensor]:
        return self.stream.sample(self._block(int(position))[1])

    def state_at(self, position: int) -> StreamState:
        """The stream's state at block ``position``'s start (read up to it if need be): what a checkpoint holds."""
        return self._block(position)[0]

    def seek(self, position: int, state: Sequence[int]) -> None:
        """Go on from block ``position``, whose state is ``state`` (a checkpoint's): nothing before it is read."""
        at = StreamState(*map(int, state))
        with self._cond:
            self._marks[position] = at
            self._restart(position, at, asked=position)

    def keyed_by(self, name: str, seed: int, shuffle: bool, hold: int) -> None:
        """The order's keys (the source's name, trainer.seed, data.shuffle) and the window: set by the BlendPlan
        that reads the stream, before its first block."""
        with self._cond:
            if self._reader is not None and (name, seed, shuffle) != (self.stream.name, self.stream.seed,
                                                                        self.stream.shuffle):
                raise RuntimeError("a stream's order changed after it began to read")
            self.stream.name, self.stream.seed, self.stream.shuffle = name, seed, shuffle
            self.hold = max(self.hold, hold)

    def close(self) -> None:
        """Stop the reader (it ends at its next block): a thread left inside the tokenizer or pyarrow when the
        interpreter exits can abort it."""
        with self._cond:
            self._generation += 1
            reader, self._reader = self._reader, None
            self._cond.notify_all()
        if reader is not None and reader is not threading.current_thread():
            reader.join(JOIN_S)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("a streaming source's reader is a thread of its process: it cannot go to DataLoader "
                        "workers (data.num_workers=0 with data.streaming=true)")

    # ------------------------------------------------------------------ the window and its reader

    def _block(self, position: int) -> Tuple[StreamState, np.ndarray]:
        with self._cond:
            if position not in self._blocks and (self._reader is None or position < self._start[0]
                                                 or position < self._next):
                # before the window (or no reader yet): read again from the nearest state kept
                start = max((p for p in self._marks if p <= position), default=0)
                self._restart(start, self._marks.get(start, StreamState(0, 0, 0, 0)), asked=position)
            self._asked = max(self._asked, position)
            self._cond.notify_all()
            while position not in self._blocks:
                if self._error is not None:
                    raise self._error
                self._cond.wait()
            return self._blocks[position]

    def _restart(self, position: int, state: StreamState, asked: int) -> None:
        """A new reader from ``state`` (block ``position``); the old one stops at its next block. Under the lock."""
        self._generation += 1
        self._blocks.clear()
        self._start, self._next, self._asked, self._error = (position, state), position, asked, None
        self._reader = threading.Thread(target=self._read, args=(self._generation, position, state), daemon=True,
                                        name=f"stream-{self.stream.name}")
        self._reader.start()
        self._cond.notify_all()  # the old reader, if it waits, wakes to stop

    def _read(self, generation: int, position: int, state: StreamState) -> None:
        try:
            for p, at, block in self.stream.blocks(position, state):
                with self._cond:
                    while generation == self._generation and p > self._asked + self.hold:
                        self._cond.wait()  # far enough ahead: wait for the rank to ask further
                    if generation != self._generation:
                        return
                    self._blocks[p] = (at, block)  # positions in increasing order: the oldest first
                    self._next = p + 1
                    while self._blocks and next(iter(self._blocks)) < self._asked - self.hold:
                        del self._blocks[next(iter(self._blocks))]
                    if p % MARK == 0:
                        self._marks[p] = at
                        while len(self._marks) > MARKS:
                            self._marks.popitem(last=False)
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 (given to the rank that waits for a block)
            with self._cond:
                if generation == self._generation:
                    self._error = err
                    self._cond.notify_all()


_OPEN: "weakref.WeakSet[StreamingDataset]" = weakref.WeakSet()


@atexit.register
def close_all() -> None:
    """Every stream's reader stopped (at exit; after each test)."""
    for stream in list(_OPEN):
        stream.close()


# ----------------------------------------------------------------------------- the keys (validation's wing)

def streaming_nodes(data: Mapping[str, Any]) -> Dict[str, Mapping[str, Any]]:
    """The nodes that stream, by the key that names them: ``data``, or ``data.sources.NAME`` in a blend."""
    from .mixture import is_blend

    if not is_blend(data):
        return {"data": data} if data.get("streaming") else {}
    sources = data.get("sources") or {}
    return {f"data.sources.{n}": node for n, node in sources.items()
            if isinstance(node, Mapping) and node.get("streaming")}


def check_streaming(cfg: Config) -> None:
    """data.streaming (or a blend source's): hf_text and hf_chat; what needs the whole corpus up front is refused.
    (trainer.max_steps, which a stream needs, its epoch not known until read, is an integer in every run:
    check_trainer.)"""
    from .mixture import is_blend

    data = cfg.data
    if is_blend(data):
        require(data.get("streaming") in (None, False), "data.streaming", data.get("streaming"),
                "is a source's key in a blend: set data.sources.NAME.streaming=true on each hf_text source")
    for key, node in streaming_nodes(data).items():
        require(node.get("streaming") is True, f"{key}.streaming", node.get("streaming"), "must be true or false")
        target = node.get("_target_") if key == "data" else node.get("kind")
        require(target in TARGETS + CHAT_TARGETS + ("hf_text", "hf_chat"), f"{key}.streaming", True,
                "streams hf_text's and hf_chat's files only (data=tokens is already read as it goes)")
        fraction = node.get("val_fraction", 0.0)
        require(not fraction, f"{key}.val_fraction", fraction, "must be 0 with streaming: the held-out documents "
                "are chosen by their index in the whole corpus, which a stream does not know up front")
        task = data.get("task", "causal_lm")
        require(task == "causal_lm", "data.task", task, "streaming gives causal LM samples only (masked_lm's "
                "masks are keyed by an epoch of known length): set data.streaming=false")
    if streaming_nodes(data):
        workers = data.get("num_workers", 0)
        require(not (isinstance(workers, int) and workers > 0), "data.num_workers", workers,
                "must be 0 with streaming: the stream's reader is a thread of the rank (it tokenizes without the "
                "GIL), and only the rank's own reader knows the state a checkpoint records")
