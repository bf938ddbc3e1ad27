"""Pipeline stages (dist.pp.*) on real gloo ranks, against one process on one big batch.

One launch of 2 ranks (pp 2) runs the schedules; one of 4 (pp 2 x ddp 2, pp 2 x fsdp 2; slow, .ci/run
runs it). fp32 and SGD with momentum on test_accumulation's token-unbalanced text (micro-batches whose
token counts differ by 4x or more), so a mean of micro-batch means, or the schedule's own 1/n, fails.

* split invariance within SCALE_TOL of the scale, every step, gradients and weights: gpipe, 1f1b,
  interleaved 1f1b and zero bubble (ZBV) with 2, 4 and 8 micro-batches, clipping on; interleaved zero bubble
  with 3 stages a rank; the end of the data (a short step whose
  missing micro-batches run as placeholders); the tied embedding and head take the same update;
* the plan: each stage group's sends, receives and collectives of step 1 and of a full step equal
  plan.json's exactly; state_mb and step_peak_state_mb as predicted; metrics carry the idle time;
* fp16-master: an inf in one stage's gradients skips the step on every stage (lr held, scale backed off);
* checkpoints: pp 2 resumes bit-identically on pp 2, and within SCALE_TOL on one process, and back; a
  signal to the last stage's rank during a step stops both stages after that step, and the resume is
  bit-identical to a run never stopped;
* what is not supported is a ConfigError naming the keys.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch.utils.data import Subset

from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.models import GPT
from helpers import assert_all_close_scaled
from test_accumulation import GLOBAL, in_one_process, launch_clean, unbalanced_text
from test_checkpoint import assert_bit_identical, ckpt, final_params, metrics, run_all
from test_fsdp import _InfOnce
from test_hsdp import STEPS, _gpt, _job, _worker

LAYERS = 4  # 4 stages at most: pp 2 x 2 stages per rank


def short_text(block_size: int = 24, n: int = 73):
    """73 samples: step 3 holds 9, so the pipeline's last micro-batches are placeholders."""
    return Subset(unbalanced_text(block_size), range(n))


def _pp(cfg, size: int = 2, schedule: str = "1f1b", per_rank: int = 1, strategy: str = "ddp",
        reshard: Optional[str] = "forward"):
    """``reshard`` under fsdp: None leaves dist.fsdp.reshard unset (auto, validate's choice)."""
    cfg.dist = dataclasses.replace(cfg.dist, strategy=strategy)
    cfg.dist.pp = dataclasses.replace(cfg.dist.pp, size=size, schedule=schedule, stages_per_rank=per_rank)
    if strategy == "fsdp" and reshard is not None:
        cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, reshard=reshard)
    return cfg


def _model(micro: int, glob: int = GLOBAL):
    return _gpt(micro, glob, n_layer=LAYERS)


def _hf(model_type: str, micro: int, glob: int = GLOBAL, **config):
    """A transformers decoder of LAYERS layers: llama (its head apart), qwen2 (its head tied to the embedding)."""
    from test_hf_models import LLAMA, causal_model

    cfg = _model(micro, glob)
    cfg.model = causal_model(model_type, {**LLAMA, "num_hidden_layers": LAYERS, "vocab_size": 256, **config})
    return cfg


def _longer(cfg):
    """The model's block_size 32 over the data's 24 tokens: the stages' shape is 32, each row padded."""
    cfg.model = {**cfg.model, "block_size": 32}
    return cfg


def _clip(cfg):
    cfg.optim.grad_clip = 0.05  # below the gradients' norm: clipping acts on every step
    return cfg


def _end(micro: int):
    cfg = _model(micro)
    cfg.data = {**cfg.data, "_target_": "test_pp.short_text"}
    return cfg


class InfGPT(GPT):
    """The GPT whose last stage's final-norm weight gets an inf gradient at one backward of one rank.

    Only ``ln_f.weight``'s gradient (element 0) becomes inf: the stream's gradient sent back to the
    first stage, and so every gradient of the other stage group, stays finite.
    """

    def __init__(self, *args, inf_rank: int = 1, inf_call: int = 5, **kwargs):
        super().__init__(*args, **kwargs)
        _InfOnce.armed.update(rank=inf_rank, call=inf_call, calls=0)

    def stage_forward(self, x, blocks, first, last):
        out = super().stage_forward(x, blocks, first, last)
        if not (last and self.training):
            return out
        return out + 0 * _InfOnce.apply(self.ln_f.weight.view(1, -1)).sum()  # inf in column 0: element 0


def _overflow():
    cfg = _pp(_model(8))  # 1 data rank x micro 8 x accum 4: rank 1's backward 5 is step 2's first
    cfg.model = {**cfg.model, "_target_": "test_pp.InfGPT", "inf_rank": 1, "inf_call": 5}
    cfg.precision.name = "fp16-master"
    cfg.precision.loss_scale.init_scale = 1024.0
    return cfg


SCHEDULES = [("gpipe", 1, 2), ("gpipe", 1, 8), ("1f1b", 1, 2), ("1f1b", 1, 4), ("1f1b", 1, 8),
             ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 2, 4), ("interleaved_1f1b", 2, 8),
             ("zero_bubble", 2, 2), ("zero_bubble", 2, 4), ("zero_bubble", 2, 8)]  # zero_bubble x 2: ZBV


def _six(micro: int):
    """6 blocks: pp 2 x 3 stages a rank, the interleaved zero-bubble schedule."""
    return _gpt(micro, GLOBAL, n_layer=6)


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
    jobs += [("plan/bf16-mixed", mixed, 2), ("plan/bf16-master", master, 2), ("plan/ac", ac, 2),
             ("overflow", _overflow(), STEPS), ("from-last/end", _pp(_end(8)), 1),
             ("llama", _clip(_pp(_hf("llama", 8))), STEPS),
             ("qwen2", _pp(_hf("qwen2", 8, tie_word_embeddings=True), schedule="interleaved_1f1b", per_rank=2), STEPS),
             ("plan/llama", _pp(_hf("llama", 8)), 2), ("llama/padded", _pp(_longer(_hf("llama", 8))), STEPS),
             ("zero_bubble/qwen2", _pp(_hf("qwen2", 8, tie_word_embeddings=True), schedule="zero_bubble",
                                       per_rank=2), STEPS),
             ("zero_bubble/v3/k4", _clip(_pp(_six(8), schedule="zero_bubble", per_rank=3)), STEPS)]
    zb_ac, zb_master = (_pp(_model(8), schedule="zero_bubble", per_rank=2) for _ in range(2))
    zb_ac.dist.activation_checkpointing = True
    zb_master.precision.name = "bf16-master"  # a weight pass's BF16 gradients beside FSDP's FP32 accumulation
    jobs += [("zero_bubble/ac", zb_ac, STEPS), ("zero_bubble/bf16-master", zb_master, 2)]
    # fsdp stages with dist.fsdp.reshard left unset: auto, which validate makes forward here
    jobs.append(("fsdp/default/k4", _clip(_pp(_model(8), strategy="fsdp", reshard=None)), STEPS))
    return jobs


def _tp(cfg, sp: bool = True):
    cfg.dist.tp = dataclasses.replace(cfg.dist.tp, size=2, sequence_parallel=sp)
    return cfg


def _jobs4() -> list:
    return [("ddp/k4", _clip(_pp(_model(4))), STEPS), ("fsdp/k4", _clip(_pp(_model(4), strategy="fsdp")), STEPS),
            ("fsdp/default/k4", _clip(_pp(_model(4), strategy="fsdp", reshard=None)), STEPS),  # reshard unset
            ("fsdp/interleaved/k4", _pp(_model(4), schedule="interleaved_1f1b", per_rank=2, strategy="fsdp"), STEPS),
            ("fsdp/zero_bubble/k4", _clip(_pp(_model(4), schedule="zero_bubble", per_rank=2, strategy="fsdp")), STEPS),
            ("tp/k4", _clip(_tp(_pp(_model(8)))), STEPS), ("tp/nosp/k4", _clip(_tp(_pp(_model(8)), sp=False)), STEPS),
            ("tp/llama", _clip(_tp(_pp(_hf("llama", 8)), sp=False)), STEPS),
            ("tp/llama/padded", _tp(_pp(_longer(_hf("llama", 8))), sp=False), STEPS)]


def _jobs8() -> list:
    return [("fsdp/tp/k4", _clip(_tp(_pp(_model(4), strategy="fsdp"))), STEPS)]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("pp2"), _jobs2())


@pytest.fixture(scope="module")
def pp4(tmp_path_factory):
    return launch_clean(_worker, 4, tmp_path_factory.mktemp("pp4"), _jobs4())


@pytest.fixture(scope="module")
def pp8(tmp_path_factory):
    return launch_clean(_worker, 8, tmp_path_factory.mktemp("pp8"), _jobs8())


@pytest.fixture(scope="module")
def refs():
    """One process, one big batch of 32 (K = 1)."""
    return in_one_process(_worker, [("ref", _model(GLOBAL), STEPS), ("clip", _clip(_model(GLOBAL)), STEPS),
                                    ("end", _end(GLOBAL), STEPS), ("from-last/end", _end(GLOBAL), 1),
                                    ("llama", _clip(_hf("llama", GLOBAL)), STEPS),
                                    ("qwen2", _hf("qwen2", GLOBAL, tie_word_embeddings=True), STEPS),
                                    ("llama/padded", _longer(_hf("llama", GLOBAL)), STEPS),
                                    ("clip6", _clip(_six(GLOBAL)), STEPS)])


TIED = {"head.weight": "tok_emb.weight", "model.lm_head.weight": "model.model.embed_tokens.weight"}


def _whole(name: str, want: dict) -> str:
    """The name one process gives a stage's tensor: a tied head is its embedding there."""
    return TIED.get(name, name) if name not in want else name


def _assert_stage_run(got: dict, want: dict, what: str) -> None:
    """This rank's parameters (its stages') equal one process's, step by step; the loss too."""
    for step in range(len(want["grads"])):
        assert got["outcomes"][step]["loss"] == pytest.approx(want["outcomes"][step]["loss"], rel=1e-5), what
        for key in ("grads", "params"):
            mine = got[key][step]
            theirs = {n: want[key][step][_whole(n, want[key][step])] for n in mine}
            floor_of = {**want[key][step], **theirs}  # the floor is the whole model's largest tensor
            assert_all_close_scaled({**floor_of, **mine}, floor_of, f"{what} {key} step {step + 1}")


@pytest.mark.parametrize("schedule, per_rank, k", SCHEDULES)
def test_pp2_schedules_equal_one_big_batch(pp2, refs, schedule, per_rank, k):
    for rank in range(2):
        _assert_stage_run(_job(pp2, f"{schedule}/v{per_rank}/k{k}", rank), refs["clip"],
                          f"pp 2 {schedule} x{per_rank} K={k} rank {rank}")


def test_pp2_interleaved_zero_bubble_and_zbv_with_checkpointing_equal_one_big_batch(pp2, refs):
    for rank in range(2):
        run = _job(pp2, "zero_bubble/v3/k4", rank)
        _assert_stage_run(run, refs["clip6"], f"pp 2 zero_bubble x3 rank {rank}")
        _assert_plan(run, rank, 1)
        _assert_stage_run(_job(pp2, "zero_bubble/ac", rank), refs["ref"], f"pp 2 ZBV, activation checkpointing, "
                          f"rank {rank}")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "llama/padded", "zero_bubble/qwen2"])
def test_pp2_transformers_decoders_equal_one_big_batch(pp2, refs, model_type):
    # zero_bubble/qwen2: ZBV places the first and the last stage (the tied embedding and head) on rank 0
    last = 0 if model_type.startswith("zero_bubble") else 1
    names = [set(_job(pp2, model_type, r)["params"][0]) for r in range(2)]
    assert "model.model.embed_tokens.weight" in names[0] and "model.model.norm.weight" in names[last]
    assert "model.lm_head.weight" in names[last]
    for rank in range(2):
        _assert_stage_run(_job(pp2, model_type, rank), refs[model_type.removeprefix("zero_bubble/")],
                          f"pp 2 {model_type} rank {rank}")


def test_pp2_short_last_step_runs_placeholders(pp2, refs):
    for rank in range(2):
        run = _job(pp2, "end", rank)
        assert run["outcomes"][-1]["samples"] == 9
        _assert_stage_run(run, refs["end"], f"pp 2 end of data rank {rank}")


def test_pp2_a_first_step_that_is_short_builds_full_stages(pp2, refs):
    # A run resumed just before the epoch's short last step starts with it: the stages take the plan's shape
    # (4 micro-batches of 8), not the short step's (one of 8 and one of 1), and the step equals one process's.
    for rank in range(2):
        run = _job(pp2, "from-last/end", rank)
        assert run["outcomes"][0]["samples"] == 9
        _assert_stage_run(run, refs["from-last/end"], f"pp 2, the short step first, rank {rank}")


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
    v = [set(_job(pp2, "zero_bubble/v2/k4", r)["params"][0]) for r in range(2)]  # ZBV: stages 0, 3 and 1, 2
    assert {"tok_emb.weight", "blocks.0.ln_1.weight", "blocks.3.ln_1.weight", "head.weight"} <= v[0]
    assert {"blocks.1.ln_1.weight", "blocks.2.ln_1.weight"} <= v[1] and not v[0] & v[1]
    zb = _job(pp2, "zero_bubble/v2/k4", 0)["params"][-1]
    assert torch.equal(zb["tok_emb.weight"], zb["head.weight"])  # the tie, summed on the one rank


def _assert_plan(run: dict, rank: int, groups: int) -> None:
    plan = run["plan_from_model"]
    group = plan["pp_stage_groups"][rank // groups]
    first, full = run["outcomes"][0], run["outcomes"][1]
    assert first["comm"] == group["first_step"], f"rank {rank} step 1"
    assert full["comm"] == group["step"], f"rank {rank} full step"
    assert first["state_mb"] == pytest.approx(plan["state_mb"], rel=1e-9)
    assert first["step_peak_state_mb"] == pytest.approx(plan["step_peak_state_mb"], rel=1e-9)
    assert full["comm"]["p2p_sends"] > 0 and full["comm"]["p2p_recv_bytes"] > 0
    # the micro-batches whose activations the rank's stages held at once, counted in torch's stage caches
    assert [o["pp_inflight"][rank] for o in run["outcomes"]] == [group["inflight"]] * len(run["outcomes"])
    assert len(full["pp_idle_times"]) == run["plan_from_model"]["world_size"]


def test_pp2_by_fsdp_with_reshard_left_unset_equals_one_big_batch(pp2, refs):
    """dist.strategy=fsdp dist.pp.size=2 and nothing more: the default dist.fsdp.reshard (auto) trains (forward)."""
    for rank in range(2):
        run = _job(pp2, "fsdp/default/k4", rank)
        _assert_stage_run(run, refs["clip"], f"pp 2 x fsdp, reshard unset, rank {rank}")
        _assert_plan(run, rank, 1)
        assert run["plan_from_model"]["dist.fsdp.reshard"] == "forward"
        assert run["plan_from_model"]["mesh"]["kind"] == "fsdp"


def test_pp2_fp16_overflow_on_one_stage_skips_on_every_stage(pp2):
    runs = [_job(pp2, "overflow", r) for r in range(2)]
    for run in runs:
        assert [o["skipped"] for o in run["outcomes"]] == [False, True, False]
        assert run["outcomes"][2]["lr"] == run["outcomes"][1]["lr"]  # the schedule held
        assert run["scale"] < run["outcomes"][0]["loss_scale"]  # backed off
        for name, value in run["params"][0].items():
            assert torch.equal(run["params"][1][name], value), name  # nothing moved at the skipped step
        assert any(not torch.equal(run["params"][2][n], v) for n, v in run["params"][1].items())  # the next moved
    # the inf is in the last stage's gradients alone: the first stage's stay finite, and it skips too
    assert [run["local_finite"][1] for run in runs] == [True, False]


@pytest.mark.parametrize("job", ["1f1b/v1/k4", "gpipe/v1/k8", "interleaved_1f1b/v2/k8", "plan/bf16-mixed",
                                 "plan/bf16-master", "plan/ac", "plan/llama", "qwen2", "zero_bubble/v2/k2",
                                 "zero_bubble/v2/k8", "zero_bubble/qwen2", "zero_bubble/ac",
                                 "zero_bubble/bf16-master"])
def test_pp2_collectives_equal_the_plan(pp2, job):
    for rank in range(2):
        _assert_plan(_job(pp2, job, rank), rank, 1)


def test_pp2_bubble_is_predicted():
    from dist_trainer.parallel.pp import pp_bubble, pp_inflight, simulated_idle

    assert pp_bubble("1f1b", 2, 1, 4) == pytest.approx(1 / 5)
    assert pp_bubble("gpipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert pp_bubble("interleaved_1f1b", 2, 2, 4) == pytest.approx(1 / 9)
    # The simulation of torch's orders (unit forward, backward to the input and to the weights) gives the
    # interleaved formula for torch's interleaved 1f1b order, and for its zero-bubble orders a fraction of it.
    for pp, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16)]:
        assert simulated_idle("interleaved_1f1b", pp, v, m) == pytest.approx([pp_bubble("interleaved_1f1b", pp, v,
                                                                                         m)] * pp)
    assert pp_bubble("zero_bubble", 2, 2, 4) == pytest.approx(1 / 25)  # ZBV: 24 units busy of 25
    assert pp_bubble("zero_bubble", 4, 2, 8) < pp_bubble("interleaved_1f1b", 4, 2, 8) / 2
    assert pp_bubble("zero_bubble", 4, 3, 8) < pp_bubble("interleaved_1f1b", 4, 3, 8) / 2
    # micro-batches held at once per stage group (the runs' counts equal these: _assert_plan)
    assert pp_inflight("gpipe", 2, 1, 8) == [8, 8] and pp_inflight("1f1b", 4, 1, 8) == [4, 3, 2, 1]
    assert pp_inflight("interleaved_1f1b", 2, 2, 8) == [5, 3] and pp_inflight("zero_bubble", 2, 2, 8) == [4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["ddp/k4", "fsdp/k4", "fsdp/default/k4", "fsdp/interleaved/k4", "fsdp/zero_bubble/k4",
                                 "tp/k4", "tp/nosp/k4", "tp/llama", "tp/llama/padded"])
def test_pp2_by_data_parallel_or_tp_2_equals_one_big_batch_and_the_plan(pp4, refs, job):
    # tp/llama/padded: stages of the model's 32 tokens over 24-token data, so its tp collectives are of 32
    want = refs["llama/padded" if "padded" in job else "llama" if "llama" in job else
                "clip" if "interleaved" not in job else "ref"]  # fsdp/zero_bubble clips
    for rank in range(4):
        run = _job(pp4, job, rank)
        _assert_stage_run(run, want, f"{job} rank {rank}")
        _assert_plan(run, rank, 2)
        if job.startswith("tp"):
            assert run["outcomes"][1]["comm"]["tp_allreduces"] > 0  # the activations' collectives, counted
        if job == "fsdp/default/k4":  # dist.fsdp.reshard unset: pp 2 x fsdp 2 runs with what auto chose
            assert run["plan_from_model"]["dist.fsdp.reshard"] == "forward"


@pytest.mark.slow
def test_pp2_by_fsdp2_by_tp2_on_8_ranks_equals_one_big_batch_and_the_plan(pp8, refs):
    for rank in range(8):
        run = _job(pp8, "fsdp/tp/k4", rank)
        _assert_stage_run(run, refs["clip"], f"pp 2 x fsdp 2 x tp 2 rank {rank}")
        _assert_plan(run, rank, 4)


# ----------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("change, key", [
    (lambda c: _pp(c, schedule="zero_bubble", per_rank=1), "dist.pp.stages_per_rank"),
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


@pytest.mark.parametrize("strategy, size, want, why", [
    ("fsdp", 2, "forward", "micro_batch is not supported with dist.pp.size=2"),
    ("fsdp", 4, "forward", "micro_batch is not supported with dist.pp.size=4"),  # pp 4 x fsdp 1
    ("fsdp", 1, "micro_batch", "this mesh supports it"),
    ("ddp", 2, "micro_batch", None),  # ddp's shard groups of one rank gather nothing: today's value, unsaid
])
def test_reshard_auto_is_resolved_once_in_validate(strategy, size, want, why):
    cfg = _pp(_model(8), size=size, strategy=strategy, reshard=None)
    assert cfg.dist.fsdp.reshard == "auto"  # the default: the user set no key
    plan = validate(cfg, 4)
    assert cfg.dist.fsdp.reshard == want  # in place: what is built and planned reads the mode
    line = f"dist.fsdp.reshard=auto -> {want} ({why})"
    assert plan.chosen == ((line,) if why else ())
    assert (line in plan.describe()) == bool(why)  # the start-up report's plan line
    assert validate(cfg, 4).mesh == plan.mesh  # the resolved config validates again, alike
    cfg.dist.fsdp.reshard = "sometimes"
    with pytest.raises(ConfigError, match=r"dist\.fsdp\.reshard='sometimes': choose one of \('auto', "):
        validate(cfg, 4)


def test_reshard_auto_in_plan_mode_text_and_plan_json(tmp_path):
    import json

    from dist_trainer.plan import plan_report

    text = plan_report(_pp(_model(8), strategy="fsdp", reshard=None), 4, json_path=tmp_path / "plan.json")
    assert "  dist.fsdp.reshard=auto -> forward (micro_batch is not supported with dist.pp.size=2)\n" in text
    assert "dist.fsdp.reshard=forward)" in text  # the all-gathers' line reads the mode
    assert json.loads((tmp_path / "plan.json").read_text())["dist.fsdp.reshard"] == "forward"


def test_a_model_without_stages_is_a_config_error_in_plan_mode_as_in_training():
    from dist_trainer.models.hf import hf_model
    from dist_trainer.plan import pp_stage_groups
    from test_hf_models import GPT2

    cfg = _pp(_model(8))
    gpt2 = hf_model("causal_lm", "gpt2", {**GPT2, "vocab_size": 256}, block_size=24)  # transformer.h: not a stage layout
    with pytest.raises(ConfigError, match=r"dist\.pp\.size=2: the model GPT2LMHeadModel .* does not declare its "
                                          r"pipeline stages"):
        pp_stage_groups(cfg, gpt2)


def test_zero_bubble_stops_where_a_parameter_got_no_gradient():
    from types import SimpleNamespace

    from dist_trainer.parallel.pp import PipelineStrategy

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    PipelineStrategy._check_weight_pass(SimpleNamespace(module=model))  # every gradient there
    model[1].weight.grad = None  # what the weight pass drops, without an error of its own
    with pytest.raises(RuntimeError, match=r"dist\.pp\.schedule=zero_bubble: 1 trainable parameters have no "
                                           r"gradient after the schedule \(first: \['1\.weight'\]\)"):
        PipelineStrategy._check_weight_pass(SimpleNamespace(module=model))


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
    zbv = ["model.n_layer=4", "dist.pp.size=2", "dist.pp.schedule=zero_bubble", "dist.pp.stages_per_rank=2"]
    _jobs(tmp_path, [("one", 1, []), ("pp", 2, ["dist.pp.size=2"]), ("pptp", 4, ["dist.pp.size=2", "dist.tp.size=2"]),
                     ("one4", 1, ["model.n_layer=4"]), ("zbv", 2, zbv),
                     ("inter", 2, ["model.n_layer=4", "dist.pp.size=2", "dist.pp.schedule=interleaved_1f1b",
                                   "dist.pp.stages_per_rank=2"])])
    one, pp = metrics(tmp_path / "one"), metrics(tmp_path / "pp")
    assert [r["loss"] for r in metrics(tmp_path / "zbv")] == pytest.approx([r["loss"] for r in metrics(tmp_path / "one4")],
                                                                           rel=1e-5)
    assert [r["loss"] for r in metrics(tmp_path / "pptp")] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["loss"] for r in pp] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert pp[-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)
    assert pp[0]["pp_bubble"] == pytest.approx(1 / 5) and len(pp[0]["pp_idle_s"]) == 2
    resumes = (("pp_same", "pp", 2, ["dist.pp.size=2"]), ("pp_to_one", "pp", 1, []),
               ("one_to_pp", "one", 2, ["dist.pp.size=2"]), ("pptp_same", "pptp", 4, ["dist.pp.size=2", "dist.tp.size=2"]),
               ("pp_to_pptp", "pp", 4, ["dist.pp.size=2", "dist.tp.size=2"]), ("pptp_to_one", "pptp", 1, []),
               ("zbv_same", "zbv", 2, zbv), ("zbv_to_one", "zbv", 1, ["model.n_layer=4"]),
               ("one_to_zbv", "one4", 2, zbv), ("inter_to_one", "inter", 1, ["model.n_layer=4"]))
    for name, src, _, _ in resumes:  # each resumes from its source's step-2 checkpoint
        shutil.copytree(ckpt(tmp_path / src, 2), ckpt(tmp_path / name, 2))
    _jobs(tmp_path, [(name, ranks, extra) for name, _, ranks, extra in resumes])
    whole, mine = final_params(tmp_path / "one"), final_params(tmp_path / "pp")
    assert set(mine) == set(whole)  # exported whole: every stage's tensors, the tied head too
    assert_bit_identical(tmp_path / "pp_same", tmp_path / "pp")  # pp 2 resumed on pp 2
    assert_bit_identical(tmp_path / "pptp_same", tmp_path / "pptp")  # pp 2 x tp 2 resumed on pp 2 x tp 2
    assert_bit_identical(tmp_path / "zbv_same", tmp_path / "zbv")  # the V placement resumed on itself
    for name in ("pp", "pp_to_one", "one_to_pp", "pptp", "pp_to_pptp", "pptp_to_one"):
        assert_all_close_scaled(final_params(tmp_path / name), whole, name)
    whole4 = final_params(tmp_path / "one4")
    # inter_to_one: the stage groups name their parameters rank by rank (blocks 0, 2 | 1, 3), not in the model's
    # order, by which one process's optimizer pairs its state with its parameters
    for name in ("zbv", "zbv_to_one", "one_to_zbv", "inter", "inter_to_one"):
        assert_all_close_scaled(final_params(tmp_path / name), whole4, name)


GATE_STEP = 3  # accum 4, one stage a rank: rank 1's stage forward 4 x (3 - 1) + 1 is step 3's first micro-batch


@pytest.mark.slow
def test_pp_a_signal_during_a_step_stops_every_stage_after_it_and_the_resume_is_bit_identical(tmp_path):
    import os
    import re
    import signal
    import time

    from dist_trainer.checkpoint import verify
    from dist_trainer.signals import EXIT_REQUEUE
    from test_checkpoint import FAULTY, Job, assert_same_metrics, gated, resumed_from, run, steps_done, wait_for

    pp = COMMON + FAULTY + ["trainer.max_steps=8", "trainer.eval_every=0", "dist.pp.size=2"]
    ref_dir, run_dir, gate = tmp_path / "ref", tmp_path / "stopped", tmp_path / "gate"
    with Job(pp + [f"hydra.run.dir={ref_dir}"], tmp_path, 2) as ref, \
            Job(pp + gated(gate, 4 * (GATE_STEP - 1) + 1, rank=1) + [f"hydra.run.dir={run_dir}"], tmp_path, 2,
                torchrun_args=["--signals-to-handle=SIGTERM,SIGUSR1"]) as job:
        wait_for(lambda: Path(f"{gate}.waiting").exists(), job, 120, f"rank 1 (the last stage) in step {GATE_STEP}")
        # To the last stage's rank only, inside the step's schedule; the first stage learns of it through the
        # step's all-reduce.
        os.kill(job.workers()[1], signal.SIGUSR1)
        time.sleep(0.2)
        assert steps_done(run_dir) == GATE_STEP - 1
        gate.touch()
        code, output = job.wait(150), job.output()
        assert ref.wait(150) == 0, ref.output()[-4000:]
    assert code != 0 and re.search(rf"exitcode\s*:\s*{EXIT_REQUEUE}\b", output), output[-4000:]
    for rank in (0, 1):  # both stages stopped after the step the signal arrived in
        assert f"step {GATE_STEP}: stop requested by a signal" in (run_dir / f"rank{rank}.log").read_text()
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, GATE_STEP + 1))
    assert verify(ckpt(run_dir, GATE_STEP)) is None

    resumed = run(pp + [f"hydra.run.dir={run_dir}"], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed_from(resumed.output) == str(ckpt(run_dir, GATE_STEP))
    assert_same_metrics(run_dir, ref_dir, 8)
    assert_bit_identical(run_dir, ref_dir)
