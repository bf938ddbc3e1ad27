"""data=hf_chat: answer masks, packing without cross-talk, and exact accumulation on conversations.

Conversations here have answers from 2 to about 80 tokens (40x), several turns and
system prompts; the models are tiny transformers configurations (no hub).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer.config import ConfigError
from dist_trainer.data.hf_chat import ChatTemplate, Conversations, PackedConversations, hf_chat, pack
from dist_trainer.data.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer, train_bpe
from dist_trainer.models.hf import hf_model
from helpers import SCALE_TOL, assert_close_scaled, run_ranks
from test_hf_models import LLAMA, STEPS, _assert_close, _steps, config

GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0}
QWEN2 = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64}


def conversations(n: int, seed: int = 0) -> list:
    """Sums and their doubling; some with a system prompt, some answers repeated up to 20 times."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        a, b = r.randint(0, 99), r.randint(0, 99)
        messages = [{"role": "system", "content": "You add numbers."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"What is {a}+{b}?"},
                     {"role": "assistant", "content": f"{a + b}. " * r.choice([1, 1, 2, 20])}]
        if i % 2:
            messages += [{"role": "user", "content": "Doubled?"}, {"role": "assistant", "content": str(2 * (a + b))}]
        out.append({"messages": messages})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_data(files: list, cache: Path, **kw) -> dict:
    return {"_target_": "dist_trainer.data.hf_chat.hf_chat", "files": [str(f) for f in files], "tokenizer": "bytes",
            "block_size": 256, "cache_dir": str(cache), "shuffle": True, **kw}


def chat_model(model_type: str = "llama", cfg: dict = LLAMA, chat_template: str = "auto") -> dict:
    return {"_target_": "dist_trainer.hf.models.hf_model", "task": "causal_lm", "model_type": model_type,
            "config": dict(cfg), "tokenizer": "bytes", "chat_template": chat_template, "block_size": 256}


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", conversations(96))


# ------------------------------------------------------------------------------------------ masks

# A Llama-3-like template: a begin token, headers around each role, an end-of-turn token.
HEADERS = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] }}<|eot|>"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}")


def _template_dir(root: Path) -> Path:
    """A trained BPE (merges across the template's text) saved with a chat template of its own."""
    texts = [json.dumps(c) for c in conversations(200, seed=1)]
    tok = train_bpe([texts], vocab_size=400, min_frequency=2)
    tok.tok.add_special_tokens(["<|start|>", "<|end|>", "<|eot|>"])
    tok.chat_template = HEADERS
    return tok.save(root / "tok")


@pytest.mark.parametrize("template", ["default", "own"])
def test_answer_masks_are_exact_for_system_prompts_and_several_turns(template, chats, tmp_path):
    """Every token decodes to the rendered text; the trained ones to exactly the answers and their ends of turn."""
    spec = "bytes" if template == "default" else str(_template_dir(tmp_path))
    end = "<|im_end|>\n" if template == "default" else "<|eot|>"
    data = hf_chat([str(chats)], block_size=512, tokenizer=spec, chat_template="auto", cache_dir=str(tmp_path / "c"))
    tok = load_tokenizer(spec, chat_template="auto")
    assert tok.chat_template == (DEFAULT_CHAT_TEMPLATE if template == "default" else HEADERS)
    renderer = ChatTemplate(tok.chat_template, tok)
    records = [json.loads(line) for line in chats.read_text().splitlines()]
    assert len(data) == len(records)
    trained_total = 0
    for index, record in enumerate(records):
        ids, trained = data.conversation(index)
        assert tok.decode(ids.tolist()) == renderer.render(record["messages"], False, "test")
        answers = "".join(m["content"] + end for m in record["messages"] if m["role"] == "assistant")
        assert tok.decode(ids[trained].tolist()) == answers
        assert not trained[0] and trained[-1 if template == "own" else -2]  # ChatML ends "<|im_end|>\n"
        trained_total += int(trained.sum())
    lengths = [int(data.conversation(i)[1].sum()) for i in range(len(records))]
    assert max(lengths) >= 10 * min(lengths)  # the weighting below is tested on answers of unequal length
    # train_on=all: every token but the first.
    everything = hf_chat([str(chats)], block_size=512, tokenizer=spec, train_on="all", cache_dir=str(tmp_path / "c"))
    ids, trained = everything.conversation(3)
    assert not trained[0] and trained[1:].all() and trained_total < sum(len(everything.conversation(i)[0])
                                                                        for i in range(len(records)))


def test_truncation_and_held_out_conversations_are_counted(chats, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dist_trainer")
    train = hf_chat([str(chats)], block_size=256, max_length=40, val_fraction=0.25, cache_dir=str(tmp_path))
    val = hf_chat([str(chats)], block_size=256, max_length=40, val_fraction=0.25, split="val", cache_dir=str(tmp_path))
    meta = json.loads((train.directory / "meta.json").read_text())
    assert meta["truncated"] > 0 and len(train) + len(val) + meta["dropped"] == 96
    assert 10 <= len(val) <= 40 and max(train.lengths()) == 40
    assert "cut to data.max_length=40" in caplog.text


# ---------------------------------------------------------------------------------------- packing

def _loss(model, batch: dict) -> tuple:
    out = model({k: v for k, v in batch.items()})
    return out["loss_sum"].double(), int(out["num_items"])


@pytest.mark.parametrize("model_type,cfg", [("llama", LLAMA), ("gpt2", GPT2), ("qwen2", QWEN2)])
def test_a_packed_block_and_a_padded_batch_lose_what_their_conversations_lose_alone(model_type, cfg, chats, tmp_path):
    """No token attends to another conversation: the sums agree within 1e-5 (fp32)."""
    torch.manual_seed(0)
    data = hf_chat([str(chats)], block_size=256, cache_dir=str(tmp_path))
    packed = PackedConversations(data, 256)
    # Larger initial weights than the default: attention that is not nearly even, so cross-talk would show.
    model = hf_model("causal_lm", model_type, {**cfg, "initializer_range": 0.3}, tokenizer="bytes",
                     chat_template="auto", block_size=256, attn_implementation="sdpa").eval()
    with torch.no_grad():
        shared = [i for i, (first, last) in enumerate(packed.blocks) if last - first >= 3][:3]
        assert len(shared) == 3  # blocks of several conversations
        for index in shared:
            first, last = packed.blocks[index]
            alone = [_loss(model, data.collate([data[i]])) for i in range(first, last)]
            block = packed[index]
            got, items = _loss(model, {k: v[None] for k, v in block.items()})
            want = sum(loss for loss, _ in alone)
            assert items == sum(n for _, n in alone)
            assert_close_scaled(got, want, "a packed block vs its conversations alone")
            # Without positions that restart, the same tokens attend across conversations, and the sum
            # leaves the tolerance by far.
            crossed, _ = _loss(model, {"input_ids": block["input_ids"][None], "labels": block["labels"][None]})
            assert abs(float(crossed - want)) > 10 * SCALE_TOL * abs(float(want))
            padded, padded_items = _loss(model, data.collate([data[i] for i in range(first, last)]))
            assert padded_items == items
            assert_close_scaled(padded, want, "padded conversations vs each alone")


def test_packing_keeps_conversations_whole_and_in_order():
    import numpy as np

    blocks = pack(np.array([5, 3, 4, 10, 1, 1]), 10)
    assert blocks == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert pack(np.array([12, 3]), 10) == [(0, 1), (1, 2)]  # one longer than a block stands alone (cut before)


# ------------------------------------------------------------------------------ split invariance

def _jobs(files: list, cache: Path) -> dict:
    def job(packing: bool, strategy: str):
        data = chat_data(files, cache, packing=packing, block_size=256 if packing else 128)

        def make(micro: int):
            cfg = config(chat_model(), data, micro, "ddp" if strategy == "pp" else strategy)
            if strategy == "pp":  # two stages of one decoder layer: each builds the masks and positions itself
                cfg.dist.pp.size = 2
            return cfg
        return make
    return {(packing, strategy): job(packing, strategy) for packing in (False, True)
            for strategy in ("ddp", "fsdp", "pp")}


def _split_worker(rank: int, world: int, files: list, cache: str) -> dict:
    return {key: _steps(make(4), world) for key, make in _jobs(files, Path(cache)).items()}


def test_split_invariance_padded_and_packed_under_ddp_fsdp_and_pp(tmp_path):
    """2 ranks x micro 4 x accum 4 == 1 process x 32 samples: conversations, or blocks of them. Under pp 2
    (micro 4 x accum 8 through the pipeline) each rank holds one stage: the two together are the model."""
    files = [str(write_jsonl(tmp_path / "chats.jsonl", conversations(160, seed=2)))]
    cache = tmp_path / "cache"
    ranks = run_ranks(_split_worker, 2, tmp_path, files, str(cache))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        refs = {packing: _steps(_jobs(files, cache)[(packing, "ddp")](32), 1) for packing in (False, True)}
    finally:
        dist.destroy_process_group()
    for (packing, strategy), rec in ranks[0].items():
        ref, what = refs[packing], f"{'packed' if packing else 'padded'}/{strategy}"
        if strategy == "pp":
            other = ranks[1][(packing, strategy)]
            assert not rec["params"].keys() & other["params"].keys()
            rec = {"items": rec["items"], "grads": [{**a, **b} for a, b in zip(rec["grads"], other["grads"])],
                   "params": {**rec["params"], **other["params"]}}
            ranks[1][(packing, strategy)] = rec
        assert rec["items"] == ref["items"]  # the same answer tokens counted, whatever the split
        for step in range(STEPS):
            _assert_close(rec["grads"][step], ref["grads"][step], f"{what} step {step + 1} grad")
        _assert_close(rec["params"], ref["params"], f"{what} params")
        _assert_close(ranks[1][(packing, strategy)]["params"], rec["params"], f"{what} rank 1")


# ------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("record,message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, r"line 2: no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, r"line 2: role 'robot' is not one of system, user"),
    ({"messages": [{"role": "user", "content": 3}]}, r"line 2: a message's content must be text"),
    ({"text": "hi"}, r"line 2 has neither 'messages' \(data.messages_key\) nor 'prompt' and 'completion'"),
])
def test_bad_conversations_name_the_file_and_line(record, message, tmp_path):
    good = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(ConfigError, match=message):
        hf_chat([str(path)], block_size=64, cache_dir=str(tmp_path / "c"))


def test_bad_templates_and_settings_name_the_key(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "1+1?", "completion": "2"}])
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ConfigError, match=r"data.chat_template: cannot render .*ok.jsonl line 1 .*roles must alternate"):
        hf_chat([str(path)], block_size=64, chat_template=str(raising), cache_dir=str(tmp_path / "c"))
    reorders = tmp_path / "reorders.jinja"  # the newest message first: no prefix property
    reorders.write_text("{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"does not render .* turn by turn"):
        hf_chat([str(path)], block_size=64, chat_template=str(reorders), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"data.chat_template=nope.jinja: choose auto, default, or the path"):
        hf_chat([str(path)], block_size=64, chat_template="nope.jinja", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ConfigError, match=r"data.max_length=100: must be an integer in \[2, data.block_size=64\]"):
        hf_chat([str(path)], block_size=64, max_length=100)
    with pytest.raises(ConfigError, match=r"data.train_on='prompt': choose assistant"):
        hf_chat([str(path)], block_size=64, train_on="prompt")
    with pytest.raises(ConfigError, match=r"model.task=masked_lm"):
        hf_chat([str(path)], block_size=64, task="masked_lm")


def test_the_models_vocabulary_follows_the_templates_tokens():
    model = hf_model("causal_lm", "llama", dict(LLAMA), tokenizer="bytes", chat_template="default")
    assert model.model.config.vocab_size == 259 + 2 == load_tokenizer("bytes", chat_template="default").vocab_size
    assert hf_model("causal_lm", "llama", dict(LLAMA), tokenizer="bytes").model.config.vocab_size == 259


def test_collate_pads_right_with_no_loss_and_no_attention(chats, tmp_path):
    data = hf_chat([str(chats)], block_size=256, cache_dir=str(tmp_path))
    batch = data.collate([data[0], data[1]])
    lengths = [len(data.conversation(i)[0]) for i in (0, 1)]
    assert batch["input_ids"].shape == (2, max(lengths))
    short = lengths.index(min(lengths))
    assert batch["attention_mask"][short].sum() == min(lengths)
    assert (batch["labels"][short, min(lengths):] == -100).all()
    assert isinstance(data, Conversations)


def test_parquet_and_prompt_completion_records_give_the_same_tokens_as_jsonl_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [("What is 2+3?", "5"), ("Spell cat.", "c-a-t " * 7)]
    jsonl = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": p},
                                                              {"role": "assistant", "content": c}]} for p, c in pairs])
    parquet = tmp_path / "pc.parquet"
    pq.write_table(pa.table({"question": [p for p, _ in pairs], "answer": [c for _, c in pairs]}), parquet)
    a = hf_chat([str(jsonl)], block_size=128, cache_dir=str(tmp_path / "c"))
    b = hf_chat([str(parquet)], block_size=128, prompt_key="question", completion_key="answer",
                cache_dir=str(tmp_path / "c"))
    for i in range(len(pairs)):
        assert all((x == y).all() for x, y in zip(a.conversation(i), b.conversation(i)))


def test_the_arithmetic_set_holds_out_its_questions_and_evaluate_measures_a_model(tmp_path):
    """python -m dist_trainer.arithmetic and python -m dist_trainer.evaluate, on a random tiny model."""
    import math
    import re

    from dist_trainer.arithmetic import write
    from dist_trainer.hf.evaluate import evaluate
    from dist_trainer.hf.export import save_pretrained

    write(tmp_path / "arith", train=300, test=20, largest=30, seed=0)
    sets = {name: [json.loads(line)["messages"] for line in (tmp_path / "arith" / f"{name}.jsonl").open()]
            for name in ("train", "test")}
    questions = {name: {m[1 if m[0]["role"] == "system" else 0]["content"] for m in convs}
                 for name, convs in sets.items()}
    assert len(questions["train"]) == 300 and not questions["train"] & questions["test"]
    for conv in sets["train"]:
        a, b = map(int, re.match(r"What is (\d+)\+(\d+)\?", next(m["content"] for m in conv if m["role"] == "user")).groups())
        assert next(m["content"] for m in conv if m["role"] == "assistant") == str(a + b)
    torch.manual_seed(0)
    module = hf_model("causal_lm", "llama", dict(LLAMA), tokenizer="bytes", chat_template="default")
    save_pretrained(module, module.state_dict(), tmp_path / "model")
    result = evaluate(tmp_path / "model", tmp_path / "arith" / "test.jsonl")
    data = hf_chat([str(tmp_path / "arith" / "test.jsonl")], block_size=512, cache_dir=str(tmp_path / "c"))
    assert result["conversations"] == 20
    assert result["answer_tokens"] == sum(int(data.conversation(i)[1].sum()) for i in range(len(data)))
    assert abs(result["answer_loss"] - math.log(261)) < 0.5  # a random model: about ln(vocabulary)
    assert result["exact_match"] == 0.0


def test_the_arithmetic_prompts_are_the_conversations_up_to_their_last_answer(tmp_path):
    """--prompts: each record is its conversation before the last answer, with that answer, and data=hf_prompts
    reads them (task=grpo's example, docs/post_training.md)."""
    from dist_trainer.arithmetic import write
    from dist_trainer.data.hf_prompts import hf_prompts

    write(tmp_path, train=40, test=8, largest=30, seed=0, prompts=True)
    read = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").open()]
            for name in ("train", "test", "train_prompts", "test_prompts")}
    for name in ("train", "test"):
        assert [p["prompt"] + [{"role": "assistant", "content": p["answer"]}] for p in read[f"{name}_prompts"]] == \
            [c["messages"] for c in read[name]]
    # a second turn: the first answer stays in the prompt, the doubled sum is the answer
    assert any(p["prompt"][-1]["content"] == "And doubled?" for p in read["train_prompts"])
    data = hf_prompts([str(tmp_path / "train_prompts.jsonl")], group_size=2, cache_dir=str(tmp_path / "c"))
    assert len(data) == 80 and data.records == read["train_prompts"]
