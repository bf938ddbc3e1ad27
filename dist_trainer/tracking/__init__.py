"""Experiment tracking where users keep their runs: Weights & Biases and MLflow (``logger=[jsonl,wandb,mlflow]``).

metrics.jsonl stays the source of truth; a tracker gets a copy of it:

- at start, the composed config as flat keys (``optim.lr``) and the plan's
  numbers (global batch, accumulation, parameters, ``state_mb``) as summary
  values;
- every metrics.jsonl record, each field a metric at its optimizer step;
- at the end, the report's PNGs (and ``hf_model/`` with
  ``logging.hf_model_artifact=true``) as artifacts.

Rank 0 alone tracks, on a thread of its own: a slow or unreachable server
never holds up a step. A backend that fails is warned about once and dropped;
training and the local files go on. The tracked run's id is kept in
``tracking.json`` in the run directory with the last step each backend has
taken, so a resumed or requeued run logs into the same tracked run from the
step after, and no step is logged twice.

    wandb_run.py    wandb.init(id=..., resume="allow"), run.log(..., step=...)
    mlflow_run.py   MlflowClient: one run, log_batch per step
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol

log = logging.getLogger("dist_trainer")

STATE_FILE = "tracking.json"
CLOSE_TIMEOUT_S = 60.0  # how long the end of a run waits for a tracker still sending


class Backend(Protocol):
    name: str

    def start(self, resume_id: Optional[str]) -> str:
        """Open (or reopen) the tracked run; returns its id."""

    def config(self, flat: Dict[str, Any], summary: Dict[str, Any]) -> None: ...

    def log(self, record: Dict[str, Any], step: int) -> None: ...

    def artifacts(self, paths: List[Path]) -> None: ...

    def finish(self) -> None: ...


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """{"optim.lr": 0.001, ...}: nested dicts as dotted keys; lists as they are."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def metrics_of(record: Dict[str, Any]) -> Dict[str, float]:
    """The record's numbers (booleans as 0/1), without the step itself and without nulls."""
    out = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, str):
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
    return out


class Trackers:
    """The backends of ``logger``, fed through one queue by rank 0; every other rank holds an empty one."""

    def __init__(self, backends: List[Backend], run_dir: Path, resumed_step: int):
        self.backends, self.run_dir = backends, run_dir
        # A run that starts from step 0 starts new tracked runs, even where a crashed one left its state.
        self.state = _read_state(run_dir) if resumed_step else {}
        # A resumed run repeats the steps after its checkpoint: those a backend already took are not sent twice.
        self.logged = {b.name: self.state.get(b.name, {}).get("logged_through", 0) for b in backends}
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="dist_trainer-tracking", daemon=True)
        if backends:
            self._thread.start()

    def start(self, flat_config: Dict[str, Any], summary: Dict[str, Any]) -> None:
        for backend in list(self.backends):
            self._call(backend, lambda b=backend: self._open(b, flat_config, summary))

    def log(self, record: Dict[str, Any]) -> None:
        step = record["step"]
        values = metrics_of(record)
        for backend in self.backends:
            if step > self.logged[backend.name]:
                self._call(backend, lambda b=backend: self._log(b, values, step))

    def finish(self, artifacts: List[Path]) -> None:
        """Send the artifacts, close every backend, and wait (at most CLOSE_TIMEOUT_S) for the queue to drain."""
        if not self.backends:
            return
        for backend in self.backends:
            self._call(backend, lambda b=backend: (b.artifacts(artifacts), b.finish()))
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("tracking: %s still sending after %.0f s; leaving it (metrics.jsonl is complete)",
                        ", ".join(b.name for b in self.backends), CLOSE_TIMEOUT_S)

    # -- the tracking thread --

    def _call(self, backend: Backend, work: Callable[[], None]) -> None:
        self._queue.put(lambda: self._guarded(backend, work))

    def _guarded(self, backend: Backend, work: Callable[[], None]) -> None:
        if backend not in self.backends:
            return  # dropped after an earlier failure
        try:
            work()
        except Exception as err:  # a tracker's failure never stops training
            self.backends.remove(backend)
            log.warning("tracking: %s failed (%s: %s); it is dropped for the rest of this run, training and "
                        "metrics.jsonl go on", backend.name, type(err).__name__, str(err).splitlines()[0][:300])

    def _drain(self) -> None:
        while (work := self._queue.get()) is not None:
            work()

    def _open(self, backend: Backend, flat_config: Dict[str, Any], summary: Dict[str, Any]) -> None:
        previous = self.state.get(backend.name, {}).get("id")  # none unless resumed (see __init__)
        run_id = backend.start(previous)
        self.state.setdefault(backend.name, {})["id"] = run_id
        _write_state(self.run_dir, self.state)
        if previous is None:
            backend.config(flat_config, summary)
        log.info("tracking: %s run %s%s", backend.name, run_id, " (resumed)" if previous else "")

    def _log(self, backend: Backend, values: Dict[str, float], step: int) -> None:
        backend.log(values, step)
        self.logged[backend.name] = step
        self.state.setdefault(backend.name, {})["logged_through"] = step
        _write_state(self.run_dir, self.state)


def _read_state(run_dir: Path) -> Dict[str, Any]:
    path = run_dir / STATE_FILE
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        log.warning("tracking: %s is unreadable; the tracked runs start anew", path)
        return {}


def _write_state(run_dir: Path, state: Dict[str, Any]) -> None:
    """Whole or not at all: a crash mid-write leaves the previous state."""
    path, tmp = run_dir / STATE_FILE, run_dir / f".tmp-{STATE_FILE}"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def final_artifacts(run_dir: Path, hf_model: bool) -> List[Path]:
    """The report's PNGs (written now, where matplotlib is installed) and, if asked, hf_model/."""
    paths: List[Path] = []
    try:
        from ..report import load_records, write_plots

        out = run_dir / "report"
        out.mkdir(exist_ok=True)
        paths += write_plots(load_records(run_dir / "metrics.jsonl"), out, f"Run {run_dir.resolve().name}")
    except (ImportError, SystemExit):  # report raises SystemExit without matplotlib
        log.info("tracking: no report PNGs to upload (pip install matplotlib)")
    if hf_model and (run_dir / "hf_model").is_dir():
        paths.append(run_dir / "hf_model")
    return paths


def build(names: List[str], cfg: Any, run_dir: Path, is_main: bool, resumed_step: int) -> Trackers:
    """The trackers ``logger`` names (rank 0; an empty set elsewhere)."""
    backends: List[Backend] = []
    if is_main:
        name = run_dir.resolve().name
        if "wandb" in names:
            from .wandb_run import WandbRun

            backends.append(WandbRun(cfg.logging.wandb, run_dir, name))
        if "mlflow" in names:
            from .mlflow_run import MlflowRun

            backends.append(MlflowRun(cfg.logging.mlflow, name))
    return Trackers(backends, run_dir, resumed_step)
