"""The limit: a minimal hand-written DDP + no_sync + AdamW loop for the benchmark job.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/handwritten.py --steps 60 --out times.json

Nothing but what the update needs: the same model, data order, loss
normalisation (mean over the step's tokens), grad clip 1.0 and AdamW as
dist_trainer's default job, no logging, no checks. It relies on every sample
having ``block_size`` targets (true of char_text without min_len), so the
divisor is a constant. Rank 0 writes the end time of every optimizer step.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from common import (
    ACCUM, CLIP, MICRO, MODEL, StepClock, build_dataset, build_model, make_adamw, rank_micro_batches, runner_args,
)


def main() -> None:
    args = runner_args()

    launched = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    ddp = DDP(model)
    optimizer = make_adamw(model)
    dataset = build_dataset()
    loader = DataLoader(dataset, batch_sampler=rank_micro_batches(len(dataset), rank, world, args.steps))
    divisor = MICRO * ACCUM * MODEL["block_size"]  # this rank's tokens per step; DDP averages over ranks

    clock = StepClock()
    batches = iter(loader)
    first_step_wall = None
    for _ in range(args.steps):
        for i in range(ACCUM):
            batch = next(batches)
            with ddp.no_sync() if i < ACCUM - 1 else nullcontext():
                out = ddp(batch)
                (out["loss_sum"] / divisor).backward()
            clock.add(out["loss_sum"], out["num_items"])
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
        if first_step_wall is None:
            first_step_wall = time.time()
            if rank == 0:
                print(f"first optimizer step done at {first_step_wall:.6f}", flush=True)
    clock.dump(args.out, framework="handwritten", first_step_wall=first_step_wall, launched_wall=launched)
    # Both ranks done before the group goes: destroying it while the peer is
    # still inside a collective can abort gloo ("terminate called without an
    # active exception") with torch 2.13.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
