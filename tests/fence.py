"""What one test may change in pytest's own process, put back before the next test (conftest's autouse fence).

A test runs inside one long-lived process with hundreds of others, so anything global it changes and
leaves reaches every later test: an environment variable, a signal handler, the RNG, torch's default
dtype, its deterministic flags or grad mode, its intra-op threads, dynamo's compiled code, a logging
handler, the working directory, an open process group. ``Fence`` snapshots all of them before a test
and restores them after it; threads it cannot restore, so a non-daemon thread the test started and
left running is reported (``stray_threads``) and fails the test that left it.

Ranks and CLI runs need none of this: each is a fresh fork of the preloaded server (tests/preloaded.py).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from typing import List

import torch
import torch.distributed as dist

# The signals a test may catch (SIGKILL and SIGSTOP cannot be; SIGCHLD and SIGWINCH are the runtime's).
SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
                       signal.SIGALRM, signal.SIGCONT, signal.SIGPIPE, signal.SIGQUIT)]
LOGGERS = ("", "dist_trainer", "torch", "torch.distributed", "hydra")
THREAD_GRACE_S = 5.0


class Fence:
    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
        self.random = random.getstate()
        self.torch_rng = torch.get_rng_state()
        np = sys.modules.get("numpy")
        self.numpy_rng = np.random.get_state() if np is not None else None
        self.default_dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.grad_enabled = torch.is_grad_enabled()
        self.num_threads = torch.get_num_threads()
        self.matmul_precision = torch.get_float32_matmul_precision()
        self.loggers = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                               logging.getLogger(name).propagate, logging.getLogger(name).disabled)
                        for name in LOGGERS}
        self.logging_disable = logging.root.manager.disable
        self.threads = {t.ident for t in threading.enumerate()}
        self.dynamo_used = self._dynamo_frames()

    @staticmethod
    def _dynamo_frames() -> int:
        dynamo = sys.modules.get("torch._dynamo.utils")
        return sum(dynamo.counters["frames"].values()) if dynamo is not None else 0

    def restore(self) -> List[str]:
        """Put everything back; the names of what had changed (for a test of the fence, and for a report)."""
        changed = []
        if dict(os.environ) != self.environ:
            changed.append("environment")
            os.environ.clear()
            os.environ.update(self.environ)
        try:
            cwd = os.getcwd()
        except FileNotFoundError:  # a test that moved into its tmp_path, removed when the test passed
            cwd = None
        if cwd != self.cwd:
            changed.append("working directory")
            os.chdir(self.cwd)
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) != handler:
                changed.append(f"handler of {signal.Signals(sig).name}")
                signal.signal(sig, handler)
        random.setstate(self.random)
        torch.set_rng_state(self.torch_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.numpy_rng is not None:
            np.random.set_state(self.numpy_rng)
        if torch.get_default_dtype() != self.default_dtype:
            changed.append("default dtype")
            torch.set_default_dtype(self.default_dtype)
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            changed.append("deterministic algorithms")
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if torch.is_grad_enabled() != self.grad_enabled:
            changed.append("grad mode")
            torch.set_grad_enabled(self.grad_enabled)
        if torch.get_num_threads() != self.num_threads:
            changed.append("intra-op threads")
            torch.set_num_threads(self.num_threads)
        if torch.get_float32_matmul_precision() != self.matmul_precision:
            changed.append("float32 matmul precision")
            torch.set_float32_matmul_precision(self.matmul_precision)
        for name, (level, handlers, propagate, disabled) in self.loggers.items():
            logger = logging.getLogger(name)
            if (logger.level, logger.handlers, logger.propagate, logger.disabled) != (level, handlers, propagate,
                                                                                      disabled):
                changed.append(f"logger {name or 'root'}")
                for handler in logger.handlers:
                    if handler not in handlers:
                        handler.close()
                logger.setLevel(level)
                logger.handlers[:] = handlers
                logger.propagate, logger.disabled = propagate, disabled
        if logging.root.manager.disable != self.logging_disable:
            changed.append("logging.disable")
            logging.disable(self.logging_disable)
        if dist.is_available() and dist.is_initialized():
            changed.append("process group")
            dist.destroy_process_group()
        if self._dynamo_frames() != self.dynamo_used:
            changed.append("dynamo caches")
            torch._dynamo.reset()
        return changed

    def stray_threads(self, grace_s: float = THREAD_GRACE_S) -> List[threading.Thread]:
        """Non-daemon threads started since the snapshot and still running after ``grace_s``.

        An executor's idle workers (concurrent.futures, e.g. inductor's compile pool kept for the next
        compile) are not strays: their executor owns them and the interpreter's exit ends them.
        """
        from concurrent.futures import thread as pool

        deadline = time.monotonic() + grace_s
        while True:
            pooled = set(getattr(pool, "_threads_queues", {}))
            stray = [t for t in threading.enumerate()
                     if t.ident not in self.threads and not t.daemon and t.is_alive() and t not in pooled]
            if not stray or time.monotonic() > deadline:
                return stray
            stray[0].join(timeout=max(0.0, min(0.1, deadline - time.monotonic())))
