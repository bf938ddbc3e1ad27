"""LoRA adapters (model.lora, peft) on hf_causal_lm: exact under accumulation, the base untouched.

The adapters are the only trained parameters; ddp and fsdp (frozen and trained
parameters in one unit), padded and packed conversations, activation
checkpointing; checkpoints hold the adapters alone and the base's digest;
``hf_adapter/`` and the merged ``hf_model/`` give the framework's logits.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_trainer import distributed
from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.models.hf import hf_model
from dist_trainer.plan import plan_numbers
from dist_trainer.run import build
from helpers import assert_close_scaled, run_ranks
from test_checkpoint import metrics, run
from test_hf_chat import chat_data, chat_model, conversations, write_jsonl
from test_hf_models import LLAMA, STEPS, _assert_close, _steps, config

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": None}


def lora_model(**lora) -> dict:
    return {**chat_model(), "lora": {**LORA, **lora}}


def _jobs(files: list, cache: Path) -> dict:
    def job(packing: bool, strategy: str, ac: bool):
        data = chat_data(files, cache, packing=packing, block_size=256 if packing else 128)
        # packed: the head tied to the embedding, which under fsdp is then the root's one parameter, gathered
        # only where it is read (fsdp.FrozenRoot)
        model = {**chat_model(cfg={**LLAMA, "tie_word_embeddings": True}), "lora": LORA} if packing else lora_model()
        return lambda micro: config(model, data, micro, strategy, ac=ac)
    return {("packed" if packing else "padded", strategy, ac): job(packing, strategy, ac)
            for packing, strategy, ac in [(False, "ddp", False), (True, "ddp", False), (False, "fsdp", True),
                                          (True, "fsdp", False)]}


def _split_worker(rank: int, world: int, files: list, cache: str) -> dict:
    return {key: _steps(make(4), world) for key, make in _jobs(files, Path(cache)).items()}


def test_lora_split_invariance_under_ddp_and_fsdp_and_the_base_stays_bit_identical(tmp_path):
    """2 ranks x micro 4 x accum 4 == 1 process x 32 samples for the adapters; the base never moves."""
    files = [str(write_jsonl(tmp_path / "chats.jsonl", conversations(160, seed=3)))]
    cache = tmp_path / "cache"
    ranks = run_ranks(_split_worker, 2, tmp_path, files, str(cache))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        jobs = _jobs(files, cache)
        refs = {kind: _steps(jobs[(kind, "ddp", False)](32), 1) for kind in ("padded", "packed")}
    finally:
        dist.destroy_process_group()
    for (kind, strategy, ac), rec in ranks[0].items():
        ref, what = refs[kind], f"{kind}/{strategy}{' +ac' if ac else ''}"
        trained = list(rec["grads"][0])
        assert trained and all("lora_" in n for n in trained)  # only the adapters train
        assert len(rec["frozen"]) > len(trained)  # the base's weights are frozen
        assert rec["items"] == ref["items"]
        for step in range(STEPS):
            _assert_close(rec["grads"][step], ref["grads"][step], f"{what} step {step + 1} grad")
        _assert_close(rec["params"], ref["params"], f"{what} params")
        _assert_close(ranks[1][(kind, strategy, ac)]["params"], rec["params"], f"{what} rank 1")
        assert all(torch.equal(rec["params"][n], rec["frozen"][n]) for n in rec["frozen"]), what  # not moved
        assert all(torch.equal(rec["frozen"][n], ref["frozen"][n]) for n in ref["frozen"]), what  # the same base
        # fsdp builds the base on the meta device, each rank its shards, and takes its digest from them: the
        # digest a whole copy gives, so checkpoints written either way resume either way
        assert rec["built_on_meta"] == (strategy == "fsdp"), what
        assert rec["frozen_digest"] == ref["frozen_digest"] and len(ref["frozen_digest"]) == 64, what
        if strategy == "fsdp":
            # Each frozen layer of the base is an FSDP unit of its own (dp_plan.unit_modules): plan mode's
            # collectives are the run's, and there are more of them than a unit per block and the root gives.
            cfg = jobs[(kind, strategy, ac)](4)
            step = plan_numbers(cfg, validate(cfg, 2))["step"]
            # 2 layers of 7 frozen linear units and the block's own, the final norm's unit and the root, each
            # gathered in the forward and the backward of 4 micro-batches: 144. packed (the head tied): the first
            # layer's query, key and value bases carry no gradient (no backward gathers them: 12 fewer), and
            # the root, the embedding alone, is gathered again for the head (4 more). padded: activation
            # checkpointing's recomputation gathers every unit of a block in the backward.
            assert step["all_gathers"] == (136 if kind == "packed" else 144), (what, step)
            for number, comm in enumerate(rec["comm"][1:], 2):
                assert {k: comm.get(k, 0) for k in step} == step, (what, number)


def test_bf16_master_stores_the_base_in_bf16_and_trains_fp32_masters_of_the_adapters(tmp_path):
    files = [str(write_jsonl(tmp_path / "chats.jsonl", conversations(40, seed=4)))]
    cfg = config(lora_model(), chat_data(files, tmp_path / "cache"), 8, precision="bf16-master")
    cfg.batch.global_batch_size = 16
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts = build(cfg, validate(cfg, 1), distributed.init("cpu"))
        module, weights = parts.trainer.module, parts.trainer.weights
        base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
        assert {p.dtype for n, p in module.named_parameters()} == {torch.bfloat16}
        assert weights.masters and all(m.dtype == torch.float32 for m in weights.masters)
        assert len(weights.masters) == sum(p.requires_grad for p in module.parameters())
        masters = [m.clone() for m in weights.masters]
        for step, (window, batches) in zip((1, 2), epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)):
            assert not parts.trainer.train_step(batches, window, step).skipped
        assert all(not torch.equal(a, b) for a, b in zip(masters, weights.masters))  # the adapters moved
        assert all(torch.equal(p, base[n]) for n, p in module.named_parameters() if not p.requires_grad)
        del parts, module, weights  # the DDP object before destroy_process_group(), or its exit can hang
    finally:
        dist.destroy_process_group()


def test_lora_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['nope'\] \(modules_to_save=None\): .*linear layers are named .*q_proj"):
        hf_model("causal_lm", "llama", dict(LLAMA), lora={**LORA, "target_modules": ["nope"]})
    with pytest.raises(ConfigError, match=r"model.lora.r=-1: the adapters' rank"):
        hf_model("causal_lm", "llama", dict(LLAMA), lora={**LORA, "r": -1})
    with pytest.raises(ConfigError, match=r"model.lora: LoRA adapters are for model=hf_causal_lm"):
        hf_model("masked_lm", "bert", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                       "intermediate_size": 64}, lora=LORA)
    full = hf_model("causal_lm", "llama", dict(LLAMA), lora={**LORA, "r": None})
    assert all(p.requires_grad for p in full.parameters())  # r null: full fine-tuning


# ------------------------------------------------------------------------ a real run, resumed

MODEL_ARGS = ["model=hf_causal_lm", "model.model_type=llama", "model.pretrained=null",
              "+model.config={hidden_size:32,num_hidden_layers:2,num_attention_heads:4,num_key_value_heads:2,"
              "intermediate_size:64}", "model.lora.r=4", "model.lora.alpha=8"]


def _args(chats: Path, cache: Path, run_dir: Path, steps: int) -> list:
    return MODEL_ARGS + [
        "data=hf_chat", f"data.files=[{chats}]", "data.packing=true", "data.block_size=256", "data.val_fraction=0.1",
        f"data.cache_dir={cache}", "batch.micro_batch_size=2", "batch.global_batch_size=8", "optim.schedule=constant",
        "optim.warmup_steps=0", f"trainer.max_steps={steps}", "trainer.ckpt_every=2", "trainer.eval_every=3",
        "trainer.eval_batches=2", "trainer.log_every=1", "trainer.device=cpu", "dist.strategy=fsdp",
        f"hydra.run.dir={run_dir}"]


@pytest.mark.slow  # four 2-rank torchrun jobs and two exports: about 70 s
def test_a_lora_run_resumes_bit_identically_and_exports_adapters_and_a_merged_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    chats, cache = write_jsonl(tmp_path / "chats.jsonl", conversations(120, seed=5)), tmp_path / "cache"
    whole, split = tmp_path / "whole", tmp_path / "split"
    ref = run(_args(chats, cache, whole, 9), tmp_path, nproc=2)
    assert ref.returncode == 0, ref.output[-4000:]
    first = run(_args(chats, cache, split, 5), tmp_path, nproc=2)  # the first 5 steps (constant lr: the same)
    assert first.returncode == 0, first.output[-4000:]
    shutil.rmtree(split / "checkpoints" / "step_00000005")  # as if killed in step 5: resume from 4
    second = run(_args(chats, cache, split, 9), tmp_path, nproc=2)
    assert second.returncode == 0, second.output[-4000:]
    assert "resuming from" in second.output and "(step 4)" in second.output
    epochs = [r["epoch"] for r in metrics(whole)]
    assert epochs[3] == epochs[4] and len(set(epochs)) >= 2  # step 4 is mid-epoch; the run crosses an epoch
    got, want = (torch.load(d / "final_model.pt", weights_only=True) for d in (split, whole))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [r["loss"] for r in metrics(split)] == [r["loss"] for r in metrics(whole)]

    # The checkpoint holds the adapters (and their optimizer state) only, and the base's digest.
    from dist_trainer.checkpoint import shard_tensor_shapes

    ckpt = whole / "checkpoints" / "step_00000009"  # the last step is always saved
    keys = [k for k in shard_tensor_shapes(ckpt / "shards") if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys)
    shared = torch.load(ckpt / "shared.pt", weights_only=False)
    assert len(shared["frozen"]) == 64

    # hf_adapter/ on the base, and the merged hf_model/, give the framework's logits.
    from hydra.utils import instantiate

    module = instantiate(shared["model_config"], _convert_="all")
    module.load_state_dict(want)
    batch = {"input_ids": torch.randint(0, 250, (2, 40))}
    with torch.no_grad():
        logits = module.model(**batch).logits
        base = module.model.get_base_model()
        base_copy = AutoModelForCausalLM.from_config(base.config)
        base_copy.load_state_dict({k.replace("base_layer.", ""): v for k, v in
                                   base.state_dict().items() if "lora_" not in k})
        adapted = PeftModel.from_pretrained(base_copy, whole / "hf_adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(whole / "hf_model").eval()
        assert_close_scaled(adapted(**batch).logits, logits, "hf_adapter on the base")
        assert_close_scaled(merged(**batch).logits, logits, "merged hf_model")
    assert json.loads((whole / "hf_adapter" / "adapter_config.json").read_text())["r"] == 4

    # The export command writes the same from the checkpoint; a different base is refused.
    from dist_trainer.hf.export import export

    # A run directory stands for its newest checkpoint (step 9; 6 and 8 are kept too).
    assert export(whole, tmp_path / "exported", tmp_path / "exported-adapter") == ckpt
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        assert_close_scaled(again(**batch).logits, logits, "exported from the checkpoint")
    other = run(_args(chats, cache, whole, 12) + ["trainer.seed=1"], tmp_path, nproc=2)  # another random base
    assert other.returncode != 0 and "trained on other frozen weights" in other.output, other.output[-3000:]


def test_an_adapter_loads_on_its_own_base_from_disk_as_readme_shows(tmp_path):
    """A base pretrained with the bytes tokenizer (259 ids), fine-tuned with LoRA on chats whose template adds
    two markers: docs/huggingface.md's lines (the tokenizer from hf_adapter/, the base from its own directory, one
    resize) give the run's logits, whatever values the resize put in the new rows."""
    from hydra.utils import instantiate
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dist_trainer.hf.export import save_pretrained

    torch.manual_seed(0)
    base_dir, run_dir = tmp_path / "base", tmp_path / "run"
    pretrained = hf_model("causal_lm", "llama", dict(LLAMA), tokenizer="bytes")  # untied head: rows of its own
    save_pretrained(pretrained, pretrained.state_dict(), base_dir)  # what a pretraining run leaves in hf_model/
    chats = write_jsonl(tmp_path / "chats.jsonl", conversations(48, seed=6))
    proc = run(["model=hf_causal_lm", f"model.pretrained={base_dir}", "model.lora.r=4", "model.lora.alpha=8",
                "data=hf_chat", f"data.files=[{chats}]", f"data.tokenizer={base_dir}", "data.packing=true",
                "data.block_size=256", f"data.cache_dir={tmp_path / 'cache'}", "batch.micro_batch_size=2",
                "batch.global_batch_size=8", "optim.lr=1e-2", "optim.warmup_steps=0", "trainer.max_steps=3",
                "trainer.eval_every=0", "trainer.device=cpu", "dist.strategy=fsdp", f"hydra.run.dir={run_dir}"],
               tmp_path, nproc=2)
    assert proc.returncode == 0, proc.output[-4000:]

    # The run's own model: rebuilt from its checkpoint's configuration, with its final weights.
    shared = torch.load(run_dir / "checkpoints" / "step_00000003" / "shared.pt", weights_only=False)
    module = instantiate(shared["model_config"], _convert_="all")
    module.load_state_dict(torch.load(run_dir / "final_model.pt", weights_only=True))
    tuned = module.model.get_base_model()
    assert tuned.config.vocab_size == 261 and not tuned.config.tie_word_embeddings

    # docs/huggingface.md's lines, verbatim but for the paths.
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf_adapter")
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    base.resize_token_embeddings(len(tokenizer))
    assert len(tokenizer) == 261 and tokenizer.chat_template  # the markers, and the template that renders them
    with torch.no_grad():  # whatever the resize sampled there: the adapter carries the trained rows
        for weight in (base.get_input_embeddings().weight, base.get_output_embeddings().weight):
            weight[259:] = torch.randn_like(weight[259:])
    model = PeftModel.from_pretrained(base, run_dir / "hf_adapter").eval()

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"},
                                         {"role": "assistant", "content": "5."}], return_dict=True,
                                        return_tensors="pt")["input_ids"]
    assert {259, 260} <= set(ids[0].tolist())
    with torch.no_grad():
        want = module.eval().model(input_ids=ids).logits
        assert_close_scaled(model(input_ids=ids).logits, want, "adapter on its base from disk vs the run")
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model").eval()
        assert_close_scaled(merged(input_ids=ids).logits, want, "merged hf_model vs the run")
    # The new rows trained, in the input embedding and in the head (how the model predicts an end of turn):
    # the resize started them at the mean of the others.
    for name in ("get_input_embeddings", "get_output_embeddings"):
        mean = getattr(pretrained.model, name)().weight.detach().mean(0)
        moved = (getattr(merged, name)().weight[259:].detach() - mean).abs().max().item()
        assert moved > 1e-3, (name, moved)


def test_tokens_a_template_adds_to_a_pretrained_vocabulary_train_under_lora(tmp_path):
    from dist_trainer.hf.export import save_pretrained

    torch.manual_seed(0)
    base = hf_model("causal_lm", "llama", dict(LLAMA), tokenizer="bytes")  # 259 ids: no chat markers
    save_pretrained(base, base.state_dict(), tmp_path / "base")
    tuned = hf_model("causal_lm", pretrained=str(tmp_path / "base"), tokenizer=str(tmp_path / "base"),
                     chat_template="default", lora=LORA)
    assert tuned.model.get_base_model().config.vocab_size == 261
    trained = {n for n, p in tuned.named_parameters() if p.requires_grad}
    assert any("trainable_tokens" in n for n in trained) and any("lora_" in n for n in trained)
    head = hf_model("causal_lm", pretrained=str(tmp_path / "base"), tokenizer=str(tmp_path / "base"),
                    chat_template="default", lora={**LORA, "modules_to_save": ["lm_head"]})
    assert any("lm_head" in n for n, p in head.named_parameters() if p.requires_grad)
