"""Preemption: SIGTERM or SIGUSR1 asks for a checkpoint and a clean exit.

Schedulers (Slurm's --signal, Kubernetes' termination) send one of these some
time before the kill; torchrun passes them to the workers with
``--signals-to-handle``. The handler only raises a flag: the current optimizer
step finishes, every rank learns of the request through the step's all-reduce
(so they stop after the same step), a checkpoint is written, and the process
exits with EXIT_REQUEUE.
"""

from __future__ import annotations

import signal
import threading
from typing import Dict, Optional

# sysexits' EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_REQUEUE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Stopped on request after a checkpoint; run again in the same run directory to resume."""


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
