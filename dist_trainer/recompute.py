"""Whether the forward running now is activation checkpointing's recomputation (in backward).

Statistics that a forward gathers as a side effect (an MoE layer's expert counts) must be counted once per
micro-batch: the recomputation runs the same tensor operations again, and only such bookkeeping skips.
``parallel.blocks`` enters ``recomputation()`` around every recomputed block; a model reads ``recomputing()``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()


def recomputing() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def recomputation() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
