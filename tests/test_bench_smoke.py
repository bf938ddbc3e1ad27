"""The GPU benchmark runs as one command: its --smoke mode on the CPU checks the script itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow  # 10-12 s: every row of bench/gpu.py on this CPU
def test_gpu_benchmark_smoke_runs_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--smoke", "--compile", "off",
                           "--fp8", "all", "--optim", "all", "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    rows = {(r["precision"], r["strategy"], r["ac"]) for r in results}
    # the precision grid under ddp, then fsdp and activation checkpointing
    assert {("bf16-mixed", "ddp", False), ("bf16-master", "ddp", False), ("fp16-master", "ddp", False),
            ("bf16-master", "fsdp", False), ("bf16-master", "ddp", True),
            ("fp8-rowwise", "ddp", False), ("fp8-tensorwise", "ddp", False)} == rows  # float8 (emulated here)
    # Muon (gather) against AdamW under ddp and fsdp
    assert sorted((r["strategy"], r["optim"]) for r in results if r["optim"] == "muon") == [("ddp", "muon"),
                                                                                          ("fsdp", "muon")]
    assert all(r["fp8_linears"] > 0 for r in results if r["precision"].startswith("fp8-"))
    assert sorted(r["prefetch"] for r in results if r["strategy"] == "fsdp" and r["optim"] == "adamw") == [0, 1]
    # the mixture-of-experts rows: the global aux term (its counting pass) and the sequence one
    assert sorted(r["moe_scope"] for r in results if r["moe_scope"]) == ["global", "sequence"]
    for r in results:
        assert r["tokens_per_s"] > 0 and r["state_mb"] > 0 and not r["skipped"], r
    fsdp = next(r for r in results if (r["precision"], r["strategy"], r["ac"], r["prefetch"], r["optim"]) ==
                ("bf16-master", "fsdp", False, 1, "adamw"))
    ddp = next(r for r in results if (r["precision"], r["strategy"], r["ac"], r["moe_scope"], r["optim"]) ==
               ("bf16-master", "ddp", False, None, "adamw"))
    # one rank: fsdp holds FP32 parameters (the masters) and no half copy; ddp holds both
    assert fsdp["state_mb"] < ddp["state_mb"]
