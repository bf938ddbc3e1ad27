"""The one place that reads torchrun's environment and owns the process group."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("dist_trainer")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    owns_group: bool
    local_world_size: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE): the node a shard group may fill

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def rank() -> int:
    """This process's global rank (0 when not launched by torchrun)."""
    return _int_env("RANK", 0)


def local_rank() -> int:
    """This process's rank on its node (0 when not launched by torchrun)."""
    return _int_env("LOCAL_RANK", 0)


def local_world_size() -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE); without torchrun, every rank is on this node."""
    return _int_env("LOCAL_WORLD_SIZE", world_size())


def launched_local_world_size() -> Optional[int]:
    """Ranks per node as torchrun set it; None outside torchrun."""
    return int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None


def world_size() -> int:
    """The world size, known before the process group exists (for validation)."""
    return dist.get_world_size() if dist.is_initialized() else _int_env("WORLD_SIZE", 1)


def run_id() -> str:
    """A name all ranks agree on without talking to each other.

    torchrun gives every worker the same TORCHELASTIC_RUN_ID (the --rdzv_id, or a
    fresh uuid under --standalone), and keeps it across elastic restarts; a plain
    single process has no peers to agree with and takes a timestamp. Without
    --rdzv_id torchrun says "none" on every job: on one node the workers share
    their torchrun agent, so its pid and start time name the run; across nodes
    nothing shared is known, and guessing would mix jobs, so it is an error.
    """
    rid = os.environ.get("TORCHELASTIC_RUN_ID")
    if rid and rid != "none":
        return rid
    if rid == "none":
        if world_size() > _int_env("LOCAL_WORLD_SIZE", 1):
            raise RuntimeError("torchrun gave no run id (pass --rdzv_id=JOB_ID, or hydra.run.dir=...): "
                               "ranks on different nodes could not agree on a run directory")
        agent = os.getppid()
        with open(f"/proc/{agent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time, clock ticks after boot
        return f"torchrun-{agent}-{started}"
    return time.strftime("local-%Y%m%d-%H%M%S")


def pick_device(preference: str, local_rank: int) -> torch.device:
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    # One GPU per process: torchrun's LOCAL_RANK picks it.
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init(device_preference: str = "auto", timeout_s: int = 1800) -> DistEnv:
    """Join (or, for a single plain process, create) the default process group.

    A process group already set up by the caller (tests spawning ranks with a
    file:// store) is used as it is, and ``owns_group`` is False so that
    ``shutdown`` leaves it to its owner.
    """
    local_rank = _int_env("LOCAL_RANK", 0)
    device = pick_device(device_preference, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    owns_group = not dist.is_initialized()
    if owns_group:
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # launched by torchrun
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend, store=_torchrun_store(rank, world, timeout),
                                    rank=rank, world_size=world, timeout=timeout)
        else:
            # python -m dist_trainer: a group of one, so the code path is the same.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), device, dist.get_backend(), owns_group,
                   local_world_size())


def _torchrun_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's rendezvous store for this restart attempt, with no keys of an earlier one.

    By default torchrun's agent hosts one TCP store for the whole job and hands
    it to every attempt. After an elastic restart the keys of the failed attempt
    are still there, and a new gloo group can read its dead peers' addresses
    ("Connection refused") or wait forever (pytorch issues 135712, 167288). A
    prefix made of TORCHELASTIC_RESTART_COUNT gives each attempt a clean
    namespace. That count is the same on every worker only while all of them
    come from one agent: across nodes, an agent that restarts because another
    node's workers failed does not count it. So multi-node launches set
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch/ does): then every rendezvous
    round gets a fresh store, hosted by rank 0 on a new port, and needs no prefix.
    """
    host, port = rendezvous_address()
    prefix = attempt_prefix()
    store = dist.TCPStore(host, port, world, is_master=prefix is None and rank == 0,
                          timeout=timeout, multi_tenant=prefix is None)
    if prefix is None:
        return store  # new for this attempt
    nodes = _int_env("GROUP_WORLD_SIZE", 1)
    if nodes > 1 and _int_env("TORCHELASTIC_MAX_RESTARTS", 0) > 0 and rank == 0:
        log.warning("%d nodes with --max-restarts and torchrun's shared store: a restart can leave nodes in "
                    "different store namespaces and hang. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every "
                    "node (launch/ does).", nodes)
    return dist.PrefixStore(prefix, store)


def rendezvous_address() -> tuple[str, int]:
    """Where torchrun's store for this attempt listens (MASTER_ADDR, MASTER_PORT)."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def has_rendezvous_store() -> bool:
    """Whether the ranks meet at a TCP store (torchrun's, or rank 0's under submitit) that a client can reach."""
    return "MASTER_ADDR" in os.environ and "RANK" in os.environ


def adopt_submitit_task() -> None:
    """A task of a submitit job (``hydra/launcher=submitit_slurm`` or ``submitit_local``) is a rank.

    submitit starts one process per task, with Slurm's numbering (or its local
    executor's) and no torchrun: its own helper says it in torchrun's words
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, and a
    MASTER_PORT drawn from the job id, the same on every task and again after a
    requeue). Rank 0 then hosts the store, as under a multi-node torchrun.
    Called before Hydra configures logging, which names each rank's log file.
    CUDA_VISIBLE_DEVICES is left alone: LOCAL_RANK picks the GPU, as under torchrun.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local") or "RANK" in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def attempt_prefix() -> Optional[str]:
    """This attempt's key prefix on torchrun's agent store; None where the store is new in each round.

    The agent's store lives across restarts (see _torchrun_store); a store of
    rank 0's (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) needs no prefix, and on
    several nodes the agents' restart counts may differ.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return f"dist_trainer/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def set_timeout(seconds: float, groups: list) -> None:
    """Give the process groups' later collectives ``seconds`` (dist.timeout_s after dist.init_timeout_s).

    torch has no public way to change a group's timeout once it exists;
    _set_pg_timeout is what torchtitan uses for the same split (a long first
    collective while ranks load, short ones while they train).
    """
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def shutdown(env: DistEnv, finished: bool = False) -> None:
    """Destroy the process group; after a finished run, only once every rank is past its last collective.

    A rank that tears the gloo group down while a peer is still completing the
    last collective can make that peer abort at exit (SIGABRT, "terminate
    called without an active exception") after all its work is done. The
    store, not the group, says when every rank has arrived, so the wait itself
    leaves nothing in flight on the group. After a failure nothing waits: a
    peer may be gone.
    """
    if env.owns_group and dist.is_initialized():
        if finished and env.world_size > 1:
            _store_barrier(env.world_size)
        dist.destroy_process_group()


def _store_barrier(world_size: int, timeout_s: float = 120.0) -> None:
    """Wait until every rank has reached this point (counted on the default group's store)."""
    store = dist.distributed_c10d._get_default_store()
    key = f"{attempt_prefix() or 'dist_trainer'}/finished"
    if store.add(key, 1) == world_size:  # the last to arrive tells the others
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"], timedelta(seconds=timeout_s))
    except RuntimeError:  # past the deadline: tear down anyway
        pass
