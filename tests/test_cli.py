"""The command line as users run it: python -m dist_trainer and torchrun, in subprocesses."""

from __future__ import annotations

import json
import math
import platform

import pytest
import torch

from dist_trainer import hostmem
from helpers import REPO, run_module

BAD_CONFIGS = [
    # (overrides, text the error must contain)
    (["batch.global_batch_size=100"], "batch.global_batch_size=100"),
    (["batch.micro_batch_size=-4"], "batch.micro_batch_size"),
    (["batch.global_batch_size=-64"], "batch.global_batch_size"),
    (["precision=fp8"], "precision"),
    (["optim.lr_scaling=cubic"], "optim.lr_scaling"),
    (["batch.micro_batch_sise=4"], "micro_batch_sise"),
    (["trainer.max_steps=many"], "trainer.max_steps"),
    (["optim.lr_scaling=linear"], "optim.base_batch_size"),
    (["optim=sgd", "optim.momentum=-0.9"], "optim.momentum"),
    (["data.drop_last=true", "batch.global_batch_size=8192"], "data.drop_last=true drops everything"),
]


@pytest.mark.parametrize("overrides,expected", BAD_CONFIGS, ids=[o[0][-1] for o in BAD_CONFIGS])
def test_bad_config_fails_before_training_naming_the_key(tmp_path, overrides, expected):
    run_dir = tmp_path / "run"
    proc = run_module([*overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert expected in output, output
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained


def test_impossible_split_suggests_values(tmp_path):
    proc = run_module(["batch.global_batch_size=100", "batch.micro_batch_size=16", f"hydra.run.dir={tmp_path}"],
                      cwd=tmp_path, timeout=60)
    output = proc.stdout + proc.stderr
    assert "batch.micro_batch_size in [" in output and "(e.g. 96 or 112)" in output, output


CONTRACT_FIELDS = {"step", "loss", "lr", "grad_norm", "loss_scale", "skipped", "samples", "allreduces",
                   "step_time_s", "samples_per_s", "peak_mem_mb"}


def test_default_job_under_torchrun_trains_and_writes_the_contract_outputs(tmp_path):
    proc = run_module(["trainer.max_steps=16", "optim.warmup_steps=4", "trainer.eval_every=0",
                       "trainer.eval_batches=2", "trainer.log_every=4"],
                      cwd=tmp_path, timeout=300, torchrun_nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs  # both ranks agreed on one run directory
    run_dir = runs[0]
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()
    assert "world size 2 x micro batch 16 x accum steps 2 = global batch 64" in proc.stdout
    if hostmem.user_choice() is None and platform.libc_ver()[0] == "glibc":  # trainer.tune_malloc's default
        assert "host malloc: freed blocks kept for reuse" in proc.stdout  # ddp: the whole model on every rank
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 17))
    for r in records:
        assert CONTRACT_FIELDS <= r.keys() and r["tokens_per_s"] == r["items_per_s"]  # GPT: items are tokens
        assert r["loss_scale"] is None and r["skipped"] is False and r["skip_reason"] is None and r["allreduces"] >= 1
    assert records[-1]["samples"] == 16 * 64
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses  # byte-level loss starts near ln 256
    assert math.isfinite(records[-1]["eval_loss"])
    weights = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert all(t.dtype == torch.float32 for t in weights.values())
    # Plan mode, with no process group, predicts the all-reduces this run issued.
    plan = run_module(["plan.only=true", "plan.world_size=2", f"hydra.run.dir={tmp_path}/plan"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    steady = records[-1]
    assert (f"gradient all-reduces per optimizer step: {steady['allreduces']} (DDP buckets, expected)"
            in plan.stdout), (plan.stdout, steady)
    assert f"({steady['allreduce_bytes']} bytes)" in plan.stdout
    assert "without no_sync it would be" in plan.stdout


def test_plan_mode_fails_like_the_trainer_on_an_impossible_split(tmp_path):
    proc = run_module(["plan.only=true", "plan.world_size=3", f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert proc.returncode == 2 and "batch.global_batch_size=64" in proc.stdout + proc.stderr
    ok = run_module(["plan.only=true", "plan.world_size=64", "batch.global_batch_size=4096",
                     f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    assert "micro batch 16 x accum steps 4 x world 64 = global batch 4096" in ok.stdout, ok.stdout + ok.stderr


def test_single_process_runs_the_same_path(tmp_path):
    proc = run_module(["trainer.max_steps=3", "batch.global_batch_size=32", "model.n_layer=1",
                       "precision=bf16-mixed", "trainer.tune_malloc=false", f"hydra.run.dir={tmp_path}/run"],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "host malloc" not in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)


def test_tensorboard_logger_writes_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc = run_module(["logger=tensorboard", "trainer.max_steps=3", "model.n_layer=1", "batch.global_batch_size=32",
                       f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert losses == pytest.approx([r["loss"] for r in records], rel=1e-6)  # stored as float32


def test_custom_model_and_data_groups_take_only_the_users_arguments(tmp_path):
    # model=custom / data=custom start from an empty node: the GPT's and char_text's
    # arguments are not passed on to the user's classes (which would not accept them).
    proc = run_module(["model=custom", "model._target_=helpers.RegressionMLP", "+model.in_dim=4", "+model.hidden=8",
                       "data=custom", "data._target_=dist_trainer.data.builtin.regression", "+data.n=48",
                       "batch.micro_batch_size=8", "batch.global_batch_size=16", "trainer.max_steps=2",
                       f"hydra.run.dir={tmp_path}/run"], cwd=REPO / "tests", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model helpers.RegressionMLP: 49 parameters | data dist_trainer.data.builtin.regression: 48 samples" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [16, 32]
    assert not any("tokens_per_s" in r for r in records)  # a regression model's items are samples
    # Without a _target_, the error names the key to set.
    missing = run_module(["model=custom", f"hydra.run.dir={tmp_path}/missing"], cwd=tmp_path, timeout=60)
    assert missing.returncode == 2 and "model._target_ must be set" in missing.stdout + missing.stderr


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    # A run resumed from step 2 writes steps 3 and 4 again: TensorBoard must show the new
    # values only, as metrics.jsonl (trimmed back to the checkpoint) does.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dist_trainer.metrics import TensorBoardWriter

    first = TensorBoardWriter(tmp_path)
    for step in range(1, 5):
        first.write({"step": step, "loss": float(step)})
    first.close()
    resumed = TensorBoardWriter(tmp_path, initial=2)
    for step in (3, 4, 5):
        resumed.write({"step": step, "loss": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                          (5, 50.0)]


def test_plan_mode_predicts_a_master_mode_runs_allreduces_and_bytes(tmp_path):
    # bf16-master: DDP buckets the bf16 weights and the FP32 LayerNorms apart (one dtype
    # per bucket), and the hook sends an FP32 copy of each bucket (4 bytes per element).
    common = ["precision=bf16-master", "batch.global_batch_size=16", "model.n_layer=1"]
    proc = run_module([*common, "trainer.max_steps=3", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steady = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    params = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    elements = sum(t.numel() for name, t in params.items() if name != "head.weight")  # tied to tok_emb.weight
    assert steady["allreduce_bytes"] == 4 * elements  # every gradient element once, in FP32
    plan = run_module([*common, "plan.only=true", "plan.world_size=1", f"hydra.run.dir={tmp_path}/plan"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert (f"gradient all-reduces per optimizer step: {steady['allreduces']} (DDP buckets, expected)"
            in plan.stdout), (plan.stdout, steady)
    assert f"({steady['allreduce_bytes']} bytes)" in plan.stdout
    assert steady["allreduces"] >= 2  # half and FP32 buckets apart


def test_a_local_multirun_trains_each_point_in_its_own_run_directory(tmp_path):
    # Hydra's own launcher, no plugin: the points run one after the other in this process, each
    # creating and destroying its process group (of one) and writing its own run directory.
    sweep = tmp_path / "sweep"
    proc = run_module(["-m", "optim.lr=1e-3,3e-4", "trainer.max_steps=2", "optim.warmup_steps=0",
                       "model.n_layer=1", "trainer.eval_every=0", "trainer.eval_batches=1",
                       f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (sweep / "multirun.yaml").exists()
    lrs = []
    for point in ("0", "1"):
        records = [json.loads(line) for line in (sweep / point / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2] and (sweep / point / "final_model.pt").exists()
        lrs.append(records[0]["lr"])
    assert lrs == pytest.approx([1e-3, 3e-4], rel=1e-12)
