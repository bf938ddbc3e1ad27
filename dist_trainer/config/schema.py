"""The configuration's schema: the dataclasses Hydra composes ``conf/`` against, their key values, and the small
pure helpers every layer shares.

This is the ground the project stands on: it imports nothing of dist_trainer. Hydra composes the YAML groups in
``conf/`` against the dataclasses below (so a misspelled key or a wrong type fails at composition, naming the key).
The shapes derived from a config (the mesh, the batch plan) are ``config/shapes.py``'s; the checks of each feature
run above the features, in ``dist_trainer/validation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """A ConfigError naming the key and its value unless ``ok``: every check's one form."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def divisors(n: int) -> List[int]:
    """The divisors of ``n``, offered in the messages as the values that would fit."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class BatchConfig:
    # samples per rank per forward/backward; "auto" (CUDA) finds the largest that fits
    micro_batch_size: Any = 16
    global_batch_size: Optional[int] = None  # samples per optimizer step, all ranks (task=grpo: its sequences)
    accum_steps: Optional[int] = None  # micro-batches per optimizer step
    # The epoch's last step when it holds fewer samples (data.drop_last=false):
    # "mean" averages over what it holds, like every step; "scaled" also multiplies
    # its gradient by held / global_batch_size, so every sample of the epoch
    # weighs the same in the sum of updates.
    partial_step: str = "mean"


@dataclass
class LossScaleConfig:
    init_scale: float = 2.0**16  # the loss scale the run starts with (> 0)
    growth_factor: float = 2.0  # the scale is multiplied by this after growth_interval good steps (> 1)
    backoff_factor: float = 0.5  # and by this when it backs off on overflowing gradients, in (0, 1)
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
    # The precision mode, set by the precision= group: fp32, bf16-mixed, fp16-mixed, bf16-master, fp16-master,
    # fp8-rowwise, fp8-rowwise-gw-hp, fp8-tensorwise or fp8-mxfp8 (docs/precision.md)
    name: str = "fp32"
    fp8: Fp8Config = field(default_factory=Fp8Config)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)  # fp16 modes only
    debug_overflow: bool = False  # on a skipped step, log parameters with non-finite grads


@dataclass
class MuonConfig:
    """optim.muon: Muon's keys (optim.name=muon), for the hidden layers' matrices; the rest take AdamW's optim.*."""

    lr: float = 0.02  # before the schedule and batch-size scaling, which it follows as optim.lr does
    momentum: float = 0.95  # weight of the past in Muon's momentum (an average of the gradients), in [0, 1)
    # true: Newton-Schulz orthogonalises the gradient moved toward the momentum (Nesterov); false: the momentum
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
    # Set by the optim= group: adamw, sgd, muon (Muon on the hidden matrices, AdamW on the rest) or adafactor
    name: str = "adamw"
    lr: float = 1e-3  # before scaling for the effective batch
    weight_decay: float = 0.0  # applied to matrices and embeddings only
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW's (muon's too) [beta1, beta2], in [0, 1)
    # Adam's eps is added in the FP32 optimizer state (parameters seen by the
    # optimizer are always FP32), so 1e-8 does not underflow as it would in fp16.
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    lr_scaling: str = "none"  # none | linear | sqrt: lr x (global_batch_size / base_batch_size), or its root
    base_batch_size: Optional[int] = None  # global batch the base lr was tuned for
    warmup_steps: int = 0  # optimizer updates of linear warmup
    schedule: str = "constant"  # after warmup: constant, or cosine down to min_lr_ratio x lr at trainer.max_steps
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
    seed: int = 0  # initial weights and data order; dropout and other draws: seed + the data-parallel rank
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
    # page-faults), bounded (blocks from 64 KiB up returned when freed: a sharded model's steps cannot fragment
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
    # Recompute each block's (dist.blocks) activations in backward instead of keeping them: less memory, one
    # more forward of every block; the same gradients
    activation_checkpointing: bool = False
    # ddp: BatchNorm's batch statistics over all ranks (torch's SyncBatchNorm on CUDA, parallel/sync_batchnorm.py
    # on CPU); not with fsdp, tp or pp
    sync_batchnorm: bool = False
    # For forwards that leave some parameters unused: DDP's flag under ddp; under fsdp such parameters take
    # part in the reduce-scatter with zero gradients
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

    project: Optional[str] = None  # the project the run is logged to
    entity: Optional[str] = None  # the team or user that owns the project
    name: Optional[str] = None  # null: the run directory's name
    tags: List[str] = field(default_factory=list)  # labels on the run, e.g. [baseline, fsdp]
    group: Optional[str] = None  # runs of one group are shown together (a sweep's, a comparison's)
    mode: Optional[str] = None  # online | offline | disabled


@dataclass
class MlflowConfig:
    """logging.mlflow.*: null reads MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME."""

    tracking_uri: Optional[str] = None  # the tracking server or store, e.g. http://host:5000
    experiment: Optional[str] = None  # null and no MLFLOW_EXPERIMENT_NAME: dist_trainer
    run_name: Optional[str] = None  # null: the run directory's name


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    hf_model_artifact: bool = False  # also upload hf_model/ at the end (the report's PNGs always go)


TASKS = ("lm", "dpo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust")
REFERENCES = ("auto", "copy", "adapter", "none", "precomputed")


@dataclass
class DPOConfig:
    """rl.dpo: Direct Preference Optimization's keys (task=dpo; dist_trainer/rl/dpo.py)."""

    beta: float = 0.1  # the strength of the KL anchor: each side's implicit reward is beta x (its logp - the reference's)
    # sigmoid (DPO's), ipo (on the answers' per-token mean logps), hinge (SLiC's), robust (with label_smoothing)
    loss: str = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid and robust: the assumed fraction of flipped labels, in [0, 0.5)
    # The weight of an NLL term on the chosen answers (RPO's), token-weighted over all the step's chosen tokens
    sft_weight: float = 0.0


ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "mean")
ADVANTAGE_SCALES = ("group", "batch", "none")
# rl.loss.agg, and the aliases each paper's name stands for
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_AGG_ALIASES = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class AdvantageConfig:
    """rl.advantage: how a completion's reward becomes its advantage (task=grpo; dist_trainer/rl/grpo.py)."""

    # grpo: reward - its group's mean; rloo: reward - the mean of the group's other rewards; mean: as grpo
    # (the two differ only in how they scale: rloo's is G/(G-1) times grpo's)
    estimator: str = "grpo"
    # group: divided by its group's standard deviation (+ 1e-4); batch: by the step's; none: not divided (Dr. GRPO)
    scale: str = "group"


@dataclass
class LossAggConfig:
    """rl.loss: how the step's per-token terms become one loss, over the whole step whatever its split."""

    # token-mean (alias dapo): every completion token of the step weighs the same; seq-mean-token-mean (grpo): a
    # sequence's mean over its tokens, averaged over the step's sequences; seq-mean-token-sum: a sequence's sum,
    # averaged over sequences; seq-mean-token-sum-norm (dr_grpo): a sequence's sum over rl.loss.max_tokens,
    # averaged over sequences. A mean per micro-batch is refused: it changes with the split
    agg: str = "token-mean"
    max_tokens: Optional[int] = None  # seq-mean-token-sum-norm's constant; null: rl.rollout.max_new_tokens


@dataclass
class ClipConfig:
    """rl.clip: the ratio's clip range [1 - low, 1 + high] (DAPO's clip-higher: high > low)."""

    low: float = 0.2  # the ratio's lower bound is 1 - low (applies where the advantage is negative)
    high: float = 0.2  # its upper bound is 1 + high (where the advantage is positive); DAPO raises it, e.g. 0.28


@dataclass
class KLConfig:
    """rl.kl: a per-token KL penalty against the reference (rl.reference), added to the loss."""

    coef: float = 0.0  # 0: no KL term (and no reference pass)
    # k1: logp - ref; k2: (logp - ref)^2 / 2; k3: exp(ref - logp) - (ref - logp) - 1 (Schulman's, unbiased, >= 0)
    estimator: str = "k3"


@dataclass
class RolloutConfig:
    """rl.rollout: how the trainer samples each prompt's completions."""

    max_new_tokens: int = 64  # a completion's most tokens; one that has not ended by then is truncated
    # The sampling temperature (> 0), applied identically when the trainer scores the completions; full
    # sampling from the tempered distribution (truncated sampling such as top-p or top-k is not offered: the
    # scored distribution would not be the sampled one)
    temperature: float = 1.0


PUBLISH_MODES = ("none", "disk", "sglang", "vllm", "broadcast")
PUBLISH_DTYPES = ("fp32", "bf16", "fp16")
PUBLISH_LORA = ("merged", "adapter")


@dataclass
class PublishConfig:
    """rl.publish: the policy's weights as Hugging Face directories for an inference server (rl/publish.py)."""

    # none; disk: a Hugging Face directory <dir>/step_<N:08d>/ after the steps it publishes at; sglang: that
    # directory, then POST <url>/update_weights_from_disk so the server loads it; vllm, broadcast: no directory,
    # the tensors broadcast over a torch.distributed group to the server, announced through vLLM's
    # weight-transfer routes or SGLang's update_weights_from_distributed (rl/transfer.py)
    mode: str = "none"
    every: int = 1  # optimizer steps between publications (>= 1); the last step always publishes
    dir: Optional[str] = None  # where the versions go; null: the run directory's published/
    keep: int = 2  # versions kept (>= 1): older ones are deleted once a new one is complete
    url: Optional[str] = None  # mode=sglang, vllm, broadcast: the server, e.g. http://127.0.0.1:30000 (required)
    # mode=vllm, broadcast: where the trainer's rank 0 serves the group's store (the server's workers connect)
    master_address: str = "127.0.0.1"
    master_port: Optional[int] = None  # mode=vllm, broadcast: the store's port (required there)
    world_size: int = 2  # mode=vllm, broadcast: the group's ranks, the trainer's rank 0 and the server's workers
    group_name: str = "dist_trainer_publish"  # mode=vllm, broadcast: the group's name (its store prefix)
    dtype: str = "fp32"  # what the served tensors are cast to: fp32, bf16 or fp16 (LoRA is merged in FP32 first)
    # A LoRA model: merged (the base with its adapters merged, a whole model) or adapter (the adapters alone, in
    # peft's format: mode=disk, or mode=sglang, which loads them with /load_lora_adapter)
    lora: str = "merged"


@dataclass
class RLConfig:
    """rl: post-training with preferences (task=dpo) and rewards (task=grpo): the reference model and each
    objective's keys."""

    # What the policy is measured against: copy (a frozen copy of the model as built), adapter (with model.lora:
    # the policy with its adapters disabled, no second copy), none (no reference: its log-probabilities 0),
    # precomputed (the model as built measures every pair once before the first step, kept in the data cache and
    # reused by later runs of the same model and data: no reference forward while training, no copy held);
    # auto: adapter with LoRA, else copy
    reference: str = "auto"
    dpo: DPOConfig = field(default_factory=DPOConfig)
    # task=grpo: prompts per optimizer step; the step's global batch is prompts_per_step x group_size sequences
    # (batch.global_batch_size follows it, or must equal it)
    prompts_per_step: int = 8
    group_size: int = 4  # task=grpo: completions sampled per prompt (a group, compared with one another)
    # exact_answer (a completion, cut at its end of turn and stripped, equals the record's answer), or a node
    # {_target_: module.function} naming any callable (prompt, completion, **record) -> float
    reward: Any = "exact_answer"
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossAggConfig = field(default_factory=LossAggConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0  # a bonus on the completions' token entropy (subtracted from the loss)
    # Optimizer steps on each step's rollouts: 1 (the old log-probabilities are the current ones: ratio 1), or
    # k > 1 (the rollouts trained k times against their log-probabilities when sampled; kept in checkpoints)
    inner_steps: int = 1
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)  # Published during training, whatever the task


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
    # The model= group's node (gpt, digits_convnet, hf_causal_lm, hf_masked_lm, custom): _target_ names the
    # nn.Module (or the function) built; the other keys are its arguments
    model: Dict[str, Any] = field(default_factory=dict)
    # The data= group's node (char_text, digits, tokens, hf_text, hf_chat, hf_preference, blend, custom): _target_
    # names the callable that returns the dataset; the other keys are its arguments, but shuffle, drop_last,
    # num_workers and prefetch_factor, which are the loader's. data=blend: data.sources.NAME.{kind, weight, the
    # kind's own keys} and data.blend.allow_change (docs/data.md)
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
    # What the run trains: lm (the next token, or the masked ones: the data's own loss), dpo (preference pairs
    # of data=hf_preference against a reference model: rl.*) or grpo (the model's own completions of the prompts
    # of data=hf_prompts, rewarded: rl.*)
    task: str = "lm"
    rl: RLConfig = field(default_factory=RLConfig)
