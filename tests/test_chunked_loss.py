"""``model.loss.chunked``: the GPT's head and cross-entropy chunk by chunk, against the plain (whole-logits) loss.

One process, a 2-layer GPT with a 1000-token vocabulary on 3 x 24 tokens, 29 of them with ignored targets (-100),
chunks of 7 and 17 tokens (neither divides 72; the 7-token chunks 1 and 2 hold only ignored targets) and one
chunk larger than the batch:

* fp32 (torch's ``F.linear_cross_entropy``): the loss equals the plain one within SAME_OPS_TOL (measured: exactly),
  the token count exactly, and every gradient within SCALE_TOL of the plain path's (measured at most 5.5e-7 under
  AVX-512, AVX2 and the default kernels; torch's kernel computes the softmax's gradient with other operations
  than the plain path's log-softmax backward and sums the head's gradient over chunks, so the two round apart as
  a reordering does: helpers.py's SCALE_TOL, not SAME_OPS_TOL). Neither is less accurate: against a float64
  model the chunked gradients are no further than 1.5x the plain ones (measured 0.7x).
* dist_trainer's own chunks (``_ChunkedHeadLoss``, used wherever the head runs in a half type), run in fp32: loss
  and gradients within SAME_OPS_TOL of the plain path (the same operations on the same rows; only the head
  weight's gradient is summed over chunks, measured 1.4e-7 of its scale).
* under bf16 and fp16 autocast, and with bf16 weights (bf16-master): the loss within SCALE_TOL, every gradient
  within the half type's rounding of the plain path's (3e-2 and 5e-3 of their scale, the bounds of
  test_master_weights; measured 2.6e-3, 3.8e-4 and 6.2e-3 with bf16 weights, the head weight's gradient alone:
  each chunk's is rounded to the half type once, where the plain path rounds the whole product once), and as
  accurate: against the float64 model the head weight's gradient and the whole set are no further than 1.25x the
  plain path's (measured 0.72x and 1.0x under bf16). With one chunk the operations are the plain path's exactly:
  within SAME_OPS_TOL.
* a batch whose targets are all ignored: loss 0, 0 items, zero gradients, on both paths.

Memory: bench/chunked_loss.py at vocabulary 32768 x 1000 tokens (125 MiB of float32 logits), each row in a fresh
process, the peak resident set a forward + backward adds (glibc's mmap threshold fixed low, so the resident set
follows the live tensors): the plain loss adds more than twice the logits (it keeps them and the log-softmax for
backward; measured 369 MiB), the chunked one less than a third of that (measured 16 MiB in fp32, 59 MiB under
bf16 autocast).

Two gloo ranks: 3 AdamW steps of the GPT on uneven valid tokens with model.loss.chunked=true (50-token chunks)
under ddp (4 micro-batches a step), fsdp with activation checkpointing (2), context parallelism (cp 2 under
ddp) and pipeline stages (pp 2: the last stage computes each micro-batch's summed loss in chunks) against one
process with the plain loss on one batch of 32: every step's loss, items and gradient norm, the
gradients of step 1 and the weights after step 3 within SCALE_TOL of their scale (measured 3.9e-7 and 3.5e-6).
Our own chunks on 2 ranks too: fp16-mixed under ddp (dynamic loss scaling through their backward) and bf16-master
under fsdp (FSDP's bf16 parameters), against one process's plain loss in the same precision, to the half type's
rounding (5e-3 and 3e-2; measured 3.8e-4 and 1.2e-2).
Tensor parallelism (tp 2 on the 2 ranks, with and without sequence parallelism, and fp16-mixed): each chunk's
cross-entropy on the ranks' vocabulary slices, against the same one-process plain loss (measured 3.6e-7 for the
gradients and 6.7e-7 for the weights in fp32; 3.6e-4 for fp16's gradients); every step's tp collectives equal
plan mode's, the chunks' all-reduces included.

Refused (a ConfigError naming model.loss.chunked, before anything is built): tp with dist.tp.loss_parallel=false
and Hugging Face masked LMs (causal LMs chunk: tests/test_chunked_loss_hf.py); wrong values of model.loss.* name their key. ``python -m dist_trainer
model.loss.chunked=true`` composes (the key is in conf/model/gpt.yaml) and reaches validation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_trainer.config import ConfigError, CPConfig, PPConfig, TPConfig
from dist_trainer.validation import validate
from dist_trainer.models import GPT
from dist_trainer.models.loss import IGNORE_INDEX, _ChunkedHeadLoss
from dist_trainer.parallel.tp import TP_COMM_KEYS
from dist_trainer.plan import plan_numbers
from helpers import (REPO, SAME_OPS_TOL, SCALE_TOL, assert_all_close_scaled, assert_close_scaled, record_steps,
                     run_jobs, run_module, scaled_error, set_floor)
from test_accumulation import GLOBAL, STEPS, gpt_config, in_one_process, launch_clean

MODEL = {"vocab_size": 1000, "block_size": 24, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}
# The half types' rounding of a gradient, relative to its scale (test_master_weights' bounds).
HALF_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
NOT_WORSE = 1.25  # the chunked half-type gradients' error from float64, at most this times the plain path's
# fp32's rounding of a sum of tens of terms taken in another order, relative to the set's scale: a few 1e-7.
REORDER_TOL = 1e-6


# ------------------------------------------------------------------------------------------ one process

def _batch(all_ignored: bool = False) -> dict:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (3, 24), generator=gen)
    targets = torch.randint(0, MODEL["vocab_size"], (3, 24), generator=gen)
    targets[0, 3:] = IGNORE_INDEX  # tokens 3-23: with 7-token chunks, chunks 1 and 2 hold no valid target
    targets[2, :8] = IGNORE_INDEX
    if all_ignored:
        targets[:] = IGNORE_INDEX
    return {"input_ids": ids, "targets": targets}


def _run(chunk: int | None, weights: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
         all_ignored: bool = False) -> tuple[torch.Tensor, int, dict]:
    """(loss_sum, num_items, gradients) of one forward and backward; chunk None: the plain loss."""
    torch.manual_seed(0)
    model = GPT(**MODEL, loss={"chunked": chunk is not None, "chunk_tokens": chunk or 1}).to(weights)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(_batch(all_ignored))
    out["loss_sum"].backward()
    assert out["loss_sum"].dtype == torch.float32
    return (out["loss_sum"].detach(), int(out["num_items"]),
            {name: p.grad.detach().double() for name, p in model.named_parameters()})


@pytest.fixture(scope="module")
def float64_run():
    """The plain loss of the same model in float64: the reference both paths' rounding is measured from."""
    return _run(None, weights=torch.float64)


def _set_error(got: dict, ref: dict) -> float:
    floor = set_floor(ref)
    return max(scaled_error(got[name], r, floor) for name, r in ref.items())


@pytest.mark.parametrize("chunk", [7, 17, 1000])
def test_fp32_chunked_loss_equals_the_plain_loss(chunk, float64_run):
    plain, chunked = _run(None), _run(chunk)
    assert chunked[1] == plain[1] == 43  # num_items: the valid targets, exactly
    assert_close_scaled(chunked[0], plain[0], f"loss_sum, chunks of {chunk}", SAME_OPS_TOL)
    assert_all_close_scaled(chunked[2], plain[2], f"gradients, chunks of {chunk}", SCALE_TOL)
    exact = float64_run[2]
    # Not less accurate than the plain path: its error from float64 within 1.5 times the plain path's, up to
    # REORDER_TOL (the chunks sum the head's gradient in another order; on an AMD EPYC with AVX-512, chunks of
    # 7 measured 8.8e-7 against the plain path's 4.8e-7). A sum kept in a half type would be 1e-3 or more.
    assert _set_error(chunked[2], exact) <= 1.5 * _set_error(plain[2], exact) + REORDER_TOL


@pytest.mark.parametrize("chunk", [7, 17])
def test_own_chunks_run_the_plain_operations(chunk):
    """_ChunkedHeadLoss (the half types' path) in fp32: the plain path's operations, chunk by chunk."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(72, 32, generator=gen, dtype=torch.float64).float()
    weight = (0.02 * torch.randn(1000, 32, generator=gen)).requires_grad_()
    targets = _batch()["targets"].reshape(-1)
    grads = []
    for own in (False, True):
        xi = x.clone().requires_grad_()
        loss = (_ChunkedHeadLoss.apply(xi, weight, targets, chunk, torch.float32) if own else GPT.loss_terms(
            torch.nn.functional.linear(xi, weight), targets)["loss_sum"])
        weight.grad = None
        (3.0 * loss).backward()  # a loss scale reaches the chunks' gradients through backward
        grads.append({"loss": loss.detach(), "x": xi.grad, "weight": weight.grad})
    assert_all_close_scaled(grads[1], grads[0], f"own chunks of {chunk} in fp32", SAME_OPS_TOL)


HALF_CASES = {  # name: (weights, autocast)
    "bf16-autocast": (torch.float32, torch.bfloat16),
    "fp16-autocast": (torch.float32, torch.float16),
    "bf16-weights": (torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(HALF_CASES))
@pytest.mark.parametrize("chunk", [7, 17])
def test_half_precision_chunked_loss_is_as_accurate_as_the_plain_loss(name, chunk, float64_run):
    weights, autocast = HALF_CASES[name]
    plain, chunked = _run(None, weights, autocast), _run(chunk, weights, autocast)
    assert chunked[1] == plain[1]
    assert_close_scaled(chunked[0], plain[0], f"{name} loss_sum", SCALE_TOL)
    assert_all_close_scaled(chunked[2], plain[2], f"{name} gradients", HALF_TOL[autocast])
    exact, head = float64_run[2], "tok_emb.weight"  # the head's weight (tied): what the chunks sum
    floor = set_floor(exact)
    head_error = scaled_error(chunked[2][head], exact[head], floor)
    assert head_error <= NOT_WORSE * scaled_error(plain[2][head], exact[head], floor), name
    assert _set_error(chunked[2], exact) <= NOT_WORSE * _set_error(plain[2], exact), name


@pytest.mark.parametrize("name", list(HALF_CASES))
def test_one_half_precision_chunk_is_the_plain_loss(name):
    weights, autocast = HALF_CASES[name]
    plain, chunked = _run(None, weights, autocast), _run(1000, weights, autocast)
    assert_close_scaled(chunked[0], plain[0], f"{name} loss_sum", SAME_OPS_TOL)
    assert_all_close_scaled(chunked[2], plain[2], f"{name} gradients, one chunk", SAME_OPS_TOL)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_batch_without_valid_targets_gives_zero(autocast):
    for chunk in (None, 7):
        loss, items, grads = _run(chunk, autocast=autocast, all_ignored=True)
        assert (loss.item(), items) == (0.0, 0)
        assert all(bool((g == 0).all()) for g in grads.values()), chunk


# ------------------------------------------------------------------------------------------ memory

@pytest.mark.slow  # the benchmark's own process and a 32k vocabulary: about 15 s
def test_chunked_loss_adds_a_fraction_of_the_plain_loss_peak(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chunked_loss.py"), "--vocab", "32768",
                           "--tokens", "1000", "--width", "64", "--chunks", "128", "--repeats", "0",
                           "--json", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for precision in ("fp32", "bf16-mixed"):
        plain, chunked = (next(r for r in rows if r["precision"] == precision and bool(r["chunk_tokens"]) == c)
                          for c in (False, True))
        # The measure sees the logits: the plain loss keeps them and the log-softmax for backward.
        assert plain["peak_mib"] > 2 * plain["logits_mib"], (precision, plain)
        assert chunked["peak_mib"] < plain["peak_mib"] / 3, (precision, chunked, plain)
        assert chunked["num_items"] == plain["num_items"] == 900
        assert chunked["loss_sum"] == pytest.approx(plain["loss_sum"], rel=SCALE_TOL), precision


# ------------------------------------------------------------------------------------------ two ranks

def _config(micro: int, chunked: bool, strategy: str = "ddp", cp: int = 1, precision: str = "fp32",
            checkpointing: bool = False, pp: int = 1, layers: int = 1, tp: TPConfig = TPConfig()):
    cfg = gpt_config(micro)  # test_accumulation's GPT on uneven valid tokens, 3 AdamW steps of 32 samples
    cfg.model["n_layer"] = layers
    # 50 tokens a chunk: divides no micro-batch (96, 192 or 768 tokens; 48 or 96 on a cp rank)
    cfg.model = {**cfg.model, "loss": {"chunked": chunked, "chunk_tokens": 50}}
    cfg.precision = dataclasses.replace(cfg.precision, name=precision)
    return dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, strategy=strategy, cp=CPConfig(size=cp),
                                                             pp=PPConfig(size=pp), tp=tp,
                                                             activation_checkpointing=checkpointing))


# One process, one batch of 32, the plain loss. bf16-master under fsdp, as on the 2 ranks: under ddp the step's
# gradients are the FP32 masters', not the bf16 model's .grad that _named_full reads.
REFERENCES = {"fp32": _config(GLOBAL, False), "fp16-mixed": _config(GLOBAL, False, precision="fp16-mixed"),
              "bf16-master": _config(GLOBAL, False, "fsdp", precision="bf16-master"),
              "fp32-2-layers": _config(GLOBAL, False, layers=2)}
CASES = {"ddp": _config(4, True), "fsdp-ac": _config(8, True, "fsdp", checkpointing=True),
         "cp2-ddp": _config(8, True, cp=2),
         # pp 2: the last stage computes each micro-batch's summed loss in chunks, inside the stage
         "pp2": _config(4, True, pp=2, layers=2),  # a block a stage
         # the half types: our own chunks, dynamic loss scaling through their backward, FSDP's bf16 parameters
         "ddp-fp16-mixed": _config(4, True, precision="fp16-mixed"),
         "fsdp-bf16-master": _config(8, True, "fsdp", precision="bf16-master"),
         # tp 2: each chunk's cross-entropy on the ranks' vocabulary slices (1000 rows: 500 a rank), the head's
         # input gathered from the sequence shards (or whole without sequence parallelism)
         "tp2": _config(4, True, tp=TPConfig(size=2)),
         "tp2-no-sp": _config(4, True, tp=TPConfig(size=2, sequence_parallel=False)),
         "tp2-fp16-mixed": _config(4, True, precision="fp16-mixed", tp=TPConfig(size=2))}
# One process's half-type run against 2 ranks': the half type's rounding (test_cp's and test_master_weights'
# bounds), for the loss and norm too; gradients of step 1 only (AdamW moves an element whose gradient is
# rounding noise by up to lr, so later weights are compared in fp32 only).
RUN_TOL = {"fp32": SCALE_TOL, "fp16-mixed": 5e-3, "bf16-master": 3e-2}


def _chunked_as_configured(parts, plan) -> dict:
    """The run computes its loss in chunks as configured (a pipeline's last stage returns the summed loss)."""
    module = parts.trainer.module
    assert module.loss_options.chunked == parts.model_config["loss"]["chunked"]
    if plan.mesh.pp > 1:
        assert parts.trainer.strategy.chunked_loss
    return {}


def _run_job(env, world_size: int, name: str, cfg) -> dict:
    """Each step's outcome, whole gradients of step 1, whole weights after the last step."""
    rec = record_steps(env, world_size, cfg, STEPS, before=_chunked_as_configured)
    return {**rec, "grads": rec["grads"][0], "params": rec["params"][0]}


def _worker(rank: int, world_size: int, jobs: list) -> dict:
    return run_jobs(rank, world_size, jobs, _run_job)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(_worker, list(REFERENCES.items()))
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("chunked2"), list(CASES.items()))
    return one, two


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_with_chunks_equal_one_process_without(runs, name):
    one, two = runs
    precision = CASES[name].precision.name
    ref, tol = one["fp32-2-layers" if name == "pp2" else precision], RUN_TOL[precision]
    assert "error" not in ref, ref.get("error")
    for rank, results in enumerate(two):
        got = results[name]
        assert "error" not in got, got.get("error")
        assert len(got["outcomes"]) == STEPS
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert (a["items"], a["samples"]) == (b["items"], b["samples"]) and not a["skipped"], (name, step)
            assert a["loss"] == pytest.approx(b["loss"], rel=tol), f"{name}: loss at step {step}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol), f"{name}: norm at step {step}"
        what = f"{name} rank {rank}"
        # A pipeline rank holds its stages' parameters; the last stage's head is its copy of the tied embedding.
        held = {k: "tok_emb.weight" if k == "head.weight" else k for k in got["params"]}
        assert_all_close_scaled(got["grads"], {k: ref["grads"][v] for k, v in held.items()},
                                f"{what} gradients of step 1", tol)
        if precision == "fp32":
            assert_all_close_scaled(got["params"], {k: ref["params"][v] for k, v in held.items()},
                                    f"{what} weights after step {STEPS}")
        if "pp" not in name:
            assert set(held) == set(ref["params"]), what


@pytest.mark.parametrize("name", [name for name in CASES if name.startswith("tp2")])
def test_tensor_parallel_chunks_issue_what_plan_mode_predicts(runs, name):
    """Every step's tp collectives (the chunks' all-reduces with the layers') equal plan.json's, call for call
    and byte for byte; the chunks' all-reduces carry loss_parallel's bytes (3 float32 values a token) in 2 calls a
    chunk, so the chunked plan differs from the plain one by calls only."""
    cfg = CASES[name]
    plan = validate(cfg, 2)
    step = plan_numbers(cfg, plan)["step"]
    for rank, results in enumerate(runs[1]):
        for number, outcome in enumerate(results[name]["outcomes"], 1):
            got = {key: outcome["comm"][key] for key in TP_COMM_KEYS}
            assert got == {key: step[key] for key in TP_COMM_KEYS}, (name, rank, number)
    plain = plan_numbers(_plain(cfg), validate(_plain(cfg), 2))["step"]
    tokens, chunks = 4 * 24, -(-4 * 24 // 50)  # a micro-batch's tokens on a tp rank; 2 chunks of 50
    assert step["tp_allreduce_bytes"] == plain["tp_allreduce_bytes"]
    assert step["tp_allreduces"] - plain["tp_allreduces"] == (2 * chunks - 3) * plan.accum_steps, tokens


def _plain(cfg):
    return dataclasses.replace(cfg, model={**cfg.model, "loss": {"chunked": False}})


# ------------------------------------------------------------------------------------------ what is refused

def test_tensor_parallelism_without_loss_parallel_refuses_the_chunked_loss():
    cfg = _config(4, True, tp=TPConfig(size=2, loss_parallel=False))
    with pytest.raises(ConfigError, match=r"^model\.loss\.chunked=True: with dist\.tp\.size=2 computes .* set "
                                          r"dist\.tp\.loss_parallel=true"):
        validate(cfg, 2)
    cfg.model["loss"]["chunked"] = False
    validate(cfg, 2)  # the plain loss runs there


def test_a_hugging_face_masked_lm_refuses_the_chunked_loss():
    """Causal LMs chunk (tests/test_chunked_loss_hf.py); a masked LM's head transforms the hidden states first."""
    cfg = _config(4, True)
    cfg.model = {"_target_": "dist_trainer.models.hf.hf_model", "task": "masked_lm", "model_type": "bert",
                 "loss": {"chunked": True}}
    with pytest.raises(ConfigError, match=r"^model\.loss\.chunked=True: is for causal LMs"):
        validate(cfg, 1)


@pytest.mark.parametrize("loss,key", [
    ({"chunked": "yes"}, "model.loss.chunked='yes'"),
    ({"chunked": True, "chunk_tokens": 0}, "model.loss.chunk_tokens=0"),
    ({"chunked": True, "chunk_tokens": 2.5}, "model.loss.chunk_tokens=2.5"),
    ({"chunked": True, "chunk_tokens": True}, "model.loss.chunk_tokens=True"),
    ({"chunk": 64}, "model.loss.chunk: not a key"),
])
def test_wrong_values_name_their_key(loss, key):
    cfg = _config(4, True)
    cfg.model["loss"] = loss
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        validate(cfg, 1)
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.")):
        GPT(**MODEL, loss=loss)


def test_the_cli_override_reaches_validation(tmp_path):
    """model.loss.chunked is in conf/model/gpt.yaml: a plain override (no +) composes and is validated."""
    proc = run_module(["model.loss.chunked=true", "dist.tp.size=2", "dist.tp.loss_parallel=false", "plan.only=true",
                       "plan.world_size=2",
                       f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "model.loss.chunked=True: with dist.tp.size=2 computes" in proc.stdout + proc.stderr
