"""Framework overhead: dist_trainer vs a hand-written DDP loop, Accelerate and Lightning.

    python bench/overhead.py                      # 3 rounds, 10 warm-up + 50 timed steps per run
    python bench/overhead.py --rounds 2 --steps 30 --warmup 5 --only dist_trainer,handwritten

The same job for all (bench/common.py): dist_trainer's default GPT (4 x 128,
block 64) on char_text, 2 ranks x micro 16 x accum 2 = global 64, fp32, gloo,
one thread per rank, AdamW with clip 1.0, constant lr, the same micro-batches in
the same order. Every run is a fresh ``torchrun --nproc_per_node=2``; the
frameworks alternate (A B C D A B C D ...) so that machine drift hits all alike.

Step time is the wall time of one optimizer step in the steady state:

* dist_trainer (the real, unpatched framework via ``torchrun -m dist_trainer``):
  ``step_time_s`` from its metrics.jsonl, and, as a cross-check, the wall time
  between the rank-0 log lines of the first and last timed steps;
* the others: the interval between the ends of consecutive optimizer steps.

The first ``--warmup`` steps are discarded. Each framework's speed is its
median step time; its ratio is (hand-written median) / (its median), i.e.
steps/s relative to the hand-written loop (1.00 = as fast, 0.97 = 3 % slower).
The losses of every step are compared with the hand-written loop's too: equal
losses show the frameworks trained the same model on the same data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, DIST_TRAINER_OVERRIDES, bench_env, machine_description, step_times, torchrun_cmd  # noqa: E402

FRAMEWORKS = ("dist_trainer", "handwritten", "accelerate", "lightning")
SCRIPTS = {"handwritten": "handwritten.py", "accelerate": "run_accelerate.py", "lightning": "run_lightning.py"}
LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[dist_trainer\]\[INFO\] - step (\d+)/")


def log_times(log: Path) -> Dict[int, float]:
    """Step -> wall time of its rank-0 console line (millisecond resolution)."""
    out = {}
    for line in log.read_text().splitlines():
        m = LOG_LINE.match(line)
        if m:
            out[int(m.group(2))] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def run_dist_trainer(workdir: Path, warmup: int, steps: int, timeout: float,
                     launcher: tuple = ("-m", "dist_trainer"), extra: tuple = (), env: dict = None) -> dict:
    run_dir = workdir / "dist_trainer_run"
    total = warmup + steps + 1  # +1: the last step also evaluates, and its log line would include that
    log_every = math.gcd(warmup, steps) or 1
    cmd = torchrun_cmd(*launcher, *DIST_TRAINER_OVERRIDES, f"trainer.max_steps={total}",
                       f"trainer.log_every={log_every}", f"hydra.run.dir={run_dir}", *extra)
    proc = subprocess.run(cmd, cwd=workdir, env=bench_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(launcher)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records}
    times = [by_step[k]["step_time_s"] for k in range(warmup + 1, warmup + steps + 1)]
    stamps = log_times(run_dir / "rank0.log")
    wall = stamps[warmup + steps] - stamps[warmup] if warmup in stamps and warmup + steps in stamps else None
    losses = [by_step[k]["loss"] for k in range(1, warmup + steps + 1)]
    return {"times": times, "wall_total_s": wall, "losses": losses, "peak_mem_mb": records[-1]["peak_mem_mb"]}


def run_script(name: str, workdir: Path, warmup: int, steps: int, timeout: float) -> dict:
    out = workdir / f"{name}.json"
    cmd = torchrun_cmd(str(BENCH / SCRIPTS[name]), "--steps", str(warmup + steps), "--out", str(out))
    proc = subprocess.run(cmd, cwd=workdir, env=bench_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    record = json.loads(out.read_text())
    times = step_times(record["ends"], warmup, steps)
    return {"times": times, "wall_total_s": sum(times), "losses": record["losses"][:warmup + steps],
            "threads": record["threads"]}


def one_run(name: str, warmup: int, steps: int, timeout: float) -> dict:
    """One fresh launch; a launch that fails is reported and tried once more."""
    try:
        return _one_run(name, warmup, steps, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        print(f"WARNING: {name} run failed, trying it once more: {str(err)[-1500:]}", flush=True)
        result = _one_run(name, warmup, steps, timeout)
        result["retried"] = True
        return result


def _one_run(name: str, warmup: int, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        start = time.perf_counter()
        load0 = os.getloadavg()[0]
        if name == "dist_trainer":
            result = run_dist_trainer(Path(tmp), warmup, steps, timeout)
        else:
            result = run_script(name, Path(tmp), warmup, steps, timeout)
        result["run_s"] = time.perf_counter() - start
        result["load"] = (load0, os.getloadavg()[0])
        return result


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps discarded per run")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps timed per run")
    parser.add_argument("--only", default=",".join(FRAMEWORKS), help="comma-separated subset, in run order")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    if "handwritten" not in names:
        parser.error("the hand-written loop is the reference: keep it in --only")

    print(machine_description(), flush=True)
    print(f"\njob: GPT 4x128 block 64, char_text, 2 ranks x micro 16 x accum 2 = global 64, fp32, gloo, "
          f"OMP_NUM_THREADS=1; {args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} rounds\n",
          flush=True)
    results: Dict[str, List[dict]] = {n: [] for n in names}
    for rnd in range(1, args.rounds + 1):
        for name in names:
            r = one_run(name, args.warmup, args.steps, args.timeout)
            results[name].append(r)
            med = statistics.median(r["times"])
            wall = f"{r['wall_total_s']:.2f} s" if r["wall_total_s"] is not None else "-"
            print(f"round {rnd} {name:12s} median {fmt_ms(med)}/step = {1 / med:5.2f} steps/s | "
                  f"sum {sum(r['times']):6.2f} s, wall {wall} over {args.steps} steps | run {r['run_s']:5.1f} s | "
                  f"load {r['load'][0]:.1f}->{r['load'][1]:.1f}", flush=True)

    ref_rounds = [statistics.median(r["times"]) for r in results["handwritten"]]
    ref_pooled = statistics.median([t for r in results["handwritten"] for t in r["times"]])
    ref_losses = results["handwritten"][0]["losses"]
    early = min(5, len(ref_losses))
    print("\nsummary: ratio = hand-written median step time / the framework's = its steps/s relative to the limit;")
    print("'pooled' uses the median over all timed steps of all rounds, 'per round' pairs each run with the")
    print("hand-written run of the same round, 'median of rounds' is the median of those paired ratios.")
    print(f"loss check: max |loss - hand-written loss| over the first {early} steps (same data, same math: ~1e-6),")
    print("and over all steps (rounding differences grow through AdamW's normalisation of tiny gradients).\n")
    header = (f"| {'framework':12s} | {'median step':>11s} | {'steps/s':>7s} | {'ratio (pooled)':>14s} | "
              f"{'ratio (median of rounds)':>24s} | {'ratio per round':>24s} | {'loss diff, first steps':>22s} "
              f"| {'all steps':>9s} |")
    print(header)
    print("|" + "---|" * 8)
    summary = {}
    for name in names:
        pooled = statistics.median([t for r in results[name] for t in r["times"]])
        per_round = [ref / statistics.median(r["times"]) for ref, r in zip(ref_rounds, results[name])]
        diffs = [[abs(a - b) for a, b in zip(r["losses"], ref_losses)] for r in results[name]]
        early_diff = max(max(d[:early]) for d in diffs)
        all_diff = max(max(d) for d in diffs)
        summary[name] = {"median_step_s": pooled, "steps_per_s": 1 / pooled, "ratio": ref_pooled / pooled,
                         "ratio_median_of_rounds": statistics.median(per_round), "ratio_per_round": per_round,
                         "loss_diff_first_steps": early_diff, "loss_diff_all_steps": all_diff}
        print(f"| {name:12s} | {fmt_ms(pooled):>11s} | {1 / pooled:7.3f} | {ref_pooled / pooled:14.3f} | "
              f"{statistics.median(per_round):24.3f} | {' '.join(f'{x:.3f}' for x in per_round):>24s} | "
              f"{early_diff:22.1e} | {all_diff:9.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
