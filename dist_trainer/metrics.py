"""metrics.jsonl and the console line; rank 0 writes, other ranks hold a null writer."""

from __future__ import annotations

import json
import logging
import math
import resource
from pathlib import Path
from typing import Any, Dict, Optional

import torch

log = logging.getLogger("dist_trainer")


def peak_mem_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _strict(value: Any) -> Any:
    # Strict JSON has no NaN or Infinity: write null instead.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    def __init__(self, path: Optional[Path]):
        self.file = open(path, "w", buffering=1) if path is not None else None

    def write(self, record: Dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({k: _strict(v) for k, v in record.items()}, allow_nan=False) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def console_line(record: Dict[str, Any], max_steps: int) -> str:
    scale = record.get("loss_scale")
    parts = [
        f"step {record['step']}/{max_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:.3f}" if record.get("grad_norm") is not None else "grad_norm -",
        f"scale {scale:g}" if scale is not None else None,
        "SKIPPED" if record["skipped"] else None,
        f"{record['samples_per_s']:.1f} samples/s",
        f"{record['step_time_s'] * 1000:.0f} ms/step",
    ]
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    return " | ".join(p for p in parts if p)
