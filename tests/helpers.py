"""Real multi-process runs on gloo for tests, and small configs."""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Container, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_trainer.config import BatchConfig, Config, DistConfig, OptimConfig, PrecisionConfig, TrainerConfig
from dist_trainer.distributed import _store_barrier

import preloaded

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------- comparing numbers

# How close two runs' tensors must be, measured against the tensor's own scale:
# max|got - ref| / max|ref| (scaled_error), never element by element. An element
# near zero holds no information about correctness: a sum of terms that cancel
# keeps the rounding of its large terms, and which of them round up is decided by
# the order of accumulation and by the CPU's kernels (AVX-512 and AVX2 block their
# reductions differently; two vendors' AVX-512 differ too). So an element-wise
# relative bound fails on correct code on some machine.
#
# SCALE_TOL: the same fp32 math summed in another order (ranks and micro-batches,
# a sharded reduction, another instruction set). fp32 rounds each operation to
# 6e-8 of its operands; a reduction of n terms in another order moves the result
# by up to about sqrt(n) of those, a few 1e-7 of the scale for these tiny models;
# three steps of an optimizer carry it along. 1e-5 of the scale holds that with a
# margin of 10 or more (measured under ATEN_CPU_CAPABILITY=default, avx2 and
# avx512), and any real error of the algorithm (a wrong factor, a sample counted
# twice or missed, a mean of means) is 1e-3 of the scale or more.
SCALE_TOL = 1e-5
# SAME_OPS_TOL: the same operations in the same order, recomputed (activation
# checkpointing) or reached by another path, where only a fused kernel may round
# another way.
SAME_OPS_TOL = 1e-6
# A set of tensors (a model's gradients or parameters) is compared tensor by
# tensor, each against its own scale but never a scale below FLOOR of the set's
# largest. A tensor that small can hold the rounding of the rest and nothing
# else: a bias before a BatchNorm and an attention key's bias have gradients
# that are exactly zero in exact arithmetic (the normalisation and the softmax
# remove a constant shift), so what is computed for them is rounding, about
# fp32's 6e-8 of the largest gradients, and their own scale is that rounding.
# The floor costs no sensitivity that matters: an error as large as the tensor
# itself still shows for any tensor larger than SCALE_TOL x FLOOR = 1e-6 of the
# set's largest.
FLOOR = 0.1


def scaled_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max|got - ref| / max(max|ref|, floor) in float64 (the absolute error where both are zero)."""
    got, ref = torch.as_tensor(got).detach().double(), torch.as_tensor(ref).detach().double()
    if not ref.numel():
        return 0.0
    diff, scale = (got - ref).abs().max().item(), max(ref.abs().max().item(), floor)
    return diff / scale if scale > 0 else diff


def assert_close_scaled(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = SCALE_TOL,
                        floor: float = 0.0) -> float:
    """got equals ref within ``tol`` of ref's scale (at least ``floor``); returns the error."""
    got, ref = torch.as_tensor(got), torch.as_tensor(ref)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} against {tuple(ref.shape)}"
    assert bool(torch.isfinite(got).all()) == bool(torch.isfinite(ref).all()), f"{what}: non-finite on one side"
    err = scaled_error(got, ref, floor)
    assert err <= tol, f"{what}: max|got-ref| / max(max|ref|, {floor:.1e}) = {err:.3e} > {tol:.0e}"
    return err


def set_floor(ref: dict) -> float:
    """FLOOR of the largest magnitude in a name -> tensor mapping."""
    tensors = (torch.as_tensor(r).detach() for r in ref.values() if r is not None)
    return FLOOR * max((t.abs().max().item() for t in tensors if t.numel()), default=0.0)


def assert_all_close_scaled(got: dict, ref: dict, what: str, tol: float = SCALE_TOL) -> float:
    """Each tensor of a name -> tensor mapping within ``tol`` of its scale (at least set_floor); the largest error.

    None (a parameter without a gradient) must be None on both sides.
    """
    assert got.keys() == ref.keys(), f"{what}: names differ: {sorted(set(got) ^ set(ref))}"
    floor, err = set_floor(ref), 0.0
    for name, r in ref.items():
        if r is None or got[name] is None:
            assert r is None and got[name] is None, f"{what} {name}: missing on one side"
            continue
        err = max(err, assert_close_scaled(got[name], r, f"{what} {name}", tol, floor))
    return err


def _rank_main(rank: int, world_size: int, store_dir: str, fn: Callable, args: tuple, env: dict) -> None:
    preloaded.enter(env, os.path.join(store_dir, f"rank{rank}.out"), os.path.join(store_dir, f"rank{rank}.err"))
    torch.set_num_threads(1)
    # A rank still running after STACKS_AFTER_S writes every thread's stack to stderr (pytest shows it), so
    # a hang names its place instead of only timing out.
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=False)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        path = os.path.join(store_dir, f"result{rank}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole, or not there: a launcher may go by its presence
    except BaseException:
        dist.destroy_process_group()  # nothing waits after a failure: a peer may be gone
        raise
    close_group(world_size)
    # The work is saved and the group closed: end here, before the interpreter's teardown runs gloo's and
    # the collectives' destructors at exit, which is where a rank could abort (SIGABRT) after its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def close_group(world_size: int) -> None:
    """Destroy the process group once every rank is past its last collective, as dist_trainer.distributed does.

    A rank tearing the gloo group down while its peer still completes the last
    collective can abort that peer at exit (SIGABRT, torch 2.13).
    """
    if world_size > 1:
        _store_barrier(world_size)
    dist.destroy_process_group()


EXIT_GRACE_S = 20  # once every rank has saved its result, the time they get to exit
STACKS_AFTER_S = 240  # below pytest-timeout's 300 s: a hung rank's stacks reach the log before the test fails


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any, timeout: Optional[float] = None
              ) -> List[Any]:
    """Run fn(rank, world_size, *args) in world_size processes forked from the preloaded server; their results.

    The ranks see this process's environment at the call (tests/preloaded.py); their stdout and stderr are
    copied to this process's when they end, so pytest shows them with a failure. Never leaves a process
    behind: a rank stuck in process-group teardown after saving its result (torch 2.13 on gloo, now and
    then) is killed, a launch past ``timeout`` (if given; pytest-timeout's limit otherwise) writes every
    rank's stacks and fails the test, and any exception here (pytest-timeout's included) kills the ranks
    first. A live child would otherwise keep pytest from exiting: multiprocessing joins its children at exit.
    """
    store_dir = tmp_path / f"ranks{world_size}-{fn.__name__}"
    store_dir.mkdir(parents=True, exist_ok=True)
    logs = [str(store_dir / f"rank{r}") for r in range(world_size)]
    preloaded.context()  # the server's preload list, before the first fork starts it
    ctx = mp.start_processes(_rank_main, args=(world_size, str(store_dir), fn, args, dict(os.environ)),
                             nprocs=world_size, join=False, start_method="forkserver")
    results = [store_dir / f"result{r}.pt" for r in range(world_size)]
    deadline = time.monotonic() + (timeout or 0)
    try:
        while not ctx.join(timeout=1.0):  # re-raises a rank's exception
            done = [path.is_file() for path in results]
            if all(done):
                _let_exit(ctx)
                break
            if timeout is not None and time.monotonic() > deadline:
                missing = [r for r, ok in enumerate(done) if not ok]
                pytest.fail(f"{world_size} ranks did not finish in {timeout:.0f} s: a collective hangs "
                            f"(ranks {missing} saved no result; every rank's stacks are in the captured stderr)")
    except BaseException:  # a launch past its timeout, pytest-timeout's, or a rank's failure: where each rank was
        preloaded.dump_stacks(ctx.processes)
        raise
    finally:
        preloaded.kill_all(ctx.processes)
        preloaded.show_logs(logs, f"{fn.__name__} on {world_size} ranks:")
    return [torch.load(path, weights_only=False) for path in results]


def _let_exit(ctx) -> None:
    """Every rank saved its result: they exit at once (_rank_main), and one that does not exit 0 fails the test."""
    exit_deadline = time.monotonic() + EXIT_GRACE_S
    while not ctx.join(timeout=1.0):  # re-raises a rank's exception, or names its exit code
        if time.monotonic() > exit_deadline:
            alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            pytest.fail(f"ranks {alive} saved their results but did not exit in {EXIT_GRACE_S} s "
                        "(their stacks are in the captured stderr)")


class RegressionMLP(torch.nn.Module):
    """Linear-tanh-linear regressor returning the scalar mean squared error."""

    def __init__(self, in_dim: int = 4, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1).float(), batch["y"])


def regression_config(micro: int, accum: int | None = None, glob: int | None = None, steps: int = 3,
                      precision: str = "fp32", n: int = 96, **optim: Any) -> Config:
    return Config(
        model={"_target_": "helpers.RegressionMLP", "in_dim": 4, "hidden": 16},
        data={"_target_": "dist_trainer.data.builtin.regression", "n": n, "in_dim": 4, "shuffle": True},
        batch=BatchConfig(micro_batch_size=micro, accum_steps=accum, global_batch_size=glob),
        precision=PrecisionConfig(name=precision),
        optim=OptimConfig(**{"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2,
                             "schedule": "cosine", "grad_clip": None, **optim}),
        trainer=TrainerConfig(max_steps=steps, log_every=1, eval_every=0),
        dist=DistConfig(),
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_module(args: List[str], cwd: Path, timeout: float = 240, torchrun_nproc: int = 0, agent: bool = True
               ) -> subprocess.CompletedProcess:
    """python -m dist_trainer (forked from the preloaded server) or torchrun with nproc ranks.

    ``agent=False``: the nproc workers are forked with torchrun's environment, without the agent (for runs
    where torchrun itself is not what is tested); their stdout and stderr together are the result's stdout.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    if not torchrun_nproc:
        return preloaded.run_cli(args, cwd, timeout, env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_nproc}",
           "-m", "dist_trainer", *args]
    if not agent:
        out_path = Path(tempfile.mkdtemp(prefix="dist-trainer-workers-")) / "workers.out"
        workers = preloaded.Workers(args, torchrun_nproc, cwd, env, out_path)
        try:
            code = workers.wait(timeout)
        except subprocess.TimeoutExpired:
            preloaded.dump_stacks(workers.processes)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out_path.read_text(errors="replace"))
        finally:
            workers.kill()
        output = out_path.read_text(errors="replace")
        shutil.rmtree(out_path.parent, ignore_errors=True)
        return subprocess.CompletedProcess(cmd, code, output, "")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------- recorded steps on real ranks (test_cp.py, test_moe*.py)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import traceback  # noqa: E402

from dist_trainer import distributed  # noqa: E402
from dist_trainer.validation import validate  # noqa: E402
from dist_trainer.data import epoch_batches  # noqa: E402
from dist_trainer.run import build  # noqa: E402


def run_jobs(rank: int, world_size: int, jobs: list, run_job: Callable) -> dict:
    """A rank function (run_ranks, in_one_process): name -> run_job(env, world_size, name, *rest) for each job
    (name, *rest) in order, on one DistEnv.

    A job that raises is recorded as {"error": its traceback}, so only its own tests fail (job_record).
    """
    env = distributed.init("cpu")
    results = {}
    for name, *job in jobs:
        try:
            results[name] = run_job(env, world_size, name, *job)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        gc.collect()  # the job's DDP or FSDP wrapper and its hooks go before the next job builds its own
    return results


def job_record(results: dict, name: str) -> dict:
    """run_jobs' record of job ``name``; a job that raised fails the test with its traceback."""
    rec = results[name]
    if "error" in rec:
        pytest.fail(f"job {name} raised:\n{rec['error']}")
    return rec


def record_steps(env, world_size: int, cfg: Config, steps: int, grads_at: Container[int] = (1,),
                 before: Optional[Callable] = None, after: Optional[Callable] = None) -> dict:
    """Build cfg's run as dist_trainer.run does and take its first ``steps`` steps; what they did.

    "outcomes": each step's outcome as a dict; "grads": the whole gradients (gathered under fsdp) after each
    step in ``grads_at``; "params": [the whole weights after the last step]. ``before(parts, plan)`` (called
    after the build: a run broken on purpose, plan mode's numbers) and ``after(parts)`` return a test's own
    entries for the record.
    """
    from test_fsdp import _named_full  # here, not at the top: test_fsdp imports this module

    plan = validate(cfg, world_size)
    parts = build(cfg, plan, env)
    trainer = parts.trainer
    rec = {"outcomes": [], "grads": [], **(before(parts, plan) if before else {})}
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, steps + 1), batches):
        rec["outcomes"].append(dataclasses.asdict(trainer.train_step(micro_batches, window, step)))
        if step in grads_at:
            rec["grads"].append(_named_full(trainer.module, grads=True))
    rec["params"] = [_named_full(trainer.module, grads=False)]
    return {**rec, **(after(parts) if after else {})}


# ------------------------------------------------- checkpoint tests (test_checkpoint.py)

import threading  # noqa: E402
import time as _time  # noqa: E402

from dist_trainer.models import GPT as _GPT  # noqa: E402


class FaultyGPT(_GPT):
    """The built-in GPT (same parameters, same initialisation, same numbers) with test hooks.

    Training-forward calls of this process are counted from 1 (the count restarts with the
    process, e.g. on resume). ``nan_calls``: calls whose loss is NaN. ``gate_call``: at that
    call the forward creates ``<gate_file>.waiting`` and blocks until ``gate_file`` exists, so
    a test can act (signal, kill, snapshot) while a known step is in progress. ``nan_rank`` /
    ``gate_rank`` limit a hook to one global rank (None: every rank).
    """

    def __init__(self, *args: Any, nan_calls: List[int] = (), nan_rank: int | None = None,
                 gate_call: int | None = None, gate_file: str | None = None, gate_rank: int | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.nan_calls, self.nan_rank = set(nan_calls), nan_rank
        self.gate_call, self.gate_file, self.gate_rank = gate_call, gate_file, gate_rank
        self.train_calls = 0

    def _count_and_gate(self) -> bool:
        """Counts a training call, waits at the gate if it is this one; whether this call's loss is NaN."""
        self.train_calls += 1
        rank = int(os.environ.get("RANK", "0"))
        if self.train_calls == self.gate_call and self.gate_rank in (None, rank) and not os.path.exists(self.gate_file):
            Path(f"{self.gate_file}.waiting").touch()
            while not os.path.exists(self.gate_file):
                _time.sleep(0.01)
        return self.train_calls in self.nan_calls and self.nan_rank in (None, rank)

    def forward(self, batch):
        if not self.training:
            return super().forward(batch)
        nan = self._count_and_gate()
        out = super().forward(batch)
        return {**out, "loss_sum": out["loss_sum"] * float("nan")} if nan else out

    def stage_forward(self, x, blocks, first, last):
        """Under dist.pp.size > 1: each of this rank's stage forwards is a training call (one stage a rank:
        call ``accum_steps x (s - 1) + 1`` is step s's first micro-batch); a NaN call's output is NaN."""
        if not self.training:
            return super().stage_forward(x, blocks, first, last)
        nan = self._count_and_gate()
        out = super().stage_forward(x, blocks, first, last)
        return out * float("nan") if nan else out


# ------------------------------------------------- hang and straggler tests (test_hang.py)

class SlowOnOneRank(torch.utils.data.Dataset):
    """char_text whose training samples, on one rank, cost ``sleep_s`` each and then block forever.

    On ``slow_rank`` each training sample sleeps ``sleep_s`` (a straggler in data
    wait), and the call after ``block_after`` calls of this process creates
    ``blocked_file`` and blocks for good (a loader that hangs). Calls are counted
    per process: with data.num_workers=1 it is the loader worker that blocks.
    """

    def __init__(self, slow_rank: int, sleep_s: float, block_after: int, blocked_file: str,
                 split: str = "train", **kwargs: Any):
        from dist_trainer.data.builtin import char_text

        self.base = char_text(split=split, **kwargs)
        self.slow = split == "train" and int(os.environ.get("RANK", "0")) == slow_rank
        self.sleep_s, self.block_after, self.blocked_file = sleep_s, block_after, blocked_file
        self.calls = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        if self.slow:
            self.calls += 1
            if self.calls > self.block_after:
                Path(self.blocked_file).touch()
                threading.Event().wait()  # forever: only a kill ends it
            _time.sleep(self.sleep_s)
        return self.base[index]


def fails_on_rank(rank: int, **kwargs: Any):
    """char_text, except on ``rank``, whose data is missing: an error one rank alone meets."""
    from dist_trainer.config import ConfigError
    from dist_trainer.data.builtin import char_text

    if int(os.environ.get("RANK", "0")) == rank:
        raise ConfigError(f"data.path=/nowhere/shard{rank}.bin: no such file on rank {rank}")
    return char_text(**kwargs)
