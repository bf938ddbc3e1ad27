"""``trainer.compile``: a watch on what compiles when, and eager evaluation.

Blocks are compiled (``parallel.blocks.compile_blocks``) in place, after activation checkpointing and before DDP
or FSDP wrap the model (the order torchtitan uses): each block's ``forward``
becomes its compiled version, an instance attribute as activation
checkpointing sets it. Parameter names and state dicts are unchanged, and the
hooks DDP and FSDP put on the modules run eagerly around the compiled code
(FSDP's all-gathers, DDP's gradient hooks are not traced).

Shapes: the batch dimension is marked dynamic at every call, so a short
micro-batch (the last step of an epoch) runs the graph already compiled. A
micro-batch of one sample still compiles once more: torch specialises sizes 0
and 1, and no hint changes that. Evaluation runs eagerly
(``torch.compiler.set_stance("force_eager")``): eval mode and the last,
shorter eval batch would otherwise each compile again.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any, ContextManager, Dict, Optional

import torch

log = logging.getLogger("dist_trainer")


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process.

    torch has no public counter of compilations; this is the one its own
    tests read (``torch._dynamo.utils.counters``).
    """
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def eager_eval(enabled: bool) -> ContextManager:
    """The context evaluation runs in: eager when the model is compiled."""
    return torch.compiler.set_stance("force_eager") if enabled else nullcontext()


class CompileWatch:
    """Says in the log how long the first step compiled, and when anything compiles after it."""

    def __init__(self, enabled: bool, is_main: bool):
        self.enabled, self.is_main = enabled, is_main
        self.frames = compiled_frames() if enabled else 0
        self.started = time.perf_counter()
        self.recompiles = 0  # compilations after the first step

    def after_step(self, step: int, step_time_s: float) -> Optional[Dict[str, Any]]:
        """Metrics for the step's record (None when compile is off)."""
        if not self.enabled:
            return None
        frames = compiled_frames()
        new, self.frames = frames - self.frames, frames
        if step == 1:
            if self.is_main:
                log.info("torch.compile: %d graph(s) compiled during step 1 (%.1f s, compilation included)",
                         new, step_time_s)
        elif new:
            self.recompiles += new
            log.warning("step %d: torch.compile compiled %d more graph(s) after the first step (a new input "
                        "shape, e.g. a micro-batch of one sample; it is cached from now on)", step, new)
        return {"compiled_graphs": frames, "recompiles": self.recompiles}
