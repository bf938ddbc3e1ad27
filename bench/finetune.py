"""Fine-tuning on conversations: LoRA against full fine-tuning, packing against padding (CPU, 2 ranks).

    python bench/finetune.py                  # 2 rounds, 3 warm-up + 20 timed steps per run
    python bench/finetune.py --rounds 1 --timed 10

The same conversations (python -m dist_trainer.arithmetic: 4000 sums, some with
a system prompt or a second turn) and the same Llama-style model built from a
configuration (4 layers x 256 wide, bytes tokenizer with the default chat
template), fp32, AdamW, 2 ranks x micro 8 x accum 2. Four runs, alternated over
rounds so that drift hits all alike:

* ``full/padded``, ``full/packed``: every weight trains;
* ``lora/padded``, ``lora/packed``: model.lora.r=8 on peft's default modules.

Reported: the median step time; ``state_mb`` (model, gradients and optimizer
state of the largest rank); and answer tokens per second (the trained tokens:
the same conversations, so the same work, whether a sample is a block of
packed conversations or one padded conversation). A packed sample holds
several conversations, so a step of packed samples does more work: answer
tokens per second is the measure to compare, not the step time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, run_dist_trainer  # noqa: E402

MODEL = ["model=hf_causal_lm", "model.model_type=llama",
         "+model.config={hidden_size:256,num_hidden_layers:4,num_attention_heads:4,num_key_value_heads:2,"
         "intermediate_size:768}"]


def base(chats: Path, cache: Path) -> list:
    return MODEL + [
        "data=hf_chat", f"data.files=[{chats}]", "data.block_size=256", f"data.cache_dir={cache}",
        "batch.micro_batch_size=8", "batch.global_batch_size=32", "precision=fp32", "optim.warmup_steps=0",
        "optim.schedule=constant", "trainer.eval_every=0", "trainer.eval_batches=1", "trainer.ckpt_every=0",
        "trainer.device=cpu", "trainer.seed=0"]


RUNS = {"full/padded": ["data.packing=false"], "full/packed": ["data.packing=true"],
        "lora/padded": ["data.packing=false", "model.lora.r=8"], "lora/packed": ["data.packing=true", "model.lora.r=8"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timed", type=int, default=20)
    args = parser.parse_args()
    print(machine_description(), flush=True)
    from dist_trainer.arithmetic import write

    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        write(Path(tmp) / "arith", train=4000, test=10, largest=99, seed=0)
        common = base(Path(tmp) / "arith" / "train.jsonl", Path(tmp) / "cache")
        times = {n: [] for n in RUNS}
        tokens = {n: [] for n in RUNS}
        state = {}
        for rnd in range(1, args.rounds + 1):
            for name, extra in RUNS.items():
                recs = run_dist_trainer(extra, args.warmup + args.timed, base=common)
                timed = recs[args.warmup:]
                times[name] += [r["step_time_s"] for r in timed]
                tokens[name] += [r["tokens_per_s"] for r in timed]
                state[name] = recs[-1]["state_mb"]
                print(f"round {rnd} {name:12s} median {statistics.median(times[name]) * 1e3:7.1f} ms/step, "
                      f"{statistics.median(tokens[name]):8.0f} answer tokens/s, state {state[name]:.2f} MB",
                      flush=True)
    med = {n: statistics.median(times[n]) for n in RUNS}
    tps = {n: statistics.median(tokens[n]) for n in RUNS}
    print("\n| run | median step (ms) | answer tokens/s | state_mb |")
    print("| --- | --- | --- | --- |")
    for n in RUNS:
        print(f"| {n} | {med[n] * 1e3:.1f} | {tps[n]:.0f} | {state[n]:.2f} |")
    for kind in ("padded", "packed"):
        print(f"lora/{kind} vs full/{kind}: step time x{med[f'lora/{kind}'] / med[f'full/{kind}']:.3f}, "
              f"state_mb x{state[f'lora/{kind}'] / state[f'full/{kind}']:.3f}")
    for tuning in ("full", "lora"):
        print(f"{tuning}: packed vs padded answer tokens/s x{tps[f'{tuning}/packed'] / tps[f'{tuning}/padded']:.3f}")


if __name__ == "__main__":
    main()
