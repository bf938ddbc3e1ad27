"""``python -m dist_trainer.arithmetic --out DIR``: a chat data set whose answers can be checked.

Questions "What is 37+45?" and their answers "82", as ``messages`` records
(data=hf_chat): DIR/train.jsonl and DIR/test.jsonl, with no question in both.
Some conversations carry a system prompt, some a second turn ("And doubled?"),
so answer masks meet system prompts and several turns. Deterministic for a
seed; no network, no dependency beyond Python.
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


def write(out: Path, train: int, test: int, largest: int, seed: int) -> None:
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


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.arithmetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--train", type=int, default=4000, help="training conversations (default 4000)")
    parser.add_argument("--test", type=int, default=200, help="held-out conversations (default 200)")
    parser.add_argument("--largest", type=int, default=99, help="the largest operand (default 99)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write(args.out, args.train, args.test, args.largest, args.seed)


if __name__ == "__main__":
    main()
