"""The default tier on a loaded machine: the README's test command, several times in a row, beside a CPU hog.

    python bench/suite_under_load.py                 # 3 runs beside 2 busy processes (one a core here)
    python bench/suite_under_load.py --runs 1 --hogs 0    # the same command on an idle machine, for comparison

The hog is ``--hogs`` processes that spin in a tight loop at the tests' own priority for as long as the runs
last, so every rank, every launch's deadline and every timeout in the suite competes for the cores with it.
Each run is pytest with the project's defaults (pyproject's addopts: the default tier on two workers); the
script prints each run's outcome (pytest's summary line) and wall time, and exits non-zero if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _spin() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2, help="busy processes beside the tests (default: 2)")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    hogs = [multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    failed = 0
    try:
        for run in range(1, args.runs + 1):
            begin = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *args.pytest_args], cwd=REPO,
                                  capture_output=True, text=True)
            wall = time.perf_counter() - begin
            summary = [line for line in proc.stdout.splitlines() if " in " in line and ("passed" in line or
                                                                                      "failed" in line)]
            print(f"run {run}/{args.runs} beside {args.hogs} busy processes: rc {proc.returncode}, "
                  f"{wall / 60:.1f} min: {summary[-1] if summary else proc.stdout[-2000:]}", flush=True)
            if proc.returncode != 0:
                failed += 1
                print(proc.stdout[-20000:], flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
            hog.join()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
