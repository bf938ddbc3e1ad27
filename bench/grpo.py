"""GRPO on the arithmetic questions: reward over the run, held-out exact match before and after, time per step.

    python bench/grpo.py runs/arith-full/hf_model          # 8 prompts x 8 completions, lr 2e-5, 100 steps
    python bench/grpo.py runs/arith-full/hf_model --prompts-per-step 32 --lr 3e-5 --steps 60

MODEL_DIR is the fine-tuned arithmetic model of docs/huggingface.md ("Fine-tuning on conversations"),
a Hugging Face directory with its tokenizer. The script

1. writes the questions (``python -m dist_trainer.arithmetic --prompts``, seed 0: the fine-tune's
   conversations and its 200 held-out ones) as data=hf_prompts records: each conversation up to its last
   answer, with that answer;
2. measures MODEL_DIR with ``dist_trainer.evaluate``: greedy exact match on the 200 held-out questions, and on
   the first 200 training questions (what GRPO is rewarded on);
3. runs ``torchrun --nproc_per_node=2 -m dist_trainer task=grpo`` from MODEL_DIR on the 4000 training
   questions with rl.reward=exact_answer (rl.prompts_per_step x rl.group_size completions a step, full
   sampling at the temperature, one AdamW update per rollout, constant lr);
4. measures the run's ``hf_model/`` the same way, and prints the reward curve (each step's mean reward: the
   share of its completions that are exactly right, in blocks), the exact matches before and after, and the
   median seconds per step split into sampling (gen_s), rewarding (score_s) and the forward and backward
   (train_s).

Everything is written under --out (default: a temporary directory), the run in OUT/run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_env, machine_description, torchrun_cmd  # noqa: E402


def grpo_overrides(model: Path, prompts: Path, args: argparse.Namespace) -> list:
    rows = args.prompts_per_step * args.group_size // 2  # each of the 2 ranks' share of a step, in one micro-batch
    return [
        "task=grpo", "model=hf_causal_lm", f"model.pretrained={model}",
        "data=hf_prompts", f"data.files=[{prompts}]", f"data.tokenizer={model}",
        f"rl.prompts_per_step={args.prompts_per_step}", f"rl.group_size={args.group_size}",
        "rl.reward=exact_answer", f"rl.rollout.max_new_tokens={args.max_new_tokens}",
        f"rl.rollout.temperature={args.temperature}", f"rl.kl.coef={args.kl}",
        f"optim.lr={args.lr}", "optim.warmup_steps=0", "optim.schedule=constant",
        f"batch.micro_batch_size={rows}", "trainer.eval_every=0", "trainer.ckpt_every=0", "trainer.log_every=1",
        f"trainer.max_steps={args.steps}", "trainer.device=cpu", f"trainer.seed={args.seed}", *args.set]


def exact_match(model: Path, chats: Path, limit: int) -> float:
    from dist_trainer.hf.evaluate import evaluate

    return evaluate(model, chats, limit=limit)["exact_match"]


def measure(model: Path, arith: Path) -> dict:
    return {"held_out": exact_match(model, arith / "test.jsonl", 200),
            "train_200": exact_match(model, arith / "train.jsonl", 200)}


def blocks(values: list, size: int) -> str:
    return " ".join(f"{statistics.mean(values[i:i + size]):.3f}" for i in range(0, len(values), size))


def report(records: list, before: dict, after: dict, wall_s: float, block: int) -> dict:
    rewards = [r["reward_mean"] for r in records]
    k = min(block, len(rewards))
    split = {key: statistics.median(r[key] for r in records) for key in ("gen_s", "score_s", "train_s")}
    step = statistics.median(r["step_time_s"] for r in records)
    print(f"\nreward_mean per step, in blocks of {block}: {blocks(rewards, block)}")
    print(f"first {k} steps {statistics.mean(rewards[:k]):.3f}, last {k} {statistics.mean(rewards[-k:]):.3f}, "
          f"over the run {statistics.mean(rewards):.3f}")
    for key in ("frac_zero_std_groups", "kl", "entropy", "completion_len_mean", "truncated_frac"):
        values = [r.get(key, 0.0) for r in records]
        print(f"{key}: first {k} steps {statistics.mean(values[:k]):.3f}, last {k} {statistics.mean(values[-k:]):.3f}")
    print(f"greedy exact match, 200 held-out questions: {before['held_out']:.1%} -> {after['held_out']:.1%}")
    print(f"greedy exact match, first 200 training questions: {before['train_200']:.1%} -> {after['train_200']:.1%}")
    print(f"median seconds per step: {step:.2f} (gen_s {split['gen_s']:.2f}, score_s {split['score_s']:.4f}, "
          f"train_s {split['train_s']:.2f}); the run {wall_s:.0f} s with start-up and export")
    return {"rewards": rewards, "before": before, "after": after, "median_step_s": step, **split, "wall_s": wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, metavar="MODEL_DIR")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8, help="an answer is at most 4 tokens and its end")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW, constant; 5e-4 and up collapsed")
    parser.add_argument("--kl", type=float, default=0.0, help="rl.kl.coef (k3 against a frozen copy); 0: none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block", type=int, default=10, help="steps per block of the reward curve")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more dist_trainer overrides")
    parser.add_argument("--out", type=Path, default=None, help="keep everything here (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    args = parser.parse_args()
    print(machine_description(), flush=True)
    model = args.model.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        out = (args.out or Path(tmp)).resolve()
        from dist_trainer.arithmetic import write

        write(out / "arith", train=4000, test=200, largest=99, seed=0, prompts=True)
        before = measure(model, out / "arith")
        print(f"before: {before}", flush=True)
        run = out / "run"
        cmd = torchrun_cmd("-m", "dist_trainer", *grpo_overrides(model, out / "arith" / "train_prompts.jsonl", args),
                           f"hydra.run.dir={run}")
        print("python " + " ".join(cmd[1:]), flush=True)
        began = time.perf_counter()
        proc = subprocess.run(cmd, cwd=out, env=bench_env(), capture_output=True, text=True)
        wall_s = time.perf_counter() - began
        (out / "run.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"the GRPO run failed (log: {out / 'run.log'}):\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        after = measure(run / "hf_model", out / "arith")
        numbers = report(records, before, after, wall_s, args.block)
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **numbers}, indent=1))


if __name__ == "__main__":
    main()
