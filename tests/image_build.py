"""docker/Dockerfile built and run for real without a Docker daemon: buildah, as root, for tests.

buildah runs with chroot isolation (no OCI runtime, no user namespaces: root
needs none) and vfs storage (works on any filesystem, overlayfs included), in
a store of its own under CACHE; nothing of the machine's own container storage
is read or changed. No image registry is needed:

* the base image is Debian bookworm made by debootstrap from the machine's
  Debian mirror and committed as BASE_IMAGE; it stays in the store between
  runs (1 to 2 minutes to make, 200 MB);
* the build reaches packages the way this machine's pip does: its settings
  (``pip config list``: files and PIP_* variables) are written to one pip.conf
  mounted at /etc/pip.conf, and the local paths they name (wheel directories,
  file:// indexes, the CA bundle, constraint files) are mounted read-only at
  the same paths, so e.g. the default ``torch==2.13.0`` takes a local CPU wheel.

buildah and debootstrap are installed with apt-get when missing (as root);
otherwise ``available()`` says why the image cannot be built here, and the
test is skipped with that reason.
"""

from __future__ import annotations

import ast
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import urllib.parse
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("DIST_TRAINER_IMAGE_CACHE", "/var/cache/dist_trainer-image"))
SUITE = "bookworm"  # the Dockerfile's default base is python:3.11-slim-bookworm: the same Debian and Python
BASE_PACKAGES = ("python3", "python3-pip", "python3-venv", "ca-certificates")
BASE_IMAGE = f"localhost/dist-trainer-base:{SUITE}"
# Stored as a label on the base image: a cached base made another way is made again.
BASE_RECIPE = f"debootstrap --variant=minbase --include={','.join(BASE_PACKAGES)} {SUITE}"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# The pip settings that decide where packages come from and how they are fetched.
PIP_KEYS = ("index-url", "extra-index-url", "find-links", "no-index", "trusted-host", "cert", "client-cert",
            "constraint", "proxy", "timeout", "default-timeout", "retries")
PIP_PATH_KEYS = ("cert", "client-cert", "constraint", "find-links", "index-url", "extra-index-url")


class ImageError(RuntimeError):
    """A step of making the base, building or running failed; the message ends with its log's tail."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)


def available() -> Optional[str]:
    """None if the image can be built and run here (installing buildah and debootstrap if need be), else why not."""
    if os.geteuid() != 0:
        return ("buildah builds the image here as root (chroot isolation, vfs storage); as another user it needs "
                "user namespaces and subordinate uid/gid ranges, which this test does not set up")
    missing = [name for name in ("buildah", "debootstrap") if _which(name) is None]
    if missing and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "buildah", "debootstrap"],
                       env=env, capture_output=True, timeout=900)
        missing = [name for name in ("buildah", "debootstrap") if _which(name) is None]
    if missing:
        return f"{' and '.join(missing)} not installed and could not be (needs root and apt-get)"
    # chroot isolation still gives each RUN its own mount and UTS namespaces.
    probe = subprocess.run(["unshare", "--mount", "--uts", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create mount/UTS namespaces, which buildah's chroot isolation needs: {probe.stderr.strip()}"
    return None


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class Buildah:
    """buildah on its own store under CACHE (vfs), logging each long step to a file."""

    def __init__(self, cache: Path = CACHE):
        self.cache = cache
        runroot = Path("/run/dist_trainer-image") if Path("/run").is_dir() else cache / "run"
        self.store = ["--root", str(cache / "storage"), "--runroot", str(runroot), "--storage-driver", "vfs"]

    def cmd(self, *args: str) -> List[str]:
        return [_which("buildah"), *self.store, *args]

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ImageError(f"buildah {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc

    def logged(self, args: List[str], log: Path, timeout: float, what: str) -> None:
        with open(log, "a") as out:
            out.write(f"+ buildah {' '.join(args)}\n")
            out.flush()
            try:
                proc = subprocess.run(self.cmd(*args), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise ImageError(f"{what}: still running after {timeout} s; {log}:\n{_tail(log)}") from None
        if proc.returncode != 0:
            raise ImageError(f"{what} failed ({proc.returncode}); {log}:\n{_tail(log)}")

    def exists(self, image: str) -> bool:
        return self("inspect", "--type", "image", image, check=False).returncode == 0

    def config(self, image: str) -> dict:
        """The image's OCI config: Entrypoint, Cmd, User, WorkingDir, Env, Labels."""
        return json.loads(self("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]

    def remove_image(self, image: str) -> None:
        self("rmi", "--force", image, check=False, timeout=600)

    def remove_stale(self, prefix: str) -> None:
        """Containers and images named ``<prefix>-<pid>-...`` whose test process is gone (killed before it
        could clean up: with vfs each is a full copy, over a gigabyte)."""
        def stale(name: str) -> bool:
            m = re.search(rf"{re.escape(prefix)}[-:](\d+)-", name)
            return bool(m) and not os.path.exists(f"/proc/{m.group(1)}")

        for name in self("containers", "--format", "{{.ContainerName}}").stdout.split():
            if stale(name):
                self("rm", name, check=False, timeout=600)
        for name in self("images", "--format", "{{.Name}}:{{.Tag}}").stdout.split():
            if stale(name):
                self.remove_image(name)


# --------------------------------------------------------------------------- the base image

def debian_mirror() -> str:
    """The machine's apt source for SUITE (deb822 .sources or one-line lists), else deb.debian.org."""
    sources = sorted(Path("/etc/apt").glob("sources.list.d/*.sources"))
    for path in sources:
        for stanza in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, flags=re.M))
            if SUITE in fields.get("Suites", "").split() and "deb" in fields.get("Types", "").split():
                return fields.get("URIs", DEFAULT_MIRROR).split()[0]
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt").glob("sources.list.d/*.list"))]:
        if path.is_file():
            for m in re.finditer(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{SUITE}\s", path.read_text(errors="replace"),
                                 flags=re.M):
                return m.group(1)
    return DEFAULT_MIRROR


def _unmount_under(root: Path) -> None:
    """Whatever a failed debootstrap left mounted inside the tree (proc, sys, a bind-mounted /dev)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for point in sorted((m for m in mounts if m == str(root) or m.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=60)


def ensure_base(buildah: Buildah, log: Path) -> str:
    """BASE_IMAGE, made with debootstrap unless the store already has it (one maker at a time)."""
    buildah.cache.mkdir(parents=True, exist_ok=True)
    with open(buildah.cache / "base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test run may be making it right now
        if buildah.exists(BASE_IMAGE) and buildah.config(BASE_IMAGE).get("Labels", {}).get(
                "dist_trainer.base") == BASE_RECIPE:
            return BASE_IMAGE
        buildah.remove_image(BASE_IMAGE)  # one made another way, or a half-made one
        rootfs = Path(tempfile.mkdtemp(dir=buildah.cache, prefix="rootfs-"))  # on disk: /tmp may be a small tmpfs
        try:
            _debootstrap(rootfs, log)
            _commit_rootfs(buildah, rootfs, log)
        finally:
            _unmount_under(rootfs)
            # --one-file-system: never follow into something still mounted there
            subprocess.run(["rm", "-rf", "--one-file-system", str(rootfs)], capture_output=True, timeout=300)
    return BASE_IMAGE


def _debootstrap(rootfs: Path, log: Path) -> None:
    cmd = [_which("debootstrap"), "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(rootfs),
           debian_mirror()]
    with open(log, "a") as out:
        out.write(f"+ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=1200)
        except subprocess.TimeoutExpired:
            raise ImageError(f"debootstrap still running after 1200 s; {log}:\n{_tail(log)}") from None
    if proc.returncode != 0:
        raise ImageError(f"debootstrap failed ({proc.returncode}); {log}:\n{_tail(log)}")
    # What a registry's Debian image leaves out as well: the downloaded packages, the package lists, and
    # this machine's hostname and resolver (buildah provides both to each container).
    for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*_*", "etc/hostname", "etc/resolv.conf"):
        for path in rootfs.glob(pattern):
            path.unlink()


def _commit_rootfs(buildah: Buildah, rootfs: Path, log: Path) -> None:
    """rootfs as an image of one layer: `buildah from scratch`, copy the tree in, commit."""
    container = buildah("from", "scratch").stdout.strip()
    try:
        mount = buildah("mount", container).stdout.strip()
        copy = subprocess.run(["cp", "-a", f"{rootfs}/.", mount], capture_output=True, text=True, timeout=600)
        buildah("umount", container)
        if copy.returncode != 0:
            raise ImageError(f"copying the Debian tree into the base image failed: {copy.stderr[-3000:]}")
        buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env", "LANG=C.UTF-8", "--cmd", "/bin/bash", "--label", f"dist_trainer.base={BASE_RECIPE}",
                container)
        buildah.logged(["commit", "--rm", container, BASE_IMAGE], log, 600, "committing the base image")
    finally:
        buildah("rm", container, check=False)  # already gone after a successful commit --rm


# --------------------------------------------------------------------------- this machine's pip, for the build

def pip_settings(python: str) -> Dict[str, str]:
    """What pip on this machine uses to find packages: config files and PIP_* variables, merged as pip does."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=120).stdout
    rank = {"global": 0, "install": 1, ":env:": 2}  # later wins: [install] over [global], PIP_* over both
    found = []
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.partition(".")
        if sep and section in rank and name in PIP_KEYS:
            found.append((rank[section], name, ast.literal_eval(value)))  # pip prints repr(value)
    settings = {name: value for _, name, value in sorted(found, key=lambda item: item[0])}
    if "cert" not in settings:  # pip (through requests) also honours these
        bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        if bundle and os.path.isfile(bundle):
            settings["cert"] = bundle
    return settings


def pip_mounts(settings: Dict[str, str], conf: Path) -> List[str]:
    """`-v` arguments: ``conf`` (written from settings) at /etc/pip.conf, and the local paths they name."""
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    paths: List[Path] = []
    for key in PIP_PATH_KEYS:
        for item in settings.get(key, "").split():
            if item.startswith("file:"):
                item = urllib.parse.unquote(urllib.parse.urlparse(item).path)
            elif "://" in item:
                continue
            path = Path(item)
            if not path.is_absolute() or not path.exists():
                continue
            if key.endswith("index-url") and path.name == "simple":
                path = path.parent  # a PEP 503 tree's pages link to files beside simple/ (../../files/...)
            paths.append(path)
    kept = [p for p in dict.fromkeys(paths) if not any(q != p and q in p.parents for q in paths)]
    return ["-v", f"{conf}:/etc/pip.conf:ro", *[arg for p in kept for arg in ("-v", f"{p}:{p}:ro")]]


# --------------------------------------------------------------------------- build

def build_image(buildah: Buildah, tag: str, base: str, mounts: List[str], log: Path, timeout: float = 1200) -> None:
    """docker/Dockerfile from the working tree, as `docker build -f docker/Dockerfile .` would."""
    buildah.logged([
        "build", "--isolation", "chroot",
        "--format", "docker",  # in the OCI format SHELL is ignored: RUN would run /bin/sh, without pipefail
        "--layers=false",  # one layer: with vfs every cached layer is a full copy of the tree
        "--force-rm",  # no build container left behind when a step fails
        "--pull=never", "--build-arg", f"BASE_IMAGE={base}",
        "-f", str(REPO / "docker" / "Dockerfile"),
        "--ignorefile", str(REPO / "docker" / "Dockerfile.dockerignore"),  # buildah reads only <context>/.dockerignore
        *mounts, "-t", tag, str(REPO)], log, timeout, "buildah build")


# --------------------------------------------------------------------------- containers

def tagged_pids(tag: str) -> List[int]:
    """Processes whose environment holds DT_IMAGE_TEST_TAG=tag: a container's processes (chroot isolation
    shares the machine's PID namespace) and everything they started, torchrun's workers included."""
    needle = f"DT_IMAGE_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def kill_tagged(tag: str) -> None:
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Container:
    """A working container of ``image``; ``start`` runs a command in it as the image's user, in its WORKDIR.

    ``--uts host``: a new UTS namespace gets a random hostname that nothing resolves (Docker and Kubernetes
    write it into the container's /etc/hosts; buildah does not), and torchrun's rendezvous, which looks up
    its own hostname, would time out after 300 s.
    """

    def __init__(self, buildah: Buildah, image: str, name: str):
        self.buildah, self.name = buildah, name
        self.tag = name  # in every process's environment (tagged_pids)
        buildah("from", "--pull=never", "--name", name, image, timeout=900)  # vfs: a full copy of the image
        self.procs: List[subprocess.Popen] = []

    def start(self, argv: List[str], env: Dict[str, str], volumes: Dict[Path, str], log: Path) -> subprocess.Popen:
        env = {**env, "DT_IMAGE_TEST_TAG": self.tag}
        cmd = self.buildah.cmd("run", "--isolation", "chroot", "--uts", "host",
                               *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
                               *[a for host, inside in volumes.items() for a in ("-v", f"{host}:{inside}")],
                               self.name, "--", *argv)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log
        self.procs.append(proc)
        return proc

    def first_process(self, name: str) -> Optional[int]:
        """The pid of the container's process called ``name`` (its PID 1 under Docker or Kubernetes)."""
        return next((pid for pid in sorted(tagged_pids(self.tag)) if comm(pid) == name), None)

    def close(self) -> None:
        """Kill whatever still runs in it (buildah run does not pass signals on), then remove it."""
        kill_tagged(self.tag)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        kill_tagged(self.tag)  # anything that started in between
        self.buildah("rm", self.name, check=False, timeout=600)
