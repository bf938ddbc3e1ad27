"""Checkpoints across tensor-parallel degrees, with real torchrun runs.

* tp 2 x fsdp 2 (4 ranks) stopped at step K and resumed on the same mesh is bit-identical
  to the uninterrupted run (parameters, every metric);
* the same checkpoint resumed without tp: fsdp on 2 ranks, ddp on 2 ranks and one process
  continue the run with the global batch kept, within 1e-5 of the uninterrupted run (fp32);
* and back: a ddp checkpoint of 2 ranks resumes on tp 2 x fsdp 2, and one of tp 2 on its
  own (2 ranks), within 1e-5;
* final_model.pt holds whole tensors, and every step equals plan.json's prediction.

The runs are test_mesh_checkpoint's (JOB2: a 1-layer GPT without biases, micro-batches of 4,
global 32: tp 2 x fsdp 2 is 2 data-parallel ranks x 4 x accum 4).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from test_checkpoint import K, STEPS, assert_bit_identical, assert_same_metrics, ckpt, copy_run, final_params, run_all
from test_mesh_checkpoint import BASE, _assert_continues, _assert_resumed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DDP = BASE
FSDP = BASE + ["dist.strategy=fsdp"]
TP = BASE + ["dist.tp.size=2"]  # on 2 ranks: one tp group
TP_FSDP = FSDP + ["dist.tp.size=2"]  # on 4 ranks: fsdp over 2 data-parallel ranks, tp 2 within each
TP_MESH = "fsdp: 1 shard group of 2 ranks, each rank a tensor-parallel group of 2 ranks"

# Resumes of the tp 2 x fsdp 2 half run: (name, args, nproc (0: python -m dist_trainer), the mesh it runs on)
TARGETS = [("same", TP_FSDP, 4, TP_MESH), ("fsdp2", FSDP, 2, "fsdp: 1 shard group of 2 ranks"),
           ("ddp2", DDP, 2, "ddp: 2 replicas"), ("one", DDP, 0, "ddp: 1 replicas")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ckpt")
    first = run_all([
        (TP_FSDP + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={root / 'ref'}"], 4),
        (TP_FSDP + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'half'}"], 4),
        (DDP + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'ddp_half'}"], 2),
        (TP + [f"trainer.max_steps={K}", f"hydra.run.dir={root / 'tp_half'}"], 2),
    ], root, timeout=400)
    for result in first:
        assert result.returncode == 0, result.output[-4000:]
    dirs = {name: copy_run(root / "half", root / f"to_{name}") for name, *_ in TARGETS}
    dirs["back"] = copy_run(root / "ddp_half", root / "ddp_to_tp")
    dirs["tp_back"] = copy_run(root / "tp_half", root / "tp_to_tp_fsdp")
    jobs = [*[(args, nproc, name) for name, args, nproc, _ in TARGETS], (TP_FSDP, 4, "back"), (TP_FSDP, 4, "tp_back")]
    results = run_all([(args + [f"trainer.max_steps={STEPS}", f"hydra.run.dir={dirs[name]}"], nproc)
                       for args, nproc, name in jobs], root, timeout=600)
    return SimpleNamespace(root=root, dirs=dirs, results={name: result for (_, _, name), result in zip(jobs, results)})


def test_tp_resume_on_the_same_mesh_is_bit_identical(runs):
    _assert_resumed(runs, "same", TP_MESH)
    assert_same_metrics(runs.dirs["same"], runs.root / "ref", STEPS)
    assert_bit_identical(runs.dirs["same"], runs.root / "ref")


@pytest.mark.parametrize("name, mesh", [(name, mesh) for name, _, _, mesh in TARGETS[1:]] +
                         [("back", TP_MESH), ("tp_back", TP_MESH)])
def test_a_checkpoint_resumes_across_tp_degrees(runs, name, mesh):
    _assert_resumed(runs, name, mesh)
    _assert_continues(runs.dirs[name], runs.root / "ref")


def test_final_model_is_whole_and_every_step_matches_the_plan(runs):
    root = runs.root
    params = final_params(root / "ref")
    assert params["tok_emb.weight"].shape == (256, 32) and params["blocks.0.attn.q.weight"].shape == (32, 32)
    plan = json.loads((root / "ref" / "plan.json").read_text())
    assert plan["mesh"] == {"kind": "fsdp", "replicate": 1, "shard": 2, "tp": 2, "pp": 1}
    records = [json.loads(line) for line in (root / "ref" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        want = plan["first_step"] if record["step"] == 1 else plan["step"]
        assert {key: record[key] for key in want} == want, record["step"]
    assert plan["step"]["tp_all_gathers"] > 0
    assert ckpt(root / "half", K).is_dir()
