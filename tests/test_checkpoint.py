"""Checkpoints and resume, with real processes: python -m dist_trainer and torchrun on gloo.

What is proved here:

* exact resume: a run stopped at step K and started again in the same run
  directory ends bit-identical to a straight run (fp32 on 2 ranks under torchrun,
  stopped mid-epoch and mid-warmup; fp16-mixed with dropout and a moving loss
  scale in one process);
* torchrun's elastic restart after a worker is SIGKILLed resumes and ends
  bit-identical to an uninterrupted run;
* a worker stopped with SIGSTOP (which torchrun never notices) ends the attempt
  within dist.step_timeout_s + 30 s, named with its pid and step by one error,
  rank 0's stacks in its log; the restart resumes and ends bit-identical;
* SIGUSR1 (preemption) on one worker: every rank stops after the same step,
  checkpoints, exits with EXIT_REQUEUE; a second start resumes and ends
  bit-identical, and the stop comes after the step the signal arrived in;
* SIGTERM to a whole process group with DataLoader workers (as torchrun,
  Slurm and Kubernetes send it): the workers ignore it, the main process
  checkpoints and exits with EXIT_REQUEUE;
* a resume on another world size keeps the global batch (accumulation
  re-derived) and matches to fp tolerance; one that cannot keep it exits 2
  naming batch.global_batch_size;
* non-finite losses in fp32: trainer.nonfinite=stop leaves earlier checkpoints
  untouched, =skip skips and continues until trainer.max_consecutive_skips;
* corrupt checkpoints are skipped for the newest valid one; a checkpoint whose
  pickle would run code is refused; only trainer.keep_checkpoints are kept.

Timing never decides an outcome: where a test must act while a known step is
in progress, helpers.FaultyGPT blocks that step's forward on a gate file until
the test has acted. Runs that depend on nothing are started together up front
(the ``jobs`` fixture) so that the two cores stay busy.

Every process is started in its own session with a tag in its environment;
the workers torchrun starts (in sessions of their own) inherit the tag, and
whatever carries it is SIGKILLed when a test leaves, pass or fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from dist_trainer.checkpoint import list_checkpoints, verify
from dist_trainer.signals import EXIT_REQUEUE
import preloaded
from helpers import REPO, assert_all_close_scaled, assert_close_scaled, free_port, run_ranks

TESTS = Path(__file__).resolve().parent

# A one-layer GPT on 32-byte windows: a few ms per step on CPU. eval only at the end (one micro-batch).
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "trainer.eval_every=0",
        "trainer.eval_batches=1", "trainer.log_every=1", "trainer.device=cpu"]

# The 2-rank fp32 job that the exact-resume, elastic, preemption and world-size tests share:
# global 32 = 2 ranks x micro 8 x accum 2. Every run of it has the same numbers: a split run sets
# trainer.max_steps=K for its first half and STEPS for its second, and a cosine schedule's length is
# max_steps, so the two halves would follow different lr curves; optim.schedule=constant (linear
# warmup over WARMUP updates, then flat) depends only on the update count, so all runs use the same lr.
WARMUP, K, STEPS = 16, 12, 24  # the split run stops at K: inside the warmup, and STEPS crosses its end
JOB2 = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", f"optim.warmup_steps={WARMUP}",
               "optim.schedule=constant", "trainer.ckpt_every=2"]
ASYNC_JOB2 = [a for a in JOB2 if not a.startswith("trainer.ckpt_every=")] + ["trainer.ckpt_every=1",
                                                                               "trainer.ckpt_async=true"]
FAULTY = ["model._target_=helpers.FaultyGPT"]  # the built-in GPT's parameters and numbers, plus test hooks

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_RANK")


# --------------------------------------------------------------------------- processes

def _tagged_pids(tag: str) -> List[int]:
    """Processes whose environment carries this job's tag (the job and everything it started)."""
    needle = f"DT_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _children(pid: int) -> List[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:
        pass
    return kids


def _env_of(pid: int) -> Dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


class Job:
    """``python -m dist_trainer`` (nproc=0) or torchrun with nproc ranks, in the background.

    The environment is run_module's (one thread, gloo on loopback, the repository
    on PYTHONPATH) plus tests/ (for helpers.FaultyGPT) and a unique tag; output
    goes to a file, so nothing blocks while a test polls the run directory.

    ``agent=False`` (run and run_all, where torchrun's agent is not what is tested): the process or the
    workers are forked from the preloaded server (tests/preloaded.py) with the environment torchrun gives
    its workers, instead of paying a new interpreter's imports each.
    """

    def __init__(self, args: List[str], cwd: Path, nproc: int = 0, torchrun_args: List[str] = (),
                 standalone: bool = True, env_extra: Optional[Dict[str, str]] = None, agent: bool = True):
        self.tag = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", DT_TEST_TAG=self.tag,
                   PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), **(env_extra or {}))
        if nproc:  # standalone=False: torchrun_args carry the rendezvous (--nnodes, --rdzv_*)
            cmd = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
                   f"--nproc_per_node={nproc}", *torchrun_args, "-m", "dist_trainer", *args]
        else:
            cmd = [sys.executable, "-m", "dist_trainer", *args]
        self.out_path = cwd / f"job-{self.tag[:8]}.out"
        self._out = open(self.out_path, "w")
        if not agent and standalone and not torchrun_args:
            self.proc = preloaded.Workers(args, nproc, cwd, env, self.out_path)
            return
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout: float = 150) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {timeout} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        self._out.flush()
        return self.out_path.read_text(errors="replace")

    def workers(self) -> Dict[int, int]:
        """{global rank: pid} of torchrun's current workers."""
        if isinstance(self.proc, preloaded.Workers):
            return self.proc.workers()
        return {int(_env_of(pid)["RANK"]): pid for pid in _children(self.proc.pid)}

    def kill(self) -> None:
        if self.proc.poll() is None:  # never signal a pid that was already reaped (it may be reused)
            self.proc.kill()
        for pid in _tagged_pids(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()  # workers live in sessions of their own: killing the group would miss them
        self._out.close()


def run(args: List[str], cwd: Path, nproc: int = 0, timeout: float = 150, agent: bool = False, **kw
        ) -> SimpleNamespace:
    with Job(args, cwd, nproc, agent=agent, **kw) as job:
        rc = job.wait(timeout)
        return SimpleNamespace(returncode=rc, output=job.output())


def run_all(jobs: List[tuple], cwd: Path, timeout: float = 150, agent: bool = False) -> List[SimpleNamespace]:
    """Start several (args, nproc) jobs at once and wait for all of them (2 cores: they overlap)."""
    started = []
    try:
        for args, nproc in jobs:
            started.append(Job(args, cwd, nproc, agent=agent))
        results = [SimpleNamespace(returncode=job.wait(timeout), output=job.output()) for job in started]
    finally:
        for job in started:
            job.__exit__()
    return results


def wait_for(predicate: Callable[[], bool], job: Job, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if job.proc.poll() is not None:
            pytest.fail(f"the run ended (rc {job.proc.returncode}) before {what}:\n{job.output()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout} s:\n{job.output()[-4000:]}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- run directories

def metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def final_params(run_dir: Path) -> Dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_model.pt", weights_only=True)


def assert_bit_identical(run_dir: Path, ref_dir: Path) -> None:
    got, want = final_params(run_dir), final_params(ref_dir)
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"


def assert_same_metrics(run_dir: Path, ref_dir: Path, steps: int) -> None:
    """Steps 1..steps exactly once each, and the same numbers as the reference."""
    got, want = metrics(run_dir), metrics(ref_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped", "updates", "samples"):
        assert [r[key] for r in got] == [r[key] for r in want], key


def digests(root: Path) -> Dict[str, tuple]:
    """sha256 and mtime of every file under root."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def hang_messages(output: str) -> List[str]:
    """The watchdog's errors shown on the console (health/watchdog.py), in order."""
    return re.findall(r"\[ERROR\] - (the run hangs: .*)", output)


def resumed_from(output: str) -> Optional[str]:
    found = re.findall(r"resuming from (\S+) \(step (\d+)\)", output)
    return found[-1][0] if found else None


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------- jobs started up front

class Background:
    """Jobs that depend on nothing, all started at once when the module's first test asks.

    On 2 cores a lone run leaves about half the CPU idle (imports, torchrun's
    agent, interpreter teardown); overlapping the independent runs keeps both busy.
    """

    def __init__(self, root: Path, wanted: set):
        self.root, self.wanted, self.jobs, self.results = root, wanted, {}, {}

    def start(self, name: str, args: List[str], nproc: int = 0, torchrun_args: List[str] = (), agent: bool = False
              ) -> None:
        """A job through real torchrun where its agent is tested (``agent``, or its own torchrun_args)."""
        if name in self.wanted:
            self.jobs[name] = Job(args, self.root, nproc, torchrun_args, agent=agent or bool(torchrun_args))

    def result(self, name: str) -> SimpleNamespace:
        if name not in self.results:
            job = self.jobs[name]
            self.results[name] = SimpleNamespace(returncode=job.wait(240), output=job.output())
        return self.results[name]

    def close(self) -> None:
        for job in self.jobs.values():
            job.__exit__()


FP16 = TINY + ["precision=fp16-mixed", "precision.loss_scale.growth_interval=3", "model.dropout=0.1",
               "batch.global_batch_size=32", "batch.micro_batch_size=8", "optim.warmup_steps=10",
               "optim.schedule=constant", "trainer.ckpt_every=0"]
FP16_K, FP16_STEPS = 5, 12  # with this data order: a skip at step 4 (before the stop) and at 11 (after)
SMALL = TINY + ["batch.global_batch_size=16", "batch.micro_batch_size=8"]  # one process: accum 2
KEEP = SMALL + ["trainer.max_steps=10", "trainer.ckpt_every=2", "trainer.keep_checkpoints=2"]
CORRUPT = SMALL + ["trainer.max_steps=8", "trainer.ckpt_every=2", "trainer.keep_checkpoints=4"]
NAN_SKIP = TINY + FAULTY + ["batch.global_batch_size=8", "batch.micro_batch_size=8", "trainer.nonfinite=skip",
                            "trainer.max_consecutive_skips=2", "trainer.max_steps=10", "optim.warmup_steps=10",
                            "+model.nan_calls=[3,6,7,8]"]


def gated(gate: Path, call: int, rank: int) -> List[str]:
    """FaultyGPT blocks rank's training-forward number ``call`` until ``gate`` exists.

    A gate in the first 5 steps may wait for its test as long as it likes: the step
    watchdog (dist.step_timeout_s=auto) gives them dist.init_timeout_s. A later one, or
    a run with a number of seconds, must be started by the test that opens it.
    """
    return FAULTY + [f"+model.gate_call={call}", f"+model.gate_file={gate}", f"+model.gate_rank={rank}"]


# accum 2 on 2 ranks: rank 1's forward 2s-1 is the first micro-batch of step s.
ELASTIC_GATE_STEP = 5  # checkpoints 2 and 4 are written
PREEMPT_GATE_STEP = 4
HANG_GATE_STEP, HANG_TIMEOUT_S = 5, 10  # a rank stopped in step 5; dist.step_timeout_s


def uses(*names: str):
    """Marks the up-front jobs a test reads, so that a run of some of the tests starts only theirs."""
    def mark(fn):
        fn.jobs_used = names
        return fn
    return mark


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """Every run that needs no other run first, started together; ``result(name)`` waits for one.

    Only the test that owns a split run resumes it in place; other tests copy what they change.
    """
    root = tmp_path_factory.mktemp("jobs")
    wanted = {name for item in request.session.items
              for name in getattr(getattr(item, "function", None), "jobs_used", ())}
    bg = Background(root, wanted)
    _evil_checkpoint(ckpt(root / "evil", 2), root / "evil-marker")
    try:
        bg.start("ref", JOB2 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'ref'}"], nproc=2)
        bg.start("half", JOB2 + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'half'}"], nproc=2)
        bg.start("fp16_ref", FP16 + [f"trainer.max_steps={FP16_STEPS}", f"hydra.run.dir={root / 'fp16_ref'}"])
        bg.start("fp16_half", FP16 + [f"trainer.max_steps={FP16_K}", f"hydra.run.dir={root / 'fp16_half'}"])
        bg.start("keep", KEEP + [f"hydra.run.dir={root / 'keep'}"])
        bg.start("keep_every", KEEP + ["trainer.keep_every=4", f"hydra.run.dir={root / 'keep_every'}"])
        bg.start("corrupt", CORRUPT + [f"hydra.run.dir={root / 'corrupt'}"])
        bg.start("evil", SMALL + ["trainer.max_steps=4", f"hydra.run.dir={root / 'evil'}"])
        bg.start("nan_skip", NAN_SKIP + [f"hydra.run.dir={root / 'nan_skip'}"])
        # These block on a gate in a known step until their test acts (a cheap sleep meanwhile).
        bg.start("elastic", JOB2 + gated(root / "elastic-gate", 2 * ELASTIC_GATE_STEP - 1, rank=1)
                 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'elastic'}"],
                 nproc=2, torchrun_args=["--max-restarts=3"])
        bg.start("preempt", JOB2 + gated(root / "preempt-gate", 2 * PREEMPT_GATE_STEP - 1, rank=1)
                 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'preempt'}"],
                 nproc=2, torchrun_args=["--signals-to-handle=SIGTERM,SIGUSR1"])
        # The same under trainer.ckpt_async=true, checkpointing every step: a background write precedes the stop.
        bg.start("async_preempt", ASYNC_JOB2 + gated(root / "async_preempt-gate", 2 * PREEMPT_GATE_STEP - 1, rank=1)
                 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'async_preempt'}"],
                 nproc=2, torchrun_args=["--signals-to-handle=SIGTERM,SIGUSR1"])
        # accum 1 on 2 ranks: rank 1's forward 5 is step 5, NaN there (trainer.nonfinite=stop, the default).
        bg.start("nan_stop", SMALL + gated(root / "nan_stop-gate", 5, rank=1)
                 + ["trainer.ckpt_every=2", "trainer.max_steps=8", "+model.nan_calls=[5]", "+model.nan_rank=1",
                    f"hydra.run.dir={root / 'nan_stop'}"], nproc=2, agent=True)  # the agent's summary of the exits
        yield SimpleNamespace(root=root, result=bg.result, job=bg.jobs.__getitem__)
    finally:
        bg.close()


@pytest.fixture(scope="module")
def fp32_2rank(jobs):
    """An uninterrupted STEPS-step run and a K-step run of JOB2 on 2 ranks.

    The exact-resume test resumes ``half`` in place; others copy ``half_copy``, taken before that.
    """
    ref, half = jobs.result("ref"), jobs.result("half")
    assert ref.returncode == 0, ref.output[-4000:]
    assert half.returncode == 0, half.output[-4000:]
    half_copy = copy_run(jobs.root / "half", jobs.root / "half_copy")
    return SimpleNamespace(ref=jobs.root / "ref", half=jobs.root / "half", half_copy=half_copy,
                           half_output=half.output)


# --------------------------------------------------------------------------- 1. exact resume

@uses("ref", "half")
def test_fp32_two_ranks_resume_mid_epoch_and_mid_warmup_is_bit_identical(fp32_2rank, tmp_path):
    steps_per_epoch = int(re.search(r"(\d+) optimizer steps per epoch", fp32_2rank.half_output).group(1))
    assert K < STEPS < steps_per_epoch  # the stop at K is mid-epoch (and the whole run stays in epoch 0)
    assert 0 < K < WARMUP < STEPS  # mid-warmup, and the resumed half crosses the end of the warmup
    ref = metrics(fp32_2rank.ref)
    assert ref[K]["lr"] < ref[WARMUP]["lr"] == ref[-1]["lr"]  # step K+1 still warming up; flat after
    assert [r["step"] for r in metrics(fp32_2rank.half)] == list(range(1, K + 1))
    assert verify(ckpt(fp32_2rank.half, K)) is None

    run_dir = fp32_2rank.half  # the same run directory, now with trainer.max_steps=STEPS
    proc = run(JOB2 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.output[-4000:]
    assert resumed_from(proc.output) == str(ckpt(run_dir, K)), proc.output[-4000:]
    assert_same_metrics(run_dir, fp32_2rank.ref, STEPS)
    assert_bit_identical(run_dir, fp32_2rank.ref)


@uses("fp16_ref", "fp16_half")
def test_fp16_mixed_with_dropout_resume_is_bit_identical(jobs, tmp_path):
    # One process, accum 4; dropout draws from the torch RNG, which the checkpoint must restore;
    # growth_interval=3 makes the loss scale grow (and overflow, skipping steps) around the resume.
    ref, half = jobs.result("fp16_ref"), jobs.result("fp16_half")
    assert ref.returncode == 0 and half.returncode == 0, ref.output[-3000:] + half.output[-3000:]
    ref_dir = jobs.root / "fp16_ref"
    records = metrics(ref_dir)
    assert len({r["loss_scale"] for r in records[:FP16_K]}) > 1  # the scaler's state moves before the stop...
    assert any(r["skipped"] for r in records[FP16_K:])  # ...and an overflow skip comes after it
    assert 0 < FP16_K < 10  # mid-warmup (optim.warmup_steps=10)

    run_dir = jobs.root / "fp16_half"  # the same run directory, now with trainer.max_steps=FP16_STEPS
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, FP16_K + 1))
    assert verify(ckpt(run_dir, FP16_K)) is None  # trainer.ckpt_every=0: only the one at the end
    proc = run(FP16 + [f"trainer.max_steps={FP16_STEPS}", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.output[-4000:]
    assert resumed_from(proc.output) == str(ckpt(run_dir, FP16_K))
    assert_same_metrics(run_dir, ref_dir, FP16_STEPS)
    assert_bit_identical(run_dir, ref_dir)


# --------------------------------------------------------------------------- 2. elastic restart

@pytest.mark.slow  # a real torchrun agent restarting its workers, about 15 s
@uses("ref", "half", "elastic")
def test_elastic_restart_after_a_worker_is_killed_resumes_bit_identical(jobs, fp32_2rank):
    # torchrun --max-restarts=3; rank 1 waits on the gate in step ELASTIC_GATE_STEP (see jobs).
    job, run_dir, gate = jobs.job("elastic"), jobs.root / "elastic", jobs.root / "elastic-gate"
    wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, f"rank 1 in step {ELASTIC_GATE_STEP}")
    workers = job.workers()
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGKILL)
    gate.touch()  # the restarted rank 1 passes
    killed_after = steps_done(run_dir)
    result = jobs.result("elastic")
    assert killed_after == ELASTIC_GATE_STEP - 1
    assert result.returncode == 0, result.output[-4000:]
    # torchrun restarted the group; its rank 0 resumed from the newest checkpoint.
    assert resumed_from(result.output) == str(ckpt(run_dir, 4)), result.output[-4000:]
    assert_same_metrics(run_dir, fp32_2rank.ref, STEPS)
    assert_bit_identical(run_dir, fp32_2rank.ref)


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
@uses("ref", "half")
def test_a_stopped_rank_is_named_within_the_step_timeout_and_the_restart_resumes_bit_identical(fp32_2rank, tmp_path):
    # SIGSTOP, as a stalled device or a debugger would: torchrun sees no exit code, and without the
    # watchdog rank 0 would wait for dist.timeout_s. torchrun --max-restarts=1; the gate is in step 5.
    # Started here, not up front: a gate that waits past dist.step_timeout_s would be a hang itself.
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    args = JOB2 + gated(gate, 2 * HANG_GATE_STEP - 1, rank=1) + [
        f"trainer.max_steps={STEPS}", f"dist.step_timeout_s={HANG_TIMEOUT_S}", f"hydra.run.dir={run_dir}"]
    with Job(args, tmp_path, 2, ["--max-restarts=1"]) as job:
        wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, f"rank 1 in step {HANG_GATE_STEP}")
        stopped = job.workers()[1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        gate.touch()  # the restarted rank 1 passes
        wait_for(lambda: "failed (exitcode: 124)" in job.output(), job, HANG_TIMEOUT_S + 30,
                 "the hang to end the attempt")
        ended_after = time.monotonic() - stopped_at
        result = SimpleNamespace(returncode=job.wait(150), output=job.output())
    assert result.returncode == 0, result.output[-4000:]
    assert ended_after <= HANG_TIMEOUT_S + 30
    found = hang_messages(result.output)
    assert len(found) == 1, result.output[-4000:]
    assert (f"computing in step {HANG_GATE_STEP} has taken" in found[0]
            and f"(dist.step_timeout_s={HANG_TIMEOUT_S})" in found[0]), found[0]
    assert re.search(rf"rank 1 \(host \S+, pid {stopped}\) did not respond: stopped, or frozen whole; "
                     rf"the last step it began was {HANG_GATE_STEP}; rank 0 waited for it", found[0]), found[0]
    log = (run_dir / "rank0.log").read_text()
    stacks = log[log.index("the stacks of every thread of rank 0 follow"):]
    assert "in train_step" in stacks and "in _watch" in stacks, stacks[:3000]
    assert resumed_from(result.output) == str(ckpt(run_dir, 4)), result.output[-4000:]
    assert_same_metrics(run_dir, fp32_2rank.ref, STEPS)
    assert_bit_identical(run_dir, fp32_2rank.ref)


JOIN = """
import torch, torch.distributed as dist
from dist_trainer import distributed
env = distributed.init("cpu", timeout_s=30)
total = torch.ones(1)
dist.all_reduce(total)
print("joined", env.rank, total.item())
distributed.shutdown(env)
"""


@pytest.mark.parametrize("agent_store", [pytest.param(False, marks=pytest.mark.slow), True])  # False: 5 s, slow stage
def test_workers_with_different_restart_counts_join_one_group_on_a_fresh_store(tmp_path, agent_store):
    # Across nodes each torchrun agent counts its own restarts: after one node's worker
    # dies, its agent restarts with TORCHELASTIC_RESTART_COUNT=1 and the others (restarting
    # for the waiting node) with 0. On a fresh store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    # what launch/ sets) the workers must not split the store by that count; on the agent's
    # shared store (one node, so the counts agree) the count keeps attempts apart.
    port = free_port()
    server = (dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
              if agent_store else None)  # the agent's store
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHELASTIC_USE_AGENT_STORE=str(agent_store),
                   TORCHELASTIC_RESTART_COUNT="0" if agent_store else str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", JOIN], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=90)[0] for p in procs]
    del server
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "joined 0 2.0" in outs[0] and "joined 1 2.0" in outs[1], outs


@pytest.mark.slow  # two torchrun agents and a restart, about 20 s; one node's restart stays in the default suite
@uses("ref", "half")
def test_elastic_restart_across_two_nodes_resumes_bit_identical(fp32_2rank, tmp_path):
    # Two torchrun agents ("nodes") of one process each, with launch/'s
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 1 is killed, both agents restart, the
    # new group forms on a fresh store, resumes from the newest checkpoint and ends
    # bit-identical to an uninterrupted run.
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    port = free_port()
    rdzv = ["--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
            "--max-restarts=2"]
    args = (JOB2 + gated(gate, 2 * ELASTIC_GATE_STEP - 1, rank=1)
            + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"])
    multi_node = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with Job(args, tmp_path, 1, rdzv, standalone=False, env_extra=multi_node) as a, \
            Job(args, tmp_path, 1, rdzv, standalone=False, env_extra=multi_node) as b:
        wait_for(lambda: Path(f"{gate}.waiting").exists(), a, 120, f"rank 1 in step {ELASTIC_GATE_STEP}")
        workers = {**a.workers(), **b.workers()}
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        gate.touch()
        codes = a.wait(240), b.wait(240)
        outputs = a.output() + b.output()
    assert codes == (0, 0), outputs[-6000:]
    assert resumed_from(outputs) == str(ckpt(run_dir, 4)), outputs[-6000:]
    assert_same_metrics(run_dir, fp32_2rank.ref, STEPS)
    assert_bit_identical(run_dir, fp32_2rank.ref)


# --------------------------------------------------------------------------- 3. preemption

@uses("ref", "half", "preempt")
def test_sigusr1_on_one_worker_checkpoints_exits_requeue_and_resumes_bit_identical(jobs, fp32_2rank, tmp_path):
    _preempted(jobs, fp32_2rank, tmp_path, "preempt", JOB2)


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
@uses("ref", "half", "async_preempt")
def test_sigusr1_with_a_background_save_in_flight_waits_for_it_then_checkpoints_and_resumes(jobs, fp32_2rank,
                                                                                           tmp_path):
    def check(run_dir: Path, stop: int) -> None:
        # Steps 1-3 were saved in the background, each sealed before the next was staged (keep 3: 2 and 3
        # are left); the stop's own save waited for step 3's and was written before the exit.
        assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
            f"step_{step:08d}" for step in (stop, stop - 1, stop - 2)]
        assert all(verify(ckpt(run_dir, step)) is None for step in (stop, stop - 1, stop - 2))
        records = metrics(run_dir)
        assert [("ckpt_staging_mb" in r) for r in records] == [True] * (stop - 1) + [False]
        assert sum("ckpt_write_s" in r for r in records) == stop - 1

    _preempted(jobs, fp32_2rank, tmp_path, "async_preempt", ASYNC_JOB2, check)


def _preempted(jobs, fp32_2rank, tmp_path, name: str, args: List[str],
               check: Callable[[Path, int], None] = lambda run_dir, stop: None) -> None:
    # torchrun --signals-to-handle=SIGTERM,SIGUSR1; rank 1 waits on the gate in step PREEMPT_GATE_STEP.
    job, run_dir, gate = jobs.job(name), jobs.root / name, jobs.root / f"{name}-gate"
    wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, f"rank 1 in step {PREEMPT_GATE_STEP}")
    # To rank 1 only, while it is in that step's forward (blocked on the gate, in Python, so the
    # handler runs at once); rank 0 must learn of it through the step's all-reduce.
    os.kill(job.workers()[1], signal.SIGUSR1)
    time.sleep(0.2)
    assert steps_done(run_dir) == PREEMPT_GATE_STEP - 1
    gate.touch()
    result = jobs.result(name)
    output = result.output
    assert result.returncode != 0, output[-4000:]  # torchrun reports its workers' EXIT_REQUEUE as a failure (1)
    assert re.search(rf"exitcode\s*:\s*{EXIT_REQUEUE}\b", output), output[-4000:]
    stops = re.findall(r"step (\d+): stop requested by a signal; checkpoint written", output)
    assert stops, output[-4000:]
    stop = int(stops[0])
    for rank in (0, 1):  # both ranks stopped after the same step (each rank's log)
        assert f"step {stop}: stop requested by a signal" in (run_dir / f"rank{rank}.log").read_text()
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, stop + 1))
    assert verify(ckpt(run_dir, stop)) is None
    assert not (run_dir / "final_model.pt").exists()
    check(run_dir, stop)
    metrics_then = metrics(run_dir)

    proc = run(args + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.output[-4000:]
    assert resumed_from(proc.output) == str(ckpt(run_dir, stop))
    assert_same_metrics(run_dir, fp32_2rank.ref, STEPS)
    assert_bit_identical(run_dir, fp32_2rank.ref)

    # signals.py: "the current optimizer step finishes, every rank learns of the request through the
    # step's all-reduce (so they stop after the same step)": the signal arrived during PREEMPT_GATE_STEP.
    assert stop == PREEMPT_GATE_STEP, (
        f"SIGUSR1 arrived during step {PREEMPT_GATE_STEP}, but the run stopped after step {stop}: run.py "
        "passes stop_requested=stop.requested to train_step when the step starts, so a signal arriving "
        "during a step only reaches the NEXT step's all-reduce (one extra step before the checkpoint and exit)")
    assert metrics(run_dir)[:stop] == metrics_then


def test_sigterm_to_the_process_group_with_dataloader_workers_checkpoints_and_exits_requeue(tmp_path):
    # The signal reaches the DataLoader workers too (the same process group). Had they died
    # of it, the main process would fail with "DataLoader worker exited unexpectedly".
    run_dir = tmp_path / "run"
    args = TINY + ["batch.global_batch_size=8", "batch.micro_batch_size=4", "data.num_workers=2",
                   "trainer.max_steps=1000", "trainer.ckpt_every=0", f"hydra.run.dir={run_dir}"]
    with Job(args, tmp_path) as job:
        wait_for(lambda: steps_done(run_dir) >= 3, job, 120, "3 steps")
        assert len(_children(job.proc.pid)) == 2  # the two DataLoader workers, alive
        os.killpg(job.proc.pid, signal.SIGTERM)
        rc = job.wait(120)
        output = job.output()
    assert rc == EXIT_REQUEUE, output[-4000:]
    stop = int(re.findall(r"step (\d+): stop requested by a signal; checkpoint written", output)[0])
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, stop + 1))
    assert verify(ckpt(run_dir, stop)) is None


# --------------------------------------------------------------------------- 4. another world size

@uses("ref", "half")
def test_resume_on_one_process_keeps_the_global_batch(fp32_2rank, tmp_path):
    good = copy_run(fp32_2rank.half_copy, tmp_path / "good")
    bad = copy_run(fp32_2rank.half_copy, tmp_path / "bad")
    before = digests(bad / "checkpoints"), (bad / "metrics.jsonl").read_bytes()
    # 1 process: micro 8 x accum 4 = global 32, as saved; and one without batch.global_batch_size,
    # whose global batch (micro 8 x accum 2 x 1 rank = 16) differs from the checkpoint's 32.
    ok, err = run_all([(JOB2 + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={good}"], 0),
                       (JOB2 + ["batch.global_batch_size=null", "batch.accum_steps=2",
                                f"trainer.max_steps={STEPS}", f"hydra.run.dir={bad}"], 0)], tmp_path)

    assert ok.returncode == 0, ok.output[-4000:]
    assert "world size 1 x micro batch 8 x accum steps 4 = global batch 32" in ok.output
    assert resumed_from(ok.output) == str(ckpt(good, K))
    got, want = metrics(good), metrics(fp32_2rank.ref)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got[:K]] == [r["loss"] for r in want[:K]]  # the 2-rank part, kept
    # Same samples per step for any world size (data.py), so only the reduction order differs.
    assert_close_scaled(torch.tensor([r["loss"] for r in got[K:]], dtype=torch.float64),
                        torch.tensor([r["loss"] for r in want[K:]], dtype=torch.float64), "losses")
    params, ref_params = final_params(good), final_params(fp32_2rank.ref)
    assert params.keys() == ref_params.keys()
    # The key bias (k.bias) has an exactly zero gradient (softmax ignores a constant added to every
    # score of a query), so it holds only rounding noise, which AdamW normalises into steps: it is
    # ~1e-6 in both runs but not equal to 1e-5. Everything else must match to 1e-5.
    for params_ in (params, ref_params):
        assert params_.pop("blocks.0.attn.k.bias").abs().max() < 1e-4
    assert_all_close_scaled(params, ref_params, "final parameters")

    assert err.returncode == 2, err.output[-4000:]
    assert "batch.global_batch_size" in err.output and "global batch of 32" in err.output, err.output[-4000:]
    assert (digests(bad / "checkpoints"), (bad / "metrics.jsonl").read_bytes()) == before  # untouched


# --------------------------------------------------------------------------- 5. non-finite losses

@uses("nan_stop")
def test_nonfinite_loss_stop_leaves_earlier_checkpoints_untouched(jobs):
    # 2 ranks, accum 1, NaN loss on rank 1 at step 5, which waits on the gate first (see jobs).
    job, run_dir, gate = jobs.job("nan_stop"), jobs.root / "nan_stop", jobs.root / "nan_stop-gate"
    wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, "rank 1 in step 5")
    before = digests(run_dir / "checkpoints")  # step 5 has not reached its all-reduce yet
    gate.touch()
    result = jobs.result("nan_stop")
    output = result.output
    assert result.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", output), output[-4000:]  # ranks exit 2
    message = re.search(r"step 5: non-finite loss on ranks \[1\].*", output)  # rank 0's console
    assert message and "trainer.nonfinite" in message.group(0), output[-4000:]
    assert "step 5: non-finite loss on ranks [1]" in (run_dir / "rank1.log").read_text()
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
    assert sorted(before) == [f"step_0000000{s}/{f}" for s in (2, 4)
                              for f in ("manifest.json", "rng_rank0.pt", "rng_rank1.pt", "shared.pt")]
    assert digests(run_dir / "checkpoints") == before  # same bytes and mtimes, nothing added
    assert not (run_dir / "final_model.pt").exists()


@uses("nan_skip")
def test_nonfinite_loss_skip_until_max_consecutive_skips(jobs):
    # One process, accum 1: forward n is step n. NaN at steps 3, 6, 7, 8 with max_consecutive_skips=2:
    # 3 is skipped (nothing updated, the warmup waits), 4 and 5 train, 6 and 7 are skipped,
    # 8 is the third skip in a row: stop, exit code 2.
    result, run_dir = jobs.result("nan_skip"), jobs.root / "nan_skip"
    assert result.returncode == 2, result.output[-4000:]
    assert re.search(r"step 8: non-finite loss on ranks \[0\], 3 steps in a row, more than "
                     r"trainer.max_consecutive_skips=2", result.output), result.output[-4000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, True, True]
    assert [r["updates"] for r in records] == [1, 2, 2, 3, 4, 4, 4]
    assert [r["loss"] is None for r in records] == [r["skipped"] for r in records]  # NaN written as null
    assert [r["grad_norm"] is None for r in records] == [r["skipped"] for r in records]
    lrs = [r["lr"] for r in records]
    assert lrs[2] == lrs[3] and lrs[5] == lrs[6]  # a skipped step does not move the warmup
    assert lrs[0] < lrs[1] < lrs[2] < lrs[4] < lrs[5]


# --------------------------------------------------------------------------- 6. corrupt checkpoints

@uses("corrupt")
def test_corrupt_checkpoints_are_skipped_for_the_newest_valid_one(jobs, tmp_path):
    # The "corrupt" job: 8 steps, checkpoints 2, 4, 6 and 8 kept. The three newest are damaged in
    # three ways; a new start warns about each, newest first, and resumes from step 2.
    assert jobs.result("corrupt").returncode == 0
    first = jobs.root / "corrupt"
    run_dir = copy_run(first, tmp_path / "run")
    (run_dir / "final_model.pt").unlink()
    shared = ckpt(run_dir, 8) / "shared.pt"
    shared.write_bytes(shared.read_bytes()[: shared.stat().st_size // 2])  # truncated
    (ckpt(run_dir, 6) / "manifest.json").unlink()  # never sealed
    data = bytearray((ckpt(run_dir, 4) / "shared.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    (ckpt(run_dir, 4) / "shared.pt").write_bytes(bytes(data))

    result = run(CORRUPT + [f"hydra.run.dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    warned = re.findall(r"checkpoint (\S+) is unusable \((.*)\); trying the previous one", result.output)
    assert [path for path, _ in warned] == [str(ckpt(run_dir, s)) for s in (8, 6, 4)], result.output[-4000:]
    assert re.fullmatch(r"shared.pt has \d+ bytes, the manifest says \d+", warned[0][1]), warned
    assert warned[1][1].startswith("unreadable manifest"), warned
    assert warned[2][1] == "shared.pt does not match its sha256", warned
    assert resumed_from(result.output) == str(ckpt(run_dir, 2)), result.output[-4000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 9))
    assert all(verify(ckpt(run_dir, s)) is None for s in (2, 4, 6, 8))  # rewritten, valid again
    assert_bit_identical(run_dir, first)


# --------------------------------------------------------------------------- 7. malicious checkpoint

class _CreatesFile:
    """Unpickling this calls open(marker, "w"): code execution, which weights_only must refuse."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _evil_checkpoint(path: Path, marker: Path) -> None:
    """A checkpoint whose shared.pt runs open(marker, 'w') when unpickled, sealed with a valid manifest."""
    path.mkdir(parents=True)
    torch.save({"format": 1, "world_size": 1, "trainer": _CreatesFile(marker),
                "loop": {"step": 2, "epoch": 0, "step_in_epoch": 2, "samples": 32},
                "plan": {"global_batch_size": 16}}, path / "shared.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rng_rank0.pt")  # complete but for the payload
    files = {}
    for name in ("shared.pt", "rng_rank0.pt"):
        data = (path / name).read_bytes()
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {"step": 2, "world_size": 1, "format": 1, "files": files}
    (path / "manifest.json").write_text(json.dumps(manifest))


@uses("evil")
def test_checkpoint_that_would_run_code_is_refused(jobs, tmp_path):
    # The payload works: a plain (unsafe) torch.load runs it.
    probe_marker = tmp_path / "probe-marker"
    _evil_checkpoint(tmp_path / "probe", probe_marker)
    torch.load(tmp_path / "probe" / "shared.pt", weights_only=False)
    assert probe_marker.exists()

    run_dir = jobs.root / "evil"  # started on a run dir holding only such a checkpoint (see jobs)
    result = jobs.result("evil")
    assert not (jobs.root / "evil-marker").exists(), "loading the checkpoint ran code from it"
    # The manifest and sha256 are valid, but verification also loads it with
    # weights_only=True, which refuses the io.open global: the checkpoint is
    # unusable, and as no usable one is left the run stops cleanly, changing nothing.
    assert "weights_only=True" in verify(ckpt(run_dir, 2))
    assert result.returncode == 2, result.output[-4000:]
    assert "no usable checkpoint" in result.output and "nothing in it ran" in result.output, result.output[-4000:]
    assert ckpt(run_dir, 2).exists()  # left in place for the user to inspect
    assert metrics(run_dir) == [] and not (run_dir / "final_model.pt").exists()


# --------------------------------------------------------------------------- 8. keep_checkpoints

@uses("keep")
def test_only_the_newest_checkpoints_are_kept(jobs):
    result, run_dir = jobs.result("keep"), jobs.root / "keep"  # 10 steps, ckpt_every=2, keep_checkpoints=2
    assert result.returncode == 0, result.output[-4000:]
    for step in (2, 4, 6, 8, 10):
        assert f"step {step}: checkpoint {ckpt(run_dir, step)}" in result.output  # all were written
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000008", "step_00000010"]
    assert verify(ckpt(run_dir, 8)) is None and verify(ckpt(run_dir, 10)) is None


@uses("keep_every")
def test_keep_every_keeps_its_steps_checkpoints_from_pruning_while_saving_and_at_start(jobs):
    result, run_dir = jobs.result("keep_every"), jobs.root / "keep_every"  # keep 2, and every 4th step's
    assert result.returncode == 0, result.output[-4000:]
    names = lambda: sorted(p.name for p in (run_dir / "checkpoints").iterdir())  # noqa: E731
    assert names() == ["step_00000004", "step_00000008", "step_00000010"]
    # Resumed in place with keep_checkpoints=1: the start's clean-up and the next save prune step 10, not 4 or 8.
    more = run(KEEP + ["trainer.keep_every=4", "trainer.keep_checkpoints=1", "trainer.max_steps=12",
                       f"hydra.run.dir={run_dir}"], jobs.root)
    assert more.returncode == 0, more.output[-4000:]
    assert resumed_from(more.output) == str(ckpt(run_dir, 10))
    assert names() == ["step_00000004", "step_00000008", "step_00000012"]
    assert all(verify(ckpt(run_dir, step)) is None for step in (4, 8, 12))


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_keep_every_is_a_config_error_naming_it(value):
    from dist_trainer.config import ConfigError
    from dist_trainer.validation import validate
    from test_hsdp import _gpt

    cfg = _gpt(8)
    cfg.trainer.keep_every = value
    with pytest.raises(ConfigError, match=r"trainer\.keep_every"):
        validate(cfg, 1)


def test_a_manifest_without_every_ranks_rng_file_is_not_a_usable_checkpoint(tmp_path):
    path = tmp_path / "step_00000002"
    path.mkdir()
    torch.save({"loop": {"step": 2}}, path / "shared.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rng_rank0.pt")
    files = {name: {"bytes": (path / name).stat().st_size,
                    "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
             for name in ("shared.pt", "rng_rank0.pt")}
    (path / "manifest.json").write_text(json.dumps({"step": 2, "world_size": 1, "format": 1, "files": files}))
    assert verify(path) is None
    (path / "manifest.json").write_text(json.dumps({"step": 2, "world_size": 2, "format": 1, "files": files}))
    assert verify(path) == "rng_rank1.pt not in the manifest of a 2-rank checkpoint"


def _save_without_rank1_rng(rank, world_size, run_dir):
    from dist_trainer import checkpoint, distributed

    env = distributed.init("cpu")
    if rank == 1:  # as if rank 1 wrote to a directory rank 0 does not see
        real = checkpoint._save_file
        checkpoint._save_file = lambda obj, path: None if path.name == "rng_rank1.pt" else real(obj, path)
    try:
        checkpoint.save(checkpoint.checkpoint_dir(Path(run_dir)), 2, {"loop": {"step": 2}}, env, keep=3)
    except checkpoint.CheckpointError as err:
        return str(err)
    return None


def test_a_checkpoint_missing_a_ranks_file_is_not_sealed_and_every_rank_stops(tmp_path):
    errors = run_ranks(_save_without_rank1_rng, 2, tmp_path, str(tmp_path / "run"))
    assert all(e and "rank 0 cannot see rng_rank1.pt" in e and "hydra.run.dir" in e for e in errors), errors
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []  # nothing sealed
