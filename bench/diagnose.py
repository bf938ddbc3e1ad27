"""Test hypotheses about dist_trainer's overhead with monkeypatched runs (a diagnostic, not the benchmark).

    python bench/diagnose.py                                   # all patches, 3 rounds of 10 + 40 steps
    python bench/diagnose.py --patches no_comm_hook --rounds 4

Alternates, in fresh torchrun launches of the bench/overhead.py job: the real
dist_trainer (``-m dist_trainer``), dist_trainer under each patch of
bench/patched_dist_trainer.py, and the hand-written loop. A patch whose runs
close the gap to the hand-written loop points at the cost it removes; the
numbers here are never the benchmark's (bench/overhead.py measures only the
unpatched framework).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, machine_description  # noqa: E402
from overhead import run_dist_trainer, run_script  # noqa: E402
from patched_dist_trainer import PATCHES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patches", default=",".join(p for p in PATCHES if p != "none"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(machine_description(), flush=True)
    variants = ["dist_trainer"] + [f"patched:{p}" for p in args.patches.split(",") if p] + ["handwritten"]
    times = {v: [] for v in variants}
    for rnd in range(1, args.rounds + 1):
        for v in variants:
            with tempfile.TemporaryDirectory(prefix="bench-diag-") as tmp:
                if v == "handwritten":
                    r = run_script("handwritten", Path(tmp), args.warmup, args.steps, 600)
                else:
                    launcher = (("-m", "dist_trainer") if v == "dist_trainer"
                                else (str(BENCH / "patched_dist_trainer.py"), v.split(":", 1)[1]))
                    r = run_dist_trainer(Path(tmp), args.warmup, args.steps, 600, launcher)
            times[v].append(r["times"])
            print(f"round {rnd} {v:24s} median {statistics.median(r['times']) * 1000:7.1f} ms/step", flush=True)
    ref = [statistics.median(t) for t in times["handwritten"]]
    print("\n| variant | median step (ms) | ratio to hand-written (median of rounds) | per round |")
    print("|---|---|---|---|")
    for v in variants:
        meds = [statistics.median(t) for t in times[v]]
        per = [h / m for h, m in zip(ref, meds)]
        pooled = statistics.median([x for t in times[v] for x in t])
        print(f"| {v} | {pooled * 1000:.1f} | {statistics.median(per):.3f} | {' '.join(f'{x:.3f}' for x in per)} |")


if __name__ == "__main__":
    main()
