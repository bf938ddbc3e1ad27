"""Autocast and loss scaling: the only module that knows the precision mode.

The choice is made once, at build time: the training step calls
``precision.autocast()`` and reads ``precision.scaler.scale`` without asking
which mode it is in. bf16 and fp32 get a scaler whose scale is always 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Collection, ContextManager, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .config import LossScaleConfig, PrecisionConfig, master_mode
from .norms import layer_norms_in_fp32

AUTOCAST_DTYPES = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
                   "bf16-master": torch.bfloat16, "fp16-master": torch.float16,
                   # float8 matmuls inside bf16 compute (dist_trainer/fp8.py)
                   "fp8-rowwise": torch.bfloat16, "fp8-rowwise-gw-hp": torch.bfloat16, "fp8-tensorwise": torch.bfloat16,
                   "fp8-mxfp8": torch.bfloat16}
NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm,
               nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


class LossScaleError(RuntimeError):
    """The dynamic loss scale would fall below its minimum: training cannot go on."""


class ConstantScaler:
    """Scale 1 that never changes: fp32 and bf16 need no loss scaling."""

    dynamic = False
    scale = 1.0

    def update(self, found_inf: bool, step: int) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling for fp16, decided on the host once per optimizer step.

    The scale stays constant through an accumulation window (it is read when each
    micro-batch's loss is scaled and changed only by ``update`` at the window's
    end), so every micro-batch's gradient carries the same factor and one
    division unscales their sum. ``found_inf`` must be the same on every rank;
    the trainer all-reduces it, so every rank's scale stays identical.
    """

    cfg: LossScaleConfig
    scale: float = 0.0  # the factor every micro-batch's loss is multiplied by
    growth_tracker: int = 0  # finite steps since the last change of scale
    hysteresis_left: int = 0  # overflows still tolerated before backing off
    history: List[Tuple[int, float]] = field(default_factory=list)  # (step, new scale)
    dynamic = True

    def __post_init__(self) -> None:
        self.scale = float(self.cfg.init_scale)
        self.hysteresis_left = self.cfg.hysteresis

    def update(self, found_inf: bool, step: int) -> None:
        cfg = self.cfg
        if not found_inf:
            self.growth_tracker += 1
            if self.growth_tracker >= cfg.growth_interval:
                self._set(self.scale * cfg.growth_factor, step)
            return
        self.growth_tracker = 0
        self.hysteresis_left -= 1
        if self.hysteresis_left > 0:
            return
        new_scale = self.scale * cfg.backoff_factor
        if new_scale < cfg.min_scale:
            recent = ", ".join(f"step {s}: {v:g}" for s, v in self.history[-8:]) or "none"
            raise LossScaleError(
                f"step {step}: gradients overflow even at loss scale {self.scale:g}; backing off would "
                f"go below precision.loss_scale.min_scale={cfg.min_scale:g} (recent scale changes: "
                f"{recent}). The loss or its gradients are diverging: lower optim.lr, set "
                "optim.grad_clip, lengthen optim.warmup_steps, or use precision=bf16-mixed."
            )
        self._set(new_scale, step)

    def _set(self, scale: float, step: int) -> None:
        self.scale = scale
        self.growth_tracker = 0
        self.hysteresis_left = self.cfg.hysteresis
        self.history = (self.history + [(step, scale)])[-32:]

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_left": self.hysteresis_left,
            "history": [list(h) for h in self.history],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.history = [(int(s), float(v)) for s, v in state["history"]]


class ModelWeights:
    """fp32 and *-mixed modes: the optimizer steps the model's own FP32 parameters."""

    sent_element_size = None  # DDP's all-reduce sends the buckets as they are

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]

    def optimizer_params(self) -> List[torch.Tensor]:
        return self.params

    def reduce_bucket(self, bucket: dist.GradBucket, group: dist.ProcessGroup | None) -> torch.futures.Future:
        # DDP's default: divide by world size, all-reduce (sum).
        return default_hooks.allreduce_hook(group, bucket)

    def accumulate(self) -> None:
        pass  # .grad accumulates across micro-batches by itself

    def grads(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its gradient) for every parameter that has one."""
        return [(p, p.grad) for p in self.params if p.grad is not None]

    # True when the gradients are views of DDP's buckets (gradient_as_bucket_view): they are
    # zeroed in place, so each backward accumulates straight into the bucket and no
    # gradient-sized copy is ever allocated beside it. Only set where every parameter gets
    # a gradient in every step (no find_unused_parameters), where zero and None are alike.
    keep_grad_buffers = False

    def zero_grad(self) -> None:
        for p in self.params:
            if self.keep_grad_buffers and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None

    def after_step(self) -> None:
        pass

    def fp32_state_dict(self, model: nn.Module, leave_out: Collection[str] = ()) -> Dict[str, torch.Tensor]:
        """FP32 copies of the state, but for the names in ``leave_out`` (a checkpoint's frozen weights)."""
        return _fp32_copy(_without(model.state_dict(), leave_out))

    def fp32_tensors(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The tensors whose values the FP32 state dict holds, by name, not copied: the model's own."""
        return model.state_dict()

    def load_fp32_state_dict(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        load_trained(model, state)


class MasterWeights:
    """*-master modes: half-precision parameters, FP32 masters owned by the optimizer side.

    Each parameter gets an FP32 master whose ``.grad`` is the FP32 accumulation
    buffer of the step. After every micro-batch but the last, the half gradient
    is added into it and cleared, so small contributions are not rounded away
    in a half-precision sum. The last micro-batch's backward all-reduces through
    ``reduce_bucket``: it adds the bucket's half gradients to the FP32 buffers
    and all-reduces that FP32 window sum. All-reducing only the last
    micro-batch's ``.grad`` would silently drop the other micro-batches' share
    of the other ranks and desynchronise them.
    """

    sent_element_size = 4  # the FP32 window sum is what goes on the wire

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        for master in self.masters:
            master.grad = torch.zeros_like(master)
        self.master_of = {p: m for p, m in zip(self.params, self.masters)}

    def optimizer_params(self) -> List[torch.Tensor]:
        return self.masters

    def reduce_bucket(self, bucket: dist.GradBucket, group: dist.ProcessGroup | None) -> torch.futures.Future:
        buffers = [self.master_of[p].grad for p in bucket.parameters()]
        window = torch.cat([(b + g.float()).view(-1) for b, g in zip(buffers, bucket.gradients())])
        window.div_(dist.get_world_size(group))  # DDP's convention: the mean over ranks
        future = dist.all_reduce(window, group=group, async_op=True).get_future()

        def unpack(fut: torch.futures.Future) -> torch.Tensor:
            reduced, offset = fut.value()[0], 0
            for buf in buffers:
                buf.copy_(reduced[offset:offset + buf.numel()].view_as(buf))
                offset += buf.numel()
            # DDP copies this into the half .grad, which nothing reads: the FP32
            # buffers now hold the step's gradient.
            return bucket.buffer().zero_()

        return future.then(unpack)

    @torch.no_grad()
    def accumulate(self) -> None:
        for p in self.params:
            if p.grad is not None:
                self.master_of[p].grad.add_(p.grad)
                p.grad = None

    def grads(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(model parameter, its FP32 gradient) for every parameter."""
        return [(p, m.grad) for p, m in zip(self.params, self.masters)]

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad.zero_()

    @torch.no_grad()
    def after_step(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # round the updated FP32 master into the half parameter

    def fp32_state_dict(self, model: nn.Module, leave_out: Collection[str] = ()) -> Dict[str, torch.Tensor]:
        state = _fp32_copy(_without(model.state_dict(), leave_out))
        # Every name of a tied parameter (a GPT's head.weight is its tok_emb.weight)
        # gets the master: the state dict holds both, and loading takes the last.
        # One copy per master: the names stay tied in the file as in the model.
        copies = {id(m): m.detach().cpu().clone() for m in self.master_of.values()}
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in self.master_of:  # trained, so never left out
                state[name] = copies[id(self.master_of[p])]
        return state

    def fp32_tensors(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """The tensors whose values the FP32 state dict holds, by name, not copied: the masters in place of the
        half parameters they stand for (under every name of a tied one), the model's own for the rest."""
        state = model.state_dict()
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in self.master_of:
                state[name] = self.master_of[p].detach()
        return state

    @torch.no_grad()
    def load_fp32_state_dict(self, model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
        load_trained(model, state)  # half parameters: rounded copies
        for name, p in model.named_parameters():
            if p in self.master_of:
                self.master_of[p].copy_(state[name])  # masters: exact


def frozen_names(model: nn.Module) -> set:
    """The state-dict names of the parameters that do not train (a LoRA model's base weights)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def load_trained(model: nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load ``state``, which may leave out frozen parameters (checkpoints do): they keep the values they were built with."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    absent = sorted(set(missing) - frozen_names(model))
    if absent or unexpected:
        raise RuntimeError(f"the saved model does not fit this one: missing {absent[:5]}, unexpected {unexpected[:5]}")


def _without(state: Dict[str, torch.Tensor], names: Collection[str]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k not in names} if names else state


def _fp32_copy(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """FP32 copies of a state dict's tensors; names that share one tensor (tied weights) share one copy."""
    from .parallel.state import data_key  # parallel imports this module

    copies: Dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state.items():
        key = data_key(v)
        if key not in copies or not key[0]:
            copies[key] = (v.float() if v.is_floating_point() else v).detach().cpu().clone()
        out[k] = copies[key]
    return out


class Precision:
    """Autocast, loss scaling and where the FP32 weights live, for one precision mode."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.name = cfg.name
        self.device_type = device.type
        # the fp8 modes over fp32 compute: FP32 weights and no autocast around the float8 matmuls
        fp32_compute = cfg.name.startswith("fp8-") and cfg.fp8.compute == "fp32"
        self.autocast_dtype = None if fp32_compute else AUTOCAST_DTYPES[cfg.name]
        self.param_dtype = self.autocast_dtype if master_mode(cfg) else None
        # Where the optimizer's FP32 weights live (and what the gradient all-reduce sends).
        self.weights_type = MasterWeights if self.param_dtype is not None else ModelWeights
        self.scaler = DynamicLossScaler(cfg.loss_scale) if cfg.name.startswith("fp16") else ConstantScaler()
        self.debug_overflow = cfg.debug_overflow
        # the float8 modes with power-of-two scales: the loss's backward factor a power of two too (Trainer)
        self.pow2_backward = cfg.name.startswith("fp8-") and cfg.fp8.pow2_scales

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def fp32_norms(self, model: nn.Module) -> nn.Module:
        """Every half mode: the LayerNorms compute in FP32 (norms.FP32LayerNorm), so their parameters' gradients,
        sums over a micro-batch's tokens, hold FP32's precision at any micro-batch size. Every strategy's model
        passes here before it is cut or wrapped; fp32 (and float8 over fp32 compute) keep torch's own."""
        return layer_norms_in_fp32(model) if self.autocast_dtype is not None else model

    def prepare(self, model: nn.Module) -> nn.Module:
        """Master modes store parameters in half precision; normalisation layers stay FP32."""
        if self.param_dtype is not None:
            model.to(self.param_dtype)
            for module in model.modules():
                if isinstance(module, NORM_LAYERS):
                    module.float()  # statistics and their affine in FP32
        return model

    def weights(self, model: nn.Module) -> "ModelWeights | MasterWeights":
        return self.weights_type(model)
