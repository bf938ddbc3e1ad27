"""``model.loss.chunked`` for Hugging Face causal LMs: the decoder body to its final norm, then the head and the
cross-entropy chunk by chunk (``models/loss.py``), against HFModel's plain loss from the whole logits.

One process, tiny llama and qwen2 (hidden 32, 2 layers, 4 heads, 2 kv heads, a 1000-token vocabulary) on 3 x 24
right-padded ids (attention-mask zeros ending two rows; the labels are the ids shifted, the padding ignored: 43
tokens count), chunks of 7 and 17 tokens (neither divides 72) and one larger than the batch:

* fp32 (torch's ``F.linear_cross_entropy``): the loss within SAME_OPS_TOL of the plain one (measured at most
  1.0e-7: the same token losses summed chunk by chunk), the token count exactly, every gradient within SCALE_TOL
  of its scale (measured at most 6.2e-7 for llama, 4.4e-7 for qwen2: torch's kernel computes the softmax's
  gradient with other operations than the plain path's, as test_chunked_loss.py explains).
* bf16 autocast (the project's own chunks): the loss within SCALE_TOL (measured 1.0e-7), every gradient within
  bf16's rounding of the plain path's (3e-2 of its scale, test_chunked_loss.py's HALF_TOL; measured 4.0e-3).
* memory (``activations.saved_bytes``, 4 x 64 tokens, 1.0 MB of float32 logits): the plain forward keeps their
  log-softmax for backward, the chunked one none of them (in fp32 it keeps the head's input and weight
  gradients instead); measured 2.82 against 1.78 MB in fp32, 2.81 against 1.75 MB under bf16 autocast (eager
  attention on both paths).

Two gloo ranks: a tiny llama on right-padded ids of uneven lengths (22 tokens a row: padded to cp's unit 4 under
cp 2), 3 AdamW steps with chunks of 20 tokens (divides neither a ddp micro-batch's 88 tokens nor a cp rank's 48)
under ddp, cp 2 (the targets shifted before the cut, the chunks on the rank's cut ones), pp 2 (the last stage
computes the summed loss in chunks) and tp 2 (the chunks on the ranks' vocabulary slices), against one process
with the plain loss on one batch of 32: every step's items exactly, loss and gradient norm, the gradients of
step 1 and the weights after step 3 within SCALE_TOL of their scale (measured at most 5.0e-7 and 3.9e-6).

Refused (a ConfigError naming model.loss.chunked): heads that are more than a bias-free linear map of the final
norm's output, when the model is built (gemma2's soft-capping, cohere's logit_scale, granite's logits_scaling
other than 1, phi's head bias, a LoRA model's head trained whole); a masked LM when the configuration is validated.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import Dataset

from dist_trainer.activations import saved_bytes
from dist_trainer.config import ConfigError, CPConfig, PPConfig, TPConfig
from dist_trainer.validation import validate
from dist_trainer.data.builtin import char_text
from dist_trainer.models.hf import hf_model
from helpers import SAME_OPS_TOL, SCALE_TOL, assert_all_close_scaled
from test_accumulation import GLOBAL, STEPS, _token_length, gpt_config, in_one_process, launch_clean
from test_chunked_loss import _worker  # each step recorded, the chunks checked as configured

# Grouped keys and values (4 query heads, 2 kv heads), rotary positions.
HF = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "intermediate_size": 64, "vocab_size": 1000, "max_position_embeddings": 64}
BF16_TOL = 3e-2  # bf16's rounding of a gradient, relative to its scale (test_chunked_loss.py's HALF_TOL)


# ------------------------------------------------------------------------------------------ one process

def _batch(rows: int = 3, length: int = 24) -> dict:
    """Right-padded ids (no targets: the model shifts the ids into labels, the padding ignored)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, HF["vocab_size"], (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, 5:] = 0  # 4 tokens count; with 7-token chunks, chunks 1 and 2 hold no counted target
    mask[-1, length - 7:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _model(model_type: str, chunk: int | None, **kw):
    torch.manual_seed(0)
    return hf_model("causal_lm", model_type, dict(HF), loss={"chunked": chunk is not None, "chunk_tokens": chunk or 1},
                    **kw)


def _run(model_type: str, chunk: int | None, autocast: bool = False) -> tuple[torch.Tensor, int, dict]:
    """(loss_sum, num_items, gradients) of one forward and backward; chunk None: the plain loss."""
    model = _model(model_type, chunk)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(_batch())
    out["loss_sum"].backward()
    assert out["loss_sum"].dtype == torch.float32
    return (out["loss_sum"].detach(), int(out["num_items"]),
            {name: p.grad.detach().double() for name, p in model.named_parameters()})


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [7, 17, 1000])
def test_fp32_chunks_equal_the_plain_loss(model_type, chunk):
    plain, chunked = _run(model_type, None), _run(model_type, chunk)
    assert chunked[1] == plain[1] == 4 + 23 + 16  # each row's ids shifted: its counted tokens less one
    assert chunked[0].item() == pytest.approx(plain[0].item(), rel=SAME_OPS_TOL)
    assert_all_close_scaled(chunked[2], plain[2], f"{model_type} chunks of {chunk}: gradients")


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_bf16_autocast_chunks_are_the_plain_loss_to_bf16s_rounding(model_type):
    plain, chunked = _run(model_type, None, autocast=True), _run(model_type, 17, autocast=True)
    assert chunked[1] == plain[1]
    assert chunked[0].item() == pytest.approx(plain[0].item(), rel=SCALE_TOL)
    assert_all_close_scaled(chunked[2], plain[2], f"{model_type} bf16 chunks: gradients", BF16_TOL)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_chunked_forward_keeps_no_logits(autocast):
    """The plain forward keeps the log-softmax of its float32 logits for backward; the chunked one keeps none of
    them (in fp32, F.linear_cross_entropy keeps the gradients of the head's input and weight instead)."""
    batch, width, vocab = _batch(4, 64), HF["hidden_size"], HF["vocab_size"]
    kept = {}
    for chunk in (None, 64):
        # eager attention (alike on both paths): torch's bf16 sdpa at 64 tokens needs AVX-512 (pack_vnni2), and
        # this test runs under ATEN_CPU_CAPABILITY=avx2 too
        model = _model("llama", chunk, attn_implementation="eager")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            kept[chunk] = saved_bytes(model, lambda: model(batch))[0]
    rows, length = batch["input_ids"].shape
    log_softmax = rows * (length - 1) * vocab * 4  # the plain path's logits drop each row's last position
    gradients = 0 if autocast else (rows * length + vocab) * width * 4
    assert kept[None] - kept[64] >= log_softmax - gradients, kept


# ------------------------------------------------------------------------------------------ refused

@pytest.mark.parametrize("model_type,config,why", [
    ("gemma2", {"head_dim": 8}, r"final_logit_softcapping=30\.0"),
    ("cohere", {}, r"logit_scale=0\.0625"),
    ("granite", {"logits_scaling": 8.0}, r"logits_scaling=8\.0"),
    ("phi", {}, "head has one"),
])
def test_a_head_that_is_not_a_plain_linear_map_is_refused(model_type, config, why):
    with pytest.raises(ConfigError, match=r"^model\.loss\.chunked=True: .*" + why):
        hf_model("causal_lm", model_type, {**HF, **config}, attn_implementation="eager", loss={"chunked": True})
    hf_model("causal_lm", model_type, {**HF, **config}, attn_implementation="eager")  # the plain loss builds


@pytest.mark.parametrize("model_type,config", [
    ("mistral", {}), ("qwen3", {"head_dim": 8}), ("olmo2", {}), ("phi3", {}),
    ("gemma", {"head_dim": 8}),  # its head tied to the embedding, which it scales by sqrt(width): inside the body
    ("gemma3_text", {"head_dim": 8}),  # no final_logit_softcapping by default
    ("gemma2", {"head_dim": 8, "final_logit_softcapping": None}),
    ("granite", {}),  # logits_scaling 1 by default
    ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),  # transformer.h, ln_f, a tied head
])
def test_families_built_with_chunks_give_their_plain_loss(model_type, config):
    """A family the build accepts: the chunks' loss is the one from the logits the model itself returns."""
    batch = _batch()
    config = {**HF, **config} if model_type != "gpt2" else {**config, "vocab_size": HF["vocab_size"]}
    losses = []
    for chunk in (None, 17):
        torch.manual_seed(0)
        model = hf_model("causal_lm", model_type, config, attn_implementation="eager",
                         loss={"chunked": chunk is not None, "chunk_tokens": chunk or 1})
        losses.append(model(batch)["loss_sum"].item())
    assert losses[1] == pytest.approx(losses[0], rel=SAME_OPS_TOL), model_type


def test_lora_adapters_chunk_and_a_head_trained_whole_is_refused():
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    torch.manual_seed(0)
    chunked = hf_model("causal_lm", "llama", dict(HF), lora=lora, loss={"chunked": True, "chunk_tokens": 7})
    plain = hf_model("causal_lm", "llama", dict(HF), lora=lora)
    plain.load_state_dict(chunked.state_dict())
    a, b = chunked(_batch())["loss_sum"], plain(_batch())["loss_sum"]
    assert a.item() == pytest.approx(b.item(), rel=SAME_OPS_TOL)
    with pytest.raises(ConfigError, match=r"^model\.loss\.chunked=True: needs a plain linear head; .*"
                                          "ModulesToSaveWrapper"):
        hf_model("causal_lm", "llama", dict(HF), lora={**lora, "modules_to_save": ["lm_head"]},
                 loss={"chunked": True})


def test_validation_accepts_a_causal_lm_and_refuses_a_masked_lm():
    cfg = _config(4, True)
    validate(cfg, 1)
    cfg.model = {**cfg.model, "_target_": "dist_trainer.models.hf.hf_model", "task": "masked_lm",
                 "model_type": "bert"}
    with pytest.raises(ConfigError, match=r"^model\.loss\.chunked=True: is for causal LMs"):
        validate(cfg, 1)


# ------------------------------------------------------------------------------------------ two ranks

class PaddedIds(Dataset):
    """``char_text``'s items as a Hugging Face batch brings them: ids right-padded after their valid tokens with
    an ``attention_mask``, no targets; valid lengths uneven as test_accumulation's (capped at the row)."""

    def __init__(self, block_size: int) -> None:
        base = char_text(block_size=block_size, min_len=1)
        lengths = [min(_token_length(s, p), block_size - 1) for s in range(STEPS) for p in range(GLOBAL)]
        pools = {n: [i for i in range(2000) if base.valid_length(i) == n] for n in set(lengths)}
        self.items = [base[pools[n].pop(0)] for n in lengths]
        self.valid = lengths

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        ids = self.items[index]["input_ids"]
        mask = (torch.arange(len(ids)) <= self.valid[index]).long()  # the ids whose next token counts, and it
        return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _config(micro: int, chunked: bool, cp: int = 1, pp: int = 1, tp: TPConfig = TPConfig()):
    cfg = gpt_config(micro)  # 3 AdamW steps of 32 sequences
    cfg.model = {"_target_": "dist_trainer.models.hf.hf_model", "task": "causal_lm", "model_type": "llama",
                 "config": {**HF, "vocab_size": 256}, "block_size": 22,
                 # 20 tokens a chunk: divides neither a micro-batch's 88 tokens nor a cp rank's 48 (24 / 2 x 4)
                 "loss": {"chunked": chunked, "chunk_tokens": 20}}
    cfg.data = {"_target_": f"{__name__}.PaddedIds", "block_size": 22, "shuffle": False}
    cfg.optim = dataclasses.replace(cfg.optim, eps=1e-6)
    return dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, cp=CPConfig(size=cp), pp=PPConfig(size=pp),
                                                             tp=tp))


REFERENCE = _config(GLOBAL, False)  # one process, one batch of 32, the plain loss
CASES = {"ddp": _config(4, True), "cp2": _config(4, True, cp=2), "pp2": _config(4, True, pp=2),
         # tp 2: the head column-wise, each chunk's cross-entropy on the ranks' vocabulary slices (128 rows each)
         "tp2": _config(4, True, tp=TPConfig(size=2))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(_worker, [("plain", REFERENCE)])["plain"]
    two = launch_clean(_worker, 2, tmp_path_factory.mktemp("chunked_hf2"), list(CASES.items()))
    return one, two


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_with_chunks_equal_one_process_without(runs, name):
    ref, two = runs
    assert "error" not in ref, ref.get("error")
    for rank, results in enumerate(two):
        got, what = results[name], f"{name} rank {rank}"
        assert "error" not in got, got.get("error")
        assert len(got["outcomes"]) == STEPS
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert (a["items"], a["samples"]) == (b["items"], b["samples"]) and not a["skipped"], (what, step)
            assert a["loss"] == pytest.approx(b["loss"], rel=SCALE_TOL), f"{what}: loss at step {step}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=SCALE_TOL), f"{what}: norm at step {step}"
        held = set(got["params"])  # a pipeline rank holds its stages' parameters
        assert held == set(ref["params"]) or name == "pp2", what
        assert_all_close_scaled(got["grads"], {k: ref["grads"][k] for k in held}, f"{what} gradients of step 1")
        assert_all_close_scaled(got["params"], {k: ref["params"][k] for k in held}, f"{what} weights after step "
                                f"{STEPS}")
