"""What the parallelisms refuse, checked on the configuration before anything is built: tensor parallelism's and
the pipeline's keys, context parallelism's against the mesh, the pipeline schedule's against the batch plan.

No tensor, no process group: ``dist_trainer.validation`` calls these in its ordered lists, beside the other
features' checks.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from ..config import PP_SCHEDULES, TP_STYLES, BatchPlan, Config, ConfigError, MeshShape, require


def check_tp(cfg: Config) -> None:
    """``dist.tp.*``, and what tensor parallelism does not combine with; before the mesh is derived."""
    tp, d = cfg.dist.tp, cfg.dist
    require(isinstance(tp.size, int) and not isinstance(tp.size, bool) and tp.size >= 1, "dist.tp.size", tp.size,
            "must be an integer >= 1 (1: no tensor parallelism)")
    require(tp.plan == "auto" or (isinstance(tp.plan, dict) and bool(tp.plan) and
                                  all(isinstance(k, str) and v in TP_STYLES for k, v in tp.plan.items())),
            "dist.tp.plan", tp.plan, f"auto, or a mapping of module-name patterns to one of {list(TP_STYLES)}")
    require(isinstance(tp.sequence_parallel, bool), "dist.tp.sequence_parallel", tp.sequence_parallel,
            "must be true or false")
    require(isinstance(tp.loss_parallel, bool), "dist.tp.loss_parallel", tp.loss_parallel, "must be true or false")
    if tp.size == 1:
        return
    # What tensor parallelism does not combine with, named by both keys, before anything is built.
    require(not d.sync_batchnorm, "dist.sync_batchnorm", d.sync_batchnorm,
            f"is not supported with dist.tp.size={tp.size}: set dist.sync_batchnorm=false or dist.tp.size=1")
    require(d.check_consistency_every == 0, "dist.check_consistency_every", d.check_consistency_every,
            f"compares whole replicas across ranks, and under dist.tp.size={tp.size} each rank holds a cut of "
            "every layer: set dist.check_consistency_every=0 or dist.tp.size=1")
    require(cfg.batch.micro_batch_size != "auto", "batch.micro_batch_size", "auto",
            f"is not supported with dist.tp.size={tp.size} (its trials run the whole model on each rank): "
            "set an integer batch.micro_batch_size")
    lora = cfg.model.get("lora") or {}
    require(not (isinstance(lora, dict) and lora.get("r")), "model.lora.r", lora.get("r") if isinstance(lora, dict)
            else lora, f"LoRA adapters on a tensor-parallel base are not supported yet (dist.tp.size={tp.size}): "
            "set dist.tp.size=1, or model.lora.r=null for full fine-tuning")


def check_pp(cfg: Config) -> None:
    """``dist.pp.*``, and what pipeline stages do not combine with; before the mesh is derived."""
    pp, d = cfg.dist.pp, cfg.dist
    require(isinstance(pp.size, int) and not isinstance(pp.size, bool) and pp.size >= 1, "dist.pp.size", pp.size,
            "must be an integer >= 1 (1: no pipeline)")
    require(pp.schedule in PP_SCHEDULES, "dist.pp.schedule", pp.schedule, f"must be one of {list(PP_SCHEDULES)}")
    v = pp.stages_per_rank
    require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "dist.pp.stages_per_rank", v,
            "must be an integer >= 1")
    if pp.schedule in ("gpipe", "1f1b"):
        require(v == 1, "dist.pp.stages_per_rank", v, f"must be 1 with dist.pp.schedule={pp.schedule} (a single-stage "
                "schedule); interleaved_1f1b and zero_bubble hold several stages per rank")
    else:
        require(v >= 2, "dist.pp.stages_per_rank", v, f"must be 2 or more with dist.pp.schedule={pp.schedule} "
                "(2 with zero_bubble is the V schedule); or use dist.pp.schedule=1f1b")
    require(pp.split == "auto" or (isinstance(pp.split, (list, tuple)) and all(isinstance(n, str) for n in pp.split)),
            "dist.pp.split", pp.split,
            "auto, or the names of the blocks where stages 1, 2, ... begin (e.g. [blocks.2])")
    if pp.size == 1:
        return
    # What the pipeline does not combine with (yet), named by both keys, before anything is built.
    why = {
        "trainer.compile": (not cfg.trainer.compile, "compiling pipeline stages is not supported: set "
                            "trainer.compile=false or dist.pp.size=1"),
        "dist.sync_batchnorm": (not d.sync_batchnorm, "is not supported with pipeline stages: set "
                                "dist.sync_batchnorm=false or dist.pp.size=1"),
        "dist.check_consistency_every": (d.check_consistency_every == 0, "compares whole replicas across ranks, and "
                                         "each pipeline rank holds other stages: set dist.check_consistency_every=0"),
        "batch.micro_batch_size": (cfg.batch.micro_batch_size != "auto", "auto is not supported with dist.pp.size > 1 "
                                   "(its trials run the whole model on each rank): set an integer"),
        "dist.fsdp.reshard": (d.strategy == "ddp" or d.fsdp.reshard != "micro_batch", "micro_batch is not supported "
                              "with dist.pp.size > 1: torch's stages keep each unit gathered from its first backward "
                              "to the step's end, so a unit gathers once a step under forward or step; set "
                              "dist.fsdp.reshard=forward (or auto, its default)"),
        "dist.fsdp.accum_sync": (d.strategy == "ddp" or d.fsdp.accum_sync == "last", "every is not supported with "
                                 "dist.pp.size > 1 (the schedule reduces gradients once, after its last backward): "
                                 "set dist.fsdp.accum_sync=last"),
    }
    for key, (ok, text) in why.items():
        require(ok, key, _get(cfg, key), f"{text} (dist.pp.size={pp.size})")
    lora = cfg.model.get("lora") or {}
    require(not (isinstance(lora, dict) and lora.get("r")), "model.lora.r", lora.get("r") if isinstance(lora, dict)
            else lora, f"LoRA adapters on pipeline stages are not supported yet (dist.pp.size={pp.size}): set "
            "dist.pp.size=1, or model.lora.r=null")


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def pp_window_need(schedule: str, stages: int, pp: int, accum: int) -> Optional[str]:
    """Why ``accum`` micro-batches are too few (or the wrong number) for the schedule; None if they serve."""
    if schedule == "1f1b" and accum < stages:
        return f"needs at least as many micro-batches as stages ({stages})"
    interleaved = schedule == "interleaved_1f1b" or (schedule == "zero_bubble" and stages != 2 * pp)  # not ZBV
    if interleaved and accum > pp and accum % max(1, accum // pp):
        rounds = max(1, accum // pp)
        return f"needs a multiple of its rounds ({rounds} = accum steps // dist.pp.size={pp})"
    return None


def check_pp_window(cfg: Config, plan: BatchPlan) -> None:
    """The step's micro-batches serve the schedule, or a ConfigError naming batch.* and dist.pp.* and what would."""
    if plan.mesh.pp == 1:
        return
    pp, accum, glob, micro = cfg.dist.pp, plan.accum_steps, plan.global_batch_size, plan.micro_batch_size
    data_ranks = plan.mesh.data_ranks
    stages = pp.size * pp.stages_per_rank
    why = pp_window_need(pp.schedule, stages, pp.size, accum)
    if why is None:
        return
    fits = [n for n in range(1, 4 * max(accum, stages) + 1) if pp_window_need(pp.schedule, stages, pp.size, n) is None]
    near = sorted(fits, key=lambda n: (abs(n - accum), n))[:3]
    raise ConfigError(
        f"batch.accum_steps={accum} (global batch {glob} / ({data_ranks} data-parallel ranks x micro batch {micro})): "
        f"dist.pp.schedule={pp.schedule} with dist.pp.size={pp.size} x dist.pp.stages_per_rank={pp.stages_per_rank} "
        f"{why}. Valid accum steps near it: {sorted(near)}; set batch.global_batch_size (or batch.accum_steps, "
        "batch.micro_batch_size) to give one, or change dist.pp.*")


# The models context parallelism supports: the built-in GPT, and Hugging Face causal decoders (models.hf checks
# the layout and the attention when it builds: Llama's, full causal attention).
CP_MODELS = ("dist_trainer.models.GPT", "dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")


def check_cp(cfg: Config, mesh: MeshShape) -> None:
    """``dist.cp.*`` against the mesh and the model; a ConfigError before the first collective."""
    cp = cfg.dist.cp
    require(cp.method in ("ring", "ulysses"), "dist.cp.method", cp.method, "choose ring or ulysses")
    require(cp.layout in ("zigzag", "contiguous"), "dist.cp.layout", cp.layout, "choose zigzag or contiguous")
    if mesh.cp == 1:
        return
    require(mesh.ep == 1, "dist.cp.size", mesh.cp, f"with dist.ep.size={mesh.ep} is not supported yet: set one of "
            "them to 1")
    model = cfg.model
    require(model.get("_target_") in CP_MODELS and model.get("task", "causal_lm") == "causal_lm", "dist.cp.size",
            mesh.cp, f"supports the built-in GPT and Hugging Face causal decoders (model._target_ one of "
            f"{list(CP_MODELS[:2])}, model.task=causal_lm), not {model.get('_target_')}: set dist.cp.size=1")
    moe = model.get("moe") or {}
    require(not moe.get("num_experts") and not _hf_moe(model), "dist.cp.size", mesh.cp,
            "with MoE layers is not supported yet: set dist.cp.size=1")
    require(not model.get("dropout"), "model.dropout", model.get("dropout"),
            f"must be 0 with dist.cp.size={mesh.cp}: attention dropout is not split over the cp ranks")
    require(not cfg.data.get("packing"), "data.packing", True,
            f"with dist.cp.size={mesh.cp}: packed sequences restart their positions, and ring and ulysses "
            "attend causally over the whole row; set data.packing=false (padded batches work)")
    unit = (2 * mesh.cp if cp.layout == "zigzag" else mesh.cp) * mesh.tp  # parallel.cp.unit
    block = model.get("block_size")  # the GPT's learned positions: the padding to the unit must fit them
    require(model.get("_target_") != CP_MODELS[0] or (isinstance(block, int) and block % unit == 0), "data.block_size",
            block,
            f"must be a multiple of {unit} with dist.cp.size={mesh.cp} and dist.cp.layout={cp.layout} (each rank "
            + ("two chunks of every sequence" if cp.layout == "zigzag" else "one chunk of every sequence")
            + (f", cut into dist.tp.size={mesh.tp} sequence shards)" if mesh.tp > 1 else ")"))
    heads = model.get("n_head")
    # (a Hugging Face model's heads are checked when it is built: parallel.cp)
    require(cp.method != "ulysses" or heads is None or (isinstance(heads, int) and heads % (mesh.cp * mesh.tp) == 0),
            "dist.cp.method", cp.method, f"needs model.n_head={heads} divisible by dist.cp.size={mesh.cp}"
            + (f" x dist.tp.size={mesh.tp}" if mesh.tp > 1 else "") + " (each rank attends over n_head / cp heads"
            " of the whole sequence): use ring, or another cp size")


def _hf_moe(model: Dict[str, Any]) -> bool:
    """Whether a Hugging Face model's configuration names a mixture of experts (its type or expert count)."""
    config = model.get("config") or {}
    moe_keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return "moe" in str(model.get("model_type") or "") or any(config.get(k) for k in moe_keys)
