"""Expert parallelism (dist.ep.size=2) in the built-in GPT's MoE layers, against one process and one big batch.

A 2-layer GPT with 4 experts, top 2, the global aux term (0.01), with and without a shared expert, on 8
sequences a step whose valid tokens differ from sequence to sequence (``test_accumulation.unbalanced_text``).
One process with one batch of 8 is the reference; 2 real ranks on gloo, each holding 2 of the 4 experts of
every layer, split the same steps 2 ranks x 2 micro-batches x 2 under ddp and fsdp (clipping active in one
case each). Per step the expert counts are equal exactly; the gradients of step 1 (every expert whole, gathered
from its slices) and the weights after 3 AdamW steps within SCALE_TOL of their scale.

The expert gradients are where expert parallelism goes wrong (pytorch#160285, Megatron-LM#5956): reduced over
the ranks holding the same experts and divided by those ranks' number instead of the data ranks', they come
out ep times too large. A run with that broken division is made here (the divisor patched) and fails the same
comparison, so the comparison is one that catches it. Each step's all-to-alls equal plan mode's prediction
(under activation checkpointing too), their bytes stay within its bound, and the global gradient norm counts
each expert once (the clipped runs equal the reference).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from dist_trainer.config import ConfigError, EPConfig
from dist_trainer.validation import validate
from dist_trainer.moe.ep import expert_params
from dist_trainer.plan import plan_numbers
from helpers import SCALE_TOL, record_steps, run_jobs, scaled_error
from helpers import job_record as _rec
from test_accumulation import _assert_close, gpt_config, in_one_process, launch_clean

STEPS, GLOBAL = 3, 8
MODEL = {"vocab_size": 256, "block_size": 24, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0,
         "bias": False}
MOE = {"num_experts": 4, "top_k": 2, "shared_experts": 0, "hidden": 32, "router": "softmax", "norm_topk": True,
       "aux_loss": {"coef": 0.01, "scope": "global"}, "z_loss": {"coef": 0.0}, "bias_update": {"rate": 0.0}}
CLIP = 0.05  # below the step-1 gradient norm of this model (asserted): clipping acts


def ep_config(micro: int, ep: int = 1, strategy: str = "ddp", shared: int = 0, clip: bool = False,
              checkpointing: bool = False):
    cfg = gpt_config(micro)
    cfg.model = {**cfg.model, **MODEL, "moe": {**MOE, "shared_experts": shared}}
    cfg.batch = dataclasses.replace(cfg.batch, global_batch_size=GLOBAL)
    # As test_moe: an expert gradient's elements near zero would be turned by AdamW's default eps into
    # lr-sized steps of their rounding.
    cfg.optim = dataclasses.replace(cfg.optim, eps=1e-6, grad_clip=CLIP if clip else None)
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=STEPS)
    return dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy=strategy, ep=EPConfig(size=ep),
                                                             activation_checkpointing=checkpointing))


def _jobs(world: int) -> list[tuple]:
    if world == 1:
        return [("shared0/ref", ep_config(GLOBAL)), ("shared1-clip/ref", ep_config(GLOBAL, shared=1, clip=True))]
    return [("shared0/ddp", ep_config(2, 2)), ("shared1-clip/ddp", ep_config(2, 2, shared=1, clip=True)),
            ("shared0/fsdp", ep_config(2, 2, "fsdp")), ("shared1-clip/fsdp", ep_config(2, 2, "fsdp", 1, True)),
            ("shared0/ddp-ac", ep_config(2, 2, checkpointing=True)),
            ("shared0/ddp-broken", ep_config(2, 2))]


def _run_job(env, world_size: int, name: str, cfg) -> dict:
    """Each step's outcome, whole gradients of step 1 and weights after the last step (experts gathered from their
    slices), plan mode's numbers and the shapes of this rank's expert slices."""
    def before(parts, plan) -> dict:
        if name.endswith("broken"):  # the bug of pytorch#160285: divided by the ranks holding the same experts
            parts.trainer.strategy.ep.data_ranks = plan.mesh.expert_data_ranks
        return {"plan": plan_numbers(cfg, plan), "expert_shapes": {
            tuple(p.to_local().shape) for p in expert_params(parts.trainer.module) if hasattr(p, "to_local")}}
    return record_steps(env, world_size, cfg, STEPS, before=before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(run_jobs, _jobs(1), _run_job)
    two = launch_clean(run_jobs, 2, tmp_path_factory.mktemp("ep2"), _jobs(2), _run_job)
    return one, two


def _errors(got: dict, ref: dict) -> tuple[float, float]:
    """(step-1 gradients, final weights): the largest error relative to each tensor's scale."""
    grads = max(scaled_error(got["grads"][0][k], ref["grads"][0][k]) for k in ref["grads"][0])
    params = max(scaled_error(got["params"][-1][k], ref["params"][-1][k]) for k in ref["params"][-1])
    return grads, params


@pytest.mark.parametrize("name", ["shared0/ddp", "shared1-clip/ddp", "shared0/fsdp", "shared1-clip/fsdp",
                                  "shared0/ddp-ac"])
def test_expert_parallel_split_equals_one_big_batch(runs, name):
    one, two = runs
    ref = _rec(one, name.split("/")[0] + "/ref")
    for rank in range(2):
        got = _rec(two[rank], name)
        assert got["expert_shapes"] == {(2, 2 * 32, 32), (2, 32, 32)}, "each rank holds 2 of the 4 experts"
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert a["moe"]["expert_tokens"] == b["moe"]["expert_tokens"], f"{name}: expert counts, step {step}"
            assert a["items"] == b["items"] and not a["skipped"], f"{name}: step {step}"
            assert a["loss"] == pytest.approx(b["loss"], rel=SCALE_TOL), f"{name}: loss at step {step}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=SCALE_TOL), f"{name}: norm at step {step}"
        _assert_close(got["grads"][0], ref["grads"][0], f"ep2 {name} rank {rank} grads step 1")
        _assert_close(got["params"][-1], ref["params"][-1], f"ep2 {name} rank {rank} params step {STEPS}")


def test_clipping_acts_in_the_clipped_cases(runs):
    one, _ = runs
    assert _rec(one, "shared1-clip/ref")["outcomes"][0]["grad_norm"] > 2 * CLIP


def test_expert_gradients_divided_by_the_edp_ranks_fail_the_comparison(runs):
    """The bug of pytorch#160285 (expert gradients ep times too large) moves the gradients far past SCALE_TOL."""
    one, two = runs
    ref, broken = _rec(one, "shared0/ref"), _rec(two[0], "shared0/ddp-broken")
    grads, params = _errors(broken, ref)
    expert = "blocks.0.mlp.experts.gate_up_proj"
    assert scaled_error(broken["grads"][0][expert], 2 * ref["grads"][0][expert]) < 1e-5  # ep = 2 times too large
    assert grads > 0.5 and params > 1e3 * SCALE_TOL


@pytest.mark.parametrize("name", ["shared0/ddp", "shared1-clip/fsdp", "shared0/ddp-ac"])
def test_all_to_alls_equal_the_plan(runs, name):
    _, two = runs
    for rank in range(2):
        got = _rec(two[rank], name)
        numbers = got["plan"]
        assert numbers["mesh"]["ep"] == 2 and numbers["comm_dims"]["all_to_alls"] == "ep"
        for step, want in ((1, numbers["first_step"]), (2, numbers["step"]), (3, numbers["step"])):
            comm = dict(got["outcomes"][step - 1]["comm"])
            sent = comm.pop("all_to_all_bytes")
            assert comm == want, (name, rank, step, comm, want)
            assert 0 < sent <= numbers["ep_all_to_all_bytes_max"], (name, rank, step)
    # 2 MoE layers x 2 micro-batches: the counts' pass, the forward (3 each), the backward (2); and the
    # recomputation's forward under activation checkpointing
    ac = name.endswith("ac")
    assert _rec(two[0], name)["plan"]["step"]["all_to_alls"] == 2 * 2 * (3 + 3 + 2 + (3 if ac else 0))


def test_plan_divides_the_expert_state_by_ep():
    cfg1, cfg2 = ep_config(2), ep_config(2, 2)
    one, two = plan_numbers(cfg1, validate(cfg1, 2)), plan_numbers(cfg2, validate(cfg2, 2))
    # AdamW: parameter, gradient, two moments, FP32; the experts' half of it goes
    experts = 2 * 4 * (2 * 32 * 32 + 32 * 32) * 4 * 4
    assert (one["state_mb"] - two["state_mb"]) * 2**20 == pytest.approx(experts / 2)
    # DDP no longer all-reduces the experts' gradients (each rank's experts are its own, edp groups of one)
    assert one["step"]["allreduce_bytes"] - two["step"]["allreduce_bytes"] == 2 * (2 * 32 * 32 + 32 * 32) * 4 * 4


@pytest.mark.parametrize("world,ep,model,match", [
    (2, 3, {}, "must divide the 2 data-parallel ranks"),
    (6, 3, {}, "must divide model.moe.num_experts=4"),
    (2, 2, {"moe": {**MOE, "num_experts": 0}}, "needs a model with MoE layers"),
])
def test_impossible_ep_names_the_key(world, ep, model, match):
    cfg = ep_config(1, ep)
    cfg.model = {**cfg.model, **model}
    cfg.batch = dataclasses.replace(cfg.batch, global_batch_size=6 if world == 6 else GLOBAL)
    with pytest.raises(ConfigError, match=f"dist.ep.size={ep}: .*{match}"):
        validate(cfg, world)


def test_mesh_says_what_each_rank_counts():
    cfg = ep_config(1, 2)
    cfg.batch = dataclasses.replace(cfg.batch, global_batch_size=8)
    mesh = validate(cfg, 4).mesh
    assert (mesh.ep, mesh.expert_data_ranks, mesh.data_ranks, mesh.world_size) == (2, 2, 4, 4)
    assert [mesh.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [mesh.counts_experts(r) for r in range(4)] == [True, True, False, False]
    assert "expert-parallel groups of 2 data ranks" in mesh.describe()


# ------------------------------------------------------------------ checkpoints across ep degrees (real launches)

E2E = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "trainer.eval_every=0",
       "trainer.eval_batches=1", "trainer.log_every=1", "trainer.device=cpu", "+model.bias=false",
       "model.moe.num_experts=4", "model.moe.hidden=32", "batch.global_batch_size=8", "batch.micro_batch_size=2",
       "optim.warmup_steps=8", "optim.schedule=constant", "optim.eps=1e-6", "trainer.ckpt_every=2",
       "trainer.max_steps=4"]  # a constant lr after warmup: a resumed run follows the uninterrupted one's


def _cut_at_step_2(src, dst):
    """A copy of a finished 4-step run as it was after step 2: its step-2 checkpoint the newest."""
    from test_checkpoint import ckpt, copy_run

    copy_run(src, dst)
    shutil.rmtree(ckpt(dst, 4))
    (dst / "final_model.pt").unlink()
    lines = (dst / "metrics.jsonl").read_text().splitlines()[:2]
    (dst / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return dst


@pytest.mark.slow  # four 2-rank launches, a 4-rank one and two one-process ones, about 90 s on 2 cores
def test_checkpoint_resumes_across_ep_degrees(tmp_path):
    """An ep 2 checkpoint holds every expert whole under its one-process name: it resumes on one process
    (ep 1) and under fsdp with ep 2; a ddp checkpoint without ep resumes with ep 2; an fsdp checkpoint of 4 ranks
    with ep 2 (each expert slice sharded over 2 edp ranks) resumes on one process; each ends within 1e-5 of the
    uninterrupted ep 2 run."""
    from test_checkpoint import ckpt, final_params, metrics, resumed_from, run_all

    ep2, ep1 = E2E + ["dist.ep.size=2"], E2E
    fsdp4 = [a if a != "batch.micro_batch_size=2" else "batch.micro_batch_size=1" for a in ep2] + ["dist.strategy=fsdp"]
    first = run_all([(ep2 + [f"hydra.run.dir={tmp_path / 'ref'}"], 2),
                     (ep1 + [f"hydra.run.dir={tmp_path / 'ep1'}"], 2),
                     (fsdp4 + [f"hydra.run.dir={tmp_path / 'fsdp4'}"], 4)], tmp_path, timeout=360)
    for result in first:
        assert result.returncode == 0, result.output[-4000:]
    ref = final_params(tmp_path / "ref")
    assert ref["blocks.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)  # whole, as one process names it
    assert metrics(tmp_path / "ref")[1]["all_to_alls"] == 2 * 2 * (3 + 3 + 2)  # 2 layers x 2 micro-batches
    _assert_close(final_params(tmp_path / "fsdp4"), ref, "4 ranks, fsdp, ep 2: final parameters")
    resumes = {"to1": (ep1, 0, "ref"), "tofsdp": (ep2 + ["dist.strategy=fsdp"], 2, "ref"), "toep2": (ep2, 2, "ep1"),
               "fsdp4to1": (ep1, 0, "fsdp4")}
    dirs = {name: _cut_at_step_2(tmp_path / src, tmp_path / name) for name, (_, _, src) in resumes.items()}
    results = run_all([(args + [f"hydra.run.dir={dirs[name]}"], nproc) for name, (args, nproc, _) in
                       resumes.items()], tmp_path, timeout=240)
    for result, (name, run_dir) in zip(results, dirs.items()):
        assert result.returncode == 0, result.output[-4000:]
        assert resumed_from(result.output) == str(ckpt(run_dir, 2)), result.output[-4000:]
        assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
        _assert_close(final_params(run_dir), ref, f"resumed {name}: final parameters")


# ------------------------------------------------------------------ ep 2 x 2 expert-data-parallel ranks

@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    one = in_one_process(run_jobs, _jobs(1)[:1] + [("shared0/clip/ref", ep_config(GLOBAL, clip=True))], _run_job)
    hsdp = ep_config(1, 2, "fsdp", clip=True)  # 2 replicas x shard groups of 2; ep 2 within each replica
    hsdp.dist.fsdp = dataclasses.replace(hsdp.dist.fsdp, shard_size=2)
    jobs = [("shared0/ddp4", ep_config(2, 2)), ("shared0/fsdp4", ep_config(1, 2, "fsdp")), ("shared0/hsdp4", hsdp)]
    return one, launch_clean(run_jobs, 4, tmp_path_factory.mktemp("ep4"), jobs, _run_job)


@pytest.mark.slow  # 4 ranks on 2 cores
@pytest.mark.parametrize("name", ["shared0/ddp4", "shared0/fsdp4", "shared0/hsdp4"])
def test_four_ranks_reduce_experts_over_their_edp_group(runs4, name):
    """4 ranks x 1 micro-batch of 2 (ddp) or 4 x 2 x 1 (fsdp; hsdp: 2 replicas of shard groups of 2, clipped),
    ep 2: each expert on 2 ranks, its gradient summed over them (one all-reduce, in the plan) and divided by the
    4 data ranks: one process x 8 within SCALE_TOL."""
    one, four = runs4
    ref = _rec(one, "shared0/clip/ref" if "hsdp" in name else "shared0/ref")
    for rank in range(4):
        got = _rec(four[rank], name)
        _assert_close(got["grads"][0], ref["grads"][0], f"ep2x2 {name} rank {rank} grads step 1")
        _assert_close(got["params"][-1], ref["params"][-1], f"ep2x2 {name} rank {rank} params step {STEPS}")
        for a, b in zip(got["outcomes"], ref["outcomes"]):
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=SCALE_TOL)  # each expert counted once
        comm = dict(got["outcomes"][1]["comm"])
        comm.pop("all_to_all_bytes")
        assert comm == got["plan"]["step"]
        # ddp: each rank's slice whole, all-reduced over edp; fsdp, hsdp: cut over edp too (an FSDP unit a layer)
        edp = ("allreduces",) if "ddp" in name else ("all_gathers", "reduce_scatters")
        assert all("the experts': edp" in got["plan"]["comm_dims"][key] for key in edp)
        if "ddp" not in name:
            assert got["expert_shapes"] == {(1, 2 * 32, 32), (1, 32, 32)}, "a quarter of each layer's experts"
            assert got["outcomes"][-1]["state_mb"] == pytest.approx(got["plan"]["state_mb"], rel=0.05)
