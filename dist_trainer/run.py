"""The orchestrator: build the parts once, then loop over optimizer steps."""

from __future__ import annotations

import gc
import json
import logging
import random
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from torch import nn

from . import checkpoint, distributed, hostmem, tracking
from .checkpoint import background
from .compiling import CompileWatch, eager_eval
from .config import BatchPlan, Config, ConfigError, logger_names
from .data import StepPlan, TrainLoader, build_dataset, eval_loader, plan_for
from .data.blend import Blend, source_figures
from .distributed import DistEnv
from .final import save_final_model
from .finder import find_micro_batch_size, largest_divisor_at_most, model_trial
from .health import stragglers, watchdog
from .health.watchdog import Watchdog
from .metrics import Outputs, peak_flops, peak_mem_mb
from .models import construct, pretrained
from .models.hf import TARGETS as HF_TARGETS
from .moe import inactive_params, routing_of
from .rl import build_objective, precompute
from .rl.publish import build_publisher
from . import fp8
from .optim import build_optimizer, optimizer_line
from .parallel import build_strategy, check_consistency
from .parallel.state import WholeTensors
from .plan import plan_numbers, write_plan_json
from .precision import Precision
from .signals import Preempted, StopRequest
from .trainer import StepOutcome, Trainer, loss_terms
from .validation import validate

log = logging.getLogger("dist_trainer")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, precision: Precision, device: torch.device,
             compiled: bool = False, context: Callable[[], Any] = nullcontext,
             pipeline: Optional[Callable[..., Any]] = None) -> float:
    """Item-weighted mean loss over the held-out batches of all ranks (eagerly, also when compiled).

    ``context``: the strategy's evaluation context (fsdp reshards what eval left gathered).
    """
    loss_sum, items = eval_totals(model, loader, precision, device, compiled, context, pipeline)
    return loss_sum / items if items else float("nan")


@torch.no_grad()
def eval_totals(model: nn.Module, loader: Any, precision: Precision, device: torch.device,
                compiled: bool = False, context: Callable[[], Any] = nullcontext,
                pipeline: Optional[Callable[..., Any]] = None) -> tuple[float, float]:
    """(summed loss, items) over the held-out batches of all ranks: ``evaluate``'s sums."""
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with context():
        if pipeline is not None:  # pipeline stages: the schedule runs the forward passes, the last stage the loss
            totals += torch.stack(pipeline([to_device(b, device) for b in loader], precision.autocast))
        else:
            for batch in loader:
                with precision.autocast(), eager_eval(compiled):
                    output = model(to_device(batch, device))
                loss_sum, items = loss_terms(output, batch, count=True)
                totals += torch.stack([loss_sum.double(), items.double().to(device)])
    dist.all_reduce(totals)  # every rank calls it, even one with no eval batches
    model.train()
    loss_sum, items = totals.tolist()
    return loss_sum, items


def eval_figures(evals: Dict[str, Any], totals_of: Callable[[Any], tuple[float, float]]) -> Dict[str, float]:
    """``eval_loss`` over every loader's items; with a blend's sources (name -> loader), each one's
    ``eval_loss.NAME`` too (token-weighted, its own held-out data)."""
    sums = {name: totals_of(loader) for name, loader in evals.items()}  # in order: every rank the same
    loss_sum, items = sum(s for s, _ in sums.values()), sum(n for _, n in sums.values())
    record = {"eval_loss": loss_sum / items if items else float("nan")}
    record.update({f"eval_loss.{name}": (s / n if n else float("nan")) for name, (s, n) in sums.items() if name})
    return record


def startup_report(plan: BatchPlan, env: DistEnv, cfg: Config, model: nn.Module,
                   step_plan: StepPlan, run_dir: Path) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (
        f"run dir {run_dir} | {env.world_size} rank(s) on {env.device.type} ({env.backend}) | "
        f"precision {cfg.precision.name} | {plan.mesh.describe()}\n"
        f"plan: {plan.describe()}\n"
        f"model {getattr(model, 'name', cfg.model['_target_'])}: {params:,} parameters | data {cfg.data['_target_']}: "
        + (f"{step_plan.num_samples} samples, {step_plan.steps_per_epoch} optimizer steps per epoch"
           if not hasattr(step_plan, "mixture") else  # data=blend: no epoch of the whole
           f"sources {step_plan.describe_sources()}, each wrapping on its own "
           "(plan mode prints each one's share and epochs)")
        + moe_line(model, plan)
        + (f"\noptimizer: {line}" if (line := optimizer_line(list(model.named_parameters()), cfg.optim)) else "")
        + (f"\nprecision {fp8.describe_converted(model, cfg.precision.name)}" if cfg.precision.name in fp8.RECIPES
           else "")
    )


def moe_line(model: nn.Module, plan: BatchPlan) -> str:
    """The MoE layers and what their balancing costs (nothing for a dense model)."""
    routing = routing_of(model)
    if not routing.layers:
        return ""
    layer, cfg = routing.layers[0], routing.cfg
    total = sum(p.numel() for p in model.parameters())
    line = (f"\nMoE: {len(routing.layers)} layers x {layer.num_experts} experts, top {layer.top_k}, "
            f"{total - inactive_params(model):,} of its {total:,} parameters active for a token | "
            f"aux {cfg.aux_coef} ({cfg.aux_scope}), z {cfg.z_coef}, bias update {cfg.bias_rate}")
    if routing.needs_prepass(plan.accum_steps, plan.data_ranks):
        line += (" | the global aux term counts the step's experts first: one forward pass without gradients "
                 "more per micro-batch (model.moe.aux_loss.scope=sequence needs none)")
    return line


def train(cfg: Config, run_dir: Path) -> Dict[str, Any]:
    """Train as configured; every rank calls this. Returns rank-local summary numbers."""
    plan = validate(cfg, distributed.world_size(), distributed.local_world_size())  # before any tensor is allocated
    if cfg.batch.micro_batch_size == "auto" and (cfg.trainer.device == "cpu" or not torch.cuda.is_available()):
        raise ConfigError("batch.micro_batch_size=auto measures GPU memory and needs a CUDA device; "
                          "on CPU set an integer batch.micro_batch_size")
    env = distributed.init(cfg.trainer.device, cfg.dist.init_timeout_s)
    watch = watchdog.start(cfg.dist.step_timeout_s, cfg.dist.init_timeout_s, env.rank, env.world_size)
    if cfg.trainer.tune_malloc and env.device.type == "cpu":
        mode = hostmem.mode_for(cfg.trainer.tune_malloc, plan.mesh)  # None: the user chose in the environment
        tuned = mode is not None and hostmem.keep_freed_memory(mode)  # before the model and data are allocated
        if env.is_main:
            log.info("host malloc: %s", hostmem.describe(mode) if tuned else
                     f"left as set ({hostmem.user_choice() or 'not glibc'})")
    finished = False
    try:
        summary = _train(cfg, plan, env, Path(run_dir), watch)
        finished = True
        return summary
    except Preempted as err:
        # Every rank stops here at the same step, its checkpoint written (the request is agreed in the step's
        # all-reduce). Say so before any rank leaves, and leave together (shutdown's barrier): torchrun's agent
        # stops the other workers as soon as one exits, which could cut this line off on a loaded machine.
        log.warning("%s", err)
        traceback.clear_frames(err.__traceback__)
        finished = True
        raise
    except BaseException as err:
        if watchdog.is_collective_failure(err):
            watch.collective_failed(err)  # names the step, the collective and who did not arrive; exits
        # The traceback's frames still hold the DDP object; clear them so it is
        # freed before the process group is destroyed (the other order can hang).
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        watch.close()
        gc.collect()
        distributed.shutdown(env, finished)


@dataclass
class Parts:
    """Everything the loop needs, built once before it."""

    trainer: Trainer
    step_plan: StepPlan
    train_set: Any
    eval_set: Any
    model_config: Dict[str, Any]  # cfg.model, resolved
    frozen: Optional[str] = None  # checkpoint.frozen_digest of the model as built: what checkpoints leave out
    model_seed: int = 0  # the seed the model was built with: an export rebuilds the same frozen weights
    built_on_meta: bool = False  # each rank materialised its own shards only (models.construct)
    load_host_peak_mb: Optional[float] = None  # what building or loading the model added to this rank's memory
    host_baseline_mb: Optional[float] = None  # what this rank held with its data ready, before the model


def build(cfg: Config, plan: BatchPlan, env: DistEnv) -> Parts:
    torch.manual_seed(cfg.trainer.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    train_set = build_dataset(cfg.data)
    # The ranks of a tensor-parallel group see the same micro-batches: the data follows the data-parallel rank.
    step_plan = plan_for(train_set, cfg, plan, plan.mesh.data_rank(env.rank))  # data before model
    eval_set = build_dataset(cfg.data, split="val") if "split" in cfg.data else None
    precision = Precision(cfg.precision, env.device)
    # Under fsdp, hsdp, tp and pp the model is built on the meta device and each rank materialises its shards.
    mesh = plan.mesh
    sharded = mesh.cuts_model and cfg.dist.meta_init
    whole = lambda: instantiate(cfg.model, _convert_="all")  # noqa: E731
    make, source = whole, None
    if sharded and cfg.model.get("pretrained") and cfg.model.get("_target_") in HF_TARGETS:  # its slices, each rank
        make = lambda: instantiate(cfg.model, _convert_="all", load_weights=False)  # noqa: E731
        source = pretrained.SafetensorsSource(Path(cfg.model["pretrained"]).expanduser(),
                                              lora=bool((cfg.model.get("lora") or {}).get("r")))
    # What building (or loading) the model adds to this rank's memory: built whole, the build and the wrapping;
    # on the meta device the shards' materialisation, which measures itself (the recording imports the model's
    # library and allocates nothing the model keeps).
    if cfg.precision.name in fp8.RECIPES:  # torchao's import is not the model's memory: before the measure
        fp8.import_torchao(cfg.precision.name)
    rng = torch.get_rng_state()  # the model's initial draws: a reference copy built later repeats them
    with hostmem.PhasePeak() as built:
        model, materialise = construct.build(make, sharded, env.device,
                                             log.warning if env.is_main else lambda _: None, whole, source)
        frozen = checkpoint.frozen_digest(model)  # before wrapping: whole tensors on every rank (None on meta)
        if cfg.precision.name in fp8.RECIPES:  # float8 linears first: every parallelism wraps them as it would a Linear
            fp8.convert(model, cfg.precision.fp8, cfg.precision.name, env.device.type)
        strategy = build_strategy(model, env, cfg.dist, mesh, precision, cfg.trainer.compile, materialise)
        # task=dpo: its reference (a copy: of the model as built; where the model is cut, built again and cut alike)
        copy_of = (lambda: reference_copy(cfg, env, strategy, precision, rng, sharded, (make, whole, source))
                   ) if mesh.cuts_model else None
        build_objective(cfg, strategy.module, copy_of, train_set, precision.autocast, mesh.cuts_model)
        if materialise is not None:  # a frozen base built on the meta device: its digest from the shards
            frozen = sharded_frozen_digest(strategy.module, env.device)
    # rl.reference=precomputed: each pair's values under the model as built (cached), carried by its samples
    train_set, eval_set = precompute.attach(cfg, strategy, precision, env.device, train_set, eval_set)
    load_mb = materialise.mb if materialise is not None else built.mb
    # The optimizer's tensors (FP32 masters in master modes) are the trainable parameters', in order.
    names = [n for n, p in strategy.module.named_parameters() if p.requires_grad]
    optimizer = build_optimizer(strategy.weights.optimizer_params(), cfg.optim, plan.lr, names)
    # FSDP2's float8 all-gather: each weight's scale agreed before its shards are cast, as ddp's cast takes it
    scales = (fp8.ScaleSync(strategy.module, optimizer, cfg.precision.fp8.pow2_scales)
              if cfg.precision.name in fp8.RECIPES and cfg.precision.fp8.all_gather else None)
    trainer = Trainer(strategy, optimizer, precision, env, plan, cfg.optim, cfg.trainer, cfg.batch.partial_step,
                      scales)
    trainer.sources = source_figures(train_set)  # data=blend: per-source loss and tokens in the step's all-reduce
    # Dropout and other runtime randomness per data-parallel rank: a tp group's ranks draw alike, so what
    # they hold whole (the residual stream without sequence parallelism) stays identical on each.
    # Python's and NumPy's generators too (a model or dataset may draw from them; checkpoints save all three):
    # two runs of one config start, and so stay, alike.
    seed = cfg.trainer.seed + plan.mesh.data_rank(env.rank)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    return Parts(trainer, step_plan, train_set, eval_set, dict(cfg.model), frozen, cfg.trainer.seed,
                 materialise is not None, load_mb, built.before_mb)


def reference_copy(cfg: Config, env: DistEnv, strategy: Any, precision: Precision, rng: torch.Tensor, sharded: bool,
                   builders: tuple) -> Any:
    """rl.reference=copy where the strategy cuts the model: the model built once more from the same draws (or
    files), frozen and sharded as the policy is (parallel.fsdp.FrozenShards); the policy's own state untouched."""
    from .parallel.fsdp import FrozenShards

    state = torch.get_rng_state()
    torch.set_rng_state(rng)
    make, whole, source = builders
    copy, materialise = construct.build(make, sharded, env.device, lambda _: None, whole, source)
    torch.set_rng_state(state)
    if cfg.precision.name in fp8.RECIPES:  # the policy's linears are float8: the copy's alike
        fp8.convert(copy, cfg.precision.fp8, cfg.precision.name, env.device.type)
    precision.fp32_norms(copy)
    return FrozenShards(copy, env, cfg.dist, strategy.mesh, precision, strategy.dmesh, materialise)


def sharded_frozen_digest(module: nn.Module, device: torch.device) -> Optional[str]:
    """checkpoint.frozen_digest of a model whose frozen parameters are shards (fsdp, tp): the same sha256 of the
    whole tensors, by sorted name, walked one whole tensor at a time on rank 0 (parallel.state.WholeTensors)
    and given to every rank. A digest a run wrote with the base built whole is equal to it."""
    frozen = dict(sorted((name, p) for name, p in module.named_parameters() if not p.requires_grad))
    if not frozen:
        return None
    # Every rank walks (each tensor's gather is a collective); only rank 0 is given the tensors, so only its
    # digest is of the base: the others' are of nothing, and the broadcast replaces them.
    digest = [checkpoint.digest_of(WholeTensors(frozen, {}, device))]
    dist.broadcast_object_list(digest, src=0)
    return digest[0]


def choose_micro_batch(cfg: Config, parts: Parts, env: DistEnv) -> BatchPlan:
    """Run the finder, then re-derive accum steps: the global batch and the lr stay as configured."""
    trainer = parts.trainer
    per_rank = trainer.plan.global_batch_size // env.world_size
    trial = model_trial(trainer.module, parts.train_set, trainer.precision.autocast,
                        trainer.weights.optimizer_params(), 2 if cfg.optim.name == "adamw" else 1, env.device)
    fits = find_micro_batch_size(trial, per_rank, env.device)
    if fits == 0:
        raise ConfigError("batch.micro_batch_size=auto: not even one sample fits in GPU memory; "
                          "use a smaller model or precision=bf16-master")
    cfg.batch.micro_batch_size = largest_divisor_at_most(per_rank, fits)
    plan = validate(cfg, env.world_size, env.local_world_size)
    if env.is_main:
        log.info("batch.micro_batch_size=auto: %d samples fit on every rank; using %d (divides %d per rank) "
                 "x accum steps %d", fits, plan.micro_batch_size, per_rank, plan.accum_steps)
    trainer.plan = plan
    parts.step_plan = plan_for(parts.train_set, cfg, plan, plan.mesh.data_rank(env.rank))
    return plan


@dataclass
class Position:
    """Where the run is: saved in every checkpoint, so a resume continues exactly."""

    step: int = 0  # optimizer steps done (skipped ones included)
    epoch: int = 0
    step_in_epoch: int = 0  # steps of ``epoch`` done
    samples: int = 0


def _train(cfg: Config, plan: BatchPlan, env: DistEnv, run_dir: Path, watch: Watchdog) -> Dict[str, Any]:
    parts = build(cfg, plan, env)
    model = parts.trainer.module
    if cfg.batch.micro_batch_size == "auto":
        plan = choose_micro_batch(cfg, parts, env)
    numbers: Dict[str, Any] = {}  # plan.json's, on rank 0
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        log.info(startup_report(plan, env, cfg, model, parts.step_plan, run_dir))
        # What every full step's collectives and state will be, for a tool to compare with metrics.jsonl.
        # From the built model: the meta device's first initialisation costs seconds (torch's refs).
        numbers = plan_numbers(cfg, plan, model, parts.host_baseline_mb if env.device.type == "cpu" else None)
        write_plan_json(numbers, run_dir / "plan.json")
    report_host_memory("load", parts.load_host_peak_mb, numbers.get("load_host_peak_mb"), run_dir, env)
    if cfg.trainer.ckpt_async:  # before training: a copy that cannot fit must not start
        problem = [background.host_memory_problem(numbers["ckpt_staging_mb"], env.local_world_size,
                                                  hostmem.available_bytes()) if env.is_main else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise ConfigError(problem[0])
    ckpt_root = checkpoint.checkpoint_dir(run_dir, cfg.trainer.ckpt_dir)  # local, or object storage
    position = resume(parts, plan, env, ckpt_root, cfg.trainer.seed, cfg.trainer.keep_checkpoints,
                      cfg.trainer.keep_every)
    trackers = start_trackers(cfg, plan, numbers, run_dir, env.is_main, position.step)
    outputs = Outputs(run_dir, env.is_main, logger_names(cfg.logger), plan.max_steps, position.step,
                      cfg.trainer.log_every, trackers)
    stop = StopRequest()
    hosts = stragglers.gather_hosts(env.world_size)
    tcfg = cfg.trainer
    saves = background.build(env, tcfg.keep_checkpoints, tcfg.keep_every, tcfg.ckpt_async, cfg.dist.timeout_s)
    publisher = build_publisher(cfg.rl.publish, parts.trainer.strategy, model, run_dir, env)
    try:
        summary = _loop(cfg, parts, position, outputs, stop, ckpt_root, watch, hosts, saves, publisher)
    finally:
        saves.close()
        stop.close()
        outputs.close()
        if isinstance(parts.train_set, Blend):  # a streaming source's reader stops reading ahead
            parts.train_set.close()
    watch.begin("final", position.step)
    # Every rank walks the model tensor by tensor; rank 0 writes final_model.pt and hf_model/.
    with hostmem.PhasePeak() as export:  # what writing the final model adds to this rank's memory
        save_final_model(parts.trainer.strategy, model, run_dir, env, position.step)
    report_host_memory("export", export.mb, numbers.get("export_host_peak_mb"), run_dir, env)
    if env.device.type == "cpu":  # on CUDA the steps' tensors are the device's, and peak_mem_mb says so
        report_host_memory("run", hostmem.run_peak_mb(), numbers.get("run_host_peak_mb"), run_dir, env)
    trackers.finish(tracking.final_artifacts(run_dir, cfg.logging.hf_model_artifact) if trackers.backends else [])
    return summary


def report_host_memory(phase: str, mb: Optional[float], predicted: Optional[float], run_dir: Path,
                       env: DistEnv) -> None:
    """Every rank's measured host memory of a phase (load, export: what it added; run: the process's whole
    peak) into host_memory.json; rank 0 logs the most."""
    every: list = [None] * env.world_size
    dist.all_gather_object(every, mb)  # every rank takes part
    if not env.is_main or any(v is None for v in every):
        return
    path = run_dir / "host_memory.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record[f"{phase}_host_peak_mb"] = every
    path.write_text(json.dumps(record))
    rank = max(range(len(every)), key=every.__getitem__)
    what = "the run's peak host memory" if phase == "run" else f"host memory added by the model's {phase}"
    log.info("%s: %.0f MiB on rank %d, the most of any rank%s", what, every[rank], rank,
             f" (plan: {predicted:.0f} MiB)" if predicted is not None else "")


def start_trackers(cfg: Config, plan: BatchPlan, numbers: Dict[str, Any], run_dir: Path, is_main: bool,
                   resumed_step: int) -> "tracking.Trackers":
    """W&B and MLflow (logger=[...]), on rank 0: the config as flat keys, plan.json's ``numbers`` as the summary."""
    trackers = tracking.build(logger_names(cfg.logger), cfg, run_dir, is_main, resumed_step)
    if trackers.backends:
        summary = {key: numbers[key] for key in ("world_size", "micro_batch_size", "accum_steps", "global_batch_size",
                                                 "parameters", "state_mb")}
        if "block_size" in cfg.data:
            summary["tokens_per_step"] = plan.global_batch_size * cfg.data["block_size"]
        trackers.start(tracking.flatten(asdict(cfg)), summary)
    return trackers


def resume(parts: Parts, plan: BatchPlan, env: DistEnv, ckpt_root: checkpoint.Location, seed: int, keep: int = 3,
           keep_every: int = 0) -> Position:
    """Load the newest valid checkpoint of the run's checkpoint directory, if there is one."""
    if env.is_main:
        checkpoint.clean_up(ckpt_root, keep, keep_every)
    loaded = checkpoint.load_latest(ckpt_root, env)
    if loaded is None:
        return Position()
    shared, rng, path = loaded
    saved_global = shared["plan"]["global_batch_size"]
    if saved_global != plan.global_batch_size:
        raise ConfigError(
            f"batch.global_batch_size={plan.global_batch_size} on {env.world_size} ranks, but the checkpoint in "
            f"{ckpt_root} was trained with a global batch of {saved_global}: set batch.global_batch_size="
            f"{saved_global} (accum steps are re-derived for the new world size), or start a new run directory"
        )
    checkpoint.check_frozen(shared.get("frozen"), parts.frozen, path)
    shards = path / checkpoint.SHARDS
    parts.trainer.load_checkpoint_state(shared["trainer"], shards if shards.is_dir() else None)
    position = Position(**shared["loop"])
    if hasattr(parts.step_plan, "resume_from"):  # data=blend: the same blend, or data.blend.allow_change
        parts.step_plan.resume_from(shared.get("blend"), position.step)
    if rng is not None:
        checkpoint.restore_rng(rng, env.device)
    else:  # more ranks than when it was saved: a fresh, distinct stream per rank
        log.warning("no saved RNG state for rank %d; seeding it from trainer.seed", env.rank)
        torch.manual_seed(seed + env.rank + 1_000_003 * position.step)
    return position


def checkpoint_state(parts: Parts, position: Position) -> tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """(what rank 0 writes into shared.pt, the sharded tensors every rank writes its part of, or None)."""
    trainer_state, sharded = parts.trainer.checkpoint_state()
    # model_config: what rebuilds the model from this checkpoint alone (python -m dist_trainer.export)
    shared = {"trainer": trainer_state, "loop": asdict(position), "plan": asdict(parts.trainer.plan),
              "model_config": parts.model_config, "frozen": parts.frozen, "model_seed": parts.model_seed}
    if hasattr(parts.step_plan, "checkpoint_state"):  # data=blend: its sources, weights and each one's position
        shared["blend"] = parts.step_plan.checkpoint_state(position.step)
    return shared, sharded


def save_with_record(saves: background.BlockingSaves, ckpt_root: checkpoint.Location, parts: Parts,
                     position: Position, final: bool, record: Dict[str, Any], outputs: Outputs) -> None:
    """The step's checkpoint, and its record with the save's figures.

    The record is written as soon as the save lets the step go on (its files
    written, or staged), before any seal: a sealed checkpoint always has its
    step's record, which a resume keeps. It is written even if the save fails.
    """
    pending = [record]
    try:
        saves.save(ckpt_root, position.step, *checkpoint_state(parts, position), final,
                   lambda figures: outputs.write({**pending.pop(), **figures}))
    finally:
        if pending:
            outputs.write(pending.pop())


def _loop(cfg: Config, parts: Parts, position: Position, outputs: Outputs, stop: StopRequest,
          ckpt_root: checkpoint.Location, watch: Watchdog, hosts: list,
          saves: background.BlockingSaves, publisher: Any) -> Dict[str, Any]:
    trainer, eval_set = parts.trainer, parts.eval_set
    env, plan, tcfg = trainer.env, trainer.plan, cfg.trainer
    num_workers = cfg.data.get("num_workers", 0)
    pin = env.device.type == "cuda"
    # Not "eval_set and loader": a DataLoader with no batches is falsy, and a rank left
    # without held-out samples must still join evaluate()'s all-reduce.
    # A blend's held-out data: each source's own (eval_loss.NAME), the first eval_batches of each.
    held_out = {"": eval_set} if not isinstance(eval_set, Blend) else dict(zip(eval_set.names, eval_set.datasets))
    evals = (None if eval_set is None else
             {name: eval_loader(held, plan.micro_batch_size, tcfg.eval_batches, plan.mesh.data_rank(env.rank),
                                plan.data_ranks, num_workers, lockstep=plan.mesh.ep > 1 or plan.mesh.cuts_model)
              for name, held in held_out.items()})
    # One loader for the run: with data.num_workers > 0 its workers start once and serve every epoch.
    loader = TrainLoader(parts.train_set, parts.step_plan, num_workers, pin, cfg.data.get("prefetch_factor"))
    compiles = CompileWatch(tcfg.compile, env.is_main)
    mfu_basis = _peak_model_flops(trainer)  # looked up once: neither changes during the run
    lagging = stragglers.StragglerWatch(hosts, env.is_main)
    record: Dict[str, Any] = {}
    steps_here = 0  # steps of this attempt
    tick = time.perf_counter()
    watch.begin("step", position.step + 1)  # its data wait first
    while position.step < plan.max_steps:
        for window, batches in loader.epoch(position.epoch, position.step_in_epoch):
            fetched = time.perf_counter()  # the wait for this step's micro-batches ends here
            watch.computing()
            step = position.step + 1
            outcome = trainer.train_step([to_device(b, env.device) for b in batches], window, step,
                                         stop_requested=lambda: stop.requested, data_time_s=fetched - tick,
                                         busy=saves.busy)
            steps_here += 1
            if steps_here == 1:  # start-up is over: later collectives get dist.timeout_s
                distributed.set_timeout(cfg.dist.timeout_s, trainer.strategy.groups)
                watch.training_collectives(cfg.dist.timeout_s)
            position.step, position.step_in_epoch = step, position.step_in_epoch + 1
            position.samples += outcome.samples
            now = time.perf_counter()
            record = step_record(outcome, position, trainer, now - tick, fetched - tick, mfu_basis)
            record.update(compiles.after_step(step, now - tick) or {})
            record.update(stragglers.figures(outcome.data_times, outcome.compute_times))
            lagging.after_step(step, steps_here, outcome.data_times, outcome.compute_times)
            last = step == plan.max_steps
            if evals is not None and ((tcfg.eval_every and step % tcfg.eval_every == 0) or last):
                watch.begin("eval", step)
                record.update(eval_figures(evals, lambda held: eval_totals(
                    trainer.module, held, trainer.precision, env.device, tcfg.compile, trainer.strategy.evaluation,
                    getattr(trainer.strategy, "eval_window", None))))
            if publisher.due(step, last):  # rl.publish: the inference server gets this step's weights
                watch.begin("publish", step)
                record["publish_s"] = publisher.publish(step)
            # A background save whose write ended on every rank: sealed (its write time), or raised here.
            record.update(saves.after_step(outcome.busy))
            if last or outcome.stop_requested or (tcfg.ckpt_every and step % tcfg.ckpt_every == 0):
                watch.begin("checkpoint", step)
                save_with_record(saves, ckpt_root, parts, position, last or outcome.stop_requested, record, outputs)
            else:
                outputs.write(record)
            if cfg.dist.check_consistency_every and step % cfg.dist.check_consistency_every == 0:
                watch.begin("check", step)
                check_consistency(trainer.consistency_tensors(), step)
            if outcome.stop_requested and not last:  # at the last step, just finish
                raise Preempted(f"step {step}: stop requested by a signal; checkpoint written, "
                                "start again in the same run directory to resume", stop.signum)
            tick = time.perf_counter()  # evaluation and checkpoint time is not step time
            if last:
                break
            watch.begin("step", step + 1)
        else:
            position.epoch, position.step_in_epoch = position.epoch + 1, 0
    return {"steps": position.step, "updates": trainer.updates, "samples": position.samples,
            "loss": record.get("loss"), "eval_loss": record.get("eval_loss")}


def _peak_model_flops(trainer: Trainer) -> Optional[tuple[float, float]]:
    """(model FLOPs per item, peak FLOP/s of all ranks), or None where MFU cannot be known."""
    # Under pipeline stages a rank holds part of the model: its own count is not the model's (no mfu then).
    flops = getattr(trainer.module, "flops_per_item", None) if trainer.plan.mesh.pp == 1 else None
    peak = peak_flops(trainer.env.device, trainer.precision.autocast_dtype is not None)
    if not callable(flops) or not peak:
        return None
    return flops(), peak * trainer.env.world_size


def step_record(outcome: StepOutcome, position: Position, trainer: Trainer, step_time: float,
                data_time: float, mfu_basis: Optional[tuple[float, float]]) -> Dict[str, Any]:
    env = trainer.env
    record = {
        "step": position.step, "epoch": position.epoch, "loss": outcome.loss, "lr": outcome.lr,
        "grad_norm": outcome.grad_norm, "loss_scale": outcome.loss_scale, "skipped": outcome.skipped,
        "skip_reason": outcome.skip_reason,
        "skipped_total": trainer.skipped_total, "updates": trainer.updates, "samples": position.samples,
        "items": outcome.items, "allreduces": outcome.allreduces, "allreduce_bytes": outcome.allreduce_bytes,
        **{k: v for k, v in outcome.comm.items() if k not in ("allreduces", "allreduce_bytes")},
        "state_mb": outcome.state_mb, "step_peak_state_mb": outcome.step_peak_state_mb,
        "step_time_s": step_time, "data_time_s": data_time, "compute_time_s": step_time - data_time,
        "samples_per_s": outcome.samples / step_time, "items_per_s": outcome.items / step_time,
        "peak_mem_mb": peak_mem_mb(env.device),
        **outcome.moe,  # MoE: aux_loss, z_loss, expert_tokens, expert_load_max, dead_experts
        **outcome.rl,  # task=dpo: rewards/chosen, rewards/rejected, rewards/accuracies, ... (rl.dpo.FIGURES)
        **outcome.sources,  # data=blend: source_loss.NAME, source_tokens.NAME
    }
    if outcome.pp_idle_times:  # pipeline stages: each stage group's idle seconds (its slowest rank's), measured
        mesh, per = trainer.plan.mesh, trainer.plan.mesh.stage_ranks
        groups = range(mesh.pp)
        record["pp_idle_s"] = [max(outcome.pp_idle_times[g * per:(g + 1) * per]) for g in groups]
        record["pp_idle_frac"] = [max(i / max(w, 1e-9) for i, w in zip(outcome.pp_idle_times[g * per:(g + 1) * per],
                                                                    outcome.pp_schedule_times[g * per:(g + 1) * per]))
                                  for g in groups]
        record["pp_bubble"] = trainer.strategy.bubble
        record["pp_inflight"] = [int(max(outcome.pp_inflight[g * per:(g + 1) * per])) for g in groups]
    if outcome.item_form and getattr(trainer.module, "items_are_tokens", False):
        record["tokens_per_s"] = record["items_per_s"]  # the model says its items are tokens
    if mfu_basis is not None:
        per_item, peak = mfu_basis
        record["mfu"] = per_item * record["items_per_s"] / peak
    return record
