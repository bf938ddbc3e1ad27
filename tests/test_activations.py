"""Plan mode's activation memory (``activation_mb``: what autograd keeps for backward from one micro-batch's forward
on a rank) against the same measure of a real rank's forward, on 2 gloo ranks.

The built-in GPT on 8 sequences of 24 tokens a micro-batch (test_accumulation's data) under ddp (cp 1), context
parallelism at cp 2 (ring zig-zag and contiguous, Ulysses; fp32, bf16 autocast and bf16 weights; with activation
checkpointing, which keeps the blocks' inputs instead), float8 linears (fp8-rowwise over bf16 and fp32 compute), the chunked loss with and without cp, and a tiny llama at cp 2: each
rank's measured bytes equal the prediction exactly (the same forward on fake tensors at the rank's shape; the
llama at cp 1 within 1.1x above, see UPPER_BOUND; bf16 weights too, whose FP32LayerNorms keep FP32 statistics
in both), cp 2
keeps between 0.45 and 0.55 of cp 1's (1/cp but the few per-sequence tensors), and the chunked loss keeps less than
the plain one.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback

import pytest
import torch

from dist_trainer import distributed
from dist_trainer.activations import saved_bytes
from dist_trainer.config import CPConfig
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.parallel.blocks import find_blocks
from dist_trainer.plan import plan_numbers
from dist_trainer.run import build
from test_accumulation import gpt_config, launch_clean

MIB = 2 ** 20


def _config(cp: int = 1, method: str = "ring", layout: str = "zigzag", precision: str = "fp32",
            checkpointing: bool = False, chunked: bool = False, model: dict | None = None):
    cfg = gpt_config(8)
    cfg.model = model or {**cfg.model, "n_layer": 2, "loss": {"chunked": chunked, "chunk_tokens": 50}}
    cfg.precision = dataclasses.replace(cfg.precision, name=precision)
    return dataclasses.replace(cfg, dist=dataclasses.replace(
        cfg.dist, cp=CPConfig(size=cp, method=method, layout=layout), activation_checkpointing=checkpointing))


LLAMA = {"_target_": "dist_trainer.models.hf.hf_model", "task": "causal_lm", "model_type": "llama",
         "config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}}
CASES = {
    "cp1": _config(),
    "cp2-ring-zigzag": _config(2),
    "cp2-ring-contiguous": _config(2, layout="contiguous"),
    "cp2-ulysses": _config(2, "ulysses"),
    "cp1-bf16": _config(precision="bf16-mixed"),
    "cp2-ring-bf16": _config(2, precision="bf16-mixed"),
    "cp2-ring-bf16-master": _config(2, precision="bf16-master"),  # bf16 weights, FP32 norms
    "cp2-ring-checkpointing": _config(2, checkpointing=True),
    "cp1-chunked": _config(chunked=True),
    "cp2-ring-chunked": _config(2, chunked=True),
    "cp1-fp8": _config(precision="fp8-rowwise"),  # float8 linears (torchao, emulated) over bf16 compute
    "cp1-fp8-fp32": _config(precision="fp8-rowwise"),  # and over fp32
    "llama-cp1": _config(model=LLAMA),
    "llama-cp2-ring": _config(2, model=LLAMA),
}
CASES["cp1-fp8-fp32"].precision.fp8 = dataclasses.replace(CASES["cp1-fp8-fp32"].precision.fp8, compute="fp32")


def _measure(env, cfg) -> int:
    """Bytes this rank's forward of its first micro-batch keeps for backward (then its backward, as DDP expects)."""
    parts = build(cfg, validate(cfg, 2), env)
    trainer = parts.trainer
    blocks = find_blocks(trainer.module, cfg.dist.blocks) if cfg.dist.activation_checkpointing else []
    _, micro_batches = next(iter(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)))
    with trainer.precision.autocast():
        kept, out = saved_bytes(trainer.module, lambda: trainer.model(micro_batches[0]), blocks)
    out["loss_sum"].backward()
    return kept


def _worker(rank: int, world_size: int, jobs: list) -> dict:
    env = distributed.init("cpu")
    results = {}
    for name, cfg in jobs:
        try:
            results[name] = _measure(env, cfg)
        except Exception:
            results[name] = traceback.format_exc()
        gc.collect()
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("activations"), list(CASES.items()))


def _predicted(name: str) -> float:
    cfg = CASES[name]
    return plan_numbers(cfg, validate(cfg, 2))["activation_mb"]


# Transformers' own attention (a Hugging Face model at cp 1) sees fake tensors as tracing and then builds the
# causal mask and repeats the grouped keys and values, which its real forward does not: the prediction is above the
# measure there (measured 1.077x for the tiny llama). At cp > 1 the project's attention runs, and it is exact.
UPPER_BOUND = {"llama-cp1": 1.1}


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_keeps_what_plan_mode_predicts(measured, name):
    predicted = _predicted(name)
    for rank, results in enumerate(measured):
        assert isinstance(results[name], int), results[name]
        got = results[name] / MIB
        if name in UPPER_BOUND:
            assert got < predicted <= UPPER_BOUND[name] * got, (name, rank, got, predicted)
        else:
            assert got == pytest.approx(predicted, rel=1e-9), (name, rank)


@pytest.mark.parametrize("name", ["cp2-ring-zigzag", "cp2-ring-contiguous", "cp2-ulysses", "cp2-ring-bf16",
                                  "llama-cp2-ring"])
def test_cp2_keeps_about_half_of_cp1(measured, name):
    base = "llama-cp1" if name.startswith("llama") else "cp1-bf16" if "bf16" in name else "cp1"
    for results in measured:
        assert 0.45 <= results[name] / results[base] <= 0.55, (name, results[name], results[base])


def test_the_chunked_loss_keeps_less_and_checkpointing_less_still(measured):
    for results in measured:
        assert results["cp1-chunked"] < results["cp1"]
        assert results["cp2-ring-chunked"] < results["cp2-ring-zigzag"]
        assert results["cp2-ring-checkpointing"] < results["cp2-ring-zigzag"] / 2
