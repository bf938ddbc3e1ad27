"""Pipeline stages on 2 CPU ranks: each schedule's measured idle fraction against its predicted bubble,
step time against ddp on the same ranks, and what each stage group holds.

    python bench/pp.py                  # about 4 minutes on 2 cores
    python bench/pp.py --rounds 3       # more rounds, alternated

Every mode runs the default GPT (4 blocks x 128 wide, 4 heads, AdamW, fp32) on the same 2 ranks with the
same global batch of 64 sequences of 64 bytes (bench/common.py's job):

* ddp: 2 data-parallel ranks x micro 16 x accum 2;
* pp 2 (one stage group per rank, one data-parallel rank): gpipe and 1f1b with 4 and 8 micro-batches
  (micro 16 and 8), interleaved 1f1b and zero bubble (ZBV: stages placed in a V, the backward split into
  input and weight passes) with 2 stages a rank (4 stages of one block) with 4 and 8.

Each mode is a real ``torchrun -m dist_trainer`` run; the modes alternate over rounds and each reports the
median over its timed steps of ``step_time_s`` and of each stage group's ``pp_idle_frac`` (its rank's
schedule wall time not spent in a stage's forward or backward: the bubble and the waits for the peer),
beside ``pp_bubble`` ((p - 1) / (m + p - 1); interleaving v stages a rank: (p - 1) / (v m + p - 1); zero
bubble: torch's order simulated with a unit of time per forward, backward to the input and to the weights).
Two ranks on two cores: a stage's idle time is time the other stage's rank can use, so the step time
gains less from a small bubble than a GPU pair would; the ratio to ddp measures the machinery's cost here.
State per stage group is plan.json's ``pp_stage_groups`` (equal to the run's counters, tests/test_pp.py),
with the sends per step.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer_with_plan  # noqa: E402

MODES = {
    "ddp": ["batch.micro_batch_size=16"],
    "gpipe, m 4": ["dist.pp.size=2", "dist.pp.schedule=gpipe", "batch.micro_batch_size=16"],
    "gpipe, m 8": ["dist.pp.size=2", "dist.pp.schedule=gpipe", "batch.micro_batch_size=8"],
    "1f1b, m 4": ["dist.pp.size=2", "dist.pp.schedule=1f1b", "batch.micro_batch_size=16"],
    "1f1b, m 8": ["dist.pp.size=2", "dist.pp.schedule=1f1b", "batch.micro_batch_size=8"],
    "interleaved x2, m 4": ["dist.pp.size=2", "dist.pp.schedule=interleaved_1f1b", "dist.pp.stages_per_rank=2",
                            "batch.micro_batch_size=16"],
    "interleaved x2, m 8": ["dist.pp.size=2", "dist.pp.schedule=interleaved_1f1b", "dist.pp.stages_per_rank=2",
                            "batch.micro_batch_size=8"],
    "zero bubble V, m 4": ["dist.pp.size=2", "dist.pp.schedule=zero_bubble", "dist.pp.stages_per_rank=2",
                           "batch.micro_batch_size=16"],
    "zero bubble V, m 8": ["dist.pp.size=2", "dist.pp.schedule=zero_bubble", "dist.pp.stages_per_rank=2",
                           "batch.micro_batch_size=8"],
}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    args = rounds_parser(__doc__).parse_args()
    print(machine_description(), flush=True)
    print(f"\n2 ranks, global 64 x 64 bytes; {args.warmup} warm-up + {args.timed} timed steps, modes alternated "
          f"over {args.rounds} rounds; medians over the timed steps\n", flush=True)
    runs = {name: [] for name in MODES}
    plans = {}
    for rnd in range(1, args.rounds + 1):
        for name, keys in MODES.items():
            recs, plan = run_dist_trainer_with_plan(keys, args.warmup + args.timed, 2)
            plans[name] = plan
            timed = recs[args.warmup:]
            runs[name] += timed
            idle = [statistics.median(r["pp_idle_frac"][g] for r in timed) for g in range(2)] if "pp_bubble" in timed[0] \
                else None
            print(f"round {rnd} {name:20s} median {statistics.median(r['step_time_s'] for r in timed) * 1000:7.1f} "
                  f"ms/step, idle {idle}, loss at step {recs[-1]['step']}: {recs[-1]['loss']:.6f}", flush=True)
    ddp = statistics.median(r["step_time_s"] for r in runs["ddp"])
    print("\n| mode | accum | median step (ms) | vs ddp | idle, stage group 0 | idle, group 1 | bubble (predicted) |")
    print("|---|---|---|---|---|---|---|")
    table = {}
    for name, recs in runs.items():
        step = statistics.median(r["step_time_s"] for r in recs)
        row = {"step_ms": step * 1000, "vs_ddp": step / ddp, "accum": plans[name]["accum_steps"]}
        if "pp_bubble" in recs[0]:
            row.update(idle=[statistics.median(r["pp_idle_frac"][g] for r in recs) for g in range(2)],
                       bubble=recs[0]["pp_bubble"])
            idle = " | ".join(f"{i:.3f}" for i in row["idle"]) + f" | {row['bubble']:.3f}"
        else:
            idle = "- | - | -"
        table[name] = row
        print(f"| {name} | {row['accum']} | {step * 1000:.1f} | {step / ddp:.2f}x | {idle} |")
    print("\n| mode | state (MiB), stage group 0 | group 1 | step peak, group 0 | group 1 | sends a step, group 0 "
          "(calls / MiB) | group 1 |")
    print("|---|---|---|---|---|---|---|")
    for name, plan in plans.items():
        groups = plan.get("pp_stage_groups") or [plan]
        state = " | ".join(f"{g['state_mb']:.2f}" for g in groups)
        peak = " | ".join(f"{g['step_peak_state_mb']:.2f}" for g in groups)
        sends = " | ".join(f"{g['step']['p2p_sends']} / {_mib(g['step']['p2p_send_bytes'])}" for g in groups) \
            if len(groups) > 1 else "- | -"
        if len(groups) == 1:
            state, peak = f"{state} | (every rank)", f"{peak} | (every rank)"
        print(f"| {name} | {state} | {peak} | {sends} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": table, "plans": plans}, indent=1, default=str))


if __name__ == "__main__":
    main()
