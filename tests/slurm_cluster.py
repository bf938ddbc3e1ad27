"""A real one-node Slurm cluster on this machine, for tests: munged, slurmctld and slurmd.

Everything lives in one directory (configuration, key, state, spool, logs,
sockets); nothing of the machine's own Slurm or munge setup is read or
changed. ``SlurmCluster.env()`` is the environment for sbatch, squeue,
scontrol and scancel to reach it (SLURM_CONF).

Debian's packages (slurm-wlm, munge; Slurm 22.05 on bookworm) are installed
when missing and the test runs as root with apt-get; otherwise ``available()``
says why not, and the test is skipped with that reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def available() -> Optional[str]:
    """None if Slurm and munge can run here (installing them if need be), else why not."""
    missing = [name for name in DAEMONS + CLIENTS + ("mungekey",) if _which(name) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"],
                       env=env, capture_output=True, timeout=900)
        missing = [name for name in DAEMONS + CLIENTS + ("mungekey",) if _which(name) is None]
    if missing:
        return f"Slurm is not installed and could not be ({', '.join(missing)} missing; needs root and apt-get)"
    if os.geteuid() != 0:
        return "a Slurm cluster of one node runs its daemons as root here"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host, in ``root``."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus = root, cpus
        self.node = socket.gethostname().split(".")[0]
        self.procs: List[subprocess.Popen] = []
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"

    def env(self) -> Dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8)
        r = self.root
        self.conf.write_text("\n".join([
            "ClusterName=dtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "JobRequeue=1",
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=30",
            "GresTypes=gpu",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={mem_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def start(self, timeout: float = 60) -> None:
        self._write_config()
        key = self.root / "munge" / "munge.key"
        subprocess.run([_which("mungekey"), "--create", "--keyfile", str(key), "--force"], check=True,
                       capture_output=True)
        os.chmod(key, 0o600)
        munge_dir = self.root / "munge"
        self._spawn([_which("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                     f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
                     f"--seed-file={munge_dir / 'munged.seed'}"], "munged")
        self._wait(lambda: self.munge_socket.exists(), timeout, "munged's socket")
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(lambda: self._run("scontrol", "ping").returncode == 0 and
                   "UP" in self._run("scontrol", "ping").stdout, timeout, "slurmctld")
        self._spawn([_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node], "slurmd")
        self._wait(lambda: "idle" in self._run("sinfo", "-h", "-o", "%T").stdout, timeout, "an idle node")

    def _spawn(self, cmd: List[str], name: str) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                           start_new_session=True))

    def _run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([_which(cmd[0]), *cmd[1:]], env=self.env(), capture_output=True, text=True, timeout=60)

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self._run("scontrol", *args)

    def job_state(self, job: str) -> str:
        out = self._run("scontrol", "show", "job", job).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def slurmd_log(self) -> str:
        path = self.root / "log" / "slurmd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logged_at(self, text: str) -> float:
        """When slurmd logged a line holding ``text`` (seconds since the epoch); +inf if it has not."""
        from datetime import datetime

        for line in self.slurmd_log().splitlines():
            if text in line and line.startswith("["):
                return datetime.strptime(line[1:line.index("]")], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
        return float("inf")

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm: no {what} after {timeout} s (daemons exited: {[p.args[0] for p in dead]}); "
                                   f"logs in {self.root / 'log'}:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started (slurmd first)."""
        if self.procs:
            self._run("scancel", "--full", "--user=root") if _which("scancel") else None
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.procs.clear()
