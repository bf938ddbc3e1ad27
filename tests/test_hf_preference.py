"""data=hf_preference: three record forms, one tokenization; only the final answer trained; the [2B, L] batch.

Tiny jsonl files and the bytes tokenizer: every case builds its cache in well under a second, no process starts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_trainer.config import ConfigError
from dist_trainer.data import hf_preference as hf_preference_module
from dist_trainer.data.hf_chat import ChatTemplate, hf_chat
from dist_trainer.data.hf_preference import Pairs, hf_preference
from dist_trainer.data.tokenizer import load_tokenizer

SYSTEM = {"role": "system", "content": "You add numbers."}
EARLIER = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
CHOSEN, REJECTED = "5", "It is six, I believe."


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(tmp_path: Path, records: list, name: str = "pairs.jsonl", **kw) -> Pairs:
    path = write_jsonl(tmp_path / name, records)
    return hf_preference([str(path)], **{"block_size": 256, "cache_dir": str(tmp_path / "cache"), **kw})


def pairs(n: int) -> list:
    """String records, answers from 1 to ~60 characters."""
    return [{"prompt": f"What is {i}+{i}?", "chosen": str(2 * i), "rejected": f"{2 * i + 1}, or so. " * (i % 7)}
            for i in range(n)]


# ------------------------------------------------------------------------------------------ tokens

def test_string_message_and_implicit_records_give_the_same_ids(tmp_path):
    """The same conversation in each of TRL's forms, and as data=hf_chat tokenizes it."""
    prompt = [user("What is 2+3?")]
    forms = [
        {"prompt": "What is 2+3?", "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": prompt, "chosen": [assistant(CHOSEN)], "rejected": [assistant(REJECTED)]},
        {"prompt": prompt, "chosen": CHOSEN, "rejected": [assistant(REJECTED)]},  # a plain answer after messages
        {"chosen": prompt + [assistant(CHOSEN)], "rejected": prompt + [assistant(REJECTED)]},
    ]
    data = build(tmp_path, forms)
    assert len(data) == 4
    first = data.pair(0)
    for index in range(1, 4):
        for side, (ids, trained) in data.pair(index).items():
            assert np.array_equal(ids, first[side][0]) and np.array_equal(trained, first[side][1]), (index, side)
    # Several turns: a message-list prompt and the implicit prompt the two conversations share agree too.
    long_prompt = [SYSTEM, *EARLIER, user("And 2+3?")]
    multi = build(tmp_path, [{"prompt": long_prompt, "chosen": [assistant(CHOSEN)], "rejected": REJECTED},
                             {"chosen": long_prompt + [assistant(CHOSEN)],
                              "rejected": long_prompt + [assistant(REJECTED)]}], name="multi.jsonl")
    for side in ("chosen", "rejected"):
        assert all(np.array_equal(a, b) for a, b in zip(multi.pair(0)[side], multi.pair(1)[side]))
    # A one-turn side is what data=hf_chat makes of the same prompt and completion, token for token.
    chat = hf_chat([str(write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "What is 2+3?", "completion": answer}
                                                              for answer in (CHOSEN, REJECTED)]))],
                   block_size=256, cache_dir=str(tmp_path / "cache"))
    for row, side in enumerate(("chosen", "rejected")):
        assert all(np.array_equal(a, b) for a, b in zip(first[side], chat.conversation(row)))


EOT_TEMPLATE = ("<s>{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}<eot>{% endfor %}"
                "{% if add_generation_prompt %}[assistant]: {% endif %}")


@pytest.mark.parametrize("template", ["default", "own"])
def test_only_the_final_answer_is_trained(template, tmp_path):
    """The trained tokens decode to exactly the answer and its end of turn; the prompt, an earlier assistant
    turn in it included, is not trained, and both sides share its tokens."""
    spec = "auto"
    if template == "own":
        spec = str(tmp_path / "eot.jinja")
        Path(spec).write_text(EOT_TEMPLATE)
    end = "<|im_end|>\n" if template == "default" else "<eot>"
    prompt = [SYSTEM, *EARLIER, user("What is 2+3?")]
    records = [{"prompt": prompt, "chosen": [assistant(CHOSEN)], "rejected": [assistant(REJECTED)]},
               {"prompt": "Say hi.", "chosen": "hi", "rejected": "Hello, hello, hello!"}]
    data = build(tmp_path, records, chat_template=spec)
    tok = load_tokenizer("bytes", chat_template=spec)
    renderer = ChatTemplate(tok.chat_template, tok)
    for index, (record_prompt, answers) in enumerate([(prompt, (CHOSEN, REJECTED)),
                                                      ([user("Say hi.")], ("hi", "Hello, hello, hello!"))]):
        pair = data.pair(index)
        prompt_text = renderer.render(record_prompt, True, "test")
        prompt_ids = {}
        for side, answer in zip(("chosen", "rejected"), answers):
            ids, trained = pair[side]
            assert tok.decode(ids.tolist()) == renderer.render(record_prompt + [assistant(answer)], False, "test")
            assert tok.decode(ids[trained].tolist()) == answer + end
            first = int(np.argmax(trained))  # the first trained position; all after it are trained
            assert trained[first:].all() and not trained[:first].any()
            assert tok.decode(ids[:first].tolist()) == prompt_text  # nothing of the prompt is trained
            assert index or "Hello there" + end in prompt_text  # the earlier assistant turn among it
            prompt_ids[side] = ids[:first]
        assert np.array_equal(prompt_ids["chosen"], prompt_ids["rejected"])
    sample = data[0]
    labels = sample["chosen_labels"]
    assert sample["chosen_ids"].dtype == labels.dtype == torch.int64
    trained = labels != -100  # Hugging Face's unshifted labels: position t's label is token t
    assert torch.equal(labels[trained], sample["chosen_ids"][trained])


def test_collate_puts_chosen_rows_first_then_rejected_padded_right_by_position(tmp_path):
    """B pairs -> [2B, L]; the pad token's own text inside an answer is attended to: the mask is by position."""
    records = pairs(3)
    records[1]["chosen"] = "a<pad>b"  # the bytes tokenizer reads it as the pad id (257)
    data = build(tmp_path, records)
    samples = [data[i] for i in range(3)]
    batch = data.collate(samples)
    rows = [s["chosen_ids"] for s in samples] + [s["rejected_ids"] for s in samples]
    labels = [s["chosen_labels"] for s in samples] + [s["rejected_labels"] for s in samples]
    longest = max(r.numel() for r in rows)
    assert len({r.numel() for r in rows}) > 2  # rows of different lengths
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(v.shape == (6, longest) and v.dtype == torch.int64 for v in batch.values())
    assert data.pad_id in rows[1].tolist()
    for row, (ids, label) in enumerate(zip(rows, labels)):
        n = ids.numel()
        assert torch.equal(batch["input_ids"][row, :n], ids) and torch.equal(batch["labels"][row, :n], label)
        assert batch["attention_mask"][row, :n].all() and not batch["attention_mask"][row, n:].any()
        assert (batch["labels"][row, n:] == -100).all() and (batch["input_ids"][row, n:] == data.pad_id).all()
    assert data.pairs_per_sample == 1 and len(data) == 3
    assert data.lengths().tolist() == [max(rows[i].numel(), rows[i + 3].numel()) for i in range(3)]


def test_the_loader_makes_each_micro_batch_of_b_pairs_one_batch_of_2b_rows(tmp_path):
    """Through the data group's yaml, build_dataset, the training loader and the evaluation loader."""
    from omegaconf import OmegaConf

    from dist_trainer.config.shapes import BatchPlan
    from dist_trainer.data import StepPlan, build_dataset, epoch_batches, eval_loader

    path = write_jsonl(tmp_path / "pairs.jsonl", pairs(12))
    node = OmegaConf.load(Path(hf_preference_module.__file__).parents[1] / "conf" / "data" / "hf_preference.yaml")
    root = OmegaConf.create({"data": node})
    root.data.files, root.data.cache_dir = [str(path)], str(tmp_path / "cache")
    data = OmegaConf.to_container(root, resolve=True)["data"]
    assert build_dataset(data, split="val") is None  # nothing held out
    train = build_dataset(data)
    assert isinstance(train, Pairs) and len(train) == 12
    plan = BatchPlan(world_size=1, micro_batch_size=2, accum_steps=3, global_batch_size=6, base_lr=1.0, lr=1.0,
                     max_steps=2)
    window, batches = next(epoch_batches(train, StepPlan(len(train), plan, 0, 0, True, False), 0, 0, 0, False))
    assert [len(indices) for indices in window] == [2, 2, 2]
    for indices, batch in zip(window, batches):
        want = train.collate([train[i] for i in indices])
        assert batch["input_ids"].shape[0] == 4 and all(torch.equal(batch[k], want[k]) for k in want)
    val = build_dataset({**data, "val_fraction": 0.5}, split="val")
    assert isinstance(val, Pairs) and 0 < len(val) < 12
    batch = next(iter(eval_loader(val, 2, 1, 0, 1, 0)))
    assert batch["input_ids"].shape[0] == 2 * min(2, len(val))


# ------------------------------------------------------------------------------------------ lengths

def test_long_sides_are_cut_and_pairs_left_without_an_answer_dropped(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="dist_trainer")
    long_prompt = "Why? " * 20  # its rendering alone is longer than max_length: nothing of an answer is left
    records = pairs(10) + [{"prompt": long_prompt, "chosen": "yes", "rejected": "no"}]
    data = build(tmp_path, records, max_length=48)
    meta = json.loads((data.directory / "meta.json").read_text())
    full = build(tmp_path, records, name="again.jsonl")  # the same pairs, nothing cut
    cut = sum(int(n > 48) for i in range(len(full)) for n in (full.pair(i)["chosen"][0].size,
                                                             full.pair(i)["rejected"][0].size))
    assert cut >= 5 and meta["truncated"] == cut  # the long prompt's two sides among them
    assert meta["dropped"] == 1 and len(data) == 10 and max(data.lengths()) == 48
    for i in range(len(data)):
        for side, (ids, trained) in data.pair(i).items():
            assert trained.any() and np.array_equal(ids, full.pair(i)[side][0][:48])  # the start is kept
    assert f"{cut} sides cut to data.max_length=48, 1 pairs dropped" in caplog.text


def test_the_cache_is_built_once_and_reused(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="dist_trainer")
    first = build(tmp_path, pairs(4))
    assert "wrote the tokenized cache" in caplog.text and first.directory.parent.name == "hf_preference"
    monkeypatch.setattr(hf_preference_module, "_write", lambda *a, **k: pytest.fail("the cache was rebuilt"))
    again = hf_preference([str(tmp_path / "pairs.jsonl")], block_size=256, cache_dir=str(tmp_path / "cache"))
    assert again.directory == first.directory and "reused the tokenized cache" in caplog.text
    assert again.pair(3)["rejected"][0].tolist() == first.pair(3)["rejected"][0].tolist()
    monkeypatch.undo()
    # Another max_length is another key: a directory of its own.
    cut = hf_preference([str(tmp_path / "pairs.jsonl")], block_size=256, max_length=40,
                        cache_dir=str(tmp_path / "cache"))
    assert cut.directory != first.directory


# ---------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("record,message", [
    ({"prompt": "hi", "rejected": "no"}, r"line 2 has no 'chosen' \(data.chosen_key\)"),
    ({"prompt": "hi", "chosen": "yes"}, r"line 2 has no 'rejected' \(data.rejected_key\)"),
    ({"prompt": "hi", "chosen": [assistant("yes")], "rejected": "no"},
     r"line 2: 'chosen' \(data.chosen_key\) must be text, as the prompt is"),
    ({"prompt": 3, "chosen": "yes", "rejected": "no"},
     r"line 2, 'prompt' \(data.prompt_key\): a conversation must be a non-empty list"),
    ({"prompt": [user("hi"), assistant("hello")], "chosen": "yes", "rejected": "no"},
     r"line 2, 'prompt' \(data.prompt_key\): the prompt must end with a user turn \(its last "
     r"message's role is assistant\)"),
    ({"prompt": [user("hi")], "chosen": "yes", "rejected": [assistant("a"), assistant("b")]},
     r"line 2, 'rejected' \(data.rejected_key\): an answer is one assistant message"),
    ({"prompt": [user("hi")], "chosen": [user("yes")], "rejected": "no"},
     r"line 2, 'chosen' \(data.chosen_key\): an answer is one assistant message"),
    ({"prompt": [user("hi")], "chosen": "yes", "rejected": [{"role": "robot", "content": "no"}]},
     r"line 2, 'rejected' \(data.rejected_key\): role 'robot' is not one of"),
    ({"chosen": "yes", "rejected": "no"}, r"line 2: with no 'prompt' \(data.prompt_key\), 'chosen' \(data.chosen_key\) "
                                          r"must be a whole conversation"),
    ({"chosen": [user("a"), assistant("b"), user("c"), assistant("d")], "rejected": [user("a"), assistant("x")]},
     r"line 2: with no 'prompt' .* what follows them in 'chosen' \(data.chosen_key\) must be one assistant "
     r"message, not assistant, user, assistant"),
    ({"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b")]},
     r"what follows them in 'chosen' \(data.chosen_key\) must be one assistant message, not nothing"),
    ({"chosen": [assistant("b")], "rejected": [assistant("c")]},
     r"line 2, the start 'chosen' \(data.chosen_key\) and 'rejected' \(data.rejected_key\) share: the prompt must "
     r"end with a user turn \(it has no message\)"),
    (["hi"], r"line 2: a record must be an object with 'chosen' \(data.chosen_key\)"),
])
def test_each_malformed_record_names_its_file_line_and_key(record, message, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [pairs(1)[0], record])
    with pytest.raises(ConfigError, match=message) as err:
        hf_preference([str(path)], block_size=64, cache_dir=str(tmp_path / "c"))
    assert str(path) in str(err.value)


def test_a_template_that_cannot_locate_the_answer_or_renders_two_prompts_names_data_chat_template(tmp_path,
                                                                                                 monkeypatch):
    path = write_jsonl(tmp_path / "ok.jsonl", pairs(2))
    reorders = tmp_path / "reorders.jinja"  # the newest message first: the answer is not after the prompt
    reorders.write_text("{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"data.chat_template: it does not render .*'chosen' \(data.chosen_key\) "
                                          r"turn by turn.*use data.chat_template=default$"):
        hf_preference([str(path)], block_size=64, chat_template=str(reorders), cache_dir=str(tmp_path / "c"))
    # The two sides' prompts are compared token for token (a template that rewrote the prompt after
    # seeing the answer would differ): one side's prompt changed here by hand.
    pieces = hf_preference_module._pieces

    def differing(template, prompt, answer, where):
        out = pieces(template, prompt, answer, where)
        return [(out[0][0] + "!", False), *out[1:]] if "rejected" in where else out

    monkeypatch.setattr(hf_preference_module, "_pieces", differing)
    with pytest.raises(ConfigError, match=r"data.chat_template: it renders the prompt of .*ok.jsonl line 1 "
                                          r"differently before 'chosen'"):
        hf_preference([str(path)], block_size=64, cache_dir=str(tmp_path / "c"))


def test_bad_settings_name_the_key(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", pairs(2))
    with pytest.raises(ConfigError, match=r"data.max_length=100: must be an integer in \[2, data.block_size=64\]"):
        hf_preference([str(path)], block_size=64, max_length=100)
    with pytest.raises(ConfigError, match=r"data=hf_preference trains causal LMs; model.task=masked_lm"):
        hf_preference([str(path)], task="masked_lm")
    with pytest.raises(ConfigError, match=r"data.files: .*a.txt is text; preference pairs are read from json"):
        hf_preference([str(write_jsonl(tmp_path / "a.txt", []))], cache_dir=str(tmp_path / "c"))
