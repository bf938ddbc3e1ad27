"""Mixture of experts on 2 CPU ranks: expert parallelism against replicated experts, the counting pass's cost,
and all-to-all bytes against plan mode's.

    python bench/moe.py                 # about 4 minutes on 2 cores
    python bench/moe.py --rounds 3 --timed 10

Every mode runs the default GPT (4 blocks x 128 wide) with each MLP a layer of 8 SwiGLU experts, 2 a token,
hidden 512, fp32, AdamW, on 2 ranks with the same global batch of 64 sequences of 64 bytes, micro-batches of 16
(accum 2):

* ddp and fsdp: every rank holds every expert (fsdp: a shard of each);
* ep 2 under ddp and fsdp: each rank holds 4 experts of every layer, tokens reach them by all-to-all;
* the aux term's scope under ddp: ``global`` (the default; the step's expert counts come from a forward pass
  without gradients per micro-batch first), ``sequence`` (no such pass), and aux off.

``torchrun -m dist_trainer``, the modes alternated over rounds, the median ``step_time_s`` after the warm-up
steps, as a ratio to the ddp mode (global scope) of the same run. Beside it each mode's ``state_mb`` and, for
ep, the step's ``all_to_alls`` and ``all_to_all_bytes`` against ``plan.json``'s calls and bound. 2 ranks on 2
cores, gloo: a CPU measures the machinery's cost, not what NVLink would give a GPU.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer_with_plan  # noqa: E402

WORLD = 2
BASE = ["batch.micro_batch_size=16", "batch.global_batch_size=64", "model.moe.num_experts=8", "model.moe.top_k=2",
        "model.moe.hidden=512", "trainer.eval_every=0"]
MODES = {
    "ddp": [],
    "ep 2 (ddp)": ["dist.ep.size=2"],
    "fsdp": ["dist.strategy=fsdp"],
    "ep 2 (fsdp)": ["dist.ep.size=2", "dist.strategy=fsdp"],
    "ddp, aux sequence": ["model.moe.aux_loss.scope=sequence"],
    "ddp, aux off": ["model.moe.aux_loss.coef=0"],
}


def main() -> None:
    args = rounds_parser(__doc__).parse_args()
    print(machine_description())
    print(f"\n{WORLD} ranks, global 64 x 64 bytes, micro 16 (accum 2), 8 experts top 2; {args.warmup} warm-up + "
          f"{args.timed} timed steps, modes alternated over {args.rounds} rounds; median step_time_s\n", flush=True)
    results = {name: [] for name in MODES}
    for rnd in range(1, args.rounds + 1):
        for name, keys in MODES.items():
            recs, plan = run_dist_trainer_with_plan(BASE + keys, args.warmup + args.timed, WORLD)
            timed = recs[args.warmup:]
            last = recs[-1]
            results[name].append({
                "times": [r["step_time_s"] for r in timed], "loss": last["loss"], "state_mb": last["state_mb"],
                "all_to_alls": [r.get("all_to_alls", 0) for r in timed[1:]],
                "all_to_all_bytes": max(r.get("all_to_all_bytes", 0) for r in timed),
                "plan_all_to_alls": (plan["step"] or {}).get("all_to_alls", 0),
                "plan_bytes_max": plan.get("ep_all_to_all_bytes_max"), "plan_state_mb": plan["state_mb"],
                "expert_load_max": last.get("expert_load_max"), "aux_loss": last.get("aux_loss")})
            print(f"round {rnd} {name:18s} median {statistics.median(results[name][-1]['times']) * 1000:7.1f} "
                  f"ms/step (loss at step {len(recs)}: {last['loss']:.6f})", flush=True)
    base = statistics.median(t for r in results["ddp"] for t in r["times"])
    print("\n| mode | median step (ms) | vs ddp | state_mb (plan) | all-to-alls a step (plan) | "
          "all-to-all bytes, most of a step (plan's bound) | expert load max / mean | loss at the last step |")
    print("|---|---|---|---|---|---|---|---|")
    for name in MODES:
        med = statistics.median(t for r in results[name] for t in r["times"])
        last = results[name][-1]
        calls = sorted(set(c for r in results[name] for c in r["all_to_alls"]))
        bound = last["plan_bytes_max"]
        print(f"| {name} | {med * 1000:.1f} | {med / base:.2f}x | {last['state_mb']:.2f} ({last['plan_state_mb']:.2f}) "
              f"| {', '.join(map(str, calls))} ({last['plan_all_to_alls']}) | {last['all_to_all_bytes']:,} "
              f"({'' if bound is None else f'{bound:,}'}) | {last['expert_load_max']:.2f} | {last['loss']:.6f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
