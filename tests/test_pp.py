"""Pipeline stages (dist.pp.*) on real gloo ranks, against one process on one big batch.

One launch of 2 ranks (pp 2) runs the schedules; one of 4 (pp 2 x ddp 2, pp 2 x fsdp 2; slow, .ci/run
runs it). fp32 and SGD with momentum on test_accumulation's token-unbalanced text (micro-batches whose
token counts differ by 4x or more), so a mean of micro-batch means, or the schedule's own 1/n, fails.

* split invariance within SCALE_TOL of the scale, every step, gradients and weights: gpipe, 1f1b and
  interleaved 1f1b with 2, 4 and 8 micro-batches, clipping on; the end of the data (a short step whose
  missing micro-batches run as placeholders); the tied embedding and head take the same update;
* the plan: each stage group's sends, receives and collectives of step 1 and of a full step equal
  plan.json's exactly; state_mb and step_peak_state_mb as predicted; metrics carry the idle time;
* checkpoints: pp 2 resumes bit-identically on pp 2, and within SCALE_TOL on one process, and back;
* what is not supported is a ConfigError naming the keys.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from dist_trainer.config import ConfigError, validate
from helpers import assert_all_close_scaled
from test_accumulation import GLOBAL, in_one_process, launch_clean, unbalanced_text
from test_checkpoint import assert_bit_identical, ckpt, final_params, metrics, run_all
from test_hsdp import STEPS, _gpt, _job, _worker

LAYERS = 4  # 4 stages at most: pp 2 x 2 stages per rank


def short_text(block_size: int = 24, n: int = 73):
    """73 samples: step 3 holds 9, so the pipeline's last micro-batches are placeholders."""
    return Subset(unbalanced_text(block_size), range(n))


def _pp(cfg, size: int = 2, schedule: str = "1f1b", per_rank: int = 1, strategy: str = "ddp"):
    cfg.dist = dataclasses.replace(cfg.dist, strategy=strategy)
    cfg.dist.pp = dataclasses.replace(cfg.dist.pp, size=size, schedule=schedule, stages_per_rank=per_rank)
    if strategy == "fsdp":
        cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, reshard="forward")
    return cfg


def _model(micro: int, glob: int = GLOBAL):
    return _gpt(micro, glob, n_layer=LAYERS)


def _clip(cfg):
    cfg.optim.grad_clip = 0.05  # below the gradients' norm: clipping acts on every step
    return cfg


def _end(micro: int):
    cfg = _model(micro)
    cfg.data = {**cfg.data, "_target_": "test_pp.short_text"}
    return cfg


SCHEDULES = [("gpipe", 1, 2), ("gpipe", 1, 8), ("1f1b", 1, 2), ("1f1b", 1, 4), ("1f1b", 1, 8),
             ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 2, 8)]


def _jobs2() -> list:
    jobs = [(f"{s}/v{v}/k{k}", _clip(_pp(_model(GLOBAL // k), schedule=s, per_rank=v)), STEPS)
            for s, v, k in SCHEDULES]
    jobs.append(("end", _pp(_end(8)), STEPS))
    mixed = _pp(_model(8))
    mixed.precision.name = "bf16-mixed"
    master = _pp(_model(8))
    master.precision.name = "bf16-master"
    ac = _pp(_model(8))
    ac.dist.activation_checkpointing = True
    jobs += [("plan/bf16-mixed", mixed, 2), ("plan/bf16-master", master, 2), ("plan/ac", ac, 2)]
    return jobs


def _jobs4() -> list:
    return [("ddp/k4", _clip(_pp(_model(4))), STEPS), ("fsdp/k4", _clip(_pp(_model(4), strategy="fsdp")), STEPS),
            ("fsdp/interleaved/k4", _pp(_model(4), schedule="interleaved_1f1b", per_rank=2, strategy="fsdp"), STEPS)]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("pp2"), _jobs2())


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    return launch_clean(_worker, 4, tmp_path_factory.mktemp("pp4"), _jobs4())


@pytest.fixture(scope="module")
def refs():
    """One process, one big batch of 32 (K = 1)."""
    return in_one_process(_worker, [("ref", _model(GLOBAL), STEPS), ("clip", _clip(_model(GLOBAL)), STEPS),
                                    ("end", _end(GLOBAL), STEPS)])


def _whole(name: str) -> str:
    return "tok_emb.weight" if name == "head.weight" else name  # one process ties the head to the embedding


def _assert_stage_run(got: dict, want: dict, what: str) -> None:
    """This rank's parameters (its stages') equal one process's, step by step; the loss too."""
    for step in range(len(want["grads"])):
        assert got["outcomes"][step]["loss"] == pytest.approx(want["outcomes"][step]["loss"], rel=1e-5), what
        for key in ("grads", "params"):
            mine = got[key][step]
            theirs = {n: want[key][step][_whole(n)] for n in mine}
            floor_of = {**want[key][step], **theirs}  # the floor is the whole model's largest tensor
            assert_all_close_scaled({**floor_of, **mine}, floor_of, f"{what} {key} step {step + 1}")


@pytest.mark.parametrize("schedule, per_rank, k", SCHEDULES)
def test_pp2_schedules_equal_one_big_batch(pp2, refs, schedule, per_rank, k):
    for rank in range(2):
        _assert_stage_run(_job(pp2, f"{schedule}/v{per_rank}/k{k}", rank), refs["clip"],
                          f"pp 2 {schedule} x{per_rank} K={k} rank {rank}")


def test_pp2_short_last_step_runs_placeholders(pp2, refs):
    for rank in range(2):
        run = _job(pp2, "end", rank)
        assert run["outcomes"][-1]["samples"] == 9
        _assert_stage_run(run, refs["end"], f"pp 2 end of data rank {rank}")


def test_pp2_stages_hold_their_blocks_and_the_tie(pp2):
    names = [set(_job(pp2, "1f1b/v1/k4", r)["params"][0]) for r in range(2)]
    assert {"tok_emb.weight", "blocks.0.ln_1.weight", "blocks.1.ln_1.weight"} <= names[0]
    assert {"head.weight", "ln_f.weight", "blocks.3.ln_1.weight"} <= names[1]
    assert not names[0] & names[1]
    first, last = (_job(pp2, "1f1b/v1/k4", r)["params"][-1] for r in range(2))
    assert torch.equal(first["tok_emb.weight"], last["head.weight"])  # the tied copies took one update
    inter = [set(_job(pp2, "interleaved_1f1b/v2/k4", r)["params"][0]) for r in range(2)]
    assert {"blocks.0.ln_1.weight", "blocks.2.ln_1.weight"} <= inter[0]
    assert {"blocks.1.ln_1.weight", "blocks.3.ln_1.weight"} <= inter[1]


def _assert_plan(run: dict, rank: int, groups: int) -> None:
    plan = run["plan_from_model"]
    group = plan["pp_stage_groups"][rank // groups]
    first, full = run["outcomes"][0], run["outcomes"][1]
    assert first["comm"] == group["first_step"], f"rank {rank} step 1"
    assert full["comm"] == group["step"], f"rank {rank} full step"
    assert first["state_mb"] == pytest.approx(plan["state_mb"], rel=1e-9)
    assert first["step_peak_state_mb"] == pytest.approx(plan["step_peak_state_mb"], rel=1e-9)
    assert full["comm"]["p2p_sends"] > 0 and full["comm"]["p2p_recv_bytes"] > 0
    assert len(full["pp_idle_times"]) == run["plan_from_model"]["world_size"]


@pytest.mark.parametrize("job", ["1f1b/v1/k4", "gpipe/v1/k8", "interleaved_1f1b/v2/k8", "plan/bf16-mixed",
                                 "plan/bf16-master", "plan/ac"])
def test_pp2_collectives_equal_the_plan(pp2, job):
    for rank in range(2):
        _assert_plan(_job(pp2, job, rank), rank, 1)


def test_pp2_bubble_is_predicted():
    from dist_trainer.parallel.pp import pp_bubble

    assert pp_bubble("1f1b", 2, 1, 4) == pytest.approx(1 / 5)
    assert pp_bubble("gpipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert pp_bubble("interleaved_1f1b", 2, 2, 4) == pytest.approx(1 / 9)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ddp/k4", "fsdp/k4", "fsdp/interleaved/k4"])
def test_pp2_by_data_parallel_2_equals_one_big_batch_and_the_plan(pp4, refs, job):
    for rank in range(4):
        run = _job(pp4, job, rank)
        _assert_stage_run(run, refs["clip" if "interleaved" not in job else "ref"], f"{job} rank {rank}")
        _assert_plan(run, rank, 2)


# ----------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("change, key", [
    (lambda c: _pp(c, schedule="zero_bubble", per_rank=2), "dist.pp.schedule"),
    (lambda c: setattr(_pp(c).dist, "tp", dataclasses.replace(c.dist.tp, size=2)), "dist.tp.size"),
    (lambda c: setattr(_pp(c).trainer, "compile", True), "trainer.compile"),
    (lambda c: setattr(_pp(c, strategy="fsdp").dist, "fsdp", dataclasses.replace(c.dist.fsdp, accum_sync="every")),
     "dist.fsdp.accum_sync"),
    (lambda c: setattr(_pp(c, strategy="fsdp").dist, "fsdp", dataclasses.replace(c.dist.fsdp, reshard="micro_batch")),
     "dist.fsdp.reshard"),
    (lambda c: _pp(c, schedule="1f1b", per_rank=2), "dist.pp.stages_per_rank"),
    (lambda c: _pp(c, schedule="interleaved_1f1b", per_rank=1), "dist.pp.stages_per_rank"),
    (lambda c: _pp(c, size=3), "dist.pp.size"),
])
def test_pp_unsupported_combinations_are_config_errors(change, key):
    cfg = _model(8)
    change(cfg)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 4)


def test_pp_too_few_micro_batches_names_batch_and_pp_keys():
    cfg = _pp(_model(16), size=4)  # 1 data rank x micro 16 x accum 2: 1f1b on 4 stages needs 4
    with pytest.raises(ConfigError, match=r"batch\.accum_steps=2.*dist\.pp\.schedule=1f1b.*Valid accum steps near it"):
        validate(cfg, 4)


# ----------------------------------------------------------------------------- checkpoints, a real torchrun job

COMMON = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.ckpt_every=2", "batch.micro_batch_size=8",
          "batch.global_batch_size=32", "optim.warmup_steps=0", "model.n_layer=2", "model.n_embd=32",
          "data.block_size=32", "model.block_size=32"]


def _jobs(root: Path, runs: list) -> None:
    """(run directory name, ranks, overrides) as real torchrun jobs, all at once (test_checkpoint's run_all)."""
    results = run_all([(COMMON + [f"hydra.run.dir={root / name}", *extra], ranks) for name, ranks, extra in runs],
                      root, timeout=300)
    for result in results:
        assert result.returncode == 0, result.output[-3000:]


@pytest.mark.slow
def test_pp_checkpoints_resume_across_pp_degrees(tmp_path):
    _jobs(tmp_path, [("one", 1, []), ("pp", 2, ["dist.pp.size=2"])])
    one, pp = metrics(tmp_path / "one"), metrics(tmp_path / "pp")
    assert [r["loss"] for r in pp] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert pp[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    assert pp[0]["pp_bubble"] == pytest.approx(1 / 5) and len(pp[0]["pp_idle_s"]) == 2
    resumes = (("pp_same", "pp", 2, ["dist.pp.size=2"]), ("pp_to_one", "pp", 1, []),
               ("one_to_pp", "one", 2, ["dist.pp.size=2"]))
    for name, src, _, _ in resumes:  # each resumes from its source's step-2 checkpoint
        shutil.copytree(ckpt(tmp_path / src, 2), ckpt(tmp_path / name, 2))
    _jobs(tmp_path, [(name, ranks, extra) for name, _, ranks, extra in resumes])
    whole, mine = final_params(tmp_path / "one"), final_params(tmp_path / "pp")
    assert set(mine) == set(whole)  # exported whole: every stage's tensors, the tied head too
    assert_bit_identical(tmp_path / "pp_same", tmp_path / "pp")  # pp 2 resumed on pp 2
    for name in ("pp", "pp_to_one", "one_to_pp"):
        assert_all_close_scaled(final_params(tmp_path / name), whole, name)
