"""``data=hf_text``: local text files read with Hugging Face ``datasets``, tokenized once, memory-mapped.

Formats: ``text`` (a document per paragraph), ``json`` (json, jsonl),
``parquet``, ``csv``; ``data.text_key`` names the column. Each document is
tokenized (``TextTokenizer.encode_text``: the text of a special token is text)
and followed by end-of-text, into token files written as prepare.py writes them
(train.bin, val.bin, meta.json), documents held out by a hash of their index.
These are a cache, ``<cache>/hf_text/<sha256 of the files' paths, sizes and
mtimes, the tokenizer, formats, text_key, val_fraction>``. Under
torch.distributed each node's local rank 0 builds it while the node's other
ranks wait in a collective (within the group's timeout, dist.timeout_s); every
rank then learns whether any failed, so a bad input is one ConfigError
everywhere, not a hang. Items: causal_lm as TokenFile's; masked_lm
``{"input_ids", "labels"}`` masked by (seed, epoch, index).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from .. import distributed
from ..config import ConfigError
from .builtin import IGNORE_INDEX
from .loader import hash_key
from .prepare import BATCH_DOCS, write_token_files
from .tokenizer import TextTokenizer, load_tokenizer
from .tokens import TokenFile

log = logging.getLogger("dist_trainer")
T = TypeVar("T")
Sources = List[Tuple[Path, str]]  # each input file, resolved, with its format

FORMATS = ("text", "json", "parquet", "csv")
EXTENSIONS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# A text file's document is a paragraph; a csv's "NA" or "null" is text, not a missing value.
EXTRA = {"text": {"sample_by": "paragraph"}, "csv": {"na_filter": False}}
TASKS = ("causal_lm", "masked_lm")
# Part of the key: a change to the files' layout or to their ids builds new caches.
# 2: the text of a special token inside a document is text (it was the special id).
CACHE_VERSION = 2
OUTCOMES = {"reused": "reused", "written": "wrote", "theirs": "another process wrote first; using"}  # build_cache's


@dataclass(frozen=True)
class Names:
    """The option each error names: config keys here, command-line flags in the tokenizer CLI."""

    files: str = "data.files"
    format: str = "data.format"
    text_key: str = "data.text_key"


def resolve_files(files: Sequence[str], format: Optional[str], names: Names = Names()) -> Sources:
    """Each file, resolved, with its format (``format``, or from its extension)."""
    if format is not None and format not in FORMATS:
        raise ConfigError(f"{names.format}={format!r}: choose one of {', '.join(FORMATS)}, or null (from the extension)")
    sources = []
    for name in files:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"{names.files}: {name}: no such file")
        fmt = format or EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise ConfigError(f"{names.format}=null: the format of {name} is not known from its extension; "
                              f"set {names.format} to one of {', '.join(FORMATS)}")
        sources.append((path, fmt))
    return sources


def load_table(path: Path, fmt: str, cache_dir: Path, names: Names = Names()) -> Any:
    """One file as a datasets table; a malformed file is a ConfigError naming it."""
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # ours counts documents; theirs would add one bar per file
    try:
        extra = EXTRA.get(fmt, {})
        return datasets.load_dataset(fmt, data_files=[str(path)], split="train", cache_dir=str(cache_dir), **extra)
    except Exception as err:  # each builder raises its own kinds for a malformed file
        raise ConfigError(f"{names.files}: {path} cannot be read as {fmt} ({type(err).__name__}: {err})") from err
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def read_documents(sources: Sources, text_key: str, cache_dir: Path,
                   names: Names = Names()) -> Iterator[List[str]]:
    """Batches of non-empty documents, file by file, in order."""
    for path, fmt in sources:
        table = load_table(path, fmt, cache_dir, names)
        column = "text" if fmt == "text" else text_key
        if column not in table.column_names:
            raise ConfigError(f"{names.text_key}={text_key!r}: {path} has no such column "
                              f"(its columns: {', '.join(table.column_names)})")
        for batch in table.iter(batch_size=BATCH_DOCS):
            # A paragraph keeps no newline of the blank lines around it; nulls are no document.
            docs = ["" if v is None else (v.strip("\n") if fmt == "text" else str(v)) for v in batch[column]]
            yield [d for d in docs if d]


def cache_root(cache_dir: Optional[str]) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("DIST_TRAINER_CACHE"):
        return Path(os.environ["DIST_TRAINER_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "dist_trainer"


def cache_key(sources: Sources, tokenizer: TextTokenizer, text_key: str, val_fraction: float) -> str:
    return files_key(sources, tokenizer, CACHE_VERSION, text_key=text_key, val_fraction=float(val_fraction))


def files_key(sources: Sources, tokenizer: TextTokenizer, version: int, **options: Any) -> str:
    """sha256 of the files (paths, sizes, mtimes, formats), the tokenizer, a layout version and ``options``."""
    files = [[str(p), p.stat().st_size, p.stat().st_mtime_ns, fmt] for p, fmt in sources]
    parts = {"version": version, "files": files, "tokenizer": tokenizer.to_json(), **options}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else distributed.rank()


def _tokenize(out: Path, sources: Sources, tok: TextTokenizer, text_key: str,
              val_fraction: float, progress: bool) -> Dict[str, Any]:
    """Write out/train.bin and out/val.bin as prepare does; return their meta."""
    written = write_token_files(out, read_documents(sources, text_key, out / "datasets"), tok, val_fraction,
                                progress, desc="tokenizing data.files")
    shutil.rmtree(out / "datasets", ignore_errors=True)  # datasets' arrow copies: the token files are the cache
    return {"tokenizer": tok.spec, "inputs": [[str(p), fmt] for p, fmt in sources], "text_key": text_key,
            "val_fraction": val_fraction, **written,
            "written_by": {"host": socket.gethostname(), "pid": os.getpid(), "rank": _global_rank()}}


def build_cache(directory: Path, write: Callable[[Path], Dict[str, Any]]) -> str:
    """``write(tmp)`` into ``directory`` unless it is there: 'reused', 'written', or 'theirs' (another process won).

    ``write`` fills a fresh directory and returns the meta written beside its files.
    """
    if (directory / "meta.json").is_file():
        return "reused"
    # Beside the target, a name of its own: processes of several nodes sharing one file
    # system each write theirs, and a killed build leaves nothing that looks finished.
    tmp = directory.parent / f".{directory.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        meta = write(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, directory)  # atomic: the cache is complete, or not there
        except OSError:
            if not (directory / "meta.json").is_file():
                raise
            return "theirs"  # the same key, so the same tokens: keep the one already in place
        return "written"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report(err: Optional[BaseException]) -> Optional[Tuple[bool, str]]:
    if err is None:
        return None
    return (True, str(err)) if isinstance(err, ConfigError) else (False, f"{type(err).__name__}: {err}")


def agreed(step: Callable[[], T]) -> T:
    """``step()`` on this rank; if it raised on any rank, raise on every rank.

    Every rank reaches the collective, failed or not: it is also where the
    other ranks wait for the one building the cache, so a rank that raised
    before it would leave them waiting until the process group times out.
    """
    result, failure = None, None
    try:
        result = step()
    except Exception as err:  # reported to the peers first, re-raised below
        failure = err
    reports = [_report(failure)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, _report(failure))
    if failure is not None:
        raise failure
    for rank, report in enumerate(reports):
        if report is not None:
            is_config, message = report
            if is_config:
                raise ConfigError(message)  # the same message as on the rank that failed
            raise RuntimeError(f"rank {rank} failed building data=hf_text: {message}")
    return result


class CausalText(TokenFile):
    """Causal LM samples exactly as ``data=tokens`` gives them, with the tokenizer that made them."""

    def __init__(self, path: Path, block_size: int, tokenizer: TextTokenizer):
        super().__init__(str(path), block_size, key="data.files (tokenized)")
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, probability: float, mask_id: int,
                special_ids: np.ndarray, regular_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """BERT's masking: (input_ids, labels), labels the original id where chosen, IGNORE_INDEX elsewhere."""
    n = ids.size
    # The same draws whatever is chosen, so the stream (and the mask) depends only on the seed.
    chosen = (rng.random(n) < probability) & ~np.isin(ids, special_ids)
    roll = rng.random(n)  # of the chosen: 80% the mask token, 10% a random token, 10% kept
    random_ids = regular_ids[rng.integers(0, regular_ids.size, n)]
    inputs = np.where(chosen & (roll < 0.8), mask_id, ids)
    inputs = np.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, inputs)
    return inputs, np.where(chosen, ids, IGNORE_INDEX)


class MaskedText(TokenFile):
    """Masked LM samples: tokens ``[i * T, (i + 1) * T)``, masked by (seed, epoch, i)."""

    keyed_by_epoch = True  # the training loader passes (epoch, index): each epoch masks anew

    def __init__(self, path: Path, block_size: int, tokenizer: TextTokenizer, mlm_probability: float, seed: int):
        super().__init__(str(path), block_size, key="data.files (tokenized)")
        self._len = self.num_tokens // block_size  # no next token needed: a sample is T tokens
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.mlm_probability, self.seed = mlm_probability, seed
        self.regular_ids = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.special_ids)

    def __getitem__(self, key: Any) -> Dict[str, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        index = int(index) + (self._len if index < 0 else 0)
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        start = index * self.block_size
        ids = np.array(self._map()[start:start + self.block_size], dtype=np.int64)
        rng = np.random.default_rng(hash_key(self.seed, int(epoch), index))
        inputs, labels = mask_tokens(ids, rng, self.mlm_probability, self.tokenizer.mask_id,
                                     self.tokenizer.special_ids, self.regular_ids)
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}


def _check_args(files: Any, block_size: Any, val_fraction: Any, split: str, task: str, mlm_probability: Any) -> List[str]:
    """Checks of the values alone: the same on every rank, so they may raise before any collective."""
    files = check_common(files, split, val_fraction)
    if task not in TASKS:
        raise ConfigError(f"data.task={task!r}: choose one of {', '.join(TASKS)} (it follows model.task)")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ConfigError(f"data.block_size={block_size!r}: must be an integer >= 1")
    if task == "masked_lm" and not (isinstance(mlm_probability, (int, float)) and 0 < mlm_probability <= 1):
        raise ConfigError(f"data.mlm_probability={mlm_probability!r}: must be in (0, 1]")
    return files


def check_common(files: Any, split: str, val_fraction: Any) -> List[str]:
    """data.files, data.split and data.val_fraction, as every file-reading dataset takes them; the paths."""
    files = [files] if isinstance(files, (str, os.PathLike)) else files
    if not files or not all(isinstance(f, (str, os.PathLike)) for f in files):
        raise ConfigError(f"data.files={files!r}: must be a non-empty list of paths")
    if split not in ("train", "val"):
        raise ConfigError(f"data.split={split!r}: choose train or val")
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction={val_fraction!r}: must be in [0, 1)")
    return [str(f) for f in files]


def _open(directory: Path, split: str, task: str, block_size: int, tok: TextTokenizer,
          mlm_probability: float, seed: int) -> Dataset:
    if not (directory / "meta.json").is_file():
        raise ConfigError(f"data.cache_dir: the tokenized cache {directory} is not there on this rank; the ranks "
                          "of a node must share it (and torchrun's LOCAL_RANK must be set)")
    meta = json.loads((directory / "meta.json").read_text())
    tokens = meta[split]["tokens"]
    if tokens < block_size + 1:  # a causal sample's targets reach one token further; masked ones ask the same
        raise ConfigError(f"data.block_size={block_size}: the {split} split of data.files holds {tokens} tokens, "
                          "fewer than one sample (block_size + 1); lower data.block_size, add text, or change "
                          "data.val_fraction")
    path = directory / f"{split}.bin"
    if task == "causal_lm":
        return CausalText(path, block_size, tok)
    return MaskedText(path, block_size, tok, mlm_probability, seed)


def hf_text(files: Sequence[str], block_size: int, tokenizer: str = "bytes", format: Optional[str] = None,
            text_key: str = "text", val_fraction: float = 0.0, split: str = "train", task: str = "causal_lm",
            mlm_probability: float = 0.15, seed: int = 0, cache_dir: Optional[str] = None,
            streaming: bool = False) -> Optional[Dataset]:
    """The ``data=hf_text`` dataset of ``split``; None for val when nothing is held out.

    ``streaming``: tokenized as the run reads (``streaming.py``; validation refuses what it cannot do), each
    rank on its own, no cache; its order is keyed by the ``BlendPlan`` that reads it."""
    files = _check_args(files, block_size, val_fraction, split, task, mlm_probability)
    if split == "val" and val_fraction == 0:
        return None  # nothing held out: the run has no evaluation
    if streaming:
        from .streaming import StreamingDataset, TextStream

        return StreamingDataset(TextStream(resolve_files(files, format), load_tokenizer(tokenizer), block_size,
                                           text_key))
    builds = distributed.local_rank() == 0  # one builder per node; the node's other ranks wait in agreed()

    def prepare() -> Tuple[TextTokenizer, Path]:
        tok = load_tokenizer(tokenizer)
        if task == "masked_lm" and tok.mask_id is None:
            raise ConfigError(f"data.tokenizer={tokenizer}: it has no mask token (<mask> or [MASK]), which "
                              "task masked_lm needs")
        sources = resolve_files(files, format)
        directory = cache_root(cache_dir) / "hf_text" / cache_key(sources, tok, text_key, val_fraction)
        if builds:
            directory.parent.mkdir(parents=True, exist_ok=True)
            outcome = build_cache(directory, lambda tmp: _tokenize(tmp, sources, tok, text_key, val_fraction,
                                                                   progress=_global_rank() == 0))
            if outcome != "reused" or split == "train":  # the val split, built right after, says nothing new
                log.info("hf_text: %s the tokenized cache %s", OUTCOMES[outcome], directory)
        return tok, directory

    tok, directory = agreed(prepare)
    return agreed(lambda: _open(directory, split, task, block_size, tok, mlm_probability, seed))
