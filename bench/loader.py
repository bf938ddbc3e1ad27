"""DataLoader workers: the time a step waits for its data, with data.num_workers 0, 1 and 2 (2 ranks).

    python bench/loader.py                 # 2 rounds, 120 steps per run (crossing an epoch), about 3 minutes

The default job (bench/common.py: 2 ranks x micro 16 x accum 2, fp32) for 120
optimizer steps, so the run crosses the end of the first epoch (103 steps) and
the workers serve a second epoch. From metrics.jsonl: the median and the
maximum ``data_time_s`` (the wait for the step's micro-batches) after the
first 5 steps, at the first step of epoch 1, and the median ``step_time_s``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, run_dist_trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    print(machine_description(), flush=True)
    rows = {w: [] for w in (0, 1, 2)}
    for rnd in range(1, args.rounds + 1):
        for workers in rows:
            recs = run_dist_trainer([f"data.num_workers={workers}"], args.steps)
            timed = recs[5:]
            first_of_epoch1 = next(r for r in recs if r["epoch"] == 1)
            row = {"data_median_ms": 1e3 * statistics.median(r["data_time_s"] for r in timed),
                   "data_max_ms": 1e3 * max(r["data_time_s"] for r in timed),
                   "epoch1_first_ms": 1e3 * first_of_epoch1["data_time_s"],
                   "step_median_ms": 1e3 * statistics.median(r["step_time_s"] for r in timed)}
            rows[workers].append(row)
            print(f"round {rnd} num_workers={workers}: data_time median {row['data_median_ms']:.2f} ms, max "
                  f"{row['data_max_ms']:.2f} ms, first step of epoch 1 {row['epoch1_first_ms']:.2f} ms; step "
                  f"{row['step_median_ms']:.1f} ms", flush=True)
    print("\n| data.num_workers | data_time_s median (ms) | max (ms) | first step of epoch 1 (ms) | median step (ms) |")
    print("|---|---|---|---|---|")
    for workers, runs in rows.items():
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        print(f"| {workers} | {med('data_median_ms'):.2f} | {max(r['data_max_ms'] for r in runs):.2f} | "
              f"{med('epoch1_first_ms'):.2f} | {med('step_median_ms'):.1f} |")


if __name__ == "__main__":
    main()
