"""Where dist_trainer's training loop spends its time: py-spy over the benchmark job.

    python bench/profile_loop.py               # 40 steps, 2 ranks, py-spy at 200 Hz
    python bench/profile_loop.py --steps 60 --keep /tmp/profile.txt

Runs ``torchrun -m dist_trainer`` with the job of bench/overhead.py under
``py-spy record --subprocesses`` (collapsed stacks), then attributes the rank
processes' samples inside ``_loop`` to its direct callees (train_step, data
loading, the per-step record, checkpoint...) and those inside
``Trainer.train_step`` to the framework's lines. Anything that is neither the
model's forward, its backward nor the optimizer's step is framework overhead.
py-spy steals CPU from a 2-core machine, so the step times of a profiled run
are not benchmark numbers; the proportions are what to read.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DIST_TRAINER_OVERRIDES, bench_env, torchrun_cmd  # noqa: E402


def short(frame: str) -> str:
    return re.sub(r" \((?:.*/)?([^/]+/[^/]+:\d+)\)", r" (\1)", frame)


def breakdown(path: Path, anchor: str, depth: int = 1) -> tuple[int, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2 or not frames[1].startswith("process") or "dist_trainer" not in frames[1]:
            continue  # only the rank processes, not the torchrun agent
        hits = [i for i, f in enumerate(frames) if f.startswith(anchor + " ")]
        if not hits:
            continue
        i = hits[0]
        total += int(n)
        counts[" > ".join(short(f) for f in frames[i + 1:i + 1 + depth]) or "<own lines>"] += int(n)
    return total, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", type=int, default=200)
    parser.add_argument("--keep", help="copy the raw collapsed stacks here")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        sys.exit("py-spy not found: pip install -r bench/requirements.txt")
    with tempfile.TemporaryDirectory(prefix="bench-prof-") as tmp:
        raw = Path(tmp) / "stacks.txt"
        cmd = ["py-spy", "record", "--subprocesses", "--format", "raw", "-r", str(args.rate), "-o", str(raw), "--",
               *torchrun_cmd("-m", "dist_trainer", *DIST_TRAINER_OVERRIDES, f"trainer.max_steps={args.steps}",
                             f"hydra.run.dir={Path(tmp) / 'run'}")]
        subprocess.run(cmd, cwd=tmp, env=bench_env(), check=True, capture_output=True)
        if args.keep:
            shutil.copy(raw, args.keep)
        for anchor, depth in (("_loop", 1), ("Trainer.train_step", 1), ("Trainer._apply", 1),
                              ("Trainer._reduce_window", 1)):
            total, counts = breakdown(raw, anchor, depth)
            print(f"\nsamples inside {anchor}: {total} (both ranks)")
            for key, n in counts.most_common(12):
                print(f"  {n:6d} {100 * n / max(total, 1):5.1f}%  {key}")


if __name__ == "__main__":
    main()
