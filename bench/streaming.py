"""Time to the first step, and host memory, of a streamed text corpus against preparing it first.

    python bench/streaming.py                  # ~1 GB of jsonl in 64 shards, in a temporary directory
    python bench/streaming.py --gb 0.25 --shards 16 --json out.json

The corpus: jsonl shards of documents of random words (about 2 KB each), written once. Then, one process each
(the default job's byte-level GPT, data.block_size 256, bytes tokenizer, trainer.max_steps=2, CPU):

- streamed: ``data=hf_text data.streaming=true data.files=[...]``: launch -> the console's ``step 1/`` line;
- prepared: ``python -m dist_trainer.prepare --tokenizer bytes`` of the same files, then ``data=tokens`` on its
  train.bin: the prepare's wall time plus launch -> ``step 1/``;
- cached (``--cached``): ``data=hf_text`` with a fresh ``data.cache_dir``: tokenized into hf_text's cache by the
  run itself, launch -> ``step 1/``.

Host memory: each training process's peak resident set (the kernel's ru_maxrss of the child, from wait4),
beside the corpus size, and dist_trainer's own ``run_host_peak_mb`` from host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DIST_TRAINER_OVERRIDES, bench_env, machine_description  # noqa: E402

BLOCK = 256
FIRST = "] - step 1/"
JOB = [o for o in DIST_TRAINER_OVERRIDES if not o.startswith("data.block_size")] + [
    f"data.block_size={BLOCK}", "model.vocab_size=259", "trainer.max_steps=2", "trainer.log_every=1"]


def write_corpus(root: Path, total_bytes: int, shards: int, seed: int = 0) -> List[Path]:
    """jsonl shards of random-word documents: a pool of lines, each shard a seeded shuffle of it, repeated."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, n)) for n in rng.integers(2, 10, 5000)]
    pool = [json.dumps({"text": " ".join(rng.choice(words, 330))}) + "\n" for _ in range(2000)]
    per_shard, files = total_bytes // shards, []
    for s in range(shards):
        path = root / f"shard{s:04d}.jsonl"
        with open(path, "w") as f:
            written = 0
            while written < per_shard:  # whole lines: a shard ends at the line that passes its share
                chunk = "".join(pool[i] for i in rng.permutation(len(pool)))
                f.write(chunk)
                written += len(chunk)
        files.append(path)
    return files


def launch(cmd: List[str], cwd: Path, until: Optional[str] = None) -> Dict[str, float]:
    """Run ``cmd``; seconds to the first line holding ``until`` (if given), to exit, and the child's peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=bench_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    seen, tail = None, []
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        if until and seen is None and until in line:
            seen = time.perf_counter() - start
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or (until and seen is None):
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed (rc {proc.returncode}):\n{''.join(tail)}")
    return {"first_step_s": seen, "exit_s": time.perf_counter() - start, "peak_rss_mb": usage.ru_maxrss / 1024}


def train(tmp: Path, name: str, data: List[str]) -> Dict[str, float]:
    run_dir = tmp / name
    result = launch([sys.executable, "-m", "dist_trainer", *JOB, *data, f"hydra.run.dir={run_dir}"], tmp, FIRST)
    host = json.loads((run_dir / "host_memory.json").read_text())
    return {**result, "run_host_peak_mb": host.get("run_host_peak_mb", [None])[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (1e9 bytes)")
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--cached", action="store_true", help="also time data=hf_text's own cache build")
    parser.add_argument("--dir", help="where the corpus and runs go (default: a temporary directory)")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-streaming-", dir=args.dir) as name:
        tmp = Path(name)
        (tmp / "corpus").mkdir()
        started = time.perf_counter()
        files = write_corpus(tmp / "corpus", int(args.gb * 1e9), args.shards)
        size = sum(f.stat().st_size for f in files)
        print(f"corpus: {size / 1e9:.2f} GB in {len(files)} jsonl shards, written in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        listing = "data.files=[" + ",".join(map(str, files)) + "]"
        results: Dict[str, Dict[str, float]] = {}
        results["streamed"] = train(tmp, "streamed", ["data=hf_text", "data.streaming=true", listing])
        prep = launch([sys.executable, "-m", "dist_trainer.prepare", "--tokenizer", "bytes", "--out",
                       str(tmp / "tokens"), *map(str, files)], tmp)
        run = train(tmp, "prepared", ["data=tokens", f"data.path={tmp / 'tokens' / 'train.bin'}"])
        results["prepared"] = {**run, "prepare_s": prep["exit_s"], "prepare_peak_rss_mb": prep["peak_rss_mb"],
                               "first_step_s": prep["exit_s"] + run["first_step_s"]}
        if args.cached:
            results["cached"] = train(tmp, "cached", ["data=hf_text", listing, f"data.cache_dir={tmp / 'cache'}"])
    print("\n| path | launch -> first step (s) | peak RSS of the training process (MiB) | run_host_peak_mb |")
    print("|---|---|---|---|")
    for path, r in results.items():
        extra = f" (prepare {r['prepare_s']:.1f} s + train {r['first_step_s'] - r['prepare_s']:.1f} s)" \
            if "prepare_s" in r else ""
        print(f"| {path} | {r['first_step_s']:.1f}{extra} | {r['peak_rss_mb']:.0f} | {r['run_host_peak_mb']:.0f} |")
    s, p = results["streamed"], results["prepared"]
    print(f"\nstreamed / prepare-then-train time to first step: {s['first_step_s'] / p['first_step_s']:.3f} "
          f"({s['first_step_s']:.1f} s vs {p['first_step_s']:.1f} s); corpus {size / 2**20:,.0f} MiB, streamed "
          f"run's peak RSS {s['peak_rss_mb']:.0f} MiB ({s['peak_rss_mb'] / (size / 2**20):.3f} of the corpus)")
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus_bytes": size, "shards": len(files), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
