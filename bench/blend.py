"""Loader throughput of a 3-source blend against one source, side by side in one process.

    python bench/blend.py                  # 5 rounds of 400 steps each, about a minute

The training loader alone (``TrainLoader``, data.num_workers=0, one rank, micro 16 x accum 4 = 64 samples a
step, block 256), no model: the time to produce and collate every micro-batch of a step, from its window (the
order) to its tensors. "one source": data=tokens on a file of 8 M tokens (more for more steps: one epoch).
"blend": that file (0.5), a 1 M-token file (0.3) and a jsonl text source tokenized by hf_text (0.2), so the
smaller sources wrap several times. Rounds alternate the two, and each is timed after one warm step, in this
process's CPU time (data.num_workers=0 and one torch thread: all of the loader's work is this thread's, and
other processes' load on a shared machine counts less than in wall time); the ratio is blend / one source per
round, then the median. ``--calls``: also the Python function calls per step of each (cProfile), a count
that no load moves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine_description  # noqa: E402

from dist_trainer.config import BatchConfig, Config, TrainerConfig  # noqa: E402
from dist_trainer.data import TrainLoader, build_dataset, plan_for  # noqa: E402
from dist_trainer.validation import validate  # noqa: E402

BLOCK, MICRO, GLOBAL = 256, 16, 64


def write_sources(root: Path, steps: int) -> None:
    rng = np.random.default_rng(0)
    # web: enough for the run in one epoch (one source's loader stops at its epoch's end); code and math wrap
    web = max(8_000_000, (steps + 10) * GLOBAL * BLOCK + 1)
    rng.integers(0, 256, size=web).astype(np.uint16).tofile(root / "web.bin")
    rng.integers(0, 256, size=1_000_000).astype(np.uint16).tofile(root / "code.bin")
    words = ["alpha", "beta", "gamma", "delta", "proof", "lemma", "the", "of", "and", "x", "=", "+", "1", "2"]
    with open(root / "math.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": " ".join(words[j % len(words)] for j in rng.integers(0, 99, 80))}) + "\n")


def config(root: Path, blend: bool, steps: int) -> Config:
    if blend:
        data = {"_target_": "dist_trainer.data.blend.blend", "block_size": BLOCK, "tokenizer": "bytes",
                "vocab_size": 259, "seed": 0, "sources": {
                    "web": {"kind": "tokens", "path": str(root / "web.bin"), "weight": 0.5},
                    "code": {"kind": "tokens", "path": str(root / "code.bin"), "weight": 0.3},
                    "math": {"kind": "hf_text", "files": [str(root / "math.jsonl")], "weight": 0.2,
                             "cache_dir": str(root / "cache")}}}
    else:
        data = {"_target_": "dist_trainer.data.tokens.token_file", "path": str(root / "web.bin"),
                "block_size": BLOCK, "vocab_size": 259}
    return Config(model={"_target_": "dist_trainer.models.GPT"}, data=data,
                  batch=BatchConfig(micro_batch_size=MICRO, global_batch_size=GLOBAL),
                  trainer=TrainerConfig(max_steps=steps + 1))


def steps_per_s(root: Path, blend: bool, steps: int) -> float:
    cfg = config(root, blend, steps)
    dataset = build_dataset(cfg.data)
    loader = TrainLoader(dataset, plan_for(dataset, cfg, validate(cfg, 1), 0))
    batches = loader.epoch(0, 0)
    next(batches)  # warm
    began = time.process_time()  # this process's CPU time: the machine's other load does not count
    for _, (_, micro_batches) in zip(range(steps), batches):
        assert len(micro_batches) == GLOBAL // MICRO
    return steps / (time.process_time() - began)


def calls_per_step(root: Path, blend: bool, steps: int) -> float:
    """Python function calls per step of the loader (cProfile's count), after one warm step."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    steps_per_s(root, blend, steps)
    profile.disable()
    return pstats.Stats(profile).total_calls / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--calls", action="store_true", help="also count Python calls per step (cProfile)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_description(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_sources(root, args.steps)
        build_dataset(config(root, True, 1).data)  # the text source's cache, before any timing
        ratios, one_rates, blend_rates = [], [], []
        for rnd in range(1, args.rounds + 1):
            one = steps_per_s(root, False, args.steps)
            mixed = steps_per_s(root, True, args.steps)
            one_rates.append(one)
            blend_rates.append(mixed)
            ratios.append(mixed / one)
            print(f"round {rnd}: one source {one:.1f} steps/s ({one * GLOBAL * BLOCK / 1e6:.2f} M tokens/s), "
                  f"blend {mixed:.1f} steps/s ({mixed * GLOBAL * BLOCK / 1e6:.2f} M tokens/s): ratio {mixed / one:.3f}",
                  flush=True)
        print("(steps/s of CPU time)")
        if args.calls:
            for blend in (False, True):
                print(f"{'blend' if blend else 'one source'}: {calls_per_step(root, blend, 200):,.0f} Python "
                      "calls a step")
    print(f"\nmedian: one source {statistics.median(one_rates):.1f} steps/s, blend {statistics.median(blend_rates):.1f} "
          f"steps/s, blend / one source {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
