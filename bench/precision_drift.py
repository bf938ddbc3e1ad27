"""How far each precision mode's update is from fp32's, at one micro-batch of 16 and at 2 ranks x 2 x 4.

    python bench/precision_drift.py                    # about a minute on 2 shared cores
    python bench/precision_drift.py --modes bf16-master,fp8-rowwise
    python bench/precision_drift.py --strategy fsdp    # the norms' parameters gathered in bf16 in the master modes

The job, as a new user would set it: the built-in GPT with its biases (``model.n_layer=2 model.n_embd=64``), 16
sequences of 64 tokens a step (``data.block_size=64 batch.global_batch_size=16``), plain SGD (``optim=sgd
optim.momentum=0``, lr 0.1), 3 steps. Each mode runs split two ways: one process with one micro-batch of 16, and 2
gloo ranks with micro-batches of 2, 4 each. The fp32 run with one micro-batch of 16 is the reference.

A tensor's error is the norm of the difference of its update (its FP32 weights after 3 steps less its initial
ones; the masters in the master modes) from fp32's, over the norm of fp32's update, but never over less than 1e-3
of the largest tensor's RMS update (the attention key's bias has an exactly zero true gradient: its update is
rounding). The table prints, for each mode and split, the largest error over the tensors and its tensor.
``--fp32-compute`` adds the float8 modes over FP32 compute, and their split gap (2 x 2 x 4 against 1 x 16 of the
same mode) at step 1's gradients, where both splits start from the same weights.

docs/precision.md's table is this script's output, with the "before" column from the same command at the commit
before the LayerNorms computed in FP32.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compose, machine_description  # noqa: E402

MODES = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "fp8-rowwise", "fp8-rowwise-gw-hp",
         "fp8-tensorwise", "fp8-mxfp8"]
FP32_COMPUTE = ["fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-tensorwise", "fp8-mxfp8"]
JOB = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "data.block_size=64", "batch.global_batch_size=16",
       "optim=sgd", "optim.lr=0.1", "optim.momentum=0", "trainer.log_every=1"]
STEPS, FLOOR = 3, 1e-3


def overrides(mode: str, micro: int, strategy: str) -> list:
    name, _, compute = mode.partition(" ")
    return JOB + [f"precision={name}", f"batch.micro_batch_size={micro}", f"dist.strategy={strategy}"] + (
        ["precision.fp8.compute=fp32"] if compute else [])


def run(mode: str, micro: int, world: int, strategy: str, env) -> dict:
    """The FP32 weights before and after STEPS steps, and step 1's gradients where the model's are the step's (no
    FP32 masters beside it)."""
    from dist_trainer.config import validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.run import build

    cfg = compose(overrides(mode, micro, strategy))
    parts = build(cfg, validate(cfg, world), env)
    trainer = parts.trainer
    weights = lambda: {k: v.detach().float().clone() for k, v in trainer.strategy.full_state_dict().items()}  # noqa
    record = {"init": weights()}
    for step, (window, micro_batches) in zip(range(1, STEPS + 1),
                                             epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)):
        trainer.train_step(micro_batches, window, step)
        if step == 1 and trainer.precision.param_dtype is None:
            record["grads"] = {n: whole(p.grad) for n, p in trainer.module.named_parameters() if p.grad is not None}
    record["final"] = weights()
    return record


def whole(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (fsdp's are shards: every rank gathers)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _rank(rank: int, world: int, store: str, out: str, modes: list, micro: int, strategy: str) -> None:
    from dist_trainer import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    env = distributed.init("cpu")  # the group above, as a launcher's
    records = {mode: run(mode, micro, world, strategy, env) for mode in modes}
    if rank == 0:
        torch.save(records, out)
    dist.barrier()
    dist.destroy_process_group()


def launch(modes: list, micro: int, world: int, strategy: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-drift-") as tmp:
        out = os.path.join(tmp, "records.pt")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), out, modes, micro, strategy), nprocs=world,
                           start_method="spawn")
        return torch.load(out, weights_only=False)


def update_errors(got: dict, ref: dict) -> dict:
    """Per tensor: |update - ref's update| / max(|ref's update|, FLOOR x the largest RMS update x sqrt(numel))."""
    delta = {k: (ref["final"][k] - ref["init"][k]).double() for k in ref["init"]}
    top = max(d.norm().item() / d.numel() ** 0.5 for d in delta.values())
    return {k: ((got["final"][k] - got["init"][k]).double() - d).norm().item()
            / max(d.norm().item(), FLOOR * top * d.numel() ** 0.5) for k, d in delta.items()}


def split_gap(got: dict, ref: dict) -> float:
    """Step 1's gradients, 2 x 2 x 4 against 1 x 16: the largest max|a-b| / max(max|b|, 0.1 x the largest)."""
    floor = 0.1 * max(g.abs().max().item() for g in ref["grads"].values())
    return max((got["grads"][k] - g).abs().max().item() / max(g.abs().max().item(), floor)
               for k, g in ref["grads"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated precision modes (fp32 is added)")
    parser.add_argument("--fp32-compute", action="store_true", help="also the float8 modes over FP32 compute")
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"], help="dist.strategy of every run")
    args = parser.parse_args()
    modes = ["fp32"] + [m for m in args.modes.split(",") if m != "fp32"]
    modes += [f"{m} fp32-compute" for m in FP32_COMPUTE] if args.fp32_compute else []
    print(f"{machine_description()}; ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}; "
          f"dist.strategy={args.strategy}", flush=True)
    one, two = launch(modes, 16, 1, args.strategy), launch(modes, 2, 2, args.strategy)
    ref = one["fp32"]
    print("\n| mode | 1 x 16 against fp32 | 2 x 2 x 4 against fp32 | step 1's gradients, 2 x 2 x 4 against 1 x 16 |")
    print("| --- | --- | --- | --- |")
    for mode in modes:
        cells = []
        for got in (one[mode], two[mode]):
            errors = update_errors(got, ref)
            worst = max(errors, key=errors.get)
            cells.append(f"{errors[worst]:.1e} ({worst})")
        gap = f"{split_gap(two[mode], one[mode]):.1e}" if "grads" in one[mode] else "(FP32 masters)"
        print(f"| {mode} | {cells[0]} | {cells[1]} | {gap} |")


if __name__ == "__main__":
    main()
