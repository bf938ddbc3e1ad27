"""Sharding across nodes: hsdp, parameters kept gathered, prefetch, and the communication plan, on 4 real ranks.

One launch of 4 gloo ranks runs every job; the references run in this process.

* split invariance: hsdp 2 x 2 in every ``reshard`` x ``accum_sync`` equals one
  process on one big batch (fp32, SGD with momentum) within 1e-5, every step;
* ``reshard=step`` gathers each unit once per step whatever K, and its weights
  after 3 steps equal ``reshard=micro_batch``'s within 1e-6;
* the weights the next step uses are the optimizer's update: a strategy that
  kept its gathered copy (the stale case) is caught by the same comparison;
* ``prefetch`` changes no number;
* fp16-master under hsdp: an overflow on one rank skips the step on every rank;
  bf16-master and bf16-mixed within the tolerance fsdp is held to; clipping by the
  global norm, the end of the data (a short step, placeholders) and activation
  checkpointing equal their references;
* the plan grid: every collective's calls and bytes of every step equal
  plan.json's prediction exactly (ddp, fsdp, hsdp; K = 1, 3, 8; every reshard;
  both accum_sync; a Hugging Face model), and a transformers GPT-2 under hsdp
  equals one process (marked slow: a second 4-rank launch; .ci/run runs it);
* step_peak_state_mb as plan mode predicts it, and raised by reshard=step.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback

import pytest
import torch
from torch.distributed.tensor import DTensor

from dist_trainer import distributed
from dist_trainer.config import BatchConfig, ConfigError, OptimConfig
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.plan import plan_numbers
from dist_trainer.run import build
from helpers import SAME_OPS_TOL, assert_all_close_scaled
from test_accumulation import GLOBAL, _assert_close, gpt_config, in_one_process, launch_clean, mlp_config

WORLD = 4
STEPS = 3
RESHARDS = ("micro_batch", "forward", "step")
SYNCS = ("last", "every")
SGD = OptimConfig(name="sgd", lr=0.5, momentum=0.9, weight_decay=0.0, warmup_steps=0, schedule="constant",
                  grad_clip=None)


def _gpt(micro: int, glob: int = GLOBAL, n_layer: int = 2):
    cfg = gpt_config(micro)
    cfg.model = {**cfg.model, "n_layer": n_layer}
    cfg.optim = dataclasses.replace(SGD)
    cfg.batch = BatchConfig(micro_batch_size=micro, global_batch_size=glob)
    return cfg


def _mesh(cfg, shard_size="hsdp", reshard: str = "micro_batch", accum_sync: str = "last", prefetch: int = 1):
    """fsdp with a shard group of 2 (hsdp 2 x 2 on 4 ranks), of all ranks (None), or ddp."""
    if shard_size == "ddp":
        return cfg
    cfg.dist = dataclasses.replace(cfg.dist, strategy="fsdp")
    cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, shard_size=2 if shard_size == "hsdp" else shard_size,
                                        reshard=reshard, accum_sync=accum_sync, prefetch=prefetch)
    return cfg


def _hf(micro: int, glob: int):
    from test_hf_models import GPT2, causal_model

    cfg = _gpt(micro, glob)
    cfg.model = causal_model("gpt2", GPT2)
    return cfg


def _grid_jobs() -> list:
    """(name, cfg, steps) for the plan grid: 2 steps each, so that step 1 and a later full step are both seen."""
    jobs = []
    for k in (1, 3, 8):
        micro = 2 if k < 8 else 1
        glob = WORLD * micro * k
        jobs.append((f"plan/ddp/{k}", _gpt(micro, glob), 2))
        for kind in ("fsdp", "hsdp"):
            for reshard in RESHARDS:
                for sync in SYNCS:
                    cfg = _mesh(_gpt(micro, glob), None if kind == "fsdp" else "hsdp", reshard, sync)
                    jobs.append((f"plan/{kind}/{reshard}/{sync}/{k}", cfg, 2))
    jobs.append(("plan/hf/hsdp/step", _mesh(_hf(2, WORLD * 2 * 3), "hsdp", "step", "every"), 2))
    jobs.append(("hf", _mesh(_hf(2, GLOBAL), "hsdp", "step", "every"), STEPS))  # split invariance, below
    jobs.append(("plan/hf/fsdp/forward", _mesh(_hf(2, WORLD * 2 * 3), None, "forward", "last"), 2))
    return jobs


def _jobs() -> list:
    jobs = []
    for reshard in RESHARDS:
        for sync in SYNCS:
            jobs.append((f"split/{reshard}/{sync}", _mesh(_gpt(2), "hsdp", reshard, sync), STEPS))  # K = 4
    jobs.append(("split/step/last/k1", _mesh(_gpt(8), "hsdp", "step", "last"), STEPS))  # K = 1
    jobs.append(("stale", _mesh(_gpt(2), "hsdp", "step", "last"), STEPS))  # the same, with the gathered copy kept
    for prefetch in (0, 2):
        jobs.append((f"prefetch/{prefetch}", _mesh(_gpt(2, n_layer=3), "hsdp", "micro_batch", "last", prefetch), 2))
    jobs.append(("prefetch/1", _mesh(_gpt(2, n_layer=3), "hsdp", "micro_batch", "last", 1), 2))
    for reshard in ("micro_batch", "step"):  # 4 blocks: more than micro_batch's root + 2 blocks gathered at once
        jobs.append((f"peak/{reshard}", _mesh(_gpt(2, n_layer=4), "hsdp", reshard, "last"), 1))
    clip = _mesh(_gpt(2), "hsdp", "forward", "last")
    clip.optim.grad_clip = 0.05  # below the gradients' norm: clipping acts on every step
    jobs.append(("clip", clip, STEPS))
    # 73 samples: step 3 holds 9, so ranks get a short micro-batch and placeholders
    jobs.append(("end", _mesh(mlp_config(2, n=73), "hsdp", "step", "every"), STEPS))
    ac = _mesh(_gpt(2), "hsdp", "micro_batch", "last")
    ac.dist.activation_checkpointing = True
    jobs.append(("ac", ac, STEPS))
    master = _mesh(_gpt(2), "hsdp", "step", "last")
    master.precision.name = "bf16-master"
    jobs.append(("master", master, 1))
    mixed = _mesh(_gpt(2), "hsdp", "forward", "every")
    mixed.precision.name = "bf16-mixed"  # autocast over FP32 shards
    jobs.append(("mixed", mixed, 1))
    from test_fsdp import InfMLP  # noqa: F401  (importable by name in the ranks)
    from test_fsdp import overflow_config

    overflow = _mesh(overflow_config(), "hsdp", "step", "last")
    overflow.precision.name = "fp16-master"
    overflow.model = {**overflow.model, "inf_rank": 3, "inf_call": 3}  # K = 2: rank 3's first backward of step 2
    jobs.append(("overflow", overflow, STEPS))
    return jobs


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _named(module, grads: bool) -> dict:
    return {name: None if (p.grad if grads else p) is None else _full((p.grad if grads else p).detach()).clone()
            for name, p in module.named_parameters()}


def _keep_gathered(strategy) -> None:
    """Break the strategy on purpose: units stay gathered after the last backward (the stale case)."""
    from contextlib import contextmanager

    @contextmanager
    def micro_batch(last):
        strategy.root.set_requires_gradient_sync(last)
        strategy.root.set_reshard_after_backward(False)
        yield

    strategy.micro_batch = micro_batch


def _run_job(env, name: str, cfg, steps: int) -> dict:
    parts = build(cfg, validate(cfg, env.world_size), env)
    trainer = parts.trainer
    if name == "stale":
        _keep_gathered(trainer.strategy)
    rec = {"outcomes": [], "grads": [], "params": [], "local_finite": []}
    reduce_window = trainer._reduce_window

    def spy(*args, **kwargs):  # this rank's own shards before the skip decision
        rec["local_finite"].append(all(bool(torch.isfinite(g).all()) for _, g in trainer.weights.grads()))
        return reduce_window(*args, **kwargs)

    trainer._reduce_window = spy
    batches = enumerate(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False), 1)
    if name.startswith("from-last/"):  # the epoch's last step first, as a run resumed just before it starts
        batches = list(batches)[-1:]
    for (step, (window, micro_batches)), _ in zip(batches, range(steps)):
        outcome = trainer.train_step(micro_batches, window, step)
        rec["outcomes"].append(dataclasses.asdict(outcome))
        rec["grads"].append(_named(trainer.module, grads=True))
        rec["params"].append(_named(trainer.module, grads=False))
    rec["scale"] = trainer.precision.scaler.scale
    rec["plan_from_model"] = plan_numbers(cfg, validate(cfg, env.world_size), trainer.module)
    return rec


def _worker(rank: int, world_size: int, jobs: list) -> dict:
    env = distributed.init("cpu")
    results = {}
    for name, cfg, steps in jobs:
        try:
            results[name] = _run_job(env, name, cfg, steps)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        gc.collect()
    return results


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return launch_clean(_worker, WORLD, tmp_path_factory.mktemp("hsdp4"), _jobs())


@pytest.fixture(scope="module")
def grid4(tmp_path_factory):
    return launch_clean(_worker, WORLD, tmp_path_factory.mktemp("grid4"), _grid_jobs())


def _ref_jobs() -> list:
    clip = _gpt(GLOBAL)
    clip.optim.grad_clip = 0.05
    return [("ref", _gpt(GLOBAL), STEPS), ("clip", clip, STEPS), ("end", mlp_config(32, n=73), STEPS)]


@pytest.fixture(scope="module")
def refs():
    """One process, one big batch of 32 (K = 1)."""
    return in_one_process(_worker, _ref_jobs())


@pytest.fixture(scope="module")
def ref(refs):
    return _job([refs], "ref")


def _job(world4, name: str, rank: int = 0) -> dict:
    rec = world4[rank][name]
    if "error" in rec:
        pytest.fail(f"job {name} raised:\n{rec['error']}")
    return rec


def _assert_same_run(got: dict, want: dict, what: str) -> None:
    for step in range(len(want["grads"])):
        assert got["outcomes"][step]["loss"] == pytest.approx(want["outcomes"][step]["loss"], rel=1e-5), what
        _assert_close(got["grads"][step], want["grads"][step], f"{what} grads step {step + 1}")
        _assert_close(got["params"][step], want["params"][step], f"{what} params step {step + 1}")


# ----------------------------------------------------------------------------- split invariance

@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("reshard", RESHARDS)
def test_hsdp_2x2_equals_one_big_batch(world4, ref, reshard, sync):
    runs = [_job(world4, f"split/{reshard}/{sync}", r) for r in range(WORLD)]
    _assert_same_run(runs[0], ref, f"hsdp 2x2 reshard={reshard} accum_sync={sync}")
    for run in runs[1:]:  # one sharded tensor, gathered alike on every rank of both replicas
        for name, value in run["params"][-1].items():
            assert torch.equal(value, runs[0]["params"][-1][name]), name
    # the run moved the weights: a comparison of untrained weights would prove nothing
    moved = max((ref["params"][-1][n] - ref["params"][0][n]).abs().max().item() for n in ref["params"][0])
    assert moved > 1e-3


@pytest.mark.parametrize("name", ["clip", "end"])
def test_hsdp_clipping_and_the_end_of_the_data_equal_one_process(world4, refs, name):
    run, want = _job(world4, name), _job([refs], name)
    _assert_same_run(run, want, f"hsdp {name}")
    if name == "clip":  # clipping acted, by the same global norm on every rank
        for step, outcome in enumerate(run["outcomes"]):
            assert outcome["grad_norm"] > 0.1
            assert outcome["grad_norm"] == pytest.approx(want["outcomes"][step]["grad_norm"], rel=1e-5)
            assert {_job(world4, name, r)["outcomes"][step]["grad_norm"] for r in range(WORLD)} == {outcome["grad_norm"]}
    if name == "end":  # the last step's 9 samples: every item counted once
        assert run["outcomes"][2]["samples"] == run["outcomes"][2]["items"] == 9


def test_hsdp_activation_checkpointing_gives_the_same_gradients(world4):
    on, off = _job(world4, "ac"), _job(world4, "split/micro_batch/last")
    for step in range(STEPS):
        assert_all_close_scaled(on["grads"][step], off["grads"][step], f"hsdp checkpointed step {step + 1}",
                                SAME_OPS_TOL)


@pytest.mark.parametrize("name", ["master", "mixed"])
def test_hsdp_bf16_modes_within_the_tolerance_of_ddp(world4, ref, name):
    """The gradient the optimizer gets against fp32's one big batch (test_fsdp's bound for bf16-master)."""
    run = _job(world4, name)
    assert not run["outcomes"][0]["skipped"]
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    got, want = flat(run["grads"][0]), flat(ref["grads"][0])
    assert ((got - want).norm() / want.norm()).item() < 3e-2


@pytest.mark.slow
def test_hsdp_hugging_face_model_equals_one_process(grid4):
    want = _job([in_one_process(_worker, [("hf", _hf(GLOBAL, GLOBAL), STEPS)])], "hf")
    _assert_same_run(_job(grid4, "hf"), want, "hsdp gpt2 (transformers)")


def test_reshard_step_gathers_each_unit_once_per_step_whatever_k(world4):
    units = 3  # the GPT's 2 blocks, then the root
    for name in ("split/step/last", "split/step/every", "split/step/last/k1"):
        for outcome in _job(world4, name)["outcomes"]:
            assert outcome["comm"]["all_gathers"] == units, (name, outcome["comm"])
    for outcome in _job(world4, "split/micro_batch/last")["outcomes"]:  # K = 4: 2K per unit
        assert outcome["comm"]["all_gathers"] == 2 * 4 * units


def test_reshard_step_weights_equal_micro_batch_after_3_steps(world4):
    step, micro = _job(world4, "split/step/last"), _job(world4, "split/micro_batch/last")
    assert_all_close_scaled(step["params"][-1], micro["params"][-1], "reshard step vs micro_batch", SAME_OPS_TOL)


def test_the_next_step_uses_the_updated_weights(world4, ref):
    """Kept gathered past the step, the units would run step 2 on step 1's weights: caught."""
    fresh, stale = _job(world4, "split/step/last"), _job(world4, "stale")
    assert stale["outcomes"][1]["comm"]["all_gathers"] == 0  # the broken strategy gathered nothing anew
    assert fresh["outcomes"][1]["comm"]["all_gathers"] == 3
    _assert_same_run(fresh, ref, "reshard=step")
    with pytest.raises(AssertionError):
        _assert_same_run(stale, ref, "reshard=step, gathered copy kept")
    assert stale["outcomes"][1]["loss"] != pytest.approx(ref["outcomes"][1]["loss"], rel=1e-5)


def test_prefetch_changes_no_number(world4):
    base = _job(world4, "prefetch/1")
    for prefetch in (0, 2):
        other = _job(world4, f"prefetch/{prefetch}")
        for step in range(2):
            assert other["outcomes"][step]["loss"] == base["outcomes"][step]["loss"]
            for name, value in base["grads"][step].items():
                assert torch.equal(other["grads"][step][name], value), (prefetch, name)
            assert other["outcomes"][step]["comm"] == base["outcomes"][step]["comm"]


def test_hsdp_fp16_master_overflow_on_one_rank_skips_on_every_rank(world4):
    runs = [_job(world4, "overflow", r) for r in range(WORLD)]
    for run in runs:
        assert [o["skipped"] for o in run["outcomes"]] == [False, True, False]
        assert run["outcomes"][1]["skip_reason"] == "nonfinite"
        assert run["outcomes"][2]["lr"] == run["outcomes"][1]["lr"]  # the schedule held
        assert run["scale"] < runs[0]["outcomes"][0]["loss_scale"]  # backed off
    # rank 3's inf (row 0 of the first weight) is reduce-scattered into the shard of its group's
    # first rank (rank 2), which the replica all-reduce shares with rank 0; ranks 1 and 3 stay finite
    assert [run["local_finite"][1] for run in runs] == [False, True, False, True]
    assert all(torch.equal(runs[0]["params"][1][n], v) for n, v in runs[0]["params"][0].items())  # nothing moved


# ----------------------------------------------------------------------------- the communication plan

GRID = [name for name, _, _ in _grid_jobs() if name.startswith("plan/")]


@pytest.mark.slow
@pytest.mark.parametrize("name", GRID)
def test_every_step_matches_the_plan_exactly(grid4, name):
    cfg = next(cfg for job, cfg, _ in _grid_jobs() if job == name)
    numbers = plan_numbers(cfg, validate(cfg, WORLD))
    for rank in range(WORLD):
        outcomes = _job(grid4, name, rank)["outcomes"]
        assert outcomes[0]["comm"] == numbers["first_step"], (name, rank, outcomes[0]["comm"])
        assert outcomes[1]["comm"] == numbers["step"], (name, rank, outcomes[1]["comm"])
    if "/hsdp/" in name:
        assert numbers["step"]["allreduces"] > 0 and numbers["mesh"] == {"kind": "hsdp", "replicate": 2, "shard": 2, "tp": 1, "pp": 1}


@pytest.mark.slow
def test_hsdp_all_reduces_half_of_ddps_bytes_across_replicas(grid4):
    """Per step, hsdp 2 x 2 all-reduces one shard (half the gradient) across 2 replicas; ddp the whole. On a CPU
    the GPT's head, tied to its embedding, has its part of the gradient reduced on its own
    (parallel/tied_head.py): one reduce-scatter of the weight and one all-reduce of its shard more, set apart."""
    from dist_trainer.parallel.dp_plan import shard_elements
    from dist_trainer.plan import meta_model
    from dist_trainer.precision import Precision

    cfg = _mesh(_gpt(2, WORLD * 2 * 3), "hsdp")
    head = meta_model(cfg, Precision(cfg.precision, torch.device("cpu"))).head.weight
    tied = shard_elements(head, 2) * 4  # FP32 bytes of one rank's shard
    hsdp = _job(grid4, "plan/hsdp/micro_batch/last/3")["outcomes"][1]["comm"]
    ddp = _job(grid4, "plan/ddp/3")["outcomes"][1]["comm"]
    assert hsdp["allreduce_bytes"] - tied == pytest.approx(ddp["allreduce_bytes"] / 2, rel=0.02)
    assert hsdp["reduce_scatter_bytes"] - 2 * tied == pytest.approx(ddp["allreduce_bytes"], rel=0.02)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("size, match", [(3, r"dist\.fsdp\.shard_size=3: must be null, node, or a divisor"),
                                         (0, r"dist\.fsdp\.shard_size=0"), ("half", r"dist\.fsdp\.shard_size='half'")])
def test_a_shard_size_that_does_not_divide_names_the_key(size, match):
    cfg = _mesh(_gpt(2), size)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, WORLD)


def test_node_shard_size_needs_whole_nodes():
    cfg = _mesh(_gpt(2), "node")
    assert validate(cfg, 4, local_world_size=2).mesh.describe() == "hsdp: 2 replicas x shard groups of 2 ranks"
    with pytest.raises(ConfigError, match=r"dist\.fsdp\.shard_size='node'.*whole number of nodes of 3"):
        validate(cfg, 4, local_world_size=3)


def test_shard_size_under_ddp_and_bad_reshard_name_the_key():
    cfg = _gpt(2)
    cfg.dist.fsdp.shard_size = 2
    with pytest.raises(ConfigError, match=r"dist\.fsdp\.shard_size=2.*dist\.strategy=fsdp"):
        validate(cfg, WORLD)
    cfg = _mesh(_gpt(2), None, reshard="never")
    with pytest.raises(ConfigError, match=r"dist\.fsdp\.reshard='never': choose one of"):
        validate(cfg, WORLD)


@pytest.mark.parametrize("old, new", [(True, "micro_batch"), (False, "forward")])
def test_reshard_after_forward_still_works_with_a_warning(caplog, old, new):
    cfg = _mesh(_gpt(2), None)
    cfg.dist.fsdp.reshard_after_forward = old
    validate(cfg, WORLD)
    assert cfg.dist.fsdp.reshard == new
    assert f"dist.fsdp.reshard={new}" in caplog.text and "deprecated" in caplog.text
    contradicting = _mesh(_gpt(2), None, reshard="step")
    contradicting.dist.fsdp.reshard_after_forward = True
    with pytest.raises(ConfigError, match=r"dist\.fsdp\.reshard_after_forward=True.*dist\.fsdp\.reshard=step"):
        validate(contradicting, WORLD)


# ----------------------------------------------------------------------------- memory

PEAK_JOBS = ([f"split/{reshard}/{sync}" for reshard in RESHARDS for sync in SYNCS] + ["peak/micro_batch", "peak/step"]
             + ["prefetch/0", "prefetch/1"])  # 3 blocks: 0 gathers none ahead (FSDP2 itself would gather one)


@pytest.mark.parametrize("name", PEAK_JOBS)
def test_step_peak_state_mb_is_predicted(world4, name):
    cfg = next(cfg for job, cfg, _ in _jobs() if job == name)
    numbers = plan_numbers(cfg, validate(cfg, WORLD))
    outcome = _job(world4, name)["outcomes"][-1]
    assert outcome["state_mb"] == pytest.approx(numbers["state_mb"], rel=0.05)
    extra = outcome["step_peak_state_mb"] - outcome["state_mb"]
    predicted = numbers["step_peak_state_mb"] - numbers["state_mb"]
    assert extra > 0 and extra == pytest.approx(predicted, rel=0.05), (extra, predicted)


def test_reshard_step_raises_the_step_peak(world4):
    """K = 4, 4 blocks: kept gathered through the step holds every unit, freed after each use a few."""
    step, micro = (_job(world4, f"peak/{r}")["outcomes"][-1] for r in ("step", "micro_batch"))
    assert step["state_mb"] == micro["state_mb"]
    assert step["step_peak_state_mb"] > micro["step_peak_state_mb"] * 1.1, (step, micro)



@pytest.mark.parametrize("name", [f"split/{reshard}/{sync}" for reshard in RESHARDS for sync in SYNCS])
def test_a_runs_plan_json_from_its_wrapped_model_equals_plan_mode(world4, name):
    """A run computes plan.json from its built, wrapped model (FSDP renames the blocks' classes): plan mode's numbers."""
    cfg = next(cfg for job, cfg, _ in _jobs() if job == name)
    assert _job(world4, name)["plan_from_model"] == plan_numbers(cfg, validate(cfg, WORLD))
