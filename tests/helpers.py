"""Real multi-process runs on gloo for tests, and small configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dist_trainer.config import BatchConfig, Config, DistConfig, OptimConfig, PrecisionConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[1]


def _rank_main(rank: int, world_size: int, store_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(store_dir, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any) -> List[Any]:
    """Run fn(rank, world_size, *args) in world_size spawned processes; return their results."""
    store_dir = tmp_path / f"ranks{world_size}-{fn.__name__}"
    store_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(world_size, str(store_dir), fn, args), nprocs=world_size, join=True)
    return [torch.load(store_dir / f"result{r}.pt", weights_only=False) for r in range(world_size)]


class RegressionMLP(torch.nn.Module):
    """Linear-tanh-linear regressor returning the scalar mean squared error."""

    def __init__(self, in_dim: int = 4, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(in_dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1).float(), batch["y"])


def regression_config(micro: int, accum: int | None = None, glob: int | None = None, steps: int = 3,
                      precision: str = "fp32", n: int = 96, **optim: Any) -> Config:
    return Config(
        model={"_target_": "helpers.RegressionMLP", "in_dim": 4, "hidden": 16},
        data={"_target_": "dist_trainer.datasets.regression", "n": n, "in_dim": 4, "shuffle": True},
        batch=BatchConfig(micro_batch_size=micro, accum_steps=accum, global_batch_size=glob),
        precision=PrecisionConfig(name=precision),
        optim=OptimConfig(**{"name": "adamw", "lr": 1e-2, "weight_decay": 0.1, "warmup_steps": 2,
                             "schedule": "cosine", "grad_clip": None, **optim}),
        trainer=TrainerConfig(max_steps=steps, log_every=1, eval_every=0),
        dist=DistConfig(),
    )


def run_module(args: List[str], cwd: Path, timeout: float = 240, torchrun_nproc: int = 0) -> subprocess.CompletedProcess:
    """python -m dist_trainer (or torchrun with nproc ranks) in a subprocess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)}
    if torchrun_nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_nproc}",
               "-m", "dist_trainer", *args]
    else:
        cmd = [sys.executable, "-m", "dist_trainer", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
