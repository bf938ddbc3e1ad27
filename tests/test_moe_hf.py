"""Hugging Face MoE models through the project's MoE layer (dist_trainer.moe.hf), with its balancing terms.

Tiny configurations (2 layers, width 32, 4-8 experts, top-2; random weights, nothing downloaded), fp32:

* each family (qwen3_moe, mixtral, olmoe, deepseek_v3, qwen2_moe): the swapped model holds transformers' own
  tensors under transformers' own names, its logits equal the unswapped model's within 1e-6 of their scale
  (DeepSeek-V3 with selection biases that push every score below 0, where masking the groups left out with 0
  instead of -inf would choose other experts), the swap draws nothing from the generator, a build recorded on
  the meta device and replayed equals the whole build bit for bit, and ``hf_model/`` written by the project's
  exporter reloads in transformers and through ``model.pretrained`` to the same weights;
* the balancing terms count exactly the tokens the loss counts (shifted labels, padding and -100 nowhere),
  transformers' own router loss is never asked for, FLOPs count the active parameters only;
* split invariance on real gloo ranks: a qwen3_moe (samples padded through ``attention_mask``) and a mixtral
  (``targets`` with -100) trained 3 AdamW steps as one process x 8 samples and as 2 ranks x 4 x 1 and
  2 ranks x 2 x 2, under ddp and fsdp: expert counts exact, every step's gradients and the final weights within
  SCALE_TOL of their scale, the fsdp ranks' meta-built initial weights bit-equal to the whole build's; the aux
  term is there (> 0) and moves the gradients (coefficient 0 gives others).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import Dataset

pytest.importorskip("transformers")

from dist_trainer.config import (BatchConfig, Config, ConfigError, DistConfig, EPConfig, OptimConfig,  # noqa: E402
                                 PrecisionConfig, TrainerConfig)
from dist_trainer.models.construct import materialise, record  # noqa: E402
from dist_trainer.models.hf import hf_model  # noqa: E402
from dist_trainer.moe import MoE, routing_of  # noqa: E402
from dist_trainer.moe.hf import FAMILIES as BLOCKS  # noqa: E402
from helpers import (SAME_OPS_TOL, SCALE_TOL, assert_all_close_scaled, assert_close_scaled, record_steps,  # noqa: E402
                     run_jobs, scaled_error)
from helpers import job_record as _rec  # noqa: E402
from test_accumulation import in_one_process, launch_clean, unbalanced_text  # noqa: E402
from test_fsdp import _named_full  # noqa: E402

BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 64, "eos_token_id": None, "bos_token_id": None,
        "pad_token_id": None,
        # Router weights of transformers' default scale (0.02) give nearly equal scores, where the choice of
        # experts turns on the last bit of the layer below: 0.2 makes the routing a property of the model.
        "initializer_range": 0.2}
FAMILIES = {
    "qwen3_moe": {**BASE, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 24, "num_experts": 8,
                  "num_experts_per_tok": 2, "norm_topk_prob": True, "router_aux_loss_coef": 0.01},
    "mixtral": {**BASE, "intermediate_size": 24, "num_local_experts": 4, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.01},
    "olmoe": {**BASE, "intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2},  # norm_topk_prob false
    "deepseek_v3": {**BASE, "num_key_value_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 16,
                    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "routed_scaling_factor": 2.5},
    "qwen2_moe": {**BASE, "intermediate_size": 64, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2},
}
MOE_LAYERS = {"qwen3_moe": 2, "mixtral": 2, "olmoe": 2, "deepseek_v3": 1, "qwen2_moe": 2}  # deepseek: 1 dense first
# Names transformers gives the MoE block's tensors, which the swapped model must keep (layer 1: every family's MoE).
NAMES = {"qwen3_moe": [], "mixtral": [], "olmoe": [],
         "deepseek_v3": ["mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
                         "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight"],
         "qwen2_moe": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.down_proj.weight",
                       "mlp.shared_expert_gate.weight"]}
REPORT: dict = {}


def _hf_config(model_type: str):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **FAMILIES[model_type])


def _ours(model_type: str, **kw):
    return hf_model("causal_lm", model_type, dict(FAMILIES[model_type]), block_size=24, **kw)


def _biases_below_zero(model: torch.nn.Module) -> None:
    """DeepSeek-V3's selection biases: random, and low enough that every biased score is below 0."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5 - 2.0)


def _ids(batch: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- each family, in one process

@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_swapped_model_is_transformers_own(model_type, tmp_path):
    import transformers

    from dist_trainer.hf.export import layout_of, write_hf_model
    from dist_trainer.parallel.state import parameter_ties

    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_hf_config(model_type), dtype=torch.float32,
                                                        attn_implementation="sdpa")
    after_ref = torch.random.get_rng_state()
    torch.manual_seed(0)
    ours = _ours(model_type)
    assert torch.equal(torch.random.get_rng_state(), after_ref)  # the swap draws nothing

    layers = [m for m in ours.modules() if isinstance(m, MoE)]
    assert len(layers) == MOE_LAYERS[model_type] and routing_of(ours).layers == layers
    assert not any(type(m).__name__ in BLOCKS for m in ours.modules())
    theirs, mine = ref.state_dict(), ours.model.state_dict()
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    for name in ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", *NAMES[model_type]]:
        assert f"model.layers.1.{name}" in mine, name

    if model_type == "deepseek_v3":
        _biases_below_zero(ref)
        _biases_below_zero(ours.model)
    with torch.no_grad():
        want = ref.eval()(input_ids=_ids()).logits
        got = ours.model.eval()(input_ids=_ids()).logits
    REPORT[f"logits {model_type}"] = assert_close_scaled(got, want, f"{model_type} logits", SAME_OPS_TOL)

    # hf_model/ as the project writes it (names planned from the layout): transformers and model.pretrained
    # read it back to the same tensors.
    state = {f"model.{k}": v for k, v in mine.items()}
    write_hf_model(ours, layout_of(state, parameter_ties(ours)), list(state.items()), tmp_path / "hf_model")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.float32)
    loaded = hf_model("causal_lm", pretrained=str(tmp_path / "hf_model"), block_size=24)
    assert type(loaded.model.model.layers[1].mlp) is MoE
    for name, value in mine.items():
        assert torch.equal(again.state_dict()[name], value), name
        assert torch.equal(loaded.model.state_dict()[name], value), name


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_meta_build_replayed_equals_the_whole_build(model_type):
    torch.manual_seed(3)
    whole = _ours(model_type)
    after_whole = torch.random.get_rng_state()
    torch.manual_seed(3)
    model, trace = record(lambda: _ours(model_type))
    assert all(t.device.type == "meta" for t in model.parameters())
    materialise(model, trace, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), after_whole)
    got, ref = model.state_dict(), whole.state_dict()
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name


def test_the_terms_count_the_tokens_the_loss_counts():
    """Padding (attention_mask), -100 labels and the last position (it predicts nothing) count nowhere."""
    model = _ours("qwen3_moe", moe={"aux_loss": {"coef": 0.01}, "z_loss": {"coef": 1e-3}})
    routing = routing_of(model)
    ids = _ids(3, 24)
    mask = torch.ones_like(ids)
    mask[1, 10:], mask[2, 3:] = 0, 0  # padded
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5:9] = -100  # a prompt's tokens
    for batch in ({"input_ids": ids, "attention_mask": mask}, {"input_ids": ids, "labels": labels},
                  {"input_ids": ids, "targets": labels}):
        routing.begin_step(torch.device("cpu"))
        out = model(batch)
        counts = routing.local_stats(1.0)[:2 * 8].view(2, 8)
        assert counts.sum(dim=1).tolist() == [2.0 * out["num_items"].item()] * 2, batch.keys()
        assert 0 < out["num_items"].item() < 3 * 23


def test_coefficients_from_the_configuration_and_bad_keys():
    import transformers

    model = _ours("qwen3_moe")  # coef null: router_aux_loss_coef x top_k / MoE layers (transformers' strength)
    assert routing_of(model).cfg.aux_coef == pytest.approx(0.01 * 2 / 2) and routing_of(model).cfg.z_coef == 0
    assert _ours("olmoe", moe={"aux_loss": {"coef": 0.05}}).routing.cfg.aux_coef == 0.05  # a number as it is
    assert _ours("deepseek_v3").routing.cfg.aux_coef == 0  # no router_aux_loss_coef: none
    assert _ours("qwen2_moe", moe={"aux_loss": {"coef": 0.0}}).routing.cfg.aux_coef == 0.0
    dense = hf_model("causal_lm", "llama", {**BASE, "intermediate_size": 64}, block_size=24)
    assert dense.routing is None and not routing_of(dense).layers
    with pytest.raises(ConfigError, match=r"model\.moe\.bias_update\.rate"):
        _ours("mixtral", moe={"bias_update": {"rate": 0.01}})
    with pytest.raises(ConfigError, match=r"model\.moe\.aux_loss\.scope"):
        _ours("mixtral", moe={"aux_loss": {"coef": None, "scope": "batch"}})
    with pytest.raises(ConfigError, match=r"router_jitter_noise"):
        hf_model("causal_lm", "mixtral", {**FAMILIES["mixtral"], "router_jitter_noise": 0.1}, block_size=24)
    # A configuration that asks transformers for its router loss: not computed (the layers count their own).
    model = hf_model("causal_lm", "mixtral", {**FAMILIES["mixtral"], "output_router_logits": True}, block_size=24)
    assert model._call_kwargs["output_router_logits"] is False
    model({"input_ids": _ids()})
    assert isinstance(model.model, transformers.MixtralForCausalLM)


def test_tp_plans_of_the_families():
    """qwen3_moe's per-head norms are head_norm (not sequence shards), its mlp whole; OLMoE's norm over the whole
    projection is refused by name rather than cut wrong."""
    plan = _ours("qwen3_moe").tp_plan
    assert plan["model.model.layers.*.self_attn.q_norm"] == plan["model.model.layers.*.self_attn.k_norm"] == "head_norm"
    assert plan["model.model.layers.*.mlp"] == "replicate" and plan["model.model.norm"] == "sequence_parallel"
    assert not any(".mlp." in k for k in plan)
    with pytest.raises(ConfigError, match=r"dist\.tp\.size.*olmoe.*q_proj"):
        _ours("olmoe").tp_plan


def test_flops_count_active_parameters():
    model = _ours("qwen3_moe")
    H, I, E, k, L = 32, 24, 8, 2, 2
    inactive = L * (E - k) * 3 * H * I  # gate, up and down of the experts a token does not go through
    dense = model.model.num_parameters(exclude_embeddings=True)
    assert model.flops_per_item() == 6.0 * (dense - inactive) + 12.0 * L * H * 24
    deepseek = _ours("deepseek_v3")  # one MoE layer, its shared expert active
    dense = deepseek.model.num_parameters(exclude_embeddings=True)
    assert deepseek.flops_per_item() == 6.0 * (dense - (8 - 2) * 3 * 32 * 16) + 12.0 * 2 * 32 * 24


# --------------------------------------------------------------------------- split invariance on real ranks

GLOBAL, STEPS = 8, 3
SPLITS = {"2x4x1": 4, "2x2x2": 2}  # name: micro-batch size on 2 ranks
MOE = {"aux_loss": {"coef": 0.01, "scope": "global"}, "z_loss": {"coef": 1e-3}, "bias_update": {"rate": 0.0}}


class PaddedText(Dataset):
    """``unbalanced_text`` as a tokenizer pads it: input ids and an ``attention_mask`` (no labels: the model's
    are the ids, shifted, padding ignored). Valid lengths 24, 6, 4, 1 by position: rank 0 gets long samples."""

    def __init__(self, block_size: int = 24):
        self.base = unbalanced_text(block_size, 1)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict:
        item = self.base[index]
        valid = int((item["targets"] != -100).sum())
        positions = torch.arange(item["input_ids"].numel())
        return {"input_ids": item["input_ids"], "attention_mask": (positions <= valid).long()}


def _split_config(model_type: str, micro: int, strategy: str = "ddp", moe: dict = MOE, ep: int = 1) -> Config:
    data = ({"_target_": f"{__name__}.PaddedText", "block_size": 24} if model_type == "qwen3_moe" else
            {"_target_": "test_accumulation.unbalanced_text", "block_size": 24, "steps": 1})
    return Config(
        model={"_target_": "dist_trainer.models.hf.hf_model", "task": "causal_lm", "model_type": model_type,
               "config": dict(FAMILIES[model_type]), "block_size": 24, "moe": moe},
        data={**data, "shuffle": False},
        batch=BatchConfig(micro_batch_size=micro, global_batch_size=GLOBAL),
        precision=PrecisionConfig(name="fp32"),
        # eps 1e-6, as tests/test_moe.py says why: an expert's gradient holds elements of rounding size.
        optim=OptimConfig(name="adamw", lr=3e-3, weight_decay=0.1, warmup_steps=2, schedule="cosine",
                          grad_clip=None, eps=1e-6),
        trainer=TrainerConfig(max_steps=STEPS, log_every=1, eval_every=0),
        dist=DistConfig(strategy=strategy, ep=EPConfig(size=ep)),
    )


def _jobs(world: int) -> list:
    if world == 1:
        return [(f"{mt}/ref", _split_config(mt, GLOBAL), STEPS) for mt in ("qwen3_moe", "mixtral")] + [
            ("qwen3_moe/coef0", _split_config("qwen3_moe", GLOBAL, moe={**MOE, "aux_loss": {"coef": 0.0}}), 1)]
    return [(f"{mt}/{strategy}-{split}", _split_config(mt, micro, strategy), STEPS)
            for mt in ("qwen3_moe", "mixtral") for strategy in ("ddp", "fsdp") for split, micro in SPLITS.items()] + [
        # The swapped blocks are the project's layer: expert parallelism cuts a Hugging Face model's experts too.
        ("qwen3_moe/ep2-2x2x2", _split_config("qwen3_moe", 2, "ddp", ep=2), STEPS),
        ("mixtral/ep2-fsdp-2x4x1", _split_config("mixtral", 4, "fsdp", ep=2), STEPS),
        # tp 2: the attention cut, each MoE layer whole on both tp ranks (the plan's replicate), with and
        # without sequence parallelism; one data rank, 2 micro-batches of 4.
        # qwen3_moe's q_norm/k_norm run on each rank's heads (head_norm), their gradients summed over tp: without
        # the sum (a plain replicated norm) the run without sequence parallelism is off.
        ("mixtral/tp2-sp-1x4x2", _tp_config("mixtral", 4, sp=True), STEPS),
        ("mixtral/tp2-nosp-1x4x2", _tp_config("mixtral", 4, sp=False), STEPS),
        ("qwen3_moe/tp2-sp-1x4x2", _tp_config("qwen3_moe", 4, sp=True), STEPS),
        ("qwen3_moe/tp2-nosp-1x4x2", _tp_config("qwen3_moe", 4, sp=False), STEPS)]


def _tp_config(model_type: str, micro: int, sp: bool) -> Config:
    cfg = _split_config(model_type, micro)
    cfg.dist.tp = dataclasses.replace(cfg.dist.tp, size=2, sequence_parallel=sp)
    return cfg


def _run_job(env, world_size: int, name: str, cfg: Config, steps: int) -> dict:
    """Each step's outcome and whole gradients, the whole weights before the first step and after the last, and
    whether the build went through the meta device."""
    return record_steps(env, world_size, cfg, steps, grads_at=range(1, steps + 1), before=_initial)


def _initial(parts, plan) -> dict:
    return {"init": _named_full(parts.trainer.module, grads=False), "meta": parts.built_on_meta}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    one = in_one_process(run_jobs, _jobs(1), _run_job)
    two = launch_clean(run_jobs, 2, tmp_path_factory.mktemp("moe_hf2"), _jobs(2), _run_job)
    yield one, two
    if REPORT:
        print("\nlargest errors [max |got-ref| / max|ref|]:")
        for what, err in REPORT.items():
            print(f"  {what:40s} {err:.2e}")


@pytest.mark.parametrize("name", [name for name, _, _ in _jobs(2)])
def test_split_equals_one_big_batch(runs, name):
    one, two = runs
    ref = _rec(one, name.split("/")[0] + "/ref")
    assert not ref["meta"]
    err = 0.0
    for rank in range(2):
        got, what = _rec(two[rank], name), f"{name} rank {rank}"
        if "fsdp" in name:  # built on the meta device, each rank its shards: the whole build's values, bit for bit
            assert got["meta"]
            for key, value in ref["init"].items():
                assert torch.equal(got["init"][key], value), f"{what}: initial {key}"
        for step, (a, b) in enumerate(zip(got["outcomes"], ref["outcomes"]), 1):
            assert a["moe"]["expert_tokens"] == b["moe"]["expert_tokens"], f"{what}: expert counts at step {step}"
            assert a["items"] == b["items"] and not a["skipped"], f"{what}: step {step}"
            for key in ("aux_loss", "z_loss"):
                assert a["moe"][key] == pytest.approx(b["moe"][key], rel=SCALE_TOL), f"{what} {key} step {step}"
            assert a["loss"] == pytest.approx(b["loss"], rel=SCALE_TOL), f"{what}: loss at step {step}"
            err = max(err, assert_all_close_scaled(got["grads"][step - 1], ref["grads"][step - 1],
                                                   f"{what} grads step {step}"))
        err = max(err, assert_all_close_scaled(got["params"][-1], ref["params"][-1], f"{what} params"))
    REPORT[name] = err


def test_the_steps_hold_uneven_tokens_and_the_aux_term_moves_the_gradients(runs):
    one, _ = runs
    ref = _rec(one, "qwen3_moe/ref")
    items = [o["items"] for o in ref["outcomes"]]
    assert items[0] < GLOBAL * 23 and items[-1] < items[0]  # padding ignored, the steps' token counts differ
    first = ref["outcomes"][0]["moe"]
    assert first["aux_loss"] > 0.01 and first["z_loss"] > 0  # about coef a layer at least: top-k takes the likeliest
    assert [sum(row) for row in first["expert_tokens"]] == [2 * items[0]] * 2  # each counted token: top_k experts
    coef0 = _rec(one, "qwen3_moe/coef0")
    assert coef0["outcomes"][0]["moe"]["aux_loss"] == 0.0
    router = "model.model.layers.0.mlp.gate.weight"
    REPORT["router grad, aux coef 0 vs 0.01"] = diff = scaled_error(coef0["grads"][0][router], ref["grads"][0][router])
    assert diff > 1e-3
    mixtral = _rec(one, "mixtral/ref")["outcomes"]
    assert mixtral[0]["moe"]["aux_loss"] > 0.01 and mixtral[0]["items"] != mixtral[-1]["items"]


@pytest.mark.slow
def test_an_expert_parallel_run_exports_hf_model_that_transformers_loads_with_equal_logits(tmp_path):
    """2 ranks, fsdp with ep 2 (each rank holds half of every layer's experts): hf_model/ holds every expert whole
    under transformers' names, equal to final_model.pt, and transformers' logits equal the project's model's."""
    import transformers

    from helpers import run_module

    run_dir = tmp_path / "run"
    config = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "head_dim": 8}
    proc = run_module(["model=hf_causal_lm", "model.model_type=qwen3_moe",
                       *[f"+model.config.{k}={v}" for k, v in config.items()], "data.block_size=32",
                       "batch.micro_batch_size=4", "batch.global_batch_size=16", "trainer.max_steps=3",
                       "trainer.eval_every=0", "dist.strategy=fsdp", "dist.ep.size=2", f"hydra.run.dir={run_dir}"],
                      tmp_path, timeout=400, torchrun_nproc=2, agent=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", dtype=torch.float32)
    final = {k[len("model."):]: v for k, v in torch.load(run_dir / "final_model.pt", weights_only=True).items()}
    state = theirs.state_dict()
    assert state.keys() == final.keys() and state["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for name, value in state.items():
        assert torch.equal(value, final[name]), name
    ours = hf_model("causal_lm", pretrained=str(run_dir / "hf_model"), block_size=32)
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = theirs.eval()(input_ids=ids).logits, ours.model.eval()(input_ids=ids).logits
    assert_close_scaled(got, want, "logits", SAME_OPS_TOL)
