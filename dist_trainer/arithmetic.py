"""``python -m dist_trainer.arithmetic --out DIR``: a chat data set whose answers can be checked.

Questions "What is 37+45?" and their answers "82", as ``messages`` records
(data=hf_chat): DIR/train.jsonl and DIR/test.jsonl, with no question in both.
Some conversations carry a system prompt, some a second turn ("And doubled?"),
so answer masks meet system prompts and several turns. Deterministic for a
seed; no network, no dependency beyond Python.

``--prompts`` also writes DIR/train_prompts.jsonl and DIR/test_prompts.jsonl
for task=grpo (data=hf_prompts): each conversation up to its last answer as
``prompt`` (messages) and that answer as ``answer`` (rl.reward=exact_answer),
the question ``python -m dist_trainer.evaluate`` asks of the same record.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import List, Optional, Sequence

SYSTEM = "You are a calculator. Answer with the number only."


def conversations(pairs: List[tuple], rng: random.Random) -> List[dict]:
    out = []
    for a, b in pairs:
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        messages += [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]
        if rng.random() < 0.25:
            messages += [{"role": "user", "content": "And doubled?"},
                         {"role": "assistant", "content": str(2 * (a + b))}]
        out.append({"messages": messages})
    return out


def prompt_record(conversation: dict) -> dict:
    """A conversation as a prompt to be answered: its messages before the last answer, and that answer."""
    messages = conversation["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return {"prompt": messages[:last], "answer": messages[last]["content"]}


def write(out: Path, train: int, test: int, largest: int, seed: int, prompts: bool = False) -> None:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(largest + 1) for b in range(largest + 1)]
    if train + test > len(pairs):
        raise SystemExit(f"error: --train {train} + --test {test} exceeds the {len(pairs)} questions with operands "
                         f"up to {largest}; raise --largest")
    rng.shuffle(pairs)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:train]), ("test", pairs[train:train + test])):
        records = conversations(part, rng)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{out / name}.jsonl: {len(records)} conversations")
        if prompts:
            lines = "".join(json.dumps(prompt_record(r)) + "\n" for r in records)
            (out / f"{name}_prompts.jsonl").write_text(lines)
            print(f"{out / name}_prompts.jsonl: {len(records)} prompts with their answers")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.arithmetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--train", type=int, default=4000, help="training conversations (default 4000)")
    parser.add_argument("--test", type=int, default=200, help="held-out conversations (default 200)")
    parser.add_argument("--largest", type=int, default=99, help="the largest operand (default 99)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", action="store_true",
                        help="also write train_prompts.jsonl and test_prompts.jsonl (data=hf_prompts)")
    args = parser.parse_args(argv)
    write(args.out, args.train, args.test, args.largest, args.seed, args.prompts)


if __name__ == "__main__":
    main()
