"""What users see: metrics.jsonl, TensorBoard, the console; rank 0 writes, other ranks hold null writers."""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

log = logging.getLogger("dist_trainer")


def peak_mem_mb(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    from .hostmem import run_peak_mb  # the kernel's peak, kept across the resets of a phase's measurement

    peak = run_peak_mb()
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB


# Dense bf16/fp16 tensor-core peaks (FLOP/s) by device name; fp32 runs use the fp32 column.
PEAK_FLOPS = {  # name fragment: (half precision, fp32)
    "H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12), "A10G": (125e12, 31.2e12), "V100": (125e12, 15.7e12),
}


def peak_flops(device: torch.device, half_precision: bool) -> Optional[float]:
    """The device's peak FLOP/s from the table above, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, full) in PEAK_FLOPS.items():
        if fragment in name:
            return half if half_precision else full
    return None


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
                    if (step := _step_of(line)) is not None and step <= keep_until]
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
        f"SKIPPED ({record['skip_reason']})" if record["skipped"] else None,
        f"{record['samples_per_s']:.1f} samples/s",
        f"{record['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in record else None,
        f"MFU {record['mfu'] * 100:.1f}%" if record.get("mfu") is not None else None,
        f"{record['step_time_s'] * 1000:.0f} ms/step",
    ]
    if "eval_loss" in record:
        parts.append(f"eval_loss {record['eval_loss']:.4f}")
    return " | ".join(p for p in parts if p)


class TensorBoardWriter:
    """The same scalars as metrics.jsonl (which stays the source of truth), for TensorBoard."""

    def __init__(self, log_dir: Path, initial: int = 0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError("logger=tensorboard needs the tensorboard package: pip install tensorboard") from err
        # A resumed run writes steps after ``initial`` again: purge_step tells TensorBoard to
        # drop what earlier event files hold from there on, as metrics.jsonl is trimmed.
        self.writer = SummaryWriter(str(log_dir), purge_step=initial + 1 if initial else None)

    def write(self, record: Dict[str, Any]) -> None:
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                self.writer.add_scalar(f"train/{key}" if key != "eval_loss" else "eval/loss", value, record["step"])
            elif isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", int(value), record["step"])

    def close(self) -> None:
        self.writer.close()


class Progress:
    """A live bar on a terminal; a compact log line every log_every steps otherwise (CI, Slurm logs)."""

    def __init__(self, enabled: bool, total: int, initial: int, log_every: int):
        self.total, self.log_every, self.bar = total, log_every, None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, record: Dict[str, Any]) -> None:
        step = record["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(_postfix(record), refresh=False)
            if step % self.log_every == 0 or "eval_loss" in record or step == self.total:
                self.bar.write(console_line(record, self.total))
        elif step % self.log_every == 0 or step == 1 or step == self.total or "eval_loss" in record:
            log.info(console_line(record, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _postfix(record: Dict[str, Any]) -> str:
    parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
    if record.get("loss_scale") is not None:
        parts.append(f"scale {record['loss_scale']:g}")
    parts.append(f"{record['samples_per_s']:.0f} samples/s")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


class Outputs:
    """Every per-step record goes to metrics.jsonl, TensorBoard if asked, the trackers, and the console."""

    def __init__(self, run_dir: Path, is_main: bool, loggers: List[str], total: int, initial: int, log_every: int,
                 trackers: Any = None):
        self.jsonl = MetricsWriter(run_dir / "metrics.jsonl" if is_main else None, keep_until=initial)
        self.tensorboard = (TensorBoardWriter(run_dir / "tensorboard", initial)
                            if is_main and "tensorboard" in loggers else None)
        self.trackers = trackers  # tracking.Trackers: W&B, MLflow (rank 0), fed on their own thread
        self.progress = Progress(is_main, total, initial, log_every)

    def write(self, record: Dict[str, Any]) -> None:
        self.jsonl.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        if self.trackers is not None:
            self.trackers.log(record)
        self.progress.update(record)

    def close(self) -> None:
        self.progress.close()
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
