"""data.streaming=true: hf_text tokenized as the run reads, the same samples as the prepared path, exact resume.

A corpus of many small shards (text, jsonl and parquet) is compared in this process, through BlendPlan and the
dataset, with the token file hf_text's cache writes of the same files: without shuffle the stream's samples of
every step equal the prepared file's, epoch after epoch (a blend source and data=hf_text alone alike). With
shuffle, each rank's own reader gives the samples of the one-process global batch, and a checkpoint's stream
state resumes exactly. Then one 2-rank launch and one process train a blend with a streaming source: final
weights within SCALE_TOL, and a resume chain (mid-epoch, then past the stream's epoch boundary) bit-identical to
the straight run. The refusals name their keys; ``prepare --processes`` writes the one-process file byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_trainer import distributed
from dist_trainer.config import ConfigError
from dist_trainer.data import BlendPlan, build_dataset
from dist_trainer.data.mixture import Mixture, plan_lines
from dist_trainer.data.prepare import prepare
from dist_trainer.data.streaming import StreamState, close_all
from dist_trainer.run import train
from dist_trainer.validation import validate
from helpers import assert_all_close_scaled
from test_accumulation import in_one_process, launch_clean
from test_blend import BLOCK, GLOBAL, blend_config, _final, _metrics
from test_hf_text import _offline, paragraphs, write  # noqa: F401 (_offline: the module's autouse fixture)

STEPS = 10  # the runs: the stream (6 samples a step) wraps inside them


@pytest.fixture(autouse=True)
def _readers_stopped():
    """No reader of a test's streams goes on tokenizing into the next test (one patching the tokenizer, say)."""
    yield
    close_all()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Many shards of real paragraphs in three formats; and a tiny jsonl corpus whose epoch is a few steps."""
    root = tmp_path_factory.mktemp("streaming")
    docs = [d for d in paragraphs(400) if len(d) < 400][:48]
    shards = [write(root / f"shard{i:02d}{('.txt', '.jsonl', '.parquet')[i % 3]}", docs[i * 4:(i + 1) * 4])
              for i in range(12)]
    small = []
    for i in range(4):
        small.append(root / f"small{i}.jsonl")
        small[-1].write_text("".join(json.dumps({"text": f"shard {i} note {j}: " + "ab cd " * (1 + (i + j) % 4)})
                                     + "\n" for j in range(4)))
    chats = [root / f"chat{i}.jsonl" for i in range(3)]
    for i, path in enumerate(chats):
        path.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"What is {i}+{j}?"},
            {"role": "assistant", "content": f"{i + j}. " * (1 + (i * j) % 5)}]}) + "\n" for j in range(5)))
    return {"root": root, "shards": [str(s) for s in shards], "small": [str(s) for s in small],
            "chats": [str(c) for c in chats]}


def config(root: Path, sources: dict, micro: int = GLOBAL, steps: int = STEPS, shuffle: bool = True):
    cfg = blend_config(root, micro, steps=steps)
    cfg.data["sources"], cfg.data["shuffle"] = sources, shuffle
    return cfg


def text(files: list, weight=1.0, **keys) -> dict:
    return {"kind": "hf_text", "files": files, "weight": weight, **keys}


def plan_of(cfg, world: int = 1, rank: int = 0) -> BlendPlan:
    """A rank's plan over a dataset of its own: each has its own stream reader, as each rank of a run."""
    return BlendPlan.for_config(build_dataset(cfg.data), cfg, validate(cfg, world), rank)


def samples(plan: BlendPlan, step: int, world: int = 1) -> list:
    """The rank's samples of ``step`` as token tuples (input_ids, then the last target)."""
    out = []
    for micro in next(plan.windows(0, step - 1)):
        for i in micro:
            item = plan.blend[i]
            out.append(tuple(item["input_ids"].tolist()) + (int(item["targets"][-1]),))
    return out


# --------------------------------------------------------------------------- in this process

def test_without_shuffle_the_stream_is_the_prepared_file_epoch_after_epoch(corpus):
    root, shards = corpus["root"], corpus["shards"]
    prepared = build_dataset(config(root, {"text": text(shards, cache_dir=str(root / "cache"))}).data).datasets[0]
    blocks = len(prepared)
    steps = 5 * blocks // (2 * GLOBAL)  # two and a half epochs of the file
    streamed = plan_of(config(root, {"text": text(shards, streaming=True)}, steps=steps, shuffle=False))
    tokens = plan_of(config(root, {"text": {"kind": "tokens", "path": str(prepared.path), "weight": 1.0}},
                            steps=steps, shuffle=False))
    for step in range(1, steps + 1):
        assert samples(streamed, step) == samples(tokens, step), step
    # data=hf_text data.streaming=true alone: a one-source blend, the same samples (no source column)
    alone = config(root, {}, steps=steps)
    alone.data = {"_target_": "dist_trainer.data.hf_text.hf_text", "files": shards, "block_size": BLOCK,
                  "streaming": True, "shuffle": False}
    plan = plan_of(alone)
    assert plan.blend.standalone and "source" not in plan.blend[0]
    for step in (1, blocks // GLOBAL + 1, steps):  # the first step, one across the wrap, the last
        assert samples(plan, step) == samples(tokens, step), step
    assert plan.blend.describe()["stream"]["length"] == "streamed: not known until read"
    # a small window asked far ahead, then behind it: read on (dropping what passes), then again from a mark
    stream = plan.blend.datasets[0]
    stream.hold = 8
    for position in (3 * blocks + 5, 40, 41, 2 * blocks + 1):
        assert torch.equal(stream[position]["input_ids"], tokens.blend[position % blocks]["input_ids"]), position


def test_shuffled_ranks_read_the_one_process_batches_and_a_checkpoint_resumes_the_stream(corpus):
    root, shards = corpus["root"], corpus["shards"]
    sources = {"text": text(corpus["small"], weight=0.7, streaming=True),  # its epoch: 5 steps
               "notes": text(shards, weight=0.3, cache_dir=str(root / "cache"))}
    steps = 30
    one = plan_of(config(root, sources, steps=steps))
    ranks = [plan_of(config(root, sources, micro=1, steps=steps), 2, r) for r in range(2)]
    for step in range(1, steps + 1):
        assert sorted(samples(one, step)) == sorted(samples(ranks[0], step) + samples(ranks[1], step)), step
    stream = one.blend.datasets[0].stream
    assert stream.shard_order(0) != stream.shard_order(1) != list(range(4))  # keyed per epoch
    # the checkpoint after step 17: the stream's state at its next position; a fresh reader seeks there
    saved = json.loads(json.dumps(one.checkpoint_state(17)))
    position, state = saved["streams"]["text"]["position"], StreamState(*saved["streams"]["text"]["state"])
    assert position == one.mixture.taken(17)[0] and state.epoch >= 1  # past the stream's first epoch
    later = plan_of(config(root, sources, steps=steps))
    later.resume_from(saved, 17)
    assert all(samples(later, s) == samples(one, s) for s in range(18, steps + 1))
    # a stream whose files changed since the checkpoint would read other blocks at the saved state: refused
    changed = Path(corpus["small"][-1])
    stat = changed.stat()
    os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        with pytest.raises(ConfigError, match=r"data\.sources\.text\.files: the stream's files"):
            plan_of(config(root, sources, steps=steps)).resume_from(saved, 17)
        allowed = config(root, sources, steps=steps)
        allowed.data["blend"] = {"allow_change": True}  # the new files from their beginning, at the saved position
        moved = plan_of(allowed)
        moved.resume_from(saved, 17)
        assert moved.blend.datasets[0].state_at(position) == StreamState(0, 0, 0, 0)
    finally:
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("packing", [False, True])
def test_a_chat_stream_is_the_cached_conversations_and_resumes_past_its_epoch(corpus, packing):
    """hf_chat: a conversation a sample (padded) or packed blocks, as its cache holds them, epoch after epoch."""
    root, chats = corpus["root"], corpus["chats"]
    cached = {"kind": "hf_chat", "files": chats, "weight": 1.0, "packing": packing, "cache_dir": str(root / "cache")}

    def chat_config(source: dict, steps: int = STEPS, shuffle: bool = True):
        cfg = config(root, {"chat": source}, steps=steps, shuffle=shuffle)
        cfg.data["block_size"] = 160  # a conversation's template and answer: 2 or 3 to a packed block
        cfg.data["vocab_size"] = 261  # the bytes tokenizer and the default template's two markers
        return cfg

    cache = build_dataset(chat_config(cached).data).datasets[0]
    steps = max(4, 5 * len(cache) // (2 * GLOBAL) + 1)  # two and a half epochs of the cache, or more
    streamed = {**cached, "streaming": True}
    one = plan_of(chat_config(streamed, steps, shuffle=False))
    reference = plan_of(chat_config(cached, steps, shuffle=False))
    keys = ("input_ids", "labels", "position_ids") if packing else ("input_ids", "labels")
    for step in range(1, steps + 1):
        got, want = next(one.windows(0, step - 1))[0], next(reference.windows(0, step - 1))[0]
        for i, j in zip(got, want):
            a, b = one.blend[i], reference.blend[j]
            assert set(a) == set(b) == {*keys, "source"} and all(torch.equal(a[k], b[k]) for k in keys), step
    shuffled = chat_config(streamed, steps)
    one = plan_of(shuffled)
    saved = json.loads(json.dumps(one.checkpoint_state(steps - 2)))
    assert StreamState(*saved["streams"]["chat"]["state"]).epoch >= 1
    later = plan_of(shuffled)
    later.resume_from(saved, steps - 2)
    for step in (steps - 1, steps):
        assert all(torch.equal(later.blend[i]["input_ids"], one.blend[i]["input_ids"])
                   for i in next(later.windows(0, step - 1))[0]), step


def test_plan_mode_says_a_streams_length_is_not_known():
    mixture = Mixture(["web", "text"], [[(1, 0.5)], [(1, 0.5)]], 10)
    lines = "\n".join(plan_lines(mixture, [40, 2**48], ["tokens", "hf_text"], 20))
    assert "text (hf_text, streamed: not known until read): weight 0.5, 5 samples a step" in lines
    assert "an epoch and its wraps: streamed: not known until read" in lines and "web (tokens, 40 samples)" in lines


@pytest.mark.parametrize("change,message", [
    ({"num_workers": 2}, "data.num_workers=2: must be 0 with streaming"),
    ({"val_fraction": 0.1}, "data.val_fraction=0.1: must be 0 with streaming"),
    ({"task": "masked_lm"}, "data.task='masked_lm': streaming gives causal LM samples only"),
    ({"max_steps": None}, "trainer.max_steps=None: must be an integer >= 1"),  # every run's: a stream's too
    ({"_target_": "dist_trainer.data.tokens.token_file"}, "data.streaming=True: streams hf_text's and hf_chat's"),
    ({"blend": True}, "data.sources.text.val_fraction=0.2: must be 0 with streaming"),
])
def test_what_a_stream_cannot_do_is_refused_naming_the_key(corpus, change, message):
    cfg = config(corpus["root"], {})
    cfg.data = {"_target_": "dist_trainer.data.hf_text.hf_text", "files": corpus["small"], "block_size": BLOCK,
                "streaming": True, "task": "causal_lm"}
    if change.pop("blend", False):
        cfg = config(corpus["root"], {"text": text(corpus["small"], streaming=True, val_fraction=0.2)})
    if "max_steps" in change:
        cfg.trainer.max_steps = change.pop("max_steps")
    cfg.data.update(change)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert str(err.value).startswith(message)


def test_ids_beyond_the_models_vocabulary_are_named_as_they_are_read(corpus):
    cfg = config(corpus["root"], {"text": text(corpus["small"], streaming=True)})
    cfg.data["vocab_size"] = 256  # the bytes tokenizer's end-of-text is 256
    plan = plan_of(cfg)
    with pytest.raises(ConfigError, match=r"data\.sources\.text\.files: token id 256 is beyond model\.vocab_size=256"):
        plan.blend[0]


def test_prepare_in_processes_writes_the_one_process_file(corpus, tmp_path):
    """--processes 2: the shards tokenized in 2 processes, the files and meta (timings aside) byte for byte."""
    files = [Path(f) for f in corpus["shards"] + corpus["small"] if not f.endswith(".parquet")]
    one = prepare(files, tmp_path / "one", "bytes", val_fraction=0.2, progress=False)
    three = prepare(files, tmp_path / "three", "bytes", val_fraction=0.2, progress=False, processes=2)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name
    timings = ("seconds", "tokens_per_s")
    assert {k: v for k, v in one.items() if k not in timings} == {k: v for k, v in three.items() if k not in timings}
    assert one["val"]["documents"] > 0


# --------------------------------------------------------------------------- real ranks

def run_sources(root: Path, small: list) -> dict:
    """6 samples a step from a stream whose epoch is a few steps; 4 from the shared notes file."""
    return {"text": text(small, weight=0.6, streaming=True),
            "web": {"kind": "tokens", "path": str(root / "web.bin"), "weight": 0.4}}


def _rank(rank: int, world: int, root: str, small: list, run_dir: str) -> dict:
    distributed.init("cpu")
    train(config(Path(root), run_sources(Path(root), small), micro=1), Path(run_dir) / "two")
    return {}


def _one(rank: int, world: int, root: Path, small: list, run_dir: Path) -> dict:
    distributed.init("cpu")
    train(config(root, run_sources(root, small), micro=5), run_dir / "straight")
    for steps in (3, 8, STEPS):  # resumed mid-epoch (3), then past the stream's first epoch
        train(config(root, run_sources(root, small), micro=5, steps=steps), run_dir / "chain")
    return {}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root, out = corpus["root"], tmp_path_factory.mktemp("runs")
    np.random.default_rng(0).integers(0, 256, size=40 * BLOCK + 1).astype(np.uint16).tofile(root / "web.bin")
    launch_clean(_rank, 2, out, str(root), corpus["small"], str(out))
    in_one_process(_one, root, corpus["small"], out)
    return out


def test_two_ranks_streaming_in_a_blend_match_one_process(runs):
    assert_all_close_scaled(_final(runs / "two"), _final(runs / "straight"), "2 ranks x 1 micro-batch, streamed")
    m1, m2 = _metrics(runs / "straight"), _metrics(runs / "two")
    assert [r["source_tokens.text"] for r in m1] == [r["source_tokens.text"] for r in m2] == [6 * BLOCK] * STEPS
    assert m1[-1]["loss"] < m1[0]["loss"]


def test_resume_mid_epoch_and_past_the_streams_epoch_is_bit_identical(runs, corpus):
    straight, chain = _final(runs / "straight"), _final(runs / "chain")
    m_straight = {r["step"]: r["loss"] for r in _metrics(runs / "straight")}
    assert {r["step"]: r["loss"] for r in _metrics(runs / "chain")} == m_straight
    assert all(torch.equal(chain[name], t) for name, t in straight.items())
    states = {}
    for step in (3, 8):
        ckpt = torch.load(runs / "chain" / "checkpoints" / f"step_{step:08d}" / "shared.pt", weights_only=False)
        saved = ckpt["blend"]["streams"]["text"]
        assert saved["position"] == ckpt["blend"]["taken"]["text"] == 6 * step
        states[step] = StreamState(*saved["state"])  # epoch, shard, document, token offset
    assert states[3].epoch == 0 and states[8].epoch >= 1, states  # the second resume is past the epoch's end
    shutil.rmtree(runs / "chain" / "checkpoints", ignore_errors=True)
