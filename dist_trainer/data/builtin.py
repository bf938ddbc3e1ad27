"""Built-in datasets for ``dist_trainer``.

All datasets are map-style :class:`torch.utils.data.Dataset` objects whose items
are dicts of tensors, so PyTorch's default collate function stacks them into a
batch dict that is passed straight to ``model(batch)``.

Nothing here downloads anything:

* :func:`char_text` uses the English reference text shipped with CPython
  (``pydoc_data.topics``), byte-level (vocabulary of 256 byte values).
* :func:`digits` uses scikit-learn's bundled 8x8 handwritten digits.
* :func:`regression` is a small synthetic regression problem.
"""

from __future__ import annotations

import zlib
from functools import lru_cache

import torch
from torch.utils.data import Dataset

__all__ = [
    "BYTE_VOCAB_SIZE",
    "IGNORE_INDEX",
    "CharTextDataset",
    "DigitsDataset",
    "RegressionDataset",
    "char_text",
    "digits",
    "regression",
    "reference_text_bytes",
]

#: Vocabulary size of the byte-level text dataset (one token per byte value).
BYTE_VOCAB_SIZE = 256
#: Target value that the loss ignores (matches ``F.cross_entropy``'s default).
IGNORE_INDEX = -100

_SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"data.split must be 'train' or 'val', got {split!r}")


def _check_fraction(val_fraction: float) -> None:
    if not (0.0 < float(val_fraction) < 1.0):
        raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction!r}")


@lru_cache(maxsize=1)
def reference_text_bytes() -> bytes:
    """The CPython pydoc topic reference text, UTF-8 encoded (about 465 KB).

    Topics are concatenated in sorted-key order so the byte stream is
    deterministic for a given Python version.
    """
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


class CharTextDataset(Dataset):
    """Byte-level language-modelling windows over a byte string.

    Item ``i`` covers bytes ``[i * block_size, i * block_size + block_size + 1)``
    (non-overlapping inputs, stride ``block_size`` bytes) and is
    ``{"input_ids": int64[block_size], "targets": int64[block_size]}`` where
    ``targets`` is ``input_ids`` shifted left by one byte.

    In variable-length mode (``min_len`` given) item ``i`` has a deterministic
    valid length ``L_i`` in ``[min_len, block_size]`` tokens; target positions
    ``>= L_i`` are set to :data:`IGNORE_INDEX`. ``L_i`` depends only on
    ``(i, block_size, min_len)`` and ``seed``, never on global RNG state.
    """

    def __init__(
        self,
        data: bytes,
        block_size: int,
        min_len: int | None = None,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"data.block_size must be >= 1, got {block_size}")
        if len(data) < block_size + 1:
            raise ValueError(
                f"data.block_size={block_size} is too large for a text split of "
                f"{len(data)} bytes (need at least block_size + 1 bytes)"
            )
        if min_len is not None and not (1 <= min_len <= block_size):
            raise ValueError(
                f"data.min_len must be in [1, block_size={block_size}], got {min_len}"
            )
        self.block_size = int(block_size)
        self.min_len = None if min_len is None else int(min_len)
        self.seed = int(seed)
        # uint8 storage; converted to int64 per item.
        self._data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._len = (len(data) - 1) // self.block_size

    @property
    def vocab_size(self) -> int:
        """Number of token ids (bytes): 256."""
        return BYTE_VOCAB_SIZE

    @property
    def num_bytes(self) -> int:
        """Size of the underlying split, in bytes."""
        return int(self._data.numel())

    def __len__(self) -> int:
        return self._len

    def valid_length(self, index: int) -> int:
        """Number of non-ignored target tokens of item ``index``."""
        if self.min_len is None:
            return self.block_size
        span = self.block_size - self.min_len + 1
        # Deterministic hash of (seed, index): stable across processes/runs.
        h = zlib.crc32(f"{self.seed}:{index}".encode("ascii"))
        return self.min_len + h % span

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} items")
        start = index * self.block_size
        chunk = self._data[start : start + self.block_size + 1].to(torch.int64)
        input_ids = chunk[:-1].clone()
        targets = chunk[1:].clone()
        if self.min_len is not None:
            targets[self.valid_length(index) :] = IGNORE_INDEX
        return {"input_ids": input_ids, "targets": targets}


def char_text(
    block_size: int = 64,
    split: str = "train",
    val_fraction: float = 0.1,
    min_len: int | None = None,
) -> CharTextDataset:
    """Byte-level LM dataset over CPython's bundled English reference text.

    Args:
        block_size: context length in bytes (= tokens) of each item.
        split: ``"train"`` (the first ``1 - val_fraction`` of the bytes) or
            ``"val"`` (the last ``val_fraction`` of the bytes).
        val_fraction: fraction of the bytes held out for validation.
        min_len: if given, enables variable-length mode: each item keeps a
            deterministic number of valid target tokens in
            ``[min_len, block_size]``; the rest are ``-100`` (ignored).

    Returns:
        A :class:`CharTextDataset` (vocabulary: 256 byte values).
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"data.block_size must be an integer >= 1, got {block_size!r}")
    _check_split(split)
    _check_fraction(val_fraction)
    text = reference_text_bytes()
    cut = len(text) - int(round(len(text) * float(val_fraction)))
    data = text[:cut] if split == "train" else text[cut:]
    return CharTextDataset(data, block_size=block_size, min_len=min_len)


class DigitsDataset(Dataset):
    """Items ``{"image": float32[1, 8, 8] in [0, 1], "label": int64 scalar}``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels must have the same length")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


def digits(split: str = "train", val_fraction: float = 0.2) -> DigitsDataset:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

    The split is deterministic and contiguous: the first ``1 - val_fraction``
    of the samples (in the order scikit-learn ships them) are ``"train"``, the
    rest ``"val"``. Pixel values (0..16) are scaled to ``[0, 1]`` by ``/ 16``.
    """
    _check_split(split)
    _check_fraction(val_fraction)
    from sklearn.datasets import load_digits  # lazy: only needed here

    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    n = labels.shape[0]
    cut = n - int(round(n * float(val_fraction)))
    sl = slice(0, cut) if split == "train" else slice(cut, n)
    return DigitsDataset(images[sl].contiguous(), labels[sl].contiguous())


class RegressionDataset(Dataset):
    """Items ``{"x": float32[in_dim], "y": float32 scalar, "use_branch": bool scalar}``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, use_branch: torch.Tensor) -> None:
        self.x = x
        self.y = y
        self.use_branch = use_branch

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index], "use_branch": self.use_branch[index]}


def regression(
    n: int = 64, in_dim: int = 4, seed: int = 0, branch_every: int = 0
) -> RegressionDataset:
    """Synthetic regression: ``y = x @ w + b + 0.01 * noise`` from a seeded generator.

    ``use_branch`` is True for item ``i`` iff ``branch_every > 0`` and
    ``(i // branch_every) % 2 == 0``; with a sequential sampler and batch size
    ``branch_every`` consecutive micro-batches alternate using the branch.
    """
    if n < 1:
        raise ValueError(f"data.n must be >= 1, got {n}")
    if in_dim < 1:
        raise ValueError(f"data.in_dim must be >= 1, got {in_dim}")
    if branch_every < 0:
        raise ValueError(f"data.branch_every must be >= 0, got {branch_every}")
    g = torch.Generator().manual_seed(int(seed))
    w = torch.randn(in_dim, generator=g)
    b = torch.randn((), generator=g)
    x = torch.randn(n, in_dim, generator=g)
    y = x @ w + b + 0.01 * torch.randn(n, generator=g)
    idx = torch.arange(n)
    if branch_every > 0:
        use_branch = (idx // branch_every) % 2 == 0
    else:
        use_branch = torch.zeros(n, dtype=torch.bool)
    return RegressionDataset(x, y, use_branch)
