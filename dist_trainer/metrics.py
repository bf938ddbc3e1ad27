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
    """Appends one line per step; on resume, first drops lines after the resumed step."""

    def __init__(self, path: Optional[Path], keep_until: int = 0):
        self.file = None
        if path is None:
            return
        kept = []
        if keep_until > 0 and path.exists():
            # Steps after the checkpoint were lost with the crash and will run again.
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and _step_of(line) is not None and _step_of(line) <= keep_until]
        self.file = open(path, "w", buffering=1)
        self.file.writelines(kept)

    def write(self, record: Dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({k: _strict(v) for k, v in record.items()}, allow_nan=False) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _step_of(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a crash


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
