"""Sharding across nodes: collectives and memory per mode from the plan, and step time per mode on CPU.

    python bench/comm_plan.py                 # both parts, about 5 minutes on 2 cores
    python bench/comm_plan.py --part plan     # plan mode only: 8 nodes x 8 ranks, no process started
    python bench/comm_plan.py --part speed    # torchrun runs on 2 ranks, every mode side by side

plan: the numbers ``plan.json`` holds (which a run's steps equal exactly; the
tests hold them to it), for 64 ranks as 8 nodes of 8: bytes per optimizer step
of all-gathers, reduce-scatters and all-reduces against the micro-batches K, for
ddp, fsdp over all 64 ranks and hsdp (``dist.fsdp.shard_size=node``: shard
groups of 8, 8 replicas), in each ``dist.fsdp.reshard`` mode, with
``accum_sync=last``; and which of them cross the nodes (fsdp: all of them; hsdp:
only the replica all-reduce); ``state_mb`` and ``step_peak_state_mb`` per mode.
Two models: the default GPT (0.8 M parameters, fp32) and GPT-2 small's shape
(124 M, bf16-master), both built on the meta device.

speed: the default job on 2 ranks at K = 4 (micro 8, global 64): ddp, fsdp in
each reshard mode, and hsdp with shard groups of one rank (2 replicas), rounds
alternated, median ``step_time_s`` after the warm-up as a ratio to ddp's in the
same run, with each run's measured collectives and ``step_peak_state_mb``. gloo
emulates reduce-scatter with all-reduces on CPU, so these times say little
about a GPU cluster; the counted bytes say what crosses the wire.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer  # noqa: E402

MIB = 2**20
NODES, PER_NODE = 8, 8
MODELS = {
    "default GPT (fp32)": ({"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "vocab_size": 256}, "fp32", 16),
    "GPT-2 small (bf16-master)": ({"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
                                   "vocab_size": 50257}, "bf16-master", 8),
}
MESHES = {"ddp": ("ddp", None), "fsdp 64": ("fsdp", None), "hsdp 8x8": ("fsdp", "node")}
RESHARDS = ("micro_batch", "forward", "step")


def plan_for(model: dict, precision: str, micro: int, accum: int, strategy: str, shard_size, reshard: str) -> dict:
    from dist_trainer.config import BatchConfig, Config, DistConfig, FSDPConfig, PrecisionConfig, TrainerConfig
    from dist_trainer.validation import validate
    from dist_trainer.plan import plan_numbers

    cfg = Config(model={"_target_": "dist_trainer.models.GPT", "dropout": 0.0, **model},
                 data={"_target_": "dist_trainer.data.builtin.char_text"},
                 batch=BatchConfig(micro_batch_size=micro, accum_steps=accum),
                 precision=PrecisionConfig(name=precision), trainer=TrainerConfig(),
                 dist=DistConfig(strategy=strategy, fsdp=FSDPConfig(shard_size=shard_size, reshard=reshard)))
    return plan_numbers(cfg, validate(cfg, NODES * PER_NODE, PER_NODE))


def plan_part() -> list:
    rows = []
    for title, (model, precision, micro) in MODELS.items():
        print(f"\n{title}, {NODES} nodes x {PER_NODE} ranks, micro {micro}, accum_sync=last: MiB per optimizer "
              "step per rank (all-gathers / reduce-scatters / all-reduces); crossing nodes: the MiB of those that "
              "run over ranks of several nodes\n", flush=True)
        print("| mesh | reshard | K | all-gathers | reduce-scatters | all-reduces | crossing nodes | vs ddp's "
              "all-reduce | state_mb | step_peak_state_mb |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for accum in (1, 2, 4, 8, 16):
            ddp_bytes = None
            for mesh, (strategy, shard_size) in MESHES.items():
                for reshard in (RESHARDS if strategy == "fsdp" else ("-",)):
                    numbers = plan_for(model, precision, micro, accum, strategy, shard_size,
                                       reshard if strategy == "fsdp" else "micro_batch")
                    step = numbers["step"]
                    gathered, scattered, reduced = (step[k] / MIB for k in (
                        "all_gather_bytes", "reduce_scatter_bytes", "allreduce_bytes"))
                    crossing = reduced if mesh != "fsdp 64" else gathered + scattered
                    if strategy == "ddp":
                        ddp_bytes = reduced
                    rows.append({"model": title, "mesh": mesh, "reshard": reshard, "accum": accum, **step,
                                 "crossing_mib": crossing, "state_mb": numbers["state_mb"],
                                 "step_peak_state_mb": numbers["step_peak_state_mb"]})
                    print(f"| {mesh} | {reshard} | {accum} | {gathered:,.1f} | {scattered:,.1f} | {reduced:,.1f} | "
                          f"{crossing:,.1f} | {crossing / ddp_bytes:.2f}x | {numbers['state_mb']:,.1f} | "
                          f"{numbers['step_peak_state_mb']:,.1f} |", flush=True)
    return rows


SPEED_MODES = {
    "ddp": ["dist.strategy=ddp"],
    **{f"fsdp {r}": ["dist.strategy=fsdp", f"dist.fsdp.reshard={r}"] for r in RESHARDS},
    "hsdp 2x1 step": ["dist.strategy=fsdp", "dist.fsdp.shard_size=1", "dist.fsdp.reshard=step"],
}


def speed_part(rounds: int, warmup: int, timed: int) -> dict:
    print(f"\nSTEP TIME: the default GPT on 2 ranks x micro 8 x accum 4, {warmup} warm-up + {timed} timed steps, "
          f"modes alternated over {rounds} rounds; median step_time_s\n", flush=True)
    batch = ["batch.micro_batch_size=8", "batch.global_batch_size=64", "trainer.eval_every=0"]
    results = {name: [] for name in SPEED_MODES}
    last = {}
    for rnd in range(1, rounds + 1):
        for name, keys in SPEED_MODES.items():
            recs = run_dist_trainer(keys + batch, warmup + timed)
            times = [r["step_time_s"] for r in recs[warmup:]]
            results[name].extend(times)
            last[name] = recs[-1]
            print(f"round {rnd} {name:16s} median {statistics.median(times) * 1000:7.1f} ms/step", flush=True)
    ddp = statistics.median(results["ddp"])
    print("\n| mode | median step (ms) | vs ddp | all-gathers (MiB) | reduce-scatters (MiB) | all-reduces (MiB) | "
          "state_mb | step_peak_state_mb | loss at the last step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in SPEED_MODES:
        r, med = last[name], statistics.median(results[name])
        print(f"| {name} | {med * 1000:.1f} | {med / ddp:.2f}x | {r['all_gathers']} ({r['all_gather_bytes'] / MIB:.2f}) | "
              f"{r['reduce_scatters']} ({r['reduce_scatter_bytes'] / MIB:.2f}) | "
              f"{r['allreduces']} ({r['allreduce_bytes'] / MIB:.2f}) | {r['state_mb']:.2f} | "
              f"{r['step_peak_state_mb']:.2f} | {r['loss']:.6f} |")
    return {"times": results, "last": last}


def main() -> None:
    args = rounds_parser(__doc__, ("plan", "speed")).parse_args()
    print(machine_description(), flush=True)
    out = {}
    if args.part in ("all", "plan"):
        out["plan"] = plan_part()
    if args.part in ("all", "speed"):
        out["speed"] = speed_part(args.rounds, args.warmup, args.timed)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
