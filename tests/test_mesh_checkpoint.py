"""A sharded checkpoint resumes on any mesh: hsdp, fsdp, ddp, any world size, with real torchrun runs.

* an hsdp 2x2 run (4 ranks, dist.fsdp.shard_size=2) stopped at step K and resumed
  on the same mesh is bit-identical to the uninterrupted run (parameters, every metric);
* the same checkpoint resumed on fsdp over 4 ranks (one shard group), fsdp on 2
  ranks, ddp on 2 ranks and one process continues the run with the global batch
  kept (accumulation re-derived), within 1e-5 of the uninterrupted run (fp32);
* and back: a checkpoint written by fsdp on 2 ranks resumes on hsdp 2x2, within 1e-5;
* the hsdp checkpoint holds each replicated shard once, and every step a run takes
  equals the collectives plan.json predicts for its mesh, after a resume too.

The runs are JOB2 of test_checkpoint (a 1-layer GPT, warmup then a constant lr, so
a split run follows the uninterrupted run's lr) without biases, as in
test_fsdp_checkpoint, with micro-batches of 4: global 32 = 4 ranks x 4 x accum 2
(2 ranks: accum 4, one process: accum 8). Every run starts in the module fixture:
the three first runs together, then every resume together (run_all).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_trainer.checkpoint import verify
from helpers import assert_all_close_scaled, assert_close_scaled
from test_checkpoint import (JOB2, K, STEPS, assert_bit_identical, assert_same_metrics, ckpt, copy_run, final_params,
                             metrics, resumed_from, run_all)

# About 80 s on 2 cores (9 launches, 27 processes): slow. The fixture's two rounds of runs
# come before the first test, so that test gets more than the default 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BASE = [a for a in JOB2 if not a.startswith("batch.micro_batch_size=")] + ["batch.micro_batch_size=4",
                                                                           "+model.bias=false"]
DDP = BASE
FSDP = BASE + ["dist.strategy=fsdp"]
HSDP = FSDP + ["dist.fsdp.shard_size=2"]  # 4 ranks: 2 replicas x shard groups of 2

# Resumes of the hsdp half run: (name, args, nproc (0: python -m dist_trainer), the mesh it runs on,
# world size, accum steps).
TARGETS = [
    ("fsdp4", FSDP, 4, "fsdp: 1 shard group of 4 ranks", 4, 2),
    ("fsdp2", FSDP, 2, "fsdp: 1 shard group of 2 ranks", 2, 4),
    ("ddp2", DDP, 2, "ddp: 2 replicas", 2, 4),
    ("one", FSDP, 0, "fsdp: 1 shard group of 1 ranks", 1, 8),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted hsdp run and the K-step halves (hsdp 2x2, fsdp on 2 ranks), then every resume."""
    root = tmp_path_factory.mktemp("mesh_ckpt")
    first = run_all([
        (HSDP + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'ref'}"], 4),
        (HSDP + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'half'}"], 4),
        (FSDP + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'fsdp_half'}"], 2),
    ], root, timeout=240)
    for result in first:
        assert result.returncode == 0, result.output[-4000:]
    layout = SimpleNamespace(verified=verify(ckpt(root / "half", K)),  # before any resume adds checkpoints
                             hsdp=json.loads((ckpt(root / "half", K) / "manifest.json").read_text()),
                             fsdp=json.loads((ckpt(root / "fsdp_half", K) / "manifest.json").read_text()))
    dirs = {"hsdp": copy_run(root / "half", root / "to_hsdp"),
            **{name: copy_run(root / "half", root / f"to_{name}") for name, *_ in TARGETS},
            "back": copy_run(root / "fsdp_half", root / "fsdp_to_hsdp")}
    jobs = [(HSDP, 4, "hsdp"), *[(args, nproc, name) for name, args, nproc, *_ in TARGETS], (HSDP, 4, "back")]
    results = run_all([(args + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={dirs[name]}"], nproc)
                       for args, nproc, name in jobs], root, timeout=280)
    return SimpleNamespace(root=root, ref=root / "ref", layout=layout, dirs=dirs,
                           results={name: result for (_, _, name), result in zip(jobs, results)})


def _assert_resumed(runs, name: str, mesh: str) -> None:
    result, run_dir = runs.results[name], runs.dirs[name]
    assert result.returncode == 0, result.output[-4000:]
    assert resumed_from(result.output) == str(ckpt(run_dir, K)), result.output[-4000:]
    assert f"| {mesh}\n" in result.output, result.output[-4000:]


def _assert_continues(run_dir: Path, ref_dir: Path) -> None:
    """Steps 1..STEPS once each, the global batch kept, losses and parameters within 1e-5 of the reference."""
    got, want = metrics(run_dir), metrics(ref_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in got] == [r["samples"] for r in want]  # the global batch kept
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    assert_close_scaled(torch.tensor([r["loss"] for r in got], dtype=torch.float64),
                        torch.tensor([r["loss"] for r in want], dtype=torch.float64), "losses")
    params, ref = final_params(run_dir), final_params(ref_dir)
    assert params.keys() == ref.keys()
    assert_all_close_scaled(params, ref, "final parameters")


def _shard_bytes(manifest: dict) -> list:
    return [entry["bytes"] for name, entry in manifest["files"].items()
            if name.startswith("shards/") and name.endswith(".distcp")]


def test_hsdp_checkpoint_is_sharded_and_holds_each_replicated_shard_once(runs):
    assert runs.layout.verified is None
    manifest = runs.layout.hsdp
    assert manifest["sharded"] and manifest["world_size"] == 4
    assert "shards/.metadata" in manifest["files"]
    assert len(_shard_bytes(manifest)) == 4  # every rank wrote its own file
    # Two replicas hold the same shards: written once between them, the 4 files of hsdp
    # 2x2 hold as much as fsdp's 2 (twice as much if each replica wrote its copy).
    hsdp, fsdp = sum(_shard_bytes(manifest)), sum(_shard_bytes(runs.layout.fsdp))
    assert 0.9 * fsdp < hsdp < 1.1 * fsdp, (hsdp, fsdp)
    plan = json.loads((runs.ref / "plan.json").read_text())
    assert plan["mesh"] == {"kind": "hsdp", "replicate": 2, "shard": 2, "tp": 1, "pp": 1} and plan["accum_steps"] == 2


def test_hsdp_resume_on_the_same_mesh_is_bit_identical(runs):
    _assert_resumed(runs, "hsdp", "hsdp: 2 replicas x shard groups of 2 ranks")
    assert_same_metrics(runs.dirs["hsdp"], runs.ref, STEPS)
    assert_bit_identical(runs.dirs["hsdp"], runs.ref)


@pytest.mark.parametrize("name, mesh, world, accum", [(name, *rest) for name, _, _, *rest in TARGETS],
                         ids=[name for name, *_ in TARGETS])
def test_hsdp_checkpoint_resumes_on_another_mesh(runs, name, mesh, world, accum):
    _assert_resumed(runs, name, mesh)
    assert f"world size {world} x micro batch 4 x accum steps {accum} = global batch 32" in runs.results[name].output
    _assert_continues(runs.dirs[name], runs.ref)


def test_fsdp_checkpoint_resumes_on_hsdp(runs):
    _assert_resumed(runs, "back", "hsdp: 2 replicas x shard groups of 2 ranks")
    assert "world size 4 x micro batch 4 x accum steps 2 = global batch 32" in runs.results["back"].output
    _assert_continues(runs.dirs["back"], runs.ref)


COMM_KEYS = ("all_gathers", "all_gather_bytes", "reduce_scatters", "reduce_scatter_bytes",
             "allreduces", "allreduce_bytes", "step_allreduces", "step_allreduce_bytes")


def test_every_step_matches_the_plan_of_its_mesh(runs):
    # plan.json is written at every start, for the mesh of that start. Every step of a run
    # started afresh equals it (step 1: first_step); after a resume on any mesh, the first
    # step measures state_mb on that mesh again (resumed_step), and every later one is a
    # full step of that mesh: plan.json's "step" exactly.
    wrong = []
    for name, run_dir, first in [("ref", runs.ref, 1), ("half", runs.root / "half", 1),
                                 ("fsdp_half", runs.root / "fsdp_half", 1),
                                 *[(name, path, K + 1) for name, path in runs.dirs.items()]]:
        plan = json.loads((run_dir / "plan.json").read_text())
        assert set(plan["step"]) == set(COMM_KEYS), name
        for record in metrics(run_dir)[first - 1:]:
            want = (plan["first_step"] if record["step"] == 1 else
                    plan["resumed_step"] if record["step"] == first else plan["step"])
            got = {key: record[key] for key in COMM_KEYS}
            if got != want:
                wrong.append(f"{name} ({plan['mesh']['kind']} {plan['mesh']['replicate']}x{plan['mesh']['shard']}) "
                             f"step {record['step']}: " + ", ".join(f"{key} {got[key]} (plan {want[key]})"
                                                                    for key in COMM_KEYS if got[key] != want[key]))
    assert not wrong, "\n".join(wrong)
