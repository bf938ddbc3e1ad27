"""Whether the forward running now is activation checkpointing's recomputation (in backward).

Statistics that a forward gathers as a side effect (an MoE layer's expert counts) must be counted once per
micro-batch: the recomputation runs the same tensor operations again, and only such bookkeeping skips.
``parallel.blocks`` enters ``recomputation()`` around every recomputed block; a model reads ``recomputing()``.
"""

from __future__ import annotations

import threading

_state = threading.local()


def recomputing() -> bool:
    return getattr(_state, "depth", 0) > 0


class recomputation:
    """The context of one recomputed forward. A class, not a generator: a schedule that splits the backward
    (zero bubble: inputs', then weights' gradients) may enter the same context once for each part."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1
