"""Host malloc tuning (dist_trainer/hostmem.py): page faults counted in fresh processes.

Each check runs in its own interpreter: mallopt changes the whole process, and
the pytest process must keep its own allocator state.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from helpers import REPO

# Allocates, fills and frees a 40 MiB tensor (above glibc's largest dynamic
# mmap threshold, 32 MiB, so it is always a fresh mmap by default) 40 times,
# and counts the minor page faults of the last 20 rounds. The first ones are a
# warm-up: tuned, the heap grows for a few rounds (small allocations take parts
# of the freed block) before the 40 MiB block is reused, as in a training loop's
# first steps.
PROBE = """
import json, resource, sys, torch
from dist_trainer import hostmem

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rounds():
    for _ in range(20):
        torch.empty(10 << 20).fill_(1.0)  # warm-up, not counted
    start = faults()
    for _ in range(20):
        torch.empty(10 << 20).fill_(1.0)  # 40 MiB of float32, freed at once
    return faults() - start

before = rounds()
tuned = hostmem.keep_freed_memory()
print(json.dumps({"before": before, "tuned": tuned, "after": rounds(), "choice": hostmem.user_choice()}))
"""

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds exist in glibc only")


def probe(**env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_tuning_removes_the_page_faults_of_large_blocks():
    result = probe()
    assert result["tuned"] is True and result["choice"] is None
    # 40 MiB = 10,240 pages: every round faults them all in by default ...
    assert result["before"] >= 20 * 10_000, result
    # ... and, tuned, the freed block is reused: hardly a fault in 20 rounds.
    assert result["after"] <= 500, result


@glibc_only
@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_a_users_own_allocator_setting_is_left_alone(variable):
    value = "glibc.malloc.check=0" if variable == "GLIBC_TUNABLES" else "33554432"
    result = probe(**{variable: value})
    assert result["tuned"] is False and result["choice"] == variable
    if variable == "GLIBC_TUNABLES":  # malloc left at glibc's defaults: the faults stay
        assert result["after"] >= 20 * 10_000, result
