"""The benchmark job through Hugging Face Accelerate (accelerator.accumulate, clip_grad_norm_).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/run_accelerate.py --steps 60 --out times.json

The DataLoader is not passed to ``accelerator.prepare``: Accelerate would shard
it with its own order, and the benchmark feeds every framework the same
micro-batches (dist_trainer's order). ``accumulate`` then syncs every
``gradient_accumulation_steps`` micro-batches by counting, and runs the other
backward passes under DDP's ``no_sync``.
"""

from __future__ import annotations

import time

from accelerate import Accelerator
from torch.utils.data import DataLoader

from common import (
    ACCUM, CLIP, StepClock, build_dataset, build_model, make_adamw, rank_micro_batches, runner_args,
)


def main() -> None:
    args = runner_args()

    launched = time.time()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True, mixed_precision="no")
    model = build_model()
    optimizer = make_adamw(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    dataset = build_dataset()
    rank, world = accelerator.process_index, accelerator.num_processes
    loader = DataLoader(dataset, batch_sampler=rank_micro_batches(len(dataset), rank, world, args.steps))

    clock = StepClock()
    for batch in loader:
        with accelerator.accumulate(model):
            out = model(batch)
            # the micro-batch's mean; accelerator.backward divides by the accumulation steps
            accelerator.backward(out["loss_sum"] / out["num_items"])
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        clock.add(out["loss_sum"], out["num_items"])
        if accelerator.sync_gradients:
            clock.tick()
    clock.dump(args.out, framework="accelerate", distributed_type=str(accelerator.distributed_type),
               launched_wall=launched)
    accelerator.wait_for_everyone()  # both ranks done before the group is torn down
    accelerator.end_training()


if __name__ == "__main__":
    main()
