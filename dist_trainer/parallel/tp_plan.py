"""Tensor parallelism's plan part: the activations' collectives of a step (``tp.expected_tp_comm``, of the
modules a stage group holds), what the sequence-parallel norms keep for backward, the mesh dimension and the
printed line.

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from ..config import MIB, BatchPlan, Config, mib_text
from ..precision import Precision
from .blocks import find_blocks
from .cp_plan import activation_size, micro_batch_tokens, rank_tokens
from .tp import FP8_AMAX_KEYS, TP_COMM_KEYS, expected_tp_comm, norm_activation_bytes


def tp_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
            held: Optional[Callable[[str], bool]] = None, tokens: Optional[int] = None) -> Dict[str, int]:
    """The tp collectives of one full step, for micro-batches of whole sequences (``micro_batch_tokens``).
    Padded batches of shorter sequences send less. ``held``: the modules that count (a stage group's);
    ``tokens``: a micro-batch's, where it is not the data's (pipeline stages run at the model's block_size)."""
    param_bytes = (precision.param_dtype or torch.float32).itemsize
    linear_bytes = activation_size(precision)
    blocks = find_blocks(model, cfg.dist.blocks) if cfg.dist.activation_checkpointing else []
    names = {id(m): name for name, m in model.named_modules()}
    loss = getattr(model, "loss_options", None)  # the built-in GPT's model.loss
    return expected_tp_comm(model, cfg.dist.tp, tokens or micro_batch_tokens(cfg, plan, model), plan.accum_steps,
                            param_bytes, linear_bytes, [names[id(b)] for b in blocks],
                            plan.accum_steps if cfg.dist.fsdp.accum_sync == "every" else 1, held,
                            loss.chunk_tokens if loss is not None and loss.chunked else None)


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """The activations' collectives of the modules stage group ``group`` holds, counted apart and in the
    totals."""
    if plan.mesh.tp == 1:
        return
    counts.update(dict.fromkeys(TP_COMM_KEYS, 0))
    for key, value in tp_comm(cfg, plan, model, precision, group["modules"], rank_tokens(cfg, plan, model)).items():
        counts[key] += value
        counts[key[len("tp_"):]] += value


def norm_activation_mb(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision) -> Optional[float]:
    """What the sequence-parallel norms save for backward per micro-batch on a rank (cut by tp under sp); None
    without tp, while the finder has the split to choose, and under pipeline stages (a stage's forward is not
    run alone in plan mode)."""
    if plan.mesh.tp == 1 or cfg.batch.micro_batch_size == "auto" or plan.mesh.pp > 1:
        return None
    return norm_activation_bytes(model, cfg.dist.tp, rank_tokens(cfg, plan, model),
                                 (precision.param_dtype or torch.float32).itemsize) / MIB


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    if plan.mesh.tp > 1:
        dims.update({key: "tp" for key in TP_COMM_KEYS + FP8_AMAX_KEYS if not key.endswith("_bytes")})


def tp_comm_lines(step: Dict[str, int], tp: int) -> List[str]:
    return [f"  tensor-parallel collectives per optimizer step (activations, over each tp group of {tp}): "
            f"all-reduces {step['tp_allreduces']}, {mib_text(step['tp_allreduce_bytes'])}; all-gathers "
            f"{step['tp_all_gathers']}, {mib_text(step['tp_all_gather_bytes'])}; reduce-scatters "
            f"{step['tp_reduce_scatters']}, {mib_text(step['tp_reduce_scatter_bytes'])} (also in the totals: all_gathers, "
            "reduce_scatters, allreduces)"]

