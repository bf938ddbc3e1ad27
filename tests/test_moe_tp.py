"""Mixture of experts under tensor parallelism (dist.tp.size=2), against one process and one big batch.

A 2-layer GPT (n_embd 32) with 4 experts, top 2, one shared expert, the global aux term (0.05) and the z-loss
(1e-3), on 8 sequences a step whose valid tokens differ from sequence to sequence (``test_accumulation``'s
unbalanced text). One process with one batch of 8 is the reference. Tensor parallelism cuts the attention; each
MoE layer runs whole on both tp ranks (``tp.py``'s ``replicate``: under sequence parallelism its input gathered
from the sequence shards, its output cut back to them), so the router's and the experts' gradients are whole
on each tp rank and must not be summed over the tp group. Per step the expert counts are equal exactly (the
trainer counts the first tp rank's routing only); the gradients of steps 1-3, the weights after 3 AdamW steps
and the aux and z values within SCALE_TOL of their scale:

* tp 2 on 2 ranks, 4 x 2 micro-batches, with and without sequence parallelism;
* (slow) expert parallelism 2 x tp 2 on 4 ranks: each tp rank's all-to-alls within the ep group of its own tp
  index, clipping active (the norm counts each expert once, on one tp rank of the first ep group).
"""

from __future__ import annotations

import dataclasses

import pytest

from dist_trainer.config import EPConfig
from dist_trainer.validation import validate
from dist_trainer.plan import plan_numbers
from test_accumulation import in_one_process, launch_clean
from test_moe import _assert_same_run, _rec, _worker, moe_config

GLOBAL = 8
CLIP = 0.05  # below the step-1 gradient norm of this model (asserted): clipping acts


def tp_moe_config(micro: int, tp: int = 1, sp: bool = True, ep: int = 1, clip: bool = False):
    cfg = moe_config(micro, "global", strategy="fsdp" if ep > 1 else "ddp", n_embd=32, n_head=2)
    cfg.batch = dataclasses.replace(cfg.batch, global_batch_size=GLOBAL)
    cfg.optim = dataclasses.replace(cfg.optim, grad_clip=CLIP if clip else None)
    cfg.dist = dataclasses.replace(cfg.dist, ep=EPConfig(size=ep))
    cfg.dist.tp = dataclasses.replace(cfg.dist.tp, size=tp, sequence_parallel=sp)
    return cfg


def _jobs(world: int) -> list[tuple]:
    if world == 1:
        return [("ref", tp_moe_config(GLOBAL), 3), ("ref/clip", tp_moe_config(GLOBAL, clip=True), 3)]
    if world == 2:
        return [("tp2/sp", tp_moe_config(4, 2), 3), ("tp2/nosp", tp_moe_config(4, 2, sp=False), 3)]
    return [("ep2xtp2/sp-clip", tp_moe_config(2, 2, ep=2, clip=True), 3),
            ("ep2xtp2/nosp", tp_moe_config(2, 2, sp=False, ep=2), 3)]


@pytest.fixture(scope="module")
def one():
    return in_one_process(_worker, _jobs(1))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("moe_tp2"), _jobs(2))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return launch_clean(_worker, 4, tmp_path_factory.mktemp("moe_tp4"), _jobs(4))


@pytest.mark.parametrize("name", ["tp2/sp", "tp2/nosp"])
def test_tp_equals_one_big_batch(one, two, name):
    ref = _rec(one, "ref")
    assert ref["outcomes"][0]["moe"]["aux_loss"] > 0 and ref["outcomes"][0]["moe"]["z_loss"] > 0
    for rank in range(2):
        got = _rec(two[rank], name)
        _assert_same_run(got, ref, f"moe {name} rank {rank}")
        # The router and the experts are whole on each tp rank (not cut), and stay equal to the reference's.
        assert got["params"][-1]["blocks.0.mlp.gate.weight"].shape == (4, 32)
        # Sequence parallelism is on where asked: the row-wise layers reduce-scatter onto sequence shards.
        assert (got["outcomes"][0]["comm"]["tp_reduce_scatters"] > 0) == name.endswith("/sp")


def _assert_plan(ranks: list, name: str) -> None:
    """Steps 2 and 3 of each rank show the collectives plan mode predicts: under sequence parallelism each MoE
    layer's input gathered from the sequence shards (and its output's gradient in backward); the all-to-alls
    (their bytes within the plan's bound)."""
    cfg = {job: cfg for job, cfg, _ in _jobs(len(ranks))}[name]
    numbers = plan_numbers(cfg, validate(cfg, len(ranks)))
    for rank, results in enumerate(ranks):
        for step in (2, 3):
            comm = dict(_rec(results, name)["outcomes"][step - 1]["comm"])
            if "all_to_all_bytes" in comm:
                assert 0 < comm.pop("all_to_all_bytes") <= numbers["ep_all_to_all_bytes_max"]
            assert comm == numbers["step"], (name, rank, step, comm, numbers["step"])


@pytest.mark.parametrize("name", ["tp2/sp", "tp2/nosp"])
def test_tp_steps_match_the_plan(two, name):
    _assert_plan(two, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2xtp2/sp-clip", "ep2xtp2/nosp"])
def test_ep_by_tp_equals_one_big_batch(one, four, name):
    ref = _rec(one, "ref/clip" if name.endswith("clip") else "ref")
    if name.endswith("clip"):
        assert ref["outcomes"][0]["grad_norm"] > CLIP
    for rank in range(4):
        _assert_same_run(_rec(four[rank], name), ref, f"moe {name} rank {rank}")

    _assert_plan(four, name)
