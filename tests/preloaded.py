"""Test processes without the import bill: ranks and CLI runs forked from one preloaded server.

A process started with ``spawn`` (or a ``python -m dist_trainer`` subprocess) imports torch, Hydra, all
of dist_trainer and often transformers, peft and torchao: 2-4 s on these 2 cores, for a case that
computes for milliseconds. Here the standard library's forkserver imports them once (PRELOAD), and
every rank and CLI run is a fork of it: a fresh process image each time, so a case can leak nothing
into the next one (each starts from the server's untouched state), and a failed or hung case takes
only its own processes down.

What a fork does not inherit from the test that starts it is carried explicitly: the environment
(``os.environ`` at launch, monkeypatched variables included; the working directory and sys.path are
carried by multiprocessing itself). What the preload reads once at import is fixed before the server
starts (``FROZEN_ENV``: one OpenMP thread, Hugging Face offline): a test that needs another value of
those must run its process with ``spawn``.

Each process's stdout and stderr go to files next to its results; the launcher copies them to its own
stdout and stderr (so pytest shows them with a failed test) and, for a hung launch, first asks every
process for its threads' stacks (SIGUSR1, faulthandler) so the report says where each one waits.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# What every test process imports, once, in the server. A module missing here (an extra not installed)
# is skipped by the server; a test that needs it imports it in its own process.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.checkpoint",
    "torch.nn.parallel", "torch.utils.data", "numpy", "omegaconf", "hydra",
    "dist_trainer.run", "dist_trainer.cli", "dist_trainer.plan", "dist_trainer.trainer",
    "transformers", "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.bert.modeling_bert", "peft",
    "torchao.float8", "helpers", "gc_frozen",  # gc_frozen last: it freezes what the others made
]

# Read by the preloaded modules at import, so fixed for every forked process: set before the server starts.
FROZEN_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
}

STACKS_GRACE_S = 2.0  # after SIGUSR1, the time a hung process gets to write its stacks


def context():
    """The forkserver context, its server started with PRELOAD (_start_server)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    _start_server()
    return ctx


def _start_server() -> None:
    """Start the server (once) with this folder on its path.

    Python 3.11's forkserver is handed the parent's sys.path but does not apply it: the server's path is
    an interpreter's default, its working directory first. From the repository's root (where the README's
    test command runs) ``helpers`` and ``gc_frozen`` were then not found, and the preload skips what it cannot
    import without a word: every forked case walked a million objects per gc.collect() again (the default
    tier 5:53 from the root against 4:33 from tests/). PYTHONPATH while it starts puts this folder there.
    """
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, before] if before else [here])
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def freeze_env() -> None:
    """FROZEN_ENV into os.environ (for the server and everything this process starts): before any fork.

    Hugging Face's cache paths are read at import too: unless the caller chose one, HF_HOME is a fresh
    temporary folder, so no test process writes a cache into the home directory.
    """
    for name, value in FROZEN_ENV.items():
        os.environ.setdefault(name, value)
    if "HF_HOME" not in os.environ:
        os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dist-trainer-tests-hf-")


# ------------------------------------------------------------------- in the forked process

def enter(env: Dict[str, str], out_path: str, err_path: Optional[str] = None) -> None:
    """The launching test's environment, stdout to ``out_path`` and stderr to ``err_path`` (the same file
    when None, as a shell's 2>&1), and every thread's stack on SIGUSR1."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path or out_path)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file, fd)
        os.close(file)
    faulthandler.enable(file=sys.stderr)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _cli_main(argv: List[str], env: Dict[str, str], cwd: str, out_path: str, err_path: Optional[str],
              extra_path: Sequence[str]) -> None:
    """``python -m dist_trainer *argv`` in this forked process, ending as the interpreter would."""
    enter(env, out_path, err_path)
    os.chdir(cwd)
    sys.path[:0] = [p for p in extra_path if p not in sys.path]
    sys.argv = ["dist_trainer", *argv]
    code = 0
    try:
        runpy.run_module("dist_trainer", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # What Python's own exit does and a multiprocessing child skips: join the threads, run atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------- in the launching test

def show_logs(log_prefixes: Sequence[str], title: str) -> None:
    """Each process's captured stdout and stderr onto this process's (pytest shows them with a failure)."""
    for prefix in log_prefixes:
        for suffix, stream in (("out", sys.stdout), ("err", sys.stderr)):
            path = Path(f"{prefix}.{suffix}")
            text = path.read_text(errors="replace") if path.is_file() else ""
            if text:
                stream.write(f"----- {title} {path.name}\n{text}")
                stream.flush()


def dump_stacks(processes) -> None:
    """Ask each live process for every thread's stack (written to its stderr file)."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if alive:
        time.sleep(STACKS_GRACE_S)


def kill_all(processes) -> None:
    """SIGKILL whichever of ``processes`` still run, then reap them all."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def run_cli(argv: List[str], cwd: Path, timeout: float, env: Optional[Dict[str, str]] = None
            ) -> subprocess.CompletedProcess:
    """``python -m dist_trainer *argv`` forked from the preloaded server; a CompletedProcess like subprocess.run's.

    Past ``timeout`` the process's stacks are written to its stderr and it is killed; subprocess.TimeoutExpired
    is raised as subprocess.run would.
    """
    log_dir = Path(tempfile.mkdtemp(prefix="dist-trainer-cli-"))  # not in cwd: a test may look at what a run wrote
    prefix = str(log_dir / "cli")
    env = dict(os.environ if env is None else env)
    # What ``python -m`` puts first on sys.path: the working directory, then PYTHONPATH.
    extra = [str(cwd), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    process = context().Process(target=_cli_main, args=(list(argv), env, str(cwd), f"{prefix}.out", f"{prefix}.err",
                                                        extra), daemon=False)
    process.start()
    process.join(timeout)
    timed_out = process.is_alive()
    if timed_out:
        dump_stacks([process])
        kill_all([process])
    out, err = (Path(f"{prefix}.{suffix}").read_text(errors="replace") if Path(f"{prefix}.{suffix}").is_file()
                else "" for suffix in ("out", "err"))
    shutil.rmtree(log_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "dist_trainer", *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(cmd, process.exitcode, out, err)  # -N: killed by signal N, as subprocess


# ------------------------------------------------------------------- torchrun's workers, without the agent

# What torchrun --standalone gives each worker. As under torchrun, the launcher hosts the store
# (TORCHELASTIC_USE_AGENT_STORE) on a port it already holds: a port chosen here, freed and bound again by
# rank 0 could be taken by another job started at the same moment, whose store rank 1 would then meet.
def worker_env(env: Dict[str, str], rank: int, nproc: int, port: int, run_id: str) -> Dict[str, str]:
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": str(True)}


STOP_GRACE_S = 15.0  # after a worker fails, the others' time to exit on SIGTERM before SIGKILL (torchrun: 30)


class Workers:
    """``torchrun --standalone --nproc_per_node=N -m dist_trainer *argv`` where the agent is not what is tested:
    N workers forked from the preloaded server with the environment torchrun would give them, their stdout
    and stderr appended to one file (as torchrun's, which its workers inherit). nproc=0 is one plain
    ``python -m dist_trainer`` process, its return code its exit code.

    Like the agent, the first worker to fail stops the others (SIGTERM, then SIGKILL after STOP_GRACE_S), and
    the launch's return code is 0 when every worker exited 0, else 1. What only the agent does (restarts,
    its failure summary, forwarding signals to the workers) is tested through real torchrun.
    """

    def __init__(self, argv: List[str], nproc: int, cwd: Path, env: Dict[str, str], out_path: Path):
        import uuid

        import torch.distributed as dist

        run_id = uuid.uuid4().hex
        self.single = nproc == 0  # ``python -m dist_trainer``: one process, no launcher's variables
        # The agent's store: bound to a free port by the kernel and held until the workers are reaped.
        self._store = None if self.single else dist.TCPStore("127.0.0.1", 0, is_master=True,
                                                             wait_for_workers=False)
        port = 0 if self.single else self._store.port
        extra = [str(cwd), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
        self.processes = []
        for rank in range(max(nproc, 1)):
            process_env = env if self.single else worker_env(env, rank, nproc, port, run_id)
            process = context().Process(target=_cli_main, daemon=False, args=(
                list(argv), process_env, str(cwd), str(out_path), None, extra))
            process.start()
            self.processes.append(process)
        self.returncode: Optional[int] = None
        self._stopping_since: Optional[float] = None

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    def workers(self) -> Dict[int, int]:
        """{rank: pid} of the workers still running."""
        return {rank: p.pid for rank, p in enumerate(self.processes) if p.is_alive()}

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        codes = [p.exitcode for p in self.processes]
        if any(code not in (None, 0) for code in codes) and self._stopping_since is None:
            self._stopping_since = time.monotonic()
            for p in self.processes:
                p.terminate()  # SIGTERM, and nothing where the worker has exited since exitcode was read
        if self._stopping_since is not None and time.monotonic() - self._stopping_since > STOP_GRACE_S:
            self.kill()
        if all(code is not None for code in (p.exitcode for p in self.processes)):
            if self.single:
                self.returncode = self.processes[0].exitcode
            else:
                self.returncode = 0 if all(p.exitcode == 0 for p in self.processes) else 1
            self._store = None
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("dist_trainer workers", timeout)
            multiprocessing.connection.wait([p.sentinel for p in self.processes if p.is_alive()], timeout=0.2)
        return self.returncode

    def kill(self) -> None:
        kill_all(self.processes)
