"""``task`` and ``rl.*``: the values alone, and against the mesh (what task=dpo runs under); ``rl.publish.*``."""

from __future__ import annotations

from ..config import DPO_LOSSES, REFERENCES, TASKS, Config, MeshShape, require
from ..config.schema import PUBLISH_DTYPES, PUBLISH_MODES

HF_MODELS = ("dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")
PREFERENCE_DATA = ("dist_trainer.data.hf_preference.hf_preference", "dist_trainer.data.hf_preference")


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
    if cfg.task == "lm":
        require(not preference, "task", cfg.task, "data=hf_preference holds preference pairs: train them with task=dpo")
        return
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
    if pub.mode == "sglang":
        require(isinstance(pub.url, str) and pub.url.startswith(("http://", "https://")), "rl.publish.url", pub.url,
                "rl.publish.mode=sglang needs the server's address, e.g. http://127.0.0.1:30000")
    else:
        require(pub.url is None, "rl.publish.url", pub.url,
                f"is read by rl.publish.mode=sglang only (mode is {pub.mode}): set the mode or remove the url")
    if pub.mode != "none":
        require(cfg.model.get("_target_") in HF_MODELS and cfg.model.get("task", "causal_lm") == "causal_lm",
                "model", cfg.model.get("_target_"),
                f"rl.publish.mode={pub.mode} writes a Hugging Face causal LM's directory for a server to load: "
                "use model=hf_causal_lm (or rl.publish.mode=none)")
