"""Context parallelism (dist.cp.size=2) against one process and one big batch.

First the attention alone: 2 and 4 real ranks on gloo hold each a part of a sequence's tokens (16, 64 and 256
tokens; zig-zag or contiguous), and ring and Ulysses attention give the outputs and the q, k, v gradients of one
process's causal attention over the whole sequence, in float64 (to 1e-12 of their scale: the method is exact,
only rounding differs) and float32 (SCALE_TOL); the ring through torch's fused CPU kernel and through the math
other devices run.

Then training: a 2-layer GPT on 8 sequences a step whose valid tokens differ from sequence to sequence (some
cp halves hold no valid label at all), split 2 cp ranks x 2 micro-batches of 4 whole sequences, against one
process with one batch of 8. Every step's loss, item count, sample count and gradient norm, the gradients of
step 1 and the weights after 3 AdamW steps are compared within SCALE_TOL of their scale, under ddp and fsdp,
ring and ulysses, both layouts, activation checkpointing, clipping, fp16 with loss scaling and bf16 masters (to
the half type's rounding), and sequences of 22 and 21 tokens padded to the layout's unit; and for Hugging Face llama and qwen2 (grouped keys and values, rotary positions) on
right-padded batches without targets, whose labels are shifted from the ids before the cut. Every step's cp
exchanges equal plan mode's. The step's 8 sequences are also split 1 x 8 and 4 x 2. Three broken runs fail the
same comparison: cp ranks that drop the other half's keys (attention local to each rank), labels shifted after
the cut, and each cp rank's mean loss weighted alike.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Subset

from dist_trainer.config import ConfigError, CPConfig
from dist_trainer.validation import validate
from dist_trainer.data.builtin import char_text
from dist_trainer.parallel.cp import CPCounter, CPGroup, _RingAttention, positions, ulysses_attention
from dist_trainer.plan import plan_numbers
from helpers import (SCALE_TOL, assert_all_close_scaled, assert_close_scaled, record_steps, run_jobs, run_ranks,
                     scaled_error)
from helpers import job_record as _rec
from test_accumulation import _assert_close, _token_length, gpt_config, in_one_process, launch_clean

STEPS, GLOBAL = 3, 8
MODEL = {"vocab_size": 256, "block_size": 24, "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.0, "bias": False}
CLIP = 0.05


# ------------------------------------------------------------------------------------------ attention alone

SHAPE = (2, 4, 8)  # batch, heads, head width
# (cp, tokens): on 2 ranks 16 and 64 tokens, on 4 ranks 64 and 256; the ring's pairs through torch's fused CPU
# kernel and through the math written out that other devices run (the fused kernel switched off).
LENGTHS = {2: (16, 64), 4: (64, 256)}
KERNELS = ("fused", "math")


def _attention_worker(rank: int, world_size: int) -> dict:
    from dist_trainer.parallel import cp

    out = {}
    for length, dtype, kernel in itertools.product(LENGTHS[world_size], (torch.float64, torch.float32), KERNELS):
        cp.FUSED_DEVICES = ("cpu",) if kernel == "fused" else ()
        gen = torch.Generator().manual_seed(7)
        q, k, v, g = (torch.randn(SHAPE[:2] + (length, SHAPE[2]), generator=gen, dtype=dtype) for _ in range(4))
        for method in ("ring", "ulysses"):
            for layout in ("zigzag", "contiguous"):
                group = CPGroup(dist.group.WORLD, world_size, rank, layout, CPCounter())
                mine = positions(length, world_size, rank, layout)
                ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
                y = (_RingAttention.apply(ql, kl, vl, group) if method == "ring" else
                     ulysses_attention(ql, kl, vl, group))
                (y * g[:, :, mine]).sum().backward()
                out[(length, str(dtype), kernel, method, layout)] = {
                    "positions": mine, "y": y.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
                    "counts": group.counter.counts}
    return out


@pytest.fixture(scope="module")
def attention(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setenv("OMP_NUM_THREADS", "1")
        mpatch.setenv("GLOO_SOCKET_IFNAME", "lo")
        return {cp: run_ranks(_attention_worker, cp, tmp_path_factory.mktemp(f"cp{cp}-attention"), timeout=180)
                for cp in LENGTHS}


@pytest.mark.parametrize("cp,length", [(cp, n) for cp, lengths in LENGTHS.items() for n in lengths])
@pytest.mark.parametrize("method,kernel", [("ring", "fused"), ("ring", "math"), ("ulysses", "fused")])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, SCALE_TOL)])
def test_cp_attention_equals_whole_sequence_attention(attention, cp, length, method, kernel, layout, dtype, tol):
    gen = torch.Generator().manual_seed(7)
    shape = SHAPE[:2] + (length, SHAPE[2])
    q, k, v, g = (torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(i < 3) for i in range(4))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y * g).sum().backward()
    got = [r[(length, str(dtype), kernel, method, layout)] for r in attention[cp]]
    assert sorted(torch.cat([r["positions"] for r in got]).tolist()) == list(range(length))
    for name, ref in (("y", y.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        whole = torch.empty_like(ref)
        for r in got:
            whole[:, :, r["positions"]] = r[name]
        assert_close_scaled(whole, ref, f"cp {cp} {length} {method} {kernel} {layout} {dtype} {name}", tol=tol)
    # A layer's forward and backward: ring passes keys and values on cp - 1 times forward, and again backward
    # with their gradients cp times; ulysses exchanges q, k, v and the output once each way.
    counts = got[0]["counts"]
    if method == "ring":
        assert (counts["cp_sends"], counts["cp_all_to_alls"]) == ((cp - 1) + (cp - 1) + cp, 0)
    else:
        assert (counts["cp_sends"], counts["cp_all_to_alls"]) == (0, 4)


def test_zigzag_gives_every_rank_equal_causal_work():
    def work(rank: int, layout: str) -> int:  # (query, key) pairs a causal mask keeps on one of 4 ranks
        return int((positions(64, 4, rank, layout) + 1).sum())
    assert len({work(r, "zigzag") for r in range(4)}) == 1
    assert work(3, "contiguous") > 6 * work(0, "contiguous")  # 904 against 136


# ------------------------------------------------------------------------------------------------- training


def short_text(block_size: int) -> Subset:
    """Items of ``block_size`` tokens (22: not a multiple of zigzag's unit 4, padded to 24; 21: not one of
    contiguous's 2, padded to 22) whose valid lengths vary as ``unbalanced_text``'s do, capped at the size."""
    base = char_text(block_size=block_size, min_len=1)
    lengths = [min(_token_length(s, p), block_size) for s in range(STEPS) for p in range(GLOBAL)]
    pools = {n: [i for i in range(2000) if base.valid_length(i) == n] for n in set(lengths)}
    return Subset(base, [pools[n].pop(0) for n in lengths])


class PaddedIds(torch.utils.data.Dataset):
    """``short_text``'s items as a Hugging Face batch brings them: ``input_ids`` right-padded after each item's
    valid tokens with an ``attention_mask``, no targets (the model shifts the ids into labels: before the cut)."""

    def __init__(self, block_size: int) -> None:
        self.items = short_text(block_size)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        valid = int((item["targets"] != -100).sum()) + 1  # the ids whose next token counts, and that token
        mask = (torch.arange(len(item["input_ids"])) < valid).long()
        return {"input_ids": item["input_ids"].masked_fill(mask == 0, 0), "attention_mask": mask}


# Grouped keys and values (4 query heads, 2 kv heads): repeated to the heads before the exchange.
HF = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": 64}


def hf_config(micro: int, model_type: str, cp: int = 1, method: str = "ring", layout: str = "zigzag",
              strategy: str = "ddp", pp: int = 1):
    cfg = cp_config(micro, cp, method, layout, strategy, pp=pp)
    cfg.model = {"_target_": "dist_trainer.models.hf.hf_model", "task": "causal_lm", "model_type": model_type,
                 "config": dict(HF), "block_size": 22}
    cfg.data = {"_target_": f"{__name__}.PaddedIds", "block_size": 22, "shuffle": False}
    return cfg


def cp_config(micro: int, cp: int = 1, method: str = "ring", layout: str = "zigzag", strategy: str = "ddp",
              clip: bool = False, checkpointing: bool = False, data_block: int = 24, precision: str = "fp32",
              tp: int = 1, pp: int = 1):
    cfg = gpt_config(micro)
    cfg.dist.tp = dataclasses.replace(cfg.dist.tp, size=tp)
    cfg.dist.pp = dataclasses.replace(cfg.dist.pp, size=pp)
    cfg.precision = dataclasses.replace(cfg.precision, name=precision)
    cfg.model = {**cfg.model, **MODEL}
    if data_block != MODEL["block_size"]:
        cfg.data = {"_target_": f"{__name__}.short_text", "block_size": data_block, "shuffle": False}
    cfg.batch = dataclasses.replace(cfg.batch, global_batch_size=GLOBAL)
    cfg.optim = dataclasses.replace(cfg.optim, eps=1e-6, grad_clip=CLIP if clip else None)
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=STEPS)
    return dataclasses.replace(cfg, dist=dataclasses.replace(
        cfg.dist, strategy=strategy, cp=CPConfig(size=cp, method=method, layout=layout),
        activation_checkpointing=checkpointing))


REFS = {"plain": cp_config(GLOBAL), "clip": cp_config(GLOBAL, clip=True), "pad22": cp_config(GLOBAL, data_block=22),
        "pad21": cp_config(GLOBAL, data_block=21), "llama": hf_config(GLOBAL, "llama"),
        "qwen2": hf_config(GLOBAL, "qwen2"), "fp16": cp_config(GLOBAL, precision="fp16-mixed"),
        "bf16-master": cp_config(GLOBAL, strategy="fsdp", precision="bf16-master")}
# Half precision: the one process's attention runs in the half type, the ring's in float32 and the cp ranks'
# matmuls on half the tokens each, so the two agree to the half type's rounding, not to fp32's (the bounds of
# test_master_weights).
HALF_TOL = {"fp16-mixed": 5e-3, "bf16-master": 3e-2}
CASES = {  # name: (cp 2 config on 2 ranks, its one-process reference)
    "ring-zigzag-ddp": (cp_config(4, 2), "plain"),
    "ring-contiguous-fsdp-clip": (cp_config(4, 2, layout="contiguous", strategy="fsdp", clip=True), "clip"),
    "ulysses-zigzag-fsdp-ac": (cp_config(4, 2, "ulysses", strategy="fsdp", checkpointing=True), "plain"),
    "ulysses-contiguous-ddp-pad": (cp_config(4, 2, "ulysses", "contiguous", data_block=21), "pad21"),  # to 22
    "ring-zigzag-fsdp-pad": (cp_config(4, 2, strategy="fsdp", data_block=22), "pad22"),  # to 24
    "ring-zigzag-ddp-hf-llama": (hf_config(4, "llama", 2), "llama"),
    "ring-zigzag-ddp-fp16": (cp_config(4, 2, precision="fp16-mixed"), "fp16"),  # dynamic loss scaling
    "ulysses-zigzag-fsdp-bf16-master": (cp_config(4, 2, "ulysses", strategy="fsdp", precision="bf16-master"),
                                        "bf16-master"),
    "ulysses-contiguous-fsdp-hf-qwen2": (hf_config(4, "qwen2", 2, "ulysses", "contiguous", "fsdp"), "qwen2"),
    # the other splits of the step's 8 sequences: one micro-batch of 8, four of 2
    "ring-zigzag-ddp-micro8": (cp_config(8, 2), "plain"),
    "ulysses-zigzag-ddp-micro2": (cp_config(2, 2, "ulysses"), "plain"),
    # broken on purpose: no exchange; the labels shifted after the cut, within each rank's chunks; each cp rank's
    # mean loss weighted alike (Megatron's default)
    "ring-zigzag-ddp-local": (cp_config(4, 2), "plain"),
    "ring-zigzag-ddp-hf-llama-shift-after-cut": (hf_config(4, "llama", 2), "llama"),
    "ring-zigzag-ddp-per-rank-mean": (cp_config(4, 2), "plain"),
}
CONTROLS = ("ring-zigzag-ddp-local", "ring-zigzag-ddp-hf-llama-shift-after-cut", "ring-zigzag-ddp-per-rank-mean")


def _weigh_rank_means_alike(model, cp: int) -> None:
    """The per-rank-mean trap: each cp rank's loss is its tokens' mean times the micro-batch's valid tokens / cp,
    so the halves of a sequence weigh alike whatever tokens each holds."""
    whole = {}

    def count(module, args):  # before the cut (prepended after it, so it runs first): the whole micro-batch's
        whole["items"] = int((args[0]["targets"] != -100).sum())

    def mean(module, args, out):
        return {**out, "loss_sum": out["loss_sum"] / out["num_items"].clamp(min=1) * whole["items"] / cp}

    model.register_forward_pre_hook(count, prepend=True)
    model.register_forward_hook(mean)


def _run_job(env, world_size: int, name: str, cfg) -> dict:
    """Each step's outcome, whole gradients of step 1, whole weights after the last step, plan mode's numbers."""
    def before(parts, plan) -> dict:
        if world_size > 1:
            _break_on_purpose(name, parts, world_size)
        return {"plan": plan_numbers(cfg, plan)}
    return record_steps(env, world_size, cfg, STEPS, before=before)


def _break_on_purpose(name: str, parts, cp: int) -> None:
    """The CONTROLS' faults, on the cp ranks."""
    module = parts.trainer.module
    if name.endswith("local"):  # each rank attends over its own tokens only
        for block in module.blocks:
            block.attn.context = lambda q, k, v, scale=None: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name.endswith("shift-after-cut"):  # the model shifts each rank's ids into labels
        parts.trainer.strategy.cp.targets = None
    if name.endswith("per-rank-mean"):
        _weigh_rank_means_alike(module, cp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(run_jobs, list(REFS.items()), _run_job)
    two = launch_clean(run_jobs, 2, tmp_path_factory.mktemp("cp2"), [(n, c) for n, (c, _) in CASES.items()],
                       _run_job)
    return one, two


@pytest.mark.parametrize("name", [n for n in CASES if n not in CONTROLS])
def test_context_parallel_split_equals_one_big_batch(runs, name):
    one, two = runs
    ref = _rec(one, CASES[name][1])
    tol = HALF_TOL.get(CASES[name][0].precision.name, SCALE_TOL)
    for rank in range(2):
        got = _rec(two[rank], name)
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert (a["items"], a["samples"]) == (b["items"], b["samples"]) and not a["skipped"], f"{name} {step}"
            assert a["loss"] == pytest.approx(b["loss"], rel=tol), f"{name}: loss at step {step}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol), f"{name}: norm at step {step}"
            sends = a["comm"]["cp_sends"] + a["comm"]["cp_all_to_alls"]
            assert sends > 0, f"{name}: step {step} exchanged nothing over the cp group"
        what = f"cp2 {name} rank {rank}"
        if tol == SCALE_TOL:
            _assert_close(got["grads"][0], ref["grads"][0], f"{what} grads step 1")
            _assert_close(got["params"][-1], ref["params"][-1], f"{what} params step {STEPS}")
        else:  # (AdamW moves an element whose gradient is near zero by up to lr whatever its rounding: the
            # weights after 3 steps are compared in fp32 only)
            assert_all_close_scaled(got["grads"][0], ref["grads"][0], f"{what} grads step 1", tol)


# cp 2 x tp 2 on 4 ranks (tp innermost: ranks 0, 1 one tp group, ranks 0, 2 one cp group), sequence parallelism
# on: each rank's half of a sequence is cut into 2 sequence shards between the attention and MLP regions; and
# pp 2 x cp 2 (ranks 0, 1 the first stage group, each holding half of every sequence).
CASES4 = {
    "ring-zigzag-tp2-ddp": (cp_config(4, 2, tp=2, clip=True), "clip"),
    "ring-contiguous-tp2-fsdp-ac": (cp_config(4, 2, layout="contiguous", strategy="fsdp", tp=2,
                                              checkpointing=True), "plain"),
    # pp 2 x cp 2: each stage group's 2 ranks split every sequence; the stages run on a rank's half
    "ring-zigzag-pp2-clip": (cp_config(2, 2, pp=2, clip=True), "clip"),
    "ulysses-contiguous-pp2-fsdp-ac": (cp_config(2, 2, "ulysses", "contiguous", strategy="fsdp", pp=2,
                                                 checkpointing=True), "plain"),
    "ring-zigzag-pp2-hf-llama": (hf_config(2, "llama", 2, pp=2), "llama"),  # rotary: each stage's side inputs
}


TIED = {"head.weight": "tok_emb.weight"}


@pytest.fixture(scope="module")
def runs4(runs, tmp_path_factory):
    return runs[0], launch_clean(run_jobs, 4, tmp_path_factory.mktemp("cp2tp2"),
                                 [(n, c) for n, (c, _) in CASES4.items()], _run_job)


@pytest.mark.slow  # 4 ranks on 2 cores
@pytest.mark.parametrize("name", list(CASES4))
def test_cp2_x_tp2_and_pp2_equal_one_big_batch(runs4, name):
    one, four = runs4
    ref = _rec(one, CASES4[name][1])
    held_by_all: set = set()
    for rank in range(4):
        got = _rec(four[rank], name)
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert (a["items"], a["samples"]) == (b["items"], b["samples"]), f"{name} {step}"
            assert a["loss"] == pytest.approx(b["loss"], rel=SCALE_TOL), f"{name}: loss at step {step}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=SCALE_TOL), f"{name}: norm at step {step}"
            numbers = got["plan"]["pp_stage_groups"][rank // 2] if "pp2" in name else got["plan"]
            assert a["comm"] == numbers["first_step" if step == 1 else "step"], (name, rank, step)
            assert a["comm"]["cp_sends"] + a["comm"]["cp_all_to_alls"] > 0
            assert a["comm"]["all_gathers" if "tp2" in name else "p2p_sends"] + a["comm"].get("p2p_recvs", 0) > 0
        # A pipeline rank holds its stages' parameters only; the last stage's head is its copy of the tied
        # embedding (one process names it once, tok_emb), its gradient the sum of both stages' after the step.
        held = {k: TIED.get(k, k) for k in got["params"][-1]}
        held_by_all |= set(held.values())
        _assert_close(got["grads"][0], {k: ref["grads"][0][v] for k, v in held.items()},
                      f"{name} rank {rank} grads step 1")
        _assert_close(got["params"][-1], {k: ref["params"][-1][v] for k, v in held.items()},
                      f"{name} rank {rank} params step {STEPS}")
    assert held_by_all == set(ref["params"][-1])


@pytest.mark.parametrize("name", [n for n in CASES if n not in CONTROLS])
def test_every_step_exchanges_what_plan_mode_predicts(runs, name):
    _, two = runs
    for rank in range(2):
        got = _rec(two[rank], name)
        numbers = got["plan"]
        assert numbers["mesh"]["cp"] == 2 and numbers["comm_dims"]["cp_sends"] == "cp"
        for step, want in ((1, numbers["first_step"]), (2, numbers["step"]), (3, numbers["step"])):
            assert got["outcomes"][step - 1]["comm"] == want, (name, rank, step)
    # 2 layers x the micro-batches: ring 1 send a forward (again in the recomputation), 1 + 2 a backward;
    # ulysses 2 all-to-alls a forward, 2 a backward
    step = _rec(two[0], name)["plan"]["step"]
    forwards, accum = 2 if name.endswith("ac") else 1, GLOBAL // CASES[name][0].batch.micro_batch_size
    assert (step["cp_sends"], step["cp_all_to_alls"]) == (
        (2 * accum * (forwards + 3), 0) if name.startswith("ring") else (0, 2 * accum * (2 * forwards + 2)))
    work = step and _rec(two[0], name)["plan"]["cp_attention_work"]
    assert (len(set(work)) == 1) == ("zigzag" in name), work


def test_clipping_acts_in_the_clipped_case(runs):
    one, _ = runs
    assert _rec(one, "clip")["outcomes"][0]["grad_norm"] > 2 * CLIP


@pytest.mark.parametrize("name", CONTROLS)
def test_attention_without_the_exchange_a_shift_after_the_cut_or_rank_means_fail_the_comparison(runs, name):
    one, two = runs
    got, ref = _rec(two[0], name), _rec(one, CASES[name][1])
    worst = max(scaled_error(got["grads"][0][k], ref["grads"][0][k]) for k in ref["grads"][0])
    assert worst > 100 * SCALE_TOL


# ---------------------------------------------------------------------------------------------- config errors


@pytest.mark.parametrize("change,key", [
    (dict(cp=3), "dist.cp.size=3"),
    (dict(data_block=22, block=22), "data.block_size=22"),
    (dict(method="ulysses", heads=3), "dist.cp.method='ulysses'"),
    (dict(method="star"), "dist.cp.method='star'"),
    (dict(layout="striped"), "dist.cp.layout='striped'"),
    (dict(dropout=0.1), "model.dropout=0.1"),
    (dict(target="dist_trainer.models.DigitsConvNet"), "dist.cp.size=2: supports the built-in GPT"),
    (dict(method="ulysses", tp=2), "dist.cp.method='ulysses'"),  # 2 heads: 1 a tp rank, not cut over cp 2
    (dict(tp=2, block=20, data_block=20), "data.block_size=20"),  # zigzag's 4 chunks, each cut over tp 2: 8
    (dict(moe=4), "dist.cp.size=2: with MoE layers"),
])
def test_what_cannot_work_is_a_config_error_naming_the_key(change, key):
    cfg = cp_config(4, change.get("cp", 2), change.get("method", "ring"), change.get("layout", "zigzag"),
                    tp=change.get("tp", 1))
    cfg.model = {**cfg.model, "block_size": change.get("block", 24), "n_head": change.get("heads", 2),
                 "n_embd": 12 if "heads" in change else 16, "dropout": change.get("dropout", 0.0),
                 "_target_": change.get("target", cfg.model["_target_"]), "moe": {"num_experts": change.get("moe", 0)}}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        validate(cfg, 2 * change.get("tp", 1))


@pytest.mark.parametrize("change,key", [
    (dict(packing=True), "data.packing=True"),
    (dict(task="masked_lm"), "dist.cp.size=2: supports the built-in GPT"),
    (dict(model_type="qwen3_moe"), "dist.cp.size=2: with MoE layers"),
])
def test_hugging_face_models_that_cannot_work_are_config_errors(change, key):
    cfg = hf_config(4, change.get("model_type", "llama"), 2)
    cfg.model["task"] = change.get("task", "causal_lm")
    cfg.data["packing"] = change.get("packing", False)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 2)


@pytest.mark.parametrize("model_type,config,cp,method,match", [
    ("mistral", {"sliding_window": 8}, 2, "ring", "sliding-window"),
    ("llama", {"attention_dropout": 0.1}, 2, "ring", "attention dropout"),
    ("llama", {}, 3, "ulysses", r"heads of a tp rank \(4\) divisible by dist.cp.size=3"),
    ("mixtral", {"num_local_experts": 4}, 2, "ring", "MoE layers"),
])
def test_what_a_hugging_face_model_cannot_do_fails_before_the_first_collective(model_type, config, cp, method, match):
    from dist_trainer.config import MeshShape
    from dist_trainer.models.hf import hf_model
    from dist_trainer.parallel.cp import apply_cp

    model = hf_model("causal_lm", model_type, {**HF, **config}, block_size=24, moe={})
    with pytest.raises(ConfigError, match=match):  # no process group exists: raised before any collective
        apply_cp(model, MeshShape("ddp", cp, 1, cp=cp), CPConfig(size=cp, method=method), 0, "cpu")


def test_the_batch_plan_counts_sequences_once_per_cp_group():
    plan = validate(cp_config(4, 2), 4)
    assert (plan.data_ranks, plan.mesh.grad_ranks, plan.accum_steps) == (2, 4, 1)
    assert [plan.mesh.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [plan.mesh.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [plan.mesh.counts_samples(r) for r in range(4)] == [True, False, True, False]
    assert "context-parallel groups of 2" in plan.mesh.describe()


# ------------------------------------------------ checkpoints across cp degrees, dp 2 x cp 2 (real launches)

E2E = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.block_size=32", "model.dropout=0",
       "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.log_every=1", "trainer.device=cpu",
       "batch.global_batch_size=8", "batch.micro_batch_size=2", "optim.warmup_steps=8", "optim.schedule=constant",
       "optim.eps=1e-6", "trainer.ckpt_every=2", "trainer.max_steps=4"]  # constant lr: a resume follows the run


@pytest.mark.slow  # three 2-rank launches, a 4-rank one and two one-process ones, about 90 s on 2 cores
def test_checkpoint_resumes_across_cp_degrees_and_dp2_x_cp2_equals_cp2(tmp_path):
    """cp changes nothing stored: a cp 2 checkpoint (ddp; fsdp's sharded one) resumes on one process and on 2
    data-parallel ranks without cp, each ending within 1e-5 of the uninterrupted cp 2 run; and 4 ranks of
    dp 2 x cp 2 (fsdp over all 4, ring zigzag) end within 1e-5 of it as well."""
    from test_checkpoint import ckpt, final_params, metrics, resumed_from, run_all
    from test_moe_ep import _cut_at_step_2

    cp2 = E2E + ["dist.cp.size=2"]
    first = run_all([(cp2 + [f"hydra.run.dir={tmp_path / 'ref'}"], 2),
                     (cp2 + ["dist.strategy=fsdp", "dist.cp.method=ulysses", f"hydra.run.dir={tmp_path / 'fsdp'}"], 2),
                     (cp2 + ["dist.strategy=fsdp", f"hydra.run.dir={tmp_path / 'dp2cp2'}"], 4)],
                    tmp_path, timeout=360)
    for result in first:
        assert result.returncode == 0, result.output[-4000:]
    ref = final_params(tmp_path / "ref")
    assert metrics(tmp_path / "ref")[1]["cp_sends"] == 4 * 2 * (1 + 1 + 2)  # 4 micro-batches x 2 layers
    assert metrics(tmp_path / "dp2cp2")[1]["cp_sends"] == 2 * 2 * (1 + 1 + 2)  # 2 data ranks: 2 micro-batches
    _assert_close(final_params(tmp_path / "fsdp"), ref, "cp 2 fsdp ulysses: final parameters")
    _assert_close(final_params(tmp_path / "dp2cp2"), ref, "4 ranks, dp 2 x cp 2, fsdp: final parameters")
    resumes = {"to1": (E2E, 0, "ref"), "todp2": (E2E, 2, "ref"), "fsdpto1": (E2E + ["dist.strategy=fsdp"], 0, "fsdp")}
    dirs = {name: _cut_at_step_2(tmp_path / src, tmp_path / name) for name, (_, _, src) in resumes.items()}
    results = run_all([(args + [f"hydra.run.dir={dirs[name]}"], nproc) for name, (args, nproc, _) in
                       resumes.items()], tmp_path, timeout=240)
    for result, (name, run_dir) in zip(results, dirs.items()):
        assert result.returncode == 0, result.output[-4000:]
        assert resumed_from(result.output) == str(ckpt(run_dir, 2)), result.output[-4000:]
        assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4]
        _assert_close(final_params(run_dir), ref, f"resumed {name}: final parameters")


def test_plan_mode_under_pipeline_stages_gives_context_parallelisms_numbers_too():
    # pp 2 x cp 2 under fsdp (8 ranks): the same cp keys, counts and line as cp 2 without stages (world 4).
    from dist_trainer.plan import plan_report

    def numbers(pp: int):
        cfg = cp_config(2, 2, strategy="fsdp", pp=pp)  # 2 micro-batches of 2 a data rank: one per stage
        return cfg, plan_numbers(cfg, validate(cfg, 4 * pp))

    (_, flat), (cfg, staged) = numbers(1), numbers(2)
    assert staged["mesh"]["cp"] == 2 and staged["mesh"]["pp"] == 2
    # one path: every key of the plan without stages is in the staged one, which adds its schedule's only
    assert set(flat) <= set(staged), set(flat) - set(staged)
    assert set(staged) - set(flat) == {"pp_stage_groups", "pp_bubble", "dist.pp.schedule", "dist.pp.stages_per_rank"}
    assert staged["frozen_mb"] == 0.0 and all(g["frozen_mb"] == 0.0 for g in staged["pp_stage_groups"])
    for key in ("cp_sends", "cp_all_to_alls"):
        assert staged["comm_dims"][key] == flat["comm_dims"][key] == "cp"
    assert staged["cp_attention_work"] == flat["cp_attention_work"]
    assert staged["step"]["cp_sends"] > 0
    assert "context parallelism per optimizer step (over each cp group of 2 ranks)" in plan_report(cfg, 8)
