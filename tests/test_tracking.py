"""Tracking in Weights & Biases and MLflow, for real: wandb offline, and a real ``mlflow server`` on 127.0.0.1.

What is proved here:

* an offline W&B run of 2 ranks holds every field of every metrics.jsonl
  record at its step (read back from wandb's own file, tests/wandb_records.py),
  the composed config as flat keys, the plan's numbers as summary values and
  the report's PNGs as an artifact; a run continued in its directory logs into
  the same W&B run from the step after, each step once;
* a 2-rank run logged to a real MLflow server: every metric read back with
  MlflowClient equals metrics.jsonl at every step, the config is there as
  params, the report's PNGs as artifacts;
* a worker killed mid-run under torchrun --max-restarts: the restarted run
  logs into the same MLflow run and every step appears once;
* a server that goes away mid-run: a warning, training and metrics.jsonl
  complete;
* a missing package is a ConfigError naming the extra; a backend that fails
  is dropped while the others go on.

The W&B run and the rules run in the default suite; the continuation and the
MLflow server's tests (a server start and three launches, about 2 minutes) are
marked slow and run in .ci/run's second phase.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import pytest

from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.tracking import Trackers, flatten, metrics_of
from helpers import free_port, regression_config
from test_checkpoint import TINY, Job, gated, metrics, resumed_from, run, wait_for
from wandb_records import records

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

JOB = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", "optim.lr=1e-3", "optim.schedule=constant",
              "optim.warmup_steps=4"]  # accum 2 on 2 ranks; rank 1's forward 2s-1 is step s's first micro-batch


def _expected(record: dict) -> Dict[str, float]:
    return metrics_of(record)


def _history_by_step(run_dir: Path) -> Dict[int, dict]:
    """Every history row of every offline W&B file of this run directory, by step (a step twice fails)."""
    rows: Dict[int, dict] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for row in records(path)["history"]:
            step = row["_step"]
            assert step not in rows, f"step {step} logged twice"
            rows[step] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


# --------------------------------------------------------------------------- W&B, offline

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "dt-test"}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    run_dir = root / "run"
    first = run(JOB + ["trainer.max_steps=6", "logger=[jsonl,wandb]", f"hydra.run.dir={run_dir}"], root, 2,
                env_extra=WANDB_ENV)
    return run_dir, first, sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_an_offline_wandb_run_holds_every_metrics_record_the_config_and_the_plan(wandb_run):
    run_dir, first, files = wandb_run
    assert first.returncode == 0, first.output[-4000:]
    assert len(files) == 1, files
    got = records(files[0])
    state = (run_dir / "tracking.json").read_text()
    assert got["run_id"] and f'"id": "{got["run_id"]}"' in state, state
    rows = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")} for row in got["history"]}
    want = {r["step"]: _expected(r) for r in metrics(run_dir)[:6]}
    assert sorted(rows) == list(range(1, 7))
    for step, values in want.items():
        assert rows[step] == pytest.approx(values, rel=0, abs=0), step  # every field, exactly
    assert got["config"]["optim.lr"] == pytest.approx(1e-3) and got["config"]["batch.global_batch_size"] == 32
    assert got["config"]["model._target_"] == "dist_trainer.models.GPT"
    assert got["summary"]["plan/global_batch_size"] == 32 and got["summary"]["plan/accum_steps"] == 2
    assert got["summary"]["plan/parameters"] > 0 and got["summary"]["plan/state_mb"] > 0
    assert got["summary"]["plan/tokens_per_step"] == 32 * 32
    assert any("loss.png" in paths and "overview.png" in paths for paths in got["artifacts"]), got["artifacts"]


@pytest.mark.slow
def test_a_continued_run_logs_into_the_same_wandb_run_each_step_once(wandb_run, tmp_path):
    run_dir = wandb_run[0]
    second = run(JOB + ["trainer.max_steps=10", "logger=[jsonl,wandb]", f"hydra.run.dir={run_dir}"], tmp_path, 2,
                 env_extra=WANDB_ENV)
    assert second.returncode == 0, second.output[-4000:]
    assert resumed_from(second.output)
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({records(f)["run_id"] for f in files}) == 1, files  # one W&B run
    rows = _history_by_step(run_dir)
    assert sorted(rows) == list(range(1, 11))
    for record in metrics(run_dir):
        assert rows[record["step"]] == _expected(record), record["step"]


# --------------------------------------------------------------------------- MLflow, a real server

class MlflowServer:
    def __init__(self, root: Path):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = open(root / "mlflow-server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
             str(root / "artifacts"), "--workers", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'mlflow-server.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _mlflow_history(client, run_id: str, keys: List[str]) -> Dict[str, List[tuple]]:
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in keys}


def _one_run(client, experiment: str):
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(found) == 1, [r.info.run_id for r in found]
    return found[0]


@pytest.mark.slow
def test_a_two_rank_run_logged_to_a_real_mlflow_server_reads_back_as_metrics_jsonl(mlflow_server, tmp_path):
    run_dir = tmp_path / "run"
    proc = run(JOB + ["trainer.max_steps=6", "logger=[jsonl,mlflow]", f"logging.mlflow.tracking_uri={mlflow_server.uri}",
                      "logging.mlflow.experiment=plain", f"hydra.run.dir={run_dir}"], tmp_path, 2)
    assert proc.returncode == 0, proc.output[-4000:]
    client = _client(mlflow_server.uri)
    found = _one_run(client, "plain")
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    want = metrics(run_dir)
    keys = sorted(_expected(want[0]))
    history = _mlflow_history(client, found.info.run_id, keys)
    for key in keys:
        assert history[key] == [(r["step"], _expected(r)[key]) for r in want if key in _expected(r)], key
    params = found.data.params
    assert params["optim.lr"] == "0.001" and params["batch.global_batch_size"] == "32", params
    assert params["plan/global_batch_size"] == "32" and params["plan/accum_steps"] == "2"
    uploaded = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"loss.png", "overview.png", "ranks.png"} <= uploaded, uploaded


@pytest.mark.slow
def test_a_killed_worker_restarts_into_the_same_mlflow_run_each_step_once(mlflow_server, tmp_path):
    # Checkpoints every 4 steps; rank 1 is killed in step 7, so steps 5 and 6 were logged and run again.
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    args = JOB + gated(gate, 2 * 7 - 1, rank=1) + [
        "trainer.max_steps=10", "trainer.ckpt_every=4", "logger=[jsonl,mlflow]",
        f"logging.mlflow.tracking_uri={mlflow_server.uri}", "logging.mlflow.experiment=killed",
        f"hydra.run.dir={run_dir}"]
    with Job(args, tmp_path, 2, ["--max-restarts=1"]) as job:
        wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, "rank 1 in step 7")
        wait_for(lambda: '"logged_through": 6' in _read(run_dir / "tracking.json"), job, 60, "step 6 tracked")
        os.kill(job.workers()[1], signal.SIGKILL)
        gate.touch()
        code, output = job.wait(180), job.output()
    assert code == 0, output[-4000:]
    assert resumed_from(output) == str(run_dir / "checkpoints" / "step_00000004"), output[-4000:]
    client = _client(mlflow_server.uri)
    found = _one_run(client, "killed")  # the restart reopened the run it had
    history = _mlflow_history(client, found.info.run_id, ["loss", "samples"])
    want = metrics(run_dir)
    assert [step for step, _ in history["loss"]] == list(range(1, 11))  # each step once
    assert history["loss"] == [(r["step"], r["loss"]) for r in want]  # the resume is exact: the same values


@pytest.mark.slow
def test_a_server_that_goes_away_mid_run_leaves_training_and_metrics_jsonl_intact(tmp_path):
    server = MlflowServer(tmp_path)
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    args = JOB + gated(gate, 2 * 4 - 1, rank=0) + [
        "trainer.max_steps=10", "logger=[jsonl,mlflow]", f"logging.mlflow.tracking_uri={server.uri}",
        f"hydra.run.dir={run_dir}"]
    try:
        with Job(args, tmp_path, 2) as job:
            wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, "rank 0 in step 4")
            server.stop()
            gate.touch()
            code, output = job.wait(180), job.output()
    finally:
        server.stop()
    assert code == 0, output[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 11))
    assert "tracking: mlflow failed" in output and "dropped for the rest of this run" in output, output[-4000:]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# --------------------------------------------------------------------------- the rules on their own

def test_a_missing_tracker_package_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = regression_config(micro=4)
    cfg.logger = ["jsonl", "wandb"]
    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install -e '\.\[wandb\]'"):
        validate(cfg, 1)
    cfg.logger = ["jsonl", "neptune"]
    with pytest.raises(ConfigError, match=r"logger=.*'neptune' is not one of"):
        validate(cfg, 1)


def test_flat_config_and_metrics_of_a_record():
    assert flatten({"optim": {"lr": 0.1, "betas": [0.9, 0.95]}, "logger": "jsonl"}) == {
        "optim.lr": 0.1, "optim.betas": [0.9, 0.95], "logger": "jsonl"}
    assert metrics_of({"step": 3, "loss": 1.5, "skipped": True, "skip_reason": None, "mesh": "x", "items": 7}) == {
        "loss": 1.5, "skipped": 1.0, "items": 7.0}


class _Backend:
    def __init__(self, name: str, fail_at: int = 0):
        self.name, self.fail_at, self.steps = name, fail_at, []

    def start(self, resume_id):
        return resume_id or f"{self.name}-1"

    def config(self, flat, summary):
        pass

    def log(self, values, step):
        if step == self.fail_at:
            raise ConnectionError("server gone")
        self.steps.append(step)

    def artifacts(self, paths):
        pass

    def finish(self):
        pass


def test_a_failing_backend_is_dropped_the_others_go_on_and_a_resume_skips_what_was_taken(tmp_path, caplog):
    good, bad = _Backend("good"), _Backend("bad", fail_at=3)
    trackers = Trackers([good, bad], tmp_path, resumed_step=0)
    trackers.start({}, {})
    for step in range(1, 6):
        trackers.log({"step": step, "loss": 1.0})
    trackers.finish([])
    assert good.steps == [1, 2, 3, 4, 5] and bad.steps == [1, 2]
    assert "tracking: bad failed (ConnectionError: server gone)" in caplog.text
    again = _Backend("good")
    resumed = Trackers([again], tmp_path, resumed_step=3)  # steps 4 and 5 run again after the checkpoint
    resumed.start({}, {})
    for step in range(4, 8):
        resumed.log({"step": step, "loss": 1.0})
    resumed.finish([])
    assert again.steps == [6, 7]
