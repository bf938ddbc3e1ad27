"""Preemption: SIGTERM or SIGUSR1 (and submitit's SIGUSR2) asks for a checkpoint and a clean exit.

Schedulers (Slurm's --signal, Kubernetes' termination) send one of these some
time before the kill; torchrun passes them to the workers with
``--signals-to-handle``. The handler only raises a flag: the current optimizer
step finishes, every rank learns of the request through the step's all-reduce
(so they stop after the same step), a checkpoint is written, and the process
exits with EXIT_REQUEUE.

Under submitit (``hydra/launcher=submitit_slurm``) the job's signal is
submitit's preemption signal (``SUBMITIT_PREEMPT_SIGNAL``, USR2 by default),
and submitit's own handler requeues the job. It would do so at once, in the
middle of a step; ours takes the signal first, and once the checkpoint is
written ``pass_on`` hands it to submitit's, which requeues the job from rank 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Dict, Optional, Tuple

# sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_REQUEUE = 75

log = logging.getLogger("dist_trainer")


def stop_signals() -> Tuple[int, ...]:
    signals = [signal.SIGTERM, signal.SIGUSR1]
    if "SUBMITIT_EXECUTOR" in os.environ:
        signals.append(getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))
    return tuple(dict.fromkeys(signals))


class Preempted(Exception):
    """Stopped on request after a checkpoint; run again in the same run directory to resume."""

    def __init__(self, message: str, signum: Optional[int] = None):
        super().__init__(message)
        self.signum = signum


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in stop_signals():
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        # Python runs this between two bytecodes of the main thread, not inside the C handler,
        # so logging is safe; a rank blocked in a collective says it once the collective returns.
        if self.signum is None:
            log.warning("%s received: stopping after this optimizer step, with a checkpoint",
                        signal.Signals(signum).name)
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def pass_on(signum: Optional[int]) -> None:
    """Give the signal that stopped the run to the handler that was there before ours, if it is Python's.

    Under torchrun there is none (the default action), and nothing happens.
    Under submitit it is submitit's: on rank 0 it pickles the job and requeues
    it (and exits); on the other ranks it only logs.
    """
    handler = signal.getsignal(signum) if signum is not None else None
    if callable(handler):
        handler(signum, None)
