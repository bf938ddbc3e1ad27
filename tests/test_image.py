"""docker/Dockerfile built from the working tree and its ENTRYPOINT run, without a Docker daemon.

tests/image_build.py builds the image with buildah (chroot isolation, vfs
storage, as root) on a Debian bookworm base made with debootstrap and cached
between runs, reaching packages the way this machine's pip does. Then, in a
container of that image, with a host directory mounted at /workspace/runs as
Kubernetes mounts the runs PVC:

1. the ENTRYPOINT (tini -> dist-trainer-entrypoint -> torchrun) runs a 2-rank
   job as the image's user (uid 10001, group 0), which creates its run
   directory, runs/<run id>, and trains;
2. SIGTERM to the container's first process, tini (what the kubelet sends on
   an eviction or a node drain): through the entrypoint script torchrun passes
   it to the workers, each finishes its step, writes a checkpoint and exits
   with EXIT_REQUEUE (75); torchrun, ended by the signal, exits with 1, which
   the entrypoint turns into 75, the container's status;
3. started again on the same run directory (what a restarted pod does), it
   resumes from that checkpoint, finishes and exits with 0.

Marked ``image``; about 2 minutes with the base image cached, 3 without.
Skipped, with the reason, where buildah cannot run (not root, no namespaces,
buildah not installable). The built image and the container are removed
afterwards; the base image stays in the cache (image_build.CACHE).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import List

import pytest

from image_build import Buildah, Container, ImageError, available, build_image, ensure_base, pip_mounts, pip_settings

pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]  # a first run installs buildah and makes the base

NAME = "dist-trainer-test"  # of the images and containers made here: <NAME>-<pid of pytest>-<random>
UID, GID = 10001, 0  # the Dockerfile's USER and the group it gives it
RUNS = "/workspace/runs"
# A one-layer GPT, 2 ranks x micro 8 x accum 2 = global 32: about 15 ms a step on 2 cores. No checkpoint
# but the one the signal asks for; max_steps far beyond what runs before the test sends it.
JOB = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "trainer.eval_every=0",
       "trainer.eval_batches=1", "trainer.log_every=1", "trainer.device=cpu", "batch.global_batch_size=32",
       "batch.micro_batch_size=8", "optim.schedule=constant", "trainer.ckpt_every=0"]
TRAINED_BEFORE_SIGNAL = 30  # steps
# 2 ranks on 2 cores; gloo on loopback. chroot isolation has no PID namespace of its own, so tini is not
# PID 1 here: as a child subreaper it still reaps the orphans it would reap as PID 1 (and does not warn).
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TINI_SUBREAPER": "1"}


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    reason = available()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("image")
    buildah = Buildah()
    tag = f"localhost/{NAME}:{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        try:
            buildah.remove_stale(NAME)
            started = time.monotonic()
            base = ensure_base(buildah, root / "base.log")
            base_s = time.monotonic() - started
            build_image(buildah, tag, base, pip_mounts(pip_settings(sys.executable), root / "pip.conf"),
                        root / "build.log")
        except ImageError as err:
            pytest.fail(str(err), pytrace=False)
        print(f"image: base {base_s:.0f} s, build {time.monotonic() - started - base_s:.0f} s")
        yield SimpleNamespace(buildah=buildah, tag=tag, config=buildah.config(tag))
    finally:
        buildah.remove_image(tag)


@pytest.fixture
def container(image):
    box = Container(image.buildah, image.tag, f"{NAME}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield box
    finally:
        box.close()


def _output(proc: subprocess.Popen) -> str:
    return proc.log.read_text(errors="replace")


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the container exited ({proc.returncode}) before {what}:\n{_output(proc)[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout} s:\n{_output(proc)[-4000:]}")
        time.sleep(0.1)


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the container still runs after {timeout} s:\n{_output(proc)[-4000:]}")


def _metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the line rank 0 is writing now
            break
    return records


def _owners(root: Path) -> dict:
    """{(uid, gid): [paths]} for root and everything under it."""
    owners: dict = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        owners.setdefault((st.st_uid, st.st_gid), []).append(str(path.relative_to(root.parent)))
    return owners


def test_image_config_is_what_kubernetes_and_slurm_rely_on(image):
    config = image.config
    assert config["Entrypoint"] == ["tini", "--", "dist-trainer-entrypoint"]
    assert config["User"] == str(UID)  # numeric: runAsNonRoot can check it
    assert config["WorkingDir"] == "/workspace"
    cmd = config["Cmd"]
    assert cmd[cmd.index("-m") + 1] == "dist_trainer", cmd


def test_entrypoint_trains_as_the_image_user_checkpoints_on_sigterm_and_resumes(image, container, tmp_path):
    from dist_trainer.checkpoint import verify

    runs = tmp_path / "runs"  # the runs PVC: writable by the image's user
    runs.mkdir()
    os.chown(runs, UID, GID)
    launch = [*image.config["Entrypoint"], "--standalone", "--nproc_per_node=2", "-m", "dist_trainer", *JOB]

    # 1. The default run directory, runs/<torchrun's run id>, created and written by uid 10001.
    job = container.start(launch + ["trainer.max_steps=100000"], ENV, {runs: RUNS}, tmp_path / "evicted.log")
    _wait_for(lambda: any(len(_metrics(d)) >= TRAINED_BEFORE_SIGNAL for d in runs.iterdir()), 300,
              f"{TRAINED_BEFORE_SIGNAL} steps in runs/<run id>/metrics.jsonl", job)
    (run_dir,) = runs.iterdir()

    # 2. The kubelet's SIGTERM goes to the container's first process: here tini, which passes it to the
    # entrypoint script, which passes it to torchrun.
    tini = container.first_process("tini")
    assert tini, f"no tini among the container's processes:\n{_output(job)[-4000:]}"
    os.kill(tini, signal.SIGTERM)
    rc = _finish(job, 120)
    output = _output(job)
    stops = re.findall(r"step (\d+): stop requested by a signal; checkpoint written", output)
    assert stops, f"no checkpoint on SIGTERM (container exit status {rc}):\n{output[-4000:]}"
    stop = int(stops[0])
    for rank in (0, 1):  # each worker logs this right before it exits with EXIT_REQUEUE (75)
        assert f"step {stop}: stop requested by a signal" in (run_dir / f"rank{rank}.log").read_text()
    assert "Received 15 death signal, shutting down workers" in output, output[-4000:]
    assert "forcefully exiting" not in output, f"a worker had to be SIGKILLed:\n{output[-4000:]}"
    # torchrun, ended by the signal, exits with 1 whatever its workers' status; the entrypoint makes that
    # EXIT_REQUEUE, "stopped on request, run again to resume", the container's status (docs/launch.md).
    assert "torchrun exited with status 1 after SIGTERM" in output, output[-4000:]
    assert rc == 75, f"container exit status {rc}, expected 75 (EXIT_REQUEUE) after a SIGTERM:\n{output[-4000:]}"
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, stop + 1))
    assert TRAINED_BEFORE_SIGNAL <= stop < 100000
    assert all(math.isfinite(r["loss"]) for r in records)
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < first, f"no training: loss {first:.3f} at step 1, {last:.3f} over the last 5 steps"
    checkpoint = run_dir / "checkpoints" / f"step_{stop:08d}"
    assert verify(checkpoint) is None, verify(checkpoint)
    assert not (run_dir / "final_model.pt").exists()
    assert _owners(runs).keys() == {(UID, GID)}, _owners(runs)

    # 3. The restarted pod: the same run directory, named this time (--standalone draws a new run id).
    steps = stop + 4
    again = container.start(launch + [f"trainer.max_steps={steps}", f"hydra.run.dir={RUNS}/{run_dir.name}"], ENV,
                            {runs: RUNS}, tmp_path / "resumed.log")
    rc = _finish(again, 180)
    output = _output(again)
    assert rc == 0, output[-4000:]  # a run that completes: torchrun's 0, through the entrypoint
    assert "dist-trainer-entrypoint:" not in output, output[-4000:]  # no signal, nothing to say
    assert f"resuming from {RUNS}/{run_dir.name}/checkpoints/step_{stop:08d} (step {stop})" in output, output[-4000:]
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, steps + 1))
    assert (run_dir / "final_model.pt").is_file()
    assert sorted(p.name for p in runs.iterdir()) == [run_dir.name]
    assert _owners(runs).keys() == {(UID, GID)}, _owners(runs)
