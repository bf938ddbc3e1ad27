"""Typed configuration and the batch plan.

Hydra composes the YAML groups in ``conf/`` against the dataclasses below (so a
misspelled key or a wrong type fails at composition, naming the key). Below the
entry point nothing sees Hydra: ``validate`` turns the composed tree into a
checked ``Config`` and derives the ``BatchPlan`` before any tensor exists.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "fp8-rowwise", "fp8-rowwise-gw-hp",
              "fp8-tensorwise", "fp8-mxfp8")


def master_mode(precision: "PrecisionConfig") -> bool:
    """Whether the precision keeps FP32 masters beside half weights: *-master, and the fp8 modes over bf16 compute
    (bf16-master's weights with float8 matmuls; over fp32 compute they have FP32 weights only)."""
    name = precision.name
    return name.endswith("-master") or (name.startswith("fp8-") and precision.fp8.compute == "bf16")
OPTIMIZERS = ("adamw", "sgd", "muon", "adafactor")
LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("constant", "cosine")
NONFINITE_POLICIES = ("stop", "skip")
STRATEGIES = ("ddp", "fsdp")
ACCUM_SYNCS = ("last", "every")
RESHARDS = ("micro_batch", "forward", "step")  # what FSDP does; dist.fsdp.reshard=auto becomes one in validate
# Keys of the data node that the framework owns; they never reach the dataset.
LOADER_KEYS = ("shuffle", "drop_last", "num_workers", "prefetch_factor")


log = logging.getLogger("dist_trainer")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


@dataclass
class BatchConfig:
    # samples per rank per forward/backward; "auto" (CUDA) finds the largest that fits
    micro_batch_size: Any = 16
    global_batch_size: Optional[int] = None  # samples per optimizer step, all ranks
    accum_steps: Optional[int] = None  # micro-batches per optimizer step
    # The epoch's last step when it holds fewer samples (data.drop_last=false):
    # "mean" averages over what it holds, like every step; "scaled" also multiplies
    # its gradient by held / global_batch_size, so every sample of the epoch
    # weighs the same in the sum of updates.
    partial_step: str = "mean"


@dataclass
class LossScaleConfig:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000  # good steps before the scale grows
    hysteresis: int = 1  # back off on the hysteresis-th overflow since the scale last changed (1: every one)
    min_scale: float = 1.0  # backing off below this stops training


@dataclass
class Fp8Config:
    """precision.fp8: the float8 modes' keys (precision=fp8-*; dist_trainer/fp8.py)."""

    filter: Optional[List[str]] = None  # linear name patterns kept in bf16; null: the head and dims not % 16
    emulate: Any = "auto"  # auto: emulated where there are no float8 matmuls (CPU, GPUs before sm89); true, false
    pow2_scales: bool = True  # scales rounded to powers of two (split-invariant); false: tensorwise only
    all_gather: bool = False  # fsdp/hsdp with fp8-tensorwise: FSDP2 gathers the weights in float8 (ddp's scales)
    # What runs outside the float8 matmuls: bf16 (bf16-master's weights and autocast: each micro-batch's gradients
    # are rounded to bf16, split-invariant to bf16's rounding) or fp32 (FP32 weights, no autocast: to 1e-7)
    compute: str = "bf16"


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16 modes only
    debug_overflow: bool = False  # on a skipped step, log parameters with non-finite grads


@dataclass
class MuonConfig:
    """optim.muon: Muon's keys (optim.name=muon), for the hidden layers' matrices; the rest take AdamW's optim.*."""

    lr: float = 0.02  # before the schedule and batch-size scaling, which it follows as optim.lr does
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: str = "fp32"  # fp32 or bf16 (torch.optim.Muon's: faster, not split-invariant)
    adjust_lr: str = "original"  # original: sqrt(max(1, rows/cols)); match_rms_adamw: 0.2 sqrt(max(rows, cols))
    # fnmatch patterns of parameter names that take AdamW although 2-D: embeddings, positions, the head
    exclude: List[str] = field(default_factory=lambda: ["*emb*", "*wte*", "*wpe*", "*head.weight"])
    # Cut matrices (fsdp, tp): gather (every rank all-gathers each and orthogonalises all) or owner (each gathered
    # on one rank of its group, orthogonalised there, scattered back: a group-size-th of the iterations a rank)
    dist: str = "gather"


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3  # before scaling for the effective batch
    weight_decay: float = 0.0  # applied to matrices and embeddings only
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    # Adam's eps is added in the FP32 optimizer state (parameters seen by the
    # optimizer are always FP32), so 1e-8 does not underflow as it would in fp16.
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    lr_scaling: str = "none"
    base_batch_size: Optional[int] = None  # global batch the base lr was tuned for
    warmup_steps: int = 0  # optimizer updates of linear warmup
    schedule: str = "constant"
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of the peak lr
    grad_clip: Optional[float] = 1.0  # max global norm of unscaled grads; null disables
    # null: fused AdamW on CUDA, torch's default elsewhere (the per-parameter loop on CPU);
    # true/false forces fused on or off (fused on CPU: 3x faster steps, rounding-level differences).
    fused: Optional[bool] = None
    muon: MuonConfig = field(default_factory=MuonConfig)
    # AdamW's moments between steps: fp32 (8 bytes a parameter), bf16 (4; updated in FP32, stored rounded) or int8
    # (about 2: torchao's block-wise quantised AdamW8bit, for tensors of 4096 elements or more)
    state_dtype: str = "fp32"


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps (windows), skipped ones included
    seed: int = 0
    log_every: int = 10  # console cadence, optimizer steps
    eval_every: int = 100  # optimizer steps; 0 disables periodic eval
    eval_batches: int = 10  # micro-batches per rank per evaluation
    device: str = "auto"  # auto | cpu | cuda
    ckpt_every: int = 100  # optimizer steps between checkpoints (and one at the end); 0: only at the end
    keep_checkpoints: int = 3  # newest checkpoints kept
    keep_every: int = 0  # also keep, never pruned, every checkpoint whose step is a multiple of this; 0: none
    # Checkpoints but the last are copied into host memory at their step and written by a background
    # thread while training goes on (checkpoint/background.py); false: every save blocks until sealed.
    ckpt_async: bool = False
    # Where checkpoints go: a directory, or an fsspec URL (s3://bucket/prefix; credentials and endpoint from
    # the environment, as the client reads them). null: the run directory's checkpoints/.
    ckpt_dir: Optional[str] = None
    nonfinite: str = "stop"  # fp32/bf16 non-finite gradients: stop or skip the step
    max_consecutive_skips: int = 10  # with nonfinite=skip
    # CPU runs on glibc (dist_trainer/hostmem.py): reuse (every freed block kept in the heap: no step
    # page-faults), bounded (blocks from 1 MiB up returned when freed: a sharded model's steps cannot fragment
    # the heap past its plan), true (bounded when the model is cut across ranks, else reuse), false (as set).
    tune_malloc: Any = True
    # torch.compile the model block by block (dist.blocks), or whole where it declares none
    compile: bool = False


@dataclass
class FSDPConfig:
    # last: reduce-scatter once per optimizer step, with the last micro-batch (the unsharded
    # gradient is kept between micro-batches); every: with every micro-batch (less memory).
    accum_sync: str = "last"
    # When a unit's gathered parameters are freed: micro_batch (after each forward and each
    # backward: 2K all-gathers per unit for K micro-batches), forward (kept from a micro-batch's
    # forward to its backward: K), step (kept from the step's first forward to its last backward: 1);
    # auto: micro_batch where the mesh supports it, else forward (pipeline stages), chosen in validate.
    reshard: str = "auto"
    # Ranks in one shard group: null (all), "node" (the local world size: shard within a node,
    # replicate across nodes, i.e. hsdp) or a divisor of the world size.
    shard_size: Any = None
    prefetch: int = 1  # units gathered ahead in forward and backward; 0: none (each unit gathered when it runs)
    reshard_after_forward: Optional[bool] = None  # deprecated: true is reshard=micro_batch, false reshard=forward


TP_STYLES = ("colwise", "rowwise", "sequence_parallel", "replicate", "head_norm")


@dataclass
class TPConfig:
    # Tensor-parallel degree: ranks that cut each layer between them (the innermost mesh dimension:
    # consecutive ranks, one node's when it divides the node). 1: none.
    size: int = 1
    # auto: the model's own plan (the built-in GPT's tp_plan, a Hugging Face model's
    # base_model_tp_plan); or a mapping of module-name patterns (* matches one name) to a style.
    plan: Any = "auto"
    # Norms and dropout on sequence shards between the parallel regions: activations cut by size too.
    sequence_parallel: bool = True
    # The cross-entropy on vocabulary shards where the head is column-wise (no gathered logits).
    loss_parallel: bool = True


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


def pp_v_shape(pp: "PPConfig") -> bool:
    """Whether the stages are placed in a V (ZBV: zero_bubble with 2 stages a rank), not a loop."""
    return pp.schedule == "zero_bubble" and pp.stages_per_rank == 2


@dataclass
class PPConfig:
    # Pipeline stages (the outermost mesh dimension); 1: none. The step's micro-batches
    # (batch.accum_steps) are the pipeline's.
    size: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    # Stages each rank holds: 1 for gpipe and 1f1b; 2 or more for interleaved_1f1b; zero_bubble
    # with 2 is the V schedule (ZBV), with more the interleaved zero-bubble one.
    stages_per_rank: int = 1
    # auto: the blocks cut evenly (the embedding with the first stage, the head and loss with the
    # last); or the names of the blocks where stages 1, 2, ... begin (e.g. [blocks.2]).
    split: Any = "auto"


@dataclass
class EPConfig:
    # Expert-parallel degree (1: none), taken from the data-parallel ranks: each group of this many consecutive
    # data ranks splits every MoE layer's routed experts between them, tokens reaching them by all-to-all.
    size: int = 1


@dataclass
class CPConfig:
    # Context-parallel degree (1: none): each group of this many consecutive data-parallel ranks splits every
    # sequence's tokens between them (parallel/cp.py); they see the same sequences, their gradients are reduced
    # with the others' (fsdp shards over them too).
    size: int = 1
    method: str = "ring"  # ring: keys and values passed around the group | ulysses: all-to-all of heads
    layout: str = "zigzag"  # zigzag: chunks r and 2 cp - 1 - r (equal causal work) | contiguous


@dataclass
class DistConfig:
    strategy: str = "ddp"  # ddp | fsdp
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    pp: PPConfig = field(default_factory=PPConfig)
    ep: EPConfig = field(default_factory=EPConfig)
    cp: CPConfig = field(default_factory=CPConfig)
    # Class names of the model's repeated blocks (FSDP units, activation checkpointing);
    # null: what the model declares in _no_split_modules.
    blocks: Optional[List[str]] = None
    # fsdp, hsdp, tp, pp: build the model on the meta device and materialise each rank's shards only
    # (dist_trainer/models/construct.py); false: build it whole on every rank first, then shard it.
    meta_init: bool = True
    activation_checkpointing: bool = False
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    bucket_cap_mb: Optional[float] = None  # null = DDP's own default
    # ddp: gradients are views of the all-reduce buckets (one gradient-sized copy less);
    # always off with find_unused_parameters
    gradient_as_bucket_view: bool = True
    # A step (or evaluation, checkpoint) running longer than this is a hang: the run stops in
    # seconds and names the ranks that did not arrive (health/watchdog.py). auto | seconds | 0 (off)
    step_timeout_s: Any = "auto"
    init_timeout_s: int = 1800  # the collectives' timeout until the first step has finished (start-up, loading)
    timeout_s: int = 1800  # each later collective's timeout
    check_consistency_every: int = 0  # optimizer steps; 0 disables the cross-rank bit-equality check


@dataclass
class PlanConfig:
    only: bool = False  # print the plan and exit: no process group, no training
    world_size: Optional[int] = None  # plan for this many ranks (default: the launch's)
    nproc_per_node: Optional[int] = None  # ranks per node, for dist.fsdp.shard_size=node (default: the launch's)


@dataclass
class WandbConfig:
    """logging.wandb.*: null leaves a key to wandb, which reads WANDB_PROJECT, WANDB_ENTITY, ... itself."""

    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None  # null: the run directory's name
    tags: List[str] = field(default_factory=list)
    group: Optional[str] = None
    mode: Optional[str] = None  # online | offline | disabled


@dataclass
class MlflowConfig:
    """logging.mlflow.*: null reads MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME."""

    tracking_uri: Optional[str] = None
    experiment: Optional[str] = None  # null and no MLFLOW_EXPERIMENT_NAME: dist_trainer
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    hf_model_artifact: bool = False  # also upload hf_model/ at the end (the report's PNGs always go)


LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# The package each tracker needs, and the extra that brings it.
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                   "mlflow": ("mlflow", "mlflow")}


def logger_names(logger: Any) -> List[str]:
    """``logger`` as a list: a single name (logger=tensorboard) or a list (logger=[jsonl,wandb]); jsonl always."""
    names = [logger] if isinstance(logger, str) else list(logger)
    return ["jsonl"] + [n for n in names if n != "jsonl"]


@dataclass
class Config:
    model: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)
    batch: BatchConfig = field(default_factory=BatchConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # jsonl (always written), tensorboard, wandb, mlflow: a name or a list, e.g. logger=[jsonl,wandb]
    logger: Any = "jsonl"
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass(frozen=True)
class MeshShape:
    """The shape of the world, decided once (``derive_mesh``) and handed to the strategy.

    ``pp`` x ``replicate`` x ``shard`` x ``tp`` = world size, pp outermost, tp
    innermost: rank ``((p * replicate + r) * shard + s) * tp + t`` is
    tensor-parallel rank ``t`` of data-parallel rank ``r * shard + s`` in
    pipeline stage group ``p``. The ``pp`` ranks that differ in ``p`` alone hold
    the model's stages and see the same micro-batches. The ``tp`` ranks of one group cut each layer between
    them and see the same micro-batches; the data-parallel ranks
    (``replicate`` x ``shard``) see different ones. Data-parallel ranks
    ``r * shard ... r * shard + shard - 1`` form shard group ``r`` (consecutive:
    one node's under ``shard_size=node``); rank ``s`` of every group holds the
    same shard. ddp shards nothing (shard 1).

    ``ep`` divides the data-parallel ranks without multiplying the world (torchtitan's layout): data ranks
    ``g * ep ... g * ep + ep - 1`` form expert-parallel group ``g``, each holding 1/ep of every MoE layer's routed
    experts (rank ``i`` of a group the ``i``-th slice); the ranks with the same ``i`` in every group hold the same
    experts and form its expert-data-parallel group (``expert_data_ranks`` of them), over which those experts'
    gradients are reduced. Every rank still sees its own micro-batches.
    """

    strategy: str  # ddp | fsdp
    replicate: int
    shard: int
    tp: int = 1
    pp: int = 1
    # The stages' placement: stage group r holds stages r, r + pp, ... (loop), or r and 2 pp - 1 - r (the V of
    # dist.pp.schedule=zero_bubble with 2 stages a rank), where the first and the last stage are both group 0's.
    pp_v: bool = False
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage group: replicate x shard x tp."""
        return self.replicate * self.shard * self.tp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline stage group global ``rank`` is in (0 holds the first stage)."""
        return rank // self.stage_ranks

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are averaged (replicate x shard): the data ranks' cp ranks included."""
        return self.replicate * self.shard

    @property
    def data_ranks(self) -> int:
        """Ranks that see different micro-batches: the batch plan's unit."""
        return self.replicate * self.shard // self.cp

    def counts_batch(self, rank: int) -> bool:
        """Whether ``rank``'s micro-batches count in the step's totals: one rank per tensor-parallel group,
        in the group of the last pipeline stage (which computes the loss)."""
        return rank % self.tp == 0 and self.pp_rank(rank) == self.last_stage_group

    @property
    def last_stage_group(self) -> int:
        """The stage group holding the last stage (and the loss): pp - 1, or 0 under the V placement."""
        return 0 if self.pp_v else self.pp - 1

    def grad_rank(self, rank: int) -> int:
        """Global ``rank``'s index among the gradient ranks of its stage group (replicate x shard)."""
        return (rank % self.stage_ranks) // self.tp

    def data_rank(self, rank: int) -> int:
        """Which micro-batches global ``rank`` sees: the same for every rank of a tensor-parallel group, of a
        context-parallel group and for every stage of a pipeline."""
        return self.grad_rank(rank) // self.cp

    def cp_rank(self, rank: int) -> int:
        """Which part of each sequence's tokens global ``rank`` holds (0 without context parallelism)."""
        return self.grad_rank(rank) % self.cp

    def counts_samples(self, rank: int) -> bool:
        """Whether ``rank`` counts its micro-batches' samples: one rank of a context-parallel group (its cp
        ranks hold parts of the same sequences), where ``counts_batch`` holds."""
        return self.counts_batch(rank) and self.cp_rank(rank) == 0

    def ep_rank(self, rank: int) -> int:
        """Which slice of the experts global ``rank`` holds (0 without expert parallelism)."""
        return self.data_rank(rank) % self.ep

    @property
    def expert_data_ranks(self) -> int:
        """Ranks holding the same experts (one per expert-parallel group): their gradients are reduced over these."""
        return self.data_ranks // self.ep

    @property
    def shards_experts(self) -> bool:
        """Whether each expert slice is cut again over the edp ranks, FSDP units of their own (fsdp and hsdp
        without pipeline stages, where there are several edp ranks; ``moe.ep``), rather than whole on its rank."""
        return self.ep > 1 and self.kind != "ddp" and self.pp == 1 and self.expert_data_ranks > 1

    def counts_experts(self, rank: int) -> bool:
        """Whether ``rank``'s expert gradients count in the global norm: each expert once, in the first
        expert-parallel group (the others hold copies)."""
        return self.data_rank(rank) < self.ep and rank % self.tp == 0  # tp ranks hold the same experts whole

    @property
    def cuts_model(self) -> bool:
        """Whether the strategy cuts the model over ranks (fsdp, hsdp, tp, pp): no rank needs it whole."""
        return self.strategy == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def kind(self) -> str:
        """ddp, fsdp (one shard group of every data-parallel rank) or hsdp (shard groups replicated)."""
        if self.strategy == "ddp":
            return "ddp"
        return "fsdp" if self.replicate == 1 else "hsdp"

    def describe(self) -> str:
        if self.kind == "ddp":
            text = f"ddp: {self.replicate} replicas"
        elif self.kind == "fsdp":
            text = f"fsdp: 1 shard group of {self.shard} ranks"
        else:
            text = f"hsdp: {self.replicate} replicas x shard groups of {self.shard} ranks"
        if self.tp > 1:
            text = f"{text}, each rank a tensor-parallel group of {self.tp} ranks"
        if self.ep > 1:
            text = (f"{text}; experts split over expert-parallel groups of {self.ep} data ranks, their gradients "
                    f"reduced over {self.expert_data_ranks}"
                    + (" (fsdp: each slice sharded over them)" if self.shards_experts else ""))
        if self.cp > 1:
            text = (f"{text}; each sequence's tokens split over context-parallel groups of {self.cp} of them "
                    f"({self.data_ranks} data-parallel ranks)")
        return text if self.pp == 1 else f"pipeline of {self.pp} stage groups, each {text}"


def derive_mesh(dist: "DistConfig", world_size: int, local_world_size: int) -> MeshShape:
    """The mesh of ``dist.pp.size``, ``dist.tp.size``, ``dist.strategy``, ``dist.fsdp.shard_size`` and
    ``dist.ep.size`` and ``dist.cp.size``; ConfigError naming the key."""
    cp = dist.cp.size
    _check(isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1, "dist.cp.size", cp,
           "must be an integer >= 1 (1: no context parallelism)")
    if cp > 1:  # taken from the gradient ranks: the shape without it, then cp groups within each shard group
        shape = derive_mesh(replace(dist, cp=CPConfig()), world_size, local_world_size)
        inner = shape.shard if shape.strategy == "fsdp" else shape.replicate
        _check(inner % cp == 0, "dist.cp.size", cp,
               f"must divide the {inner} ranks of a " + ("shard group (dist.fsdp.shard_size)" if shape.strategy ==
                                                          "fsdp" else "data-parallel world")
               + f" (one of {_divisors(inner)}): a context-parallel group is made of data-parallel ranks")
        return replace(shape, cp=cp)
    ep = dist.ep.size
    _check(isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1, "dist.ep.size", ep,
           "must be an integer >= 1 (1: no expert parallelism)")
    if ep > 1:  # taken from the data-parallel ranks: the shape without it, then ep within its data ranks
        shape = derive_mesh(replace(dist, ep=EPConfig()), world_size, local_world_size)
        _check(shape.data_ranks % ep == 0, "dist.ep.size", ep,
               f"must divide the {shape.data_ranks} data-parallel ranks (one of {_divisors(shape.data_ranks)}): "
               "expert-parallel groups are made of data ranks")
        return replace(shape, ep=ep)
    pp = dist.pp.size
    _check(world_size % pp == 0, "dist.pp.size", pp,
           f"must divide the world size {world_size} (one of {_divisors(world_size)})")
    if pp > 1:
        # Each stage group is a mesh of its own: consecutive ranks, a node's (or part of one).
        shape = derive_mesh(replace(dist, pp=PPConfig()), world_size // pp, min(local_world_size, world_size // pp))
        return replace(shape, pp=pp, pp_v=pp_v_shape(dist.pp))
    tp = dist.tp.size
    _check(world_size % tp == 0, "dist.tp.size", tp,
           f"must divide the world size {world_size} (one of {_divisors(world_size)})")
    if tp > 1 and local_world_size % tp:
        log.warning("dist.tp.size=%d does not divide the %d ranks of a node: tensor-parallel groups span nodes, "
                    "and every layer's activations cross the slower link twice per forward and backward", tp,
                    local_world_size)
    data, node = world_size // tp, max(local_world_size // tp, 1)
    if dist.strategy == "ddp":
        return MeshShape("ddp", data, 1, tp)
    size = dist.fsdp.shard_size
    if size is None:
        return MeshShape("fsdp", 1, data, tp)
    if size == "node":
        _check(data % node == 0 and local_world_size % tp == 0, "dist.fsdp.shard_size", size,
               f"the world size {world_size} is not a whole number of nodes of {local_world_size} ranks"
               + (f" in tensor-parallel groups of dist.tp.size={tp}" if tp > 1 else ""))
        return MeshShape("fsdp", data // node, node, tp)
    _check(isinstance(size, int) and not isinstance(size, bool) and size >= 1 and data % size == 0,
           "dist.fsdp.shard_size", size, f"must be null, node, or a divisor of the {data} data-parallel ranks "
           f"(one of {_divisors(data)})" + (f"; world size {world_size} / dist.tp.size={tp}" if tp > 1 else ""))
    return MeshShape("fsdp", data // size, size, tp)


@dataclass(frozen=True)
class BatchPlan:
    """The derived numbers of one optimizer step, for a given world size."""

    world_size: int
    micro_batch_size: int
    accum_steps: int
    global_batch_size: int
    base_lr: float
    lr: float  # after scaling for the effective batch
    max_steps: int
    mesh: Optional[MeshShape] = None  # always set by validate; None only in plans built by hand for the data order
    # What validate chose for keys left at auto, as printed at start-up and by plan mode
    # (e.g. "dist.fsdp.reshard=auto -> forward (dist.pp.size=2)").
    chosen: Tuple[str, ...] = ()

    @property
    def data_ranks(self) -> int:
        """Ranks that see different micro-batches (world / tp / pp / cp): micro x accum x data ranks = global."""
        return self.world_size if self.mesh is None else self.mesh.data_ranks

    def describe(self) -> str:
        ranks = (f"world size {self.world_size}" if self.data_ranks == self.world_size else
                 f"data-parallel ranks {self.data_ranks} (world size {self.world_size}"
                 + (f" / tp {self.mesh.tp}" if self.mesh.tp > 1 else "")
                 + (f" / pp {self.mesh.pp}" if self.mesh.pp > 1 else "")
                 + (f" / cp {self.mesh.cp}" if self.mesh.cp > 1 else "") + ")")
        return (
            f"{ranks} x micro batch {self.micro_batch_size} "
            f"x accum steps {self.accum_steps} = global batch {self.global_batch_size} "
            f"samples per optimizer step; lr {self.base_lr:g} -> {self.lr:g} after scaling; "
            f"{self.max_steps} optimizer steps" + "".join(f"; {line}" for line in self.chosen)
        )


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def _check_ckpt_dir(ckpt_dir: Any) -> None:
    """A path, or a URL whose fsspec filesystem is installed (s3:// needs s3fs); never credentials in it."""
    _check(ckpt_dir is None or (isinstance(ckpt_dir, str) and ckpt_dir.strip() != ""), "trainer.ckpt_dir", ckpt_dir,
           "a directory or an fsspec URL such as s3://bucket/prefix, or null (the run directory's checkpoints/)")
    if ckpt_dir is None or "://" not in ckpt_dir or ckpt_dir.startswith("file://"):
        return
    protocol, rest = ckpt_dir.split("://", 1)
    _check("@" not in rest.split("/", 1)[0], "trainer.ckpt_dir", "<redacted>",
           "holds credentials; give them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), never in "
           "the config, which is logged and saved")
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"trainer.ckpt_dir={ckpt_dir!r}: no filesystem for {protocol}:// ({err}); install its "
                          "fsspec package (s3fs for s3://, pip install 'dist_trainer[s3]')") from None


def _check_loggers(logger: Any) -> None:
    names = [logger] if isinstance(logger, str) else logger
    _check(isinstance(logger, str) or (isinstance(logger, (list, tuple)) and all(isinstance(n, str) for n in logger)),
           "logger", logger, "a name or a list of names, e.g. logger=[jsonl,wandb]")
    for name in names:
        _check(name in LOGGERS, "logger", list(names), f"{name!r} is not one of {list(LOGGERS)}")
        package, extra = LOGGER_PACKAGES.get(name, (None, None))
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"logger={list(names)} needs the {package} package: pip install -e '.[{extra}]' "
                              f"(or pip install {package})")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def derive_batch(batch: BatchConfig, world_size: int, ranks: str = "world size") -> tuple[int, int]:
    """Return (accum_steps, global_batch_size); micro x accum x world = global.

    ``world_size``: the ranks that see different micro-batches (world / dist.tp.size), called ``ranks``.
    """
    micro = batch.micro_batch_size
    _check(isinstance(micro, int) and not isinstance(micro, bool) and micro >= 1, "batch.micro_batch_size",
           micro, "must be an integer >= 1, or auto")
    if batch.accum_steps is not None:
        _check(batch.accum_steps >= 1, "batch.accum_steps", batch.accum_steps, "must be >= 1")
    if batch.global_batch_size is None:
        accum = batch.accum_steps or 1
        return accum, micro * accum * world_size
    glob = batch.global_batch_size
    _check(glob >= 1, "batch.global_batch_size", glob, "must be >= 1")
    per_rank, rest = divmod(glob, micro * world_size)
    if rest or per_rank == 0:
        # Suggestions that pass this check as they stand: with batch.accum_steps set,
        # micro x world x accum must make the global batch.
        accum = batch.accum_steps or 1
        micros = [m for m in _divisors(glob) if glob % (m * world_size * accum) == 0
                  and (batch.accum_steps is None or glob // (m * world_size) == accum)]
        step = micro * world_size * accum
        lower = max(glob // step, 1) * step
        hint = (
            f"batch.micro_batch_size in {micros[-6:]} would divide it"
            if micros
            else f"no micro batch divides it over {world_size} ranks"
            + (f" in batch.accum_steps={accum}" if batch.accum_steps is not None else "")
        )
        other_global = (f"batch.global_batch_size to a multiple of {step} (e.g. {lower} or {lower + step})"
                        if batch.accum_steps is None else
                        f"batch.global_batch_size={step} (micro x world x batch.accum_steps), or drop batch.accum_steps")
        raise ConfigError(
            f"batch.global_batch_size={glob} is not batch.micro_batch_size={micro} x "
            f"{ranks} {world_size} x batch.accum_steps: {hint}; or set {other_global}"
        )
    if batch.accum_steps is not None and batch.accum_steps != per_rank:
        raise ConfigError(
            f"batch.accum_steps={batch.accum_steps} contradicts batch.global_batch_size={glob} "
            f"/ (batch.micro_batch_size={micro} x {ranks} {world_size}) = {per_rank}; "
            "set one of them, or make them agree"
        )
    return per_rank, glob


def scaled_lr(optim: OptimConfig, global_batch_size: int) -> float:
    if optim.lr_scaling == "none":
        return optim.lr
    ratio = global_batch_size / optim.base_batch_size
    return optim.lr * (ratio if optim.lr_scaling == "linear" else math.sqrt(ratio))


def _validate_values(cfg: Config) -> None:
    p, o, t, d = cfg.precision, cfg.optim, cfg.trainer, cfg.dist
    _check(p.name in PRECISIONS, "precision.name", p.name, f"choose one of {PRECISIONS}")
    ls = p.loss_scale
    _check(ls.init_scale > 0, "precision.loss_scale.init_scale", ls.init_scale, "must be > 0")
    _check(ls.growth_factor > 1, "precision.loss_scale.growth_factor", ls.growth_factor, "must be > 1")
    _check(0 < ls.backoff_factor < 1, "precision.loss_scale.backoff_factor", ls.backoff_factor, "must be in (0, 1)")
    _check(ls.growth_interval >= 1, "precision.loss_scale.growth_interval", ls.growth_interval, "must be >= 1")
    _check(ls.hysteresis >= 1, "precision.loss_scale.hysteresis", ls.hysteresis, "must be >= 1")
    _check(0 < ls.min_scale <= ls.init_scale, "precision.loss_scale.min_scale", ls.min_scale, "must be in (0, init_scale]")
    _check(cfg.batch.partial_step in ("mean", "scaled"), "batch.partial_step", cfg.batch.partial_step,
           "choose mean or scaled")
    _check(o.name in OPTIMIZERS, "optim.name", o.name, f"choose one of {OPTIMIZERS}")
    _check(o.lr > 0, "optim.lr", o.lr, "must be > 0")
    _check(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    _check(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", o.betas, "must be two values in [0, 1)")
    _check(o.eps > 0, "optim.eps", o.eps, "must be > 0")
    _check(o.momentum >= 0, "optim.momentum", o.momentum, "must be >= 0")
    _check(o.lr_scaling in LR_SCALINGS, "optim.lr_scaling", o.lr_scaling, f"choose one of {LR_SCALINGS}")
    if o.lr_scaling != "none":
        _check(o.base_batch_size is not None and o.base_batch_size >= 1, "optim.base_batch_size",
               o.base_batch_size, f"must be a positive batch size when optim.lr_scaling={o.lr_scaling}")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    _check(o.schedule in SCHEDULES, "optim.schedule", o.schedule, f"choose one of {SCHEDULES}")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    _check(o.grad_clip is None or o.grad_clip > 0, "optim.grad_clip", o.grad_clip, "must be > 0 or null")
    _validate_muon(o)
    _check(o.state_dtype in ("fp32", "bf16", "int8"), "optim.state_dtype", o.state_dtype,
           "choose fp32, bf16 or int8 (torchao's 8-bit AdamW)")
    _check(o.state_dtype == "fp32" or o.name == "adamw", "optim.state_dtype", o.state_dtype,
           f"is AdamW's (optim.name=adamw); optim.name={o.name} keeps its state in FP32: set optim.state_dtype=fp32")
    _check(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be >= 1")
    _check(isinstance(t.compile, bool), "trainer.compile", t.compile, "must be true or false")
    _check(t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1")
    _check(t.eval_every >= 0, "trainer.eval_every", t.eval_every, "must be >= 0 (0 disables)")
    _check(t.eval_batches >= 1, "trainer.eval_batches", t.eval_batches, "must be >= 1")
    _check(t.ckpt_every >= 0, "trainer.ckpt_every", t.ckpt_every, "must be >= 0 (0: only at the end)")
    _check(t.keep_checkpoints >= 1, "trainer.keep_checkpoints", t.keep_checkpoints, "must be >= 1")
    _check(isinstance(t.keep_every, int) and not isinstance(t.keep_every, bool) and t.keep_every >= 0,
           "trainer.keep_every", t.keep_every, "must be an integer >= 0 (0: only trainer.keep_checkpoints applies)")
    _check(isinstance(t.ckpt_async, bool), "trainer.ckpt_async", t.ckpt_async, "must be true or false")
    _check_ckpt_dir(t.ckpt_dir)
    _check(t.device in ("auto", "cpu", "cuda"), "trainer.device", t.device, "choose auto, cpu or cuda")
    _check(t.tune_malloc in (True, False, "reuse", "bounded"), "trainer.tune_malloc", t.tune_malloc,
           "choose true, false, reuse or bounded")
    _check(t.nonfinite in NONFINITE_POLICIES, "trainer.nonfinite", t.nonfinite, f"choose one of {NONFINITE_POLICIES}")
    _check(t.max_consecutive_skips >= 1, "trainer.max_consecutive_skips", t.max_consecutive_skips, "must be >= 1")
    _check(d.bucket_cap_mb is None or d.bucket_cap_mb > 0, "dist.bucket_cap_mb", d.bucket_cap_mb, "must be > 0 or null")
    _check(d.check_consistency_every >= 0, "dist.check_consistency_every", d.check_consistency_every,
           "must be >= 0 (0 disables)")
    _check(cfg.plan.world_size is None or cfg.plan.world_size >= 1, "plan.world_size", cfg.plan.world_size,
           "must be >= 1")
    _check(d.timeout_s >= 1, "dist.timeout_s", d.timeout_s, "must be >= 1")
    _check(d.init_timeout_s >= 1, "dist.init_timeout_s", d.init_timeout_s, "must be >= 1")
    st = d.step_timeout_s
    _check(st == "auto" or (isinstance(st, (int, float)) and not isinstance(st, bool) and st >= 0),
           "dist.step_timeout_s", st, "choose auto, a number of seconds, or 0 (off)")
    _check(d.strategy in STRATEGIES, "dist.strategy", d.strategy, f"choose one of {STRATEGIES}")
    _check(d.fsdp.accum_sync in ACCUM_SYNCS, "dist.fsdp.accum_sync", d.fsdp.accum_sync,
           f"choose one of {ACCUM_SYNCS}")
    f = d.fsdp
    if f.reshard_after_forward is not None:
        implied = "micro_batch" if f.reshard_after_forward else "forward"
        _check(f.reshard in ("auto", "micro_batch", implied), "dist.fsdp.reshard_after_forward",
               f.reshard_after_forward,
               f"is replaced by dist.fsdp.reshard and contradicts dist.fsdp.reshard={f.reshard}: drop it")
        log.warning("dist.fsdp.reshard_after_forward=%s is deprecated: it is dist.fsdp.reshard=%s now; set that",
                    f.reshard_after_forward, implied)
        f.reshard, f.reshard_after_forward = implied, None
    _check(f.reshard in ("auto", *RESHARDS), "dist.fsdp.reshard", f.reshard, f"choose one of {('auto', *RESHARDS)}")
    _check(isinstance(f.prefetch, int) and not isinstance(f.prefetch, bool) and f.prefetch >= 0,
           "dist.fsdp.prefetch", f.prefetch, "must be an integer >= 0 (units gathered ahead; 0: none)")
    _check(f.shard_size is None or f.shard_size == "node" or
           (isinstance(f.shard_size, int) and not isinstance(f.shard_size, bool) and f.shard_size >= 1),
           "dist.fsdp.shard_size", f.shard_size, "must be null (all ranks), node, or a number of ranks >= 1")
    _check(isinstance(d.meta_init, bool), "dist.meta_init", d.meta_init, "must be true or false")
    _check(d.blocks is None or (isinstance(d.blocks, list) and all(isinstance(b, str) and b for b in d.blocks)),
           "dist.blocks", d.blocks, "must be a list of class names, or null for what the model declares")
    if d.strategy == "ddp":
        _check(f.shard_size is None, "dist.fsdp.shard_size", f.shard_size,
               "shapes the shard groups of dist.strategy=fsdp (hsdp): set dist.strategy=fsdp, or drop it under ddp")
    if d.strategy == "fsdp":
        # Combinations fsdp does not support, named by both keys, before anything is built.
        _check(not d.sync_batchnorm, "dist.sync_batchnorm", d.sync_batchnorm,
               "is not supported with dist.strategy=fsdp: set dist.sync_batchnorm=false or dist.strategy=ddp")
        _check(d.check_consistency_every == 0, "dist.check_consistency_every", d.check_consistency_every,
               "compares whole replicas across ranks, and under dist.strategy=fsdp each rank holds a different "
               "shard: set dist.check_consistency_every=0 or dist.strategy=ddp")
        _check(cfg.batch.micro_batch_size != "auto", "batch.micro_batch_size", "auto",
               "is not supported with dist.strategy=fsdp (its trials run the whole unsharded model on each "
               "rank): set an integer batch.micro_batch_size, or dist.strategy=ddp")
    _validate_tp(cfg)  # the pipeline's keys after dist.fsdp.reshard=auto is resolved (validate)
    _check_loggers(cfg.logger)
    for node in ("model", "data"):
        target = getattr(cfg, node).get("_target_")
        _check(isinstance(target, str) and bool(target), f"{node}._target_", target,
               "must name an importable callable (e.g. dist_trainer.models.GPT)")
    data = cfg.data
    _check(isinstance(data.get("shuffle", True), bool), "data.shuffle", data.get("shuffle"), "must be true or false")
    _check(isinstance(data.get("drop_last", False), bool), "data.drop_last", data.get("drop_last"), "must be true or false")
    workers = data.get("num_workers", 0)
    _check(isinstance(workers, int) and workers >= 0, "data.num_workers", workers, "must be an integer >= 0")
    prefetch = data.get("prefetch_factor")
    _check(prefetch is None or (isinstance(prefetch, int) and prefetch >= 1), "data.prefetch_factor", prefetch,
           "must be null (2 per worker) or an integer >= 1 (micro-batches each DataLoader worker keeps ready)")


def _validate_tp(cfg: Config) -> None:
    tp, d = cfg.dist.tp, cfg.dist
    _check(isinstance(tp.size, int) and not isinstance(tp.size, bool) and tp.size >= 1, "dist.tp.size", tp.size,
           "must be an integer >= 1 (1: no tensor parallelism)")
    _check(tp.plan == "auto" or (isinstance(tp.plan, dict) and bool(tp.plan) and
                                 all(isinstance(k, str) and v in TP_STYLES for k, v in tp.plan.items())),
           "dist.tp.plan", tp.plan, f"auto, or a mapping of module-name patterns to one of {list(TP_STYLES)}")
    _check(isinstance(tp.sequence_parallel, bool), "dist.tp.sequence_parallel", tp.sequence_parallel,
           "must be true or false")
    _check(isinstance(tp.loss_parallel, bool), "dist.tp.loss_parallel", tp.loss_parallel, "must be true or false")
    if tp.size == 1:
        return
    # What tensor parallelism does not combine with, named by both keys, before anything is built.
    _check(not d.sync_batchnorm, "dist.sync_batchnorm", d.sync_batchnorm,
           f"is not supported with dist.tp.size={tp.size}: set dist.sync_batchnorm=false or dist.tp.size=1")
    _check(d.check_consistency_every == 0, "dist.check_consistency_every", d.check_consistency_every,
           f"compares whole replicas across ranks, and under dist.tp.size={tp.size} each rank holds a cut of "
           "every layer: set dist.check_consistency_every=0 or dist.tp.size=1")
    _check(cfg.batch.micro_batch_size != "auto", "batch.micro_batch_size", "auto",
           f"is not supported with dist.tp.size={tp.size} (its trials run the whole model on each rank): "
           "set an integer batch.micro_batch_size")
    lora = cfg.model.get("lora") or {}
    _check(not (isinstance(lora, dict) and lora.get("r")), "model.lora.r", lora.get("r") if isinstance(lora, dict)
           else lora, f"LoRA adapters on a tensor-parallel base are not supported yet (dist.tp.size={tp.size}): "
           "set dist.tp.size=1, or model.lora.r=null for full fine-tuning")


def _validate_pp(cfg: Config) -> None:
    pp, d = cfg.dist.pp, cfg.dist
    _check(isinstance(pp.size, int) and not isinstance(pp.size, bool) and pp.size >= 1, "dist.pp.size", pp.size,
           "must be an integer >= 1 (1: no pipeline)")
    _check(pp.schedule in PP_SCHEDULES, "dist.pp.schedule", pp.schedule, f"must be one of {list(PP_SCHEDULES)}")
    v = pp.stages_per_rank
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, "dist.pp.stages_per_rank", v,
           "must be an integer >= 1")
    if pp.schedule in ("gpipe", "1f1b"):
        _check(v == 1, "dist.pp.stages_per_rank", v, f"must be 1 with dist.pp.schedule={pp.schedule} (a single-stage "
               "schedule); interleaved_1f1b and zero_bubble hold several stages per rank")
    else:
        _check(v >= 2, "dist.pp.stages_per_rank", v, f"must be 2 or more with dist.pp.schedule={pp.schedule} "
               "(2 with zero_bubble is the V schedule); or use dist.pp.schedule=1f1b")
    _check(pp.split == "auto" or (isinstance(pp.split, (list, tuple)) and all(isinstance(n, str) for n in pp.split)),
           "dist.pp.split", pp.split, "auto, or the names of the blocks where stages 1, 2, ... begin (e.g. [blocks.2])")
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
        _check(ok, key, _get(cfg, key), f"{text} (dist.pp.size={pp.size})")
    lora = cfg.model.get("lora") or {}
    _check(not (isinstance(lora, dict) and lora.get("r")), "model.lora.r", lora.get("r") if isinstance(lora, dict)
           else lora, f"LoRA adapters on pipeline stages are not supported yet (dist.pp.size={pp.size}): set "
           "dist.pp.size=1, or model.lora.r=null")


def _validate_moe(cfg: Config) -> None:
    """``model.moe``: the balancing keys (any MoE model), the built-in GPT's layer shape."""
    moe = cfg.model.get("moe")
    if not isinstance(moe, dict):
        return
    from .moe.routing import BalanceConfig  # the one reader of the balancing keys

    BalanceConfig.from_dict(moe)
    capacity = moe.get("capacity_factor")
    _check(capacity is None or (isinstance(capacity, (int, float)) and not isinstance(capacity, bool) and capacity > 0),
           "model.moe.capacity_factor", capacity, "must be null (no token dropped) or a number > 0")
    experts = moe.get("num_experts") or 0
    if not experts:
        return
    top_k = moe.get("top_k", 2)
    _check(isinstance(experts, int) and experts >= 1, "model.moe.num_experts", experts, "must be an integer >= 0")
    _check(isinstance(top_k, int) and 1 <= top_k <= experts, "model.moe.top_k", top_k,
           f"must be between 1 and model.moe.num_experts ({experts})")
    _check(moe.get("router", "softmax") in ("softmax", "sigmoid"), "model.moe.router", moe.get("router"),
           "choose softmax or sigmoid")


def _validate_ep(cfg: Config, mesh: MeshShape) -> None:
    """``dist.ep.size`` against the model: the built-in GPT's MoE layers, their experts cut evenly."""
    if mesh.ep == 1:
        return
    moe = cfg.model.get("moe")
    if isinstance(moe, dict) and "num_experts" not in moe:
        return  # a Hugging Face MoE model brings its experts: moe.ep checks them once it is built
    experts = (moe.get("num_experts") or 0) if isinstance(moe, dict) else 0
    _check(isinstance(experts, int) and experts > 0, "dist.ep.size", mesh.ep,
           "needs a model with MoE layers (model.moe.num_experts > 0, the built-in GPT's); this one has none: "
           "set dist.ep.size=1")
    _check(experts % mesh.ep == 0, "dist.ep.size", mesh.ep,
           f"must divide model.moe.num_experts={experts} (each rank of an expert-parallel group holds "
           f"num_experts / dist.ep.size of them): one of {[d for d in _divisors(experts) if mesh.data_ranks % d == 0]}")
    _check(not (mesh.strategy == "ddp" and master_mode(cfg.precision)), "precision.name",
           cfg.precision.name, f"with dist.ep.size={mesh.ep} under dist.strategy=ddp is not supported yet (the "
           "experts' FP32 masters would be whole): use a *-mixed precision, or dist.strategy=fsdp")


# The Hugging Face builder (models.hf): model.loss reaches it as it reaches the GPT; its chunks are a causal LM's.
HF_MODELS = ("dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")


def _validate_muon(o: OptimConfig) -> None:
    m = o.muon
    _check(m.lr > 0, "optim.muon.lr", m.lr, "must be > 0")
    _check(0 <= m.momentum < 1, "optim.muon.momentum", m.momentum, "must be in [0, 1)")
    _check(isinstance(m.ns_steps, int) and 1 <= m.ns_steps < 100, "optim.muon.ns_steps", m.ns_steps,
           "must be an integer in [1, 100)")
    _check(m.ns_dtype in ("fp32", "bf16"), "optim.muon.ns_dtype", m.ns_dtype, "choose fp32 or bf16")
    _check(m.adjust_lr in ("original", "match_rms_adamw"), "optim.muon.adjust_lr", m.adjust_lr,
           "choose original or match_rms_adamw")
    _check(isinstance(m.exclude, (list, tuple)) and all(isinstance(x, str) for x in m.exclude),
           "optim.muon.exclude", m.exclude, "must be a list of name patterns")
    _check(m.dist in ("gather", "owner"), "optim.muon.dist", m.dist, "choose gather or owner")


def _validate_loss(cfg: Config, mesh: MeshShape) -> None:
    """``model.loss`` (the built-in GPT's, a Hugging Face causal LM's): its keys, and ``chunked`` refused where
    the chunks would not be exact.

    The chunked loss runs in the model's own forward, reading the head's weight whole (``models/loss.py``). A
    Hugging Face family whose head is more than a bias-free linear map is refused when it is built (models.hf).
    """
    loss = cfg.model.get("loss")
    if not isinstance(loss, dict):
        return  # absent, or a custom model's own constructor argument
    from .models.loss import LossOptions  # the one reader of model.loss

    if not LossOptions.from_dict(loss).chunked:
        return
    key, fix = "model.loss.chunked", "set model.loss.chunked=false"
    _check(cfg.model.get("_target_") not in HF_MODELS or cfg.model.get("task", "causal_lm") == "causal_lm", key,
           True, f"is for causal LMs (model=hf_causal_lm); a masked LM's head transforms the hidden states: {fix}")
    # Under tp the chunks are computed on each rank's slice of the vocabulary, the layout loss_parallel gives.
    _check(mesh.tp == 1 or cfg.dist.tp.loss_parallel, key, True, f"with dist.tp.size={mesh.tp} computes each "
           "chunk's cross-entropy on the ranks' vocabulary slices, which dist.tp.loss_parallel=false gathers "
           f"instead; set dist.tp.loss_parallel=true (or {fix})")


# The models context parallelism supports: the built-in GPT, and Hugging Face causal decoders (models.hf checks
# the layout and the attention when it builds: Llama's, full causal attention).
CP_MODELS = ("dist_trainer.models.GPT", "dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")


def _validate_cp(cfg: Config, mesh: MeshShape) -> None:
    """``dist.cp.*`` against the mesh and the model; a ConfigError before the first collective."""
    cp = cfg.dist.cp
    _check(cp.method in ("ring", "ulysses"), "dist.cp.method", cp.method, "choose ring or ulysses")
    _check(cp.layout in ("zigzag", "contiguous"), "dist.cp.layout", cp.layout, "choose zigzag or contiguous")
    if mesh.cp == 1:
        return
    _check(mesh.ep == 1, "dist.cp.size", mesh.cp, f"with dist.ep.size={mesh.ep} is not supported yet: set one of "
           "them to 1")
    model = cfg.model
    _check(model.get("_target_") in CP_MODELS and model.get("task", "causal_lm") == "causal_lm", "dist.cp.size",
           mesh.cp, f"supports the built-in GPT and Hugging Face causal decoders (model._target_ one of "
           f"{list(CP_MODELS[:2])}, model.task=causal_lm), not {model.get('_target_')}: set dist.cp.size=1")
    moe = model.get("moe") or {}
    _check(not moe.get("num_experts") and not _hf_moe(model), "dist.cp.size", mesh.cp,
           "with MoE layers is not supported yet: set dist.cp.size=1")
    _check(not model.get("dropout"), "model.dropout", model.get("dropout"),
           f"must be 0 with dist.cp.size={mesh.cp}: attention dropout is not split over the cp ranks")
    _check(not cfg.data.get("packing"), "data.packing", True,
           f"with dist.cp.size={mesh.cp}: packed sequences restart their positions, and ring and ulysses "
           "attend causally over the whole row; set data.packing=false (padded batches work)")
    unit = (2 * mesh.cp if cp.layout == "zigzag" else mesh.cp) * mesh.tp  # parallel.cp.unit
    block = model.get("block_size")  # the GPT's learned positions: the padding to the unit must fit them
    _check(model.get("_target_") != CP_MODELS[0] or (isinstance(block, int) and block % unit == 0), "data.block_size",
           block,
           f"must be a multiple of {unit} with dist.cp.size={mesh.cp} and dist.cp.layout={cp.layout} (each rank "
           + ("two chunks of every sequence" if cp.layout == "zigzag" else "one chunk of every sequence")
           + (f", cut into dist.tp.size={mesh.tp} sequence shards)" if mesh.tp > 1 else ")"))
    heads = model.get("n_head")
    # (a Hugging Face model's heads are checked when it is built: parallel.cp)
    _check(cp.method != "ulysses" or heads is None or (isinstance(heads, int) and heads % (mesh.cp * mesh.tp) == 0),
           "dist.cp.method", cp.method, f"needs model.n_head={heads} divisible by dist.cp.size={mesh.cp}"
           + (f" x dist.tp.size={mesh.tp}" if mesh.tp > 1 else "") + " (each rank attends over n_head / cp heads"
           " of the whole sequence): use ring, or another cp size")


def _hf_moe(model: Dict[str, Any]) -> bool:
    """Whether a Hugging Face model's configuration names a mixture of experts (its type or expert count)."""
    config = model.get("config") or {}
    moe_keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return "moe" in str(model.get("model_type") or "") or any(config.get(k) for k in moe_keys)


def resolve_reshard(dist: DistConfig) -> Optional[str]:
    """``dist.fsdp.reshard=auto`` made a mode, in place, so that everything after validate sees the mode alone.

    micro_batch (the lowest memory) where the mesh supports it; forward under fsdp with pipeline stages, where
    micro_batch is refused (``_validate_pp``: torch's stages keep each unit gathered from its first backward to
    the step's end, so forward gathers as often and holds no more). Returns the line saying what was chosen
    where it matters (fsdp), else None.
    """
    f = dist.fsdp
    if f.reshard != "auto":
        return None
    pipeline = isinstance(dist.pp.size, int) and dist.pp.size > 1
    f.reshard = "forward" if dist.strategy == "fsdp" and pipeline else "micro_batch"
    if dist.strategy != "fsdp":
        return None  # ddp gathers nothing: the mode changes no number there
    why = f"micro_batch is not supported with dist.pp.size={dist.pp.size}" if pipeline else "this mesh supports it"
    return f"dist.fsdp.reshard=auto -> {f.reshard} ({why})"


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


def _check_pp_window(pp: PPConfig, accum: int, glob: int, data_ranks: int, micro: int) -> None:
    """The step's micro-batches serve the schedule, or a ConfigError naming batch.* and dist.pp.* and what would."""
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


def validate(cfg: Config, world_size: int, local_world_size: Optional[int] = None) -> BatchPlan:
    """Check every value and derive the batch plan and the mesh; raises ConfigError naming the key.

    ``local_world_size``: ranks per node (null: all ranks on one node).

    With batch.micro_batch_size=auto the plan is provisional (micro batch 1)
    until the finder has run; the global batch must then be given.
    """
    _check(world_size >= 1, "world size", world_size, "must be >= 1")
    _validate_values(cfg)
    # Keys left at auto get their value here, once, in place: what is built, planned and saved reads a mode.
    chosen = tuple(line for line in (resolve_reshard(cfg.dist),) if line)
    _validate_pp(cfg)
    _validate_moe(cfg)
    batch = cfg.batch
    if batch.micro_batch_size == "auto":
        _check(batch.global_batch_size is not None, "batch.global_batch_size", None,
               "must be set with batch.micro_batch_size=auto (the finder keeps it, and so the lr, fixed)")
        # Trials run the bare model rank by rank; synchronized BatchNorm would make each
        # forward a collective, and a rank out of memory would leave the others in it.
        _check(not cfg.dist.sync_batchnorm, "batch.micro_batch_size", "auto",
               "cannot be used with dist.sync_batchnorm=true: set an integer batch.micro_batch_size")
        glob = batch.global_batch_size
        _check(glob >= world_size and glob % world_size == 0, "batch.global_batch_size", glob,
               f"must be a positive multiple of the world size {world_size} with batch.micro_batch_size=auto")
        batch = BatchConfig(micro_batch_size=1, global_batch_size=glob)  # provisional, until the finder runs
    mesh = derive_mesh(cfg.dist, world_size, local_world_size or world_size)
    _validate_ep(cfg, mesh)
    _validate_cp(cfg, mesh)
    _validate_loss(cfg, mesh)
    from .fp8 import check as check_fp8  # the float8 modes' keys against the mesh

    check_fp8(cfg)
    if cfg.optim.name == "adafactor":  # torch's steps plain tensors: its in-place norms fail on DTensor shards
        cut = [f"dist.strategy={cfg.dist.strategy}"] if mesh.kind != "ddp" else []
        cut += [f"dist.{k}.size={n}" for k, n in (("tp", mesh.tp), ("ep", mesh.ep)) if n > 1]
        _check(not cut, "optim.name", "adafactor", f"steps whole tensors, and {' and '.join(cut)} cuts them into "
               "DTensor slices, which torch's Adafactor cannot step: use dist.strategy=ddp (pipeline stages too), "
               "or optim.name=adamw with optim.state_dtype=bf16 for less state")
    if cfg.optim.name == "muon" and cfg.optim.muon.dist == "owner":  # owner gathers over one cut dimension
        _check(mesh.tp == 1 or mesh.kind == "ddp", "optim.muon.dist", "owner", f"cuts a matrix over one mesh "
               f"dimension, and dist.strategy={cfg.dist.strategy} with dist.tp.size={mesh.tp} cuts over two: set "
               "optim.muon.dist=gather")
    # The ranks of one tensor-parallel group see the same micro-batches: the split counts data-parallel ranks.
    accum, glob = derive_batch(batch, mesh.data_ranks, "world size" if mesh.data_ranks == world_size else
                               "data-parallel ranks (" + ", ".join(f"dist.{k}.size={n}" for k, n in
                                                                    (("tp", mesh.tp), ("pp", mesh.pp), ("cp", mesh.cp)) if n > 1) + ")")
    if mesh.pp > 1:
        _check_pp_window(cfg.dist.pp, accum, glob, mesh.data_ranks, batch.micro_batch_size)
    return BatchPlan(
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
