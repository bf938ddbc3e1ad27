"""Half precision whose error does not grow with the micro-batch: the promise per mode (docs/precision.md).

The built-in GPT with its biases (2 layers, 64 wide, 4 heads), 16 sequences of 64 tokens a step, SGD, 3 steps, in
every half mode, split two ways: one micro-batch of 16 in one process, and 2 ranks x 2 micro-batches of 2 x 4.
Each is compared with the same run in fp32 (one process, one micro-batch of 16), tensor by tensor: the norm of the
difference of the two runs' updates (the FP32 weights after 3 steps less the initial ones) over the norm of fp32's
update. The half type's rounding of each element is the whole difference: it must not depend on how many tokens a
micro-batch holds. Before the LayerNorms computed in FP32 (dist_trainer/norms.py), bf16-master's one micro-batch of
16 ended 0.21 of a LayerNorm bias's update away from fp32 (2 x 2 x 4: 1.4e-2), fp8-rowwise's 0.21.

fp32 itself splits exactly (within SCALE_TOL), and so do the float8 recipes over FP32 compute for every step's
gradients given the same weights (rowwise, rowwise-gw-hp, MXFP8; biases included): asserted at step 1, where both
splits start from the same weights. After it the two splits' weights differ by fp32's rounding of the gradients'
sums, as in fp32, and float8's rounding moves the rare element within that distance of a rounding boundary by a
float8 step (docs/precision.md), so whole runs are compared with fp32 at float8's bound, not with each other.

One 2-rank launch serves every mode (run_jobs); the one-process runs, fp32's reference among them, run once here.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dist_trainer.config import (BatchConfig, Config, DistConfig, Fp8Config, OptimConfig, PrecisionConfig,
                                 TrainerConfig)
from dist_trainer.norms import FP32LayerNorm
from dist_trainer.precision import Precision
from helpers import SCALE_TOL, assert_all_close_scaled, job_record, record_steps, run_jobs
from test_accumulation import in_one_process, launch_clean

SEQUENCES, TOKENS, STEPS = 16, 64, 3
HALF_MODES = ("bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master",
              "fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-tensorwise", "fp8-mxfp8")  # float8 over bf16 compute
# Float8 over FP32 compute, whose gradients split exactly given the same weights. Tensorwise is left out: its scale
# follows its micro-batch's largest element, so an element more than 2^14 times smaller lands in float8's subnormals
# at an exponent that depends on the split (3.0e-4 of this model's gradients at step 1; docs/precision.md).
FP32_COMPUTE = ("fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-mxfp8")
# Each tensor's update error against fp32's, by norm: the half type's rounding, carried through 3 steps. Measured
# (the largest over the tensors and both splits, under ATEN_CPU_CAPABILITY avx512, avx2 and default; always a
# LayerNorm's weight), the bound a margin over it:
#   bf16: 7.3e-3 (bf16-master, default kernels; 6.7e-3 avx512), bound 2e-2 (2.7x)
#   fp16: 1.1e-3 (fp16-master), bound 5e-3 (4.5x)
#   float8: 7.3e-2 over bf16 compute (tensorwise, default kernels; 7.1e-2 avx512 and avx2), 6.5e-2 over FP32
#     compute; e4m3 keeps 3 mantissa bits, so 6 % is one rounding. Bound 8e-2: 7e-3 above the largest, 3.5x the
#     2e-3 the instruction sets move it.
# Before the fix one micro-batch of 16 failed every master and float8 mode (bf16-master 0.21, fp16-master 7.9e-3,
# the float8 recipes 0.21-0.22), while 2 x 2 x 4 passed (1.4e-2, 1.3e-3, 6.9e-2-7.1e-2).
BOUNDS = {"bf16": 2e-2, "fp16": 5e-3, "fp8": 8e-2}
# The floor of an update's scale: 1e-3 of the largest tensor's RMS update. The key bias's true gradient is exactly
# zero (softmax ignores a shift shared by all keys), so its update is rounding (an RMS of 2e-13 against 3.4e-3);
# every other tensor is measured against its own norm (the smallest, a query bias, has 1.7e-3 of the largest RMS).
UPDATE_FLOOR = 1e-3


def _config(precision: str, micro: int, compute: str = "bf16") -> Config:
    return Config(
        model={"_target_": "dist_trainer.models.GPT", "vocab_size": 256, "block_size": TOKENS, "n_layer": 2,
               "n_head": 4, "n_embd": 64, "dropout": 0.0, "bias": True},
        data={"_target_": "dist_trainer.data.builtin.char_text", "block_size": TOKENS},
        batch=BatchConfig(micro_batch_size=micro, global_batch_size=SEQUENCES),
        precision=PrecisionConfig(name=precision, fp8=Fp8Config(compute=compute)),
        optim=OptimConfig(name="sgd", lr=0.1, momentum=0.0, weight_decay=0.0, grad_clip=None),
        trainer=TrainerConfig(max_steps=STEPS, log_every=1, eval_every=0),
        dist=DistConfig(),
    )


def _jobs(micro: int) -> list:
    jobs = [("fp32", _config("fp32", micro))] + [(mode, _config(mode, micro)) for mode in HALF_MODES]
    return jobs + [(f"{mode} fp32-compute", _config(mode, micro, "fp32")) for mode in FP32_COMPUTE]


def _fp32_weights(parts) -> dict:
    """The FP32 weights by name (the masters in the master modes), copied."""
    return {k: v.detach().float().clone() for k, v in parts.trainer.strategy.full_state_dict().items()}


def _run_job(env, world_size: int, name: str, cfg: Config) -> dict:
    return record_steps(env, world_size, cfg, STEPS, before=lambda parts, plan: {"init": _fp32_weights(parts)},
                        after=lambda parts: {"final": _fp32_weights(parts)})


def _worker(rank: int, world_size: int, jobs: list) -> dict:
    return run_jobs(rank, world_size, jobs, _run_job)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(_worker, _jobs(SEQUENCES))
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("half"), _jobs(2))
    return SimpleNamespace(one=one, two=two, ref=job_record(one, "fp32"))


def update_errors(got: dict, ref: dict) -> dict:
    """Per tensor: |update - ref's update| / max(|ref's update|, the floor), norms in float64."""
    delta = {k: (ref["final"][k] - ref["init"][k]).double() for k in ref["init"]}
    got_delta = {k: (got["final"][k] - got["init"][k]).double() for k in delta}
    top_rms = max(d.norm().item() / d.numel() ** 0.5 for d in delta.values())
    return {k: ((got_delta[k] - d).norm() / max(d.norm().item(), UPDATE_FLOOR * top_rms * d.numel() ** 0.5)).item()
            for k, d in delta.items()}


def _splits(runs, name: str) -> list:
    """(label, record) of both splits of job ``name``: one micro-batch of 16, and each rank of 2 x 2 x 4."""
    return [("1 x 16", job_record(runs.one, name))] + [
        (f"2 x 2 x 4 rank {rank}", job_record(results, name)) for rank, results in enumerate(runs.two)]


def _bound(mode: str) -> float:
    return BOUNDS["fp8" if mode.startswith("fp8") else mode[:4]]


def test_fp32_splits_exactly(runs):
    for label, got in _splits(runs, "fp32")[1:]:
        errors = update_errors(got, runs.ref)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= SCALE_TOL, f"fp32 {label}: {worst} {errors[worst]:.2e}"


@pytest.mark.parametrize("mode", HALF_MODES)
def test_half_modes_stay_within_the_half_types_rounding_of_fp32_at_any_micro_batch(runs, mode):
    for label, got in _splits(runs, mode):
        assert not any(o["skipped"] for o in got["outcomes"]), f"{mode} {label}: a step was skipped"
        errors = update_errors(got, runs.ref)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= _bound(mode), f"{mode} {label}: {worst}'s update {errors[worst]:.2e} from fp32's"


@pytest.mark.parametrize("mode", FP32_COMPUTE)
def test_float8_over_fp32_compute_splits_exactly_biases_included(runs, mode):
    name = f"{mode} fp32-compute"
    ref = job_record(runs.one, name)
    for label, got in _splits(runs, name)[1:]:
        # step 1: both splits from the same weights, every float8 cast sees the same numbers
        assert_all_close_scaled(got["grads"][0], ref["grads"][0], f"{name} {label} gradients of step 1")
    for label, got in _splits(runs, name):
        errors = update_errors(got, runs.ref)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= BOUNDS["fp8"], f"{name} {label}: {worst}'s update {errors[worst]:.2e} from fp32's"


def test_fp32_layer_norm_is_torchs_for_fp32_and_sums_a_half_inputs_tokens_in_fp32():
    """FP32LayerNorm: torch's LayerNorm bit for bit on an FP32 input, the same state-dict names; on a bf16 input of
    1,024 tokens its weight and bias gradients are the FP64 sums of the same (rounded) inputs to fp32's rounding
    (torch's CPU kernel: 3.8e-2 off), its output and input gradient bf16, rounded once."""
    torch.manual_seed(0)
    x, grad = torch.randn(16, 64, 64), torch.randn(16, 64, 64)
    plain = nn.LayerNorm(64)
    with torch.no_grad():
        plain.weight.add_(0.1 * torch.randn(64))
        plain.bias.add_(0.1 * torch.randn(64))
    ours = Precision(PrecisionConfig(name="bf16-master"), torch.device("cpu")).fp32_norms(copy.deepcopy(plain))
    assert type(ours) is FP32LayerNorm and ours.state_dict().keys() == plain.state_dict().keys()
    assert type(Precision(PrecisionConfig(name="fp32"), torch.device("cpu")).fp32_norms(plain)) is nn.LayerNorm

    def run(module: nn.Module, inp: torch.Tensor, out_grad: torch.Tensor) -> list:
        inp = inp.clone().requires_grad_()
        out = module(inp)
        out.backward(out_grad)
        return [out.detach(), inp.grad, module.weight.grad, module.bias.grad]

    for a, b in zip(run(ours, x, grad), run(plain, x, grad)):
        assert torch.equal(a, b)
    ours.zero_grad()
    plain.zero_grad()
    half = run(ours, x.bfloat16(), grad.bfloat16())
    exact = run(copy.deepcopy(plain).double(), x.bfloat16().double(), grad.bfloat16().double())
    assert [t.dtype for t in half] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    rel = [((h.double() - e).norm() / e.norm()).item() for h, e in zip(half, exact)]
    assert max(rel[:2]) < 4e-3 and max(rel[2:]) < 1e-5, rel  # bf16's rounding (2^-9); fp32's (measured 4.7e-7)
