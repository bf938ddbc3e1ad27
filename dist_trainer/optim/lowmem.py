"""Optimizer state in less memory: AdamW's moments stored in bf16 (``optim.state_dtype=bf16``), or in 8 bits
through torchao (``optim.state_dtype=int8``, ``int8_adamw`` below).

torch's AdamW keeps its two moments in the parameters' dtype, FP32 here: 8 bytes a parameter. Stored in bf16 they
take 4. Each step reads them into FP32, runs torch's own AdamW update there (the same functional code as
``torch.optim.AdamW``), and stores them back rounded to bf16 (round to nearest). The update itself is computed in
FP32 from the rounded moments, so it loses only their 8 bits of mantissa; but the rounding is not split-invariant:
a last-bit difference in a gradient (another split of the same batch) can round a moment the other way, about
4e-3 of its value, where FP32 state differs by 1e-7 (docs/optimizers.md has the numbers).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam  # AdamW's own functional update (AdamW is Adam with decoupled decay)

MOMENTS = ("exp_avg", "exp_avg_sq")
# torchao's 8-bit state: a moment of at least INT8_MIN_ELEMENTS elements in whole blocks of INT8_BLOCK is stored as
# a byte an element, an FP32 scale a block and a 256-entry FP32 table; a smaller one in FP32 (bitsandbytes' rule)
INT8_BLOCK, INT8_MIN_ELEMENTS = 256, 4096


class AdamWBF16State(torch.optim.AdamW):
    """torch.optim.AdamW with its moments kept in bf16 between steps and updated in FP32."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            # FP32 working copies of the stored moments (a new state's zeros are created FP32 by _init_group)
            work = {key: [self.state[p][key].float() for p in params] for key in MOMENTS}
            beta1, beta2 = group["betas"]
            adam(params, grads, work["exp_avg"], work["exp_avg_sq"], max_exp_avg_sqs, steps,
                 amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], decoupled_weight_decay=True)
            for key in MOMENTS:
                for p, moment in zip(params, work[key]):
                    self.state[p][key] = moment.to(torch.bfloat16)


def int8_adamw(groups: list, lr: float, betas: tuple, eps: float) -> torch.optim.Optimizer:
    """torchao's AdamW8bit (``optim.state_dtype=int8``): block-wise quantised moments, dequantised, updated in FP32
    and quantised again each step (a maintained implementation that runs on CPU and CUDA, FSDP2's DTensors too).
    Quantisation rounds far more coarsely than bf16 state: not split-invariant, documented in docs/optimizers.md."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as err:
        from ..config import ConfigError

        raise ConfigError("optim.state_dtype=int8 needs torchao: pip install 'dist_trainer[fp8]'") from err
    return AdamW8bit(groups, lr=lr, betas=betas, eps=eps, block_size=INT8_BLOCK)
