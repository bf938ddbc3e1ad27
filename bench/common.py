"""What every benchmark runner shares: the job, the data order, timing records.

The job is dist_trainer's default one (byte-level GPT, 4 layers x 128 wide,
block 64, on ``dist_trainer.data.builtin.char_text``), run as 2 ranks x micro 16 x
accum 2 = global 64, fp32, AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on
matrices and embeddings only), grad clip 1.0 and a constant lr.

The data order is dist_trainer's (written again here, not imported, so the
hand-written loop depends on nothing of the framework's but the model, the
dataset and the permutation ``dist_trainer.data.SampleOrder``, keyed by
``hash_key(seed, epoch)``): each epoch's permutation is cut into global
batches; sample j of a step goes to rank j % world, and each rank cuts its
share into micro-batches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# The default job (dist_trainer/conf/config.yaml, conf/model/gpt.yaml, conf/optim/adamw.yaml).
MODEL = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
WORLD = 2
MICRO = 16
ACCUM = 2
GLOBAL = WORLD * MICRO * ACCUM
LR = 2e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
CLIP = 1.0
SEED = 0

# dist_trainer overrides that make its run the job above (no warmup, constant lr,
# evaluation and checkpoint only after the last step).
DIST_TRAINER_OVERRIDES = [
    f"batch.micro_batch_size={MICRO}", f"batch.global_batch_size={GLOBAL}", "precision=fp32",
    f"optim.lr={LR}", "optim.warmup_steps=0", "optim.schedule=constant", f"optim.grad_clip={CLIP}",
    f"optim.weight_decay={WEIGHT_DECAY}", f"trainer.seed={SEED}", "trainer.eval_every=0",
    "trainer.eval_batches=1", "trainer.ckpt_every=0", "trainer.device=cpu",
    f"model.n_layer={MODEL['n_layer']}", f"model.n_embd={MODEL['n_embd']}", f"model.n_head={MODEL['n_head']}",
    f"data.block_size={MODEL['block_size']}",
]


def build_model() -> torch.nn.Module:
    """The GPT with the weights dist_trainer starts from (it seeds with trainer.seed first)."""
    from dist_trainer.models import GPT

    torch.manual_seed(SEED)
    return GPT(**MODEL)


def build_dataset():
    from dist_trainer.data.builtin import char_text

    return char_text(block_size=MODEL["block_size"], split="train")


def param_groups(model: torch.nn.Module) -> List[dict]:
    """Weight decay on matrices and embeddings only, as dist_trainer.optim does."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS)


def rank_micro_batches(num_samples: int, rank: int, world: int, steps: int, seed: int = SEED,
                       micro: int = MICRO, accum: int = ACCUM) -> List[List[int]]:
    """This rank's micro-batches (lists of dataset indices) for ``steps`` optimizer steps, in order.

    Only full global batches are used (the benchmarks stay inside the first
    epochs' full steps, where dist_trainer's order is exactly this).
    """
    import numpy as np

    from dist_trainer.data import SampleOrder, hash_key

    glob = micro * accum * world
    per_epoch = num_samples // glob
    out: List[List[int]] = []
    epoch = 0
    while len(out) < steps * accum:
        order = SampleOrder(num_samples, hash_key(seed, epoch))(np.arange(num_samples)).tolist()
        for step in range(per_epoch):
            mine = order[step * glob:(step + 1) * glob][rank::world]
            out.extend(mine[i:i + micro] for i in range(0, len(mine), micro))
            if len(out) >= steps * accum:
                break
        epoch += 1
    return out[:steps * accum]


class StepClock:
    """Wall-clock time at the end of every optimizer step, and each step's local loss terms.

    ``add`` keeps a micro-batch's detached (loss_sum, items) without a host
    sync; the losses are all-reduced once, after the timed steps, so that the
    benchmark can check that every framework trained on the same data.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.ends: List[float] = []
        self._pending: List[torch.Tensor] = []
        self._steps: List[List[torch.Tensor]] = []

    def add(self, loss_sum: torch.Tensor, items: torch.Tensor) -> None:
        self._pending.append(torch.stack([loss_sum.detach().double(), items.detach().double()]))

    def tick(self) -> None:
        self.ends.append(time.perf_counter())
        self._steps.append(self._pending)
        self._pending = []

    def global_losses(self) -> List[float]:
        """Every step's loss over all ranks (one all-reduce, after the timed part)."""
        import torch.distributed as dist

        if not self._steps or not all(self._steps):
            return []
        terms = torch.stack([torch.stack(s).sum(0) for s in self._steps])
        if dist.is_initialized():
            dist.all_reduce(terms)
        return (terms[:, 0] / terms[:, 1]).tolist()

    def dump(self, path: str, **extra) -> None:
        record = {"ends": [t - self.start for t in self.ends], "losses": self.global_losses(),
                  "threads": torch.get_num_threads(), **extra}
        if int(os.environ.get("RANK", "0")) == 0:
            Path(path).write_text(json.dumps(record))


def step_times(ends: Sequence[float], warmup: int, measured: int) -> List[float]:
    """Durations of steps warmup+1 .. warmup+measured from their end times (step k ends at ends[k-1])."""
    if len(ends) < warmup + measured:
        raise RuntimeError(f"only {len(ends)} steps recorded, need {warmup + measured}")
    return [ends[k] - ends[k - 1] for k in range(warmup, warmup + measured)]


def machine_description() -> str:
    lscpu = subprocess.run("lscpu | head -20", shell=True, capture_output=True, text=True).stdout.strip()
    mem = subprocess.run("free -g | head -2", shell=True, capture_output=True, text=True).stdout.strip()
    return (f"{lscpu}\n{mem}\npython {platform.python_version()}, torch {torch.__version__}, "
            f"{os.cpu_count()} CPUs visible, load average {os.getloadavg()}\n"
            f"allocator settings passed to every run: {allocator_env() or 'none (glibc defaults)'}")


def allocator_env() -> Dict[str, str]:
    """The environment variables that change malloc for every launched run (dist_trainer then leaves it alone)."""
    return {k: v for k, v in os.environ.items()
            if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD")}


def torchrun_cmd(*args: str, nproc: int = WORLD) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def bench_env(**extra: str) -> Dict[str, str]:
    """One thread per rank (torchrun's default too, set here explicitly), bench/ importable."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_dist_trainer(overrides: Sequence[str], steps: int, nproc: int = WORLD, fresh_inductor_cache: bool = False,
                     base: Sequence[str] = DIST_TRAINER_OVERRIDES) -> List[dict]:
    """One ``torchrun -m dist_trainer`` run of the benchmark job (``base``) with ``overrides``, in a
    temporary directory; its metrics.jsonl records. ``fresh_inductor_cache``: compile cold."""
    return run_dist_trainer_with_plan(overrides, steps, nproc, fresh_inductor_cache, base)[0]


def run_dist_trainer_with_plan(overrides: Sequence[str], steps: int, nproc: int = WORLD,
                               fresh_inductor_cache: bool = False,
                               base: Sequence[str] = DIST_TRAINER_OVERRIDES) -> tuple:
    """``run_dist_trainer``'s metrics.jsonl records, and the run's plan.json."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = torchrun_cmd("-m", "dist_trainer", *base, *overrides, f"trainer.max_steps={steps}",
                           f"trainer.log_every={steps}", f"hydra.run.dir={run_dir}", nproc=nproc)
        env = bench_env(**({"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")} if fresh_inductor_cache else {}))
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{list(overrides)} on {nproc} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return ([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
                json.loads((run_dir / "plan.json").read_text()))


def rounds_parser(doc: str, parts: Sequence[str] = (), timed: int = 10) -> argparse.ArgumentParser:
    """The command line of a benchmark of modes alternated over rounds: ``--part`` (when it has ``parts``),
    ``--rounds``, ``--warmup`` and ``--timed`` steps, ``--json``; a script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if parts:
        parser.add_argument("--part", choices=("all", *parts), default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=timed)
    parser.add_argument("--json", help="also write every number to this file")
    return parser


def runner_args() -> argparse.Namespace:
    """The command line every per-framework runner takes: timed steps and where to write the times."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


# ---------------------------------------------------------------- runs built as dist_trainer.run builds them
# (bench/fp8.py, bench/optimizers.py: modes of one model on 2 gloo ranks, stepped in turn)

# evaluation and checkpoints off: the step alone is timed
STEP_ONLY = ["trainer.device=cpu", "trainer.eval_every=0", "trainer.ckpt_every=0"]


def compose(overrides: List[str]):
    """The run's Config, as the entry point composes it from conf/ (evaluation and checkpoints off)."""
    from hydra import compose as hydra_compose, initialize_config_module
    from omegaconf import OmegaConf

    import dist_trainer.cli  # noqa: F401  (registers the schema)

    with initialize_config_module("dist_trainer.conf", version_base=None):
        return OmegaConf.to_object(hydra_compose("config", STEP_ONLY + list(overrides)))


class Mode:
    """One mode's run on ``world`` ranks, built as dist_trainer.run builds it, and its batches."""

    def __init__(self, overrides: List[str], env, world: int) -> None:
        from dist_trainer.validation import validate
        from dist_trainer.plan import plan_numbers
        from dist_trainer.run import build

        cfg = compose(overrides)
        plan = validate(cfg, world)
        self.parts = build(cfg, plan, env)
        self.trainer = self.parts.trainer
        numbers = plan_numbers(cfg, plan, self.trainer.module)
        self.plan_state_mb, self.plan_step = numbers["state_mb"], numbers["step"] or {}
        self.batches = self._batches()
        self.step, self.last = 0, None  # steps taken, the last one's outcome

    def _batches(self):
        from dist_trainer.data import epoch_batches

        epoch = 0
        while True:  # epoch after epoch, as long as the benchmark asks
            yield from epoch_batches(self.parts.train_set, self.parts.step_plan, epoch, 0, 0, False)
            epoch += 1

    def train_step(self) -> tuple:
        """One step: (its wall time on this rank, the outcome)."""
        window, micro_batches = next(self.batches)
        self.step += 1
        began = time.perf_counter()
        outcome = self.trainer.train_step(micro_batches, window, self.step)
        return time.perf_counter() - began, outcome


def take_turns(runs: Dict[str, Mode], timed: int, report_every: int, rank: int) -> Dict[str, List[float]]:
    """Each mode's wall time of ``timed`` steps on this rank, the modes taking turns step by step, so that another
    job's burst on the shared cores falls on all of them; each mode's last outcome kept in ``last``."""
    steps: Dict[str, List[float]] = {name: [] for name in runs}
    for i in range(timed):
        for name, run in runs.items():
            elapsed, outcome = run.train_step()
            assert not outcome.skipped, f"{name}: step {run.step} skipped ({outcome.skip_reason})"
            steps[name].append(elapsed)
            run.last = outcome
        if rank == 0 and (i + 1) % report_every == 0:
            print(f"{i + 1} of {timed} timed steps a mode done", flush=True)
    return steps


def slowest(values: List[float]) -> List[float]:
    """Each entry's largest value over the ranks (one all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
