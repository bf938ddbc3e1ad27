"""A pytest plugin (``-p suite_profile``, tests/ on PYTHONPATH) that counts each test's process starts.

bench/suite_time.py loads it to split the suite's time into start-up and compute: it records, for every
test id, how many processes the test started and of which kind (a spawned rank, a rank forked from the
preloaded server, a ``python`` subprocess, a torchrun launch and its ranks), and writes them as JSON to
the path in DT_SUITE_PROFILE at the end of the session.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import subprocess
from collections import Counter

_current: Counter = Counter()
_starts: dict = {}


def _kind_of_command(args) -> list:
    argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
    text = " ".join(argv)
    if "torch.distributed.run" in text or "torchrun" in text:
        nproc = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--nproc_per_node=")
                      and a.split("=", 1)[1].isdigit()), 1)
        return [("torchrun", 1), ("torchrun_rank", nproc)]
    if argv and "python" in os.path.basename(argv[0]):
        return [("python", 1)]
    return [("other", 1)]


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _counting_popen_init(self, args, *rest, **kwargs):
    for kind, n in _kind_of_command(args):
        _current[kind] += n
    return _popen_init(self, args, *rest, **kwargs)


def _counting_start(self):
    _current[f"rank_{type(self).__name__}"] += 1  # SpawnProcess, ForkServerProcess, ForkProcess, Process
    return _process_start(self)


def pytest_configure(config):
    subprocess.Popen.__init__ = _counting_popen_init
    multiprocessing.process.BaseProcess.start = _counting_start


def pytest_runtest_logstart(nodeid, location):
    _current.clear()


def pytest_runtest_logfinish(nodeid, location):
    _starts[nodeid] = dict(_current)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("DT_SUITE_PROFILE")
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist: one file a worker, none from the controller
    if worker:
        path = f"{path}.{worker}" if path else None
    elif session.config.pluginmanager.hasplugin("dsession"):  # pytest-xdist's controller: its workers count
        return
    if path:
        with open(path, "w") as f:
            json.dump(_starts, f, indent=0, sort_keys=True)
