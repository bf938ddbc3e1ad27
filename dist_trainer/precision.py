"""Autocast and loss scaling: the only module that knows the precision mode.

The choice is made once, at build time: the training step calls
``precision.autocast()`` and reads ``precision.scaler.scale`` without asking
which mode it is in. bf16 and fp32 get a scaler whose scale is always 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ContextManager, Dict, List, Tuple

import torch

from .config import LossScaleConfig, PrecisionConfig

AUTOCAST_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


class LossScaleError(RuntimeError):
    """The dynamic loss scale would fall below its minimum: training cannot go on."""


class ConstantScaler:
    """Scale 1 that never changes: fp32 and bf16 need no loss scaling."""

    dynamic = False
    scale = 1.0

    def update(self, found_inf: bool, step: int) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling for fp16, decided on the host once per optimizer step.

    The scale stays constant through an accumulation window (it is read when each
    micro-batch's loss is scaled and changed only by ``update`` at the window's
    end), so every micro-batch's gradient carries the same factor and one
    division unscales their sum. ``found_inf`` must be the same on every rank;
    the trainer all-reduces it, so every rank's scale stays identical.
    """

    cfg: LossScaleConfig
    scale: float = 0.0
    growth_tracker: int = 0  # finite steps since the last change of scale
    hysteresis_left: int = 0  # overflows still tolerated before backing off
    history: List[Tuple[int, float]] = field(default_factory=list)  # (step, new scale)
    dynamic = True

    def __post_init__(self) -> None:
        self.scale = float(self.cfg.init_scale)
        self.hysteresis_left = self.cfg.hysteresis

    def update(self, found_inf: bool, step: int) -> None:
        cfg = self.cfg
        if not found_inf:
            self.growth_tracker += 1
            if self.growth_tracker >= cfg.growth_interval:
                self._set(self.scale * cfg.growth_factor, step)
            return
        self.growth_tracker = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return
        new_scale = self.scale * cfg.backoff_factor
        if new_scale < cfg.min_scale:
            recent = ", ".join(f"step {s}: {v:g}" for s, v in self.history[-8:]) or "none"
            raise LossScaleError(
                f"step {step}: gradients overflow even at loss scale {self.scale:g}; backing off would "
                f"go below precision.loss_scale.min_scale={cfg.min_scale:g} (recent scale changes: "
                f"{recent}). The loss or its gradients are diverging: lower optim.lr, set "
                "optim.grad_clip, lengthen optim.warmup_steps, or use precision=bf16-mixed."
            )
        self._set(new_scale, step)

    def _set(self, scale: float, step: int) -> None:
        self.scale = scale
        self.growth_tracker = 0
        self.hysteresis_left = self.cfg.hysteresis
        self.history = (self.history + [(step, scale)])[-32:]

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.history = [(int(s), float(v)) for s, v in state["history"]]


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.name = cfg.name
        self.device_type = device.type
        self.autocast_dtype = AUTOCAST_DTYPES[cfg.name]
        self.scaler = DynamicLossScaler(cfg.loss_scale) if cfg.name.startswith("fp16") else ConstantScaler()

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)
