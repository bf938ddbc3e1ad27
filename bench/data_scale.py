"""Start-up and resume cost against the size of the data (data=tokens, sparse token files).

    python bench/data_scale.py            # about 2 minutes on 2 cores; needs ~130 GB of *sparse* file space

Part 1, a real run: for token files of 1e6, 1e8 and 1e9 samples of 64 tokens
(uint16; sparse files made with truncate, so only the pages read take space),
``torchrun --nproc_per_node=2 -m dist_trainer data=tokens ... trainer.max_steps=1``:
the wall time of the whole launch and rank 0's peak RSS (metrics.jsonl's
peak_mem_mb), side by side.

Part 2, the data path alone, in this process: ``StepPlan`` and the first
window of an epoch from step 0 and from step 1e6 (a resume there), for the
same sizes: seconds and the RSS it added. For comparison, what the order cost
before it was computed on the fly: ``torch.randperm(n).tolist()`` (the old
``StepPlan.windows`` built it for every epoch and every resume), for 1e6 and
1e7 samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, machine_description, torchrun_cmd  # noqa: E402

BLOCK = 64
SIZES = (10**6, 10**8, 10**9)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sparse_token_file(directory: Path, samples: int) -> Path:
    path = directory / f"tokens-{samples}.bin"
    with open(path, "wb") as f:
        f.truncate(2 * (samples * BLOCK + 1))  # uint16 zeros, allocated only where read
    return path


def real_runs(directory: Path) -> None:
    print("\nPART 1: torchrun, 2 ranks, one optimizer step (micro 8 x accum 4 x 2 ranks)\n")
    print("| samples | file (sparse) | launch to exit (s) | rank 0 peak RSS (MB) |")
    print("|---|---|---|---|")
    for samples in SIZES:
        path = sparse_token_file(directory, samples)
        run_dir = directory / f"run-{samples}"
        cmd = torchrun_cmd("-m", "dist_trainer", "data=tokens", f"data.path={path}", f"data.block_size={BLOCK}",
                           "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "batch.micro_batch_size=8",
                           "batch.global_batch_size=64", "trainer.max_steps=1", "trainer.eval_every=0",
                           "trainer.device=cpu", f"hydra.run.dir={run_dir}")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=directory, env=bench_env(), capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
        record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
        print(f"| {samples:.0e} | {path.stat().st_size / 2**30:,.1f} GiB | {wall:.2f} | "
              f"{record['peak_mem_mb']:.0f} |", flush=True)
        path.unlink()


def data_path(directory: Path) -> None:
    from dist_trainer.config import BatchConfig, Config
    from dist_trainer.validation import validate
    from dist_trainer.data import StepPlan, epoch_batches
    from dist_trainer.data.tokens import token_file

    print("\nPART 2: the data path in one process (rank 0 of 2, micro 8 x accum 4): StepPlan and the first "
          "window's batches\n")
    print("| samples | from step 0 (s) | from step 1e6 (s; 1e6 samples: its last step, 15624) | RSS added (MB) |")
    print("|---|---|---|---|")
    cfg = Config(model={"_target_": "dist_trainer.models.GPT"}, data={"_target_": "dist_trainer.data.tokens.token_file"},
                 batch=BatchConfig(micro_batch_size=8, global_batch_size=64))
    plan = validate(cfg, 2)
    for samples in SIZES:
        path = sparse_token_file(directory, samples)
        before = rss_mb()
        data = token_file(str(path), BLOCK, vocab_size=256)
        times = []
        for start_step in (0, 10**6):
            t = time.perf_counter()
            step_plan = StepPlan(len(data), plan, 0, 0, True, False)
            # a resume at step 1e6, or at the epoch's last step where the epoch is shorter
            next(epoch_batches(data, step_plan, 0, min(start_step, step_plan.steps_per_epoch - 1), 0, False))
            times.append(time.perf_counter() - t)
        print(f"| {samples:.0e} | {times[0]:.4f} | {times[1]:.4f} | {rss_mb() - before:.1f} |", flush=True)
        path.unlink()
    print("\nBEFORE (the materialised permutation, as StepPlan.windows built it for each epoch and resume):\n")
    print("| samples | torch.randperm(n).tolist() (s) | peak RSS growth (MB) |")
    print("|---|---|---|")
    probe = ("import resource, sys, time, torch; n = int(sys.argv[1]); "
             "p0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; t = time.perf_counter(); "
             "o = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist(); "
             "print(time.perf_counter() - t, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - p0) / 1024)")
    for samples in (10**6, 10**7):  # each in a fresh process, so that its peak is its own
        out = subprocess.run([sys.executable, "-c", probe, str(samples)], capture_output=True, text=True, check=True)
        seconds, grew = map(float, out.stdout.split())
        print(f"| {samples:.0e} | {seconds:.3f} | {grew:.0f} |", flush=True)


def main() -> None:
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        real_runs(Path(tmp))
        data_path(Path(tmp))


if __name__ == "__main__":
    main()
