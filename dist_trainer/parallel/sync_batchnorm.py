"""Synchronized BatchNorm that also works on CPU (gloo).

``torch.nn.SyncBatchNorm`` only runs on accelerators: DDP rejects it for CPU
modules and its kernels (``batch_norm_stats`` & co.) have no CPU
implementation.  ``CPUSyncBatchNorm`` computes the same numbers with plain
tensor ops plus ``torch.distributed.all_reduce``, so it runs on any backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    # Half precision sums over N*H*W elements lose too much precision, so
    # reduce in at least float32 (float64 inputs stay float64).
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        x = input.to(_stats_dtype(input))
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)  # broadcast per-channel stats
        local_n = x.numel() // x.size(1)

        # Local stats via var_mean (numerically stable), turned into sum and
        # sum of squares, which are what can be added across ranks.  Those are
        # packed as float64 so that the later "E[x^2] - E[x]^2" is far less
        # prone to catastrophic cancellation (inputs with |mean| >> std).  A rank with an empty batch contributes
        # zeros but still joins the collective, otherwise the others would hang.
        if local_n > 0:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            var, mean = var.double(), mean.double()
            sums, sumsqs = mean * local_n, (var + mean * mean) * local_n
        else:
            sums = sumsqs = torch.zeros(x.size(1), dtype=torch.float64, device=x.device)
        count = torch.full((1,), float(local_n), dtype=torch.float64, device=x.device)

        # ONE all_reduce of the packed [sum, sumsq, count]: collective latency,
        # not bandwidth, dominates for C-sized tensors.  Summing (rather than
        # averaging per-rank means) weights every sample equally even when
        # ranks hold batches of different sizes.
        packed = torch.cat([sums, sumsqs, count])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        sums, sumsqs, count = packed.split([x.size(1), x.size(1), 1])
        n = int(count.item())
        if n <= 1:  # same check as F.batch_norm; n is identical on every rank
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {n} in total"
            )
        mean = sums / n
        var = (sumsqs / n - mean * mean).clamp_(min=0)  # biased, used to normalise
        invstd = torch.rsqrt(var + eps)

        # Running stats use the unbiased variance of the *global* batch,
        # exactly like torch's (Sync)BatchNorm.
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (n / (n - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        mean, invstd = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        out = (x - mean) * invstd
        if weight is not None:
            out = out * weight.to(x.dtype).view(shape)
        if bias is not None:
            out = out + bias.to(x.dtype).view(shape)

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.n, ctx.group, ctx.has_bias = n, group, bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        x = input.to(mean.dtype)
        dims = [0] + list(range(2, x.dim()))
        shape = mean.shape
        g = grad_output.to(x.dtype)
        x_hat = (x - mean) * invstd  # recomputed instead of stored: saves memory

        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * x_hat).sum(dims)

        grad_input = grad_weight = grad_bias = None
        # weight/bias grads stay LOCAL: DDP all-reduces parameter gradients
        # itself, so reducing here too would count them world_size times
        # (torch.nn.SyncBatchNorm behaves the same way).
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)  # a bias implies affine, hence a weight

        if ctx.needs_input_grad[0]:
            # The input gradient depends on every sample of the global batch
            # through mean and var; again ONE packed all_reduce suffices.  Every
            # rank runs the same model, so all of them take this branch.
            C = x.size(1)
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=ctx.group)
            mean_dy = (packed[:C] / ctx.n).view(shape)
            mean_dy_xhat = (packed[C:] / ctx.n).view(shape)
            scale = invstd if weight is None else invstd * weight.to(x.dtype).view(shape)
            grad_input = (scale * (g - mean_dy - x_hat * mean_dy_xhat)).to(input.dtype)

        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class CPUSyncBatchNorm(_BatchNorm):
    """Drop-in ``nn.SyncBatchNorm`` replacement for inputs of shape (N, C, *).

    Statistics are synchronised across ``process_group`` (default: the
    default group) in training mode when more than one rank takes part;
    otherwise it behaves exactly like ``nn.BatchNorm*d``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, device=None,
                 dtype=None, *, bias=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("CPUSyncBatchNorm number of input channels should be non-zero")

    def _sync_group(self):
        """The group to synchronise over, or None when no sync is needed."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None  # eval mode uses running stats; no peers to talk to
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # Momentum / running-stat bookkeeping mirrors _BatchNorm.forward.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        group = self._sync_group()
        if group is None:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                bn_training, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, group)


def convert_sync_batchnorm(module: nn.Module, device: torch.device,
                           process_group=None) -> nn.Module:
    """Replace every BatchNorm*d in ``module`` by a synchronised version.

    On CUDA this is ``nn.SyncBatchNorm.convert_sync_batchnorm`` (fused
    kernels); elsewhere layers become ``CPUSyncBatchNorm``.  Like torch's
    version, parameters and buffers are shared, not copied, and the (possibly
    new) root module is returned.
    """
    if torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert_cpu(module, process_group)


def _convert_cpu(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm):
        out = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum,
                               module.affine, module.track_running_stats, process_group,
                               bias=module.bias is not None)
        if module.affine:
            # Re-using the Parameter objects keeps values, requires_grad and
            # any optimizer references intact.
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert_cpu(child, process_group))
    return out
