"""``task`` and ``rl.*``: the values alone, and against the mesh (what task=dpo runs under); ``rl.publish.*``."""

from __future__ import annotations

from ..config import (ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES, DPO_LOSSES, KL_ESTIMATORS, LOSS_AGG_ALIASES, LOSS_AGGS,
                      REFERENCES, TASKS, Config, MeshShape, require)
from ..config.schema import PUBLISH_DTYPES, PUBLISH_LORA, PUBLISH_MODES

HF_MODELS = ("dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")
PREFERENCE_DATA = ("dist_trainer.data.hf_preference.hf_preference", "dist_trainer.data.hf_preference")
PROMPT_DATA = ("dist_trainer.data.hf_prompts.hf_prompts",)
# Normalisations others offer that change with the split; refused, with the reason (rl.loss.agg)
PER_MICRO_BATCH = {"bnpo": "TRL's bnpo: a token mean over each micro-batch",
                   "token-mean-per-micro-batch": "a token mean over each micro-batch",
                   "sample-mean": "a mean over each micro-batch's sequences"}


def lora_rank(cfg: Config) -> int:
    """``model.lora.r`` of a Hugging Face model (0: no adapters)."""
    lora = cfg.model.get("lora") if isinstance(cfg.model, dict) else None
    return int((lora or {}).get("r") or 0)


def reference_kind(cfg: Config) -> str:
    """``rl.reference`` with auto resolved: adapter where the policy has LoRA adapters, else copy."""
    kind = cfg.rl.reference
    return ("adapter" if lora_rank(cfg) else "copy") if kind == "auto" else kind


def check_task(cfg: Config) -> None:
    """``task``, ``rl.reference`` and ``rl.dpo.*``: known values, and the model and data the task reads."""
    require(cfg.task in TASKS, "task", cfg.task, f"choose one of {', '.join(TASKS)}")
    preference = cfg.data.get("_target_") in PREFERENCE_DATA
    prompts = cfg.data.get("_target_") in PROMPT_DATA
    if cfg.task == "lm":
        require(not preference, "task", cfg.task, "data=hf_preference holds preference pairs: train them with task=dpo")
        require(not prompts, "task", cfg.task, "data=hf_prompts holds prompts to sample: train them with task=grpo")
        return
    if cfg.task == "grpo":
        return check_grpo(cfg, prompts)
    require(preference, "data", cfg.data.get("_target_"), "task=dpo trains on preference pairs: use data=hf_preference")
    require(cfg.model.get("_target_") in HF_MODELS and cfg.model.get("task", "causal_lm") == "causal_lm", "model",
            cfg.model.get("_target_"), "task=dpo trains a causal LM's answers: use model=hf_causal_lm")
    rl = cfg.rl
    require(rl.reference in REFERENCES, "rl.reference", rl.reference, f"choose one of {', '.join(REFERENCES)}")
    require(reference_kind(cfg) != "adapter" or lora_rank(cfg) > 0, "rl.reference", rl.reference,
            "adapter is the policy with its LoRA adapters disabled: set model.lora.r (or rl.reference=copy)")
    dpo = rl.dpo
    require(isinstance(dpo.beta, (int, float)) and not isinstance(dpo.beta, bool) and dpo.beta > 0, "rl.dpo.beta",
            dpo.beta, "must be a number > 0")
    require(dpo.loss in DPO_LOSSES, "rl.dpo.loss", dpo.loss, f"choose one of {', '.join(DPO_LOSSES)}")
    smoothing = dpo.label_smoothing
    require(isinstance(smoothing, (int, float)) and 0 <= smoothing < 0.5, "rl.dpo.label_smoothing", smoothing,
            "must be in [0, 0.5)")
    require(smoothing == 0 or dpo.loss in ("sigmoid", "robust"), "rl.dpo.label_smoothing", smoothing,
            f"applies to rl.dpo.loss=sigmoid or robust, not {dpo.loss}")
    require(isinstance(dpo.sft_weight, (int, float)) and not isinstance(dpo.sft_weight, bool) and dpo.sft_weight >= 0,
            "rl.dpo.sft_weight", dpo.sft_weight, "must be a number >= 0 (0: no NLL term)")


def check_task_mesh(cfg: Config, mesh: MeshShape) -> None:
    """task=dpo runs under ddp, fsdp and hsdp: the dimensions that cut a sequence's log-probabilities are refused
    until their per-sequence paths exist."""
    if cfg.task == "lm":
        return
    for key, size in (("dist.tp.size", mesh.tp), ("dist.pp.size", mesh.pp), ("dist.cp.size", mesh.cp),
                      ("dist.ep.size", mesh.ep)):
        require(size == 1, key, size, f"task={cfg.task} runs under ddp, fsdp and hsdp; set {key}=1")
    loss = cfg.model.get("loss") or {}
    require(not (isinstance(loss, dict) and loss.get("chunked")), "model.loss.chunked", True,
            f"task={cfg.task} needs each answer's log-probabilities, which the chunked loss does not keep: set "
            "model.loss.chunked=false")


def check_publish(cfg: Config) -> None:
    """``rl.publish.*``: known values, and a model the published directory can serve (a Hugging Face causal LM)."""
    pub = cfg.rl.publish
    require(pub.mode in PUBLISH_MODES, "rl.publish.mode", pub.mode, f"choose one of {', '.join(PUBLISH_MODES)}")
    require(pub.dtype in PUBLISH_DTYPES, "rl.publish.dtype", pub.dtype, f"choose one of {', '.join(PUBLISH_DTYPES)}")
    for key, value in (("rl.publish.every", pub.every), ("rl.publish.keep", pub.keep)):
        require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key, value,
                "must be an integer >= 1")
    require(pub.dir is None or (isinstance(pub.dir, str) and pub.dir.strip() != ""), "rl.publish.dir", pub.dir,
            "a local directory, or null (the run directory's published/)")
    if pub.mode in ("sglang", "vllm", "broadcast"):
        require(isinstance(pub.url, str) and pub.url.startswith(("http://", "https://")), "rl.publish.url", pub.url,
                f"rl.publish.mode={pub.mode} needs the server's address, e.g. http://127.0.0.1:30000")
    else:
        require(pub.url is None, "rl.publish.url", pub.url,
                f"is read by rl.publish.mode=sglang, vllm and broadcast only (mode is {pub.mode}): set the mode or "
                "remove the url")
    if pub.mode in ("vllm", "broadcast"):
        port = pub.master_port
        require(isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536, "rl.publish.master_port",
                port, f"rl.publish.mode={pub.mode} serves the group's store there: a free port, e.g. 29600")
        require(isinstance(pub.world_size, int) and not isinstance(pub.world_size, bool) and pub.world_size >= 2,
                "rl.publish.world_size", pub.world_size,
                "the group's ranks: the trainer's rank 0 and at least one server worker (>= 2)")
        require(isinstance(pub.master_address, str) and pub.master_address != "", "rl.publish.master_address",
                pub.master_address, "the trainer's rank 0's address, as the server reaches it")
    require(pub.lora in PUBLISH_LORA, "rl.publish.lora", pub.lora, f"choose one of {', '.join(PUBLISH_LORA)}")
    if pub.lora == "adapter":
        require(pub.mode in ("none", "disk", "sglang"), "rl.publish.lora", pub.lora,
                f"the adapters alone are written to disk (mode=disk, sglang); mode={pub.mode} sends a whole model: "
                "use rl.publish.lora=merged")
        require(pub.mode == "none" or lora_rank(cfg) > 0, "rl.publish.lora", pub.lora,
                "adapter publishes a LoRA model's adapters: set model.lora.r, or rl.publish.lora=merged")
    if pub.mode != "none":
        require(cfg.model.get("_target_") in HF_MODELS and cfg.model.get("task", "causal_lm") == "causal_lm",
                "model", cfg.model.get("_target_"),
                f"rl.publish.mode={pub.mode} writes a Hugging Face causal LM's directory for a server to load: "
                "use model=hf_causal_lm (or rl.publish.mode=none)")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_grpo(cfg: Config, prompts: bool) -> None:
    """task=grpo's keys: the data and model it samples, the group, the reward, the advantage, the loss's
    aggregation (a per-micro-batch mean refused, with the reason), the clip, the KL term and the rollouts."""
    require(prompts, "data", cfg.data.get("_target_"), "task=grpo samples completions of prompts: use data=hf_prompts")
    require(cfg.model.get("_target_") in HF_MODELS and cfg.model.get("task", "causal_lm") == "causal_lm", "model",
            cfg.model.get("_target_"), "task=grpo samples a causal LM's completions: use model=hf_causal_lm")
    rl = cfg.rl
    for key, value in (("rl.prompts_per_step", rl.prompts_per_step), ("rl.group_size", rl.group_size)):
        require(_count(value) and value >= 1, key, value, "must be an integer >= 1")
    glob = cfg.batch.global_batch_size
    sequences = rl.prompts_per_step * rl.group_size
    require(glob is None or glob == sequences, "batch.global_batch_size", glob,
            f"task=grpo's global batch is rl.prompts_per_step x rl.group_size = {sequences} sequences: leave it "
            "null or set it to that")
    require(cfg.batch.micro_batch_size != "auto", "batch.micro_batch_size", "auto",
            "task=grpo: give the micro-batch in sequences (the finder measures a fixed sample, not a rollout)")
    reward = rl.reward
    if isinstance(reward, str):
        from .rewards import BUILT_IN

        require(reward in BUILT_IN, "rl.reward", reward,
                f"choose one of {', '.join(BUILT_IN)}, or name a callable in rl.reward._target_")
    else:
        require(isinstance(reward, dict) and isinstance(reward.get("_target_"), str), "rl.reward", reward,
                "a built-in's name, or {_target_: module.function} for a callable (prompt, completion, **record)")
    require(rl.advantage.estimator in ADVANTAGE_ESTIMATORS, "rl.advantage.estimator", rl.advantage.estimator,
            f"choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    require(rl.advantage.scale in ADVANTAGE_SCALES, "rl.advantage.scale", rl.advantage.scale,
            f"choose one of {', '.join(ADVANTAGE_SCALES)}")
    agg = rl.loss.agg
    require(agg not in PER_MICRO_BATCH, "rl.loss.agg", agg,
            f"{PER_MICRO_BATCH.get(agg, '')} changes with how the step is split into micro-batches and ranks, so the "
            "update would not be the big batch's; token-mean is the mean over every token of the step")
    require(agg in LOSS_AGGS or agg in LOSS_AGG_ALIASES, "rl.loss.agg", agg,
            f"choose one of {', '.join(LOSS_AGGS)} (or {', '.join(LOSS_AGG_ALIASES)})")
    max_tokens = rl.loss.max_tokens
    require(max_tokens is None or (_count(max_tokens) and max_tokens >= 1), "rl.loss.max_tokens", max_tokens,
            "an integer >= 1, or null (rl.rollout.max_new_tokens)")
    for key, value in (("rl.clip.low", rl.clip.low), ("rl.clip.high", rl.clip.high)):
        require(_number(value) and value >= 0, key, value, "must be a number >= 0")
    require(rl.clip.low < 1, "rl.clip.low", rl.clip.low, "must be < 1 (the ratio's lower bound is 1 - low)")
    require(_number(rl.kl.coef) and rl.kl.coef >= 0, "rl.kl.coef", rl.kl.coef, "must be a number >= 0 (0: no KL)")
    require(rl.kl.estimator in KL_ESTIMATORS, "rl.kl.estimator", rl.kl.estimator,
            f"choose one of {', '.join(KL_ESTIMATORS)}")
    require(_number(rl.entropy_coef) and rl.entropy_coef >= 0, "rl.entropy_coef", rl.entropy_coef,
            "must be a number >= 0")
    require(_count(rl.inner_steps) and rl.inner_steps >= 1, "rl.inner_steps", rl.inner_steps,
            "must be an integer >= 1: the optimizer steps each step's rollouts are trained by")
    require(rl.reference in REFERENCES and rl.reference != "precomputed", "rl.reference", rl.reference,
            "task=grpo's completions are new each step: choose auto, copy, adapter or none")
    require(reference_kind(cfg) != "adapter" or lora_rank(cfg) > 0, "rl.reference", rl.reference,
            "adapter is the policy with its LoRA adapters disabled: set model.lora.r (or rl.reference=copy)")
    rollout = rl.rollout
    require(_count(rollout.max_new_tokens) and rollout.max_new_tokens >= 1, "rl.rollout.max_new_tokens",
            rollout.max_new_tokens, "must be an integer >= 1")
    require(_number(rollout.temperature) and rollout.temperature > 0, "rl.rollout.temperature", rollout.temperature,
            "must be a number > 0 (sampling from the tempered distribution; greedy decoding has no ratio to train)")
    require(not cfg.trainer.compile, "trainer.compile", cfg.trainer.compile,
            "task=grpo samples token by token through the model: compiled blocks would compile again at every "
            "length; set trainer.compile=false")
    require(not cfg.data.get("num_workers"), "data.num_workers", cfg.data.get("num_workers"),
            "data=hf_prompts hands the sampler prompt indices: it needs no worker (set 0)")


def resolve_grpo_batch(cfg: Config) -> str:
    """task=grpo: batch.global_batch_size, left null, becomes rl.prompts_per_step x rl.group_size (a chosen line)."""
    if cfg.task != "grpo" or cfg.batch.global_batch_size is not None:
        return ""
    cfg.batch.global_batch_size = cfg.rl.prompts_per_step * cfg.rl.group_size
    return (f"batch.global_batch_size={cfg.batch.global_batch_size} (rl.prompts_per_step x rl.group_size "
            "completions a step)")
