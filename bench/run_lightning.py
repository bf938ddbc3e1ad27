"""The benchmark job through PyTorch Lightning (accumulate_grad_batches, gradient_clip_val, ddp).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/run_lightning.py --steps 60 --out times.json

Launched by torchrun like the others: Lightning sees the torchelastic
environment and starts no processes of its own. ``use_distributed_sampler=False``
keeps the micro-batches every framework is fed (dist_trainer's order); Lightning
divides the loss by ``accumulate_grad_batches`` and runs the accumulating
backward passes under DDP's ``no_sync``.
"""

from __future__ import annotations

import logging
import time
import warnings

import lightning as L
from torch.utils.data import DataLoader

from common import (
    ACCUM, CLIP, StepClock, WORLD, build_dataset, build_model, make_adamw, rank_micro_batches, runner_args,
)


class GPTModule(L.LightningModule):
    def __init__(self, clock: StepClock):
        super().__init__()
        self.model = build_model()
        self.clock = clock

    def training_step(self, batch, batch_idx):
        out = self.model(batch)
        self.clock.add(out["loss_sum"], out["num_items"])
        return out["loss_sum"] / out["num_items"]

    def configure_optimizers(self):
        return make_adamw(self.model)


class StepTimer(L.Callback):
    """Ticks the clock once per optimizer step (Lightning's global_step counts them)."""

    def __init__(self, clock: StepClock):
        self.clock, self.seen = clock, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step > self.seen:
            self.seen = trainer.global_step
            self.clock.tick()


def main() -> None:
    args = runner_args()

    launched = time.time()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    import os

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", str(WORLD)))
    clock = StepClock()
    module = GPTModule(clock)
    dataset = build_dataset()
    loader = DataLoader(dataset, batch_sampler=rank_micro_batches(len(dataset), rank, world, args.steps))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp", precision="32-true",
        accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
        max_steps=args.steps, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[StepTimer(clock)],
    )
    trainer.fit(module, train_dataloaders=loader)
    clock.dump(args.out, framework="lightning", launched_wall=launched,
               strategy=type(trainer.strategy).__name__, global_step=trainer.global_step)
    # Lightning leaves its process group up after fit; tear it down before exit
    # (left to interpreter shutdown, gloo's threads can abort the process).
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
