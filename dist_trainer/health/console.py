"""One error, shown once above torchrun's summary and named in it, whichever rank fails first.

Under torchrun every rank may hit the same error (a bad config value is bad
everywhere) or one rank alone may (its data, its disk). Printing from rank 0
only loses the message when another rank fails first: torchrun stops every
worker as soon as one exits, and rank 0 can be killed before it printed (on
a loaded machine it may still be importing torch). So the first rank to fail
prints, decided by an atomic claim in torchrun's store; the others wait until
it has printed before they exit, so torchrun's SIGTERM cannot cut it short.

torchrun's summary names the failure with the earliest timestamp, in whole
seconds; a rank it killed gets the time it noticed. A rank that records its
error therefore waits for the next second before exiting: every rank killed
because of it is noticed later than the error, and the summary shows the cause.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import List, Optional

from .. import distributed
from . import store as shared

log = logging.getLogger("dist_trainer")
_HIDDEN: List[logging.Handler] = []  # console handlers taken off ranks other than 0
PRINTED_WAIT_S = 30.0  # how long the other ranks wait for the first one to print


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def console_on_main_only() -> None:
    """Ranks other than 0 keep their own log file but stay off the console (kept, for ``show_error``)."""
    if distributed.rank() != 0:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if _is_console(h)]:
            root.removeHandler(handler)
            _HIDDEN.append(handler)


def show_error(message: str, on_console: bool, level: int = logging.ERROR) -> None:
    """Log ``message`` into this rank's log file, and on the console only if ``on_console``."""
    root = logging.getLogger()
    record = log.makeRecord(log.name, level, __file__, 0, "%s", (message,), None)
    consoles = [h for h in root.handlers if _is_console(h)] + _HIDDEN
    for handler in root.handlers:
        if not _is_console(handler):
            handler.handle(record)
    if on_console:
        if not consoles:  # logging not configured (Hydra has not run yet)
            print(f"[{logging.getLevelName(level)}] - {message}", file=sys.stderr, flush=True)
        for handler in consoles:
            handler.handle(record)
            handler.flush()


def record_for_torchrun(kind: str, message: str) -> None:
    """Write the error where torchrun reads it, so that its closing summary names the cause.

    torchrun gives each worker TORCHELASTIC_ERROR_FILE; without it (a plain
    process) there is nothing to write. These errors are expected and say what
    to change, so the "traceback" torchrun prints is the message itself.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"{kind}: {message}"
    now = time.time()
    record = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(now))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        return  # the error itself was logged; a summary without it is no reason to fail differently
    time.sleep(int(now) + 1 - now + 0.01)  # see the module's docstring: the cause must be the earliest


def report_error(kind: str, message: str, printed: Optional[str] = None) -> None:
    """The whole error path of one rank: print if first, record for torchrun, let the first one finish.

    ``printed``: text to write to stderr instead of logging ``message`` (Hydra's own output).
    """
    store, name = shared.connect(), "error"
    first = shared.first_to_claim(store, name, fallback=distributed.rank() == 0)
    if printed is None:
        show_error(message, on_console=first)
    elif first:
        sys.stderr.write(printed)
        sys.stderr.flush()
    if first:
        shared.mark(store, name)
    else:
        shared.wait_for(store, name, PRINTED_WAIT_S)
    record_for_torchrun(kind, message)
