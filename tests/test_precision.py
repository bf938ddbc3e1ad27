"""Precision, loss scaling, lr schedule and batch arithmetic: single process, numbers not smoke.

Covers
- ``DynamicLossScaler`` on scripted overflow sequences (growth, backoff,
  hysteresis, min_scale, checkpoint round trips);
- the two numerical facts mixed precision rests on: fp16 gradients below
  2**-24 vanish unless the loss is scaled, and summing many fp16 micro-batch
  gradients needs an fp32 buffer;
- ``Precision`` for each mode, ``lr_at``/``scaled_lr``, ``derive_batch``/``validate``.

Scaler semantics asserted here (read from ``DynamicLossScaler.update``/``_set``):
- a finite step increments ``growth_tracker``; when it reaches
  ``growth_interval`` the scale is multiplied by ``growth_factor``;
- an overflow resets ``growth_tracker`` to 0 (an interrupted growth restarts
  counting from zero) and decrements ``hysteresis_left``; the scale backs off
  only when ``hysteresis_left`` reaches 0;
- whenever the scale changes (growth OR backoff) ``growth_tracker`` is 0 and
  ``hysteresis_left`` is ``cfg.hysteresis`` again, and ``(step, new scale)`` is
  appended to ``history``;
- a finite step between overflows does NOT restore ``hysteresis_left``
  (Megatron-LM's behaviour). Unlike Megatron, a backoff restores it, so with
  hysteresis=h every h-th consecutive overflow backs off, not every one after
  the first h.
"""

from __future__ import annotations

import io
import math
import re
from contextlib import nullcontext
from typing import List, Tuple

import pytest
import torch

from dist_trainer.config import (
    BatchConfig,
    Config,
    ConfigError,
    LossScaleConfig,
    OptimConfig,
    PrecisionConfig,
    derive_batch,
    scaled_lr,
)
from dist_trainer.validation import validate
from dist_trainer.optim import lr_at
from dist_trainer.precision import ConstantScaler, DynamicLossScaler, LossScaleError, Precision
from helpers import RegressionMLP

FP16_TINY = 2.0**-24  # smallest positive fp16 subnormal, ~5.96e-8

State = Tuple[float, int, int]  # (scale, growth_tracker, hysteresis_left)


def _state(s: DynamicLossScaler) -> State:
    return (s.scale, s.growth_tracker, s.hysteresis_left)


def _run(s: DynamicLossScaler, overflows: str, first_step: int = 1) -> List[State]:
    """Feed a script ('.' finite step, 'X' overflow) and return the state after each update."""
    states = []
    for i, c in enumerate(overflows):
        assert c in ".X"
        s.update(found_inf=(c == "X"), step=first_step + i)
        states.append(_state(s))
    return states


def _scaler(**kw) -> DynamicLossScaler:
    return DynamicLossScaler(LossScaleConfig(**kw))


# --------------------------------------------------------------------------- 1. DynamicLossScaler


def test_initial_state_from_config():
    s = _scaler(init_scale=2.0**10, hysteresis=3)
    assert _state(s) == (1024.0, 0, 3)
    assert s.history == [] and s.dynamic is True
    assert isinstance(s.scale, float)


def test_growth_after_exactly_growth_interval_finite_steps():
    s = _scaler(init_scale=8.0, growth_factor=2.0, growth_interval=3)
    assert _run(s, "......") == [
        (8.0, 1, 1),
        (8.0, 2, 1),
        (16.0, 0, 1),  # 3rd finite step: doubles, tracker resets
        (16.0, 1, 1),
        (16.0, 2, 1),
        (32.0, 0, 1),  # 6th: doubles again, no drift in the count
    ]
    assert s.history == [(3, 16.0), (6, 32.0)]


def test_growth_interval_one_grows_every_finite_step():
    s = _scaler(init_scale=1.0, growth_factor=4.0, growth_interval=1)
    assert [st[0] for st in _run(s, "...")] == [4.0, 16.0, 64.0]


def test_backoff_on_every_overflow_with_hysteresis_1():
    s = _scaler(init_scale=1024.0, backoff_factor=0.5, growth_interval=100, hysteresis=1)
    assert _run(s, "..X.XX", first_step=10) == [
        (1024.0, 1, 1),
        (1024.0, 2, 1),
        (512.0, 0, 1),  # overflow: halves at once, tracker reset
        (512.0, 1, 1),
        (256.0, 0, 1),
        (128.0, 0, 1),
    ]
    assert s.history == [(12, 512.0), (14, 256.0), (15, 128.0)]


def test_hysteresis_3_first_two_overflows_keep_scale_third_backs_off():
    s = _scaler(init_scale=1024.0, growth_interval=100, hysteresis=3)
    assert _run(s, "XXX") == [
        (1024.0, 0, 2),
        (1024.0, 0, 1),
        (512.0, 0, 3),  # third overflow backs off; hysteresis restored because the scale changed
    ]
    # Because the backoff restored hysteresis_left, the next two overflows are absorbed
    # again and only the third of them backs off (Megatron would back off on each one).
    assert _run(s, "XXX", first_step=4) == [(512.0, 0, 2), (512.0, 0, 1), (256.0, 0, 3)]
    assert s.history == [(3, 512.0), (6, 256.0)]


def test_finite_step_between_overflows_does_not_restore_hysteresis():
    s = _scaler(init_scale=1024.0, growth_interval=100, hysteresis=3)
    assert _run(s, "X.X.X") == [
        (1024.0, 0, 2),
        (1024.0, 1, 2),  # finite step: hysteresis_left stays 2
        (1024.0, 0, 1),
        (1024.0, 1, 1),
        (512.0, 0, 3),  # three overflows in total -> backoff, despite the finite steps between
    ]


def test_growth_restores_hysteresis():
    s = _scaler(init_scale=64.0, growth_interval=2, hysteresis=3)
    assert _run(s, "XX..") == [
        (64.0, 0, 2),
        (64.0, 0, 1),
        (64.0, 1, 1),
        (128.0, 0, 3),  # growth: hysteresis restored to cfg.hysteresis
    ]
    # So two more overflows are absorbed, not backed off after one.
    assert _run(s, "XXX", first_step=5) == [(128.0, 0, 2), (128.0, 0, 1), (64.0, 0, 3)]


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_growth_interrupted_by_overflow_restarts_count_from_zero(hysteresis):
    s = _scaler(init_scale=256.0, growth_interval=3, hysteresis=hysteresis)
    states = _run(s, "..X...")
    after_overflow = 128.0 if hysteresis == 1 else 256.0
    assert [st[:2] for st in states] == [
        (256.0, 1),
        (256.0, 2),
        (after_overflow, 0),  # one step short of growth: the overflow restarts the count
        (after_overflow, 1),
        (after_overflow, 2),
        (after_overflow * 2, 0),  # grows only at the 3rd finite step after the overflow
    ]
    assert s.history[-1] == (6, after_overflow * 2)


def test_min_scale_allows_reaching_it_and_raises_below():
    s = _scaler(init_scale=4.0, backoff_factor=0.5, min_scale=1.0, hysteresis=1)
    assert _run(s, "XX", first_step=41) == [(2.0, 0, 1), (1.0, 0, 1)]  # exactly min_scale is allowed
    with pytest.raises(LossScaleError) as info:
        s.update(found_inf=True, step=43)
    msg = str(info.value)
    assert "step 43" in msg
    assert "loss scale 1" in msg  # the scale that overflowed
    assert "precision.loss_scale.min_scale=1" in msg
    for advice in ("optim.lr", "optim.grad_clip", "bf16"):
        assert advice in msg, advice
    assert "step 41: 2, step 42: 1" in msg  # the recent history of scale changes
    assert s.scale == 1.0  # never set below min_scale
    assert isinstance(info.value, RuntimeError)


def test_min_scale_raise_waits_for_hysteresis():
    s = _scaler(init_scale=1.0, min_scale=1.0, hysteresis=3)
    assert _run(s, "XX") == [(1.0, 0, 2), (1.0, 0, 1)]  # absorbed: no error yet
    with pytest.raises(LossScaleError, match=r"step 3: .*loss scale 1\b"):
        s.update(found_inf=True, step=3)


def test_min_scale_non_power_of_two():
    s = _scaler(init_scale=3.0, backoff_factor=0.5, min_scale=1.0)
    assert _run(s, "X") == [(1.5, 0, 1)]
    with pytest.raises(LossScaleError, match=r"loss scale 1\.5.*precision\.loss_scale\.min_scale=1\b"):
        s.update(found_inf=True, step=2)  # 0.75 < 1


SCRIPT_BEFORE = "...X..XX.X.X."  # leaves scale changed, tracker and hysteresis mid-count
SCRIPT_AFTER = "..X.X....XX..X" + "X" * 12


def _mid_run_scaler() -> DynamicLossScaler:
    s = _scaler(init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=2.0**6)
    _run(s, SCRIPT_BEFORE)
    return s


def _trace(s: DynamicLossScaler, script: str, first_step: int):
    """State and history after each update, and the LossScaleError message if one is raised."""
    out = []
    for i, c in enumerate(script):
        try:
            s.update(found_inf=(c == "X"), step=first_step + i)
        except LossScaleError as e:
            out.append(("error", str(e)))
            break
        out.append((_state(s), list(s.history)))
    return out


def test_state_dict_round_trip_restores_everything_and_behaves_identically():
    orig = _mid_run_scaler()
    # grew at step 3, backed off at steps 7 and 10 (hysteresis 2), one overflow pending
    assert _state(orig) == (2048.0, 1, 1)  # the state the round trip must carry (non-default)
    assert orig.history == [(3, 8192.0), (7, 4096.0), (10, 2048.0)]
    state = orig.state_dict()
    assert state == {"scale": 2048.0, "growth_tracker": 1, "hysteresis_left": 1,
                     "history": [[3, 8192.0], [7, 4096.0], [10, 2048.0]]}

    restored = _scaler(init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=2.0**6)
    restored.load_state_dict(state)
    assert _state(restored) == _state(orig)
    assert restored.history == orig.history

    first = len(SCRIPT_BEFORE) + 1
    expected = _trace(orig, SCRIPT_AFTER, first)
    assert _trace(restored, SCRIPT_AFTER, first) == expected
    assert expected[-1][0] == "error"  # the continuation reaches min_scale, identically
    fresh = _scaler(init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=2.0**6)
    assert _trace(fresh, SCRIPT_AFTER, first) != expected  # so the restored state is what matters
    assert state["scale"] == 2048.0  # the state dict was a snapshot, not a view


def test_state_dict_survives_torch_save_load_weights_only():
    orig = _mid_run_scaler()
    buf = io.BytesIO()
    torch.save({"scaler": orig.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["scaler"]  # no pickled code in checkpoints
    assert loaded == orig.state_dict()

    restored = _scaler(init_scale=2.0**12, growth_interval=3, hysteresis=2, min_scale=2.0**6)
    restored.load_state_dict(loaded)
    assert _state(restored) == _state(orig) and restored.history == orig.history
    first = len(SCRIPT_BEFORE) + 1
    assert _trace(restored, SCRIPT_AFTER, first) == _trace(orig, SCRIPT_AFTER, first)


def test_constant_scaler_is_inert():
    s = ConstantScaler()
    s.update(found_inf=True, step=1)
    assert s.scale == 1.0 and s.dynamic is False
    assert s.state_dict() == {}


# --------------------------------------------------------------------------- 2. numerical facts


def test_fp16_range_facts():
    half = torch.float16
    assert torch.finfo(half).smallest_normal == 2.0**-14
    assert torch.tensor(FP16_TINY, dtype=half).item() == FP16_TINY  # the smallest subnormal exists
    assert torch.tensor(1e-8, dtype=half).item() == 0.0  # 1e-8 < 2**-25: rounds to zero
    assert torch.tensor(2.0**-26, dtype=half).item() == 0.0
    assert torch.tensor(65504.0, dtype=half).item() == 65504.0  # largest finite
    assert math.isinf(torch.tensor(65520.0, dtype=half).item())


def test_fp16_autocast_linear_underflows_without_loss_scale_and_survives_with_it():
    """A Linear under fp16 autocast whose output gradient is ~1e-8 (below 2**-24).

    The gradient arriving at the fp16 output is cast to fp16 and becomes 0, so the
    weight and bias gradients (fp32 parameters) are exactly 0, although their true
    values (~1e-7) are far from zero. Scaling the loss by 2**16 keeps the output
    gradient at ~6.6e-4, a normal fp16 number; unscaling the fp32 parameter gradient
    afterwards recovers the fp64 reference to fp16 precision.
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    upstream = (0.5 + 2.0 * torch.rand(8, 4, generator=g, dtype=torch.float64)) * 1e-8  # dL/dout
    assert upstream.max().item() < 2.0**-25  # all round to 0 in fp16

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4)
    ref_w = upstream.T @ x  # fp64 reference: dL/dW = dL/dout^T @ x
    ref_b = upstream.sum(0)
    assert ref_w.abs().max().item() > 1e-7  # the true gradient is not negligible

    grads = {}
    for scale in (1.0, 2.0**16):
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = lin(x.float())
        assert out.dtype == torch.float16
        loss = (out.float() * upstream.float()).sum()
        (loss * scale).backward()
        assert lin.weight.grad.dtype == torch.float32  # fp32 master gradients
        grads[scale] = (lin.weight.grad.double() / scale, lin.bias.grad.double() / scale)

    w1, b1 = grads[1.0]
    assert torch.count_nonzero(w1).item() == 0 and torch.count_nonzero(b1).item() == 0

    w16, b16 = grads[2.0**16]
    err_w = ((w16 - ref_w).norm() / ref_w.norm()).item()
    err_b = ((b16 - ref_b).norm() / ref_b.norm()).item()
    print(f"\n[2a autocast Linear] unscaled: |grad W|max=0 (ref {ref_w.abs().max().item():.3e}); "
          f"scale 2**16: rel err W {err_w:.2e}, b {err_b:.2e}")
    assert err_w < 1e-2 and err_b < 1e-2
    assert torch.count_nonzero(w16).item() == w16.numel()


def test_fp16_explicit_tensors_need_scaling_and_fp32_unscaling():
    """The same fact on explicit fp16 tensors: y = 3a in fp16, dL/dy = 1e-8.

    No scaling: dL/da == 0 exactly. Scaled by 2**16: dL/da = 3 * 2**16 * 1e-8 ~ 1.97e-3
    in fp16; unscaled in fp32 it is 3e-8 to fp16 precision, but unscaled in fp16 it
    would fall back into the subnormal range and lose ~all precision: so the
    division by the scale must happen in fp32.
    """
    true = 3e-8
    results = {}
    for scale in (1.0, 2.0**16):
        a = torch.ones(4, dtype=torch.float16, requires_grad=True)
        y = a * 3.0  # fp16
        loss = (y.float() * 1e-8).sum()
        (loss * scale).backward()
        assert a.grad.dtype == torch.float16
        results[scale] = a.grad
    assert torch.count_nonzero(results[1.0]).item() == 0
    scaled = results[2.0**16]
    unscaled_fp32 = scaled.float() / 2.0**16
    unscaled_fp16 = scaled / 2.0**16  # stays fp16
    err32 = ((unscaled_fp32.double() - true).abs().max() / true).item()
    err16 = ((unscaled_fp16.double() - true).abs().max() / true).item()
    print(f"\n[2a explicit fp16] unscaled grad 0; scaled+fp32 unscale rel err {err32:.2e}; "
          f"fp16 unscale rel err {err16:.2e}")
    assert err32 < 1e-3
    assert err16 > 0.5  # 3e-8 ~ half of the smallest subnormal


def test_fp32_accumulation_buffer_keeps_precision_fp16_buffer_loses():
    """256 micro-batch gradients (each rounded to fp16, as a half backward gives them),
    4096 parameters with magnitudes log-uniform in [1e-3, 1] and a consistent sign
    per parameter plus 50 % noise, summed in order into an fp16 vs an fp32 buffer,
    against the fp64 sum of the same fp16 values."""
    g = torch.Generator().manual_seed(0)
    n_micro, n = 256, 4096
    mag = 10.0 ** (-3 + 3 * torch.rand(n, generator=g, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    noise = 1 + 0.5 * torch.randn(n_micro, n, generator=g, dtype=torch.float64)
    micro_grads = (sign * mag * noise).to(torch.float16)
    ref = micro_grads.double().sum(0)

    buf16 = torch.zeros(n, dtype=torch.float16)
    buf32 = torch.zeros(n, dtype=torch.float32)
    for k in range(n_micro):
        buf16 += micro_grads[k]
        buf32 += micro_grads[k].float()

    def rel(buf):
        return ((buf.double() - ref).norm() / ref.norm()).item()

    def max_rel(buf):
        return ((buf.double() - ref).abs() / ref.abs()).max().item()

    e16, e32 = rel(buf16), rel(buf32)
    print(f"\n[2b {n_micro} micro-batches x {n}] rel err fp32 buffer {e32:.2e} (max elementwise "
          f"{max_rel(buf32):.2e}); fp16 buffer {e16:.2e} (max elementwise {max_rel(buf16):.2e}); "
          f"ratio {e16 / e32:.0f}x")
    assert e32 < 1e-6
    assert e16 > 100 * e32
    assert e16 > 1e-4  # fp16 loses real precision, not just relatively


# --------------------------------------------------------------------------- 3. Precision


def _matmul_dtype(precision: Precision) -> torch.dtype:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with precision.autocast():
        return (a @ b).dtype


def test_precision_fp32():
    p = Precision(PrecisionConfig(name="fp32"), torch.device("cpu"))
    assert isinstance(p.autocast(), nullcontext)
    assert _matmul_dtype(p) == torch.float32
    assert isinstance(p.scaler, ConstantScaler)
    assert p.scaler.dynamic is False and p.scaler.scale == 1.0


def test_precision_bf16_mixed():
    p = Precision(PrecisionConfig(name="bf16-mixed"), torch.device("cpu"))
    assert _matmul_dtype(p) == torch.bfloat16
    assert p.scaler.dynamic is False and p.scaler.scale == 1.0
    p.scaler.update(found_inf=True, step=1)
    assert p.scaler.scale == 1.0
    assert not torch.is_autocast_enabled("cpu")  # the context exited cleanly


def test_precision_fp16_mixed_uses_config_scale():
    ls = LossScaleConfig(init_scale=1024.0, hysteresis=2, growth_interval=5)
    p = Precision(PrecisionConfig(name="fp16-mixed", loss_scale=ls), torch.device("cpu"))
    assert _matmul_dtype(p) == torch.float16
    assert isinstance(p.scaler, DynamicLossScaler)
    assert p.scaler.dynamic is True
    assert p.scaler.scale == 1024.0 and p.scaler.hysteresis_left == 2
    assert p.scaler.cfg is ls


# --------------------------------------------------------------------------- 4. lr schedule


def test_linear_warmup_reaches_peak_at_last_warmup_update_then_constant():
    cfg = OptimConfig(warmup_steps=4, schedule="constant")
    lrs = [lr_at(u, 2.0, cfg, 100) for u in range(8)]
    assert lrs == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0], abs=1e-15)
    assert lr_at(99, 2.0, cfg, 100) == 2.0 and lr_at(500, 2.0, cfg, 100) == 2.0
    diffs = [b - a for a, b in zip(lrs[:4], lrs[1:4])]
    assert diffs == pytest.approx([0.5] * 3)  # linear


def test_cosine_decays_to_floor_at_the_last_update_and_stays():
    cfg = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    peak, total = 1.0, 21  # updates 0..20: 4 of warmup, then 16 decay intervals
    assert lr_at(3, peak, cfg, total) == pytest.approx(1.0)  # end of warmup
    assert lr_at(4, peak, cfg, total) == pytest.approx(1.0)  # decay starts at the peak
    assert lr_at(12, peak, cfg, total) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway
    assert lr_at(8, peak, cfg, total) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(19, peak, cfg, total) > 0.1 + 1e-4
    assert lr_at(total - 1, peak, cfg, total) == pytest.approx(0.1)  # the run's last update
    assert lr_at(21, peak, cfg, total) == pytest.approx(0.1)
    assert lr_at(1000, peak, cfg, total) == pytest.approx(0.1)
    lrs = [lr_at(u, peak, cfg, total) for u in range(3, 25)]
    assert all(b <= a + 1e-15 for a, b in zip(lrs, lrs[1:]))  # non-increasing after warmup
    assert min(lrs) == pytest.approx(0.1)


def test_cosine_without_warmup_starts_at_peak():
    cfg = OptimConfig(warmup_steps=0, schedule="cosine", min_lr_ratio=0.0)
    assert lr_at(0, 3e-4, cfg, 11) == pytest.approx(3e-4)
    assert lr_at(5, 3e-4, cfg, 11) == pytest.approx(1.5e-4)
    assert lr_at(10, 3e-4, cfg, 11) == pytest.approx(0.0, abs=1e-18)


@pytest.mark.parametrize("scaling, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_for_4x_global_batch(scaling, factor):
    cfg = OptimConfig(lr=1e-3, lr_scaling=scaling, base_batch_size=64)
    assert scaled_lr(cfg, 256) == pytest.approx(1e-3 * factor, rel=1e-12)
    assert scaled_lr(cfg, 64) == pytest.approx(1e-3, rel=1e-12)


# --------------------------------------------------------------------------- 5. batch arithmetic


def _config(**batch) -> Config:
    return Config(model={"_target_": "dist_trainer.models.GPT"},
                  data={"_target_": "dist_trainer.data.builtin.char_text"},
                  batch=BatchConfig(**batch),
                  optim=OptimConfig(lr=1e-3, lr_scaling="linear", base_batch_size=64))


def test_derive_accum_from_global():
    assert derive_batch(BatchConfig(micro_batch_size=16, global_batch_size=256), 2) == (8, 256)
    assert derive_batch(BatchConfig(micro_batch_size=16, global_batch_size=256, accum_steps=8), 2) == (8, 256)
    plan = validate(_config(micro_batch_size=16, global_batch_size=256), 2)
    assert (plan.world_size, plan.micro_batch_size, plan.accum_steps, plan.global_batch_size) == (2, 16, 8, 256)
    assert plan.micro_batch_size * plan.accum_steps * plan.world_size == plan.global_batch_size
    assert plan.lr == pytest.approx(4e-3) and plan.base_lr == 1e-3
    assert "global batch 256" in plan.describe()


def test_derive_global_from_micro_accum_world():
    assert derive_batch(BatchConfig(micro_batch_size=16, accum_steps=3), 2) == (3, 96)
    assert derive_batch(BatchConfig(micro_batch_size=16), 4) == (1, 64)
    plan = validate(_config(micro_batch_size=8, accum_steps=4), 3)
    assert (plan.accum_steps, plan.global_batch_size) == (4, 96)


def test_contradictory_accum_names_the_key():
    with pytest.raises(ConfigError) as info:
        derive_batch(BatchConfig(micro_batch_size=16, global_batch_size=256, accum_steps=4), 2)
    msg = str(info.value)
    assert "batch.accum_steps=4" in msg
    assert "= 8" in msg  # the value that would agree
    with pytest.raises(ConfigError, match=r"batch\.accum_steps"):
        validate(_config(micro_batch_size=16, global_batch_size=256, accum_steps=4), 2)


@pytest.mark.parametrize("glob, micro, world, accum",
                         [(100, 16, 2, None), (96, 10, 4, None), (250, 16, 1, None), (16, 16, 2, None), (120, 16, 2, 3)])
def test_impossible_split_names_keys_and_suggestions_work(glob, micro, world, accum):
    # Every suggestion must pass as it stands, with the batch.accum_steps the user set.
    with pytest.raises(ConfigError) as info:
        derive_batch(BatchConfig(micro_batch_size=micro, global_batch_size=glob, accum_steps=accum), world)
    msg = str(info.value)
    assert f"batch.global_batch_size={glob}" in msg
    assert f"batch.micro_batch_size={micro}" in msg
    listed = re.search(r"batch\.micro_batch_size in \[([\d, ]+)\] would divide it", msg)
    assert listed, msg
    micros = [int(m) for m in listed.group(1).split(",")]
    assert micros and micro not in micros
    for m in micros:  # every suggestion really works
        assert glob % (m * world) == 0, (m, msg)
        got_accum, g = derive_batch(BatchConfig(micro_batch_size=m, global_batch_size=glob, accum_steps=accum), world)
        assert m * got_accum * world == g == glob
    alt = (re.search(r"e\.g\. (\d+) or (\d+)", msg) if accum is None else
           re.search(r"batch\.global_batch_size=(\d+) \(micro x world x batch\.accum_steps\)", msg))
    assert alt, msg
    for g in map(int, alt.groups()):  # the suggested global batches work with the given micro
        assert g % (micro * world) == 0 and g > 0
        derive_batch(BatchConfig(micro_batch_size=micro, global_batch_size=g, accum_steps=accum), world)


def test_impossible_split_with_no_divisor_says_so():
    with pytest.raises(ConfigError) as info:
        derive_batch(BatchConfig(micro_batch_size=4, global_batch_size=6), 4)
    msg = str(info.value)
    assert "no micro batch divides it over 4 ranks" in msg
    assert "batch.global_batch_size=6" in msg and "batch.micro_batch_size=4" in msg


# --------------------------------------------------------------------------- 6. unscaling in the step


def _one_rank_trainer(precision: str, model: str = "helpers.RegressionMLP"):
    """A real Trainer (via run.build) on a gloo group of one, in this process."""
    import torch.distributed as dist

    from dist_trainer import distributed
    from dist_trainer.config import TrainerConfig
    from dist_trainer.run import build

    if not dist.is_initialized():  # conftest destroys it after the test
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = Config(
        model={"_target_": model, "in_dim": 4, "hidden": 16},
        data={"_target_": "dist_trainer.data.builtin.regression", "n": 40, "in_dim": 4, "shuffle": False},
        batch=BatchConfig(micro_batch_size=8, accum_steps=4),
        precision=PrecisionConfig(name=precision, loss_scale=LossScaleConfig(init_scale=2.0**10)),
        optim=OptimConfig(name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, grad_clip=None),
        trainer=TrainerConfig(max_steps=2, log_every=1, eval_every=0, device="cpu"),
    )
    plan = validate(cfg, 1)
    env = distributed.init("cpu")
    return build(cfg, plan, env).trainer


def _reference_step(model, batches, window):
    """Parameters before the step and the exact gradient of the step's sample mean."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ref_model = type(model)(4, 16)
    ref_model.load_state_dict(model.state_dict())
    total = sum(ref_model(b) * len(ix) for b, ix in zip(batches, window)) / sum(len(ix) for ix in window)
    grads = torch.autograd.grad(total, list(ref_model.parameters()))
    return before, dict(zip([k for k, _ in ref_model.named_parameters()], grads))


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("fp16-mixed", 2e-2)])
def test_step_update_is_exact_mean_gradient_also_for_a_smaller_last_step(precision, rtol):
    """SGD(lr=1) update == -(gradient of the summed loss / number of samples in the step).

    Step 1: a full window, 4 micro-batches of 8. Step 2: the end of the data, one
    micro-batch of 8 (docs/accumulation.md: "the last, smaller step is trained and
    normalised by what it holds"). The backward of each step divides by the loss
    divisor *in force during that step*, so the unscaling factor must use that same divisor.
    """
    trainer = _one_rank_trainer(precision)
    model = trainer.model.module
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, generator=g)

    for step, sizes in ((1, [8, 8, 8, 8]), (2, [8])):
        starts = [sum(sizes[:i]) + 32 * (step - 1) for i in range(len(sizes))]
        window = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
        batches = [{"x": x[ix], "y": y[ix]} for ix in window]

        ref, ref_grads = _reference_step(model, batches, window)

        outcome = trainer.train_step(batches, window, step)
        assert not outcome.skipped and outcome.samples == sum(sizes)
        for name, p in model.named_parameters():
            applied = ref[name] - p.detach()  # = lr * gradient used
            err = ((applied - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert err < rtol, (f"step {step} ({len(sizes)} micro-batches), {name}: update / exact gradient "
                                f"= {(applied.norm() / ref_grads[name].norm()).item():.4f}, rel err {err:.3g}")


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("fp16-mixed", 2e-2)])
@pytest.mark.parametrize("clip_ratio", [0.5, 2.0])  # optim.grad_clip as a multiple of the true norm
def test_grad_norm_is_of_the_unscaled_mean_gradient_and_clipping_bounds_the_update(precision, rtol, clip_ratio):
    # fp16 scales the loss by 2**10 here: a norm or clip taken before unscaling is off by 1024x.
    trainer = _one_rank_trainer(precision)
    model = trainer.model.module
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, generator=g)
    window = [list(range(i, i + 8)) for i in range(0, 32, 8)]
    batches = [{"x": x[ix], "y": y[ix]} for ix in window]
    before, grads = _reference_step(model, batches, window)
    true_norm = torch.cat([t.flatten() for t in grads.values()]).norm().item()
    clip = clip_ratio * true_norm
    trainer.optim_cfg.grad_clip = clip

    outcome = trainer.train_step(batches, window, 1)
    assert not outcome.skipped
    assert outcome.grad_norm == pytest.approx(true_norm, rel=rtol)  # reported before clipping
    applied = {k: before[k] - p.detach() for k, p in model.named_parameters()}  # SGD, lr 1: the gradient used
    applied_norm = torch.cat([t.flatten() for t in applied.values()]).norm().item()
    assert applied_norm == pytest.approx(min(clip, true_norm), rel=rtol)
    for name, grad in grads.items():  # same direction: clipping only shortens it
        expected = grad * min(1.0, clip / true_norm)
        assert ((applied[name] - expected).norm() / expected.norm()).item() < rtol, name


class MaskedMLP(RegressionMLP):
    """Item form: the squared error summed over the samples whose ``use_branch`` flag is set."""

    def forward(self, batch):
        mask = batch["use_branch"].float()
        err = (self.net(batch["x"]).squeeze(-1).float() - batch["y"]) ** 2
        return {"loss_sum": (err * mask).sum(), "num_items": mask.sum()}


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_a_step_with_no_items_is_skipped_without_touching_the_loss_scale(precision):
    # Not an overflow: fp16 must not back its scale off, and fp32 under the default
    # trainer.nonfinite=stop must not stop the run.
    trainer = _one_rank_trainer(precision, model=f"{__name__}.MaskedMLP")
    model = trainer.model.module
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    window = [list(range(0, 8)), list(range(8, 16))]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    scale = trainer.precision.scaler.scale
    none = [{"x": x[ix], "y": y[ix], "use_branch": torch.zeros(8, dtype=torch.bool)} for ix in window]
    outcome = trainer.train_step(none, window, 1)
    assert outcome.skipped and outcome.skip_reason == "no_items" and outcome.items == 0 and outcome.samples == 16
    assert trainer.skipped_total == 1 and trainer.consecutive_skips == 0 and trainer.updates == 0
    assert trainer.precision.scaler.scale == scale
    assert all(torch.equal(before[k], p.detach()) for k, p in model.named_parameters())
    # The next step, with items, trains as usual.
    some = [{**b, "use_branch": torch.arange(8) % 2 == 0} for b in none]
    outcome = trainer.train_step(some, window, 2)
    assert not outcome.skipped and outcome.items == 8 and trainer.updates == 1


def test_a_short_last_step_does_not_make_the_next_fp16_step_overflow(tmp_path):
    # 97 samples, global 32: every epoch ends with a step of 1 sample. The loss divisor
    # (items of an average micro-batch) must not be taken from that step: 32x smaller,
    # it made the next step's scaled losses overflow, skip, and halve the scale, every epoch.
    import json

    from dist_trainer.run import train
    from helpers import regression_config

    skipped, scales = {}, {}
    for n in (96, 97):
        cfg = regression_config(micro=8, glob=32, steps=40, precision="fp16-mixed", n=n)
        train(cfg, tmp_path / f"n{n}")
        records = [json.loads(line) for line in (tmp_path / f"n{n}" / "metrics.jsonl").read_text().splitlines()]
        skipped[n] = [r["step"] for r in records if r["skipped"]]
        scales[n] = records[-1]["loss_scale"]
    after_short = set(range(5, 41, 4))  # n=97: steps 4, 8, ... hold 1 sample
    assert not after_short & set(skipped[97]), skipped
    assert scales[97] == scales[96], scales
