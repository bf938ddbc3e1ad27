"""Context parallelism's plan part: how many tokens of a micro-batch a rank holds (its share of every sequence,
padded to the layout's unit), the ring's sends or Ulysses' all-to-alls of a step, each cp rank's attention work,
and the printed line.

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from ..config import BatchPlan, Config, mib_text
from ..precision import Precision
from .cp import attention_work, expected_cp_comm, padded_length


def activation_size(precision: Precision) -> int:
    """Bytes of an activation element: the autocast dtype's, else the parameters'."""
    dtype = precision.autocast_dtype or precision.param_dtype or torch.float32
    return dtype.itemsize


def micro_batch_tokens(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's tokens: micro batch x data.block_size (the model's block_size if the data has none;
    1 where neither has: one activation row per sample)."""
    return plan.micro_batch_size * (cfg.data.get("block_size") or getattr(model, "block_size", None) or 1)


def sequence_length(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's sequence length: the data's block_size (the model's where the data has none); under
    pipeline stages the stages' fixed shape, the model's block_size."""
    if plan.mesh.pp > 1:  # the stages' fixed shape
        return getattr(model, "block_size", None) or cfg.data.get("block_size") or 1
    return micro_batch_tokens(cfg, plan, model) // plan.micro_batch_size


def rank_tokens(cfg: Config, plan: BatchPlan, model: nn.Module) -> int:
    """A micro-batch's tokens on a rank: under cp its share of every sequence, padded to the layout's unit."""
    mesh, length = plan.mesh, sequence_length(cfg, plan, model)
    if mesh.cp == 1:
        return plan.micro_batch_size * length
    return plan.micro_batch_size * padded_length(length, mesh.cp, cfg.dist.cp.layout, mesh.tp) // mesh.cp


def cp_comm(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision,
            layers: Optional[List[nn.Module]] = None) -> Dict[str, int]:
    """Context parallelism's exchanges in a step (``parallel.cp.expected_cp_comm``), for micro-batches of whole
    sequences of ``data.block_size`` tokens (pipeline stages: the model's block_size); activation checkpointing's
    recomputation runs each forward again. ``layers``: the attention modules that count (a stage group's)."""
    forwards = 1 + int(cfg.dist.activation_checkpointing)
    return expected_cp_comm(layers if layers is not None else model.context_modules(), cfg.dist.cp,
                            plan.micro_batch_size, sequence_length(cfg, plan, model), plan.accum_steps, forwards,
                            activation_size(precision), plan.mesh.tp)


def add_step(cfg: Config, plan: BatchPlan, model: nn.Module, precision: Precision, group: Dict[str, Any],
             counts: Dict[str, int]) -> None:
    """Attention's exchanges over each cp group, of the attention layers stage group ``group`` holds, counted
    apart."""
    if plan.mesh.cp > 1:
        counts.update(cp_comm(cfg, plan, model, precision, group["attention"]))


def cp_numbers(cfg: Config, plan: BatchPlan, model: nn.Module) -> Dict[str, Any]:
    """(query, key) pairs of one sequence each cp rank's attention computes: equal under zigzag."""
    if plan.mesh.cp == 1:
        return {}
    auto = cfg.batch.micro_batch_size == "auto"
    return {"cp_attention_work": None if auto else attention_work(sequence_length(cfg, plan, model), plan.mesh.cp,
                                                                  cfg.dist.cp.layout)}


def add_dims(cfg: Config, plan: BatchPlan, model: nn.Module, dims: Dict[str, str]) -> None:
    if plan.mesh.cp > 1:
        dims.update({"cp_sends": "cp", "cp_all_to_alls": "cp"})


def cp_comm_lines(numbers: Dict[str, Any]) -> List[str]:
    cp = numbers["mesh"].get("cp", 1)
    if cp == 1:
        return []
    step, work = numbers["step"], numbers["cp_attention_work"]
    if step["cp_sends"]:
        what = f"ring: {step['cp_sends']} sends of keys and values or their gradients, {mib_text(step['cp_send_bytes'])}"
    else:
        what = f"ulysses: {step['cp_all_to_alls']} all-to-alls, {mib_text(step['cp_all_to_all_bytes'])}"
    return [f"  context parallelism per optimizer step (over each cp group of {cp} ranks): {what}; attention "
            f"work per cp rank (query-key pairs of a sequence) {work}"]

