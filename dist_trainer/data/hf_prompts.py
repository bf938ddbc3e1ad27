"""``data=hf_prompts``: prompts for ``task=grpo``, whose completions the model samples itself.

Input: local json, jsonl or parquet files, one prompt per record: ``data.prompt_key`` (``prompt``) is a text (a
user turn) or a list of ``{"role", "content"}`` messages ending with a user turn. The record's other fields are
kept as they are and passed to the reward (``exact_answer`` reads ``answer``). Each prompt is rendered with the
chat template and its generation prompt (the assistant's turn opened) and tokenized once, on every rank alike;
prompts are few and short, so they are held in memory, with no cache. A prompt longer than ``data.max_length``
tokens is dropped (counted in the log).

Samples: ``rl.group_size`` per prompt, one per completion to be sampled. Sample ``i`` is completion
``i % group_size`` of prompt ``i // group_size``, and the sample order keeps a prompt's group together
(``group_size`` is the order's group: ``data/loader.py``). A micro-batch is ``{"prompt_index", "sample"}``: which
completions its rows are; the objective (``rl/grpo.py``) samples them and makes the rows.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config import ConfigError
from .hf_chat import FORMATS, ChatTemplate, _checked, _records
from .hf_text import agreed, cache_root, check_common, resolve_files
from .tokenizer import TextTokenizer, load_tokenizer

log = logging.getLogger("dist_trainer")


class Prompts(Dataset):
    """``group_size`` samples per prompt; the prompts' tokens, records and texts, and the end-of-turn ids."""

    def __init__(self, ids: List[np.ndarray], records: List[dict], texts: List[str], tok: TextTokenizer,
                 stop_ids: Sequence[int], group_size: int, prompt_key: str = "prompt"):
        self.ids, self.records, self.texts, self.tokenizer = ids, records, texts, tok
        self.prompt_key = prompt_key  # the records' prompt field (the reward is given it as ``prompt``)
        self.group_size = group_size
        self.vocab_size = tok.vocab_size
        self.pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id  # never attended to, never a label
        # A completion ends at the first of these (the template's end of turn, the tokenizer's end of text)
        self.stop_ids = tuple(sorted(set(int(i) for i in stop_ids)))

    def __len__(self) -> int:
        return len(self.ids) * self.group_size

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        prompt, sample = divmod(int(index), self.group_size)
        return {"prompt_index": torch.tensor(prompt), "sample": torch.tensor(sample)}

    def completion_text(self, tokens: Sequence[int]) -> str:
        """A completion's text: its tokens before the first end of turn."""
        ended = [i for i, t in enumerate(tokens) if t in self.stop_ids]
        return self.tokenizer.decode(list(tokens[:ended[0]] if ended else tokens))


def end_of_turn(template: ChatTemplate, tok: TextTokenizer) -> List[int]:
    """The ids that end an assistant's turn: the template's own end of turn where it is one token (ChatML's
    ``<|im_end|>``), and the tokenizer's end of text."""
    where = "the end of turn"
    messages = [{"role": "user", "content": "q"}]
    before = template.render(messages, True, where)
    through = template.render(messages + [{"role": "assistant", "content": "a"}], False, where)
    after = through[len(before) + 1:].strip() if through.startswith(before + "a") else ""
    ids = [tok.eos_id]
    if after:
        encoded = tok.encode_batch([after])[0]
        if encoded.size == 1:
            ids.append(int(encoded[0]))
    return ids


def _prompt(record: Any, key: str, where: str) -> List[dict]:
    if not isinstance(record, dict) or key not in record:
        raise ConfigError(f"data.files: {where}: no {key!r} field (data.prompt_key={key})")
    value = record[key]
    messages = [{"role": "user", "content": value}] if isinstance(value, str) else _checked(value, where)
    if messages[-1]["role"] != "user":
        raise ConfigError(f"data.files: {where}: a prompt's messages must end with a user turn")
    return messages


def hf_prompts(files: Sequence[str], group_size: int = 4, block_size: int = 512, tokenizer: str = "bytes",
               chat_template: str = "auto", format: Optional[str] = None, prompt_key: str = "prompt",
               max_length: Optional[int] = None, val_fraction: float = 0.0, split: str = "train",
               task: str = "causal_lm", cache_dir: Optional[str] = None) -> Optional[Prompts]:
    """The ``data=hf_prompts`` dataset; None for val (rollouts are evaluated by a benchmark, not the run)."""
    files = check_common(files, split, val_fraction)
    if task != "causal_lm":
        raise ConfigError(f"data=hf_prompts is sampled by a causal LM; model.task={task} (use model=hf_causal_lm)")
    if val_fraction:
        raise ConfigError("data.val_fraction: data=hf_prompts holds no held-out split (task=grpo evaluates rollouts "
                          "outside the run); set it to 0")
    if split == "val":
        return None
    if not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"rl.group_size={group_size!r}: must be an integer >= 1")
    limit = block_size if max_length is None else max_length

    def read() -> Prompts:
        tok = load_tokenizer(tokenizer, chat_template=chat_template)
        template = ChatTemplate(tok.chat_template, tok)
        records, texts, dropped = [], [], 0
        for path, fmt in resolve_files(files, format):
            if fmt not in FORMATS:
                raise ConfigError(f"data.files: {path} is {fmt}; prompts are read from json, jsonl or parquet")
            for where, record in _records(path, fmt, cache_root(cache_dir) / "hf_prompts"):
                records.append(record)
                texts.append(template.render(_prompt(record, prompt_key, where), True, where))
        encoded = tok.encode_batch(texts) if texts else []
        kept = [i for i, ids in enumerate(encoded) if ids.size <= limit]
        dropped = len(encoded) - len(kept)
        if not kept:
            raise ConfigError(f"data.files: no prompt of at most data.max_length={limit} tokens")
        log.info("hf_prompts: %d prompts (%d longer than data.max_length=%d dropped), %d completions each",
                 len(kept), dropped, limit, group_size)
        return Prompts([encoded[i].astype(np.int64) for i in kept], [records[i] for i in kept],
                       [texts[i] for i in kept], tok, end_of_turn(template, tok), group_size,
                       prompt_key)

    return agreed(read)
