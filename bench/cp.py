"""Context parallelism on CPU ranks: activation memory and step time per rank at cp 1, cp 2 and (``--cp 1 2 4``)
cp 4, ring and Ulysses, zig-zag against contiguous.

    python bench/cp.py                  # cp 1 and 2
    python bench/cp.py --cp 1 2 4       # cp 4 too (4 processes): 1.5 minutes in all on 2 cores
    python bench/cp.py --lengths 1024 --iters 5

The default GPT (conf/model/gpt.yaml: 4 blocks x 128 wide, 4 heads, fp32) with ``block_size`` set to the sequence
length, one sequence a micro-batch, forward and backward:

* cp 1: one process holds the whole sequence (on 2 gloo ranks; the other rank idles);
* cp N: each of N gloo ranks holds 1/N of its tokens (``parallel.cp``, as a run applies it), ring or Ulysses
  attention, zig-zag or contiguous chunks. Ulysses needs the heads divisible by N: a row says so where not.

Activation memory is what autograd saves for the backward on a rank (``saved_tensors_hooks``, each storage counted
once, parameters left out), the memory that grows with the sequence; predicted: one process's / cp. The step is the
median over the timed iterations of the slowest rank's forward and backward (wall clock); compute is the slowest
rank's CPU time of the same (its main thread's ``thread_time``: torch's kernels run there with one thread, gloo's
transfers and waits do not count), and balance is the slowest rank's compute over the fastest's, beside the
attention's (query, key) pairs under the causal mask, slowest over fewest (``parallel.cp.attention_work``).
Ratios are to cp 1 of the same length, in the same run.

gloo on shared cores: a CPU measures the method's work and its balance, not what NVLink would give a GPU. With more
ranks than cores (cp 4 on 2 cores) the ranks take turns on the cores: the step's wall time is oversubscribed and
says nothing of cp 4's speed; the activation memory, the compute and the balance remain meaningful.
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
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine_description  # noqa: E402

_GPT = yaml.safe_load((REPO / "conf" / "model" / "gpt.yaml").read_text())
GPT_SHAPE = {k: _GPT[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd", "dropout")}
METHODS = (("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag"))


def modes(cps: list[int]) -> dict:
    """name: (cp, method, layout), cp 1 first (the ratios' base)."""
    out = {"cp 1": (1, "ring", "zigzag")}
    for cp in sorted(set(cps) - {1}):
        out.update({f"cp {cp} {method} {layout}": (cp, method, layout) for method, layout in METHODS})
    return out


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


def _worker(rank: int, world: int, init: str, length: int, mode: tuple, shape: dict, iters: int, queue) -> None:
    from dist_trainer.config import CPConfig, MeshShape
    from dist_trainer.models import GPT
    from dist_trainer.parallel.cp import apply_cp

    torch.set_num_threads(1)
    cp, method, layout = mode
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = GPT(block_size=length, **shape)
    if cp > 1:
        apply_cp(model, MeshShape("ddp", cp, 1, cp=cp), CPConfig(size=cp, method=method, layout=layout), rank, "cpu")
    ids = torch.randint(0, shape["vocab_size"], (1, length + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    active = cp > 1 or rank == 0  # cp 1: rank 0 alone computes
    times, cpu, activation = [], [], 0
    for _ in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        began, began_cpu = time.perf_counter(), time.thread_time()
        if active:
            activation, out = saved_bytes(model, batch)
            out["loss_sum"].backward()
        cpu.append(time.thread_time() - began_cpu)
        elapsed = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
        times.append(elapsed.item())
    # Each rank's median compute and its activations, to rank 0.
    mine = torch.tensor([statistics.median(cpu[1:]), float(activation)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        ranks = every[:cp]  # cp 1: rank 0's alone
        compute = [t[0].item() for t in ranks]
        queue.put({"time": statistics.median(times[1:]), "activation": int(max(t[1].item() for t in ranks)),
                   "compute": max(compute), "balance": max(compute) / min(compute)})
    dist.barrier()
    dist.destroy_process_group()


def run(length: int, mode: tuple, shape: dict, iters: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = max(2, mode[0])  # cp 1 on 2 ranks as cp 2, the second idle
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_worker, args=(r, world, init, length, mode, shape, iters, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=1800)
        for p in procs:
            p.join(timeout=120)
    return result


def main() -> None:
    from dist_trainer.parallel.cp import attention_work

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2],
                        help="cp sizes (cp 1 always runs, the ratios' base); cp N starts N processes")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations after one warm-up")
    parser.add_argument("--n-head", type=int, default=GPT_SHAPE["n_head"],
                        help="attention heads (default: conf/model/gpt.yaml's)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = dict(GPT_SHAPE, n_head=args.n_head)
    table = modes(args.cp)
    cores = os.cpu_count() or 1
    print(machine_description())
    print(f"\nGPT {shape['n_layer']} x {shape['n_embd']}, {shape['n_head']} heads, fp32, one sequence a micro-batch, "
          f"forward + backward; median of {args.iters} iterations; step: the slowest rank's wall clock; compute: the "
          f"slowest rank's CPU time; balance: slowest rank's compute / fastest's (attention pairs' in brackets); "
          f"activations: bytes saved for backward on the rank")
    over = sorted({cp for cp, _, _ in table.values() if cp > cores})
    if over:
        print(f"cp {', '.join(map(str, over))} on {cores} cores: more ranks than cores, so the ranks share them and "
              f"the step's wall time there is oversubscribed (not a measure of its speed); the activations, the "
              f"compute and the balance are what those rows measure")
    print("\n| tokens | mode | activations a rank (MiB) | vs cp 1 (predicted) | step (ms) | vs cp 1 | "
          "compute (ms) | vs cp 1 | balance (attention) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        base = None
        for name, mode in table.items():
            cp, method, layout = mode
            if method == "ulysses" and shape["n_head"] % cp:
                print(f"| {length} | {name} | skipped: ulysses needs the {shape['n_head']} heads divisible by "
                      f"cp {cp} | | | | | | |", flush=True)
                continue
            got = run(length, mode, shape, args.iters)
            base = base or got
            pairs = attention_work(length, cp, layout)
            note = " (oversubscribed)" if cp > cores else ""
            print(f"| {length} | {name} | {got['activation'] / 2**20:.1f} | "
                  f"{got['activation'] / base['activation']:.3f} ({1 / cp:.3f}) | {got['time'] * 1e3:.1f}{note} | "
                  f"{got['time'] / base['time']:.2f}x | {got['compute'] * 1e3:.1f} | "
                  f"{got['compute'] / base['compute']:.2f}x | {got['balance']:.2f} ({max(pairs) / min(pairs):.2f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
