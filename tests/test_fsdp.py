"""dist.strategy=fsdp: FSDP2 on gloo, 2 real ranks, against one process and one big batch.

Everything FSDP-specific that the step promises, with real numbers:

* split invariance in both accumulation modes (``accum_sync=last`` reduce-scatters
  once per step, ``every`` with every micro-batch), for a scalar loss and for a
  token-weighted GPT, against the one-big-batch run of one process (fp32, AdamW);
  that also proves gloo's reduce-scatter averages (pytorch#162338 reported sums);
* fsdp equal to ddp on the same run, grad_norm included, with clipping active;
* the end of the data (a short micro-batch, a placeholder) and a parameter that
  one rank uses and the other does not;
* master modes (FP32 shards as the masters) within the tolerances they have under ddp;
* an overflow in one rank's gradient shard skips the step on every rank, the lr
  schedule holds and the loss scale backs off;
* activation checkpointing's gradients equal those without it, dropout included;
* state_mb about half of ddp's at 2 ranks, and the collective counts per step.

All world-2 jobs run in one launch (module fixture); the references run in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dist_trainer import distributed
from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.run import build
from helpers import SAME_OPS_TOL, SCALE_TOL, assert_all_close_scaled
from test_accumulation import (GLOBAL, _assert_close, _guard_trained, branchy_config, gpt_config,
                               in_one_process, launch_clean, mlp_config)

STEPS = 3


def _fsdp(cfg, accum_sync: str = "last", **dist_kw):
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy="fsdp", **dist_kw))
    cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, accum_sync=accum_sync)
    return cfg


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _named_full(module, grads: bool) -> dict:
    """Whole tensors, gathered from the shards under fsdp (every rank calls it in the same order)."""
    out = {}
    for name, p in module.named_parameters():
        value = p.grad if grads else p
        out[name] = None if value is None else _full(value.detach()).clone()
    return out


class _InfOnce(torch.autograd.Function):
    """Identity whose backward puts inf into output column 0 once, on one rank."""

    armed = {"rank": None, "call": None, "calls": 0}

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        state = _InfOnce.armed
        state["calls"] += 1
        if dist.get_rank() == state["rank"] and state["calls"] == state["call"]:
            grad = grad.clone()
            grad[:, 0] = float("inf")
        return grad


class InfMLP(torch.nn.Module):
    """RegressionMLP whose first layer's output gradient gets inf in column 0 at one backward of one rank.

    Only row 0 of the first weight (and element 0 of its bias) becomes inf: under
    fsdp that row lives in rank 0's shard, wherever the inf came from; the other
    layers and the other rank's shards stay finite.
    """

    def __init__(self, in_dim: int = 4, hidden: int = 16, inf_rank: int = 1, inf_call: int = 5):
        super().__init__()
        self.first, self.second = torch.nn.Linear(in_dim, hidden), torch.nn.Linear(hidden, 1)
        _InfOnce.armed.update(rank=inf_rank, call=inf_call, calls=0)

    def forward(self, batch):
        h = torch.tanh(_InfOnce.apply(self.first(batch["x"])))
        return torch.nn.functional.mse_loss(self.second(h).squeeze(-1).float(), batch["y"])


def overflow_config():
    cfg = mlp_config(4)  # 2 ranks x micro 4 x accum 4; backward 5 of rank 1 is step 2's first
    cfg.model = {"_target_": f"{__name__}.InfMLP", "in_dim": 4, "hidden": 16}
    cfg.precision.name = "fp16-mixed"
    # This regression's fp16 weight gradients overflow at the default 2**16 on their own;
    # at 2**10 only the injected inf does.
    cfg.precision.loss_scale.init_scale = 1024.0
    return _fsdp(cfg)


def master_config(precision: str, micro: int, strategy: str = "fsdp"):
    cfg = gpt_config(micro)
    cfg.precision.name = precision
    return _fsdp(cfg) if strategy == "fsdp" else cfg


def ac_config(strategy: str, checkpointing: bool, accum_sync: str = "last"):
    cfg = gpt_config(4)
    cfg.model = {**cfg.model, "n_layer": 2, "dropout": 0.1}
    cfg.dist = dataclasses.replace(cfg.dist, activation_checkpointing=checkpointing)
    return _fsdp(cfg, accum_sync) if strategy == "fsdp" else cfg


def clip_config(strategy: str):
    cfg = gpt_config(4)
    cfg.optim.grad_clip = 0.05  # below the gradients' norm: clipping acts on every step
    return _fsdp(cfg) if strategy == "fsdp" else cfg


def _world2_jobs() -> list[tuple]:
    jobs = []
    for mode in ("last", "every"):
        for micro in (4, 16):  # accum 4 and accum 1
            jobs.append((f"mlp/{mode}/{micro}", _fsdp(mlp_config(micro), mode), STEPS))
            jobs.append((f"gpt/{mode}/{micro}", _fsdp(gpt_config(micro), mode), STEPS))
        jobs.append((f"end/n73/{mode}", _fsdp(mlp_config(4, n=73), mode), STEPS))
        branchy = branchy_config(4, 1)  # rank 0 uses the branch in every micro-batch, rank 1 never
        jobs.append((f"branchy/{mode}", _fsdp(branchy, mode, find_unused_parameters=True), STEPS))
    jobs.append(("gpt/ddp/4", gpt_config(4), STEPS))
    jobs.append(("clip/ddp", clip_config("ddp"), STEPS))
    jobs.append(("clip/fsdp", clip_config("fsdp"), STEPS))
    for precision in ("bf16-master", "fp16-master"):
        jobs.append((f"master/{precision}", master_config(precision, 4), 1))
    jobs.append(("master/ddp/bf16-master", master_config("bf16-master", 4, strategy="ddp"), 1))
    sgd = _fsdp(gpt_config(4), "every")
    sgd.optim = dataclasses.replace(sgd.optim, name="sgd", momentum=0.9)
    jobs.append(("sgd/fsdp", sgd, 1))
    for strategy in ("ddp", "fsdp"):
        for ac in (False, True):
            jobs.append((f"ac/{strategy}/{ac}", ac_config(strategy, ac), 1))
    jobs.append(("ac/fsdp/every/True", ac_config("fsdp", True, "every"), 1))
    for strategy, precision in (("fsdp", "bf16-master"), ("ddp", "fp16-mixed"), ("ddp", "bf16-master")):
        for ac in (False, True):
            cfg = ac_config(strategy, ac)
            cfg.precision.name = precision
            jobs.append((f"ac/{strategy}/{precision}/{ac}", cfg, 1))
    jobs.append(("overflow", overflow_config(), STEPS))
    return jobs


def _run_job(env, world_size: int, cfg, steps: int) -> dict:
    parts = build(cfg, validate(cfg, world_size), env)
    trainer, module = parts.trainer, parts.trainer.module
    rec = {"outcomes": [], "grads": [], "params": [], "windows": [], "local_finite": [],
           "init": _named_full(module, grads=False)}
    reduce_window = trainer._reduce_window

    def spy(*args, **kwargs):  # each rank's own shards, as they stand before the skip decision
        rec["local_finite"].append(all(bool(torch.isfinite(g).all()) for _, g in trainer.weights.grads()))
        return reduce_window(*args, **kwargs)

    trainer._reduce_window = spy
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, steps + 1), batches):
        outcome = trainer.train_step(micro_batches, window, step)
        rec["outcomes"].append(dataclasses.asdict(outcome))
        rec["windows"].append([list(ix) for ix in window])
        rec["grads"].append(_named_full(module, grads=True))
        rec["params"].append(_named_full(module, grads=False))
    rec["updates"], rec["scale"] = trainer.updates, trainer.precision.scaler.scale
    rec["param_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    return rec


def _worker(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    env = distributed.init("cpu")
    results = {}
    for name, cfg, steps in jobs:
        try:
            results[name] = _run_job(env, world_size, cfg, steps)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        gc.collect()
    return results


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """One process, one big batch of 32 (ddp on a group of one), and fsdp on a group of one."""
    jobs = [("mlp/ref", mlp_config(32), STEPS), ("gpt/ref", gpt_config(32), STEPS),
            ("end/n73/ref", mlp_config(32, n=73), STEPS), ("master/ref", gpt_config(32), 1),
            ("gpt/fsdp1", _fsdp(gpt_config(8)), STEPS)]
    return in_one_process(_worker, jobs)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("fsdp2"), _world2_jobs())


def _job(results: dict, name: str) -> dict:
    rec = results[name]
    if "error" in rec:
        pytest.fail(f"job {name} raised:\n{rec['error']}")
    return rec


def _both(world2, name: str) -> list[dict]:
    return [_job(r, name) for r in world2]


def _assert_same_run(got: dict, ref: dict, what: str) -> None:
    """Every step's gradient and loss, and the final weights."""
    for step in range(len(ref["grads"])):
        assert got["outcomes"][step]["loss"] == pytest.approx(ref["outcomes"][step]["loss"], rel=SCALE_TOL), what
        _assert_close(got["grads"][step], ref["grads"][step], f"{what} grads step {step + 1}")
    _assert_close(got["params"][-1], ref["params"][-1], f"{what} params")


def _assert_ranks_agree(runs: list[dict], what: str) -> None:
    """The gathered tensors are the same on both ranks (they are one sharded tensor)."""
    for a, b in zip(runs[0]["params"][-1].values(), runs[1]["params"][-1].values()):
        assert torch.equal(a, b), what


# ----------------------------------------------------------------------------- split invariance

@pytest.mark.parametrize("mode", ["last", "every"])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("micro", [4, 16], ids=["2x4x4", "2x16x1"])
def test_fsdp_split_equals_one_big_batch(refs, world2, mode, kind, micro):
    runs = _both(world2, f"{kind}/{mode}/{micro}")
    ref = _job(refs, f"{kind}/ref")
    _assert_ranks_agree(runs, kind)
    assert [len(w) for w in runs[0]["windows"]] == [GLOBAL // (2 * micro)] * STEPS
    for step in range(STEPS):  # the same items: token-weighted for the GPT
        assert runs[0]["outcomes"][step]["items"] == ref["outcomes"][step]["items"]
    _assert_same_run(runs[0], ref, f"fsdp {mode} {kind} 2x{micro}")
    _guard_trained(ref)


def test_fsdp_on_one_rank_equals_one_big_batch(refs):
    _assert_same_run(_job(refs, "gpt/fsdp1"), _job(refs, "gpt/ref"), "fsdp 1x8x4")


def test_fsdp_equals_ddp_on_the_same_run(world2):
    fsdp, ddp = _both(world2, "gpt/last/4")[0], _both(world2, "gpt/ddp/4")[0]
    _assert_same_run(fsdp, ddp, "fsdp vs ddp 2x4x4")
    for f, d in zip(fsdp["outcomes"], ddp["outcomes"]):
        assert f["grad_norm"] == pytest.approx(d["grad_norm"], rel=SCALE_TOL)


def test_grad_norm_and_clipping_equal_ddp(world2):
    fsdp, ddp = _both(world2, "clip/fsdp"), _both(world2, "clip/ddp")
    for step in range(STEPS):
        f, d = fsdp[0]["outcomes"][step], ddp[0]["outcomes"][step]
        assert d["grad_norm"] > 0.05 * 2  # clipping is active: the update is scaled down
        assert f["grad_norm"] == pytest.approx(d["grad_norm"], rel=SCALE_TOL)
        assert fsdp[1]["outcomes"][step]["grad_norm"] == f["grad_norm"]  # every rank reports the same
    _assert_same_run(fsdp[0], ddp[0], "clipped fsdp vs ddp")


@pytest.mark.parametrize("mode", ["last", "every"])
def test_fsdp_short_last_step_and_placeholder(refs, world2, mode):
    runs, ref = _both(world2, f"end/n73/{mode}"), _job(refs, "end/n73/ref")
    # step 3 holds 9 samples: rank 0 gets [4, 1], rank 1 [4] and a placeholder
    assert [[len(mb) for mb in run["windows"][2]] for run in runs] == [[4, 1], [4, 0]]
    assert runs[0]["outcomes"][2]["samples"] == runs[0]["outcomes"][2]["items"] == 9
    _assert_same_run(runs[0], ref, f"fsdp {mode} n73")


@pytest.mark.parametrize("mode", ["last", "every"])
def test_fsdp_parameter_used_by_one_rank_only(world2, mode):
    """BranchyMLP, branch_every=1: rank 0 uses the branch in every micro-batch, rank 1 never."""
    from test_accumulation import _hand_for

    runs = _both(world2, f"branchy/{mode}")
    steps = [[mb for run in runs for mb in run["windows"][s]] for s in range(STEPS)]
    hand = _hand_for("branchy", branchy_config(4, 1), steps)
    for step in range(STEPS):
        assert runs[0]["grads"][step]["branch.weight"].abs().max() > 1e-4
        _assert_close(runs[0]["grads"][step], hand[step]["grads"], f"fsdp {mode} branchy grads")
    _assert_close(runs[0]["params"][-1], hand[-1]["params"], f"fsdp {mode} branchy params")


# ----------------------------------------------------------------------------- precision

@pytest.mark.parametrize("precision, tol", [("bf16-master", 3e-2), ("fp16-master", 5e-3)])
def test_fsdp_master_modes_within_ddp_tolerances(refs, world2, precision, tol):
    """The gradient the optimizer gets (FP32 shards = masters) against fp32's one big batch.

    The tolerances are those test_master_weights holds ddp's master modes to.
    """
    runs, ref = _both(world2, f"master/{precision}"), _job(refs, "master/ref")
    assert runs[0]["param_dtypes"] == [str(torch.float32)]  # the sharded parameters are the FP32 masters
    assert not runs[0]["outcomes"][0]["skipped"]
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    got, want = flat(runs[0]["grads"][0]), flat(ref["grads"][0])
    gap = ((got - want).norm() / want.norm()).item()
    assert gap < tol, (precision, gap)
    lost = ((got / 4 - want).norm() / want.norm()).item()  # one micro-batch's share would fail
    assert lost > 10 * tol


def test_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(world2):
    runs = _both(world2, "overflow")
    # Step 2: rank 1's first backward put inf into row 0 of the first weight, which after the
    # reduce-scatter lives in rank 0's shard only: rank 1's own shards were all finite.
    assert [run["local_finite"] for run in runs] == [[True, False, True], [True, True, True]]
    for run in runs:
        skipped = [o["skipped"] for o in run["outcomes"]]
        assert skipped == [False, True, False]
        assert run["outcomes"][1]["skip_reason"] == "nonfinite"
        scales = [o["loss_scale"] for o in run["outcomes"]]
        assert scales == [1024.0, 1024.0, 512.0]  # backed off after the skip
        lrs = [o["lr"] for o in run["outcomes"]]
        assert lrs[2] == lrs[1]  # the schedule held: step 3 uses the rate step 2 would have
        assert run["updates"] == 2
    after_1, after_2 = runs[0]["params"][0], runs[0]["params"][1]
    assert all(torch.equal(after_2[name], value) for name, value in after_1.items())  # nothing moved


# ----------------------------------------------------------------------------- activation checkpointing

@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_gives_the_same_gradients(world2, strategy):
    """GPT with dropout 0.1, 2 blocks: recomputed forward passes use the same dropout masks."""
    off, on = _both(world2, f"ac/{strategy}/False")[0], _both(world2, f"ac/{strategy}/True")[0]
    assert_all_close_scaled(on["grads"][0], off["grads"][0], f"checkpointed {strategy} vs plain", SAME_OPS_TOL)
    if strategy == "fsdp":
        every = _both(world2, "ac/fsdp/every/True")[0]
        _assert_close(every["grads"][0], off["grads"][0], "checkpointed fsdp every vs plain fsdp last")


@pytest.mark.parametrize("strategy, precision", [("fsdp", "bf16-master"), ("ddp", "fp16-mixed"),
                                                 ("ddp", "bf16-master")])
def test_activation_checkpointing_in_half_precision_modes(world2, strategy, precision):
    """The recomputation runs under the forward's autocast and RNG state: the same half-precision numbers."""
    off = _both(world2, f"ac/{strategy}/{precision}/False")[0]
    on = _both(world2, f"ac/{strategy}/{precision}/True")[0]
    assert not off["outcomes"][0]["skipped"] and not on["outcomes"][0]["skipped"]
    assert_all_close_scaled(on["grads"][0], off["grads"][0], f"checkpointed {strategy} {precision} vs plain",
                            SAME_OPS_TOL)


def test_dropout_makes_checkpointing_comparison_meaningful(world2):
    """Guard: with dropout the gradients depend on the masks (a fresh mask in recompute would show)."""
    ddp, fsdp = _both(world2, "ac/ddp/False")[0], _both(world2, "ac/fsdp/False")[0]
    # the two strategies draw their masks from the same per-rank streams: same gradients
    _assert_close(fsdp["grads"][0], ddp["grads"][0], "plain fsdp vs plain ddp with dropout")


# ----------------------------------------------------------------------------- memory and collectives

def test_state_mb_under_fsdp_is_about_half_of_ddp(world2):
    fsdp = _both(world2, "gpt/last/4")[0]["outcomes"][-1]["state_mb"]
    ddp = _both(world2, "gpt/ddp/4")[0]["outcomes"][-1]["state_mb"]
    assert 0.45 < fsdp / ddp < 0.56, (fsdp, ddp)


STATE_CASES = {"gpt/last/4": lambda: _fsdp(gpt_config(4)), "gpt/ddp/4": lambda: gpt_config(4),
               "master/bf16-master": lambda: master_config("bf16-master", 4),
               "master/ddp/bf16-master": lambda: master_config("bf16-master", 4, strategy="ddp"),
               "sgd/fsdp": lambda: next(cfg for name, cfg, _ in _world2_jobs() if name == "sgd/fsdp")}


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_plan_mode_predicts_state_mb_within_5_percent(world2, name):
    from dist_trainer.plan import plan_report

    measured = max(run["outcomes"][-1]["state_mb"] for run in _both(world2, name))
    report = plan_report(STATE_CASES[name](), 2)
    found = re.search(r"model state per rank after an optimizer step: [\d.]+ MiB \((\d+) bytes", report)
    predicted = int(found.group(1)) / 2**20
    assert predicted == pytest.approx(measured, rel=0.05), (name, predicted, measured)


def test_reduce_scatters_flat_with_last_and_growing_with_every(world2):
    # the GPT's one block, then the root, and on CPU the head's part of the weight tied to the embedding, reduced
    # in the head's backward (parallel/tied_head.py)
    reductions = 3
    counts = {}
    for mode in ("last", "every"):
        for micro, accum in ((16, 1), (4, 4)):
            out = _both(world2, f"gpt/{mode}/{micro}")[0]["outcomes"]
            counts[mode, accum] = [o["comm"]["reduce_scatters"] for o in out]
            assert all(o["comm"]["all_gathers"] > 0 and o["allreduces"] == 0 for o in out)
            bytes_per_call = {o["comm"]["reduce_scatter_bytes"] / o["comm"]["reduce_scatters"] for o in out}
            assert len(bytes_per_call) == 1
    assert counts["last", 1] == counts["last", 4] == [reductions] * STEPS
    assert counts["every", 1] == [reductions] * STEPS and counts["every", 4] == [4 * reductions] * STEPS


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("key, value", [("sync_batchnorm", True), ("check_consistency_every", 5)])
def test_unsupported_combinations_name_both_keys(key, value):
    cfg = _fsdp(mlp_config(4), **{key: value})
    with pytest.raises(ConfigError, match=rf"dist\.{key}.*dist\.strategy"):
        validate(cfg, 2)


def test_micro_batch_auto_under_fsdp_names_both_keys():
    cfg = _fsdp(mlp_config(4))
    cfg.batch.micro_batch_size = "auto"
    with pytest.raises(ConfigError, match=r"batch\.micro_batch_size.*dist\.strategy=fsdp"):
        validate(cfg, 2)


def test_blocks_that_match_nothing_name_the_key():
    cfg = _fsdp(gpt_config(32), blocks=["NoSuchBlock"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"dist\.blocks=\['NoSuchBlock'\].*Block"):
            build(cfg, validate(cfg, 1), distributed.init("cpu"))
    finally:
        dist.destroy_process_group()
