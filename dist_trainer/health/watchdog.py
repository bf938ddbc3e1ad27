"""``dist.step_timeout_s``: a hung step ends the run in seconds, and says which rank hung.

A stopped rank (a stalled GPU, a deadlocked loader, a hung file system) makes
its peers wait inside a collective until ``dist.timeout_s``, and torchrun,
which watches exit codes only, never notices. So every rank runs a thread that
knows which phase the main thread is in (startup, a step's data wait or its
compute, an evaluation, a checkpoint) and since when. When a phase runs past
its allowance, or a peer says the run hangs, the thread:

1. says so in the store (``hang``), so that every rank that can still run joins
   within a poll, and leaves its own answer: its step, its phase, how long;
2. waits a few seconds for the answers, then names the ranks that did not
   answer (stopped, or frozen whole) and those behind the others (a rank still
   waiting for its data while the others wait for it in a collective);
3. writes every thread's Python stack into its rank log (faulthandler);
4. shows one error (the first rank to get there prints it), records it for
   torchrun's summary, kills the stopped ranks of its own agent (torchrun
   would wait 30 s after its SIGTERM, which a stopped process cannot act on)
   and its own loader workers, and exits with EXIT_HUNG.

torchrun then stops the rest and, with ``--max-restarts``, starts the workers
again; they resume from the newest checkpoint. A collective that times out
first (the watchdog off, or ``dist.timeout_s`` shorter) takes the same path
from the main thread, with the collective's name and the time it waited.

Allowances (``dist.step_timeout_s``): a number applies to every step,
evaluation and checkpoint; ``auto`` gives each kind of phase 10 x its median
duration in this attempt, at least 120 s, and, until it has been timed (5
steps; one evaluation, one checkpoint), ``dist.init_timeout_s``: the first
steps hold compilation and warm-up. Start-up and the final model's save, once
each, always have ``dist.init_timeout_s``.
0 turns the watchdog off (the thread still answers a peer's question).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import re
import signal
import statistics
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Deque, Dict, List, Optional, Union

import torch.distributed as dist

from .. import distributed
from . import store as shared
from .console import record_for_torchrun, show_error

log = logging.getLogger("dist_trainer")

EXIT_HUNG = 124  # timeout(1)'s status: the run did not finish in time
POLL_S = 1.0  # how often the thread looks at the clock and the store
ANSWER_WAIT_S = 3 * POLL_S  # every rank that still runs answers within a poll
AUTO_FACTOR, AUTO_FLOOR_S, WARMUP_STEPS = 10.0, 120.0, 5
# How far into a step a rank is, to tell who is behind: data wait, then compute, then the rest.
ORDER = {"startup": 0, "data": 1, "compute": 2, "eval": 3, "publish": 4, "checkpoint": 5, "check": 6, "final": 7}
_PACKAGE = str(Path(__file__).resolve().parents[1])


@dataclass
class Phase:
    kind: str  # startup, step, eval, publish, checkpoint, check, final
    step: int  # the step it belongs to (a step's number from its data wait on)
    began: float  # time.monotonic()
    detail: str = ""  # a step's part: "data" until its micro-batches are there, then "compute"

    @property
    def part(self) -> str:
        return self.detail or self.kind

    def describe(self) -> str:
        what = {"data": "waiting for its data", "compute": "computing", "startup": "starting up",
                "eval": "evaluating", "publish": "publishing the weights",
                "checkpoint": "saving a checkpoint", "check": "checking consistency",
                "final": "saving the final model"}[self.part]
        return f"{what} in step {self.step}" if self.part != "startup" else f"{what} (before step {self.step})"


class Watchdog:
    """One per rank, from the process group's start to the run's end."""

    def __init__(self, step_timeout: Union[str, float], init_timeout_s: float, rank: int, world_size: int,
                 store: Optional[dist.Store], shared_store: bool):
        self.step_timeout, self.init_timeout_s = step_timeout, float(init_timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store, self.shared_store = store, shared_store
        # The process groups' timeout as it is now, and the setting it comes from (training_collectives).
        self.collective_timeout = ("dist.init_timeout_s", self.init_timeout_s)
        self.phase = Phase("startup", 1, time.monotonic())
        self.durations: Dict[str, Deque[float]] = {}
        self._lock = threading.Lock()  # one hang report per process, from the thread or the main thread
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.whois: Dict[int, dict] = {}  # rank -> host, pid, agent pid: read when the run hangs
        self.silent: List[int] = []  # the ranks that did not answer then
        if store is not None:
            shared.publish(store, f"whois/{rank}", shared.identity())
            self._beat(1)
            self._thread = threading.Thread(target=self._watch, name="dist_trainer-watchdog", daemon=True)
            self._thread.start()

    # -- what the main thread calls: an attribute write, and one store set per step --

    def begin(self, kind: str, step: int) -> None:
        """The main thread starts ``kind`` (a step: its data wait first); the phase before it is timed."""
        now = time.monotonic()
        previous = self.phase
        if previous.kind != "startup":
            self.durations.setdefault(previous.kind, deque(maxlen=100)).append(now - previous.began)
        self.phase = Phase(kind, step, now, "data" if kind == "step" else "")
        if kind == "step":
            self._beat(step)

    def computing(self) -> None:
        """The step's micro-batches are here: from now on it computes (and waits in collectives)."""
        self.phase.detail = "compute"

    def training_collectives(self, timeout_s: float) -> None:
        """The first step is over: the process groups now time out after dist.timeout_s."""
        self.collective_timeout = ("dist.timeout_s", float(timeout_s))

    def close(self) -> None:
        self._closed.set()

    # -- the thread --

    def allowance(self, kind: str) -> Optional[tuple[float, str]]:
        """(seconds the phase may run before it counts as a hang, the setting that says so); None: no limit."""
        if self.step_timeout == 0:
            return None
        if kind in ("startup", "final"):  # once per attempt, like loading: the final model's gather and save
            return self.init_timeout_s, f"dist.init_timeout_s={self.init_timeout_s:g}"
        if self.step_timeout != "auto":
            return float(self.step_timeout), f"dist.step_timeout_s={self.step_timeout}"
        times = list(self.durations.get(kind, ()))
        if len(times) < (WARMUP_STEPS if kind == "step" else 1):
            return self.init_timeout_s, f"dist.init_timeout_s={self.init_timeout_s:g}, until it has been timed"
        median = statistics.median(times)
        return (max(AUTO_FLOOR_S, AUTO_FACTOR * median),
                f"dist.step_timeout_s=auto: {AUTO_FACTOR:g} x its median {median:.3g} s, at least {AUTO_FLOOR_S:g} s")

    def _watch(self) -> None:
        store_failed = False
        while not self._closed.wait(POLL_S):
            phase = self.phase
            limit = self.allowance(phase.kind)
            elapsed = time.monotonic() - phase.began
            if limit is not None and elapsed > limit[0]:
                self.hang(f"{phase.describe()} has taken {elapsed:.0f} s, over its allowance of {limit[0]:.0f} s "
                          f"({limit[1]})")
            try:
                flagged = self.shared_store and self.store.check(["hang"])
            except RuntimeError as err:
                if not store_failed:
                    log.warning("watchdog: torchrun's store does not answer (%s); hangs are still timed here", err)
                store_failed, flagged = True, False
            if flagged and not self._closed.is_set():
                self.hang(f"rank {self.store.get('hang').decode()} found the run hung; this rank was "
                          f"{phase.describe()} for {elapsed:.0f} s")

    def _beat(self, step: int) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"beat/{self.rank}", str(step))  # a few microseconds; the store is the agent's
        except RuntimeError:
            pass  # the thread notices a store that is gone and says so

    # -- the report, from either thread: it does not return --

    def collective_failed(self, err: BaseException) -> None:
        """A collective timed out (or a peer's connection closed) in the main thread: report it as a hang."""
        waited = re.search(r"[Tt]imed out waiting (\d+)ms", str(err))
        key, seconds = self.collective_timeout
        how = (f"timed out after {int(waited.group(1)) / 1000:.0f} s (the collective timeout: {key}={seconds:.0f})"
               if waited else f"failed ({str(err).splitlines()[0][:200]})")
        self.hang(f"a collective {how} while {self.phase.describe()}, in {_where(err)}")

    def hang(self, cause: str) -> None:
        with self._lock:
            self._closed.set()
            phase = self.phase
            findings = self._ask_everyone(phase)
            message = f"the run hangs: {cause}. {findings}"
            _dump_stacks(message, self.rank)
            first = shared.first_to_claim(self.store, "hang", fallback=True)
            show_error(message, on_console=first)
            record_for_torchrun("HangError", message)
            self._kill_stopped_siblings()
            for child in multiprocessing.active_children():  # loader workers: they may be the ones stuck
                child.kill()
            logging.shutdown()
            os._exit(EXIT_HUNG)

    def _ask_everyone(self, phase: Phase) -> str:
        """Raise the flag, answer, wait for the others' answers; say who did not arrive."""
        if self.store is None or (not self.shared_store and self.world_size > 1):
            return "The other ranks' state is unknown here (not launched by torchrun: no shared store). " + _AFTER
        try:
            answers, beats = self._gather(phase)
        except RuntimeError as err:
            host, port = distributed.rendezvous_address()
            return (f"torchrun's store at {host}:{port} did not answer ({err}): if rank 0 hosts it "
                    "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0 is likely the one that stopped. " + _AFTER)
        return self._findings(answers, beats) + ". " + _AFTER

    def _gather(self, phase: Phase) -> tuple[Dict[int, dict], Dict[int, int]]:
        """(every rank's answer that came within ANSWER_WAIT_S, the step each rank last began)."""
        ranks = list(range(self.world_size))
        if self.shared_store:
            self.store.compare_set("hang", "", str(self.rank))  # the first rank to say so is named
        shared.publish(self.store, f"answer/{self.rank}", {"step": phase.step, "part": phase.part,
                                                           "said": phase.describe(),
                                                           "for_s": time.monotonic() - phase.began})
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline and len(shared.read_all(self.store, "answer", ranks)) < len(ranks):
            time.sleep(0.2)
        self.whois = shared.read_all(self.store, "whois", ranks)
        beats = {r: int(self.store.get(f"beat/{r}")) for r in ranks if self.store.check([f"beat/{r}"])}
        return shared.read_all(self.store, "answer", ranks), beats

    def _findings(self, answers: Dict[int, dict], beats: Dict[int, int]) -> str:
        """Who did not answer, who is behind the others, and who waited for them."""
        self.silent = [r for r in range(self.world_size) if r not in answers]
        furthest = max((a["step"], ORDER[a["part"]]) for a in answers.values())
        behind = [r for r, a in sorted(answers.items()) if (a["step"], ORDER[a["part"]]) < furthest]
        parts = [f"{self._who(r)} did not respond: stopped, or frozen whole; the last step it began was "
                 f"{beats.get(r, '?')}" for r in self.silent]
        parts += [f"{self._who(r)} is behind the others, {answers[r]['said']} for {answers[r]['for_s']:.0f} s"
                  for r in behind]
        if not parts and self.world_size == 1:
            return f"{self._who(self.rank)} is {answers[self.rank]['said']}"
        if not parts:
            return (f"every rank responds and is {answers[self.rank]['said']}: the same collective or device is "
                    "stuck on all of them; compare their stacks")
        waiting = [r for r in sorted(answers) if r not in behind]
        them = "them" if len(self.silent) + len(behind) > 1 else "it"
        return "; ".join(parts + [f"rank{'s' if len(waiting) > 1 else ''} {_ranks(waiting)} waited for {them}"])

    def _who(self, r: int) -> str:
        info = self.whois.get(r)
        return f"rank {r} (host {info['host']}, pid {info['pid']})" if info else f"rank {r}"

    def _kill_stopped_siblings(self) -> None:
        """SIGKILL the ranks of this torchrun agent that did not answer: torchrun's SIGTERM cannot reach them."""
        me = shared.identity()
        for r in self.silent:
            info = self.whois.get(r)
            if info and info["host"] == me["host"] and info["agent_pid"] == me["agent_pid"]:
                try:
                    os.kill(info["pid"], signal.SIGKILL)
                    log.error("killed rank %d (pid %d), which did not respond, so that the restart need not "
                              "wait for torchrun's shutdown timeout", r, info["pid"])
                except OSError:
                    pass


_AFTER = ("Every rank that responded wrote its threads' stacks into its log (rank<N>.log in the run "
          f"directory). The run stops (exit {EXIT_HUNG}); with torchrun --max-restarts it starts again "
          "from the newest checkpoint (a submitit sweep: run it again to resume)")


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _where(err: BaseException) -> str:
    """The torch call that failed and the line of ours that called it."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if f.filename.startswith(_PACKAGE)]
    call = frames[-1].name if frames else "?"
    if not ours:
        return call
    line = ours[-1]
    return f"{call}, called from {Path(line.filename).name}:{line.lineno} {line.name}: `{line.line}`"


def _dump_stacks(message: str, rank: int) -> None:
    """Every thread's Python stack into this rank's log files (stderr if it has none)."""
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    show_error(f"{message}\nthe stacks of every thread of rank {rank} follow:",
               on_console=False)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if not files:
        faulthandler.dump_traceback(all_threads=True)
        return
    for path in files:
        with open(path, "a") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)


def is_collective_failure(err: BaseException) -> bool:
    """A collective that timed out or lost a peer (gloo's and NCCL's errors), not a bug of ours."""
    if isinstance(err, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("/gloo/" in text or "Watchdog caught collective" in text) and any(
        s in text for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer"))


def start(step_timeout: Union[str, float], init_timeout_s: float, rank: int, world_size: int) -> Watchdog:
    """The watchdog of this rank, on torchrun's store (an in-process one for a group of one)."""
    store = shared.connect()
    shared_store = store is not None
    if store is None and world_size == 1:
        store = dist.HashStore()
    return Watchdog(step_timeout, init_timeout_s, rank, world_size, store, shared_store)
