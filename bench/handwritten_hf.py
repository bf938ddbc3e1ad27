"""A hand-written DDP + no_sync + AdamW loop over a Hugging Face GPT-2 (the limit for model=hf_causal_lm).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/handwritten_hf.py --steps 60 --out times.json

The same transformers model (GPT2LMHeadModel of bench/hf.py's shape, built
with the weights dist_trainer starts from), data order, token-weighted loss
from the logits (summed cross-entropy over the step's tokens), grad clip and
AdamW as ``dist_trainer model=hf_causal_lm``, and nothing else.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from common import ACCUM, CLIP, MICRO, MODEL, SEED, StepClock, build_dataset, make_adamw, rank_micro_batches, runner_args
from hf import HF_CONFIG


def main() -> None:
    args = runner_args()
    launched = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from dist_trainer.models.hf import hf_model

    torch.manual_seed(SEED)  # as dist_trainer seeds before it builds the model
    model = hf_model("causal_lm", "gpt2", dict(HF_CONFIG), block_size=MODEL["block_size"]).model
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
                logits = ddp(input_ids=batch["input_ids"], use_cache=False).logits
                loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten(), reduction="sum")
                (loss_sum / divisor).backward()
            clock.add(loss_sum, torch.tensor(batch["targets"].numel()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
        if first_step_wall is None:
            first_step_wall = time.time()
    clock.dump(args.out, framework="handwritten_hf", first_step_wall=first_step_wall, launched_wall=launched)
    dist.barrier()  # both ranks done before the group goes (torch 2.13 can abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
