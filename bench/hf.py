"""Hugging Face models: framework overhead and the cost of a transformers model (CPU, 2 ranks).

    python bench/hf.py                    # 3 rounds, 5 warm-up + 30 timed steps per run
    python bench/hf.py --rounds 2 --timed 20

Three runs of the same job (bench/common.py's: 2 ranks x micro 16 x accum 2,
block 64, char_text, fp32, AdamW, clip 1.0, constant lr), alternated over
rounds so that drift hits all alike:

* ``gpt``: dist_trainer's built-in GPT (4 blocks x 128 wide);
* ``hf_causal_lm``: ``dist_trainer model=hf_causal_lm`` with a transformers
  GPT-2 of the same shape (4 x 128, 4 heads, 64 positions, 256 tokens);
* ``handwritten_hf``: bench/handwritten_hf.py, a minimal DDP + no_sync loop over
  that same GPT-2 with the same loss, data order and optimizer.

Step time: the median of ``step_time_s`` (dist_trainer) or of the intervals
between optimizer steps (hand-written) after the warm-up. The ratio
handwritten_hf / hf_causal_lm is the framework's overhead on a transformers
model (1.00: none); the losses of the last step show the two trained alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, DIST_TRAINER_OVERRIDES, bench_env, machine_description, run_dist_trainer, step_times, torchrun_cmd  # noqa: E402

HF_CONFIG = {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 64, "vocab_size": 256,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

# The job's overrides without the built-in GPT's model.* keys, which a transformers model has not.
COMMON = [o for o in DIST_TRAINER_OVERRIDES if not o.startswith("model.")]
RUNS = {
    "gpt": DIST_TRAINER_OVERRIDES,
    "hf_causal_lm": COMMON + ["model=hf_causal_lm", "model.model_type=gpt2",
                              "+model.config={" + ",".join(f"{k}:{v}" for k, v in HF_CONFIG.items()) + "}"],
}


def run(name: str, steps: int) -> tuple[list, float]:
    """(step times, loss of the last step) of one fresh 2-rank run."""
    if name != "handwritten_hf":
        recs = run_dist_trainer([], steps, base=RUNS[name])
        return [r["step_time_s"] for r in recs], recs[-1]["loss"]
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        out = Path(tmp) / "times.json"
        cmd = torchrun_cmd(str(BENCH / "handwritten_hf.py"), "--steps", str(steps), "--out", str(out))
        proc = subprocess.run(cmd, cwd=tmp, env=bench_env(), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        record = json.loads(out.read_text())
        return [0.0] + step_times(record["ends"], 1, steps - 1), record["losses"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timed", type=int, default=30)
    args = parser.parse_args()
    print(machine_description(), flush=True)
    names = ["gpt", "hf_causal_lm", "handwritten_hf"]
    times = {n: [] for n in names}
    losses = {}
    for rnd in range(1, args.rounds + 1):
        for name in names:
            steps, loss = run(name, args.warmup + args.timed)
            times[name] += steps[args.warmup:]
            losses[name] = loss
            print(f"round {rnd} {name:15s} median {statistics.median(steps[args.warmup:]) * 1e3:7.2f} ms/step "
                  f"(loss at the last step {loss:.6f})", flush=True)
    med = {n: statistics.median(times[n]) for n in names}
    print("\n| run | median step (ms) | vs gpt | loss at the last step |")
    print("|---|---|---|---|")
    for name in names:
        print(f"| {name} | {med[name] * 1e3:.2f} | {med[name] / med['gpt']:.2f}x | {losses[name]:.6f} |")
    print(f"\nframework overhead on a transformers model: handwritten_hf / hf_causal_lm = "
          f"{med['handwritten_hf'] / med['hf_causal_lm']:.3f} (steps/s relative to the hand-written loop)")


if __name__ == "__main__":
    main()
