"""Sharding: memory, collectives and step time of ddp and fsdp; activation checkpointing (CPU).

    python bench/fsdp.py                  # all three parts, about 10 minutes on 2 cores
    python bench/fsdp.py --part memory    # state_mb, peak RSS and collectives per world size and accum
    python bench/fsdp.py --part speed     # step time of fsdp relative to ddp, side by side
    python bench/fsdp.py --part ac        # activation checkpointing: memory saved, time spent

Every run is ``torchrun -m dist_trainer`` on the default GPT (4 blocks x 128 wide,
AdamW, fp32 unless said), and every number comes from its metrics.jsonl:

* memory: ``state_mb`` (model state of the largest rank after the optimizer step,
  from the tensors) and ``peak_mem_mb`` (rank 0's peak RSS: the whole process,
  Python and the dataset included), for ddp, fsdp with ``accum_sync=last`` and
  with ``every``, at 1, 2 and 4 ranks (4 on 2 cores is oversubscribed: fine for
  memory, not for time) and accum 1, 4 and 16 of micro-batches of 4;
  reduce-scatters, all-gathers and all-reduces per step, and their MiB;
* speed: the default job (2 ranks x micro 16 x accum 2), ddp and fsdp alternated
  over rounds, median ``step_time_s`` after the warm-up steps;
* ac: the same job at micro 64 x accum 1 under ddp, activation checkpointing off
  and on: rank 0's peak RSS and the median step time.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer  # noqa: E402

MIB = 2**20
STRATEGIES = {"ddp": ["dist.strategy=ddp"], "fsdp last": ["dist.strategy=fsdp", "dist.fsdp.accum_sync=last"],
              "fsdp every": ["dist.strategy=fsdp", "dist.fsdp.accum_sync=every"]}


def memory_part(steps: int) -> list:
    print(f"\nMEMORY AND COLLECTIVES: micro 4, {steps} steps per run; state_mb (MiB, largest rank), rank 0's "
          "peak RSS (MB), collectives per step (calls / MiB)\n", flush=True)
    print("| strategy | ranks | accum | state_mb | peak RSS | all-reduces | reduce-scatters | all-gathers |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for world in (1, 2, 4):
        for accum in (1, 4, 16):
            for name, keys in STRATEGIES.items():
                if name == "fsdp every" and accum == 1:
                    continue  # the same as last with one micro-batch
                rec = run_dist_trainer(keys + ["batch.micro_batch_size=4",
                                               f"batch.global_batch_size={4 * accum * world}"], steps, world)[-1]
                row = {"strategy": name, "world": world, "accum": accum, **{k: rec.get(k) for k in (
                    "state_mb", "peak_mem_mb", "allreduces", "allreduce_bytes", "reduce_scatters",
                    "reduce_scatter_bytes", "all_gathers", "all_gather_bytes", "step_time_s")}}
                rows.append(row)

                def calls(kind: str, size: str) -> str:
                    return "-" if not row[kind] else f"{row[kind]} / {row[size] / MIB:.2f}"

                print(f"| {name} | {world} | {accum} | {row['state_mb']:.2f} | {row['peak_mem_mb']:.0f} | "
                      f"{calls('allreduces', 'allreduce_bytes')} | {calls('reduce_scatters', 'reduce_scatter_bytes')} | "
                      f"{calls('all_gathers', 'all_gather_bytes')} |", flush=True)
    return rows


def speed_part(rounds: int, warmup: int, timed: int) -> dict:
    print(f"\nSTEP TIME: 2 ranks x micro 16 x accum 2, {warmup} warm-up + {timed} timed steps, strategies "
          f"alternated over {rounds} rounds; median step_time_s\n", flush=True)
    results = {name: [] for name in STRATEGIES}
    for rnd in range(1, rounds + 1):
        for name, keys in STRATEGIES.items():
            recs = run_dist_trainer(keys, warmup + timed)
            times = [r["step_time_s"] for r in recs[warmup:]]
            results[name].append({"times": times, "loss": recs[-1]["loss"]})
            print(f"round {rnd} {name:10s} median {statistics.median(times) * 1000:7.1f} ms/step "
                  f"(loss at step {warmup + timed}: {recs[-1]['loss']:.6f})", flush=True)
    ddp = statistics.median(t for r in results["ddp"] for t in r["times"])
    print("\n| strategy | median step (ms) | vs ddp | loss at the last step |")
    print("|---|---|---|---|")
    for name in STRATEGIES:
        med = statistics.median(t for r in results[name] for t in r["times"])
        print(f"| {name} | {med * 1000:.1f} | {med / ddp:.2f}x | {results[name][-1]['loss']:.6f} |")
    return results


def ac_part(rounds: int, warmup: int, timed: int) -> dict:
    print(f"\nACTIVATION CHECKPOINTING: ddp, 2 ranks x micro 64 x accum 1, {warmup} warm-up + {timed} timed steps, "
          f"{rounds} rounds alternated; rank 0's peak RSS and median step time\n", flush=True)
    results = {False: [], True: []}
    for _ in range(rounds):
        for ac in (False, True):
            recs = run_dist_trainer(["batch.micro_batch_size=64", "batch.global_batch_size=128",
                                     f"dist.activation_checkpointing={str(ac).lower()}"], warmup + timed)
            results[ac].append({"times": [r["step_time_s"] for r in recs[warmup:]],
                                "peak": recs[-1]["peak_mem_mb"], "loss": recs[-1]["loss"]})
    print("| activation checkpointing | peak RSS (MB) | median step (ms) | loss at the last step |")
    print("|---|---|---|---|")
    for ac in (False, True):
        peak = statistics.median(r["peak"] for r in results[ac])
        med = statistics.median(t for r in results[ac] for t in r["times"])
        print(f"| {'on' if ac else 'off'} | {peak:.0f} | {med * 1000:.1f} | {results[ac][-1]['loss']:.6f} |")
    return {str(k): v for k, v in results.items()}


def main() -> None:
    parser = rounds_parser(__doc__, ("memory", "speed", "ac"))
    parser.add_argument("--steps", type=int, default=3, help="memory part: optimizer steps per run")
    args = parser.parse_args()
    print(machine_description(), flush=True)
    out = {}
    if args.part in ("all", "memory"):
        out["memory"] = memory_part(args.steps)
    if args.part in ("all", "speed"):
        out["speed"] = speed_part(args.rounds, args.warmup, args.timed)
    if args.part in ("all", "ac"):
        out["ac"] = ac_part(args.rounds, args.warmup, args.timed)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
