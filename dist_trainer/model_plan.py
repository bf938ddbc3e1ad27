"""The model's build and export, as plan mode predicts them: the host memory building or loading the model
adds to a rank (``load_host_peak_mb``) and writing the final model (``export_host_peak_mb``, ``final.py``).

Shapes and file headers only: no tensor is allocated and no process group is asked.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

from .config import Config, MeshShape
from .moe.ep import expert_params
from .parallel.dp_plan import shard_elements


def expected_load_bytes(cfg: Config, mesh: MeshShape, model: nn.Module, cut: Dict[int, torch.Size],
                        held: Optional[List[torch.Tensor]] = None) -> int:
    """Host memory building (or loading) the model adds to the rank that holds the most.

    Under fsdp, hsdp, tp and pp (built on the meta device, ``models.construct``): the rank's FP32 shards of its
    parameters (``held``: a pipeline stage group's; default all) and its buffers whole, and beside them one
    tensor at a time: from the recorded constructor the largest whole tensor (each is drawn whole, as one
    process draws it); from pretrained files nothing where they hold FP32 (a shard is read straight into its
    storage), else the largest shard in the files' dtype. Built whole (ddp, or ``dist.meta_init=false``): an
    estimate, twice the whole model (the model, and either DDP's buckets or, from pretrained files, the pages
    transformers' loader maps, which depend on its version).
    """
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    whole = sum(t.numel() * 4 for t in tensors)
    source = cfg.model.get("pretrained")
    if not mesh.cuts_model or not cfg.dist.meta_init:
        return 2 * whole
    ids = {id(p) for p in held} if held is not None else None
    params = [p for p in {id(p): p for p in model.parameters()}.values() if ids is None or id(p) in ids]
    shards = [shard_elements(p, mesh.shard, cut.get(id(p))) for p in params]
    buffers = sum(b.numel() * 4 for b in model.buffers())
    if source:
        from .models.pretrained import BLOCK_BYTES

        itemsize = pretrained_itemsize(Path(source).expanduser())
        beside = 0 if itemsize == 4 else max(shards, default=0) * itemsize
        # a shard that keeps some columns (a row-wise Linear under tp) is read in blocks of whole rows into a
        # buffer of its own size, then copied
        columns = [math.prod(cut[id(p)]) for p in params if id(p) in cut and p.ndim > 1 and
                   tuple(cut[id(p)])[1:] != tuple(p.shape)[1:]]
        beside = max(beside, BLOCK_BYTES + max(columns) * 4 if columns else 0)
    else:
        beside = max((t.numel() * 4 for t in tensors), default=0)
    return sum(shards) * 4 + buffers + beside


def expected_export_bytes(mesh: MeshShape, model: nn.Module) -> int:
    """The most host memory writing the final model may add to a rank (``final.py``): the tensors are walked one
    at a time, so under fsdp, hsdp, tp and pp the largest one whole: an all-gather's output and input (two
    copies; measured under fsdp on 2 ranks: 1.0-1.1x the largest), and where the parameter is placed on two
    mesh dimensions (tp under FSDP2, even with shard groups of one) a second gather and the reordering of
    FSDP's strided shard, which DTensor runs one dimension after the other: four copies at most. Under ddp
    nothing (rank 0 writes its own FP32 tensors as they are), but for expert slices (dist.ep.size), each
    gathered whole. An upper bound: memory the allocator kept from training serves part of it, so a run
    measures up to it."""
    if not mesh.cuts_model:  # but expert slices (dist.ep.size): the largest gathered whole, and its FP32 copy
        return 2 * max((p.numel() * 4 for p in expert_params(model)), default=0) if mesh.ep > 1 else 0
    copies = 4 if mesh.tp > 1 or mesh.pp > 1 else 2
    return copies * max((t.numel() * 4 for t in [*model.parameters(), *model.buffers()]), default=0)


def pretrained_itemsize(directory: Path) -> int:
    """The largest element size of the floating tensors in a save_pretrained directory (their headers only)."""
    from .models.pretrained import DTYPES, SafetensorsFile, SafetensorsSource

    files = {path: SafetensorsFile(path) for path in set(SafetensorsSource(directory).files.values())}
    return max((DTYPES[entry["dtype"]].itemsize for f in files.values() for entry in f.tensors.values()
                if DTYPES[entry["dtype"]].is_floating_point), default=4)

