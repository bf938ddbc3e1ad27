"""A disk that fills during a checkpoint, with a real tmpfs as the run directory (mounted as root).

2 ranks under torchrun. The run checkpoints at step 2; while step 3 is in
progress (held on a gate) the test fills the tmpfs, leaving room for the
metrics but not for a checkpoint, so the checkpoint at step 4 fails:

* under trainer.ckpt_async=true too, where the write runs in the background
  after step 4 and fails there: every rank learns of it at the same later step;
* every rank stops with the same exit status and one message that says what
  failed, where, how much a checkpoint needs, how much is free and which
  checkpoint is intact; no gloo peer error;
* the partial checkpoint is removed and the one of step 2 is untouched;
* once space is freed (and with a stale temporary checkpoint left as debris,
  as a killed write leaves it), the same command resumes from step 2 and
  finishes, with no manual cleanup; checkpoints beyond trainer.keep_checkpoints
  are pruned at start, the newest valid ones kept.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from dist_trainer.checkpoint import list_checkpoints, verify
from test_checkpoint import TINY, Job, ckpt, gated, metrics, resumed_from, run

ARGS = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", "trainer.ckpt_every=2",
               "trainer.keep_checkpoints=1", "trainer.max_steps=6"]
GATE_STEP = 3  # accum 2 on 2 ranks: rank 1's forward 2s-1 is the first micro-batch of step s


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path, leave: int) -> Path:
    """A ballast file that leaves ``leave`` bytes free on the mount."""
    ballast = mount / "ballast"
    free = shutil.disk_usage(mount).free
    with open(ballast, "wb") as f:
        f.truncate(0)
        block = b"\0" * (1 << 16)
        remaining = free - leave
        while remaining > 0:
            f.write(block[:min(len(block), remaining)])
            remaining -= len(block)
    return ballast


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
@pytest.mark.parametrize("background", [False, True], ids=["blocking", "ckpt_async"])
def test_full_disk_stops_every_rank_cleanly_and_the_run_resumes_once_space_allows(tmpfs, tmp_path, background):
    run_dir = tmpfs / "run"
    gate = tmp_path / "gate"
    args = ARGS + [f"trainer.ckpt_async={str(background).lower()}"]
    with Job(args + gated(gate, 2 * GATE_STEP - 1, rank=1) + [f"hydra.run.dir={run_dir}"], tmp_path, nproc=2) as job:
        deadline = time.monotonic() + 150
        while not Path(f"{gate}.waiting").exists():
            assert job.proc.poll() is None, job.output()[-4000:]
            assert time.monotonic() < deadline, job.output()[-4000:]
            time.sleep(0.02)
        while background and not (ckpt(run_dir, 2) / "manifest.json").exists():  # its write may still run
            assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-4000:]
            time.sleep(0.02)
        assert verify(ckpt(run_dir, 2)) is None
        size = sum(p.stat().st_size for p in ckpt(run_dir, 2).rglob("*") if p.is_file())
        ballast = _fill(tmpfs, 64 * 1024)  # room for metrics lines, not for another checkpoint
        assert size > 2 * 64 * 1024
        gate.touch()
        rc = job.wait(150)
        out = job.output()
    assert rc != 0
    # One message, naming what failed, where, what it needs, what is free and what is intact.
    assert "checkpoint step_00000004 failed while writing the checkpoint files" in out, out[-4000:]
    assert "MiB are free there (the disk is full)" in out and "A checkpoint needs about" in out
    assert "the newest intact one is step_00000002, untouched" in out
    assert "Connection closed by peer" not in out
    # Every rank raised the same error and exits with 2, as for any clean error; torchrun may SIGTERM
    # the one still tearing down when it sees the first exit (-15), never a crash or a peer error.
    codes = re.findall(r"exitcode  : (-?\d+)", out)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, out[-3000:]
    root_cause = out[out.index("Root Cause (first observed failure):"):]
    assert "traceback : CheckpointWriteError: checkpoint step_00000004 failed" in root_cause
    # The partial checkpoint is gone; the one of step 2 is intact.
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]
    assert verify(ckpt(run_dir, 2)) is None
    # A background write fails after its step: every rank learns of it at the same later step. At step 5
    # that is before step 5's record; if the failing write still ran at step 5's all-reduce (a loaded
    # machine), the last step, 6, waits for it in its own save, whose record is written even when the save
    # fails (run.save_with_record), as step 4's is above.
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == [1, 2, 3, 4] if not background else steps in ([1, 2, 3, 4], [1, 2, 3, 4, 5],
                                                                  [1, 2, 3, 4, 5, 6]), steps

    # Space again; a killed write's debris is there too, and an older checkpoint beyond keep_checkpoints=1.
    ballast.unlink()
    stale = run_dir / "checkpoints" / ".tmp-step_00000004"
    stale.mkdir()
    (stale / "shared.pt").write_bytes(os.urandom(1 << 20))
    older = run_dir / "checkpoints" / "step_00000001"
    shutil.copytree(ckpt(run_dir, 2), older)  # sealed, valid, and older than the newest valid one
    proc = run(args + [f"hydra.run.dir={run_dir}"], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.output[-4000:]
    assert resumed_from(proc.output) == str(ckpt(run_dir, 2))
    assert "was never sealed" in proc.output
    assert not stale.exists() and not older.exists()
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 7))
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000006"]
