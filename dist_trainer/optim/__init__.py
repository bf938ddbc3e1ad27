"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from typing import List, Optional

import torch
from ..config import OptimConfig


def decay_split(params: List[torch.Tensor]) -> tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(matrices and embeddings: decayed, vectors: not), in the order the optimizer holds them."""
    return [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]


def build_optimizer(params: List[torch.Tensor], cfg: OptimConfig, lr: float,
                    names: Optional[List[str]] = None) -> torch.optim.Optimizer:
    """AdamW (FP32 or bf16 state), SGD, Adafactor or Muon (with AdamW) over FP32 tensors; weight decay only on
    matrices and embeddings.
    ``names``: the parameters' (Muon takes the hidden matrices by name)."""
    if cfg.name == "muon":
        return build_muon(params, names or [], cfg, lr)
    decayed, flat = decay_split(params)
    groups = [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": flat, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = cfg.fused if cfg.fused is not None else (cfg.name == "adamw" and params[0].device.type == "cuda")
    # Fused: one kernel over all parameters. Otherwise torch's own choice: foreach on CUDA, the
    # per-parameter loop on CPU (measured here: loop 4.4 ms, foreach 4.8 ms, fused 1.5 ms per step of
    # the default GPT, one thread; fused's update differs from the loop's by rounding, up to 7e-8).
    impl = {"fused": True} if fused else {}
    if cfg.name == "adamw" and cfg.state_dtype == "bf16":
        from .lowmem import AdamWBF16State

        return AdamWBF16State(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "adamw" and cfg.state_dtype == "int8":
        from .lowmem import int8_adamw

        return int8_adamw(groups, lr, tuple(cfg.betas), cfg.eps)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)
    if cfg.name == "adafactor":  # torch's: factored second moments of matrices (a row and a column vector)
        return torch.optim.Adafactor(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, **impl)


def muon_split(named: List[tuple], cfg: OptimConfig) -> tuple[list, list]:
    """(the (name, parameter) pairs Muon steps, those AdamW steps) of ``named``."""
    from .muon import takes_muon

    exclude = cfg.muon.exclude
    muon = [(n, p) for n, p in named if takes_muon(n, p, exclude)]
    return muon, [(n, p) for n, p in named if not takes_muon(n, p, exclude)]


def optimizer_line(named: List[tuple], cfg: OptimConfig) -> str:
    """Which parameters Muon steps and which AdamW (optim.name=muon; empty otherwise), for the start-up line
    and plan mode."""
    if cfg.name != "muon":
        return ""
    muon, rest = muon_split([(n, p) for n, p in named if p.requires_grad], cfg)
    matrices = sorted({n for n, p in rest if p.ndim >= 2})
    return (f"Muon on {len(muon)} hidden matrices ({sum(p.numel() for _, p in muon):,} parameters, ns_dtype "
            f"{cfg.muon.ns_dtype}, lr {cfg.muon.lr:g}, adjust_lr {cfg.muon.adjust_lr}); AdamW on "
            f"{len(rest)} tensors ({sum(p.numel() for _, p in rest):,} parameters: "
            + (", ".join(matrices) + " by optim.muon.exclude, " if matrices else "")
            + "vectors and norms)")


def build_muon(params: List[torch.Tensor], names: List[str], cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """One optimizer: Muon's group of hidden matrices, AdamW's groups of the rest (decay as for AdamW)."""
    from .muon import MuonAdamW

    if len(names) != len(params):
        raise ValueError(f"optim.name=muon needs each parameter's name ({len(names)} names, {len(params)} tensors)")
    muon, rest = muon_split(list(zip(names, params)), cfg)
    m = cfg.muon
    # Muon's lr follows the schedule in proportion to optim.lr (set_lr): optim.muon.lr where optim.lr is reached
    groups = [{"params": [p for _, p in muon], "muon": True, "lr": m.lr * (lr / cfg.lr), "lr_of": (m.lr, cfg.lr),
               "weight_decay": cfg.weight_decay, "momentum": m.momentum, "nesterov": m.nesterov,
               "ns_steps": m.ns_steps, "ns_dtype": m.ns_dtype, "adjust_lr": m.adjust_lr, "dist": m.dist}]
    decayed, flat = decay_split([p for _, p in rest])
    groups += [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": flat, "weight_decay": 0.0}]
    return MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=tuple(cfg.betas), eps=cfg.eps)


def lr_at(update: int, peak_lr: float, cfg: OptimConfig, total_updates: int) -> float:
    """The lr of optimizer update number ``update`` (0-based).

    ``update`` counts applied updates only: a step skipped for non-finite
    gradients does not move the schedule, so the next step reuses its rate.
    """
    if update < cfg.warmup_steps:
        return peak_lr * (update + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak_lr
    # The last update a run makes is number total_updates - 1: it gets the floor.
    decay_updates = max(total_updates - 1 - cfg.warmup_steps, 1)
    progress = min((update - cfg.warmup_steps) / decay_updates, 1.0)
    floor = peak_lr * cfg.min_lr_ratio
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        mine, base = group.get("lr_of", (1.0, 1.0))  # Muon's matrices: (optim.muon.lr, optim.lr)
        value = mine * (lr / base) if "lr_of" in group else lr
        if isinstance(group["lr"], torch.Tensor):  # torchao's 8-bit AdamW keeps it a tensor (its compiled step's)
            group["lr"].fill_(value)
        else:
            group["lr"] = value
