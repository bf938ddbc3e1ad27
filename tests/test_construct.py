"""Construction on the meta device (dist_trainer.models.construct): no rank builds the whole model, and the
initial weights equal one process's from the same seed, bit for bit, on every mesh.

* one process: the built-in GPT, a llama and a qwen2 (head tied) recorded on meta and replayed equal the
  model built whole (every parameter and buffer), the generator ends in the same state, and the replay
  holds far less than the whole model at once;
* 2 ranks (fsdp, tp 2, pp 2) and 4 ranks (tp 2 x fsdp 2): the sharded model, gathered, equals the
  one-process model bit for bit, and each rank allocated only its shards;
* a constructor that reads values is built whole, with a warning naming the memory it costs.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback

import pytest
import torch
from hydra.utils import instantiate

from dist_trainer import distributed
from dist_trainer.validation import validate
from dist_trainer.models import GPT
from dist_trainer.models.construct import NotRecordable, build, materialise, record
from dist_trainer.run import build as build_parts
from test_accumulation import in_one_process, launch_clean
from test_hsdp import _gpt
from test_tp import _llama, _qwen2, _tp

GPT_ARGS = dict(vocab_size=261, n_layer=2, n_embd=64, n_head=4, block_size=32)


def _llama_cfg(model_type: str):
    import transformers

    return transformers.AutoConfig.for_model(model_type, vocab_size=261, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, tie_word_embeddings=model_type == "qwen2")


def _hf(model_type: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(_llama_cfg(model_type), dtype=torch.float32,
                                                         attn_implementation="sdpa")


def _tensors(model):
    return {**dict(model.named_buffers()), **model.state_dict()}


@pytest.mark.parametrize("make", [lambda: GPT(**GPT_ARGS), lambda: _hf("llama"), lambda: _hf("qwen2")],
                         ids=["gpt", "llama", "qwen2"])
def test_replay_equals_the_model_built_whole_and_holds_little(make):
    torch.manual_seed(3)
    whole = make()
    after_whole = torch.random.get_rng_state()
    torch.manual_seed(3)
    model, trace = record(make)
    assert all(t.device.type == "meta" for t in model.parameters())
    peak = materialise(model, trace, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), after_whole)  # the generator ends where one process leaves it
    got, ref = _tensors(model), _tensors(whole)
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    size = sum(p.numel() * 4 for p in whole.parameters())
    assert peak < 0.2 * size, f"the replay held {peak} bytes at once of a {size}-byte model"
    # ties survive (the GPT's head is its embedding; qwen2's lm_head its embed_tokens)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.tok_emb
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.head
    if isinstance(model, GPT) or model.config.tie_word_embeddings:
        assert head.weight is emb.weight


class ReadsValues(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.scale = float(self.w.detach().abs().max())  # a value: cannot be recorded on meta


def test_a_constructor_that_reads_values_is_built_whole_with_a_warning():
    with pytest.raises(NotRecordable, match="value"):
        record(ReadsValues)
    said = []
    torch.manual_seed(0)
    model, materialise_fn = build(ReadsValues, True, torch.device("cpu"), said.append)
    torch.manual_seed(0)
    assert materialise_fn is None and torch.equal(model.w, ReadsValues().w)
    assert "built whole on every rank" in said[0] and "MiB" in said[0]


# ----------------------------------------------------------------------------- on real ranks

def _worker(rank: int, world_size: int, jobs: list) -> dict:
    env = distributed.init("cpu")
    out = {}
    for name, cfg in jobs:
        try:
            parts = build_parts(cfg, validate(cfg, world_size), env)
            strategy = parts.trainer.strategy
            local = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel()
                        for t in {id(p): p for p in strategy.module.parameters()}.values())
            out[name] = {"state": strategy.full_state_dict(), "meta": parts.built_on_meta, "local": local}
            del parts, strategy
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        gc.collect()
    return out


def _fsdp(cfg):
    cfg.dist = dataclasses.replace(cfg.dist, strategy="fsdp")
    return cfg


def _pp(cfg):
    cfg.dist = dataclasses.replace(cfg.dist, strategy="fsdp")
    cfg.dist.pp = dataclasses.replace(cfg.dist.pp, size=2)
    cfg.dist.fsdp = dataclasses.replace(cfg.dist.fsdp, reshard="forward")
    return cfg


MODELS = {"gpt": _gpt, "llama": _llama, "qwen2": _qwen2}
JOBS2 = [("gpt/fsdp", _fsdp(_gpt(8))), ("gpt/tp", _tp(_gpt(8))), ("gpt/pp", _pp(_gpt(8))),
         ("llama/fsdp", _fsdp(_llama(8))), ("llama/tp", _tp(_llama(8))), ("llama/pp", _pp(_llama(8))),
         ("qwen2/fsdp", _fsdp(_qwen2(8))), ("qwen2/tp", _tp(_qwen2(8))), ("qwen2/pp", _pp(_qwen2(8)))]
JOBS4 = [("gpt/tp2xfsdp2", _tp(_gpt(4), strategy="fsdp")), ("llama/tp2xfsdp2", _tp(_llama(4), strategy="fsdp"))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A qwen2 (tied head) saved in 3 files with an index, a llama (untied) in one file."""
    root = tmp_path_factory.mktemp("saved")
    return {"qwen2": _saved(root / "qwen2", "qwen2", shards=True), "llama": _saved(root / "llama", "llama", False),
            "bytes": _saved(root / "bytes", "llama", False, vocab=259)}  # the bytes tokenizer's ids, untied


def _pretrained_jobs(saved: dict) -> list:
    return [("pretrained-qwen2/fsdp", _fsdp(_pretrained_cfg(_qwen2, saved["qwen2"]))),
            ("pretrained-qwen2/tp", _tp(_pretrained_cfg(_qwen2, saved["qwen2"]))),
            ("pretrained-llama/pp", _pp(_pretrained_cfg(_llama, saved["llama"]))),
            ("pretrained-llama/tp", _tp(_pretrained_cfg(_llama, saved["llama"]))),
            ("chat/fsdp", _fsdp(_chat_cfg(saved["bytes"]))), ("chat/tp", _tp(_chat_cfg(saved["bytes"])))]


def _chat_cfg(directory: str):
    """A base of the bytes tokenizer's 259 ids, fine-tuned on chats: the template's two markers get rows."""
    cfg = _pretrained_cfg(_llama, directory, tokenizer="bytes")
    cfg.model["chat_template"] = "auto"
    return cfg


@pytest.fixture(scope="module")
def whole(saved):
    """One process (ddp on a world of one): every model built whole, as before (pretrained: from_pretrained)."""
    return in_one_process(_worker, [(name, make(8)) for name, make in MODELS.items()] +
                          [(f"pretrained-{name}", _pretrained_cfg(MODELS[name], saved[name]))
                           for name in ("qwen2", "llama")] + [("chat", _chat_cfg(saved["bytes"]))])


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory, saved):
    return launch_clean(_worker, 2, tmp_path_factory.mktemp("construct2"), JOBS2 + _pretrained_jobs(saved))


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return launch_clean(_worker, 4, tmp_path_factory.mktemp("construct4"), JOBS4)


def _check(results: list, whole: dict, job: str) -> None:
    for rank, result in enumerate(results):
        assert "error" not in result[job], result[job].get("error")
        assert result[job]["meta"], f"{job}: rank {rank} built the model whole"
    ref, got = whole[job.split("/")[0]], results[0][job]["state"]
    assert not ref["meta"]
    assert got.keys() == ref["state"].keys()
    for name, tensor in ref["state"].items():
        assert torch.equal(got[name], tensor), f"{job}: {name} differs from one process's"
    # every rank allocated a part of the model, not the whole (a pipeline stage: its blocks)
    total = sum(t.numel() for t in {id(t): t for t in ref["state"].values()}.values())
    for rank, result in enumerate(results):
        assert result[job]["local"] < 0.8 * total, f"{job}: rank {rank} holds {result[job]['local']} of {total}"


@pytest.mark.parametrize("job", [job for job, _ in JOBS2])
def test_meta_construction_on_2_ranks_is_bit_identical_to_one_process(ranks2, whole, job):
    _check(ranks2, whole, job)


@pytest.mark.parametrize("job", ["pretrained-qwen2/fsdp", "pretrained-qwen2/tp", "pretrained-llama/pp",
                                 "pretrained-llama/tp"])
def test_pretrained_slices_on_2_ranks_equal_from_pretrained_in_one_process(ranks2, whole, job):
    _check(ranks2, whole, job)


@pytest.mark.slow  # the 4-rank launch: .ci/run runs it with the slow set
@pytest.mark.parametrize("job", [job for job, _ in JOBS4])
def test_meta_construction_under_tp2_by_fsdp2_is_bit_identical_to_one_process(ranks4, whole, job):
    _check(ranks4, whole, job)


# ----------------------------------------------------------------------------- pretrained files, slice by slice

def _saved(directory, model_type: str, shards: bool, vocab: int = 260):
    """A tiny model saved by transformers (sharded into several files with an index where ``shards``)."""
    import transformers

    from test_hf_models import LLAMA

    directory.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(model_type, **LLAMA, vocab_size=vocab,
                                               tie_word_embeddings=model_type == "qwen2")
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, max_shard_size="40KB" if shards else "1GB")
    return str(directory)


def _pretrained_cfg(make, directory: str, tokenizer=None):
    cfg = make(8)
    cfg.model = {**cfg.model, "model_type": None, "config": {}, "pretrained": directory}
    if tokenizer:
        cfg.model["tokenizer"] = tokenizer
    return cfg


@pytest.mark.parametrize("job", ["chat/fsdp", "chat/tp"])
def test_rows_a_chat_template_adds_get_the_mean_of_the_pretrained_rows(ranks2, whole, job):
    """The base has 259 rows; the template's markers make 261 (cut 131 and 130 under tp 2). The file's rows
    load exactly; each new row, of the embedding and of the untied head, is their mean, as transformers'
    resize gives it up to its random spread of 1e-9 of the rows' covariance."""
    got, ref = ranks2[0][job]["state"], whole["chat"]["state"]
    assert "error" not in ranks2[0][job] and ranks2[0][job]["meta"]
    for name in ("model.model.embed_tokens.weight", "model.lm_head.weight"):
        assert got[name].shape[0] == ref[name].shape[0] == 261
        assert torch.equal(got[name][:259], ref[name][:259]), name
        mean = got[name][:259].mean(0)
        assert torch.equal(got[name][259], mean) and torch.equal(got[name][260], mean), name
        assert (got[name][259:] - ref[name][259:]).abs().max() <= 1e-3 * mean.abs().max(), name
