"""DPO pairs from a model's own mistakes, and held-out preference accuracy (docs/benchmarks.md, section 25).

    python bench/dpo_mistakes.py pairs runs/arith-full/hf_model arith/train_prompts.jsonl pairs_train.jsonl --limit 2000
    python bench/dpo_mistakes.py pairs runs/arith-full/hf_model arith/test_prompts.jsonl pairs_test.jsonl
    python bench/dpo_mistakes.py accuracy runs/arith-full/hf_model,runs/dpo/hf_model pairs_test.jsonl

``pairs``: the model answers each prompt of a data=hf_prompts file (``python -m dist_trainer.arithmetic
--prompts``) greedily, as ``dist_trainer.evaluate`` does; each wrong answer that ends its turn becomes a
data=hf_preference record ``{prompt, chosen: [the record's answer], rejected: [the model's]}``.

``accuracy``: for each model, the share of the pairs whose chosen answer (its tokens and the end of turn, after
the prompt with the generation prompt, the pieces tokenized apart as training does) has the higher
log-probability, and the mean margin in nats.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dist_trainer.data.hf_chat import ChatTemplate
from dist_trainer.data.tokenizer import load_tokenizer
from dist_trainer.hf.evaluate import STOP_NAMES


def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir, chat_template="auto")
    stops = [i for i in [tok.eos_id] + [tok.tok.token_to_id(n) for n in STOP_NAMES] if i is not None]
    return tok, ChatTemplate(tok.chat_template, tok), AutoModelForCausalLM.from_pretrained(model_dir).eval(), stops


def ids_of(tok, text: str) -> torch.Tensor:
    return torch.from_numpy(tok.encode_batch([text])[0].astype("int64"))


@torch.no_grad()
def pairs(model_dir: str, prompts: Path, out: Path, limit: int) -> None:
    tok, template, model, stops = load(model_dir)
    records = [json.loads(line) for line in prompts.open()][:limit]
    kept, right = [], 0
    for record in records:
        ids = ids_of(tok, template.render(record["prompt"], True, str(prompts)))[None]
        new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             eos_token_id=stops, pad_token_id=tok.pad_id or tok.eos_id)[0, ids.shape[1]:].tolist()
        ended = [i for i, t in enumerate(new) if t in stops]
        answer = tok.decode(new[:ended[0]] if ended else new).strip()
        right += answer == record["answer"]
        if answer != record["answer"] and answer and ended:
            kept.append({"prompt": record["prompt"], "chosen": [{"role": "assistant", "content": record["answer"]}],
                         "rejected": [{"role": "assistant", "content": answer}]})
    out.write_text("".join(json.dumps(r) + "\n" for r in kept))
    print(f"{prompts}: {len(records)} prompts, {right} answered right greedily, {len(kept)} pairs -> {out}")


@torch.no_grad()
def accuracy(model_dirs: str, pairs_file: Path) -> None:
    records = [json.loads(line) for line in pairs_file.open()]
    for model_dir in model_dirs.split(","):
        tok, template, model, _ = load(model_dir)

        def logp(prompt: list, answer: list) -> float:
            head = template.render(prompt, True, str(pairs_file))
            tail = template.render(prompt + answer, False, str(pairs_file))[len(head):]
            p, a = ids_of(tok, head), ids_of(tok, tail)
            logits = model(input_ids=torch.cat([p, a])[None]).logits[0, len(p) - 1:-1].float()
            return float(torch.log_softmax(logits, -1).gather(-1, a[:, None]).sum())

        margins = [logp(r["prompt"], r["chosen"]) - logp(r["prompt"], r["rejected"]) for r in records]
        right = sum(m > 0 for m in margins) / len(margins)
        print(f"{model_dir}: {len(margins)} pairs, preference accuracy {right:.1%}, "
              f"mean margin {sum(margins) / len(margins):+.3f} nats")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pairs")
    p.add_argument("model")
    p.add_argument("prompts", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    a = sub.add_parser("accuracy")
    a.add_argument("models", help="model directories, comma-separated")
    a.add_argument("pairs", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.command == "pairs":
        pairs(args.model, args.prompts, args.out, args.limit)
    else:
        accuracy(args.models, args.pairs)


if __name__ == "__main__":
    main()
