"""Validation: each feature's checks, run from explicit, ordered lists on the composed ``Config``.

This module sits above the features: it imports the checks from where each feature keeps them (none touches a
tensor or a process group) and runs them in a fixed order, so the first error a configuration meets is always the
same. ``validate`` is the one entry: the keys alone (``KEY_CHECKS``), the mesh derived once (``config.shapes``) and
the keys against it (``MESH_CHECKS``), the batch plan derived and the schedule against it (``PLAN_CHECKS``). A new
feature adds its check to its own module and one line to a list here.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional

from . import fp8
from .config import (ACCUM_SYNCS, LOGGER_PACKAGES, LOGGERS, LR_SCALINGS, NONFINITE_POLICIES, OPTIMIZERS, PRECISIONS,
                     RESHARDS, SCHEDULES, STRATEGIES, BatchConfig, BatchPlan, Config, ConfigError, MeshShape,
                     derive_batch, derive_mesh, require, resolve_reshard, scaled_lr)
from .data.mixture import check_blend, check_blend_mesh
from .data.streaming import check_streaming
from .models.loss import check_loss
from .moe.ep import check_ep_size
from .moe.routing import check_moe
from .optim.muon import check_muon
from .parallel.checks import check_cp, check_pp, check_pp_window, check_tp
from .rl.checks import check_publish, check_task, check_task_mesh, resolve_grpo_batch

log = logging.getLogger("dist_trainer")


def _check_ckpt_dir(ckpt_dir: Any) -> None:
    """A path, or a URL whose fsspec filesystem is installed (s3:// needs s3fs); never credentials in it."""
    require(ckpt_dir is None or (isinstance(ckpt_dir, str) and ckpt_dir.strip() != ""), "trainer.ckpt_dir", ckpt_dir,
            "a directory or an fsspec URL such as s3://bucket/prefix, or null (the run directory's checkpoints/)")
    if ckpt_dir is None or "://" not in ckpt_dir or ckpt_dir.startswith("file://"):
        return
    protocol, rest = ckpt_dir.split("://", 1)
    require("@" not in rest.split("/", 1)[0], "trainer.ckpt_dir", "<redacted>",
            "holds credentials; give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), never in "
            "the config, which is logged and saved")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"trainer.ckpt_dir={ckpt_dir!r}: no filesystem for {protocol}:// ({err}); install its "
                          "fsspec package (s3fs for s3://, pip install 'dist_trainer[s3]')") from None


def check_loggers(cfg: Config) -> None:
    """``logger``: known names, each one's package installed."""
    logger = cfg.logger
    names = [logger] if isinstance(logger, str) else logger
    require(isinstance(logger, str) or (isinstance(logger, (list, tuple)) and all(isinstance(n, str) for n in logger)),
            "logger", logger, "a name or a list of names, e.g. logger=[jsonl,wandb]")
    for name in names:
        require(name in LOGGERS, "logger", list(names), f"{name!r} is not one of {list(LOGGERS)}")
        package, extra = LOGGER_PACKAGES.get(name, (None, None))
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logger={list(names)} needs the {package} package: pip install -e '.[{extra}]' "
                              f"(or pip install {package})")


def check_precision(cfg: Config) -> None:
    """``precision.name`` and ``precision.loss_scale.*``."""
    p = cfg.precision
    require(p.name in PRECISIONS, "precision.name", p.name, f"choose one of {PRECISIONS}")
    ls = p.loss_scale
    require(ls.init_scale > 0, "precision.loss_scale.init_scale", ls.init_scale, "must be > 0")
    require(ls.growth_factor > 1, "precision.loss_scale.growth_factor", ls.growth_factor, "must be > 1")
    require(0 < ls.backoff_factor < 1, "precision.loss_scale.backoff_factor", ls.backoff_factor, "must be in (0, 1)")
    require(ls.growth_interval >= 1, "precision.loss_scale.growth_interval", ls.growth_interval, "must be >= 1")
    require(ls.hysteresis >= 1, "precision.loss_scale.hysteresis", ls.hysteresis, "must be >= 1")
    require(0 < ls.min_scale <= ls.init_scale, "precision.loss_scale.min_scale", ls.min_scale,
            "must be in (0, init_scale]")


def check_batch(cfg: Config) -> None:
    """``batch.partial_step`` (the batch sizes are checked as the plan is derived)."""
    require(cfg.batch.partial_step in ("mean", "scaled"), "batch.partial_step", cfg.batch.partial_step,
            "choose mean or scaled")


def check_optim(cfg: Config) -> None:
    """``optim.*``: the optimizer, its learning rate and schedule."""
    o = cfg.optim
    require(o.name in OPTIMIZERS, "optim.name", o.name, f"choose one of {OPTIMIZERS}")
    require(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    require(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", o.betas,
            "must be two values in [0, 1)")
    require(o.eps > 0, "optim.eps", o.eps, "must be > 0")
    require(o.momentum >= 0, "optim.momentum", o.momentum, "must be >= 0")
    require(o.lr_scaling in LR_SCALINGS, "optim.lr_scaling", o.lr_scaling, f"choose one of {LR_SCALINGS}")
    if o.lr_scaling != "none":
        require(o.base_batch_size is not None and o.base_batch_size >= 1, "optim.base_batch_size",
                o.base_batch_size, f"must be a positive batch size when optim.lr_scaling={o.lr_scaling}")
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    require(o.schedule in SCHEDULES, "optim.schedule", o.schedule, f"choose one of {SCHEDULES}")
    require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    require(o.grad_clip is None or o.grad_clip > 0, "optim.grad_clip", o.grad_clip, "must be > 0 or null")


def check_optim_state(cfg: Config) -> None:
    """``optim.state_dtype``: AdamW's moments between steps (``optim/lowmem.py``)."""
    o = cfg.optim
    require(o.state_dtype in ("fp32", "bf16", "int8"), "optim.state_dtype", o.state_dtype,
            "choose fp32, bf16 or int8 (torchao's 8-bit AdamW)")
    require(o.state_dtype == "fp32" or o.name == "adamw", "optim.state_dtype", o.state_dtype,
            f"is AdamW's (optim.name=adamw); optim.name={o.name} keeps its state in FP32: set optim.state_dtype=fp32")


def check_trainer(cfg: Config) -> None:
    """``trainer.*``: the run's length, cadences, checkpoints and device."""
    t = cfg.trainer
    # (an integer always: a streamed corpus's epoch is not known until read, and the run is as long as this says)
    require(isinstance(t.max_steps, int) and not isinstance(t.max_steps, bool) and t.max_steps >= 1,
            "trainer.max_steps", t.max_steps, "must be an integer >= 1")
    require(isinstance(t.compile, bool), "trainer.compile", t.compile, "must be true or false")
    require(t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1")
    require(t.eval_every >= 0, "trainer.eval_every", t.eval_every, "must be >= 0 (0 disables)")
    require(t.eval_batches >= 1, "trainer.eval_batches", t.eval_batches, "must be >= 1")
    require(t.ckpt_every >= 0, "trainer.ckpt_every", t.ckpt_every, "must be >= 0 (0: only at the end)")
    require(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
    require(isinstance(t.keep_every, int) and not isinstance(t.keep_every, bool) and t.keep_every >= 0,
            "trainer.keep_every", t.keep_every, "must be an integer >= 0 (0: only trainer.keep_checkpoints applies)")
    require(isinstance(t.ckpt_async, bool), "trainer.ckpt_async", t.ckpt_async, "must be true or false")
    _check_ckpt_dir(t.ckpt_dir)
    require(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "choose auto, cpu or cuda")
    require(t.tune_malloc in (True, False, "reuse", "bounded"), "trainer.tune_malloc", t.tune_malloc,
            "choose true, false, reuse or bounded")
    require(t.nonfinite in NONFINITE_POLICIES, "trainer.nonfinite", t.nonfinite, f"choose one of {NONFINITE_POLICIES}")
    require(t.max_consecutive_skips >= 1, "trainer.max_consecutive_skips", t.max_consecutive_skips, "must be >= 1")


def check_dist(cfg: Config) -> None:
    """``dist.*`` but its parallelisms (``parallel/checks.py``, ``moe/ep.py``), and ``plan.world_size``;
    dist.fsdp.reshard_after_forward is made dist.fsdp.reshard here, in place."""
    d = cfg.dist
    require(d.bucket_cap_mb is None or d.bucket_cap_mb > 0, "dist.bucket_cap_mb", d.bucket_cap_mb,
            "must be > 0 or null")
    require(d.check_consistency_every >= 0, "dist.check_consistency_every", d.check_consistency_every,
            "must be >= 0 (0 disables)")
    require(cfg.plan.world_size is None or cfg.plan.world_size >= 1, "plan.world_size", cfg.plan.world_size,
            "must be >= 1")
    require(d.timeout_s >= 1, "dist.timeout_s", d.timeout_s, "must be >= 1")
    require(d.init_timeout_s >= 1, "dist.init_timeout_s", d.init_timeout_s, "must be >= 1")
    st = d.step_timeout_s
    require(st == "auto" or (isinstance(st, (int, float)) and not isinstance(st, bool) and st >= 0),
            "dist.step_timeout_s", st, "choose auto, a number of seconds, or 0 (off)")
    require(d.strategy in STRATEGIES, "dist.strategy", d.strategy, f"choose one of {STRATEGIES}")
    require(d.fsdp.accum_sync in ACCUM_SYNCS, "dist.fsdp.accum_sync", d.fsdp.accum_sync,
            f"choose one of {ACCUM_SYNCS}")
    f = d.fsdp
    if f.reshard_after_forward is not None:
        implied = "micro_batch" if f.reshard_after_forward else "forward"
        require(f.reshard in ("auto", "micro_batch", implied), "dist.fsdp.reshard_after_forward",
                f.reshard_after_forward,
                f"is replaced by dist.fsdp.reshard and contradicts dist.fsdp.reshard={f.reshard}: drop it")
        log.warning("dist.fsdp.reshard_after_forward=%s is deprecated: it is dist.fsdp.reshard=%s now; set that",
                    f.reshard_after_forward, implied)
        f.reshard, f.reshard_after_forward = implied, None
    require(f.reshard in ("auto", *RESHARDS), "dist.fsdp.reshard", f.reshard, f"choose one of {('auto', *RESHARDS)}")
    require(isinstance(f.prefetch, int) and not isinstance(f.prefetch, bool) and f.prefetch >= 0,
            "dist.fsdp.prefetch", f.prefetch, "must be an integer >= 0 (units gathered ahead; 0: none)")
    require(f.shard_size is None or f.shard_size == "node" or
            (isinstance(f.shard_size, int) and not isinstance(f.shard_size, bool) and f.shard_size >= 1),
            "dist.fsdp.shard_size", f.shard_size, "must be null (all ranks), node, or a number of ranks >= 1")
    require(isinstance(d.meta_init, bool), "dist.meta_init", d.meta_init, "must be true or false")
    require(d.blocks is None or (isinstance(d.blocks, list) and all(isinstance(b, str) and b for b in d.blocks)),
            "dist.blocks", d.blocks, "must be a list of class names, or null for what the model declares")
    if d.strategy == "ddp":
        require(f.shard_size is None, "dist.fsdp.shard_size", f.shard_size,
                "shapes the shard groups of dist.strategy=fsdp (hsdp): set dist.strategy=fsdp, or drop it under ddp")
    if d.strategy == "fsdp":
        # Combinations fsdp does not support, named by both keys, before anything is built.
        require(not d.sync_batchnorm, "dist.sync_batchnorm", d.sync_batchnorm,
                "is not supported with dist.strategy=fsdp: set dist.sync_batchnorm=false or dist.strategy=ddp")
        require(d.check_consistency_every == 0, "dist.check_consistency_every", d.check_consistency_every,
                "compares whole replicas across ranks, and under dist.strategy=fsdp each rank holds a different "
                "shard: set dist.check_consistency_every=0 or dist.strategy=ddp")
        require(cfg.batch.micro_batch_size != "auto", "batch.micro_batch_size", "auto",
                "is not supported with dist.strategy=fsdp (its trials run the whole unsharded model on each "
                "rank): set an integer batch.micro_batch_size, or dist.strategy=ddp")


def check_data(cfg: Config) -> None:
    """``model._target_``, ``data._target_`` and the loader's keys of ``data``."""
    for node in ("model", "data"):
        target = getattr(cfg, node).get("_target_")
        require(isinstance(target, str) and bool(target), f"{node}._target_", target,
                "must name an importable callable (e.g. dist_trainer.models.GPT)")
    data = cfg.data
    require(isinstance(data.get("shuffle", True), bool), "data.shuffle", data.get("shuffle"), "must be true or false")
    require(isinstance(data.get("drop_last", False), bool), "data.drop_last", data.get("drop_last"),
            "must be true or false")
    workers = data.get("num_workers", 0)
    require(isinstance(workers, int) and workers >= 0, "data.num_workers", workers, "must be an integer >= 0")
    prefetch = data.get("prefetch_factor")
    require(prefetch is None or (isinstance(prefetch, int) and prefetch >= 1), "data.prefetch_factor", prefetch,
            "must be null (2 per worker) or an integer >= 1 (micro-batches each DataLoader worker keeps ready)")


def check_fp8(cfg: Config, mesh: MeshShape) -> None:
    """``precision.fp8.*`` against the rest of the configuration (``fp8.check``), after the mesh as it always ran."""
    fp8.check(cfg)


def check_optimizer_cuts(cfg: Config, mesh: MeshShape) -> None:
    """The optimizers against the mesh's cuts: Adafactor steps whole tensors, Muon's owner mode one cut dimension."""
    if cfg.optim.name == "adafactor":  # torch's steps plain tensors: its in-place norms fail on DTensor shards
        cut = [f"dist.strategy={cfg.dist.strategy}"] if mesh.kind != "ddp" else []
        cut += [f"dist.{k}.size={n}" for k, n in (("tp", mesh.tp), ("ep", mesh.ep)) if n > 1]
        require(not cut, "optim.name", "adafactor", f"steps whole tensors, and {' and '.join(cut)} cuts them into "
                "DTensor slices, which torch's Adafactor cannot step: use dist.strategy=ddp (pipeline stages too), "
                "or optim.name=adamw with optim.state_dtype=bf16 for less state")
    if cfg.optim.name == "muon" and cfg.optim.muon.dist == "owner":  # owner gathers over one cut dimension
        require(mesh.tp == 1 or mesh.kind == "ddp", "optim.muon.dist", "owner", f"cuts a matrix over one mesh "
                f"dimension, and dist.strategy={cfg.dist.strategy} with dist.tp.size={mesh.tp} cuts over two: set "
                "optim.muon.dist=gather")


# Each feature's checks, in the order they run. The keys alone, before the mesh is derived:
KEY_CHECKS = (check_precision, check_batch, check_optim, check_muon, check_optim_state, check_trainer, check_dist,
              check_tp, check_loggers, check_data, check_blend, check_streaming, check_pp, check_moe, check_task,
              check_publish)
# The keys against the mesh, once it is derived:
MESH_CHECKS = (check_ep_size, check_cp, check_loss, check_fp8, check_optimizer_cuts, check_task_mesh,
               check_blend_mesh)
# The keys against the batch plan, once it is derived:
PLAN_CHECKS = (check_pp_window,)


def _planned_batch(cfg: Config, world_size: int) -> BatchConfig:
    """``cfg.batch``; with batch.micro_batch_size=auto, the provisional plan's (micro batch 1) until the finder runs."""
    batch = cfg.batch
    if batch.micro_batch_size != "auto":
        return batch
    require(batch.global_batch_size is not None, "batch.global_batch_size", None,
            "must be set with batch.micro_batch_size=auto (the finder keeps it, and so the lr, fixed)")
    # Trials run the bare model rank by rank; synchronized BatchNorm would make each
    # forward a collective, and a rank out of memory would leave the others in it.
    require(not cfg.dist.sync_batchnorm, "batch.micro_batch_size", "auto",
            "cannot be used with dist.sync_batchnorm=true: set an integer batch.micro_batch_size")
    glob = batch.global_batch_size
    require(glob >= world_size and glob % world_size == 0, "batch.global_batch_size", glob,
            f"must be a positive multiple of the world size {world_size} with batch.micro_batch_size=auto")
    return BatchConfig(micro_batch_size=1, global_batch_size=glob)


def validate(cfg: Config, world_size: int, local_world_size: Optional[int] = None) -> BatchPlan:
    """Check every value and derive the batch plan and the mesh; raises ConfigError naming the key.

    ``local_world_size``: ranks per node (null: all ranks on one node).

    With batch.micro_batch_size=auto the plan is provisional (micro batch 1)
    until the finder has run; the global batch must then be given.
    """
    require(world_size >= 1, "world size", world_size, "must be >= 1")
    for check in KEY_CHECKS:
        check(cfg)
    # Keys left at auto get their value here, once, in place: what is built, planned and saved reads a mode.
    # (After the keys' checks: check_pp refuses an explicit micro_batch only, which auto never becomes there.)
    chosen = tuple(line for line in (resolve_reshard(cfg.dist), resolve_grpo_batch(cfg)) if line)
    batch = _planned_batch(cfg, world_size)
    mesh = derive_mesh(cfg.dist, world_size, local_world_size or world_size)
    for check in MESH_CHECKS:
        check(cfg, mesh)
    # The ranks of one tensor-parallel group see the same micro-batches: the split counts data-parallel ranks.
    cuts = ", ".join(f"dist.{k}.size={n}" for k, n in (("tp", mesh.tp), ("pp", mesh.pp), ("cp", mesh.cp)) if n > 1)
    ranks = "world size" if mesh.data_ranks == world_size else f"data-parallel ranks ({cuts})"
    accum, glob = derive_batch(batch, mesh.data_ranks, ranks)
    plan = BatchPlan(
        world_size=world_size,
        micro_batch_size=batch.micro_batch_size,
        accum_steps=accum,
        global_batch_size=glob,
        base_lr=cfg.optim.lr,
        lr=scaled_lr(cfg.optim, glob),
        max_steps=cfg.trainer.max_steps,
        mesh=mesh,
        chosen=chosen,
    )
    for check in PLAN_CHECKS:
        check(cfg, plan)
    return plan
