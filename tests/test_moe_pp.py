"""Mixture of experts under pipeline stages (dist.pp.size=2): exact against one process with one big batch.

A GPT of 2 MoE layers (n_embd 32, 4 experts, top 2, the global aux term with the z-loss) cut into 2 stages on
2 ranks (1f1b, 4 micro-batches of 8) over ``unbalanced_text``, whose valid tokens differ by 4x and more from
micro-batch to micro-batch. Each stage holds one MoE layer: the other stage's counts reach it through the
step's all-reduce, and the global term's counting pass runs every micro-batch forward through both stages
first. Per step the expert counts equal the reference's exactly; the gradients (steps 1-3), the weights after
3 AdamW steps and the aux and z values are within SCALE_TOL of their scale (``test_moe._assert_same_run``), for:

* the global term with the z-loss, also with activation checkpointing (1f1b recomputes micro-batch i's forward
  after micro-batch i + 1's: each recomputation must see its own token mask);
* the aux-loss-free bias update (sigmoid router): the biases bit-identical;
* a last step of one sequence: three placeholder micro-batches that count nowhere.

And on 4 ranks (slow): pp 2 x 2 data ranks with expert parallelism 2 (each stage's 4 experts cut over its own
2 data ranks, the all-to-alls within a stage group), 4 micro-batches of 4 a data rank, against the same one
process x 32; under hsdp-like replicas the edp reduction is tested in tests/test_moe_ep.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_trainer.config import EPConfig
from dist_trainer.validation import validate
from dist_trainer.plan import plan_numbers

from test_accumulation import in_one_process, launch_clean
from test_moe import STEPS, _assert_same_run, _rec, _short, _worker, moe_config

TIED = ("head.weight", "tok_emb.weight")  # the last stage's copy of the embedding, and its name in one process


def _wide(*args, **kw):
    """``moe_config`` at n_embd 32, with AdamW's eps at 1e-4. An Adam step moves by up to lr / eps per unit of
    gradient (at a gradient near 0): with pos_emb's fp32 summation-order rounding (5e-9, 1e-7 of its scale),
    eps 1e-6 and 1e-5 move a weight by 1.2e-5 and 1.6e-5 of the scale in 3 steps (bias case); 1e-4 by about
    2e-6. The gradients themselves are compared directly, at every step."""
    cfg = moe_config(*args, **kw, n_embd=32)
    cfg.optim = dataclasses.replace(cfg.optim, eps=1e-4)
    return cfg


def _pp(cfg, checkpointing: bool = False):
    cfg.dist = dataclasses.replace(cfg.dist, activation_checkpointing=checkpointing)
    cfg.dist.pp = dataclasses.replace(cfg.dist.pp, size=2, schedule="1f1b", stages_per_rank=1)
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(_worker, [("global/ref", _wide(32), STEPS),
                                   ("bias/ref", _wide(32, "bias"), STEPS),
                                   ("short/ref", _short(_wide(32)), STEPS + 1)])
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("moe_pp"), [
        ("global/pp2", _pp(_wide(8)), STEPS),
        ("global/pp2-ac", _pp(_wide(8), checkpointing=True), STEPS),
        ("bias/pp2", _pp(_wide(8, "bias")), STEPS),
        ("short/pp2", _pp(_short(_wide(8))), STEPS + 1)])
    return one, two


def _whole(two: list, name: str) -> dict:
    """Both stages' records as one model's: each rank's tensors under their one-process names. The last stage's
    copy of the tied embedding must equal the first stage's (their gradients were summed), then it is dropped."""
    first, last = (_rec(two[rank], name) for rank in range(2))
    whole = {"outcomes": first["outcomes"], "biases": {**first["biases"], **last["biases"]}}
    for key in ("grads", "params"):
        whole[key] = []
        for a, b in zip(first[key], last[key]):
            assert a.keys().isdisjoint(b.keys() - {TIED[0]}), f"{name}: a tensor held by both stages"
            assert torch.equal(b[TIED[0]], a[TIED[1]]), f"{name}: the tied copies' {key} differ"
            whole[key].append({**a, **{n: t for n, t in b.items() if n != TIED[0]}})
    assert first["outcomes"] == last["outcomes"] or all(
        x["moe"] == y["moe"] and x["loss"] == y["loss"] for x, y in zip(first["outcomes"], last["outcomes"]))
    return whole


@pytest.mark.parametrize("name", ["global/pp2", "global/pp2-ac", "bias/pp2", "short/pp2"])
def test_pp2_moe_equals_one_big_batch(runs, name):
    one, two = runs
    ref = _rec(one, name.split("/")[0] + "/ref")
    got = _whole(two, name)
    _assert_same_run(got, ref, name)
    assert got["biases"].keys() == ref["biases"].keys() and len(ref["biases"]) == 2 * name.startswith("bias")
    for key, value in ref["biases"].items():
        assert torch.equal(got["biases"][key], value), f"{name}: {key}"


def _assert_plan(ranks: list, cfg, name: str) -> None:
    """Each rank's steps 2 and 3 show its stage group's collectives as plan mode predicts them: the counting
    pass's sends and receives, the MoE slots of the step's all-reduce, under ep the group's all-to-alls (their
    bytes follow the routing: within plan mode's bound) and its experts' state."""
    numbers = plan_numbers(cfg, validate(cfg, len(ranks)))
    groups = numbers["pp_stage_groups"]
    for rank, results in enumerate(ranks):
        group = groups[rank * 2 // len(ranks)]
        for step in (2, 3):
            comm = dict(_rec(results, name)["outcomes"][step - 1]["comm"])
            if "all_to_all_bytes" in comm:
                assert 0 < comm.pop("all_to_all_bytes") <= numbers["ep_all_to_all_bytes_max"], (name, rank, step)
            assert comm == group["step"], (name, rank, step, comm, group["step"])
        assert _rec(results, name)["outcomes"][-1]["state_mb"] == pytest.approx(group["state_mb"], rel=0.05)


@pytest.mark.parametrize("name", ["global/pp2", "global/pp2-ac", "bias/pp2"])
def test_pp2_moe_steps_match_the_plan(runs, name):
    _, two = runs
    _assert_plan(two, _pp(_wide(8, name.split("/")[0]), checkpointing=name.endswith("-ac")), name)


def test_pp2_moe_terms_and_bias_are_there(runs):
    """The comparisons above hold something: the terms are non-zero, each stage's layer counts every valid
    token top_k times, the biases moved, and the last step's placeholders counted nothing."""
    one, two = runs
    first = _rec(two[0], "global/pp2")["outcomes"][0]
    assert first["moe"]["aux_loss"] > 0 and first["moe"]["z_loss"] > 0
    assert [sum(row) for row in first["moe"]["expert_tokens"]] == [2 * first["items"]] * 2
    assert _rec(one, "bias/ref")["biases"]["blocks.1.mlp.gate.e_score_correction_bias"].abs().max() > 0
    last = _rec(two[1], "short/pp2")["outcomes"][-1]
    assert last["samples"] == 1 and [sum(row) for row in last["moe"]["expert_tokens"]] == [2 * last["items"]] * 2


# ------------------------------------------------------------------ pp 2 x ep 2 on 4 ranks

def _ep(cfg, size: int = 2):
    cfg.dist = dataclasses.replace(cfg.dist, ep=EPConfig(size=size))
    return cfg


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    one = in_one_process(_worker, [("global/ref", _wide(32), STEPS)])
    four = launch_clean(_worker, 4, tmp_path_factory.mktemp("moe_pp_ep"), [
        ("global/pp2-ep2", _ep(_pp(_wide(4))), STEPS),
        ("global/pp2-ep2-fsdp-ac", _ep(_pp(_wide(4, strategy="fsdp"), checkpointing=True)), STEPS)])
    return one, four


@pytest.mark.slow  # 4 ranks on 2 cores
@pytest.mark.parametrize("name", ["global/pp2-ep2", "global/pp2-ep2-fsdp-ac"])
def test_pp2_ep2_equals_one_big_batch(runs4, name):
    """Ranks 0, 1 hold stage 0 (the first MoE layer), 2, 3 stage 1; the data ranks of a stage hold 2 experts
    each. Each data rank's pair of stages is one whole model; the expert slices are gathered whole."""
    one, four = runs4
    ref = _rec(one, "global/ref")
    for data_rank in range(2):
        got = _whole([four[data_rank], four[2 + data_rank]], name)
        _assert_same_run(got, ref, f"{name} data rank {data_rank}")
    cfg = _ep(_pp(_wide(4, strategy="fsdp" if "fsdp" in name else "ddp"), checkpointing=name.endswith("-ac")))
    _assert_plan(four, cfg, name)
    comm = _rec(four[0], name)["outcomes"][1]["comm"]
    # one MoE layer on this stage x 4 micro-batches: the counting pass and the forward (3 each), the backward
    # (2), and under activation checkpointing the recomputed forward (3)
    assert comm["all_to_alls"] == 4 * (3 + 3 + 2 + 3 * name.endswith("-ac"))
