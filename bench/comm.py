"""Gradient all-reduces per optimizer step: no_sync (dist_trainer) vs a backward that syncs every time.

    python bench/comm.py                 # accum 1, 4, 16 on 2 gloo ranks, 2 optimizer steps each

For each number of accumulation steps, on 2 CPU ranks:

* dist_trainer: its own Trainer (built by dist_trainer.run.build from a Config),
  a few optimizer steps; StepOutcome.allreduces / allreduce_bytes are DDP's
  bucket all-reduces, counted by the framework's comm hook;
* plain, no no_sync: DDP on the same model, backward on every micro-batch,
  counted with dist_trainer.parallel.ddp.count_allreduces (DDP's default
  all-reduce, counted);
* plain, with no_sync: the same loop with no_sync on all but the last
  micro-batch (what dist_trainer should match).

The model is dist_trainer's default GPT (0.8 M parameters, fp32 gradients,
~3.2 MB); micro-batches of 4 samples keep it quick (the counts do not depend
on the micro-batch size). dist_trainer also issues one small all-reduce of
the step's totals and non-finite flags per step (5 + world float64 values),
which is not a gradient all-reduce and is listed separately.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL, bench_env, machine_description, torchrun_cmd  # noqa: E402

ACCUMS = (1, 4, 16)
MICRO = 4


def worker(out_path: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from dist_trainer import distributed
    from dist_trainer.config import BatchConfig, Config, OptimConfig, TrainerConfig
    from dist_trainer.validation import validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.parallel.ddp import count_allreduces
    from dist_trainer.precision import ModelWeights
    from dist_trainer.run import build

    from common import build_dataset, build_model, make_adamw, rank_micro_batches

    env = distributed.init("cpu")
    rows = []
    for accum in ACCUMS:
        # dist_trainer's Trainer
        cfg = Config(model={"_target_": "dist_trainer.models.GPT", **MODEL},
                     data={"_target_": "dist_trainer.data.builtin.char_text", "block_size": MODEL["block_size"]},
                     batch=BatchConfig(micro_batch_size=MICRO, accum_steps=accum),
                     optim=OptimConfig(lr=2e-3, grad_clip=1.0), trainer=TrainerConfig(max_steps=steps))
        plan = validate(cfg, env.world_size)
        parts = build(cfg, plan, env)
        outcomes = []
        for step, (window, batches) in enumerate(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False), 1):
            outcomes.append(parts.trainer.train_step(batches, window, step))
            if step == steps:
                break
        dt_calls = [o.allreduces for o in outcomes]
        dt_bytes = [o.allreduce_bytes for o in outcomes]
        params = sum(p.numel() for p in parts.trainer.model.module.parameters())
        del parts

        # plain DDP loops, with and without no_sync
        plain = {}
        for use_no_sync in (False, True):
            model = build_model()
            ddp = DDP(model)
            counter = count_allreduces(ddp, ModelWeights(model).reduce_bucket)  # DDP's default all-reduce, counted
            optimizer = make_adamw(model)
            dataset = build_dataset()
            loader = DataLoader(dataset, batch_sampler=rank_micro_batches(
                len(dataset), env.rank, env.world_size, steps, micro=MICRO, accum=accum))
            batches = iter(loader)
            calls, nbytes = [], []
            for _ in range(steps):
                c0, b0 = counter.calls, counter.bytes
                for i in range(accum):
                    sync = not use_no_sync or i == accum - 1
                    with nullcontext() if sync else ddp.no_sync():
                        out = ddp(next(batches))
                        (out["loss_sum"] / (MICRO * accum * MODEL["block_size"])).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                calls.append(counter.calls - c0)
                nbytes.append(counter.bytes - b0)
            plain[use_no_sync] = (calls, nbytes)
            del ddp
        rows.append({"accum": accum, "params": params, "dist_trainer_calls": dt_calls, "dist_trainer_bytes": dt_bytes,
                     "plain_calls": plain[False][0], "plain_bytes": plain[False][1],
                     "no_sync_calls": plain[True][0], "no_sync_bytes": plain[True][1]})
        dist.barrier()
    if env.rank == 0:
        Path(out_path).write_text(json.dumps({"world": env.world_size, "rows": rows}))
    distributed.shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
        out = Path(tmp) / "comm.json"
        cmd = torchrun_cmd(str(Path(__file__).resolve()), "--worker", str(out), "--steps", str(args.steps))
        subprocess.run(cmd, cwd=tmp, env=bench_env(), check=True)
        result = json.loads(out.read_text())
    world = result["world"]
    print(f"\n{world} ranks, micro {MICRO}, default GPT; gradient all-reduces per optimizer step in the steady "
          f"state (the last of {args.steps} steps; DDP rebuilds its buckets after the first step):\n")
    header = ("| accum | plain (no no_sync): all-reduces | bytes | with no_sync: all-reduces | bytes "
              "| dist_trainer: all-reduces | bytes | reduction (plain / dist_trainer bytes) |")
    print(header)
    print("|" + "---|" * 8)
    for row in result["rows"]:
        plain_bytes, dt_bytes = row["plain_bytes"][-1], row["dist_trainer_bytes"][-1]
        print(f"| {row['accum']} | {row['plain_calls'][-1]} | {plain_bytes:,} "
              f"| {row['no_sync_calls'][-1]} | {row['no_sync_bytes'][-1]:,} "
              f"| {row['dist_trainer_calls'][-1]} | {dt_bytes:,} | {plain_bytes / dt_bytes:.0f}x |")
    print("\nevery step, as lists (calls; bytes):")
    for row in result["rows"]:
        print(f"  accum {row['accum']:2d}: plain {row['plain_calls']}; {row['plain_bytes']} | no_sync "
              f"{row['no_sync_calls']}; {row['no_sync_bytes']} | dist_trainer {row['dist_trainer_calls']}; "
              f"{row['dist_trainer_bytes']}")
    params = result["rows"][0]["params"]
    print(f"\nparameters: {params:,} (fp32 gradients: {params * 4:,} bytes). dist_trainer adds one all-reduce "
          f"of {5 + world} float64 ({(5 + world) * 8} bytes) per step for its totals and skip decision "
          "(and one of 8 bytes at the very first step).")


if __name__ == "__main__":
    main()
