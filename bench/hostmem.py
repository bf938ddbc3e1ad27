"""What ``trainer.tune_malloc`` buys and costs on CPU: step time, page faults, peak memory.

    python bench/hostmem.py                    # 3 rounds, 10 warm-up + 40 timed steps per run, ~2 min

The benchmark job of bench/overhead.py through ``torchrun -m dist_trainer``,
alternated in fresh launches: ``trainer.tune_malloc=reuse`` (every block kept in the heap; what ``true``
chooses for this ddp job), ``=bounded`` (blocks from 1 MiB up returned when freed; what ``true`` chooses
where the model is cut across ranks) and ``=false`` (glibc's own, moving threshold). Per run: the median ``step_time_s``, the peak resident set of
rank 0 (``peak_mem_mb`` of its last step), and the minor page faults of the
whole launch (agent and both ranks, from this process's RUSAGE_CHILDREN). The
start-up work is the same in both, so the difference in faults divided by the
steps run is what the setting saves per step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import allocator_env, machine_description  # noqa: E402
from overhead import run_dist_trainer  # noqa: E402

VARIANTS = {  # name: (override, environment)
    "reuse": ("trainer.tune_malloc=reuse", {}),
    "bounded": ("trainer.tune_malloc=bounded", {}),
    "system": ("trainer.tune_malloc=false", {}),
}


def one_run(setting: tuple, warmup: int, steps: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    override, env = setting
    with tempfile.TemporaryDirectory(prefix="bench-hostmem-") as tmp:
        result = run_dist_trainer(Path(tmp), warmup, steps, 600, extra=(override,), env=env)
    result["faults"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if allocator_env():
        parser.error(f"unset {sorted(allocator_env())}: with them set, dist_trainer leaves malloc alone in both variants")
    print(machine_description(), flush=True)
    runs = {name: [] for name in VARIANTS}
    for rnd in range(1, args.rounds + 1):
        for name, setting in VARIANTS.items():
            r = one_run(setting, args.warmup, args.steps)
            runs[name].append(r)
            print(f"round {rnd} {name:10s} median step {statistics.median(r['times']) * 1000:6.1f} ms | "
                  f"peak RSS rank 0 {r['peak_mem_mb']:6.1f} MiB | minor faults {r['faults']:,}", flush=True)
    total_steps = args.warmup + args.steps + 1
    ref = [statistics.median(r["times"]) for r in runs["system"]]
    print(f"\n| malloc | median step (ms) | speed vs system (median of rounds) | peak RSS rank 0 (MiB) | "
          f"minor faults per launch ({total_steps} steps, 2 ranks + agent) |")
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        meds = [statistics.median(r["times"]) for r in runs[name]]
        ratio = statistics.median(s / m for s, m in zip(ref, meds))
        print(f"| {name} | {statistics.median(meds) * 1000:.1f} | {ratio:.3f} | "
              f"{statistics.median(r['peak_mem_mb'] for r in runs[name]):.1f} | "
              f"{statistics.median(r['faults'] for r in runs[name]):,.0f} |")
    for name in ("reuse", "bounded"):
        saved = (statistics.median(r["faults"] for r in runs["system"])
                 - statistics.median(r["faults"] for r in runs[name])) / total_steps
        print(f"faults saved per optimizer step against the system's (both ranks), {name}: {saved:,.0f}")


if __name__ == "__main__":
    main()
