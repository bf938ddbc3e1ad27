"""Hugging Face models (model=hf_causal_lm, model=hf_masked_lm), trained exactly, exported back.

Real transformers models built from tiny configurations (random weights,
nothing downloaded), real gloo ranks:

* the loss the framework computes from the logits equals transformers' own
  (where it is right), token-weighted;
* split invariance: 2 ranks x micro 4 x accum 4 against one process with one
  batch of 32, fp32, SGD, dropout 0, for a causal LM (GPT-2; under ddp and
  fsdp) on variable-length samples and for a masked LM (BERT) on hf_text;
* GPT-2, Llama (fsdp, bf16-master, activation checkpointing) and BERT train
  on 2 ranks through the real loop, and the loss falls; hf_model/ is written at the end and reloads with from_pretrained to
  the same weights and logits, as does ``python -m dist_trainer.export`` of
  the checkpoint (ddp and fsdp);
* bad input is a ConfigError naming the key.

The runs to the end (training, export, the masked LM's resume) are marked
slow: .ci/run runs them after the default suite.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from dist_trainer import distributed  # noqa: E402
from dist_trainer.config import (BatchConfig, Config, ConfigError, DistConfig, OptimConfig,  # noqa: E402
                                 PrecisionConfig, TrainerConfig)
from dist_trainer.validation import validate  # noqa: E402
from dist_trainer.data import epoch_batches  # noqa: E402
from dist_trainer.models.hf import hf_model  # noqa: E402
from dist_trainer.run import build, train  # noqa: E402
from helpers import REPO, SAME_OPS_TOL, assert_all_close_scaled, assert_close_scaled, run_ranks  # noqa: E402

GLOBAL, STEPS = 32, 2
GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64}
BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def corpus(path: Path) -> Path:
    """Real English text (CPython's bundled reference), one paragraph per document."""
    from dist_trainer.data.builtin import reference_text_bytes

    path.write_bytes(reference_text_bytes()[:120_000])
    return path


def causal_model(model_type: str = "gpt2", config: dict = GPT2, **kw) -> dict:
    return {"_target_": "dist_trainer.hf.models.hf_model", "task": "causal_lm", "model_type": model_type,
            "config": dict(config), "block_size": 24, **kw}


def masked_model(tokenizer: str = "bytes") -> dict:
    return {"_target_": "dist_trainer.hf.models.hf_model", "task": "masked_lm", "model_type": "bert",
            "config": dict(BERT), "tokenizer": tokenizer, "block_size": 32}


def hf_text_data(text: Path, cache: Path, task: str, block_size: int = 32) -> dict:
    return {"_target_": "dist_trainer.data.hf_text.hf_text", "files": [str(text)], "tokenizer": "bytes",
            "block_size": block_size, "task": task, "seed": 0, "cache_dir": str(cache), "shuffle": True}


def config(model: dict, data: dict, micro: int, strategy: str = "ddp", steps: int = STEPS,
           optim: OptimConfig | None = None, precision: str = "fp32", ac: bool = False) -> Config:
    return Config(
        model=model, data=data,
        batch=BatchConfig(micro_batch_size=micro, global_batch_size=GLOBAL),
        precision=PrecisionConfig(name=precision),
        optim=optim or OptimConfig(name="sgd", lr=0.5, momentum=0.0, weight_decay=0.0, warmup_steps=0,
                                   schedule="constant", grad_clip=None),
        trainer=TrainerConfig(max_steps=steps, log_every=1, eval_every=0),
        dist=DistConfig(strategy=strategy, activation_checkpointing=ac),
    )


def split_jobs(text: Path, cache: Path) -> dict:
    """name -> (config for micro m and a strategy): variable-length causal samples, and masked LM samples."""
    varlen = {"_target_": "dist_trainer.data.builtin.char_text", "block_size": 24, "min_len": 1, "shuffle": True}
    return {
        "gpt2": lambda micro, strategy: config(causal_model(), varlen, micro, strategy),
        "bert": lambda micro, strategy: config(masked_model(), hf_text_data(text, cache, "masked_lm"), micro,
                                               strategy),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _steps(cfg: Config, world: int) -> dict:
    """Gradients of every step, the parameters after them, the frozen ones before (every rank calls; whole values)."""
    parts = build(cfg, validate(cfg, world), distributed.init("cpu"))
    module, rec = parts.trainer.module, {"grads": [], "items": []}
    # The frozen parameters (a LoRA model's base) as built: training must leave them as they are.
    rec["frozen"] = {name: _full(p) for name, p in module.named_parameters() if not p.requires_grad}
    rec["frozen_digest"], rec["built_on_meta"] = parts.frozen, parts.built_on_meta  # what checkpoints record
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, STEPS + 1), batches):
        outcome = parts.trainer.train_step(micro_batches, window, step)
        assert not outcome.skipped
        rec["items"].append(outcome.items)
        rec.setdefault("comm", []).append(outcome.comm)
        rec["grads"].append({name: _full(p.grad) for name, p in module.named_parameters() if p.requires_grad})
    rec["params"] = {name: _full(p) for name, p in module.named_parameters()}
    del parts
    gc.collect()
    return rec


def _split_worker(rank: int, world: int, text: str, cache: str) -> dict:
    jobs = split_jobs(Path(text), Path(cache))
    return {(name, strategy): _steps(make(4, strategy), world)
            for name, make in jobs.items() for strategy in ("ddp", "fsdp") if (name, strategy) != ("bert", "fsdp")}


_assert_close = assert_all_close_scaled  # every tensor of a set within SCALE_TOL of its scale (helpers.py)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return corpus(tmp_path_factory.mktemp("text") / "corpus.txt")


def test_split_invariance_causal_and_masked_lm(text, tmp_path):
    """2 ranks x micro 4 x accum 4 == 1 process x one batch of 32, every gradient and parameter."""
    cache = tmp_path / "cache"
    ranks = run_ranks(_split_worker, 2, tmp_path, str(text), str(cache))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        refs = {name: _steps(make(GLOBAL, "ddp"), 1) for name, make in split_jobs(text, cache).items()}
    finally:
        dist.destroy_process_group()
    for (name, strategy), rec in ranks[0].items():
        ref = refs[name]
        assert rec["items"] == ref["items"]  # the same tokens counted, whatever the split
        for step in range(STEPS):
            _assert_close(rec["grads"][step], ref["grads"][step], f"{name}/{strategy} step {step + 1} grad")
        _assert_close(rec["params"], ref["params"], f"{name}/{strategy} params")
        _assert_close(ranks[1][(name, strategy)]["params"], rec["params"], f"{name}/{strategy} rank 1")
    # Token weighting is what is tested: the causal samples' valid lengths vary, the masked ones too.
    assert len(set(refs["gpt2"]["items"])) == STEPS and refs["bert"]["items"][0] < GLOBAL * 32 * 0.3


def test_the_loss_is_transformers_own_where_that_is_right():
    """Summed over the shifted labels: equal to transformers' mean times the number of counted tokens."""
    torch.manual_seed(0)
    model = hf_model("causal_lm", "gpt2", dict(GPT2), block_size=24)
    ids = torch.randint(0, 256, (3, 24))
    labels = ids.masked_fill(torch.rand(3, 24) < 0.3, -100)
    ours = model({"input_ids": ids, "labels": labels})
    theirs = model.model(input_ids=ids, labels=labels).loss
    assert ours["num_items"].item() == (labels[:, 1:] != -100).sum().item()  # the first label predicts nothing
    assert_close_scaled(ours["loss_sum"] / ours["num_items"], theirs, "our loss vs transformers' own", SAME_OPS_TOL)
    # "targets" (already the next tokens, as data=tokens gives them) are not shifted again.
    same = model({"input_ids": ids[:, :-1], "targets": labels[:, 1:]})
    assert same["num_items"] == ours["num_items"]


def test_bad_input_names_the_key(tmp_path):
    cases = [
        (lambda: hf_model("causal_lm", "no-such-type", {}), "model.model_type=no-such-type"),
        (lambda: hf_model("causal_lm", None, {}), "model.model_type is not set"),
        (lambda: hf_model("seq2seq", "gpt2", {}), "model.task='seq2seq'"),
        (lambda: hf_model("causal_lm", "gpt2", dict(GPT2), block_size=64), "data.block_size=64"),
        (lambda: hf_model("causal_lm", pretrained=str(tmp_path / "missing")), "model.pretrained="),
        (lambda: hf_model("causal_lm", "gpt2", dict(GPT2), tokenizer="bytes"), "model.config.vocab_size=256"),
        (lambda: hf_model("causal_lm", "gpt2", {"no_such_argument_for_sure": 1, **GPT2}, block_size=8), None),
    ]
    for make, key in cases[:-1]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
            make()
    cases[-1][0]()  # transformers keeps unknown arguments as attributes: no error, like from_config


def test_pretrained_directory_loads_its_weights(tmp_path):
    torch.manual_seed(1)
    first = hf_model("causal_lm", "llama", {**LLAMA, "vocab_size": 256}, block_size=24)
    first.model.save_pretrained(tmp_path / "saved")
    again = hf_model("causal_lm", pretrained=str(tmp_path / "saved"), block_size=24)
    assert type(again.model).__name__ == "LlamaForCausalLM" and again._no_split_modules == ["LlamaDecoderLayer"]
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- the real loop, and export

def _train_worker(rank: int, world: int, text: str, root: str) -> dict:
    root, text = Path(root), Path(text)
    adamw = OptimConfig(name="adamw", lr=3e-3, weight_decay=0.0, warmup_steps=2, schedule="constant", grad_clip=1.0)
    runs = {
        "gpt2": config(causal_model(config={**GPT2, "vocab_size": 259}, tokenizer="bytes", block_size=32),
                       hf_text_data(text, root / "cache", "causal_lm"), 8, steps=12, optim=adamw),
        "llama-fsdp": config(causal_model("llama", LLAMA, tokenizer="bytes", block_size=32),
                             hf_text_data(text, root / "cache", "causal_lm"), 8, "fsdp", steps=12, optim=adamw,
                             precision="bf16-master", ac=True),
        "bert": config(masked_model(), hf_text_data(text, root / "cache", "masked_lm"), 8, steps=12,
                       optim=OptimConfig(**{**vars(adamw), "lr": 1e-2})),
        "llama-pp": config(causal_model("llama", LLAMA, tokenizer="bytes", block_size=32),
                           hf_text_data(text, root / "cache", "causal_lm"), 8, steps=12, optim=adamw),
    }
    runs["llama-pp"].dist.pp.size = 2  # its two decoder layers in two pipeline stages, one a rank
    for name, cfg in runs.items():
        cfg.trainer.ckpt_every = 12
        train(cfg, root / name)
        gc.collect()
    return {}


@pytest.fixture(scope="module")
def trained(text, tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    run_ranks(_train_worker, 2, root, str(text), str(root))
    return root


@pytest.mark.slow  # four 2-rank runs to the end: about 50 s
@pytest.mark.parametrize("name", ["gpt2", "llama-fsdp", "bert", "llama-pp"])
def test_models_train_on_two_ranks_and_export_to_hugging_face(trained, name, tmp_path):
    import transformers

    run_dir = trained / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last < first - 0.5, (first, last)  # bytes start near ln(259) = 5.56

    auto = transformers.AutoModelForMaskedLM if name == "bert" else transformers.AutoModelForCausalLM
    exported = auto.from_pretrained(run_dir / "hf_model")
    final = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert {f"model.{k}" for k in exported.state_dict()} <= set(final)
    for key, value in exported.state_dict().items():
        assert torch.equal(value, final[f"model.{key}"]), key
    tokenizer = transformers.AutoTokenizer.from_pretrained(run_dir / "hf_model")
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    assert ids.tolist()[0][:3] == list(b"The")  # the bytes tokenizer came along

    # The same model as the framework holds it: equal logits.
    cfg = {k: v for k, v in (masked_model() if name == "bert" else causal_model(
        "llama" if name.startswith("llama") else "gpt2", LLAMA if name.startswith("llama") else {**GPT2, "vocab_size": 259},
        tokenizer="bytes", block_size=32)).items() if k != "_target_"}
    ours = hf_model(**cfg)
    ours.load_state_dict(final)
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=ids).logits, ours.eval().model(input_ids=ids).logits,
                                   rtol=0, atol=0)

    # python -m dist_trainer.export of the checkpoint (sharded under fsdp) gives the same weights.
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "dist_trainer.export", str(run_dir), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO),
                                                                             "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = auto.from_pretrained(out)
    for key, value in exported.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


# --------------------------------------------------------------------------- exact resume of a masked LM

@pytest.mark.slow  # four torchrun jobs: about 45 s
def test_masked_lm_resumes_mid_epoch_bit_identically(text, tmp_path):
    """2 ranks under torchrun: 3 steps, then resumed to 6, equals 6 uninterrupted steps bit for bit
    (the masks are a function of (seed, epoch, index), dropout draws from the checkpointed RNG)."""
    from test_checkpoint import assert_bit_identical, assert_same_metrics, resumed_from, run, run_all

    config_arg = "+model.config={" + ",".join(f"{k}:{v}" for k, v in {**BERT, "hidden_dropout_prob": 0.1}.items()) + "}"
    args = ["model=hf_masked_lm", "model.model_type=bert", config_arg, "data=hf_text", f"data.files=[{text}]",
            "data.block_size=32", f"data.cache_dir={tmp_path / 'cache'}", "batch.micro_batch_size=8",
            "batch.global_batch_size=32", "optim.warmup_steps=4", "optim.schedule=constant", "trainer.eval_every=0",
            "trainer.log_every=1", "trainer.ckpt_every=3", "trainer.device=cpu"]
    first = run(args + ["trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'warm'}"], tmp_path)  # writes the cache
    assert first.returncode == 0, first.output[-3000:]
    ref, half = run_all([(args + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'ref'}"], 2),
                         (args + ["trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'half'}"], 2)], tmp_path)
    assert ref.returncode == 0 and half.returncode == 0, ref.output[-3000:] + half.output[-3000:]
    steps_per_epoch = int(re.search(r"(\d+) optimizer steps per epoch", ref.output).group(1))
    assert 6 < steps_per_epoch  # the stop at 3 and the resume are mid-epoch
    resumed = run(args + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'half'}"], tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed_from(resumed.output).endswith("step_00000003")
    assert_same_metrics(tmp_path / "half", tmp_path / "ref", 6)
    assert_bit_identical(tmp_path / "half", tmp_path / "ref")
