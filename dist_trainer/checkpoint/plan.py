"""Checkpoints' plan part: the host memory a background checkpoint copies on the largest rank
(``ckpt_staging_mb``, trainer.ckpt_async).

Shapes only (a meta model is enough): no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

from typing import Collection, Dict, List, Optional

import torch
from torch import nn

from ..config import Config
from ..optim.plan import optimizer_state_bytes
from ..parallel.dp_plan import shard_elements, sharded_by_fsdp


def expected_staging_bytes(cfg: Config, params: List[torch.Tensor], buffer_bytes: int, shard: int,
                           cut: Optional[Dict[int, torch.Size]] = None, muon: Collection[int] = ()) -> int:
    """Host memory a background checkpoint copies on the largest rank (``ckpt_staging_mb``, trainer.ckpt_async).

    ddp: rank 0 copies the FP32 model (the masters in master modes; a tied weight
    once) and the optimizer's FP32 state; the other ranks only their RNG states.
    fsdp/hsdp (and tp, pp): every rank copies its shards of both, rank 0's the
    largest. Persistent buffers (``buffer_bytes``) are copied whole; frozen
    parameters are left out of checkpoints, so out of ``params``.
    """
    cut = cut or {}
    if sharded_by_fsdp(cfg):
        sizes = [shard_elements(p, shard, cut.get(id(p))) for p in params]
    else:
        sizes = [p.numel() for p in params]
    state = optimizer_state_bytes(cfg, sizes, [id(p) in muon for p in params], [p.shape for p in params])
    return 4 * sum(sizes) + state + buffer_bytes


def persistent_buffer_bytes(model: nn.Module) -> int:
    """Bytes of the buffers a state dict holds, as checkpoints copy them (floating ones in FP32)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return sum(t.numel() * (4 if t.is_floating_point() else t.element_size())
               for name, t in model.state_dict().items() if name not in params)

