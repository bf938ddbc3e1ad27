"""Peak memory and time of the GPT's head and loss, whole against in chunks (``model.loss.chunked``).

    OMP_NUM_THREADS=2 python bench/chunked_loss.py   # 128k vocabulary, 2048 tokens x width 256: 1.5-2.5 minutes
    python bench/chunked_loss.py --vocab 32768 --tokens 1000 --width 64 --chunks 128 --repeats 0   # the test's

What runs: the built-in GPT's ``head_loss`` (the head and the summed cross-entropy, exactly as its forward computes
them from the final norm's output) on a ``[tokens, width]`` input that requires grad, forward and backward, with
``model.loss.chunked`` false and true (each of ``--chunks`` as ``model.loss.chunk_tokens``), in fp32 (the chunks
are torch's ``F.linear_cross_entropy``) and under bf16 autocast (dist_trainer's own chunks, recomputed in
backward). One target in 10 is ignored (-100).

How memory is measured: torch's CPU allocator keeps no peak counter and tracemalloc does not see its allocations,
so every row runs in a fresh process, and the number is that process's peak resident set (``ru_maxrss``) over one
forward + backward, minus its resident set just before it (the model, input and targets allocated, and one pass
over 16 tokens run to load the kernels): what the pass added at its peak, everything the kernels allocate
included, the head weight's gradient too (the same in every row). During that pass glibc's mmap threshold is
fixed at 64 KiB: every larger block is a mapping of its own, unmapped when freed, so the resident set follows
the live tensors, not the high-water mark of a heap.

How time is measured: then, in the same process, with freed memory kept for reuse as training keeps it
(``trainer.tune_malloc``, ``dist_trainer/hostmem.py``), one untimed pass and the fastest of ``--repeats`` timed
ones: steady-state passes, with no page faults on fresh memory.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mmap_threshold(size: int) -> None:
    """glibc's M_MMAP_THRESHOLD: blocks above ``size`` bytes are mappings of their own (fixed: no adjusting)."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, size):
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed: the peak would be the heap's, not the tensors'")


def worker(precision: str, chunk: int, vocab: int, tokens: int, width: int, repeats: int) -> dict:
    """One row, in this (fresh) process: chunk 0 is the plain loss."""
    import torch

    from dist_trainer.hostmem import keep_freed_memory
    from dist_trainer.models import GPT

    mmap_threshold(64 * 1024)

    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=8, n_layer=1, n_head=1, n_embd=width,
                loss={"chunked": chunk > 0, "chunk_tokens": max(chunk, 1)})
    x = torch.randn(tokens, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    targets[::10] = -100
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def forward_backward(rows: slice) -> dict:
        x.grad = None
        model.zero_grad(set_to_none=True)
        with autocast:
            out = model.head_loss(x[rows], targets[rows])
        out["loss_sum"].backward()
        return out

    forward_backward(slice(0, 16))  # the kernels' one-time set-up, outside the measured peak
    base = rss_bytes()
    out = forward_backward(slice(None))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    times = []
    if repeats:
        keep_freed_memory("reuse")
        forward_backward(slice(None))  # the heap grows to what a pass needs, once
    for _ in range(repeats):
        start = time.perf_counter()
        forward_backward(slice(None))
        times.append(time.perf_counter() - start)
    return {"precision": precision, "chunk_tokens": chunk or None, "peak_mib": (peak - base) / MIB,
            "time_s": min(times, default=float("nan")), "loss_sum": out["loss_sum"].item(),
            "num_items": int(out["num_items"]), "logits_mib": tokens * vocab * 4 / MIB}


def run_row(precision: str, chunk: int, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--worker", precision, str(chunk), "--vocab", str(args.vocab),
           "--tokens", str(args.tokens), "--width", str(args.width), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024, 256], help="model.loss.chunk_tokens values")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=["fp32", "bf16-mixed"])
    parser.add_argument("--repeats", type=int, default=1, help="timed passes (after an untimed one); 0: memory only")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--worker", nargs=2, metavar=("PRECISION", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.vocab, args.tokens, args.width,
                                args.repeats)))
        return
    print(f"head + loss, forward and backward: {args.tokens} tokens x width {args.width}, vocabulary {args.vocab} "
          f"(whole float32 logits: {args.tokens * args.vocab * 4 / MIB:.0f} MiB); OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'precision':<11} {'loss':<14} {'peak MiB':>9} {'vs plain':>9} {'time s':>7} {'vs plain':>9}  loss_sum")
    rows = []
    for precision in args.precisions:
        plain = None
        for chunk in [0, *args.chunks]:
            row = run_row(precision, chunk, args)
            plain = plain or row
            rows.append(row)
            name = "plain" if not chunk else f"chunked {chunk}"
            print(f"{precision:<11} {name:<14} {row['peak_mib']:9.1f} {row['peak_mib'] / plain['peak_mib']:8.2f}x "
                  f"{row['time_s']:7.2f} {row['time_s'] / plain['time_s']:8.2f}x  {row['loss_sum']:.6f}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
