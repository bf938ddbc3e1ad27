"""A client of torchrun's rendezvous store, for what ranks must agree on outside a collective.

A collective cannot tell a live rank from a stopped one: it just waits. The
store can. torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE) and
keeps serving while a worker is stopped, so the ranks that still run can
leave and read notes there: "I am rank 3 on host h, pid p", "I began step
41", "rank 0 says the run hangs", "rank 1 has printed the error". Every
client here has its own short timeout, so a store that does not answer (a
multi-node launch whose store lives in rank 0, and rank 0 stopped) costs
seconds, not the job. Under submitit (Slurm sweeps) rank 0 hosts the store, as
on a multi-node torchrun. A plain process has no shared store; a group of one
gets an in-process one, so the code path stays the same.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Dict, List, Optional

import torch.distributed as dist

from .. import distributed

STORE_TIMEOUT_S = 5.0  # any one store operation; the store is local to the node or one hop away


def connect(timeout_s: float = STORE_TIMEOUT_S) -> Optional[dist.Store]:
    """This attempt's namespace in the ranks' store; None without one (a plain process) or when it does not answer.

    The namespace is the process group's (distributed.attempt_prefix): an
    elastic restart starts with no notes of the attempt before it.
    """
    if not distributed.has_rendezvous_store():
        return None
    host, port = distributed.rendezvous_address()
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
    except (RuntimeError, ValueError):  # DistStoreError / DistNetworkError are RuntimeErrors
        return None
    return dist.PrefixStore(f"{distributed.attempt_prefix() or 'dist_trainer'}/health", store)


def first_to_claim(store: Optional[dist.Store], name: str, fallback: bool) -> bool:
    """Whether this rank is the first to claim ``name`` (an atomic add); ``fallback`` without a store."""
    if store is None:
        return fallback
    try:
        return store.add(f"claim/{name}", 1) == 1
    except RuntimeError:
        return fallback


def mark(store: Optional[dist.Store], name: str) -> None:
    """Say that ``name`` is done, for ranks waiting on it (``wait_for``)."""
    if store is not None:
        try:
            store.set(f"done/{name}", "1")
        except RuntimeError:
            pass


def wait_for(store: Optional[dist.Store], name: str, timeout_s: float) -> bool:
    """Wait until some rank marks ``name`` done; False on timeout or without a store."""
    if store is None:
        return False
    try:
        store.wait([f"done/{name}"], timedelta(seconds=timeout_s))
        return True
    except RuntimeError:
        return False


def identity() -> Dict[str, object]:
    """What names this process to a person reading the error: host, pid, and its torchrun agent's pid."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "agent_pid": os.getppid()}


def publish(store: dist.Store, key: str, value: dict) -> None:
    store.set(key, json.dumps(value))


def read_all(store: dist.Store, prefix: str, ranks: List[int]) -> Dict[int, dict]:
    """The ``prefix/<rank>`` notes that exist, by rank (a missing one is not waited for)."""
    found = {}
    for r in ranks:
        key = f"{prefix}/{r}"
        if store.check([key]):
            found[r] = json.loads(store.get(key))
    return found
