"""Host memory: keep glibc's malloc from page-faulting every CPU training step.

PyTorch's CPU allocator has no cache: every activation and gradient is a fresh
``malloc``. glibc serves blocks above its mmap threshold (128 KiB at first,
raised dynamically as large blocks are freed) with a new ``mmap`` and unmaps
them on ``free``, so the next step touches brand-new pages and takes a minor
page fault per 4 KiB. For the default job that was ~2,500 faults per rank per
step, and how many depends on the order of earlier allocations, so it differs
from one launch to the next. Fixing both thresholds high keeps those blocks in
the heap, where the next step reuses them (0 faults per step measured).

The cost is resident memory: freed blocks stay in the process instead of going
back to the OS, so RSS stays at its peak. A training process owns its machine
and reaches that peak every step anyway.

Users who already chose (``MALLOC_*`` variables, ``GLIBC_TUNABLES``, or another
allocator preloaded such as jemalloc or tcmalloc) are left alone, and so are
C libraries other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and stay there when freed

_USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def user_choice() -> str | None:
    """The environment variable by which the user already chose an allocator setting, if any."""
    return next((name for name in _USER_CHOICES if os.environ.get(name)), None)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True if they were set."""
    if user_choice() is not None or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the running process: its malloc is the one to tune
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # The mmap threshold first: once it is fixed, glibc stops adjusting it.
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))


def available_bytes() -> int | None:
    """Host memory this process's node can still give, or None where it cannot be read.

    The kernel's MemAvailable, and under a cgroup v2 limit (a container, a
    Kubernetes pod, a Slurm job) what is left below that limit, whichever is less.
    """
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _status_bytes(field: str) -> int | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes, or None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PhasePeak:
    """The most resident memory a phase (loading the model, exporting it) added above what the process held
    before it: the kernel's peak (VmHWM) reset at the start (/proc/self/clear_refs, Linux 4.0 and later)
    minus the resident memory then. ``mb`` is None where the kernel does not offer both.

    ``with PhasePeak() as peak: ...`` then ``peak.mb``.
    """

    def __init__(self) -> None:
        self.mb: float | None = None
        self._before: int | None = None

    def __enter__(self) -> "PhasePeak":
        self._before = _status_bytes("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # 5: reset the peak resident set size to the current one
        except OSError:
            self._before = None
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _status_bytes("VmHWM")
        if self._before is not None and peak is not None:
            self.mb = max(0, peak - self._before) / 2**20
