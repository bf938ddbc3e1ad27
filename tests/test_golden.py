"""Golden runs: any change to the step's numerics shows up here.

Two tiny fp16 runs, pinned step by step (loss, grad_norm, lr, loss scale, skips):

* ``adamw``: the default optimizer with warmup and clipping. Adam and clipping
  are blind to a constant factor on the gradient, so the reported grad_norm
  (of the unscaled, normalised gradient) is pinned too: a gradient left scaled
  by 2**16 shows there at once.
* ``sgd-scaler``: SGD without clipping (the update is proportional to the
  gradient, so any wrong factor moves the loss), sequences of 4-32 tokens (item
  counts differ between micro-batches) and a loss scale that starts too high
  and grows every 3 steps: it overflows, skips, backs off and grows again.

fp16 kernels on the CPU round differently with the instruction set torch
picks (``torch.backends.cpu.get_cpu_capability()``: AVX512 or AVX2, say), by
more than the tolerance after a few SGD steps. So the numbers are kept per
capability, in ``golden_loss.<capability>.json``; a machine whose capability
has none fails, saying how to make them. Regenerate deliberately (and say why
in the commit) with DT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py,
which writes this machine's file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import run_module

ASSETS = Path(__file__).parent / "assets"
CAPABILITY = torch.backends.cpu.get_cpu_capability()
GOLDEN = ASSETS / f"golden_loss.{CAPABILITY}.json"
TINY = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "batch.micro_batch_size=8",
        "batch.global_batch_size=32", "trainer.eval_every=0", "trainer.eval_batches=2", "precision=fp16-mixed"]
RUNS = {
    "adamw": ["trainer.max_steps=12", *TINY, "optim.warmup_steps=4", "precision.loss_scale.init_scale=65536"],
    "sgd-scaler": ["trainer.max_steps=16", *TINY, "+data.min_len=4", "optim=sgd", "optim.lr=0.5",
                   "optim.grad_clip=null", "optim.warmup_steps=0", "precision.loss_scale.init_scale=262144",
                   "precision.loss_scale.growth_interval=3"],
}


def _pinned(records: list) -> dict:
    return {key: [r[key] for r in records] for key in ("loss", "grad_norm", "lr", "loss_scale", "skipped")}


@pytest.mark.parametrize("name", list(RUNS))
def test_tiny_run_reproduces_the_golden_numbers(tmp_path, name):
    args = RUNS[name]
    proc = run_module([*args, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _pinned([json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()])
    if os.environ.get("DT_UPDATE_GOLDEN") == "1":
        stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        stored[name] = {"args": args, **got}
        GOLDEN.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    if not GOLDEN.exists():
        pytest.fail(f"no golden numbers for this CPU's capability ({CAPABILITY}; fp16 kernels round differently "
                    f"per instruction set): make them with DT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py "
                    f"on a commit whose numbers are known good, and commit {GOLDEN.name}")
    golden = json.loads(GOLDEN.read_text())[name]
    assert golden["args"] == args, "the golden file was made with other arguments: regenerate it"
    # Different CPUs round fp16 kernels differently in the last bits; 1e-4 relative
    # catches any change of algorithm.
    assert got["loss"] == pytest.approx(golden["loss"], rel=1e-4)
    assert [n is None for n in got["grad_norm"]] == [n is None for n in golden["grad_norm"]]  # skipped steps
    assert [n for n in got["grad_norm"] if n is not None] == pytest.approx(
        [n for n in golden["grad_norm"] if n is not None], rel=1e-4)
    assert got["lr"] == golden["lr"] and got["loss_scale"] == golden["loss_scale"]
    assert got["skipped"] == golden["skipped"]
    if name == "sgd-scaler":  # guard: the run really exercises the scaler both ways
        scales = golden["loss_scale"]
        assert any(golden["skipped"]) and any(b < a for a, b in zip(scales, scales[1:]))
        assert any(b > a for a, b in zip(scales, scales[1:]))
