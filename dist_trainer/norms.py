"""LayerNorm computed in FP32 whatever its input's dtype: the half modes' norms (precision.py swaps them in).

A LayerNorm's weight and bias gradients are sums over every token of the micro-batch. torch's CPU kernel, given a
bf16 input, accumulates them at bf16's precision whether its parameters are bf16 or FP32, so their error grows
with the micro-batch: 3.8e-2 of their scale off FP32 at 1,024 tokens of width 64, 1.3e-2 for the same tokens in 8
micro-batches of 128. (An ``nn.Linear``'s bias gradient, 1.7e-3 either way; ``nn.RMSNorm``, ``nn.GroupNorm`` and the
Hugging Face families' RMSNorms, 2-5e-3 either way: their sums accumulate in FP32.) Megatron's fused norms and torch's
CUDA kernels accumulate in FP32; here the whole norm runs in FP32 on every device: statistics, output and the
parameters' gradients, the output and the input's gradient rounded once to the input's dtype.

The input is kept for backward as it came (a half input stays half), with the FP32 statistics, as torch's own
LayerNorm keeps them: the activation memory is the plain LayerNorm's. An FP32 input runs torch's own kernels on
the same tensors, so its numbers are the plain LayerNorm's bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn


def _fp32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.float()


class _LayerNormInFP32(torch.autograd.Function):
    """``F.layer_norm`` of ``x`` upcast to FP32 with FP32 parameters; output and input gradient in ``x``'s dtype,
    the parameters' gradients in theirs (a half parameter's rounded once, from its FP32 sum over the tokens)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                shape: Sequence[int], eps: float) -> torch.Tensor:
        out, mean, rstd = torch.ops.aten.native_layer_norm(x.float(), shape, _fp32(weight), _fp32(bias), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        want = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), ctx.shape, mean, rstd, _fp32(weight), _fp32(bias), want)
        return (grad_x.to(x.dtype) if want[0] else None, grad_w.to(weight.dtype) if want[1] else None,
                grad_b.to(bias.dtype) if want[2] else None, None, None)


class FP32LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same state-dict names) that computes in FP32 whatever its input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNormInFP32.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)


def layer_norms_in_fp32(model: nn.Module) -> nn.Module:
    """Every plain ``nn.LayerNorm`` of ``model`` becomes an FP32LayerNorm, in place (a subclass of one: its own
    forward, which this would drop, stays)."""
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = FP32LayerNorm
    return model
