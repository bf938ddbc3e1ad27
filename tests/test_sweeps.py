"""Hydra sweeps through hydra-submitit-launcher: each point a job whose tasks are the ranks.

``python -m dist_trainer -m ... hydra/launcher=submitit_local`` (a laptop) and
``hydra/launcher=submitit_slurm`` (the real one-node Slurm of
tests/slurm_cluster.py) run every point of the sweep as one submitit job of 2
tasks: the tasks are ranks 0 and 1 of one gloo group (no torchrun), each
point in its own run directory under hydra.sweep.dir. On Slurm, a point
preempted with submitit's signal (USR2, as ``--signal=USR2@...`` sends it before
the time limit) finishes its step, checkpoints, is requeued by submitit, and
resumes to the weights of a run never interrupted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO
from test_checkpoint import JOB2, LAUNCHER_VARS, TESTS, gated, metrics, run

LRS = (1e-3, 3e-4)
STEPS, GATE_STEP = 12, 5
ARGS = JOB2 + [f"trainer.max_steps={STEPS}", "trainer.ckpt_every=100"]
TASKS = ["hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1"]


@pytest.fixture
def sweep():
    """Starts ``python -m dist_trainer -m`` over LRS; whatever a test leaves running is killed after it."""
    procs = []

    def start(launcher: str, sweep_dir: Path, extra: list, env: dict, cwd: Path, lrs=LRS) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "dist_trainer", "-m", f"optim.lr={','.join(map(str, lrs))}",
               f"hydra/launcher={launcher}", *TASKS, f"hydra.sweep.dir={sweep_dir}", *extra]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), **extra)
    return env


def _check_points(sweep_dir: Path) -> None:
    """Both points trained all their steps as 2 ranks, each with its own learning rate and run directory."""
    for point, lr in enumerate(LRS):
        run_dir = sweep_dir / str(point)
        records = metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), (point, records[-1:])
        assert f"lr: {lr}" in (run_dir / ".hydra" / "config.yaml").read_text()
        # In warmup here: each step's lr is the point's lr times the same fraction.
        assert [r["lr"] / lr for r in records] == pytest.approx([r["lr"] / LRS[0] for r in metrics(sweep_dir / "0")])
        assert json.loads((run_dir / "plan.json").read_text())["world_size"] == 2
        assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
        assert "world size 2 x micro batch 8 x accum steps 2" in (run_dir / "rank0.log").read_text()
        assert (run_dir / ".hydra" / "overrides.yaml").exists() and (run_dir / "final_model.pt").exists()
        assert not (run_dir / "rank0").exists()  # one directory per point, not one per rank


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_submitit_local_sweep_runs_each_point_as_two_ranks_in_its_own_run_directory(sweep, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep("submitit_local", sweep_dir, ARGS, _env(), tmp_path)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-4000:]
    _check_points(sweep_dir)
    # The two points differ only by their learning rate: the same first loss, then they part.
    first, second = (metrics(sweep_dir / p) for p in ("0", "1"))
    assert first[0]["loss"] == second[0]["loss"] and first[-1]["loss"] != second[-1]["loss"]


@pytest.mark.slow  # two points, one failing on every rank: about 25 s
def test_a_point_with_a_bad_value_fails_the_sweep_with_its_error_and_the_others_train(sweep, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep("submitit_local", sweep_dir, ARGS + ["trainer.max_steps=2", "batch.global_batch_size=32,31"],
                 _env(), tmp_path, lrs=LRS[:1])
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0
    # The point's own error, raised again by the sweep's command (Hydra names the point's overrides).
    assert re.search(r"ConfigError: batch.global_batch_size=31 is not", out), out[-3000:]
    assert [r["step"] for r in metrics(sweep_dir / "0")] == [1, 2]  # the good points trained


# ----------------------------------------------------------------------------------------- Slurm


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen, cluster, sweep_dir: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or proc.poll() is not None:
            logs = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}"
                             for p in sorted((sweep_dir / ".submitit").glob("*/*_log.*")))
            pytest.fail(f"no {what} after {timeout} s (launcher {'exited' if proc.poll() is not None else 'running'})"
                        f"\n{logs}\n{cluster.logs()[-3000:]}")
        time.sleep(0.1)


def _running_job(cluster) -> str:
    """The array task Slurm runs now (``<array>_<index>``), or '' if none."""
    out = subprocess.run(["squeue", "-h", "-t", "R", "-o", "%i"], env=cluster.env(), capture_output=True, text=True)
    jobs = out.stdout.split()
    return jobs[0] if len(jobs) == 1 else ""


@pytest.mark.slurm
def test_slurm_sweep_trains_both_points_and_a_preempted_point_resumes_bit_identically(cluster, sweep, tmp_path):
    """Two points, 2 tasks each, one after the other on the node's 2 CPUs; the first one to run is preempted.

    Both points hold rank 1 in step 5 until the gate opens. The test sends the running job
    submitit's signal (``scancel --signal=USR2``, what ``--signal=USR2@120`` sends before the
    time limit), waits until rank 1 has it, and opens the gate: the ranks finish step 5 and
    checkpoint, rank 0 hands the signal to submitit, which pickles the job and requeues it.
    The requeued job resumes in the same run directory; the other point runs untouched.
    """
    gate, sweep_dir = tmp_path / "gate", tmp_path / "sweep"
    env = _env(SLURM_CONF=str(cluster.conf))
    proc = sweep("submitit_slurm", sweep_dir, ARGS + gated(gate, 2 * GATE_STEP - 1, rank=1), env, tmp_path)

    # 1. The first point to run is held in step 5; its tasks get USR2.
    _wait(lambda: Path(f"{gate}.waiting").exists() and _running_job(cluster), 180, "a point held in step 5",
          proc, cluster, sweep_dir)
    job = _running_job(cluster)
    point = job.split("_")[1]
    run_dir = sweep_dir / point
    sent = subprocess.run(["scancel", "--signal=USR2", job], env=cluster.env(), capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    _wait(lambda: "SIGUSR2 received" in (run_dir / "rank1.log").read_text(), 60, "the signal at rank 1",
          proc, cluster, sweep_dir)
    gate.touch()  # step 5 finishes; both ranks stop after it

    # 2. submitit requeues it; released from Slurm's requeue delay once the node is done with it
    # (as in test_slurm_real.py: earlier, slurmd refuses the launch).
    raw = re.search(r"\bJobId=(\d+)", cluster.scontrol("show", "job", job).stdout).group(1)
    _wait(lambda: cluster.job_state(job) == "PENDING" and f"[{raw}.0] done with job" in cluster.slurmd_log()
          and time.time() > cluster.logged_at(f"[{raw}.batch] done with job") + 2,
          120, "the requeued job pending", proc, cluster, sweep_dir)
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, GATE_STEP + 1))
    assert not (run_dir / "final_model.pt").exists()
    task0_log = next((sweep_dir / ".submitit" / job).glob(f"{job}_0_log.err")).read_text()
    # submitit's handler had the signal from rank 0, after the checkpoint, and requeued the job.
    assert "Caught signal SIGUSR2" in task0_log and "DUE TO JOB REQUEUE" in task0_log, task0_log[-3000:]
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")

    # 3. The sweep ends once both points have: the preempted one resumed from step 5.
    _wait(lambda: proc.poll() is not None, 300, "the sweep to end", proc, cluster, sweep_dir)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    _check_points(sweep_dir)
    assert re.search(rf"resuming from \S+step_{GATE_STEP:08d} \(step {GATE_STEP}\)",
                     (run_dir / "rank0.log").read_text())

    # The preempted point, never interrupted (plain torchrun, the same overrides): the same weights.
    ref_dir = tmp_path / "ref"
    ref = run(ARGS + [f"optim.lr={LRS[int(point)]}", f"hydra.run.dir={ref_dir}"] + gated(gate, 2 * GATE_STEP - 1, rank=1),
              tmp_path, nproc=2)
    assert ref.returncode == 0, ref.output[-4000:]
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    want = torch.load(ref_dir / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["loss"] for r in metrics(run_dir)] == [r["loss"] for r in metrics(ref_dir)]
