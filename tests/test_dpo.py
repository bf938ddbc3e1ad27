"""task=dpo: the update over a step's preference pairs is the one big batch of them gives, whatever the split.

2 ranks x micro-batches of 1 pair x 4 accumulation steps against one process with the step's 8 pairs in one
micro-batch (16 rows, padded to the longest), a tiny Llama built from its configuration, SGD (lr 0.05) for 3
steps: every step's gradients, the weights after them and the step's figures (rewards, accuracies,
log-probabilities) within SCALE_TOL of their scale (measured at most 3.5e-6 under AVX-512, AVX2 and default
kernels; at lr 0.1 the weights' rounding after two steps reaches 1.05e-5 with default kernels, as a DPO gradient
is the difference of the two answers' gradients), under ddp and fsdp, a full model against a frozen copy of itself,
against no reference and against values precomputed before the first step, and LoRA adapters against the model
with its adapters disabled. The implicit rewards are exactly 0 at the first step where the reference is the policy
as built (precomputed: where the micro-batch is the pair alone, as measured). Precomputed values are bit-equal from
1 or 2 ranks, ddp or fsdp, and a second build reads them instead of measuring. The losses against their closed
forms; the refusals name their key.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from dist_trainer.config import ConfigError, DPOConfig, RLConfig, TPConfig
from dist_trainer.data import epoch_batches
from dist_trainer.rl.dpo import FIGURES
from dist_trainer.validation import validate
from helpers import SCALE_TOL, assert_all_close_scaled, job_record, run_jobs
from test_accumulation import in_one_process, launch_clean
from test_hf_chat import chat_model, write_jsonl
from test_hf_models import _full, config

STEPS, GLOBAL = 3, 8
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}


def preference_records(n: int, seed: int = 0) -> list:
    """Sums: the right answer chosen, a wrong one rejected; answers of 1 to 12 repeats (rows of unequal length);
    a third as message lists (TRL's conversational form), some with a system turn."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        a, b, off = r.randint(0, 99), r.randint(0, 99), r.randint(1, 9)
        right, wrong = f"{a + b}. " * r.choice([1, 2, 12]), f"{a + b + off}. " * r.choice([1, 3])
        prompt = f"What is {a}+{b}?"
        if i % 3:
            out.append({"prompt": prompt, "chosen": right, "rejected": wrong})
        else:
            turns = [{"role": "system", "content": "You add numbers."}] if i % 2 else []
            out.append({"prompt": turns + [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": right}],
                        "rejected": [{"role": "assistant", "content": wrong}]})
    return out


def pair_data(files: list, cache: Path) -> dict:
    return {"_target_": "dist_trainer.data.hf_preference.hf_preference", "files": [str(f) for f in files],
            "tokenizer": "bytes", "block_size": 256, "cache_dir": str(cache), "shuffle": True}


def dpo_config(files: list, cache: Path, micro: int, reference: str, strategy: str = "ddp", lora: bool = False,
               loss: str = "sigmoid", smoothing: float = 0.0, sft: float = 0.0):
    model = {**chat_model(), **({"lora": dict(LORA)} if lora else {})}
    cfg = config(model, pair_data(files, cache), micro, strategy, steps=STEPS)
    cfg.optim = dataclasses.replace(cfg.optim, lr=0.05)
    cfg.batch.global_batch_size = GLOBAL
    cfg.task = "dpo"
    cfg.rl = RLConfig(reference=reference, dpo=DPOConfig(beta=0.5, loss=loss, label_smoothing=smoothing,
                                                           sft_weight=sft))
    return cfg


def _record(env, world: int, name: str, cfg) -> dict:
    from dist_trainer.run import build

    parts = build(cfg, validate(cfg, world), env)
    rec = {"grads": [], "outcomes": []}
    if parts.train_set.ref_logps is not None:  # rl.reference=precomputed: the values and the files beside them
        rec["ref_logps"] = torch.from_numpy(parts.train_set.ref_logps.copy())
        rec["ref_files"] = sorted(p.name for p in Path(parts.train_set.directory).glob("ref_logps.*"))
    return record_rl_steps(parts, rec, STEPS)


def record_rl_steps(parts, rec: dict, steps: int, each_step: Optional[Callable[[dict], None]] = None) -> dict:
    """``steps`` whole steps of a built run into ``rec``: each step's outcome (its RL figures too), then
    ``each_step(rec)``, its collectives and gradients; then the weights."""
    module = parts.trainer.module
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, steps + 1), batches):
        outcome = parts.trainer.train_step(micro_batches, window, step)
        assert not outcome.skipped
        rec["outcomes"].append({"loss": outcome.loss, "items": outcome.items, **outcome.rl})
        if each_step is not None:
            each_step(rec)
        rec.setdefault("comm", []).append(outcome.comm)
        rec["grads"].append({n: _full(p.grad) for n, p in module.named_parameters() if p.requires_grad})
    rec["params"] = {n: _full(p) for n, p in module.named_parameters() if p.requires_grad}
    return rec


def _worker(rank: int, world: int, jobs: list) -> dict:
    return run_jobs(rank, world, jobs, _record)


# (name, reference, strategy, lora): the one-process reference is the name's first part under ddp
# Each one-process reference job's keys, by the name's first part. sft: RPO's NLL on the chosen answers, token-weighted
# over the step, with IPO's loss on the adapters.
REFS = {"copy": {"reference": "copy"}, "none": {"reference": "none"}, "adapter": {"reference": "adapter", "lora": True},
        "sft": {"reference": "adapter", "lora": True, "loss": "ipo", "sft": 0.5},
        "precomputed": {"reference": "precomputed"}}


def ref_micro(kind: str) -> int:
    """The one-process job's micro-batch: the step's 8 pairs; precomputed: one pair, the very batches its values
    were measured on ("precomputed/batched" runs the 8 as one: test_precomputed_rewards_...)."""
    return 1 if kind == "precomputed" else GLOBAL


def split_config(files: list, cache: Path, name: str):
    """The 2-rank job ``name`` (REFS' keys under ``name``'s strategy), micro-batches of one pair. A precomputed
    job has a data cache of its own: it measures its values under its strategy, not reading the one process's."""
    kind, strategy = name.split("/")
    if kind == "precomputed":
        cache = cache.with_name(f"{cache.name}-{strategy}")
    return dpo_config(files, cache, 1, strategy=strategy, **REFS[kind])


SPLITS = ["copy/ddp", "copy/fsdp", "none/fsdp", "sft/fsdp", "adapter/ddp", "adapter/fsdp", "precomputed/ddp",
          "precomputed/fsdp"]
# Splits whose reference and strategy another split already meets in the default suite (a copy under fsdp, the
# adapters' pass under fsdp in sft/fsdp): CI's slow stage runs them, in a launch of their own.
SLOW_SPLITS = ("copy/ddp", "none/fsdp", "adapter/fsdp")


def _splits() -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SPLITS else n for n in SPLITS]


def _two(request, runs, name: str) -> list:
    """Each rank's results holding split ``name``: the default launch's, or the slow stage's."""
    return request.getfixturevalue("slow_runs") if name in SLOW_SPLITS else runs[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return [str(write_jsonl(root / "pairs.jsonl", preference_records(48, seed=2)))], root / "cache"


@pytest.fixture(scope="module")
def runs(pairs, tmp_path_factory):
    files, cache = pairs
    refs = [(kind, dpo_config(files, cache, ref_micro(kind), **keys)) for kind, keys in REFS.items()]
    refs.append(("precomputed/batched", dpo_config(files, cache, GLOBAL, **REFS["precomputed"])))
    one = in_one_process(_worker, refs)
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("dpo2"), [
        (name, split_config(files, cache, name)) for name in SPLITS if name not in SLOW_SPLITS])
    return one, two


@pytest.fixture(scope="module")
def slow_runs(pairs, tmp_path_factory):
    files, cache = pairs
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("dpo2slow"),
                        [(name, split_config(files, cache, name)) for name in SLOW_SPLITS])


@pytest.mark.parametrize("name", _splits())
def test_dpo_split_equals_one_big_batch_of_pairs(runs, request, name):
    ref = job_record(runs[0], name.split("/")[0])
    for rank, results in enumerate(_two(request, runs, name)):
        got = job_record(results, name)
        trained = list(got["grads"][0])
        lora = REFS[name.split("/")[0]].get("lora")
        assert trained and (all("lora_" in n for n in trained) if lora else len(trained) > 10)
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert a["items"] == b["items"] == GLOBAL, (name, step)  # the step's pairs
            for key in b:
                assert a[key] == pytest.approx(b[key], rel=SCALE_TOL, abs=SCALE_TOL), f"{name} {key} at step {step}"
            assert_all_close_scaled(got["grads"][step - 1], ref["grads"][step - 1], f"{name} rank {rank} step {step}")
        assert_all_close_scaled(got["params"], ref["params"], f"{name} rank {rank} weights after step {STEPS}")
    assert ref["outcomes"][-1]["rewards/margins"] != 0.0  # the policy has moved away from its reference
    assert ("nll_loss" in ref["outcomes"][0]) == name.startswith("sft")  # the chosen answers' NLL, per token


@pytest.mark.parametrize("kind", ["copy", "adapter"])
def test_the_implicit_rewards_are_exactly_zero_at_the_first_step(runs, kind):
    """The reference is the policy as built: at step 1 both log-probabilities are the same numbers, so every
    reward and margin is exactly 0, no pair is counted right, and the sigmoid loss is log 2."""
    one, two = runs
    firsts = [job_record(one, kind)["outcomes"][0]] + [job_record(r, f"{kind}/{s}")["outcomes"][0]
                                                       for r in two for s in ("ddp", "fsdp") if f"{kind}/{s}" in r]
    for first in firsts:
        assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0, first
        assert first["rewards/accuracies"] == 0.0 and first["logps/chosen"] < 0 and first["logps/rejected"] < 0
        assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_precomputed_rewards_at_the_first_step_are_zero_up_to_the_batch_shape(runs):
    """The precomputed values are the model as built on each pair alone. A run of one pair a micro-batch runs
    those very batches: at step 1 every reward is exactly 0. A micro-batch of 8 pairs is one batch padded to its
    longest row, which CPU kernels round otherwise in the last bits than a pair alone: its first rewards are a
    few FP32 ulps of the log-probabilities (measured: 2.6e-8 of their scale), within 1e-6 of it, and its
    accuracy counts the pairs whose noise came out positive (0.25 here). That noise is also why the splits
    compare with a one-process run of single pairs: against the batched run their first accuracy is 0, not
    0.25, and their gradients differ by 4e-6 to 7e-6 of their scale (measured under AVX-512, AVX2 and default
    kernels), a difference of inputs, not of summation order."""
    one, two = runs
    firsts = [job_record(one, "precomputed")["outcomes"][0]] + [
        job_record(r, f"precomputed/{s}")["outcomes"][0] for r in two for s in ("ddp", "fsdp")]
    for first in firsts:
        assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0, first
        assert first["rewards/accuracies"] == 0.0 and first["loss"] == pytest.approx(math.log(2), rel=1e-6)
    first, beta = job_record(one, "precomputed/batched")["outcomes"][0], 0.5
    for side in ("chosen", "rejected"):
        assert abs(first[f"rewards/{side}"]) <= 1e-6 * beta * abs(first[f"logps/{side}"]), first
    # -log sigmoid(m) = log 2 - m / 2 + O(m^2): the mean loss is log 2 less half the mean margin, to FP32's rounding
    assert first["loss"] == pytest.approx(math.log(2) - first["rewards/margins"] / 2, abs=2e-7)


def test_precomputed_values_depend_on_neither_world_size_nor_strategy(runs):
    """Each pair measured alone, pair i on rank i % 2, all-reduced: the values of 2 ranks under ddp and under fsdp
    are the one process's, bit for bit, and so is the file's key (the whole weights' digest: fsdp's gathered)."""
    one, two = runs
    ref = job_record(one, "precomputed")
    assert len(ref["ref_files"]) == 1 and ref["ref_logps"].shape == (48, 2)  # the fixture's 48 pairs
    assert ref["ref_logps"].dtype == torch.float64 and (ref["ref_logps"] < 0).all()
    for results in two:
        for strategy in ("ddp", "fsdp"):
            got = job_record(results, f"precomputed/{strategy}")
            assert torch.equal(got["ref_logps"], ref["ref_logps"]), strategy
            assert got["ref_files"] == ref["ref_files"], strategy


def _builds(rank: int, world: int, cfgs: list, calls: list) -> list:
    """Each config's build: the answer_logps calls it made, its pairs' values and the files beside them."""
    from dist_trainer import distributed
    from dist_trainer.run import build, evaluate
    from dist_trainer.data import eval_loader
    from dist_trainer.precision import Precision

    env, out = distributed.init("cpu"), []
    for cfg in cfgs:
        calls.clear()
        parts = build(cfg, validate(cfg, world), env)
        data, held_out, made = parts.train_set, parts.eval_set, len(calls)
        rec = {"calls": made, "values": data.ref_logps, "files": sorted(Path(data.directory).glob("ref_logps.*")),
               "batch": data.collate([data[i] for i in range(3)])["ref_logps"].tensor}
        if held_out is not None:
            loader = eval_loader(held_out, 1, len(held_out), 0, 1, 0)  # a pair alone a batch, as measured
            rec["eval"] = (len(held_out), held_out.ref_logps,
                           evaluate(parts.trainer.module, loader, Precision(cfg.precision, env.device), env.device))
        out.append(rec)
    return out


def test_a_second_build_reuses_the_values_and_another_model_measures_its_own(runs, pairs, monkeypatch):
    """The one-process job wrote the values: the same model and data again measure nothing (no answer_logps
    call) and read them; another seed (other weights) or another model config (the same weights, another
    forward) measure their own into another file; a held-out split has its own, and at the model as built the
    held-out loss against them, a pair a batch, is exactly the sigmoid loss at 0: log 2 in FP32."""
    from dist_trainer.models.hf import HFModel

    files, cache = pairs
    calls, measure = [], HFModel.answer_logps
    monkeypatch.setattr(HFModel, "answer_logps", lambda self, *a, **kw: calls.append(1) or measure(self, *a, **kw))
    same = dpo_config(files, cache, GLOBAL, "precomputed")
    seeded = dpo_config(files, cache, GLOBAL, "precomputed")
    seeded.trainer = dataclasses.replace(seeded.trainer, seed=seeded.trainer.seed + 1)
    rope = dpo_config(files, cache, GLOBAL, "precomputed")
    rope.model = {**rope.model, "config": {**rope.model["config"], "rope_theta": 500.0}}
    held = dpo_config(files, cache.with_name("cache-val"), GLOBAL, "precomputed")
    held.data = {**held.data, "val_fraction": 0.25, "split": "train"}  # split: the run builds the val split too
    again, other_seed, other_config, with_val = in_one_process(_builds, [same, seeded, rope, held], calls)
    pairs_count = len(again["values"])
    assert again["calls"] == 0 and np.array_equal(again["values"], job_record(runs[0], "precomputed")["ref_logps"])
    assert len(again["files"]) == 1
    assert other_seed["calls"] == pairs_count and len(other_seed["files"]) == 2
    assert not np.array_equal(other_seed["values"], again["values"])
    assert other_config["calls"] == pairs_count and len(other_config["files"]) == 3
    # A batch carries the B chosen values, then the B rejected ones: its rows' order.
    assert torch.equal(again["batch"], torch.from_numpy(np.concatenate([again["values"][:3, 0],
                                                                         again["values"][:3, 1]])))
    val_pairs, val_values, eval_loss = with_val["eval"]
    assert with_val["calls"] == len(with_val["values"]) + val_pairs and val_values.shape == (val_pairs, 2)
    assert sorted(p.name.split(".")[1] for p in with_val["files"]) == ["train", "val"]  # a file each
    assert eval_loss == pytest.approx(math.log(2), rel=1e-7)


@pytest.mark.parametrize("name", _splits())
def test_every_step_issues_what_plan_mode_predicts(runs, request, pairs, name):
    """The reference's pass is a forward more per micro-batch: under fsdp its blocks are gathered again."""
    from dist_trainer.plan import plan_numbers

    cfg = split_config(*pairs, name)
    step = plan_numbers(cfg, validate(cfg, 2))["step"]
    for rank, results in enumerate(_two(request, runs, name)):
        for number, comm in enumerate(job_record(results, name)["comm"][1:], 2):
            assert {k: comm.get(k, 0) for k in step} == step, (name, rank, number)


def test_each_loss_is_its_closed_form():
    from dist_trainer.rl.dpo import DPO

    z = torch.tensor([-2.0, -0.3, 0.0, 0.4, 3.0], dtype=torch.float64)
    beta, eps = 0.5, 0.1
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    want = {"sigmoid": -(1 - eps) * torch.log(sig(beta * z)) - eps * torch.log(sig(-beta * z)),
            "robust": (-(1 - eps) * torch.log(sig(beta * z)) + eps * torch.log(sig(-beta * z))) / (1 - 2 * eps),
            "hinge": torch.clamp(1 - beta * z, min=0), "ipo": (z - 1 / (2 * beta)) ** 2}
    for kind, expected in want.items():
        smoothing = eps if kind in ("sigmoid", "robust") else 0.0
        got = DPO(DPOConfig(beta=beta, loss=kind, label_smoothing=smoothing), None)._losses(z)
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12), kind


def _refused(cfg, world: int = 2) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg, world)
    return str(err.value)


def test_what_dpo_cannot_run_under_names_the_key(pairs):
    files, cache = pairs
    base = lambda **kw: dpo_config(files, cache, 1, "copy", **kw)  # noqa: E731
    cfg = base()
    cfg.task = "ppo"
    assert "task='ppo'" in _refused(cfg)
    cfg = base()
    cfg.rl = RLConfig(reference="adapter")
    assert "rl.reference='adapter'" in _refused(cfg) and "model.lora.r" in _refused(cfg)
    for dpo, key in ((DPOConfig(beta=0.0), "rl.dpo.beta"), (DPOConfig(loss="kto"), "rl.dpo.loss"),
                     (DPOConfig(label_smoothing=0.5), "rl.dpo.label_smoothing"),
                     (DPOConfig(loss="hinge", label_smoothing=0.1), "rl.dpo.label_smoothing")):
        cfg = base()
        cfg.rl = RLConfig(dpo=dpo)
        assert key in _refused(cfg)
    cfg = base()
    cfg.dist = dataclasses.replace(cfg.dist, tp=TPConfig(size=2))
    assert "dist.tp.size=2" in _refused(cfg)
    cfg = base()
    cfg.model = {**cfg.model, "loss": {"chunked": True}}
    assert "model.loss.chunked" in _refused(cfg)
    cfg = base()
    cfg.data = {"_target_": "dist_trainer.data.hf_chat.hf_chat", "files": files}
    assert "data=hf_preference" in _refused(cfg)
    cfg = base()
    cfg.task = "lm"
    assert "task=dpo" in _refused(cfg)


# ------------------------------------------------------------------------------------------ the command line

def _cli(pairs_file: Path, run_dir: Path, steps: int, *extra: str) -> list:
    return ["task=dpo", "data=hf_preference", f"data.files=[{pairs_file}]", "data.tokenizer=bytes",
            f"data.cache_dir={run_dir.parent / 'cache'}", "model=hf_causal_lm", "model.model_type=llama",
            "+model.config={hidden_size:32,num_hidden_layers:2,num_attention_heads:4,num_key_value_heads:2,"
            "intermediate_size:64}", "batch.micro_batch_size=2", "batch.global_batch_size=8",
            f"trainer.max_steps={steps}", "trainer.ckpt_every=2", "trainer.eval_every=0", "optim.warmup_steps=0",
            "optim.schedule=constant", f"hydra.run.dir={run_dir}", *extra]


@pytest.mark.slow  # three 2-rank torchrun jobs: about 15 s
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_dpo_run_resumes_bit_identically_against_a_copy_built_again(tmp_path, strategy):
    """The frozen copy is not in the checkpoint: a resumed run builds the model as built before and copies it,
    so the run after the resume is the straight run's, bit for bit; metrics.jsonl holds the step's figures."""
    from test_checkpoint import metrics, run

    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", preference_records(64, seed=1))
    whole, split = tmp_path / "whole", tmp_path / "split"
    ref = run(_cli(pairs_file, whole, 6, f"dist.strategy={strategy}"), tmp_path, nproc=2)
    assert ref.returncode == 0, ref.output[-4000:]
    first = run(_cli(pairs_file, split, 4, f"dist.strategy={strategy}"), tmp_path, nproc=2)
    assert first.returncode == 0, first.output[-4000:]
    second = run(_cli(pairs_file, split, 6, f"dist.strategy={strategy}"), tmp_path, nproc=2)
    assert second.returncode == 0, second.output[-4000:]
    assert "resuming from" in second.output and "(step 4)" in second.output
    got, want = (torch.load(d / "final_model.pt", weights_only=True) for d in (split, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    records = metrics(whole)
    assert [r["loss"] for r in metrics(split)] == [r["loss"] for r in records]
    assert records[0]["rewards/margins"] == 0.0 and records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert records[-1]["rewards/margins"] != 0.0 and set(FIGURES) <= set(records[-1])
    assert "tokens_per_s" not in records[-1]  # the items are pairs


@pytest.mark.slow  # two 2-rank torchrun jobs: about 13 s
def test_a_precomputed_run_measures_once_and_its_resume_reads_the_values(tmp_path):
    """Under fsdp with a held-out split: the first run measures both splits before its first step (the first
    step's rewards exactly 0: one pair a micro-batch, as measured) and evaluates against them; the resume builds
    the model as built again, finds both files and measures nothing."""
    from test_checkpoint import metrics, run

    # 56 pairs hold out 12: as many held-out batches on each rank (under fsdp each forward is a collective, and
    # the eval loader evens the ranks' batches out under expert parallelism only)
    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", preference_records(56, seed=3))
    run_dir = tmp_path / "run"
    args = ("rl.reference=precomputed", "dist.strategy=fsdp", "data.val_fraction=0.25", "batch.micro_batch_size=1")
    first = run(_cli(pairs_file, run_dir, 2, *args), tmp_path, nproc=2)
    assert first.returncode == 0, first.output[-4000:]
    for split in ("train", "val"):
        assert f"computed the {split} split's reference log-probabilities" in first.output, first.output[-4000:]
    second = run(_cli(pairs_file, run_dir, 4, *args), tmp_path, nproc=2)
    assert second.returncode == 0, second.output[-4000:]
    assert "resuming from" in second.output and "computed the" not in second.output
    for split in ("train", "val"):
        assert f"reused the {split} split's reference log-probabilities" in second.output, second.output[-4000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[0]["rewards/margins"] == 0.0
    assert records[1]["eval_loss"] > 0 and records[-1]["eval_loss"] > 0 and records[-1]["rewards/margins"] != 0.0


@pytest.mark.slow  # a 2-rank torchrun job: about 8 s
def test_an_uneven_held_out_split_under_fsdp_is_evaluated_in_lockstep(tmp_path):
    """9 held-out pairs on 2 ranks in micro-batches of 2: unevenly dealt, rank 0 would run 3 forwards and rank 1
    two, and under fsdp a forward is a collective (the run used to wait forever in the third); the split is cut
    to a multiple of the ranks, so every rank runs as many."""
    from dist_trainer.data.hf_preference import hf_preference
    from test_checkpoint import metrics, run

    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", preference_records(64, seed=1))
    held = hf_preference([str(pairs_file)], tokenizer="bytes", block_size=256, val_fraction=0.15, split="val",
                         cache_dir=str(tmp_path / "cache"))
    assert len(held) == 9  # dealt 5 and 4: 3 and 2 micro-batches of 2
    result = run(_cli(pairs_file, tmp_path / "run", 2, "dist.strategy=fsdp", "rl.reference=none",
                      "data.val_fraction=0.15", "trainer.eval_every=1", "trainer.eval_batches=4"),
                 tmp_path, nproc=2, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert all(math.isfinite(r["eval_loss"]) for r in metrics(tmp_path / "run"))


def test_plan_mode_says_what_the_objective_adds(pairs):
    from dist_trainer.plan import plan_report

    report = plan_report(split_config(*pairs, "sft/fsdp"), 2)
    assert "task=dpo, rl.dpo.loss=ipo: the mean over the step's pairs; rl.reference=adapter" in report
    assert "add 7 float64 slots" in report and "1 all-reduce more, of 16 bytes" in report
    assert "(frozen_mb)" in plan_report(split_config(*pairs, "copy/fsdp"), 2)
