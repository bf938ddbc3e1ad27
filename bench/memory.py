"""Peak memory vs accumulation, and step time, per precision mode (CPU).

    python bench/memory.py                    # both parts, about 7 minutes on 2 cores
    python bench/memory.py --part memory      # only the memory table
    python bench/memory.py --part speed       # only the step-time table

Memory part: one rank (a process group of one), dist_trainer's own Trainer
(dist_trainer.run.build), the default GPT, 2 optimizer steps (the second one
holds AdamW's state as well as gradients and activations). For each precision
mode: a fixed micro-batch of ``--micro`` samples with accum 1, 4 and 16 (the
peak should stay flat), against one big micro-batch of the same global size
(accum 1; the peak grows with it).

How it is measured: the CPU allocator keeps no peak counter, and tracemalloc
does not see torch's allocations, so every configuration runs in a FRESH
process, and the number reported is that process's peak resident set
(``ru_maxrss``, monotonic over the process's life) minus its resident set right
after the model, optimizer and dataset were built. That is the memory the
training steps added at their peak: activations, gradients, optimizer state,
allocator slack. It is the honest CPU measure; on CUDA, dist_trainer reports
``torch.cuda.max_memory_allocated`` instead (see bench/gpu.py).

Speed part: the benchmark job of bench/overhead.py (2 ranks x micro 16 x accum
2, ``torchrun -m dist_trainer``) in each precision mode, the modes alternated
over rounds; the median ``step_time_s`` after the warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DIST_TRAINER_OVERRIDES, MODEL, bench_env, machine_description, torchrun_cmd  # noqa: E402

MODES = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master")
ACCUMS = (1, 4, 16)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(precision: str, micro: int, accum: int, steps: int) -> None:
    import torch

    from dist_trainer import distributed
    from dist_trainer.config import BatchConfig, Config, OptimConfig, PrecisionConfig, TrainerConfig
    from dist_trainer.validation import validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.run import build

    torch.set_num_threads(1)
    env = distributed.init("cpu")  # not under torchrun: a process group of one
    cfg = Config(model={"_target_": "dist_trainer.models.GPT", **MODEL},
                 data={"_target_": "dist_trainer.data.builtin.char_text", "block_size": MODEL["block_size"]},
                 batch=BatchConfig(micro_batch_size=micro, accum_steps=accum),
                 precision=PrecisionConfig(name=precision), optim=OptimConfig(lr=2e-3, grad_clip=1.0),
                 trainer=TrainerConfig(max_steps=steps))
    plan = validate(cfg, env.world_size)
    parts = build(cfg, plan, env)
    baseline = rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for step, (window, batches) in enumerate(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False), 1):
        start = time.perf_counter()
        outcome = parts.trainer.train_step(batches, window, step)
        times.append(time.perf_counter() - start)
        if step == steps:
            break
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"precision": precision, "micro": micro, "accum": accum, "baseline": baseline,
                      "peak_before_steps": peak_before, "peak": peak, "step_s": times, "loss": outcome.loss}))
    distributed.shutdown(env)


def run_worker(precision: str, micro: int, accum: int, steps: int) -> dict:
    env = bench_env()
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", precision, str(micro), str(accum),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_part(micro: int, steps: int) -> list:
    mib = 2**20
    print(f"\nMEMORY: one rank, default GPT, micro {micro}, {steps} optimizer steps per fresh process; "
          "peak RSS - RSS after build (MiB)\n", flush=True)
    configs = [(micro, a) for a in ACCUMS] + [(micro * a, 1) for a in ACCUMS if a > 1]
    cols = [f"micro {m} x accum {a}" + (" (one big batch)" if a == 1 and m != micro else "") for m, a in configs]
    print("| precision | " + " | ".join(cols) + " |")
    print("|" + "---|" * (len(cols) + 1))
    rows = []
    for mode in MODES:
        cells = []
        for m, a in configs:
            r = run_worker(mode, m, a, steps)
            rows.append(r)
            cells.append(f"{(r['peak'] - r['baseline']) / mib:.1f}")
        print(f"| {mode} | " + " | ".join(cells) + " |", flush=True)
    base = statistics.median(r["baseline"] for r in rows) / mib
    print(f"\n(RSS right after build, the subtracted baseline: about {base:.0f} MiB in every process; "
          f"global batch = micro x accum samples of {MODEL['block_size']} tokens)")
    return rows


def speed_part(rounds: int, warmup: int, timed: int) -> dict:
    print(f"\nSTEP TIME: 2 ranks x micro 16 x accum 2 = global 64 (torchrun -m dist_trainer), {warmup} warm-up + "
          f"{timed} timed steps, modes alternated over {rounds} rounds; median step_time_s\n", flush=True)
    results = {m: [] for m in MODES}
    for rnd in range(1, rounds + 1):
        for mode in MODES:
            with tempfile.TemporaryDirectory(prefix="bench-prec-") as tmp:
                run_dir = Path(tmp) / "run"
                overrides = [o for o in DIST_TRAINER_OVERRIDES if not o.startswith("precision=")]
                cmd = torchrun_cmd("-m", "dist_trainer", *overrides, f"precision={mode}",
                                   f"trainer.max_steps={warmup + timed + 1}", f"trainer.log_every={warmup + timed}",
                                   f"hydra.run.dir={run_dir}")
                proc = subprocess.run(cmd, cwd=tmp, env=bench_env(), capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                times = [r["step_time_s"] for r in recs[warmup:warmup + timed]]
                results[mode].append({"times": times, "loss": recs[warmup + timed - 1]["loss"],
                                      "peak_mem_mb": recs[-1]["peak_mem_mb"]})
                print(f"round {rnd} {mode:12s} median {statistics.median(times) * 1000:8.1f} ms/step "
                      f"(loss at step {warmup + timed}: {recs[warmup + timed - 1]['loss']:.4f}, "
                      f"rank-0 peak RSS {recs[-1]['peak_mem_mb']:.0f} MB)", flush=True)
    fp32 = statistics.median(t for r in results["fp32"] for t in r["times"])
    print("\n| precision | median step (ms) | tokens/s | speed vs fp32 | loss at the last timed step |")
    print("|---|---|---|---|---|")
    tokens = 64 * MODEL["block_size"]
    for mode in MODES:
        med = statistics.median(t for r in results[mode] for t in r["times"])
        loss = statistics.mean(r["loss"] for r in results[mode])
        print(f"| {mode} | {med * 1000:.1f} | {tokens / med:,.0f} | {fp32 / med:.2f}x | {loss:.4f} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "memory", "speed"), default="all")
    parser.add_argument("--micro", type=int, default=8, help="fixed micro-batch of the memory part")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per memory configuration")
    parser.add_argument("--rounds", type=int, default=2, help="speed part: rounds over the modes")
    parser.add_argument("--warmup", type=int, default=3, help="speed part: steps discarded per run")
    parser.add_argument("--timed", type=int, default=8, help="speed part: steps timed per run")
    parser.add_argument("--worker", nargs=3, metavar=("PRECISION", "MICRO", "ACCUM"), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    if args.worker:
        precision, micro, accum = args.worker
        worker(precision, int(micro), int(accum), args.steps)
        return
    print(machine_description(), flush=True)
    out = {}
    if args.part in ("all", "memory"):
        out["memory"] = memory_part(args.micro, args.steps)
    if args.part in ("all", "speed"):
        out["speed"] = speed_part(args.rounds, args.warmup, args.timed)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
