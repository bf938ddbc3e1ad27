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

# Two patterns, each measured before and after dist_trainer tunes malloc (the tuning is per process, so the
# probe runs in its own interpreter):
# - "small": a 32 KiB tensor allocated, filled and freed 20 times after 20 rounds of warm-up; the minor page
#   faults of the counted rounds. Below the bounded mmap threshold (64 KiB) the freed block is reused from the heap.
# - "fragments": what a training step's lifetimes do to a heap that keeps every block. A large block (8 MiB and
#   growing by 64 KiB a round, as a unit's buffers differ) is filled, then a small block that outlives it is
#   allocated after it, then the large one is freed: its hole is pinned by the survivor and too small for the
#   next, larger block. 60 rounds; the growth of the resident set. Bounded, large blocks have their own mappings,
#   so their memory goes back to the kernel when freed; with every block in the heap (reuse)
#   the holes stay resident.
# - "mid": 20 rounds of a 4 MiB block after a 16 MiB one was freed; their faults. Bounded, each is mapped anew
#   (the cost of the bound: 1,024 faults a round); by glibc's own rules (or a user's 32 MiB threshold) they
#   come from the heap.
PROBE = """
import ctypes, json, resource, sys, torch
from dist_trainer import hostmem
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
def small():
    for _ in range(20):
        torch.empty(8 << 10).fill_(1.0)  # warm-up, not counted
    start = faults()
    for _ in range(20):
        torch.empty(8 << 10).fill_(1.0)  # 32 KiB of float32, freed at once
    return faults() - start
def mid():
    torch.empty(4 << 20).fill_(1.0)  # a 16 MiB block freed: glibc's own threshold moves up past 4 MiB
    start = faults()
    for _ in range(20):
        torch.empty(1 << 20).fill_(1.0)  # 4 MiB
    return faults() - start
def fragments():
    start, survivors = rss(), []
    for i in range(60):
        big = torch.empty((8 << 20) // 4 + i * (16 << 10)).fill_(1.0)
        survivors.append(torch.ones(64))
        del big
    return rss() - start
mode = sys.argv[1]
if mode == "reuse":  # every block in the heap, kept when freed
    tuned = hostmem.keep_freed_memory("reuse")
    print(json.dumps({"small": small(), "mid": mid(), "fragments_mb": fragments(), "tuned": tuned}))
else:
    before = small()
    tuned = hostmem.keep_freed_memory("bounded")
    print(json.dumps({"before": before, "tuned": tuned, "small": small(), "mid": mid(),
                      "fragments_mb": fragments(), "choice": hostmem.user_choice()}))
"""
glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds exist in glibc only")


def probe(mode: str = "dist_trainer", **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
@pytest.mark.slow  # 8 s of faulting pages in: the slow stage
def test_bounded_reuses_small_blocks_and_returns_large_ones_reuse_keeps_all():
    tuned, heap = probe(), probe("reuse")
    assert tuned["tuned"] is True and tuned["choice"] is None and heap["tuned"] is True
    # Below the threshold a freed block is reused: hardly a fault in 20 rounds (8 pages each, were each mapped
    # anew).
    assert tuned["small"] <= 100, tuned
    # Large blocks go back to the kernel when freed, so the holes the survivors pin cost nothing resident:
    # 60 rounds of 8 MiB blocks leave at most a few MiB (the survivors and the heap's own pages) ...
    assert tuned["fragments_mb"] < 32, tuned
    # ... where a heap that keeps every block holds the holes: about 8 MiB a round.
    assert heap["fragments_mb"] > 200, heap
    # The price, the same every round: each large block's pages are faulted in anew, where reuse faults none.
    assert tuned["mid"] >= 20 * 1000, tuned
    assert heap["mid"] <= 100 and heap["small"] <= 100, heap


@glibc_only
@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_a_users_own_allocator_setting_is_left_alone(variable):
    value = "glibc.malloc.check=0" if variable == "GLIBC_TUNABLES" else "33554432"
    result = probe(**{variable: value})
    assert result["tuned"] is False and result["choice"] == variable
    if variable == "GLIBC_TUNABLES":  # malloc left at glibc's defaults: after a 16 MiB block, 4 MiB blocks come
        # mostly from the heap (its moving threshold; 900-1,800 faults measured), where the tuning maps each anew
        # (20,500) ...
        assert result["mid"] < 5_000, result
        # ... and its heap keeps the holes as a heap that keeps every block does (560-590 MiB measured).
        assert result["fragments_mb"] > 200, result


def test_tune_malloc_true_bounds_the_meshes_that_cut_the_model_and_a_bad_value_names_the_key():
    import dataclasses

    from dist_trainer import hostmem
    from dist_trainer.config import ConfigError, MeshShape
    from dist_trainer.validation import validate
    from test_accumulation import gpt_config

    for mesh in (MeshShape("ddp", replicate=2, shard=1), MeshShape("ddp", 2, 1, cp=2)):  # every rank holds it whole
        assert not mesh.holds_part, mesh
    for mesh in (MeshShape("fsdp", 1, 2), MeshShape("fsdp", 2, 2), MeshShape("ddp", 1, 1, tp=2),
                 MeshShape("ddp", 1, 1, pp=2), MeshShape("ddp", 2, 1, ep=2)):
        assert mesh.holds_part, mesh
    for mode in (True, False, "reuse", "bounded"):
        cfg = gpt_config(4)
        cfg.trainer = dataclasses.replace(cfg.trainer, tune_malloc=mode)
        validate(cfg, 2, 2)
    cfg.trainer = dataclasses.replace(cfg.trainer, tune_malloc="fast")
    with pytest.raises(ConfigError, match=r"trainer\.tune_malloc.*choose true, false, reuse or bounded"):
        validate(cfg, 2, 2)
