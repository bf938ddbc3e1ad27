"""Tensor parallelism (dist.tp.*) on real gloo ranks, against one process on one big batch.

One launch of 2 ranks (tp 2) and one of 4 (tp 2 x ddp 2, tp 2 x fsdp 2; its tests are marked
slow, .ci/run runs them) run every job; the references run in this process. fp32 and SGD with momentum, so any wrong factor moves
the weights; the data's micro-batches hold very different numbers of tokens
(test_accumulation's unbalanced text), so the update is token-weighted or it fails.

* split invariance within SCALE_TOL of the scale, every step, gradients and weights:
  tp 2 with accumulation of 4 and 1, sequence parallelism on and off, clipping active
  (the norm of gradients cut over the tp ranks, norms' counted once), the end of the
  data (a short step with placeholders); tp 2 x ddp 2 and tp 2 x fsdp 2 with K = 4 and 1;
* sequence parallelism on and off give the same update (SAME_OPS_TOL);
* fp16 loss scaling: an inf in one tp rank's shard skips the step on every rank;
* the plan: every tp collective (and FSDP's) of step 1 and of a full step equals
  plan.json's prediction exactly, under sp on and off, K = 1 and 3, loss parallelism off,
  activation checkpointing, bf16-mixed, on 2 and 4 ranks; state_mb as predicted;
* a Hugging Face llama (sequence parallelism on and off) and a qwen2 with its head tied
  to the embedding (their own base_model_tp_plan, their norms on sequence shards) under
  tp 2 equal one process;
* padded chats (data=hf_chat data.packing=false) whose every micro-batch is of an odd length
  train under tp 2 with sequence parallelism (each micro-batch padded to a multiple of 2,
  masked, with no loss) and equal one process; their vocabulary is the tokenizer's 261 (cut
  131 and 130, never padded), and so is a GPT's, whose plan (logits gathered) holds too;
* activation checkpointing gives the same gradients; bf16-master within fsdp's bound;
* bad plans and sizes are ConfigErrors naming the key; so is a block size that sequence
  parallelism cannot cut into equal shards, and a batch of such a length with no attention mask.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.data.hf_chat import hf_chat
from dist_trainer.plan import plan_numbers
from helpers import SAME_OPS_TOL, assert_all_close_scaled
from test_accumulation import GLOBAL, in_one_process, launch_clean, mlp_config
from test_hsdp import STEPS, _assert_same_run, _gpt, _job, _worker

MLP_PLAN = {"net.0": "colwise", "net.2": "rowwise"}


def _tp(cfg, size: int = 2, strategy: str = "ddp", sp: bool = True, loss_parallel: bool = True, plan="auto"):
    cfg.dist = dataclasses.replace(cfg.dist, strategy=strategy)
    cfg.dist.tp = dataclasses.replace(cfg.dist.tp, size=size, sequence_parallel=sp, loss_parallel=loss_parallel,
                                      plan=plan)
    return cfg


def _clip(cfg):
    cfg.optim.grad_clip = 0.05  # below the gradients' norm: clipping acts on every step
    return cfg


def _llama(micro: int, glob: int = GLOBAL):
    from test_hf_models import LLAMA, causal_model

    cfg = _gpt(micro, glob)
    cfg.model = causal_model("llama", {**LLAMA, "vocab_size": 256})
    return cfg


def _qwen2(micro: int, glob: int = GLOBAL):
    """Qwen2 with its head tied to the input embedding: the plan cuts both by vocabulary rows."""
    from test_hf_models import LLAMA, causal_model

    cfg = _gpt(micro, glob)
    cfg.model = causal_model("qwen2", {**LLAMA, "vocab_size": 256, "tie_word_embeddings": True})
    return cfg


def _qwen3(micro: int, glob: int = GLOBAL):
    """Qwen3: q_norm and k_norm over each head's features, on each tp rank's heads (head_norm)."""
    from test_hf_models import LLAMA, causal_model

    cfg = _gpt(micro, glob)
    cfg.model = causal_model("qwen3", {**LLAMA, "vocab_size": 256, "head_dim": 8})
    return cfg


def _end(micro: int):
    return mlp_config(micro, n=73)  # step 3 holds 9 samples: short micro-batches and placeholders


def _overflow():
    from test_fsdp import InfMLP  # noqa: F401  (importable by name in the ranks)

    cfg = mlp_config(4)  # 1 data rank x micro 4 x accum 8
    cfg.model = {"_target_": "test_fsdp.InfMLP", "in_dim": 4, "hidden": 16, "inf_rank": 1, "inf_call": 9}
    cfg.precision.name = "fp16-master"
    cfg.precision.loss_scale.init_scale = 1024.0
    return _tp(cfg, sp=False, plan={"first": "colwise", "second": "rowwise"})


def _jobs2() -> list:
    """2 ranks: one tp group of 2, one data-parallel rank."""
    jobs = [("k4", _clip(_tp(_gpt(8))), STEPS), ("k1", _tp(_gpt(32)), STEPS),
            ("nosp/k4", _clip(_tp(_gpt(8), sp=False)), STEPS),
            ("end", _tp(_end(8), sp=False, plan=MLP_PLAN), STEPS), ("overflow", _overflow(), STEPS),
            ("llama", _tp(_llama(16), sp=False), STEPS), ("llama/sp", _tp(_llama(8)), STEPS),
            ("qwen2", _tp(_qwen2(8)), STEPS)]
    ac = _tp(_gpt(8, 24))
    ac.dist.activation_checkpointing = True
    mixed = _tp(_gpt(8, 24))
    mixed.precision.name = "bf16-mixed"
    master = _tp(_gpt(8))
    master.precision.name = "bf16-master"
    jobs += [("master", master, 1), ("plan/k3", _tp(_gpt(8, 24)), 2), ("plan/ac", ac, 2), ("plan/bf16-mixed", mixed, 2),
             ("plan/no-loss-parallel", _tp(_gpt(8, 24), loss_parallel=False), 2),
             ("plan/nosp/k3", _tp(_gpt(8, 24), sp=False), 2), ("plan/llama/k3", _tp(_llama(8, 24), sp=False), 2),
             ("plan/qwen3/k3", _tp(_qwen3(8, 24), sp=False), 2), ("plan/qwen3/sp/k3", _tp(_qwen3(8, 24)), 2),
             ("vocab261", _clip(_tp(_vocab(_gpt(8)))), STEPS),
             ("plan/vocab261/no-loss-parallel", _tp(_vocab(_gpt(8, 24)), loss_parallel=False), 2)]
    return jobs


def _vocab(cfg, size: int = 261):
    """A vocabulary tp 2 does not divide: the tied embedding and head cut in 131 and 130 rows."""
    cfg.model = {**cfg.model, "vocab_size": size}
    return cfg


def _chat(micro: int, chats: tuple):
    """Padded chats (data.packing=false) of odd lengths only, on a tiny qwen2 whose vocabulary is the
    tokenizer's: the bytes tokenizer's 259 ids and the template's two markers, 261, which tp 2 cuts unevenly."""
    from test_hf_chat import QWEN2, chat_data, chat_model

    files, cache = chats
    cfg = _gpt(micro)
    cfg.model = chat_model("qwen2", dict(QWEN2))
    cfg.data = chat_data(files, cache, packing=False)
    return cfg


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """The conversations of odd token counts among 240: every micro-batch's longest, its padded length, is odd."""
    from test_hf_chat import conversations, write_jsonl

    root = tmp_path_factory.mktemp("chats")
    records = conversations(240, seed=3)
    lengths = hf_chat([str(write_jsonl(root / "all.jsonl", records))], block_size=256,
                      cache_dir=str(root / "cache")).lengths()
    odd = write_jsonl(root / "odd.jsonl", [r for r, n in zip(records, lengths) if n % 2])
    data = hf_chat([str(odd)], block_size=256, cache_dir=str(root / "cache"))  # the ranks' cache, built here
    assert len(data) >= 96 and all(data.lengths() % 2)
    return [str(odd)], root / "cache"


def _jobs4() -> list:
    """4 ranks: tp groups of 2 (consecutive ranks) over 2 data-parallel ranks."""
    return [("ddp/k4", _tp(_gpt(4)), STEPS), ("ddp/k1", _clip(_tp(_gpt(16))), STEPS),
            ("fsdp/k4", _clip(_tp(_gpt(4), strategy="fsdp")), STEPS),
            ("fsdp/k1", _tp(_gpt(16), strategy="fsdp", sp=False), STEPS),
            ("plan/fsdp/every/k3", _every(_tp(_gpt(4, 24), strategy="fsdp")), 2)]


def _every(cfg):
    cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, accum_sync="every")
    return cfg


# Plans whose collectives the default launch's other plans already exercise (no loss parallelism, no sequence
# parallelism, another model): the slow stage's 2-rank launch checks them.
SLOW_PLAN2 = ("plan/no-loss-parallel", "plan/nosp/k3", "plan/llama/k3", "plan/qwen3/sp/k3",
              "plan/vocab261/no-loss-parallel")


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, chats):
    jobs = [job for job in _jobs2() if job[0] not in SLOW_PLAN2]
    jobs += [("chat", _tp(_chat(8, chats)), STEPS)]  # K = 4 micro-batches of 8 padded chats
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("tp2"), jobs)


@pytest.fixture(scope="module")
def tp2_slow(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("tp2_slow"),
                        [job for job in _jobs2() if job[0] in SLOW_PLAN2])


@pytest.fixture(scope="module")
def tp4(tmp_path_factory):
    return launch_clean(_worker, 4, tmp_path_factory.mktemp("tp4"), _jobs4())


@pytest.fixture(scope="module")
def refs(chats):
    """One process, one big batch of 32 (K = 1)."""
    return in_one_process(_worker, [("ref", _gpt(GLOBAL), STEPS), ("clip", _clip(_gpt(GLOBAL)), STEPS),
                                    ("end", _end(32), STEPS), ("llama", _llama(GLOBAL), STEPS),
                                    ("qwen2", _qwen2(GLOBAL), STEPS), ("chat", _chat(GLOBAL, chats), STEPS),
                                    ("vocab261", _clip(_vocab(_gpt(GLOBAL))), STEPS)])


def _cfg(jobs: list, name: str):
    return next(cfg for job, cfg, _ in jobs if job == name)


# ----------------------------------------------------------------------------- split invariance

@pytest.mark.parametrize("name, ref", [("k4", "clip"), ("k1", "ref"), ("nosp/k4", "clip"), ("end", "end"),
                                       ("llama", "llama"), ("llama/sp", "llama"), ("qwen2", "qwen2"),
                                       ("chat", "chat"), ("vocab261", "vocab261")])
def test_tp2_equals_one_big_batch(tp2, refs, name, ref):
    runs = [_job(tp2, name, r) for r in range(2)]
    want = _job([refs], ref)
    _assert_same_run(runs[0], want, f"tp 2 {name}")
    for step, outcome in enumerate(runs[0]["outcomes"]):
        # the norm of gradients cut over the ranks, each part (and each whole norm weight) counted once
        assert outcome["grad_norm"] == pytest.approx(want["outcomes"][step]["grad_norm"], rel=1e-5)
        assert runs[1]["outcomes"][step]["grad_norm"] == outcome["grad_norm"]
        for key in ("items", "samples"):
            assert outcome[key] == want["outcomes"][step][key], key
    for value, other in zip(runs[0]["params"][-1].values(), runs[1]["params"][-1].values()):
        assert torch.equal(value, other)  # one cut tensor, gathered alike on both ranks
    moved = max((want["params"][-1][n] - want["params"][0][n]).abs().max().item() for n in want["params"][0])
    assert moved > 1e-3
    if ref == "clip":
        assert runs[0]["outcomes"][0]["grad_norm"] > 0.1  # clipping acted
    if name == "end":
        assert runs[0]["outcomes"][2]["samples"] == 9


def test_vocabularies_tp_does_not_divide_are_cut_unevenly_never_padded(tp2):
    """261 rows (bytes and a chat template's two markers) in 131 and 130: every tensor keeps the vocabulary."""
    chat = _job(tp2, "chat")["params"][0]
    assert chat["model.model.embed_tokens.weight"].shape[0] == 261
    assert _job(tp2, "vocab261")["params"][-1]["tok_emb.weight"].shape[0] == 261


@pytest.mark.slow  # the 4-rank launch: about 35 s on 2 cores
@pytest.mark.parametrize("name, ref", [("ddp/k4", "ref"), ("ddp/k1", "clip"), ("fsdp/k4", "clip"), ("fsdp/k1", "ref")])
def test_tp2_with_2_data_parallel_ranks_equals_one_big_batch(tp4, refs, name, ref):
    runs = [_job(tp4, name, r) for r in range(4)]
    _assert_same_run(runs[0], _job([refs], ref), f"tp 2 x {name}")
    for run in runs[1:]:
        assert [o["loss"] for o in run["outcomes"]] == [o["loss"] for o in runs[0]["outcomes"]]
        for name_, value in run["params"][-1].items():
            assert torch.equal(value, runs[0]["params"][-1][name_]), name_


def test_sequence_parallel_on_and_off_give_the_same_update(tp2):
    on, off = _job(tp2, "k4"), _job(tp2, "nosp/k4")
    for step in range(STEPS):
        assert_all_close_scaled(on["grads"][step], off["grads"][step], f"sp on/off grads {step + 1}", SAME_OPS_TOL)
    assert on["outcomes"][1]["comm"]["tp_all_gathers"] > 0 and off["outcomes"][1]["comm"]["tp_all_gathers"] == 0
    # the norms' saved activations, cut by the tp size (bench/tp.py measures them)
    norms = [plan_numbers(cfg, validate(cfg, 2))["norm_activation_mb"]
             for cfg in (_tp(_gpt(8)), _tp(_gpt(8), sp=False))]
    assert norms[0] > 0 and norms[1] == 2 * norms[0]


def test_activation_checkpointing_under_tp_gives_the_same_gradients(tp2):
    on, off = _job(tp2, "plan/ac"), _job(tp2, "plan/k3")
    for step in range(2):
        assert_all_close_scaled(on["grads"][step], off["grads"][step], f"tp checkpointed step {step + 1}",
                                SAME_OPS_TOL)


def test_bf16_master_under_tp_within_the_tolerance_of_ddp(tp2, refs):
    """bf16 parameters gathered from FP32 shards, activations' collectives in bf16: test_fsdp's bound."""
    run, want = _job(tp2, "master"), _job([refs], "ref")
    assert not run["outcomes"][0]["skipped"]
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    got, ref = flat(run["grads"][0]), flat(want["grads"][0])
    assert ((got - ref).norm() / ref.norm()).item() < 3e-2


def test_fp16_overflow_in_one_tp_ranks_shard_skips_on_every_rank(tp2):
    runs = [_job(tp2, "overflow", r) for r in range(2)]
    for run in runs:
        assert [o["skipped"] for o in run["outcomes"]] == [False, True, False]
        assert run["outcomes"][2]["lr"] == run["outcomes"][1]["lr"]  # the schedule held
        assert run["scale"] < run["outcomes"][0]["loss_scale"]  # backed off
    # rank 1's inf is in its own rows of the first layer: rank 0's shard stays finite, and still skips
    assert [run["local_finite"][1] for run in runs] == [True, False]
    for name, value in runs[0]["params"][0].items():
        assert torch.equal(runs[0]["params"][1][name], value), name  # nothing moved at the skipped step


# ----------------------------------------------------------------------------- the communication plan

PLAN2 = [name for name, _, _ in _jobs2() if name.startswith("plan/")] + ["k4", "nosp/k4", "k1", "llama/sp", "qwen2"]
PLAN4 = [name for name, _, _ in _jobs4()]


def _assert_plan(runs: list, cfg, world: int, name: str) -> None:
    numbers = plan_numbers(cfg, validate(cfg, world))
    assert numbers["mesh"]["tp"] == 2
    for rank, run in enumerate(runs):
        outcomes = run["outcomes"]
        assert outcomes[0]["comm"] == numbers["first_step"], (name, rank, outcomes[0]["comm"])
        assert outcomes[1]["comm"] == numbers["step"], (name, rank, outcomes[1]["comm"])
        assert run["plan_from_model"] == numbers  # a run's plan.json, from its wrapped model, is plan mode's
    assert numbers["step"]["tp_allreduces"] + numbers["step"]["tp_all_gathers"] > 0
    if cfg.precision.name == "fp32":
        assert outcomes[-1]["state_mb"] == pytest.approx(numbers["state_mb"], rel=0.05)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PLAN2 else n for n in PLAN2])
def test_every_step_matches_the_plan_on_2_ranks(request, name):
    runs = request.getfixturevalue("tp2_slow" if name in SLOW_PLAN2 else "tp2")
    _assert_plan([_job(runs, name, r) for r in range(2)], _cfg(_jobs2(), name), 2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAN4)
def test_every_step_matches_the_plan_on_4_ranks(tp4, name):
    _assert_plan([_job(tp4, name, r) for r in range(4)], _cfg(_jobs4(), name), 4, name)


def _whole_state_mb() -> float:
    return plan_numbers(_gpt(8), validate(_gpt(8), 1))["state_mb"]


def test_tp_halves_the_state_of_a_rank(tp2):
    """Each tp rank holds half of every cut matrix: state_mb of tp 2 is about half of one process's."""
    assert _job(tp2, "k4")["outcomes"][-1]["state_mb"] < 0.6 * _whole_state_mb()


@pytest.mark.slow
def test_tp_and_fsdp_together_quarter_the_state_of_a_rank(tp4):
    assert _job(tp4, "fsdp/k4")["outcomes"][-1]["state_mb"] < 0.35 * _whole_state_mb()


# ----------------------------------------------------------------------------- bad input

def test_tp_sizes_and_plans_that_cannot_work_name_the_key():
    with pytest.raises(ConfigError, match=r"dist\.tp\.size=3: must divide the world size 4"):
        validate(_tp(_gpt(4), size=3), 4)
    with pytest.raises(ConfigError, match=r"dist\.tp\.plan"):
        validate(_tp(_gpt(4), plan={"blocks.*.attn.q": "diagonal"}), 4)
    with pytest.raises(ConfigError, match=r"dist\.sync_batchnorm"):
        cfg = _tp(_gpt(4))
        cfg.dist.sync_batchnorm = True
        validate(cfg, 4)
    with pytest.raises(ConfigError, match=r"batch\.global_batch_size=32 is not batch\.micro_batch_size=32 x "
                                          r"data-parallel ranks \(dist\.tp\.size=2\) 2"):
        validate(_tp(_gpt(32)), 4)
    cfg = _tp(_gpt(4))
    cfg.model = {**cfg.model, "lora": {"r": 8}}
    with pytest.raises(ConfigError, match=r"model\.lora\.r=8"):
        validate(cfg, 4)
    plan = validate(_tp(_gpt(4)), 4)
    assert (plan.data_ranks, plan.accum_steps, plan.mesh.describe()) == (
        2, 4, "ddp: 2 replicas, each rank a tensor-parallel group of 2 ranks")


def test_a_plan_that_does_not_fit_the_model_names_the_module():
    from dist_trainer.models import GPT
    from dist_trainer.parallel.tp import check_divisible, resolve_plan

    cfg = _tp(_gpt(4)).dist.tp
    with pytest.raises(ConfigError, match=r"dist\.tp\.plan: the pattern 'blocks\.\*\.attn\.qkv' matches no module"):
        resolve_plan(GPT(n_embd=16, n_head=2), dataclasses.replace(cfg, plan={"blocks.*.attn.qkv": "colwise"}))
    with pytest.raises(ConfigError, match=r"dist\.tp\.size=2: blocks\.0\.attn has n_head=3"):
        model = GPT(n_embd=24, n_head=3, n_layer=1)
        check_divisible(model, resolve_plan(model, cfg), 2)
    with pytest.raises(ConfigError, match=r"declares no tensor-parallel plan.*dist\.tp\.plan"):
        resolve_plan(torch.nn.Linear(2, 2), cfg)


def test_sequence_parallelism_pads_a_masked_batch_and_refuses_what_it_cannot_pad():
    """The model's pre-hook: a masked micro-batch padded to a multiple of the tp size with masked, untrained
    positions; a batch of that length with no attention mask, and a block size sequence parallelism cannot cut,
    are ConfigErrors naming data.block_size and dist.tp.size (before anything is cut or communicated)."""
    from dist_trainer.models import GPT
    from dist_trainer.parallel.tp import _pad_sequence, checked_plan

    hook = _pad_sequence(2)
    ids = torch.tensor([[5, 6, 7], [8, 9, 1]])
    batch = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
             "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2], [0, 1, 2]]), "sample_id": torch.ones(2)}
    (padded,), _ = hook(None, (batch,), {})
    assert padded["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 1, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert padded["labels"].tolist() == [[5, 6, 7, -100], [8, 9, 1, -100]]
    assert padded["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert padded["sample_id"] is batch["sample_id"]  # not per token: as it was
    assert hook(None, (padded,), {}) is None  # a multiple of 2 already: nothing to do
    with pytest.raises(ConfigError, match=r"data\.block_size: a micro-batch of 3 tokens a row does not cut into "
                                          r"dist\.tp\.size=2 .*no attention_mask.*a multiple of 2 \(e\.g\. 2 or 4\)"):
        hook(None, ({"input_ids": ids, "targets": ids},), {})
    with pytest.raises(ConfigError, match=r"the batch's 'weights' is of that length and not known to pad"):
        hook(None, ({**batch, "weights": torch.ones(2, 3)},), {})
    cfg = _tp(_gpt(4)).dist.tp
    gpt = GPT(n_embd=16, n_head=2, n_layer=1, block_size=63)
    with pytest.raises(ConfigError, match=r"data\.block_size=63 \(the model's block_size\) is not a multiple of "
                                          r"dist\.tp\.size=2.*set data\.block_size to 62 or 64"):
        checked_plan(gpt, cfg)
    checked_plan(gpt, dataclasses.replace(cfg, sequence_parallel=False))  # whole sequences: any length
