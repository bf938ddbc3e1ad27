"""The suite's isolation: a case that changes the process's globals leaks nothing into the next.

In pytest's own process the autouse fence (tests/fence.py) puts back what a test changed; ranks and CLI runs
are forks of the preloaded server (tests/preloaded.py), so each starts from the same untouched state. A hung
launch fails only its own test, with every rank's stacks in its report, and the next launch runs as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import signal
import subprocess
import threading

import pytest
import torch
import torch.distributed as dist

from fence import Fence
from helpers import run_module, run_ranks


def _fingerprint() -> dict:
    """What a case could leave behind in its process, as comparable values."""
    digest = lambda data: hashlib.sha256(data).hexdigest()[:16]  # noqa: E731
    return {
        "environ": sorted((k, v) for k, v in os.environ.items() if k.startswith("FENCE_")),
        "cwd": os.getcwd(),
        "handlers": {signal.Signals(s).name: repr(signal.getsignal(s)) for s in (signal.SIGUSR2, signal.SIGTERM)},
        "torch_rng": digest(torch.get_rng_state().numpy().tobytes()),
        "random": digest(repr(random.getstate()).encode()),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "grad": torch.is_grad_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "root_handlers": len(logging.getLogger().handlers),
        "dist_trainer_level": logging.getLogger("dist_trainer").level,
        "threads": sorted(t.name for t in threading.enumerate()),
        "process_group": dist.is_initialized(),
    }


def _dirty(tmp_dir: str, daemon: bool = False) -> threading.Event:
    """Change everything _fingerprint looks at; the event a started thread waits on."""
    os.environ["FENCE_LEAK"] = "1"
    os.chdir(tmp_dir)
    signal.signal(signal.SIGUSR2, lambda *_: None)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.manual_seed(1234)
    random.seed(1234)
    torch.rand(3)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    logging.getLogger().addHandler(logging.NullHandler())
    logging.getLogger("dist_trainer").setLevel(logging.ERROR)
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="fence-leak", daemon=daemon).start()
    return stop


def test_the_fence_puts_back_everything_a_test_changes_in_pytests_process(tmp_path):
    before = _fingerprint()
    fence = Fence()
    stop = _dirty(str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert _fingerprint() != before  # the changes are real, or the check below could not fail
    try:
        assert [t.name for t in fence.stray_threads(grace_s=0.2)] == ["fence-leak"]
    finally:
        stop.set()
    changed = fence.restore()
    assert set(changed) >= {"environment", "working directory", "handler of SIGUSR2", "handler of SIGTERM",
                            "default dtype", "deterministic algorithms", "grad mode", "float32 matmul precision",
                            "logger root", "logger dist_trainer", "process group"}, changed
    assert fence.stray_threads(grace_s=5) == []
    assert _fingerprint() == before


def test_an_executors_idle_workers_are_not_strays_but_a_plain_thread_is():
    from concurrent.futures import ThreadPoolExecutor

    fence = Fence()
    pool = ThreadPoolExecutor(2)  # as inductor keeps its compile workers for the next compile
    assert pool.submit(lambda: 1).result() == 1
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="plain", daemon=False).start()
    try:
        assert [t.name for t in fence.stray_threads(grace_s=0.2)] == ["plain"]
    finally:
        stop.set()
        pool.shutdown()


def test_dynamos_compiled_code_does_not_outlive_the_test():
    from torch._dynamo.utils import counters

    fence = Fence()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
    frames = counters["frames"]["total"]
    compiled(torch.ones(2))
    assert counters["frames"]["total"] == frames  # cached: the next call compiles nothing
    assert "dynamo caches" in fence.restore()
    compiled(torch.ones(2))
    assert counters["frames"]["total"] == frames + 1  # the cache went with the test: compiled again


def _dirty_rank(rank, world_size, tmp_dir):
    before = _fingerprint()
    _dirty(tmp_dir, daemon=True)  # never released: a daemon, so the process's exit ends it
    dist.new_group([0, 1])
    return before


def _clean_rank(rank, world_size):
    return _fingerprint()


def test_a_forked_case_leaks_nothing_into_the_next(tmp_path):
    dirty = run_ranks(_dirty_rank, 2, tmp_path / "dirty", str(tmp_path))
    clean = run_ranks(_clean_rank, 2, tmp_path / "clean")
    for rank in range(2):
        # As the server made it, both times; Python's own `random` is reseeded in every fork by design
        # (os.register_at_fork), so its state is new each time rather than the server's.
        assert dirty[rank].pop("random") != clean[rank].pop("random")
        assert clean[rank] == dirty[rank], rank


def _preloaded_rank(rank, world_size, names):
    import gc
    import sys

    return {"missing": [n for n in names if n not in sys.modules], "frozen": gc.get_freeze_count(),
            "tracked": len(gc.get_objects())}


def test_a_forked_case_starts_with_the_whole_preload_frozen(tmp_path):
    # Every module of the preload that this process can import is already imported in a forked case, whichever
    # folder pytest runs from; and the imports' objects are out of the collector's reach (tests/gc_frozen.py),
    # so a gc.collect() there walks what the case made, not the million objects torch and transformers made.
    import importlib.util

    import preloaded

    names = [n for n in preloaded.PRELOAD if importlib.util.find_spec(n.split(".")[0]) is not None]
    for rank, got in enumerate(run_ranks(_preloaded_rank, 2, tmp_path, names)):
        assert got["missing"] == [], (rank, got)
        assert got["frozen"] > 100_000 and got["tracked"] < 50_000, (rank, got)


def _hang_rank(rank, world_size):
    if rank == 1:
        dist.barrier()  # rank 0 never joins: a collective that hangs
    threading.Event().wait()


def _sum_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.slow  # waits out a hang's deadline: 4-5 s
def test_a_hung_launch_fails_only_itself_with_every_ranks_stacks(tmp_path, capfd):
    with pytest.raises(pytest.fail.Exception, match="2 ranks did not finish in 2 s"):
        run_ranks(_hang_rank, 2, tmp_path / "hung", timeout=2)
    err = capfd.readouterr().err
    for rank in range(2):
        block = err.split(f"rank{rank}.err")[1].split("-----")[0]
        assert "_hang_rank" in block, f"rank {rank}'s stacks are not in the report:\n{err[-3000:]}"
    assert run_ranks(_sum_rank, 2, tmp_path / "next") == [3.0, 3.0]


@pytest.mark.slow  # waits out a hang's deadline: 6-7 s
def test_a_forked_cli_run_times_out_with_its_stacks_and_the_next_one_runs(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_module(["model=custom", "model._target_=test_fence.Hangs", f"hydra.run.dir={tmp_path}/hung"],
                   tmp_path, timeout=4)
    assert "test_fence.py" in expired.value.stderr and "in __init__" in expired.value.stderr, \
        expired.value.stderr[-3000:]
    proc = run_module(["plan.only=true", "plan.world_size=2", f"hydra.run.dir={tmp_path}/plan"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


class Hangs(torch.nn.Module):
    """A model whose construction never returns."""

    def __init__(self):
        super().__init__()
        threading.Event().wait()
