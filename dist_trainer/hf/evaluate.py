"""``python -m dist_trainer.evaluate MODEL_DIR CHATS.jsonl``: answer loss and exact match of greedy answers.

MODEL_DIR is a Hugging Face directory (a run's ``hf_model/``, or the base it
started from) with its tokenizer. For each conversation of CHATS (data=hf_chat's
records):

- the answer loss: the cross-entropy per answer token, the framework's own
  (the prompt masked as in training, the same chat template: the directory's,
  else the default one, whose markers a base without them gets as new rows);
- exact match: the model answers the last question greedily (the conversation
  up to its last assistant turn, with the generation prompt) and the answer
  counts if it equals the reference, end of turn included.

One process, no training; prints one line per measure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

from ..config import ConfigError
from ..data.hf_chat import ChatTemplate, Columns, hf_chat, read_conversations
from ..data.hf_text import resolve_files
from ..data.tokenizer import load_tokenizer
from ..models.hf import hf_model

STOP_NAMES = ("<|im_end|>", "<|eot_id|>", "<|eot|>", "<end_of_turn>")  # ends of turn of common templates
BATCH = 16


@torch.no_grad()
def evaluate(model_dir: Path, chats: Path, limit: Optional[int] = None, max_new_tokens: int = 16) -> Dict[str, float]:
    tok = load_tokenizer(str(model_dir), key="MODEL_DIR", chat_template="auto")
    torch.manual_seed(0)  # the markers' new rows, where the base has none
    module = hf_model("causal_lm", pretrained=str(model_dir), tokenizer=str(model_dir), chat_template="auto").eval()
    template = ChatTemplate(tok.chat_template, tok)
    with tempfile.TemporaryDirectory() as cache:
        data = hf_chat([str(chats)], block_size=4096, tokenizer=str(model_dir), chat_template="auto", cache_dir=cache)
        count = len(data) if limit is None else min(limit, len(data))
        loss_sum, items = 0.0, 0
        for start in range(0, count, BATCH):
            out = module(data.collate([data[i] for i in range(start, min(start + BATCH, count))]))
            loss_sum, items = loss_sum + float(out["loss_sum"]), items + int(out["num_items"])
        records = [m for _, m in read_conversations(resolve_files([str(chats)], None), Columns(), Path(cache))]
    stops = [i for i in [tok.eos_id] + [tok.tok.token_to_id(n) for n in STOP_NAMES] if i is not None]
    right = 0
    for messages in records[:count]:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = template.render(messages[:last], True, "CHATS")
        want = template.render(messages[:last + 1], False, "CHATS")[len(prompt):]
        ids = torch.from_numpy(tok.encode_batch([prompt])[0].astype("int64"))[None]
        new = module.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    do_sample=False, eos_token_id=stops, pad_token_id=tok.pad_id or tok.eos_id)
        got = tok.decode(new[0, ids.shape[1]:].tolist())
        right += got.strip() == want.strip()
    return {"conversations": count, "answer_tokens": items, "answer_loss": loss_sum / max(items, 1),
            "exact_match": right / max(count, 1)}


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path, metavar="MODEL_DIR")
    parser.add_argument("chats", type=Path, metavar="CHATS")
    parser.add_argument("--limit", type=int, default=None, help="the first N conversations only")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        result = evaluate(args.model, args.chats, args.limit, args.max_new_tokens)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.model}: {result['conversations']} conversations of {args.chats}")
    print(f"answer loss {result['answer_loss']:.4f} per answer token ({result['answer_tokens']} tokens)")
    print(f"exact match {result['exact_match']:.1%} (greedy answers to the last question)")


if __name__ == "__main__":
    main()
