"""Each rank's host memory over a whole run, and what a larger model adds to it, under every mesh on 2 ranks
(hsdp, and ddp beside it, on 4).

    python bench/run_memory.py                      # a 216 MiB and a 5x smaller qwen2, about 10 minutes on 2 cores
    python bench/run_memory.py --sizes 216 1024     # and a 1 GiB one against the 216 MiB one

Each model is a qwen2 saved by transformers (bench/load.py's shapes, head tied to the embedding). Every row
is a real ``torchrun -m dist_trainer`` run of a few optimizer steps (micro batch 1 x 32 tokens, SGD without
momentum unless the row says AdamW) that ends with ``final_model.pt`` and ``hf_model/``. Per run: each rank's
peak resident memory over the whole run (``host_memory.json``'s ``run_host_peak_mb``: the kernel's peak, from
the first import to the export), plan mode's prediction of it (``plan.json``), and the median step time.

The model-dependent part of a rank's memory is the difference between the two sizes' peaks, divided by the
difference in their FP32 sizes: about 1x where a rank holds the whole model once (ddp with SGD: weights and
gradients make 2x), about 0.5x where it holds half (fsdp on 2 ranks, weights and gradients sharded) plus what
a unit's gathers add. Each row runs with both of ``trainer.tune_malloc``'s modes, side by side: ``bounded`` (blocks
from 64 KiB up in their own mappings, returned when freed; the default where the model is cut across ranks) and
``reuse`` (every block kept in the heap; the default under ddp, and what every mesh had before); ``--malloc
default`` runs each mesh with the mode ``true`` chooses for it, where plan mode's figure is its prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402
from load import SHAPES as LOAD_SHAPES, save_model  # noqa: E402

SHAPES = {  # MiB of FP32 weights -> the qwen2 configuration (tied head): bench/load.py's, and one 5x smaller
    43: {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 3, "num_attention_heads": 6,
         "num_key_value_heads": 2, "vocab_size": 16384},
    **LOAD_SHAPES,
}
MODES = {
    "ddp": [],
    "fsdp": ["dist.strategy=fsdp"],
    "fsdp, AdamW": ["dist.strategy=fsdp", "optim=adamw"],
    "tp 2": ["dist.tp.size=2"],
    "fsdp, LoRA": ["dist.strategy=fsdp", "model.lora.r=4"],  # the base frozen and sharded, adapters of rank 4
    "hsdp 2 x 2": ["dist.strategy=fsdp", "dist.fsdp.shard_size=2"],  # 4 ranks: 2 replicas of 2-rank shard groups
    "ddp, 4 ranks": [],  # what hsdp is compared with
}
RANKS = {"hsdp 2 x 2": 4, "ddp, 4 ranks": 4}  # the others run on 2 ranks; each rank a micro-batch of one
GIB = str(1 << 30)
MALLOC = {  # trainer.tune_malloc's two modes, forced by glibc's variables whatever the mesh (dist_trainer/hostmem.py)
    "default": {},  # trainer.tune_malloc=true's own choice: bounded where the model is cut, reuse under ddp
    "bounded": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)},
    "reuse": {"MALLOC_MMAP_THRESHOLD_": GIB, "MALLOC_TRIM_THRESHOLD_": GIB},
}


def model_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def one_run(root: Path, model: Path, mode: list, malloc: dict, steps: int, tag: str, ranks: int = 2) -> dict:
    run_dir = root / "runs" / tag
    shutil.rmtree(run_dir, ignore_errors=True)  # a run left in a reused --root would resume, finished: no steps
    text = root / "text.txt"
    if not text.exists():
        text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 200)
    optim = [] if any(a.startswith("optim=") for a in mode) else ["optim=sgd", "optim.momentum=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m",
           "dist_trainer", "model=hf_causal_lm", f"model.pretrained={model}", "data=hf_text", f"data.files=[{text}]",
           "data.block_size=32", f"data.cache_dir={root / 'cache'}", "batch.micro_batch_size=1",
           f"batch.global_batch_size={ranks}", f"trainer.max_steps={steps}", "trainer.ckpt_every=0",
           "trainer.device=cpu", "trainer.log_every=1", "trainer.eval_every=0", f"hydra.run.dir={run_dir}", *optim,
           *mode]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", **malloc)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    measured = json.loads((run_dir / "host_memory.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shutil.rmtree(run_dir)  # its checkpoint and exports: about 1 GB for the 216 MiB model, read and done
    return {"peaks": measured["run_host_peak_mb"], "plan": plan.get("run_host_peak_mb"),
            "export": measured.get("export_host_peak_mb"), "export_bound": plan.get("export_host_peak_mb"),
            "step_s": statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=2, default=[43, 216], choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--malloc", nargs="*", default=["bounded", "reuse"], choices=list(MALLOC))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--root", type=Path, default=None, help="keep the saved models here (default: a temp dir)")
    args = parser.parse_args()
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-run-memory-") as tmp:
        root = args.root or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        small, large = (save_model(root, s, SHAPES) for s in args.sizes)
        sizes = {p: model_mb(p) for p in (small, large)}
        rows = []
        for mode in args.modes:
            for malloc in args.malloc:
                got = {p: one_run(root, p, MODES[mode], MALLOC[malloc], args.steps,
                                  f"{mode}-{malloc}-{p.name}".replace(" ", "_").replace(",", ""),
                                  RANKS.get(mode, 2))
                       for p in (small, large)}
                ratio = max(b - a for a, b in zip(got[small]["peaks"], got[large]["peaks"])) / (sizes[large] - sizes[small])
                rows.append((mode, malloc, got[small], got[large], ratio))
                print(f"{mode:12s} {malloc:10s} {sizes[small]:.0f} MiB model: peaks {got[small]['peaks']} | "
                      f"{sizes[large]:.0f} MiB: peaks {got[large]['peaks']} (plan {got[large]['plan']}) | "
                      f"added / model {ratio:.2f} | step {got[large]['step_s']:.2f} s | export added "
                      f"{got[large]['export']} (bound {got[large]['export_bound']})", flush=True)
        print(f"\n| mesh | malloc | peak per rank, {sizes[small]:.0f} MiB model (MiB) | peak per rank, "
              f"{sizes[large]:.0f} MiB model (MiB) | plan mode, {sizes[large]:.0f} MiB (MiB) | "
              f"added / model size | median step, {sizes[large]:.0f} MiB (s) |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for mode, malloc, s, b, ratio in rows:
            plan = f"{b['plan']:.0f}" if b["plan"] is not None else "-"
            print(f"| {mode} | {malloc} | {' / '.join(f'{v:.0f}' for v in s['peaks'])} | "
                  f"{' / '.join(f'{v:.0f}' for v in b['peaks'])} | {plan} | {ratio:.2f} | {b['step_s']:.2f} |")


if __name__ == "__main__":
    main()
