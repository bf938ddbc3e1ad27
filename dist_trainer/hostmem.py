"""Host memory: glibc's malloc made steady, and bounded where the model is sharded, for CPU training steps.

PyTorch's CPU allocator has no cache: every activation, gathered parameter and gradient is a fresh
``malloc``. glibc's defaults serve blocks above its mmap threshold with a new ``mmap`` and raise that
threshold (up to 32 MiB) as such blocks are freed, so which blocks page-fault each step depends on the
order of earlier allocations. ``trainer.tune_malloc`` fixes the thresholds, one of two ways:

* ``reuse``: every block up to 1 GiB from the heap, kept when freed: no step page-faults (for the default
  job that was ~2,500 faults per rank per step). But the heap fragments where large blocks come and go
  between smaller ones that outlive them: under fsdp on 2 ranks a 216 MiB qwen2 trained with SGD held
  1,235 MiB of heap after three steps with 379-403 MiB in use (mallinfo2), each rank 1.6-1.9 GiB resident,
  4-6x the model's share and more than ddp holding the whole model. Neither one arena
  (MALLOC_ARENA_MAX=1) nor glibc's own settings avoided it.
* ``bounded``: blocks from 64 KiB up (a unit's gathered parameters, its reduce-scatter buffer, activations
  of a few rows) get their own mapping and go back to the kernel when freed, so none can be stranded in the
  heap; smaller ones are reused. The same run peaks at 0.7-0.8 GiB per rank. The price is those blocks' page
  faults, the same every step: on a 2 vCPU VM that run's step took 2.0 s against 1.06 s (1.4 s with
  transparent huge pages: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` plus the thresholds as MALLOC_*
  variables). Measured in docs/benchmarks.md (bench/hostmem.py, bench/run_memory.py). The threshold was 1 MiB
  first: blocks between 64 KiB and 1 MiB (a 768-wide model's activations of 32 tokens, its key and value
  projections gathered) still left holes that grow with the model's width: LoRA on a 216 MiB qwen2 held 22-26
  MiB of free heap between steps against 10-13 MiB for one half as wide, 0.07x of what the larger model adds
  to a rank; the same run's step is 8 % slower at 64 KiB (1.29 s against 1.19). glibc's own threshold starts at
  128 KiB.

``true`` (the default) is bounded where the model is cut across ranks (fsdp, hsdp, tp, pp, ep: what sharding is
for is memory) and reuse otherwise (ddp: its steps' blocks reuse well, 1.1 GiB either way in that run).
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
# mode: (mmap threshold, trim threshold). reuse: blocks up to 1 GiB from the heap and kept there when freed.
# bounded: blocks from 64 KiB up in their own mappings, returned when freed; the heap's free top kept to 64 MiB.
THRESHOLDS = {"reuse": (1 << 30, 1 << 30), "bounded": (64 << 10, 64 << 20)}

_USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def user_choice() -> str | None:
    """The environment variable by which the user already chose an allocator setting, if any."""
    return next((name for name in _USER_CHOICES if os.environ.get(name)), None)


def describe(mode: str) -> str:
    return {"reuse": "freed blocks kept for reuse (trainer.tune_malloc=bounded returns blocks from 64 KiB up; "
                     "false keeps the system's settings)",
            "bounded": "blocks under 64 KiB reused, larger ones returned when freed, so the steps' heap cannot "
                       "fragment (trainer.tune_malloc=reuse keeps every block: no page faults, memory grows; "
                       "false keeps the system's settings)"}[mode]


def mode_for(setting: bool | str, mesh) -> str | None:
    """``trainer.tune_malloc`` made a mode: bounded or reuse (``true``: bounded where a rank holds a part of the model); None
    where the process keeps the system's settings (``false``, or a choice the user made in the environment)."""
    if not setting or user_choice() is not None:
        return None
    return setting if isinstance(setting, str) else "bounded" if mesh.holds_part else "reuse"


def keep_freed_memory(mode: str) -> bool:
    """Fix glibc's mmap and trim thresholds for this process as ``mode`` says (THRESHOLDS); True if set."""
    if user_choice() is not None or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the running process: its malloc is the one to tune
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    # The mmap threshold first: once it is fixed, glibc stops adjusting it.
    mmap_threshold, trim_threshold = THRESHOLDS[mode]
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))


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


def resident_mb() -> float | None:
    """The resident memory this process holds now (MiB), or None where the kernel does not say."""
    rss = _status_bytes("VmRSS")
    return None if rss is None else rss / 2**20


# What a CPU training step's libraries add to a process beyond the model's tensors, its data and what it held
# before the model was built: the model library's import, libtorch's kernels paged in by the first step,
# autograd's and gloo's threads and buffers, the heap's kept top, and under ``reuse`` the holes its kept blocks
# leave. Measured with torch 2.13 and transformers on 2 ranks, on the rank that holds the most, for qwen2 models
# of 48 and 216 MiB (bench/run_memory.py, tests/test_host_memory.py): reuse (ddp) 121-144 MiB; bounded (fsdp,
# hsdp, tp, LoRA under fsdp) 78-108 MiB. It does not grow with the model.
STEP_RUNTIME_MB = {"reuse": 140.0, "bounded": 100.0}


def expected_run_peak_mb(baseline_mb: float, mode: str | None, built_whole: bool, load_mb: float,
                         step_peak_mb: float, activation_mb: float, state_mb: float, export_mb: float) -> float:
    """A rank's peak resident memory over a CPU run (``run_host_peak_mb``), from plan mode's numbers.

    ``baseline_mb``: what the process held with its data ready, before the model was built. On top of it the
    step's runtime (STEP_RUNTIME_MB, by ``mode``) and the largest of the run's phases: the load, a step at its peak (state,
    gathered units and unsharded gradients, one micro-batch's activations), the export beside the state. Where
    freed blocks stay in the heap (``reuse``) and the model was built whole (ddp), the load's second copy (the
    pages transformers' loader maps, or DDP's bucket copy; half of ``load_mb``) is not given back, and the step
    comes on top of it.
    """
    kept = load_mb / 2 if mode == "reuse" and built_whole else 0.0
    runtime = STEP_RUNTIME_MB["bounded" if mode == "bounded" else "reuse"]  # the system's own settings: as reuse
    return baseline_mb + runtime + max(load_mb, kept + step_peak_mb + activation_mb, state_mb + export_mb)


_EARLIER_PEAK = 0  # bytes: the most resident memory reached before a PhasePeak reset the kernel's peak


def run_peak_mb() -> float | None:
    """The most resident memory this process has held so far (MiB), across the resets PhasePeak makes; None
    where the kernel does not say."""
    peak = _status_bytes("VmHWM")
    return None if peak is None else max(peak, _EARLIER_PEAK) / 2**20


class PhasePeak:
    """The most resident memory a phase (loading the model, exporting it) added above what the process held
    before it: the kernel's peak (VmHWM) reset at the start (/proc/self/clear_refs, Linux 4.0 and later)
    minus the resident memory then. ``mb`` is None where the kernel does not offer both.

    ``with PhasePeak() as peak: ...`` then ``peak.mb``.
    """

    def __init__(self) -> None:
        self.mb: float | None = None
        self._before: int | None = None

    @property
    def before_mb(self) -> float | None:
        """The resident memory when the phase began (MiB)."""
        return None if self._before is None else self._before / 2**20

    def __enter__(self) -> "PhasePeak":
        global _EARLIER_PEAK
        _EARLIER_PEAK = max(_EARLIER_PEAK, _status_bytes("VmHWM") or 0)  # the run's peak survives the reset
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
