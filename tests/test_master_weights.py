"""FP32 master weights with plain DDP, and synchronized BatchNorm through the trainer."""

from __future__ import annotations

import gc
import json
import math
from types import SimpleNamespace

import pytest
import torch

from dist_trainer import distributed
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.run import build, train
from helpers import assert_all_close_scaled, job_record, regression_config, run_jobs, run_ranks


def _gpt_config(precision: str, steps: int, micro: int = 4, glob: int = 32):
    cfg = regression_config(micro=micro, glob=glob, steps=steps, precision=precision, lr=3e-3, warmup_steps=0,
                            schedule="constant", grad_clip=1.0)
    cfg.model = {"_target_": "dist_trainer.models.GPT", "vocab_size": 256, "block_size": 32,
                 "n_layer": 1, "n_head": 2, "n_embd": 32}
    cfg.data = {"_target_": "dist_trainer.data.builtin.char_text", "block_size": 32, "min_len": 4}
    return cfg


def _master_worker(rank, world_size, precision, steps):
    cfg = _gpt_config(precision, steps)
    parts = build(cfg, validate(cfg, world_size), distributed.init("cpu"))
    trainer = parts.trainer
    losses = []
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, steps + 1), batches):
        losses.append(trainer.train_step(micro_batches, window, step).loss)
    weights = trainer.weights
    result = {
        "losses": losses,
        "masters": [m.detach().clone() for m in weights.optimizer_params()],
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.module.parameters()}),
        "master_dtypes": sorted({str(m.dtype) for m in weights.optimizer_params()}),
        "half_matches_master": all(torch.equal(p.detach(), m.to(p.dtype))
                                   for p, m in zip(weights.params, weights.masters)),
    }
    del parts, trainer, weights
    gc.collect()
    return result


def _job(env, world_size, name, fn, *args):
    """run_jobs' runner: a job is one of this file's rank functions and its arguments."""
    return {"result": fn(env.rank, world_size, *args)}


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    """The file's 2-rank jobs in one launch (helpers.run_jobs: a job that raises fails only its tests); the
    job that guards against a hang (a short last step) keeps a launch of its own."""
    root = tmp_path_factory.mktemp("ranks2")
    jobs = [*((f"master {p}", _master_worker, p, 4) for p in ("bf16-master", "fp16-master")),
            *((f"grads {p}", _grads_worker, p, 4) for p in ("bf16-master", "fp16-master")),
            ("bn", _bn_worker, root / "bn")]
    results = run_ranks(run_jobs, 2, root, jobs, _job, timeout=240)
    return SimpleNamespace(root=root, get=lambda name: [job_record(r, name)["result"] for r in results])


def test_master_weights_stay_bit_identical_across_ranks_with_accumulation(ranks2):
    # accum 4 (2 ranks x micro 4 x 4 = 32): if only the last micro-batch's
    # gradient were all-reduced, the FP32 masters would drift apart at once.
    for precision in ("bf16-master", "fp16-master"):
        r0, r1 = ranks2.get(f"master {precision}")
        half = {"bf16-master": torch.bfloat16, "fp16-master": torch.float16}[precision]
        assert set(r0["param_dtypes"]) == {str(torch.float32), str(half)}  # LayerNorm stays FP32
        assert r0["master_dtypes"] == [str(torch.float32)]
        assert r0["half_matches_master"] and r1["half_matches_master"]
        for a, b in zip(r0["masters"], r1["masters"]):
            assert torch.equal(a, b)


def _grads_worker(rank, world_size, precision, micro):
    """The gradient the optimizer gets at step 1 (FP32 masters' .grad in master modes), in parameter order."""
    cfg = _gpt_config(precision, 1, micro=micro)
    cfg.optim.grad_clip = None  # the normalised gradient itself, not a clipped one
    parts = build(cfg, validate(cfg, world_size), distributed.init("cpu"))
    window, micro_batches = next(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False))
    outcome = parts.trainer.train_step(micro_batches, window, 1)
    result = {"skipped": outcome.skipped, "accum": len(window),
              "grads": [g.detach().float().clone() for _, g in parts.trainer.weights.grads()]}
    del parts
    gc.collect()
    return result


def test_master_modes_accumulate_every_micro_batch(ranks2, tmp_path):
    # 2 ranks x micro 4 x accum 4 in a master mode against one batch of 32 in fp32:
    # the FP32 masters' gradient is the whole step's mean up to half-precision
    # rounding of each micro-batch's forward and backward. Losing a micro-batch
    # (keeping only the last one's gradient, say) moves it by far more.
    ref = run_ranks(_grads_worker, 1, tmp_path / "fp32", "fp32", 32)[0]
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    for precision, tol in (("bf16-master", 3e-2), ("fp16-master", 5e-3)):
        r0, r1 = ranks2.get(f"grads {precision}")
        assert r0["accum"] == 4 and not r0["skipped"]
        assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))
        gap = ((flat(r0["grads"]) - flat(ref["grads"])).norm() / flat(ref["grads"]).norm()).item()
        assert gap < tol, (precision, gap)
        # The same comparison fails for one micro-batch's share of the step: the
        # tolerance is far below what losing micro-batches costs.
        lost = ((flat(r0["grads"]) / 4 - flat(ref["grads"])).norm() / flat(ref["grads"]).norm()).item()
        assert lost > 10 * tol, (precision, lost)


def _final_loss(precision: str, tmp_path, steps: int = 30) -> float:
    cfg = _gpt_config(precision, steps, micro=8, glob=32)
    return train(cfg, tmp_path / precision)["loss"]


def test_half_master_modes_train_as_well_as_fp32(tmp_path):
    # Same data, same steps: the final loss of each master mode is within 2% of fp32's.
    fp32 = _final_loss("fp32", tmp_path)
    assert fp32 < 4.0  # it learned something: ln(256) = 5.55 at the start
    for precision in ("bf16-master", "fp16-master"):
        loss = _final_loss(precision, tmp_path)
        assert abs(loss - fp32) / fp32 < 0.02, (precision, loss, fp32)
        weights = torch.load(tmp_path / precision / "final_model.pt", weights_only=True)
        assert {t.dtype for t in weights.values()} == {torch.float32}
        # The saved weights are the FP32 masters (not half values widened back), under
        # every name of a tied parameter: the head shares the token embedding.
        half = {"bf16-master": torch.bfloat16, "fp16-master": torch.float16}[precision]
        emb = weights["tok_emb.weight"]
        assert torch.equal(weights["head.weight"], emb)
        assert not torch.equal(emb, emb.to(half).float())


def _bn_config(micro: int, steps: int = 3):
    # SGD: the conv bias before BatchNorm has a zero true gradient, and Adam would
    # blow its rounding noise up to full-size steps.
    cfg = regression_config(micro=micro, accum=1, steps=steps, name="sgd", lr=0.05, weight_decay=0.0,
                            grad_clip=None)
    cfg.model = {"_target_": "dist_trainer.models.DigitsConvNet", "width": 8}
    cfg.data = {"_target_": "dist_trainer.data.builtin.digits", "split": "train"}
    cfg.dist.sync_batchnorm = True
    return cfg


def _bn_worker(rank, world_size, run_dir):
    train(_bn_config(micro=8), run_dir)


def test_sync_batchnorm_on_two_ranks_equals_one_process_on_the_whole_batch(ranks2, tmp_path):
    # 2 ranks x 8 samples with synchronized statistics see exactly the batch
    # statistics of 16 samples in one process: weights and running stats agree.
    train(_bn_config(micro=16), tmp_path / "one")
    ranks2.get("bn")  # 2 ranks x 8 into ranks2.root / "bn"
    ref = torch.load(tmp_path / "one" / "final_model.pt", weights_only=True)
    got = torch.load(ranks2.root / "bn" / "final_model.pt", weights_only=True)
    assert any("running_var" in k for k in got)
    assert_all_close_scaled(got, ref, "synchronized BatchNorm on 2 ranks vs 1")


class BatchNormMLP(torch.nn.Module):
    """Linear-BatchNorm-tanh-linear regressor (scalar mean squared error), for a short last step."""

    def __init__(self, in_dim: int = 4, hidden: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.BatchNorm1d(hidden),
                                       torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])


def _short_step_worker(rank, world_size, run_dir):
    cfg = regression_config(micro=4, glob=16, steps=2, n=25, name="sgd", lr=0.05, weight_decay=0.0, grad_clip=None)
    cfg.model = {"_target_": f"{__name__}.BatchNormMLP"}
    cfg.dist.sync_batchnorm = True
    cfg.dist.check_consistency_every = 1  # parameters and running statistics bit-identical after each step
    return train(cfg, run_dir)


@pytest.mark.timeout(120)  # a collective mismatch may hang instead of failing
def test_sync_batchnorm_survives_a_short_last_step_with_uneven_micro_batches(tmp_path):
    # 25 samples, global 16: the second step holds 9, rank 0 gets [4, 1] and rank 1
    # [4]. Synchronized BatchNorm all-reduces in every forward and backward, so rank 1
    # must run a second (placeholder) micro-batch too, or the collectives mismatch.
    s0, s1 = run_ranks(_short_step_worker, 2, tmp_path, tmp_path / "run")
    assert s0["steps"] == s1["steps"] == 2 and s0["samples"] == s1["samples"] == 25
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [16, 25] and all(math.isfinite(r["loss"]) for r in records)
