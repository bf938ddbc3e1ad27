"""Tokenizers for ``data=hf_text``: ``bytes``, or a Hugging Face ``tokenizers`` file.

``load_tokenizer("bytes")`` builds a real ``tokenizers.Tokenizer`` in code: a
byte-level BPE with no merges, so byte value b is id b and UTF-8 text maps to
its bytes; ``<|endoftext|>`` is 256, ``<pad>`` 257, ``<mask>`` 258 (vocabulary
259). Anything else is a ``tokenizer.json`` or a directory holding one (a
``save_pretrained`` directory, or what ``python -m dist_trainer.tokenizer``
writes). Special tokens are found by name. ``TextTokenizer.save`` writes what
``transformers.AutoTokenizer.from_pretrained`` needs, so a trained model's
directory carries its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy as np
try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as err:  # the [hf] extra is not installed
    raise ImportError("data=hf_text and the tokenizer CLI need the [hf] extra: pip install 'dist_trainer[hf]'") from err

from ..config import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "[SEP]", "<eos>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
MASK_NAMES = ("<mask>", "[MASK]")
# What our own tokenizers hold, in this order right after their base vocabulary.
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>", "<mask>"]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, and the special tokens


def byte_alphabet() -> List[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


def _bytes_tokenizer() -> Tokenizer:
    vocab = {char: b for b, char in enumerate(byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges the split changes nothing but the cost.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # 256, 257, 258
    return tok


def _first_id(tok: Tokenizer, names: Sequence[str]) -> Optional[int]:
    return next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)


# The chat template of a tokenizer that has none (data=hf_chat, data.chat_template=auto|default):
# ChatML, with its two markers added to the vocabulary as special tokens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids a language model needs (and, for chat data, its template)."""

    def __init__(self, tok: Tokenizer, spec: str, key: str = "data.tokenizer", chat_template: Optional[str] = None):
        self.tok, self.spec, self.chat_template = tok, spec, chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = _first_id(tok, EOS_NAMES)
        if self.eos_id is None:
            raise ConfigError(f"{key}={spec}: it has no end-of-text token (one of {', '.join(EOS_NAMES)})")
        self.pad_id = _first_id(tok, PAD_NAMES)
        self.mask_id = _first_id(tok, MASK_NAMES)
        named = {self.eos_id, self.pad_id, self.mask_id} - {None}
        marked = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids = np.array(sorted(named | marked), dtype=np.int64)

    def token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer's full serialization (what makes two tokenizers the same)."""
        return self.tok.to_str()

    def encode_batch(self, docs: List[str]) -> List[np.ndarray]:
        """Token ids of each document, no special tokens added."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch_fast(docs, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json and the configs ``AutoTokenizer.from_pretrained(directory)`` reads."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(out / "tokenizer.json"))
        specials = {name: self.token(i) for name, i in
                    (("eos_token", self.eos_id), ("pad_token", self.pad_id), ("mask_token", self.mask_id))
                    if i is not None}
        # PreTrainedTokenizerFast wraps tokenizer.json as it is; without this it would guess
        # a class from a model type it does not have.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
        if self.chat_template:  # generation with the exported model renders prompts as training did
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1) + "\n")
        return out


def load_tokenizer(spec: str, key: str = "data.tokenizer", chat_template: Optional[str] = None) -> TextTokenizer:
    """``bytes``, a tokenizer.json, or a directory holding one; errors name ``key``.

    ``chat_template`` (data=hf_chat's ``data.chat_template``): ``auto``, the
    tokenizer's own (``chat_template`` in its directory's tokenizer_config.json,
    or chat_template.jinja) or else the default; ``default``, DEFAULT_CHAT_TEMPLATE;
    or a path to a Jinja file. The default adds its markers as special tokens,
    so the vocabulary (and the model's, which follows it) grows by two.
    """
    if spec == "bytes":
        tok, own = _bytes_tokenizer(), None
    else:
        path = Path(str(spec)).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{key}={spec}: no such file; give bytes, a tokenizer.json, or a directory holding one")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # the library raises plain Exception for a bad file
            raise ConfigError(f"{key}={spec}: {path} cannot be read as a tokenizers file ({err})") from err
        own = _own_chat_template(path.parent)
    template = None
    if chat_template is not None:
        template = _chat_template(chat_template, own)
        if template == DEFAULT_CHAT_TEMPLATE:
            tok.add_special_tokens([t for t in DEFAULT_CHAT_TOKENS if tok.token_to_id(t) is None])
    return TextTokenizer(tok, str(spec), key, template)


def _own_chat_template(directory: Path) -> Optional[str]:
    """The template a save_pretrained directory carries (transformers writes either file)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    config = directory / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _chat_template(choice: str, own: Optional[str]) -> str:
    if choice == "auto":
        return own or DEFAULT_CHAT_TEMPLATE
    if choice == "default":
        return DEFAULT_CHAT_TEMPLATE
    path = Path(choice).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.chat_template={choice}: choose auto, default, or the path of a Jinja template file")
    return path.read_text()


def train_bpe(batches: Iterable[List[str]], vocab_size: int, min_frequency: int = 2) -> TextTokenizer:
    """A byte-level BPE trained on batches of documents: specials first (0, 1, 2), then the bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(batches, trainer=trainer)
    return TextTokenizer(tok, "trained", key="--out")
