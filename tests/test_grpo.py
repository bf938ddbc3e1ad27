"""task=grpo: whole steps (sample, reward, update) on 2 ranks equal one process, and the rollouts are token-identical.

2 prompts a step, groups of 3 completions: 6 sequences a step, as 2 ranks x micro-batches of 1 x 3 accumulation
steps (sample j of a step on rank j % 2, so every group straddles both ranks and several micro-batches) against one
process with the step's 6 in one micro-batch. A tiny Llama built from its configuration, SGD (lr 0.2), 3 steps, a
reward that varies with the completion's text (``text_reward``). Per step: the completions' tokens and rewards
equal bit for bit, the gradients and the figures within SCALE_TOL of their scale, and the weights after the 3 steps;
for each rl.loss.agg, each KL estimator, each advantage estimator and scale, the entropy bonus, a frozen copy and LoRA
against the model with its adapters disabled, and under fsdp (where every rank samples alike many passes). With one update per rollout the ratio
is exactly 1 and nothing is clipped; the KL against the policy as built is exactly 0 at the first step.

The three negative controls each fail the same bound on the same fixed rollout batch: a token mean per
micro-batch, advantages normalised per rank, and masks made from the pad id where the pad id is the end of text.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from dist_trainer.config import ConfigError, RLConfig, TPConfig
from dist_trainer.data import epoch_batches
from dist_trainer.data.builtin import IGNORE_INDEX
from dist_trainer.data.exact import Exact
from dist_trainer.data.loader import StepPlan
from dist_trainer.rl.grpo import advantages, kl_terms
from dist_trainer.rl.rewards import build_reward, exact_answer
from dist_trainer.rl.rollout import cut
from dist_trainer.validation import validate
from helpers import SCALE_TOL, assert_all_close_scaled, job_record, run_jobs
from test_accumulation import in_one_process, launch_clean
from test_dpo import record_rl_steps
from test_hf_chat import chat_model, write_jsonl
from test_hf_models import config

STEPS, PROMPTS, GROUP = 3, 2, 3
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}


def text_reward(prompt, completion, answer=None, **record) -> float:
    """A reward that every completion's text moves: its characters' codes, folded into [0, 1)."""
    return (sum(map(ord, completion)) % 101) / 101.0


def prompt_records(n: int, seed: int = 0) -> list:
    r = random.Random(seed)
    out = []
    for i in range(n):
        a, b = r.randint(0, 99), r.randint(0, 99)
        prompt = f"What is {a}+{b}?"
        out.append({"prompt": prompt if i % 2 else [{"role": "user", "content": prompt}], "answer": str(a + b)})
    return out


def prompt_data(files: list, group: int = GROUP) -> dict:
    return {"_target_": "dist_trainer.data.hf_prompts.hf_prompts", "files": [str(f) for f in files],
            "tokenizer": "bytes", "block_size": 256, "group_size": group, "shuffle": True}


def grpo_config(files: list, micro: int, strategy: str = "ddp", agg: str = "token-mean", kl: float = 0.1,
                estimator: str = "k3", entropy: float = 0.0, lora: bool = False, reference: str = "auto",
                scale: str = "group", advantage: str = "grpo", prompts: int = PROMPTS, group: int = GROUP,
                inner: int = 1):
    model = {**chat_model(), **({"lora": dict(LORA)} if lora else {})}
    cfg = config(model, prompt_data(files, group), micro, strategy, steps=STEPS)
    cfg.optim = dataclasses.replace(cfg.optim, lr=0.2)
    cfg.batch.global_batch_size = None
    cfg.task = "grpo"
    cfg.rl = RLConfig(reference=reference, prompts_per_step=prompts, group_size=group, inner_steps=inner,
                      reward={"_target_": "test_grpo.text_reward"}, entropy_coef=entropy)
    cfg.rl.loss.agg, cfg.rl.kl.coef, cfg.rl.kl.estimator = agg, kl, estimator
    cfg.rl.advantage.scale, cfg.rl.advantage.estimator = scale, advantage
    cfg.rl.rollout.max_new_tokens, cfg.rl.rollout.temperature = 8, 0.9
    return cfg


def _record(env, world: int, name: str, cfg) -> dict:
    from dist_trainer.run import build

    parts = build(cfg, validate(cfg, world), env)
    objective = parts.trainer.objective
    return record_rl_steps(parts, {"grads": [], "outcomes": [], "sampled": []}, STEPS,
                           lambda rec: rec["sampled"].append(objective.sampled))


def _worker(rank: int, world: int, jobs: list) -> dict:
    return run_jobs(rank, world, jobs, _record)


# name -> the keys of its jobs (the 2-rank job under the name's strategy, the one-process one under ddp); between
# them every aggregation, KL estimator, advantage estimator and scale, the entropy bonus and both references
JOBS = {"token-mean": {"agg": "token-mean", "entropy": 0.01},
        "seq-mean-token-mean": {"agg": "grpo", "estimator": "k1", "advantage": "rloo"},
        "seq-mean-token-sum-norm": {"agg": "dr_grpo", "scale": "none", "advantage": "mean"},
        "lora": {"lora": True, "reference": "adapter", "agg": "seq-mean-token-sum", "estimator": "k2",
                 "scale": "batch"},
        # 3 groups of 2 over 2 ranks: under fsdp the rank with one group samples one more, to keep lockstep;
        # each rollout trained by 2 optimizer steps (step 2 trains step 1's, against their old log-probabilities)
        "three-groups": {"prompts": 3, "group": 2, "entropy": 0.01, "inner": 2}}
SPLITS = ["token-mean/ddp", "seq-mean-token-mean/ddp", "seq-mean-token-sum-norm/ddp", "lora/ddp",
          "three-groups/fsdp"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return [str(write_jsonl(tmp_path_factory.mktemp("grpo") / "prompts.jsonl", prompt_records(24, seed=3)))]


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory):
    one = in_one_process(_worker, [(name, grpo_config(prompts, 6, **keys)) for name, keys in JOBS.items()])
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("grpo2"), [
        (name, grpo_config(prompts, 1, strategy=name.split("/")[1], **JOBS[name.split("/")[0]])) for name in SPLITS])
    return one, two


@pytest.mark.parametrize("name", SPLITS)
def test_whole_grpo_steps_on_two_ranks_equal_one_process(runs, name):
    one, two = runs
    ref = job_record(one, name.split("/")[0])
    for rank, results in enumerate(two):
        got = job_record(results, name)
        for step in range(STEPS):
            # the same completions, token for token, and the same rewards, bit for bit
            assert got["sampled"][step] == ref["sampled"][step], (name, rank, step)
            a, b = got["outcomes"][step], ref["outcomes"][step]
            for key in b:
                if not key.endswith("_s"):  # timings
                    assert a[key] == pytest.approx(b[key], rel=SCALE_TOL, abs=SCALE_TOL), f"{name} {key} step {step}"
            assert_all_close_scaled(got["grads"][step], ref["grads"][step], f"{name} rank {rank} step {step + 1}")
        assert_all_close_scaled(got["params"], ref["params"], f"{name} rank {rank} weights after step {STEPS}")


@pytest.mark.slow  # a 4-rank launch: about 10 s
def test_whole_grpo_steps_under_hsdp_equal_one_process(prompts, tmp_path_factory):
    """hsdp 2 x 2 on 4 ranks (each shard group samples in lockstep; the rollouts gathered over all 4): 4 prompts x
    groups of 2, 4 ranks x micro-batches of 1 x 2 accumulation steps, against one process."""
    from test_hsdp import _mesh

    keys = {"prompts": 4, "group": 2, "agg": "grpo"}
    one = in_one_process(_worker, [("hsdp", grpo_config(prompts, 8, **keys))])
    cfg = _mesh(grpo_config(prompts, 1, strategy="fsdp", **keys), "hsdp")
    four = launch_clean(_worker, 4, tmp_path_factory.mktemp("grpo4"), [("hsdp", cfg)])
    ref = job_record(one, "hsdp")
    for rank, results in enumerate(four):
        got = job_record(results, "hsdp")
        assert got["sampled"] == ref["sampled"], rank
        for step in range(STEPS):
            assert_all_close_scaled(got["grads"][step], ref["grads"][step], f"hsdp rank {rank} step {step + 1}")
        assert_all_close_scaled(got["params"], ref["params"], f"hsdp rank {rank} weights")


@pytest.mark.parametrize("name", SPLITS)
def test_every_step_issues_what_plan_mode_predicts(runs, prompts, name):
    """The rollouts' gathers and all-reduce; under fsdp every sampling pass gathers every unit, and the frozen
    copy's units once a micro-batch."""
    from dist_trainer.plan import plan_numbers, plan_report

    kind, strategy = name.split("/")
    cfg = grpo_config(prompts, 1, strategy=strategy, **JOBS[kind])
    numbers = plan_numbers(cfg, validate(cfg, 2))
    inner = JOBS[kind].get("inner", 1)
    step = numbers["step"]
    assert step["rl_object_gathers"] == (2 if inner == 1 else 3) and step["rl_allreduces"] == 1
    for rank, results in enumerate(runs[1]):
        for number, comm in enumerate(job_record(results, name)["comm"][1:], 2):
            want = step if (number - 1) % inner == 0 else numbers["inner_step"]  # a step that samples, or not
            assert {k: comm.get(k, 0) for k in want} == want, (name, rank, number)
    if inner > 1:
        assert numbers["inner_step"]["rl_object_gathers"] == 0
        assert numbers["inner_step"]["all_gathers"] < step["all_gathers"]
    if strategy == "fsdp":
        groups = 2 if kind == "three-groups" else 1
        assert f"every rank runs {groups} group(s) x 8 passes a step" in plan_report(cfg, 2)


def test_inner_steps_train_one_rollout_against_its_old_log_probabilities(runs):
    """rl.inner_steps=2: step 2 trains step 1's completions again (no sampling), its ratio now off 1 (the weights
    moved since they were sampled) and the same on 2 ranks as in one process; step 3 samples anew."""
    for results in [runs[0]] + runs[1]:
        rec = job_record(results, "three-groups" if "three-groups" in results else "three-groups/fsdp")
        first, second, third = rec["sampled"]
        assert second == first and third != first
        out = rec["outcomes"]
        assert out[0]["ratio_min"] == out[0]["ratio_max"] == 1.0 and out[2]["ratio_min"] == out[2]["ratio_max"] == 1.0
        assert out[1]["ratio_min"] < 1.0 < out[1]["ratio_max"] and out[1]["gen_s"] == 0.0
        assert out[1]["reward_mean"] == out[0]["reward_mean"]


@pytest.mark.parametrize("name", list(JOBS))
def test_ratio_is_one_and_the_first_kl_zero_and_the_rewards_vary(runs, name):
    """One update per rollout: the ratio is exactly 1 and nothing clipped at every step. The reference is the
    policy as built (a copy, or the adapters disabled): the KL is exactly 0 at the first step, and not after."""
    outcomes = job_record(runs[0], name)["outcomes"]
    inner = JOBS[name].get("inner", 1)
    for step, out in enumerate(outcomes):
        if step % inner == 0:  # a step that samples its own rollouts
            assert out["ratio_min"] == out["ratio_max"] == 1.0 and out["clip_frac"] == 0.0, out
        assert out["reward_std"] > 0 and out["frac_zero_std_groups"] < 1 and 0 < out["completion_len_mean"] <= 8
        assert out["items"] == (round(out["completion_len_mean"] * 6) if JOBS[name].get("agg", "token-mean")
                                in ("token-mean", "dapo") else 6)  # tokens, or sequences
    assert outcomes[0]["kl"] == 0.0 and outcomes[-1]["kl"] != 0.0
    if name == "seq-mean-token-sum-norm":  # advantages around the step's mean: they sum to 0 over the step
        assert outcomes[0]["advantage_mean"] == pytest.approx(0.0, abs=1e-12)


def test_a_groups_samples_stay_together_in_a_step_on_any_world_size():
    """The order permutes whole groups: each step holds PROMPTS whole groups, the same on 1 and 2 ranks."""
    from test_accumulation import mlp_config

    def step_slots(world: int) -> list:
        cfg = mlp_config(1, n=24)
        cfg.batch.global_batch_size = PROMPTS * GROUP
        plan = validate(cfg, world)
        steps = [[] for _ in range(4)]
        for rank in range(world):
            sp = StepPlan(24 * GROUP, plan, rank, 0, True, False, group=GROUP)
            for step, window in zip(range(4), sp.windows(0)):
                steps[step] += [i for mb in window for i in mb]
        return [sorted(s) for s in steps]

    one = step_slots(1)
    assert one == step_slots(2)
    for slots in one:
        groups = {i // GROUP for i in slots}
        assert len(groups) == PROMPTS and sorted(slots) == sorted(g * GROUP + k for g in groups for k in range(GROUP))


# ------------------------------------------------------------------------------- closed forms

def test_advantages_closed_forms():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    grpo = advantages(r, "grpo", "none")
    assert torch.equal(grpo, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4], dtype=torch.float64))
    rloo = advantages(r, "rloo", "none")  # r - the mean of the others = G / (G - 1) (r - mean)
    assert torch.allclose(rloo, grpo * 4 / 3, rtol=0, atol=1e-15)
    std = r[0].std().item()  # unbiased, as TRL's
    assert torch.allclose(advantages(r, "grpo", "group")[0], grpo[0] / (std + 1e-4), rtol=0, atol=1e-15)
    assert torch.equal(advantages(r, "grpo", "group")[1], torch.zeros(4, dtype=torch.float64))  # equal rewards: 0
    assert torch.allclose(advantages(r, "mean", "batch"), (r - r.mean()) / (r.std() + 1e-4), rtol=0, atol=1e-15)
    assert torch.equal(advantages(torch.tensor([[3.0], [1.0]], dtype=torch.float64), "grpo", "group"),
                       torch.zeros(2, 1, dtype=torch.float64))  # a group of one: 0, not NaN


def test_kl_estimators_and_the_mask_by_position():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - logp
    assert torch.equal(kl_terms(logp, ref, "k1"), logp - ref)
    assert torch.equal(kl_terms(logp, ref, "k2"), 0.5 * d * d)
    assert torch.allclose(kl_terms(logp, ref, "k3"), torch.exp(d) - d - 1) and (kl_terms(logp, ref, "k3") >= 0).all()
    # through the first end of turn, by position: a later end of turn and what follows are not the completion
    assert cut([5, 6, 7, 9, 7], stop_ids=(7,)) == ([5, 6, 7], False)
    assert cut([5, 6, 8], stop_ids=(7,)) == ([5, 6, 8], True)  # not ended: truncated, trained as it stands
    assert exact_answer("What is 2+2?", " 4 \n", answer="4") == 1.0
    assert exact_answer("What is 2+2?", "5", answer=4) == 0.0
    reward = build_reward("exact_answer", "prompt")
    record = {"prompt": "What is 2+2?", "answer": "4"}
    assert reward(record, "4", True) == 1.0 and reward(record, "4", False) == 0.0  # cut before its end of turn


def test_refusals_name_the_key(prompts):
    def refused(key: str, **change):
        cfg = grpo_config(prompts, 1, **change.pop("keys", {}))
        for path, value in change.items():
            node, leaf = cfg, path.split(".")
            for part in leaf[:-1]:
                node = getattr(node, part)
            setattr(node, leaf[-1], value)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(cfg, 2)

    refused("rl.loss.agg", **{"rl.loss.agg": "bnpo"})  # a per-micro-batch mean: refused with the reason
    refused("batch.global_batch_size", **{"batch.global_batch_size": 8})
    refused("rl.reference", **{"rl.reference": "precomputed"})
    refused("rl.reference", keys={"reference": "adapter"})  # no adapters
    refused("rl.rollout.temperature", **{"rl.rollout.temperature": 0.0})
    refused("rl.inner_steps", **{"rl.inner_steps": 0})
    refused("rl.kl.estimator", **{"rl.kl.estimator": "k4"})
    refused("dist.tp.size", **{"dist.tp": TPConfig(size=2)})
    refused("trainer.compile", **{"trainer.compile": True})
    cfg = grpo_config(prompts, 1)
    assert validate(cfg, 2).global_batch_size == PROMPTS * GROUP  # derived from the prompts and the group


# ------------------------------------------------------------------------------- negative controls

@pytest.fixture(scope="module")
def fixed_batch(prompts):
    """A fixed rollout batch of 6 rows (completions of 2 to 9 tokens, all but one ended by an end of turn, rewards
    drawn once), the gradient of its loss (token-mean, advantages scaled by the batch's deviation) and of the three
    controls' (in this process)."""
    from dist_trainer.rl.grpo import advantages as advantages_of
    from dist_trainer.run import build

    cfg = grpo_config(prompts, PROMPTS * GROUP, kl=0.0, scale="batch")

    def grads_of(env, world, name, cfg):
        parts = build(cfg, validate(cfg, world), env)
        objective, model = parts.trainer.objective, parts.trainer.module
        window, batches = next(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False))
        stop, r = objective.prompts.stop_ids[-1], random.Random(5)
        slots = list(zip(batches[0]["prompt_index"].tolist(), batches[0]["sample"].tolist()))
        prompts_ = sorted({p for p, _ in slots})
        rewards = torch.tensor([[r.random() for _ in range(GROUP)] for _ in prompts_], dtype=torch.float64)
        adv = advantages_of(rewards, "grpo", "batch")
        completions = {slot: [r.randrange(40, 120) for _ in range(r.randint(1, 8))] + ([stop] if i else [])
                       for i, slot in enumerate(slots)}
        by_slot = {(p, s): (completions[(p, s)], float(adv[i, s])) for i, p in enumerate(prompts_)
                   for s in range(GROUP)}
        rows = objective.rows(batches[0], by_slot, env.device)

        def grad(loss_of) -> dict:
            model.zero_grad()
            loss_of(rows).backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

        def mean(batch):
            out = objective(model, batch)
            return out["loss_sum"] / out["num_items"]

        def per_micro_batch(batch):  # each micro-batch's own token mean, averaged over the 3 micro-batches
            return sum(mean({k: Exact(v.tensor[i::3]) if isinstance(v, Exact) else v[i::3] for k, v in batch.items()})
                       for i in range(3)) / 3

        def per_rank_advantages(batch):  # each rank's rows (j % 2) scaled by that rank's own rewards' deviation
            own = torch.tensor([rewards[prompts_.index(p), s] for p, s in slots], dtype=torch.float64)
            centred = torch.tensor([float(adv[prompts_.index(p), s]) for p, s in slots], dtype=torch.float64)
            scaled = centred * (rewards.std() + 1e-4)  # back to reward - its group's mean
            for k in range(2):
                scaled[k::2] /= own[k::2].std() + 1e-4
            return mean({**batch, "advantages": Exact(scaled)})

        def pad_masks(batch):  # the pad id taken for the end of turn (as where pad = eos): masks made by value
            labels = batch["labels"].masked_fill(batch["input_ids"] == stop, IGNORE_INDEX)
            return mean({**batch, "labels": labels})

        ids = torch.as_tensor(objective.prompts.ids[0])
        draws = []
        for seed, step in ((1, 5), (2, 5), (1, 6)):  # the process's RNG changed, then the step
            torch.manual_seed(seed)
            draws.append(objective.sampler.group(ids, 0, step))
        return {"draws": draws, "ref": grad(mean), "micro": grad(per_micro_batch), "rank": grad(per_rank_advantages),
                "pad": grad(pad_masks), "ended": int((rows["labels"] == stop).sum())}

    return in_one_process(lambda rank, world: run_jobs(rank, world, [("fixed", cfg)], grads_of))


@pytest.mark.parametrize("control", ["micro", "rank", "pad"])
def test_each_negative_control_fails_the_bound(fixed_batch, control):
    rec = job_record(fixed_batch, "fixed")
    assert rec["ended"] == PROMPTS * GROUP - 1  # the completions that end with an end of turn, labelled
    err = max(((rec[control][n] - g).abs().max() / g.abs().max()).item() for n, g in rec["ref"].items())
    assert err > 10 * SCALE_TOL, (control, err)
    with pytest.raises(AssertionError):
        assert_all_close_scaled(rec[control], rec["ref"], control)


def test_sampling_is_keyed_by_the_step_not_the_process_rng(fixed_batch):
    """A group drawn twice at one step under two different process RNG states is the same tokens (a resume
    restores the RNG anyway, but sampling never reads it); at another step it is another draw."""
    same, other_rng, other_step = job_record(fixed_batch, "fixed")["draws"]
    assert same == other_rng and same != other_step
    assert len(same) == GROUP and all(1 <= len(row) <= 8 for row in same)


def _cli(prompts_file: str, run_dir: Path, steps: int, *extra: str) -> list:
    return ["task=grpo", "data=hf_prompts", f"data.files=[{prompts_file}]", "data.tokenizer=bytes",
            "model=hf_causal_lm", "model.model_type=llama",
            "+model.config={hidden_size:32,num_hidden_layers:2,num_attention_heads:4,num_key_value_heads:2,"
            "intermediate_size:64}", "rl.prompts_per_step=2", "rl.group_size=4", "rl.rollout.max_new_tokens=6",
            "rl.kl.coef=0.05", "+rl.reward._target_=test_grpo.text_reward", "batch.micro_batch_size=2",
            f"trainer.max_steps={steps}", "trainer.ckpt_every=2", "trainer.eval_every=0", "optim.warmup_steps=0",
            "optim.schedule=constant", "optim.lr=3e-3", f"hydra.run.dir={run_dir}", *extra]


@pytest.mark.slow  # three 2-rank torchrun jobs: about 15 s
def test_a_grpo_run_resumes_bit_identically(tmp_path, prompts):
    """Under fsdp with rl.inner_steps=2: stopped after step 3 (which sampled) and resumed at step 4 (which trains
    step 3's rollouts again, read from the checkpoint with their old log-probabilities), against a frozen copy
    built again, the run ends bit for bit where the straight run ends; metrics.jsonl holds the rollouts' figures."""
    from test_checkpoint import metrics, run

    whole, split = tmp_path / "whole", tmp_path / "split"
    args = ("dist.strategy=fsdp", "rl.inner_steps=2")
    ref = run(_cli(prompts[0], whole, 4, *args), tmp_path, nproc=2)
    assert ref.returncode == 0, ref.output[-4000:]
    first = run(_cli(prompts[0], split, 3, *args), tmp_path, nproc=2)
    assert first.returncode == 0, first.output[-4000:]
    second = run(_cli(prompts[0], split, 4, *args), tmp_path, nproc=2)
    assert second.returncode == 0, second.output[-4000:]
    assert "resuming from" in second.output and "(step 3)" in second.output
    got, want = (torch.load(d / "final_model.pt", weights_only=True) for d in (split, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    records = metrics(whole)
    keys = ("loss", "reward_mean", "kl", "entropy", "completion_len_mean")
    assert [[r[k] for k in keys] for r in metrics(split)] == [[r[k] for k in keys] for r in records]
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] != 0.0 and records[-1]["reward_std"] > 0
    assert records[3]["gen_s"] == 0.0 and records[3]["ratio_max"] != 1.0  # step 4: step 3's rollouts again


def test_side_tensors_keep_their_dtype_through_an_fsdp_roots_input_cast():
    """FSDP2 casts a root's floating inputs to its parameters' dtype (bf16 in the master modes); the advantages
    and log-probabilities a batch carries in an Exact reach the loss as they were made (float64 here)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, batch):
            seen.update(x=batch["x"].dtype, exact=batch["advantages"].tensor.dtype)
            return self.linear(batch["x"])

    def run(rank, world):
        model = fully_shard(Probe(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        value = torch.tensor([0.1234567890123], dtype=torch.float64)
        model({"x": torch.randn(1, 2), "advantages": Exact(value)})
        return seen

    got = in_one_process(run)
    assert got == {"x": torch.bfloat16, "exact": torch.float64}
