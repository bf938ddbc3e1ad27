"""The orchestrator: build the parts once, then loop over optimizer steps."""

from __future__ import annotations

import gc
import logging
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from . import distributed
from .config import BatchPlan, Config, validate
from .data import StepPlan, build_dataset, epoch_batches, eval_loader
from .distributed import DistEnv
from .metrics import MetricsWriter, console_line, peak_mem_mb
from .optim import build_optimizer
from .parallel import apply_ddp, count_allreduces
from .precision import Precision
from .trainer import Trainer, loss_terms

log = logging.getLogger("dist_trainer")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, precision: Precision, device: torch.device) -> float:
    """Item-weighted mean loss over the held-out batches of all ranks."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in loader:
        with precision.autocast():
            output = model(to_device(batch, device))
        loss_sum, items = loss_terms(output, batch, count=True)
        totals += torch.stack([loss_sum.double(), items.double().to(device)])
    dist.all_reduce(totals)  # every rank calls it, even one with no eval batches
    model.train()
    return (totals[0] / totals[1]).item()


def startup_report(plan: BatchPlan, env: DistEnv, cfg: Config, model: nn.Module,
                   step_plan: StepPlan, run_dir: Path) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (
        f"run dir {run_dir} | {env.world_size} rank(s) on {env.device.type} ({env.backend}) | "
        f"precision {cfg.precision.name}\n"
        f"plan: {plan.describe()}\n"
        f"model {cfg.model['_target_']}: {params:,} parameters | data {cfg.data['_target_']}: "
        f"{step_plan.num_samples} samples, {step_plan.steps_per_epoch} optimizer steps per epoch"
    )


def train(cfg: Config, run_dir: Path) -> Dict[str, Any]:
    """Train as configured; every rank calls this. Returns rank-local summary numbers."""
    plan = validate(cfg, distributed.world_size())  # before any tensor is allocated
    env = distributed.init(cfg.trainer.device, cfg.dist.timeout_s)
    try:
        return _train(cfg, plan, env, Path(run_dir))
    except BaseException as err:
        # The traceback's frames still hold the DDP object; clear them so it is
        # freed before the process group is destroyed (the other order can hang).
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        gc.collect()
        distributed.shutdown(env)


@dataclass
class Parts:
    """Everything the loop needs, built once before it."""

    trainer: Trainer
    step_plan: StepPlan
    train_set: Any
    eval_set: Any


def build(cfg: Config, plan: BatchPlan, env: DistEnv) -> Parts:
    torch.manual_seed(cfg.trainer.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    train_set = build_dataset(cfg.data)
    eval_set = build_dataset(cfg.data, split="val") if "split" in cfg.data else None
    precision = Precision(cfg.precision, env.device)
    model = precision.prepare(instantiate(cfg.model, _convert_="all"))
    ddp = apply_ddp(model, env, cfg.dist)
    weights = precision.weights(ddp.module)
    counter = count_allreduces(ddp, weights.reduce_bucket)
    optimizer = build_optimizer(weights.optimizer_params(), cfg.optim, plan.lr)
    trainer = Trainer(ddp, optimizer, precision, weights, counter, env, plan, cfg.optim, cfg.trainer)
    step_plan = StepPlan(len(train_set), plan, env.rank, cfg.trainer.seed,
                         cfg.data.get("shuffle", True), cfg.data.get("drop_last", False))
    torch.manual_seed(cfg.trainer.seed + env.rank)  # dropout and other runtime randomness per rank
    return Parts(trainer, step_plan, train_set, eval_set)


def _train(cfg: Config, plan: BatchPlan, env: DistEnv, run_dir: Path) -> Dict[str, Any]:
    parts = build(cfg, plan, env)
    model = parts.trainer.model.module
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.info(startup_report(plan, env, cfg, model, parts.step_plan, run_dir))
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if env.is_main else None)
    try:
        summary = _loop(cfg, parts, metrics)
    finally:
        metrics.close()
    if env.is_main:
        torch.save(parts.trainer.weights.fp32_state_dict(model), run_dir / "final_model.pt")
    return summary


def _loop(cfg: Config, parts: Parts, metrics: MetricsWriter) -> Dict[str, Any]:
    trainer, eval_set = parts.trainer, parts.eval_set
    env, plan, tcfg = trainer.env, trainer.plan, cfg.trainer
    num_workers = cfg.data.get("num_workers", 0)
    pin = env.device.type == "cuda"
    evals = eval_set is not None and (
        eval_loader(eval_set, plan.micro_batch_size, tcfg.eval_batches, env.rank, env.world_size, num_workers))
    step, epoch, samples, record = 0, 0, 0, {}
    tick = time.perf_counter()
    while step < plan.max_steps:
        for window, batches in epoch_batches(parts.train_set, parts.step_plan, epoch, 0, num_workers, pin):
            step += 1
            outcome = trainer.train_step([to_device(b, env.device) for b in batches], window, step)
            samples += outcome.samples
            now = time.perf_counter()
            step_time, tick = now - tick, now
            record = {
                "step": step, "epoch": epoch, "loss": outcome.loss, "lr": outcome.lr,
                "grad_norm": outcome.grad_norm, "loss_scale": outcome.loss_scale,
                "skipped": outcome.skipped, "updates": trainer.updates, "samples": samples,
                "items": outcome.items, "allreduces": outcome.allreduces,
                "allreduce_bytes": outcome.allreduce_bytes, "step_time_s": step_time,
                "samples_per_s": outcome.samples / step_time, "items_per_s": outcome.items / step_time,
                "peak_mem_mb": peak_mem_mb(env.device),
            }
            if evals and ((tcfg.eval_every and step % tcfg.eval_every == 0) or step == plan.max_steps):
                record["eval_loss"] = evaluate(trainer.model.module, evals, trainer.precision, env.device)
                tick = time.perf_counter()  # evaluation time is not step time
            metrics.write(record)
            if step % tcfg.log_every == 0 or step == 1 or step == plan.max_steps:
                log.info(console_line(record, plan.max_steps))
            if step == plan.max_steps:
                break
        epoch += 1
    return {"steps": step, "updates": trainer.updates, "samples": samples,
            "loss": record.get("loss"), "eval_loss": record.get("eval_loss")}
