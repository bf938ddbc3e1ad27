"""Per-step overhead, paired in one process: dist_trainer's Trainer.train_step vs a hand-written step.

    python bench/step_ab.py               # 2 ranks, 40 paired steps after 5 warm-up steps

A diagnostic beside bench/overhead.py, for a noisy machine: separate runs
minutes apart see different background load, but two steps taken one right
after the other see the same. Each rank holds two identical DDP models of the
benchmark job: one inside dist_trainer's Trainer (built by dist_trainer.run.build,
unpatched), one driven by the hand-written step of bench/handwritten.py. Every
step, both get the very same collated micro-batches (so data loading is out of
the comparison) and run one after the other, in alternating order (AB, BA, ...).
Reported: median step time of each, and the median of the paired differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ACCUM, CLIP, GLOBAL, LR, MICRO, MODEL, SEED, WEIGHT_DECAY, bench_env, machine_description, torchrun_cmd  # noqa: E402


def worker(out_path: str, warmup: int, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dist_trainer import distributed
    from dist_trainer.config import BatchConfig, Config, OptimConfig, TrainerConfig, validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.run import build

    from common import build_model, make_adamw

    env = distributed.init("cpu")
    cfg = Config(model={"_target_": "dist_trainer.models.GPT", **MODEL},
                 data={"_target_": "dist_trainer.datasets.char_text", "block_size": MODEL["block_size"]},
                 batch=BatchConfig(micro_batch_size=MICRO, global_batch_size=GLOBAL),
                 optim=OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=CLIP, warmup_steps=0,
                                   schedule="constant"),
                 trainer=TrainerConfig(max_steps=warmup + steps, seed=SEED))
    plan = validate(cfg, env.world_size)
    parts = build(cfg, plan, env)
    trainer = parts.trainer

    model = build_model()
    ddp = DDP(model)
    optimizer = make_adamw(model)
    divisor = MICRO * ACCUM * MODEL["block_size"]

    def handwritten(batches):
        for i, batch in enumerate(batches):
            with ddp.no_sync() if i < len(batches) - 1 else nullcontext():
                (ddp(batch)["loss_sum"] / divisor).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = {"dist_trainer": [], "handwritten": []}
    source = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step in range(1, warmup + steps + 1):
        window, batches = next(source)
        order = ["dist_trainer", "handwritten"] if step % 2 else ["handwritten", "dist_trainer"]
        for name in order:
            dist.barrier()  # both ranks start each measured step together
            start = time.perf_counter()
            if name == "dist_trainer":
                trainer.train_step(batches, window, step)
            else:
                handwritten(batches)
            elapsed = time.perf_counter() - start
            if step > warmup:
                times[name].append(elapsed)
    same = all(torch.equal(a, b) for a, b in zip(trainer.model.module.parameters(), model.parameters()))
    close = max((a - b).abs().max().item() for a, b in zip(trainer.model.module.parameters(), model.parameters()))
    if env.rank == 0:
        Path(out_path).write_text(json.dumps({"times": times, "params_equal": same, "max_param_diff": close}))
    distributed.shutdown(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.warmup, args.steps)
        return
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        out = Path(tmp) / "ab.json"
        cmd = torchrun_cmd(str(Path(__file__).resolve()), "--worker", str(out), "--warmup", str(args.warmup),
                           "--steps", str(args.steps))
        subprocess.run(cmd, cwd=tmp, env=bench_env(), check=True, capture_output=True)
        r = json.loads(out.read_text())
    dt, hw = r["times"]["dist_trainer"], r["times"]["handwritten"]
    diffs = sorted(a - b for a, b in zip(dt, hw))
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    print(f"\n{args.steps} paired steps (2 ranks x micro {MICRO} x accum {ACCUM}, fp32), rank 0:")
    print(f"  dist_trainer Trainer.train_step  median {statistics.median(dt) * 1000:7.1f} ms")
    print(f"  hand-written step                median {statistics.median(hw) * 1000:7.1f} ms")
    print(f"  paired difference (dt - hw)      median {statistics.median(diffs) * 1000:+7.2f} ms "
          f"(quartiles {q(diffs, .25) * 1000:+.2f} .. {q(diffs, .75) * 1000:+.2f} ms)")
    print(f"  ratio (hand-written / dist_trainer median) {statistics.median(hw) / statistics.median(dt):.3f}")
    print(f"  parameters after the run: bit-equal {r['params_equal']}, max |difference| {r['max_param_diff']:.2e}")


if __name__ == "__main__":
    main()
