"""launch/slurm/train.sbatch on a real Slurm: a one-node cluster started on this machine.

Debian's Slurm (slurmctld, slurmd, munge) is found or installed (root, apt-get:
tests/slurm_cluster.py), started in a directory of its own and stopped after
the test. The job is the real script, submitted with sbatch, running torchrun
with 2 ranks on the node:

1. it trains; while step 5 is held on a gate, ``scancel --signal=USR1 --batch``
   (what ``--signal=B:USR1@120`` does before a time limit) reaches the batch
   shell, which forwards it to the step: every rank finishes the step, writes a
   checkpoint and exits, and the job requeues itself;
2. the requeued job (``scontrol update StartTime=now`` skips Slurm's requeue
   delay) resumes in the same run directory and ends bit-identically to a run
   that was never interrupted.

The shim-based tests of test_launch.py (two nodes, elastic restarts) stay:
one real node does not replace them. Marked ``slurm``; skipped, with the
reason, where Slurm can be neither found nor installed.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, free_port
from slurm_cluster import SlurmCluster
from test_checkpoint import JOB2, TESTS, gated, metrics, run

pytestmark = pytest.mark.slurm

STEPS, GATE_STEP = 12, 5
ARGS = JOB2 + [f"trainer.max_steps={STEPS}", "trainer.ckpt_every=100"]


def _wait(predicate, timeout: float, what: str, cluster: SlurmCluster, job: str, output: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            text = output.read_text(errors="replace")[-4000:] if output.exists() else "(no job output)"
            pytest.fail(f"no {what} after {timeout} s; job {job} is {cluster.job_state(job)}\n{text}\n"
                        f"{cluster.logs()[-3000:]}")
        time.sleep(0.1)


def test_sbatch_on_real_slurm_trains_is_preempted_requeued_and_resumes_bit_identically(cluster, tmp_path):
    import subprocess

    gate = tmp_path / "gate"
    env = {**cluster.env(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    torchrun = Path(sys.executable).parent / "torchrun"
    exports = f"ALL,GPUS_PER_NODE=2,TORCHRUN={torchrun},RUN_ROOT={tmp_path / 'runs'},RDZV_PORT={free_port()}"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", f"--chdir={tmp_path}",
         f"--output={tmp_path}/slurm-%j.out", f"--export={exports}", str(REPO / "launch" / "slurm" / "train.sbatch"),
         *ARGS, *gated(gate, 2 * GATE_STEP - 1, rank=1)],
        env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    output, run_dir = tmp_path / f"slurm-{job}.out", tmp_path / "runs" / job

    # 1. Trained up to step 5, held there; the scheduler's warning signal to the batch shell.
    _wait(lambda: Path(f"{gate}.waiting").exists(), 180, "step 5 in progress", cluster, job, output)
    assert cluster.job_state(job) == "RUNNING"
    signal = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True)
    assert signal.returncode == 0, signal.stderr
    _wait(lambda: "closing signal SIGUSR1" in output.read_text(errors="replace"), 60, "the signal at the workers",
          cluster, job, output)
    gate.touch()  # step 5 finishes; every rank then stops after it
    _wait(lambda: "requeueing job" in output.read_text(errors="replace"), 120, "the requeue", cluster, job, output)
    stopped = [r["step"] for r in metrics(run_dir)]
    assert stopped == list(range(1, GATE_STEP + 1)), stopped
    assert (run_dir / "checkpoints" / f"step_{GATE_STEP:08d}").is_dir()
    assert not (run_dir / "final_model.pt").exists()

    # 2. The requeued job: started at once, resumes in the same run directory, and finishes.
    # Released only once slurmd itself says the first run's step is done, which can be seconds after
    # the batch script ended and the job shows PENDING (held by Slurm's requeue delay): released
    # earlier, slurmd refuses to launch it ("Job already killed") and the job fails.
    # And a credential's times have a resolution of one second: a launch within the second in which
    # the old one was revoked (when the batch step ended) is refused too.
    _wait(lambda: cluster.job_state(job) == "PENDING" and f"[{job}.0] done with job" in cluster.slurmd_log()
          and time.time() > cluster.logged_at(f"[{job}.batch] done with job") + 2,
          120, "the first run's steps to be done on the node", cluster, job, output)
    cluster.scontrol("update", f"JobId={job}", "StartTime=now")
    _wait(lambda: cluster.job_state(job) == "COMPLETED", 240, "the requeued job to complete", cluster, job, output)
    text = output.read_text(errors="replace")
    assert f"job {job} (restart 1)" in text, text[-4000:]
    assert re.search(rf"resuming from \S+step_{GATE_STEP:08d} \(step {GATE_STEP}\)", text), text[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, STEPS + 1))

    # The same job never interrupted (plain torchrun, the same arguments): the same final weights.
    ref_dir = tmp_path / "ref"
    ref = run(ARGS + gated(gate, 2 * GATE_STEP - 1, rank=1) + [f"hydra.run.dir={ref_dir}"], tmp_path, nproc=2)
    assert ref.returncode == 0, ref.output[-4000:]
    got = torch.load(run_dir / "final_model.pt", weights_only=True)
    want = torch.load(ref_dir / "final_model.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["loss"] for r in metrics(run_dir)] == [r["loss"] for r in metrics(ref_dir)]
