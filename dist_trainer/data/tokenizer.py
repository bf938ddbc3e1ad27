"""The one tokenizer loader: ``prepare``, ``data=hf_text``, ``data=hf_chat`` and export use it.

``load_tokenizer("bytes")``: byte value b is id b, so UTF-8 text maps to its
bytes; ``<|endoftext|>`` is 256, ``<pad>`` 257, ``<mask>`` 258 (vocabulary
259). It encodes with numpy and needs no package; where a real
``tokenizers.Tokenizer`` is wanted (to save it, to decode, to render chats) it
is built in code: a byte-level BPE with no merges, which gives the same ids.
Anything else is a ``tokenizer.json`` or a directory holding one (a
``save_pretrained`` directory, or what ``python -m dist_trainer.tokenizer``
writes); it needs the ``tokenizers`` package. Special tokens are found by name.
``TextTokenizer.save`` writes what ``transformers.AutoTokenizer.from_pretrained``
needs, so a trained model's directory carries its tokenizer.

Two encodings:

* ``encode_text``, for documents (prepare, hf_text): the text of a special
  token in a document is text (an SVG ``<mask>`` tag is its characters, not the
  mask id), and a document stays one sequence however long it is, but one
  longer than PIECE_CHARS is cut at line breaks where the tokenizer is shown to
  give the same ids on both sides (checked on a window around each cut), so
  that its pieces are tokenized in parallel.
* ``encode_batch``, for rendered chat templates (hf_chat, evaluate): special
  tokens are matched, as ``transformers`` does.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from itertools import chain
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..config import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "[SEP]", "<eos>")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>")
MASK_NAMES = ("<mask>", "[MASK]")
# What our own tokenizers hold, in this order right after their base vocabulary.
SPECIAL_TOKENS = ["<|endoftext|>", "<pad>", "<mask>"]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte, and the special tokens
BYTES_EOS = 256

PIECE_CHARS = 32_768  # a longer document is cut into pieces about this long, tokenized in parallel
CHECK_CHARS = 256  # each cut is checked on this many characters either side of it
# A cut candidate: right after a line break with non-space on both sides ("word\nWord").
# Byte-level pre-tokenizers (GPT-2's, Llama 3's) always split there; other tokenizers are checked anyway.
CUT = re.compile(r"(?<=\S\n)(?=\S)")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as err:  # the [hf] extra is not installed
        raise ImportError("a tokenizer file, hf_text, hf_chat and the tokenizer CLI need the tokenizers package: "
                          "pip install 'dist_trainer[hf]'") from err
    return tokenizers


def byte_alphabet() -> List[str]:
    """GPT-2's printable stand-in for each byte value, indexed by byte (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(256)]


def _bytes_tokenizer() -> Any:
    tk = _tokenizers()
    vocab = {char: b for b, char in enumerate(byte_alphabet())}
    tok = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges the split changes nothing but the cost.
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # 256, 257, 258
    return tok


def _first_id(tok: Any, names: Sequence[str]) -> Optional[int]:
    return next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)


# The chat template of a tokenizer that has none (data=hf_chat, data.chat_template=auto|default):
# ChatML, with its two markers added to the vocabulary as special tokens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the ids a language model needs (and, for chat data, its template)."""

    def __init__(self, tok: Any, spec: str, key: str = "data.tokenizer", chat_template: Optional[str] = None):
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
        self._cuts_hold = True  # until a cut's check fails: then this tokenizer's documents stay whole

    def token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer's full serialization (what makes two tokenizers the same)."""
        return self.tok.to_str()

    def encode_batch(self, texts: List[str]) -> List[np.ndarray]:
        """Token ids of rendered text (a chat template's): special tokens' text is matched, nothing added."""
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    @cached_property
    def _text_tok(self) -> Any:
        """The same tokenizer, reading the text of special tokens as text, and never cutting a document short.

        A tokenizer.json may carry truncation or padding (for a classifier's
        inputs, say): a document is tokenized whole, and nothing is added to it.
        """
        copy = _tokenizers().Tokenizer.from_str(self.tok.to_str())
        copy.encode_special_tokens = True
        copy.no_truncation()
        copy.no_padding()
        return copy

    def _flat(self, texts: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        # _fast: no character offsets, which documents do not need.
        encoded = self._text_tok.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        ids = np.fromiter(chain.from_iterable(e.ids for e in encoded), dtype=np.uint32, count=int(lengths.sum()))
        return ids, lengths

    def _text_ids(self, texts: List[str]) -> List[np.ndarray]:
        ids, lengths = self._flat(texts)
        return np.split(ids, np.cumsum(lengths)[:-1])

    def _plan(self, docs: List[str]) -> List[List[int]]:
        return [_cuts(doc) if self._cuts_hold and len(doc) > PIECE_CHARS else [] for doc in docs]

    def encode_flat(self, docs: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        """``encode_text``'s ids of all documents end to end, and each one's length (what a writer wants)."""
        plan = self._plan(docs)
        return _joined(self._encode_cut(docs, plan)) if any(plan) else self._flat(docs)

    def encode_text(self, docs: List[str]) -> List[np.ndarray]:
        """Token ids of each document, as one sequence each; in one call of the library, in parallel."""
        plan = self._plan(docs)
        return self._encode_cut(docs, plan) if any(plan) else self._text_ids(docs)

    def _encode_cut(self, docs: List[str], plan: List[List[int]]) -> List[np.ndarray]:
        """Each document in the pieces ``plan`` cuts it into, every cut checked, in one call of the library."""
        texts: List[str] = []
        for doc, cuts in zip(docs, plan):
            bounds = [0, *cuts, len(doc)]
            texts += [doc[a:b] for a, b in zip(bounds, bounds[1:])]
            for c in cuts:  # the check: a window across the cut, and its two sides
                a, b = max(0, c - CHECK_CHARS), c + CHECK_CHARS
                texts += [doc[a:b], doc[a:c], doc[c:b]]
        ids = iter(self._text_ids(texts))
        out = []
        for doc, cuts in zip(docs, plan):
            pieces = [next(ids) for _ in range(len(cuts) + 1)]
            checks = [(next(ids), next(ids), next(ids)) for _ in cuts]
            if all(np.array_equal(whole, np.concatenate(sides)) for whole, *sides in checks):
                out.append(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
            else:  # it joins across line breaks (a Metaspace that marks each start, say): never cut again
                self._cuts_hold = False
                out.append(self._text_ids([doc])[0])
        return out

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


class BytesTokenizer(TextTokenizer):
    """``bytes`` without a chat template: documents encoded by numpy, no package needed.

    ``tok`` (the equal ``tokenizers.Tokenizer``) is built when something asks for it.
    """

    def __init__(self) -> None:
        self.spec, self.chat_template = "bytes", None
        self.vocab_size, self.eos_id, self.pad_id, self.mask_id = MIN_VOCAB, BYTES_EOS, BYTES_EOS + 1, BYTES_EOS + 2
        self.special_ids = np.array([BYTES_EOS, BYTES_EOS + 1, BYTES_EOS + 2], dtype=np.int64)

    @cached_property
    def tok(self) -> Any:
        return _bytes_tokenizer()

    def encode_text(self, docs: List[str]) -> List[np.ndarray]:
        return [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for doc in docs]

    def encode_flat(self, docs: List[str]) -> Tuple[np.ndarray, np.ndarray]:
        data = [doc.encode("utf-8") for doc in docs]
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
        return np.frombuffer(b"".join(data), dtype=np.uint8).astype(np.uint32), lengths


def _joined(arrays: List[np.ndarray]) -> Tuple[np.ndarray, np.ndarray]:
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    return (np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)), lengths


def _cuts(doc: str) -> List[int]:
    """Where to cut a long document: the first candidate after every PIECE_CHARS characters."""
    cuts: List[int] = []
    start = PIECE_CHARS
    while start < len(doc):
        found = CUT.search(doc, start)
        if found is None:
            break
        cuts.append(found.start())
        start = found.start() + PIECE_CHARS
    return cuts


def load_tokenizer(spec: str, key: str = "data.tokenizer", chat_template: Optional[str] = None) -> TextTokenizer:
    """``bytes``, a tokenizer.json, or a directory holding one; errors name ``key``.

    ``chat_template`` (data=hf_chat's ``data.chat_template``): ``auto``, the
    tokenizer's own (``chat_template`` in its directory's tokenizer_config.json,
    or chat_template.jinja) or else the default; ``default``, DEFAULT_CHAT_TEMPLATE;
    or a path to a Jinja file. The default adds its markers as special tokens,
    so the vocabulary (and the model's, which follows it) grows by two.
    """
    if spec == "bytes":
        if chat_template is None:
            return BytesTokenizer()
        tok, own = _bytes_tokenizer(), None
    else:
        path = Path(str(spec)).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{key}={spec}: no such file; give bytes, a tokenizer.json, or a directory holding one")
        tokenizers = _tokenizers()  # not installed: that error, not a bad file's
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
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
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                     special_tokens=SPECIAL_TOKENS,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(batches, trainer=trainer)
    return TextTokenizer(tok, "trained", key="--out")
