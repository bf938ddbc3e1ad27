"""A golden loss curve: any change to the step's numerics shows up here.

Regenerate deliberately (and say why in the commit) with
DT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import run_module

GOLDEN = Path(__file__).parent / "assets" / "golden_loss.json"
ARGS = ["trainer.max_steps=12", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32",
        "batch.micro_batch_size=8", "batch.global_batch_size=32", "optim.warmup_steps=4", "trainer.eval_every=0",
        "trainer.eval_batches=2", "precision=fp16-mixed", "precision.loss_scale.init_scale=65536"]


def test_tiny_run_reproduces_the_golden_losses(tmp_path):
    proc = run_module([*ARGS, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = {"loss": [r["loss"] for r in records], "lr": [r["lr"] for r in records],
           "loss_scale": [r["loss_scale"] for r in records], "skipped": [r["skipped"] for r in records]}
    if os.environ.get("DT_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"args": ARGS, **got}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert golden["args"] == ARGS, "the golden file was made with other arguments: regenerate it"
    # Different CPUs round fp16 kernels differently in the last bits; 1e-4 relative
    # catches any change of algorithm (a wrong normalisation moves the loss by >1e-2).
    assert got["loss"] == pytest.approx(golden["loss"], rel=1e-4)
    assert got["lr"] == golden["lr"] and got["loss_scale"] == golden["loss_scale"]
    assert got["skipped"] == golden["skipped"]
