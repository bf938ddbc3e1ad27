"""Hangs and stragglers, with real torchrun processes on gloo, and the watchdog's rules on their own.

What is proved here (the stopped rank whose restart resumes bit-identically is
in test_checkpoint.py, which owns the uninterrupted reference run; the two-agent
launch in test_multinode.py):

* a loader that blocks forever on rank 1 ends the run within
  dist.step_timeout_s + 30 s, with one error naming rank 1, its host and pid,
  and the step it waits for its data in; both ranks' stacks are in their logs;
* in the same run, rank 1's loading is slower (it sleeps on every sample):
  metrics.jsonl names it the slowest rank in data wait step after step, and a
  warning names it (and its host) as the straggler;
* with the watchdog off, a collective that times out names itself, the step,
  dist.timeout_s (so the first step's init timeout was replaced) and the
  stopped rank (slow);
* the allowances (auto, a number, 0), the figures, the straggler rule and the
  config checks, on their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.health import console, stragglers
from dist_trainer.health import store as shared
from dist_trainer.health.watchdog import AUTO_FLOOR_S, EXIT_HUNG, Watchdog, is_collective_failure
from helpers import free_port, regression_config
from test_checkpoint import JOB2, TINY, Job, gated, hang_messages, metrics, wait_for

TIMEOUT_S = 10  # dist.step_timeout_s of these runs
SLACK_S = 30  # the bound: a hang ends the run within dist.step_timeout_s + 30 s


def _hang_message(output: str) -> str:
    found = hang_messages(output)
    assert len(found) == 1, output[-4000:]  # shown once, by the first rank to get there
    return found[0]


# --------------------------------------------------------------------------- a blocked loader, a slow rank

SAMPLES_PER_STEP = 16  # global 32 on 2 ranks
BLOCK_AFTER_STEPS = 32  # rank 1's loader blocks once it has loaded this many steps' samples


def _slow_rank_args(run_dir: Path, blocked: Path, max_steps: int, block_after: int,
                    step_timeout_s: int = TIMEOUT_S) -> list:
    return TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", f"trainer.max_steps={max_steps}",
                   "data._target_=helpers.SlowOnOneRank", "+data.slow_rank=1", "+data.sleep_s=0.004",
                   f"+data.block_after={block_after}", f"+data.blocked_file={blocked}",
                   "data.num_workers=1", f"dist.step_timeout_s={step_timeout_s}", f"hydra.run.dir={run_dir}"]


@pytest.fixture(scope="module")
def slow_rank(tmp_path_factory):
    """BLOCK_AFTER_STEPS steps with rank 1's loader slow and never blocked: a run that ends by itself."""
    root = tmp_path_factory.mktemp("slow")
    run_dir = root / "run"
    # Nothing hangs here, so the watchdog gets a deadline no loaded machine reaches (a step or an evaluation
    # took 11 s beside a 2-core CPU hog, over TIMEOUT_S).
    args = _slow_rank_args(run_dir, root / "never", BLOCK_AFTER_STEPS, 10 ** 9, step_timeout_s=120)
    with Job(args, root, 2, agent=False) as job:
        code = job.wait(240)
        output = job.output()
    assert code == 0, output[-4000:]
    return run_dir, output


@pytest.fixture(scope="module")
def blocked_loader(tmp_path_factory):
    root = tmp_path_factory.mktemp("blocked")
    run_dir, blocked = root / "run", root / "loader-blocked"
    args = _slow_rank_args(run_dir, blocked, 400, SAMPLES_PER_STEP * BLOCK_AFTER_STEPS)
    with Job(args, root, 2) as job:
        wait_for(blocked.exists, job, 240, "rank 1's loader to block")
        blocked_at = time.monotonic()
        code = job.wait(TIMEOUT_S + SLACK_S + 5)
        ended_after = time.monotonic() - blocked_at
        output = job.output()
    return run_dir, code, ended_after, output


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_a_blocked_loader_ends_the_run_in_seconds_naming_the_rank_and_step(blocked_loader):
    run_dir, code, ended_after, output = blocked_loader
    assert code != 0, output[-4000:]
    assert f"exitcode  : {EXIT_HUNG}" in output, output[-4000:]
    assert ended_after <= TIMEOUT_S + SLACK_S, ended_after
    waits_in = metrics(run_dir)[-1]["step"] + 1  # the step rank 1 could not get its data for
    message = _hang_message(output)
    assert re.search(rf"rank 1 \(host {re.escape(socket.gethostname())}, pid \d+\) is behind the others, "
                     rf"waiting for its data in step {waits_in}", message), message
    assert "rank 0 waited for it" in message, message
    assert f"dist.step_timeout_s={TIMEOUT_S}" in output
    summary = output[output.index("Root Cause"):]
    assert "HangError: the run hangs" in summary, summary
    # Rank 0 in its step, rank 1 at its loader. Both watchdogs fire near the same second: when rank 1's
    # report ends its process first, rank 0's all-reduce in the step fails on the closed connection and
    # its main thread reports from there (collective_failed), out of train_step: either order is right.
    for rank, places in ((0, ("train_step", "collective_failed")), (1, ("_next_data",))):
        log = (run_dir / f"rank{rank}.log").read_text()
        stacks = log[log.index(f"the stacks of every thread of rank {rank} follow"):]
        assert "most recent call first" in stacks and any(where in stacks for where in places), stacks[:3000]


@pytest.mark.slow  # a 2-rank run of 15 s: the slow stage
def test_the_slow_rank_is_named_the_straggler_in_every_steps_figures(slow_rank):
    run_dir, output = slow_rank
    records = metrics(run_dir)[stragglers.WARMUP_STEPS:]
    assert len(records) >= stragglers.WINDOW_STEPS
    slowest = [r["data_time_max_rank"] for r in records]
    assert slowest.count(1) >= 0.9 * len(slowest), slowest
    for r in records:
        assert r["data_time_max_s"] >= r["data_time_min_s"] >= 0
        assert r["compute_time_max_s"] >= r["compute_time_min_s"] > 0
        assert {r["data_time_min_rank"], r["compute_time_max_rank"], r["compute_time_min_rank"]} <= {0, 1}
    # 16 samples x 4 ms a step on rank 1, while rank 0 waits for nothing
    assert sum(r["data_time_max_s"] for r in records) / len(records) > 0.03
    warned = re.findall(r"straggler: rank (\d) \(host (\S+)\) was (\d+)% slower than the median rank", output)
    assert warned == [("1", socket.gethostname(), warned[0][2])], output[-4000:]
    assert int(warned[0][2]) > 20


# --------------------------------------------------------------------------- the collective's own timeout

@pytest.mark.slow
def test_with_the_watchdog_off_a_timed_out_collective_names_itself_and_the_stopped_rank(tmp_path):
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    # accum 2: rank 1's forward 5 is the first micro-batch of step 3; dist.timeout_s from step 2 on
    args = JOB2 + gated(gate, 5, rank=1) + ["trainer.max_steps=8", "dist.step_timeout_s=0", "dist.timeout_s=5",
                                            f"hydra.run.dir={run_dir}"]
    with Job(args, tmp_path, 2) as job:
        wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, "rank 1 in step 3")
        stopped = job.workers()[1]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        code = job.wait(5 + SLACK_S + 5)
        ended_after = time.monotonic() - stopped_at
        output = job.output()
    assert code != 0 and ended_after <= 5 + SLACK_S, (ended_after, output[-4000:])
    message = _hang_message(output)
    assert "a collective timed out after 5 s (the collective timeout: dist.timeout_s=5) while computing in step 3" \
        in message, message
    assert "trainer.py" in message and "backward" in message, message  # ddp's gradient all-reduce
    assert f"rank 1 (host {socket.gethostname()}, pid {stopped}) did not respond" in message, message
    assert "the last step it began was 3" in message, message


# --------------------------------------------------------------------------- the rules on their own

def _watchdog(step_timeout, init_timeout_s=600) -> Watchdog:
    return Watchdog(step_timeout, init_timeout_s, 0, 1, None, False)


def test_auto_allows_the_first_steps_the_init_timeout_then_ten_medians_at_least_the_floor():
    watch = _watchdog("auto")
    assert watch.allowance("startup")[0] == 600
    watch.begin("step", 1)
    for step in range(2, 6):  # 4 steps timed: still warming up
        watch.phase.began -= 0.5
        watch.begin("step", step)
    assert watch.allowance("step")[0] == 600
    watch.phase.began -= 0.5
    watch.begin("eval", 5)  # the 5th step is timed on leaving it
    assert watch.allowance("step")[0] == AUTO_FLOOR_S  # 10 x 0.5 s is under 120 s
    assert watch.allowance("eval")[0] == 600  # never timed yet
    watch.phase.began -= 30
    watch.begin("step", 6)
    seconds, why = watch.allowance("eval")
    assert seconds == pytest.approx(300, abs=0.1)
    assert why == "dist.step_timeout_s=auto: 10 x its median 30 s, at least 120 s"
    for step in range(7, 13):
        watch.phase.began -= 20
        watch.begin("step", step)
    assert watch.allowance("step")[0] == pytest.approx(200, abs=0.1)  # the median of 0.5 s x 5 and 20 s x 6


def test_a_number_bounds_every_phase_but_start_up_and_the_final_save_and_zero_turns_it_off():
    watch = _watchdog(45)
    assert watch.allowance("startup") == watch.allowance("final") == (600, "dist.init_timeout_s=600")
    for kind in ("step", "eval", "checkpoint", "check"):
        assert watch.allowance(kind) == (45.0, "dist.step_timeout_s=45")
    assert _watchdog(0).allowance("step") is None and _watchdog(0).allowance("startup") is None


def test_the_collective_timeout_is_named_by_the_setting_in_force_even_when_both_are_equal():
    watch = _watchdog("auto", init_timeout_s=1800)
    assert watch.collective_timeout == ("dist.init_timeout_s", 1800)
    watch.training_collectives(1800)  # dist.timeout_s, after the first step: the same number, another key
    assert watch.collective_timeout == ("dist.timeout_s", 1800)


def test_the_main_thread_marks_a_steps_data_wait_then_its_compute():
    watch = _watchdog("auto")
    watch.begin("step", 7)
    assert watch.phase.describe() == "waiting for its data in step 7"
    watch.computing()
    assert watch.phase.describe() == "computing in step 7"
    watch.begin("checkpoint", 7)
    assert watch.phase.describe() == "saving a checkpoint in step 7"


def test_figures_name_the_slowest_and_fastest_rank():
    out = stragglers.figures([0.1, 0.5, 0.2], [0.3, 0.2, 0.4])
    assert out == {"data_time_max_s": 0.5, "data_time_max_rank": 1, "data_time_min_s": 0.1, "data_time_min_rank": 0,
                   "compute_time_max_s": 0.4, "compute_time_max_rank": 2, "compute_time_min_s": 0.2,
                   "compute_time_min_rank": 1}


def test_a_rank_is_a_straggler_past_20_percent_over_the_median_for_a_window(caplog):
    watch = stragglers.StragglerWatch(["a", "b", "c"], warn=True)
    seen = 0
    for step in range(1, 1 + stragglers.WARMUP_STEPS + stragglers.WINDOW_STEPS):
        seen += 1  # ranks 0 and 1 at 1.0 s; rank 2 at 1.19 s: within 20 %
        watch.after_step(step, seen, [0.0, 0.0, 0.19], [1.0, 1.0, 1.0])
    assert not watch.warned and "straggler" not in caplog.text
    for step in range(seen + 1, seen + 1 + stragglers.WINDOW_STEPS):
        seen += 1  # rank 2 at 1.3 s: named once, with its host
        watch.after_step(step, seen, [0.0, 0.0, 0.3], [1.0, 1.0, 1.0])
    assert watch.warned == {2}
    assert "straggler: rank 2 (host c) was 30% slower than the median rank over steps 26-45" in caplog.text
    assert "data wait 0.300 s a step; the median rank's 0.000 s" in caplog.text


def test_the_first_steps_of_an_attempt_are_not_judged():
    watch = stragglers.StragglerWatch(["a", "b"], warn=True)
    for seen in range(1, stragglers.WARMUP_STEPS + 1):
        watch.after_step(seen, seen, [5.0, 0.0], [1.0, 1.0])
    assert watch.steps == 0


@pytest.mark.parametrize("value", ["soon", -1, True])
def test_a_bad_step_timeout_is_a_config_error_naming_the_key(value):
    cfg = regression_config(micro=4)
    cfg.dist.step_timeout_s = value
    with pytest.raises(ConfigError, match=r"dist\.step_timeout_s=.*choose auto, a number of seconds, or 0"):
        validate(cfg, 1)
    cfg.dist.step_timeout_s, cfg.dist.init_timeout_s = 30, 0
    with pytest.raises(ConfigError, match=r"dist\.init_timeout_s=0: must be >= 1"):
        validate(cfg, 1)


def test_only_the_first_rank_to_claim_prints_and_the_others_wait_for_it(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "claims")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    first, second = shared.connect(), shared.connect()
    assert shared.first_to_claim(first, "error", fallback=False)
    assert not shared.first_to_claim(second, "error", fallback=True)
    assert not shared.wait_for(second, "error", timeout_s=0.2)  # not printed yet
    shared.mark(first, "error")
    assert shared.wait_for(second, "error", timeout_s=0.2)
    assert server.check(["dist_trainer/attempt0/health/claim/error"])  # this attempt's namespace
    assert shared.first_to_claim(None, "x", fallback=True) and not shared.first_to_claim(None, "x", fallback=False)


def test_the_error_record_is_torchruns_format_and_earlier_than_any_failure_it_causes(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    console.record_for_torchrun("ConfigError", "optim.lr=-1.0: must be > 0")
    left = time.time()
    record = json.loads(path.read_text())["message"]
    assert record["message"] == record["extraInfo"]["py_callstack"] == "ConfigError: optim.lr=-1.0: must be > 0"
    assert int(record["extraInfo"]["timestamp"]) < int(left)  # the next whole second had begun on return


def test_collective_failures_are_told_from_other_errors():
    assert is_collective_failure(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                                              "Timed out waiting 30000ms for recv operation to complete"))
    assert is_collective_failure(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                                              "Connection closed by peer [127.0.0.1]:37807"))
    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("Timed out waiting for a bus"))
