"""Time from launch to the first optimizer step: dist_trainer vs the hand-written loop.

    python bench/startup.py               # 4 repetitions each, alternated

Both run the benchmark job of bench/overhead.py under ``torchrun
--standalone --nproc_per_node=2`` (a fresh launch each time). The clock starts
just before the torchrun process is started and stops when rank 0's line for
the first optimizer step reaches our end of the pipe: dist_trainer's console
line ``step 1/...`` (logged at step 1), the hand-written loop's ``first
optimizer step done``. For dist_trainer the arrival of its start-up report
(printed once the model, optimizer and data are built) splits the time into
"launch to built" and "built to first step".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, DIST_TRAINER_OVERRIDES, bench_env, machine_description, torchrun_cmd  # noqa: E402

MARKS = {
    "dist_trainer": {"built": "] - run dir ", "first": "] - step 1/"},
    "handwritten": {"first": "first optimizer step done"},
}


def launch(name: str, tmp: Path) -> dict:
    """One fresh launch; one that fails is reported and tried once more."""
    try:
        return _launch(name, Path(tempfile.mkdtemp(dir=tmp)))
    except RuntimeError as err:
        print(f"WARNING: {name} launch failed, trying it once more: {str(err)[-800:]}", flush=True)
        return _launch(name, Path(tempfile.mkdtemp(dir=tmp)))  # a fresh run dir: nothing to resume


def _launch(name: str, tmp: Path) -> dict:
    if name == "dist_trainer":
        cmd = torchrun_cmd("-m", "dist_trainer", *DIST_TRAINER_OVERRIDES, "trainer.max_steps=2",
                           f"hydra.run.dir={tmp / 'run'}")
    else:
        cmd = torchrun_cmd(str(BENCH / "handwritten.py"), "--steps", "2", "--out", str(tmp / "hw.json"))
    seen = {}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tmp, env=bench_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    tail = []
    for line in proc.stdout:
        now = time.perf_counter() - start
        tail = (tail + [line])[-40:]
        for mark, text in MARKS[name].items():
            if mark not in seen and text in line:
                seen[mark] = now
    rc = proc.wait()
    total = time.perf_counter() - start
    if rc != 0 or "first" not in seen:
        raise RuntimeError(f"{name} failed (rc {rc}):\n{''.join(tail)}")
    return {**seen, "exit": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    print(machine_description(), flush=True)
    print(f"\nlaunch -> first optimizer step, torchrun 2 ranks, {args.reps} alternated repetitions\n", flush=True)
    results = {"dist_trainer": [], "handwritten": []}
    for rep in range(1, args.reps + 1):
        for name in results:
            with tempfile.TemporaryDirectory(prefix=f"bench-start-{name}-") as tmp:
                r = launch(name, Path(tmp))
            results[name].append(r)
            built = f", built at {r['built']:.2f} s" if "built" in r else ""
            print(f"rep {rep} {name:12s} first step at {r['first']:.2f} s{built} (process exited at {r['exit']:.2f} s)",
                  flush=True)
    print("\n| launcher | median launch -> first step (s) | min | max | median launch -> built (s) |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        firsts = [r["first"] for r in rs]
        built = statistics.median(r["built"] for r in rs) if all("built" in r for r in rs) else None
        print(f"| {name} | {statistics.median(firsts):.2f} | {min(firsts):.2f} | {max(firsts):.2f} | "
              f"{f'{built:.2f}' if built is not None else '-'} |")
    dt = statistics.median(r["first"] for r in results["dist_trainer"])
    hw = statistics.median(r["first"] for r in results["handwritten"])
    print(f"\ndist_trainer takes {dt - hw:+.2f} s ({dt / hw:.2f}x) to its first optimizer step vs the hand-written loop")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
