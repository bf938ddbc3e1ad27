"""Background checkpoints (trainer.ckpt_async=true), with real processes and files on disk.

What is proved here:

* a run that checkpoints every step in the background writes checkpoints whose
  tensors (model, optimizer, loss scaler, RNG states, shards) are bit-identical
  to a blocking run's, trains bit-identically to it, and a resume from a
  checkpoint written in the background ends bit-identical to the blocking run;
  for ddp, and in the slow set for fsdp, hsdp and fp16-master (with its scaler);
* the staged copy's size (ckpt_staging_mb in metrics.jsonl) is plan mode's;
* at most one save is in flight: the next waits for it (ckpt_wait_s), and
  checkpoints are sealed in order; a write that fails on one rank is raised on
  every rank at the same step, with the partial checkpoint removed and the
  sealed ones intact (spawned ranks calling the saves directly, a pickled
  object holding the write on a gate, so that no timing decides anything);
* a run killed while a background write is under way (its rank frozen with
  SIGSTOP mid-write, then every process SIGKILLed) leaves the previous
  checkpoint sealed and intact, and the next start removes the unsealed one
  and resumes bit-identically (slow set);
* a node without the host memory for its ranks' copies is refused before training.

The preemption and full-disk cases are in test_checkpoint.py and test_disk_full.py.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict

import pytest
import torch

from dist_trainer.checkpoint import SHARDS, list_checkpoints, load_shards, shard_tensor_shapes, verify
from helpers import run_ranks
from test_checkpoint import (TINY, Job, assert_bit_identical, assert_same_metrics, ckpt, copy_run, metrics,
                             resumed_from, run, run_all)

STEPS = 6
# 2 ranks, accum 2, a checkpoint every step, all kept: each save waits for the one before it.
BASE = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", "optim.warmup_steps=3",
               "optim.schedule=constant", "trainer.ckpt_every=1", "trainer.keep_checkpoints=10",
               f"trainer.max_steps={STEPS}", "+model.bias=false"]
MODES = {
    "ddp": [],
    "fsdp": ["dist.strategy=fsdp"],
    "hsdp": ["dist.strategy=fsdp", "dist.fsdp.shard_size=1"],  # 2 replicas of a shard group of one
    "fp16_master": ["precision=fp16-master", "precision.loss_scale.growth_interval=2"],
}


def checkpoint_tensors(path: Path) -> Dict[str, Any]:
    """Every file of a checkpoint as loaded: shared.pt, the RNG files, and the shards' tensors whole."""
    loaded: Dict[str, Any] = {name.name: torch.load(name, weights_only=True) for name in sorted(path.glob("*.pt"))}
    if (path / SHARDS).is_dir():
        whole = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in
                 shard_tensor_shapes(path / SHARDS).items()}
        load_shards(whole, path / SHARDS)
        loaded[SHARDS] = whole
    return loaded


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal structure and values; tensors bit for bit, dtype included."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _pair(root: Path, mode: str) -> SimpleNamespace:
    """The blocking and the background run of one mode, then a resume of the background one's step-5 checkpoint."""
    args = BASE + MODES[mode]
    sync, bg = root / f"{mode}-sync", root / f"{mode}-async"
    results = run_all([(args + [f"hydra.run.dir={sync}"], 2),
                       (args + ["trainer.ckpt_async=true", f"hydra.run.dir={bg}"], 2)], root, timeout=240)
    for result in results:
        assert result.returncode == 0, result.output[-4000:]
    resumed = copy_run(bg, root / f"{mode}-resumed")
    shutil.rmtree(ckpt(resumed, STEPS))  # the last one is always blocking: resume from one written in the background
    (resumed / "final_model.pt").unlink()
    again = run(args + ["trainer.ckpt_async=true", f"hydra.run.dir={resumed}"], root, nproc=2)
    assert again.returncode == 0, again.output[-4000:]
    return SimpleNamespace(sync=sync, bg=bg, resumed=resumed, output=results[1].output, resume_output=again.output)


def _check_pair(runs: SimpleNamespace) -> None:
    # The same training, and the same checkpoints, tensor for tensor.
    assert_same_metrics(runs.bg, runs.sync, STEPS)
    assert_bit_identical(runs.bg, runs.sync)
    for step in range(1, STEPS + 1):
        assert verify(ckpt(runs.bg, step)) is None, step
        assert_same(checkpoint_tensors(ckpt(runs.bg, step)), checkpoint_tensors(ckpt(runs.sync, step)), f"step {step}")
    # Steps 1-5 were staged and written in the background; the last one blocked (nothing runs at exit).
    records = metrics(runs.bg)
    assert all(r["ckpt_blocking_s"] > 0 for r in records)
    planned = json.loads((runs.bg / "plan.json").read_text())["ckpt_staging_mb"]
    assert [r.get("ckpt_staging_mb") for r in records] == [planned] * (STEPS - 1) + [None]
    # Each background write is sealed exactly once, logged at the step every rank learned it, or waited for.
    assert sum("ckpt_write_s" in r for r in records) == STEPS - 1
    for step in range(1, STEPS):
        assert f"step {step}: checkpoint {ckpt(runs.bg, step)} (written in the background" in runs.output
    # The blocking run's steps waited for the whole write; they stage nothing.
    assert all(r["ckpt_blocking_s"] > 0 and "ckpt_staging_mb" not in r and "ckpt_write_s" not in r
               for r in metrics(runs.sync))
    # A resume from the checkpoint of step 5, written in the background, ends bit-identical to the blocking run.
    assert resumed_from(runs.resume_output) == str(ckpt(runs.resumed, STEPS - 1))
    assert_same_metrics(runs.resumed, runs.sync, STEPS)
    assert_bit_identical(runs.resumed, runs.sync)


def test_background_and_blocking_checkpoints_hold_the_same_tensors_and_resume_bit_identical(tmp_path):
    _check_pair(_pair(tmp_path, "ddp"))


@pytest.mark.slow  # 1 min of real launches each: .ci/run runs them with the slow set
@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "fp16_master"])
def test_background_checkpoints_of_sharded_and_master_runs_equal_blocking_ones(tmp_path, mode):
    runs = _pair(tmp_path, mode)
    _check_pair(runs)
    if mode == "fsdp":  # every rank staged and wrote its own shards
        manifest = json.loads((ckpt(runs.bg, 1) / "manifest.json").read_text())
        assert {name.split("/")[1][:3] for name in manifest["files"] if name.startswith(f"{SHARDS}/__")} == \
            {"__0", "__1"}
    if mode == "fp16_master":  # the scaler moved, and its state is in every checkpoint
        scales = [r["loss_scale"] for r in metrics(runs.bg)]
        assert len(set(scales)) > 1, scales


def test_the_stager_copies_into_the_same_buffers_save_after_save_and_keeps_ties():
    from dist_trainer.checkpoint.background import Stager

    weight = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"emb": weight, "head": weight.detach()}, "optimizer": [torch.ones(4)], "step": 1}
    stager = Stager()
    first, size = stager.stage(state)
    assert size == (6 + 4) * 4  # the tied weight once
    assert first["model"]["emb"] is first["model"]["head"] and first["step"] == 1
    assert torch.equal(first["model"]["emb"], weight) and first["model"]["emb"].data_ptr() != weight.data_ptr()
    buffers = {name: t.data_ptr() for name, t in (("emb", first["model"]["emb"]), ("moment", first["optimizer"][0]))}
    weight.add_(1.0)  # training went on: the copy did not move
    assert torch.equal(first["model"]["emb"], torch.arange(6.0).reshape(2, 3))
    second, _ = stager.stage(state)  # the next save: the same buffers, refilled
    assert {"emb": second["model"]["emb"].data_ptr(), "moment": second["optimizer"][0].data_ptr()} == buffers
    assert torch.equal(second["model"]["emb"], weight)


# --------------------------------------------------------------------------- the protocol, on spawned ranks

class Gate:
    """Pickled into rank 0's shared.pt: holds the background write until ``path`` exists, or fails it."""

    def __init__(self, path: str, fail: bool = False):
        self.path, self.fail = path, fail

    def __deepcopy__(self, memo):  # staging copies it as it is: the write, not the step, must meet the gate
        return self

    def __reduce__(self):
        while not os.path.exists(self.path):
            time.sleep(0.01)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return (collections.OrderedDict, ())


def _steps(saves, busy_steps: int = 200):
    """Steps with the step all-reduce's busy count, until the write ends everywhere: (step, figures or error)."""
    import torch.distributed as dist

    for step in range(busy_steps):
        flag = torch.tensor([float(saves.busy())])
        dist.all_reduce(flag)
        try:
            figures = saves.after_step(flag.item() > 0)
        except Exception as err:  # noqa: BLE001 - what the training loop would raise
            return step, f"{type(err).__name__}: {err}"
        if figures:
            return step, figures
        time.sleep(0.02)
    return None, None


def _protocol(rank, world_size, run_dir, gate_dir):
    from dist_trainer import distributed
    from dist_trainer.checkpoint.background import BackgroundSaves

    env = distributed.init("cpu")
    root, gate_dir = Path(run_dir) / "checkpoints", Path(gate_dir)
    saves = BackgroundSaves(env, keep=10, keep_every=0, timeout_s=60)
    out: Dict[str, Any] = {}
    state = lambda step, gate=None: ({"loop": {"step": step}, "w": torch.full((4,), float(step)),  # noqa: E731
                                      "gate": gate}, None)

    first: Dict[str, float] = {}
    saves.save(root, 1, *state(1, Gate(str(gate_dir / "one"))), False, first.update)
    out["first"] = dict(first)
    out["busy_after_first"] = saves.busy()
    out["first_steps"] = _steps(saves, busy_steps=5)  # the gate is shut: still busy at every step
    if rank == 0:
        threading.Timer(1.0, (gate_dir / "one").touch).start()
    second: Dict[str, float] = {}
    saves.save(root, 2, *state(2), False, second.update)  # waits for the first
    out["second"] = dict(second)
    out["sealed_when_second_staged"] = [p.name for p in list_checkpoints(root)]
    out["second_steps"] = _steps(saves)
    # A write that fails on rank 0 only (the gate opens at once) reaches every rank at the same step.
    (gate_dir / "three").touch()
    saves.save(root, 3, *state(3, Gate(str(gate_dir / "three"), fail=True)), False, lambda figures: None)
    out["third_steps"] = _steps(saves)
    out["sealed"] = [p.name for p in list_checkpoints(root)]
    out["leftovers"] = sorted(p.name for p in root.glob(".tmp-*"))
    saves.close()
    return out


def test_one_save_in_flight_and_a_failed_write_stops_every_rank_at_the_same_step(tmp_path):
    gates = tmp_path / "gates"
    gates.mkdir()
    out = run_ranks(_protocol, 2, tmp_path, str(tmp_path / "run"), str(gates))
    for rank in out:
        assert rank["first"]["ckpt_blocking_s"] < 1.0 and "ckpt_staging_mb" in rank["first"]
        assert rank["busy_after_first"]
        assert rank["first_steps"] == (None, None)  # never done while the gate is shut
        # The second save waited for the first (about the gate's second), which was then sealed, alone.
        assert rank["second"]["ckpt_wait_s"] > 0.5 and rank["second"]["ckpt_write_s"] > 0.5
        assert rank["sealed_when_second_staged"] == ["step_00000001"]
        assert "ckpt_write_s" in rank["second_steps"][1]
        # The failure: one message on every rank, naming the checkpoint, the phase and the cause.
        step, error = rank["third_steps"]
        assert error.startswith("CheckpointWriteError: checkpoint step_00000003 failed while writing the checkpoint "
                                "files") and "rank 0: OSError: [Errno 28] No space left on device" in error, error
        assert rank["sealed"] == ["step_00000002", "step_00000001"] and rank["leftovers"] == []
    assert out[0]["third_steps"] == out[1]["third_steps"]  # the same step, the same message
    assert out[0]["second_steps"][0] == out[1]["second_steps"][0]


# --------------------------------------------------------------------------- a crash mid-write

@pytest.mark.slow  # a real 2-rank run frozen and killed mid-write, then resumed: .ci/run runs it
def test_a_run_killed_during_a_background_write_resumes_from_the_sealed_one(tmp_path):
    args = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", "trainer.ckpt_every=1",
                   "trainer.keep_checkpoints=1", "trainer.max_steps=40", "trainer.ckpt_async=true"]
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    with Job(args + [f"hydra.run.dir={ref}"], tmp_path, nproc=2) as reference, \
            Job(args + [f"hydra.run.dir={run_dir}"], tmp_path, nproc=2) as job:
        frozen, deadline = None, time.monotonic() + 150
        while frozen is None:  # freeze rank 1 while a write is under way; if it sealed first, try the next one
            assert job.proc.poll() is None and time.monotonic() < deadline, job.output()[-4000:]
            root = run_dir / "checkpoints"
            unsealed = list(root.glob(".tmp-step_*")) if root.is_dir() else []
            if not unsealed or not list_checkpoints(root):  # one after the first: a sealed one must precede it
                time.sleep(0.002)
                continue
            workers = job.workers()
            os.kill(workers[1], signal.SIGSTOP)
            time.sleep(0.3)  # whatever rank 0's writer could still do alone, it has done
            if unsealed[0].exists():
                frozen = unsealed[0]
            else:
                os.kill(workers[1], signal.SIGCONT)
        sealed = list_checkpoints(root)
        job.kill()  # SIGKILL to every process, the frozen one included
        assert reference.wait(240) == 0, reference.output()[-4000:]
    # Pruning waits for the newer checkpoint's seal: the previous one is there and intact (keep_checkpoints=1).
    assert len(sealed) == 1 and int(sealed[0].name[5:]) == int(frozen.name[len(".tmp-step_"):]) - 1
    assert verify(sealed[0]) is None
    assert frozen.exists()
    proc = run(args + [f"hydra.run.dir={run_dir}"], tmp_path, nproc=2, timeout=240)
    assert proc.returncode == 0, proc.output[-4000:]
    assert "was never sealed" in proc.output and not frozen.exists()
    assert resumed_from(proc.output) == str(sealed[0])
    assert_same_metrics(run_dir, ref, 40)
    assert_bit_identical(run_dir, ref)


# --------------------------------------------------------------------------- host memory

def test_a_node_without_host_memory_for_the_copies_is_refused_naming_the_key():
    from dist_trainer import hostmem
    from dist_trainer.checkpoint.background import host_memory_problem

    available = hostmem.available_bytes()
    assert available is not None and available > 0
    assert host_memory_problem(100.0, 8, 801 * 2**20) is None
    problem = host_memory_problem(100.0, 8, 799 * 2**20)
    assert "trainer.ckpt_async=false" in problem and "800.0 MiB for this node's 8 rank(s)" in problem
    assert "only 799.0 MiB are available" in problem
