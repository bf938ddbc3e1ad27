"""Context parallelism on 2 CPU ranks: activation memory and step time per rank at cp 1 and cp 2, ring and
Ulysses, zig-zag against contiguous.

    python bench/cp.py                  # about 2 minutes on 2 cores
    python bench/cp.py --lengths 1024 --iters 5

The default GPT (4 blocks x 128 wide, 4 heads, fp32) with ``block_size`` set to the sequence length, one
sequence a micro-batch, forward and backward:

* cp 1: one process holds the whole sequence (the other rank idles);
* cp 2: each of 2 gloo ranks holds half of its tokens (``parallel.cp``, as a run applies it), ring or Ulysses
  attention, zig-zag or contiguous chunks.

Activation memory is what autograd saves for the backward on a rank (``saved_tensors_hooks``, each storage counted
once, parameters left out), the memory that grows with the sequence; predicted: one process's / cp. Time is the median over the timed
iterations of the slowest rank's forward and backward. Ratios are to cp 1 of the same length, in the same run.
gloo on 2 shared cores: a CPU measures the method's work and its balance, not what NVLink would give a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

MODES = {  # name: (cp, method, layout)
    "cp 1": (1, "ring", "zigzag"),
    "cp 2 ring zigzag": (2, "ring", "zigzag"),
    "cp 2 ring contiguous": (2, "ring", "contiguous"),
    "cp 2 ulysses zigzag": (2, "ulysses", "zigzag"),
}


def saved_bytes(model: torch.nn.Module, batch: dict) -> tuple[int, dict]:
    """Bytes of activations autograd saves for the backward in one forward (each storage once; the parameters,
    which it saves too, left out), and the forward's output."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch)
    return sum(seen.values()), out


def _worker(rank: int, world: int, init: str, length: int, mode: str, iters: int, queue) -> None:
    from dist_trainer.config import CPConfig, MeshShape
    from dist_trainer.models import GPT
    from dist_trainer.parallel.cp import apply_cp

    torch.set_num_threads(1)
    cp, method, layout = MODES[mode]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=length, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    if cp > 1:
        apply_cp(model, MeshShape("ddp", cp, 1, cp=cp), CPConfig(size=cp, method=method, layout=layout), rank, "cpu")
    ids = torch.randint(0, 256, (1, length + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    active = cp > 1 or rank == 0  # cp 1: rank 0 alone computes
    times, activation = [], 0
    for _ in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        began = time.perf_counter()
        if active:
            activation, out = saved_bytes(model, batch)
            out["loss_sum"].backward()
        elapsed = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        times.append(elapsed.item())
    peak = torch.tensor([activation])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({"time": statistics.median(times[1:]), "activation": int(peak.item())})
    dist.barrier()
    dist.destroy_process_group()


def run(length: int, mode: str, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_worker, args=(r, 2, init, length, mode, iters, queue)) for r in range(2)]
        for p in procs:
            p.start()
        result = queue.get(timeout=900)
        for p in procs:
            p.join(timeout=120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--iters", type=int, default=5, help="timed iterations after one warm-up")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(machine_description())
    print(f"\nthe default GPT (4 x 128, 4 heads, fp32), one sequence a micro-batch, forward + backward; median of "
          f"{args.iters} iterations (the slowest rank's); activations: bytes saved for backward on the rank\n")
    print("| tokens | mode | activations a rank (MiB) | vs cp 1 (predicted) | step (ms) | vs cp 1 |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        base = None
        for mode in MODES:
            got = run(length, mode, args.iters)
            base = base or got
            cp = MODES[mode][0]
            print(f"| {length} | {mode} | {got['activation'] / 2**20:.1f} | "
                  f"{got['activation'] / base['activation']:.3f} ({1 / cp:.3f}) | {got['time'] * 1e3:.1f} | "
                  f"{got['time'] / base['time']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
