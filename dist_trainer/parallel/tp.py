"""Tensor parallelism (``dist.tp.*``): each layer cut over the ranks of the mesh's innermost dimension.

``apply_tp`` transforms the model in place on the ``tp`` sub-mesh, before
activation checkpointing, compilation and the data-parallel wrapping
(torchtitan's order). The plan maps module-name patterns (``*`` matches one
name) to a style:

* ``colwise``: a Linear's output features (an Embedding's width) cut over the
  ranks; its input is whole. Attention projections cut this way give each rank
  whole heads.
* ``rowwise``: a Linear's input features (an Embedding's vocabulary rows) cut;
  the partial outputs are summed: an all-reduce, or under sequence parallelism
  a reduce-scatter onto sequence shards.
* ``sequence_parallel``: a norm (or dropout) that runs on this rank's shard of
  the sequence between the parallel regions. Nothing under ``sequence_parallel=false``.
* ``replicate``: left whole on every rank, and run whole: every rank computes the same output from the same
  whole input (a mixture-of-experts layer: its router and experts are not cut). Under sequence parallelism its
  input is gathered from the sequence shards (an all-gather) and its output cut back to this rank's shard (a
  slice; backward all-gathers its gradient). Its parameters are plain tensors, whole on each rank; each rank
  computes their whole gradient, so nothing sums them over the tp group (FSDP2 reduces them over the data
  ranks only), and the gradient norm counts them on the group's first rank.
* ``head_norm``: a norm over each attention head's features, between a column-wise projection and attention
  (Qwen3's ``q_norm`` and ``k_norm``; Hugging Face's ``replicated_with_grad_allreduce``). It runs on this
  rank's heads, as they come out of the cut projection, with its weight whole on every rank; each rank's
  gradient of the weight is its heads' part, summed over the tp ranks where the gradients are reduced (one
  all-reduce, as a sequence-parallel norm's), with or without sequence parallelism.

Where several column-wise layers read the same input (queries, keys, values),
their parent gathers it once (under sequence parallelism) and hands them one
replicated input, so backward sums their input gradients before one reduction.
Under sequence parallelism the residual stream is cut at the first block's input
(the embeddings, the positions and anything the model derives from the whole
sequence, such as attention masks, are computed whole before it) and gathered again
by the head. The shards must be of one length (gloo aborts the process on all-gathers of unequal ones), so
under sequence parallelism the model pads each micro-batch on the right to a multiple of the tp size, with
positions masked out of attention that carry no loss (``_pad_sequence``). The head (the last column-wise layer,
after every row-wise one) keeps its logits
cut over the vocabulary under ``loss_parallel``: the cross-entropy is computed on
the shards, in forward and backward, inside ``TensorParallel.context()``.

A vocabulary the tp size does not divide (the bytes tokenizer and a chat template's two markers: 261) is
cut unevenly, as ``torch.chunk`` cuts it (131 and 130 rows): DTensor's vocabulary-parallel embedding and
cross-entropy take each rank's offset from the placement, so no row is padded, the logits of one rank never
include a row that is not the model's, and every state dict, checkpoint and export keeps the tokenizer's
vocabulary. (Megatron pads the vocabulary to a multiple instead, and must strip it on export.) Every other
cut dimension must divide: attention heads and MLP widths are the model's to choose.

Tied weights (the built-in GPT's head is its token embedding) are tied again
after the cut; both must be cut alike (head colwise, embedding rowwise).
"""

from __future__ import annotations

import re
import sys
from contextlib import ExitStack
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ConfigError, TPConfig

SEQUENCE = Shard(1)  # activations are (batch, sequence, features): sequence shards are dim 1
IGNORE_INDEX = -100  # a target that carries no loss (the built-in models' and Hugging Face's)
# What a padded position holds, by batch key: a token no one attends to (attention_mask 0) and no target.
# position_ids continue the row's own.
PAD_VALUES = {"input_ids": 0, "token_type_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX,
              "targets": IGNORE_INDEX}


def declared_plan(model: nn.Module) -> Optional[Dict[str, str]]:
    """The model's own plan: ``tp_plan`` (the built-in GPT, an ``HFModel`` from its configuration)."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if plan else None


def resolve_plan(model: nn.Module, cfg: TPConfig) -> Dict[str, str]:
    """Module name -> style for every module the plan names; ConfigError naming dist.tp.plan otherwise."""
    patterns = declared_plan(model) if cfg.plan == "auto" else dict(cfg.plan)
    if not patterns:
        raise ConfigError(f"dist.tp.size={cfg.size}: {type(model).__name__} declares no tensor-parallel plan "
                          "(tp_plan, or a Hugging Face configuration's base_model_tp_plan); set dist.tp.plan to a "
                          "mapping of module-name patterns to colwise, rowwise, sequence_parallel, replicate or "
                          "head_norm")
    names = [name for name, _ in model.named_modules() if name]
    resolved: Dict[str, str] = {}
    for pattern, style in patterns.items():
        regex = re.compile("[^.]+".join(re.escape(part) for part in pattern.split("*")))
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise ConfigError(f"dist.tp.plan: the pattern {pattern!r} matches no module of {type(model).__name__} "
                              f"(its modules are named like {names[:6]}...)")
        resolved.update(dict.fromkeys(matched, style))
    return resolved


def cut_dim(module: nn.Module, style: str) -> int:
    """The weight dimension a colwise/rowwise cut splits: a Linear's output features (dim 0) or input
    features (dim 1); an Embedding's width (dim 1) or vocabulary rows (dim 0)."""
    return 0 if (style == "colwise") == isinstance(module, nn.Linear) else 1


def check_divisible(model: nn.Module, plan: Dict[str, str], size: int) -> None:
    """Every cut dimension divides by the tp size, and so does every head count; ConfigError naming the module."""
    modules = dict(model.named_modules())
    head = head_of(model, plan)
    for name, style in plan.items():
        module = modules[name]
        if style in ("colwise", "rowwise"):
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ConfigError(f"dist.tp.plan: {name} is a {type(module).__name__}; {style} cuts a Linear or "
                                  "an Embedding only")
            rows = module.weight.shape[cut_dim(module, style)]
            vocabulary = name == head or (isinstance(module, nn.Embedding) and style == "rowwise")
            if rows % size and not vocabulary:  # a vocabulary is cut unevenly (torch.chunk's sizes): see apply_tp
                raise ConfigError(f"dist.tp.size={size}: {name} ({style}) has {rows} features to cut, not a "
                                  f"multiple of {size}")
    for name, module in modules.items():
        for attr in ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads"):
            heads = getattr(module, attr, None) or getattr(getattr(module, "config", None), attr, None)
            if isinstance(heads, int) and heads % size:
                raise ConfigError(f"dist.tp.size={size}: {name or type(module).__name__} has {attr}={heads}, not "
                                  f"divisible by the tp size; every rank must hold whole heads")


def checked_plan(model: nn.Module, cfg: TPConfig) -> Dict[str, str]:
    """The resolved plan, checked as training checks it (plan mode too): ConfigError naming the key."""
    plan = resolve_plan(model, cfg)
    check_divisible(model, plan, cfg.size)
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style == "sequence_parallel" and isinstance(modules[name], (nn.Linear, nn.Embedding)):
            raise ConfigError(f"dist.tp.plan: {name} is a {type(modules[name]).__name__}; sequence_parallel is for "
                              "norms and dropout (cut a Linear or an Embedding colwise or rowwise, or replicate it)")
    if cfg.sequence_parallel and "sequence_parallel" not in plan.values():
        raise ConfigError(f"dist.tp.sequence_parallel=true: the plan of {type(model).__name__} places no norm on "
                          "sequence shards (no module is sequence_parallel); set dist.tp.sequence_parallel=false, "
                          "or give dist.tp.plan the norms as sequence_parallel")
    block = getattr(model, "block_size", None)
    if cfg.sequence_parallel and isinstance(block, int) and block % cfg.size:
        # The sequence is cut into tp shards of one length: blocks of this size (packed data, the built-in GPT's,
        # the pipeline's stages) cannot be, and a padded micro-batch could not be padded to a multiple within it
        # (the built-in GPT has no learned position past it). Refused before anything is cut or communicated.
        near = [n for n in (block - block % cfg.size, block + cfg.size - block % cfg.size) if n]
        raise ConfigError(f"data.block_size={block} (the model's block_size) is not a multiple of dist.tp.size="
                          f"{cfg.size}: sequence parallelism cuts each sequence into {cfg.size} equal shards; set "
                          f"data.block_size to {' or '.join(map(str, near))}, or dist.tp.sequence_parallel=false")
    return plan


def head_of(model: nn.Module, plan: Dict[str, str]) -> Optional[str]:
    """The output head: the last column-wise Linear, after every row-wise module (None if there is none)."""
    order = [name for name, _ in model.named_modules() if name in plan]
    head = None
    for name in order:
        if plan[name] == "rowwise":
            head = None
        elif plan[name] == "colwise" and isinstance(model.get_submodule(name), nn.Linear):
            head = name
    return head


def _tied_groups(model: nn.Module) -> List[List[Tuple[str, str]]]:
    """(module name, attribute) of each parameter that more than one module holds."""
    holders: Dict[int, List[Tuple[str, str]]] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mname, pname))
    return [group for group in holders.values() if len(group) > 1]


def _gather_input(mesh: DeviceMesh, sequence_parallel: bool):
    """A parent's pre-hook: its first tensor input as one replicated DTensor for every column-wise child.

    Under sequence parallelism the input is this rank's sequence shard: gathered
    once here (an all-gather), and in backward the children's summed input
    gradients are reduce-scattered once. Otherwise the input is whole, and
    backward all-reduces the summed gradient once.
    """
    placement = SEQUENCE if sequence_parallel else Replicate()

    def to_replicated(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        return x.redistribute(mesh, [Replicate()])

    return _on_first_input(to_replicated)


def _on_first_input(convert: Callable[[Any], Any]) -> Callable:
    """A forward pre-hook that applies ``convert`` to the module's first input: the first positional
    argument, or the first tensor keyword (a Hugging Face layer is called with hidden_states=...)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        if args:
            return (convert(args[0]), *args[1:]), kwargs
        key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        return args, {**kwargs, key: convert(kwargs[key])}

    return hook


def _cut_sequence(mesh: DeviceMesh):
    """The first block's pre-hook under sequence parallelism: its (whole) input cut to this rank's
    sequence shard. Forward keeps a slice (no communication); backward all-gathers the gradient."""

    def to_shard(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        if x.shape[1] % mesh.size():  # shards of unequal length: the all-gathers would abort (gloo), not raise
            raise ConfigError(f"dist.tp.sequence_parallel=true: a sequence of {x.shape[1]} positions does not cut "
                              f"into dist.tp.size={mesh.size()} equal shards; set data.block_size (and the "
                              f"model's block_size) to a multiple of {mesh.size()}, or "
                              "dist.tp.sequence_parallel=false")
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [SEQUENCE]).to_local()

    return _on_first_input(to_shard)


def _pad_sequence(size: int):
    """The model's pre-hook under sequence parallelism: the micro-batch padded on the right to a multiple of
    ``size`` positions, so that the stream cuts into equal sequence shards.

    Padded chats (``data=hf_chat data.packing=false``) are as long as each micro-batch's longest
    conversation: any length. The added positions change no number: they come after every real token
    (attention is causal, and they are masked out of it: attention_mask 0), carry no loss (target -100,
    so the loss and its item count are the unpadded batch's) and continue the row's positions; they stay
    within the model's block_size, a multiple of ``size`` (``checked_plan``). A batch without an attention
    mask is refused instead: nothing would hide the padding from a model that is not causal. Fixed-length
    blocks (packed chats, the built-in GPT's) are of the block size, and so never padded here.
    """

    def refuse(length: int, why: str) -> ConfigError:
        fits = [n for n in (length - length % size, length + size - length % size) if n]
        return ConfigError(f"data.block_size: a micro-batch of {length} tokens a row does not cut into dist.tp.size="
                           f"{size} equal sequence shards (dist.tp.sequence_parallel=true), and {why}; set "
                           f"data.block_size to a multiple of {size} (e.g. {' or '.join(map(str, fits))}), or "
                           "dist.tp.sequence_parallel=false")

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        batch = args[0] if args else None
        if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), torch.Tensor):
            return None
        length = batch["input_ids"].shape[1]
        extra = -length % size
        if not extra:
            return None
        if "attention_mask" not in batch:
            raise refuse(length, "the batch has no attention_mask to pad it with")
        padded = {}
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != length:
                padded[key] = value
                continue
            shape = (value.shape[0], extra, *value.shape[2:])
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, extra + 1, dtype=value.dtype, device=value.device).view(1, -1)
            elif key in PAD_VALUES:
                tail = value.new_full(shape, PAD_VALUES[key])
            else:
                raise refuse(length, f"the batch's {key!r} is of that length and not known to pad (one of "
                                     f"{sorted([*PAD_VALUES, 'position_ids'])})")
            padded[key] = torch.cat([value, tail], dim=1)
        return (padded, *args[1:]), kwargs

    return hook


def _style(module: nn.Module, style: str, is_head: bool, cfg: TPConfig, parent_gathers: bool) -> Optional[Any]:
    """The torch ParallelStyle of ``style`` for ``module`` (None: nothing to do)."""
    sp = cfg.sequence_parallel
    stream = SEQUENCE if sp else Replicate()  # how the blocks' activations between the parallel regions are laid out
    if style == "colwise":
        if is_head:
            out = Shard(-1) if cfg.loss_parallel else Replicate()
            return ColwiseParallel(input_layouts=stream, output_layouts=out, use_local_output=not cfg.loss_parallel)
        if isinstance(module, nn.Embedding):  # before the first block: whole
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        return ColwiseParallel(input_layouts=Replicate() if parent_gathers else stream)
    if style == "rowwise":
        if isinstance(module, nn.Embedding):  # before the first block: whole
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        return RowwiseParallel(output_layouts=stream)
    if style == "sequence_parallel" and sp:
        return SequenceParallel()
    if style == "head_norm":
        return _HeadNorm()
    if style == "replicate" and sp:  # run whole between sequence shards: gathered in, cut back out
        return PrepareModuleInputOutput(input_layouts=SEQUENCE, desired_input_layouts=Replicate(),
                                        use_local_input=True, output_layouts=Replicate(),
                                        desired_output_layouts=SEQUENCE, use_local_output=True)
    return None


class _HeadNorm(SequenceParallel):
    """``head_norm``: the weight replicated, the input this rank's heads (dim -2 of (..., heads, head size))."""

    def __init__(self):
        super().__init__(use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if isinstance(x, DTensor) or x.ndim < 2:
            raise ValueError(f"dist.tp.plan: head_norm {type(mod).__name__} takes the local heads of a column-wise "
                             f"projection as a plain tensor (..., heads, head size), not {type(x).__name__} of "
                             f"{x.ndim} dims")
        return DTensor.from_local(x, device_mesh, (Shard(x.ndim - 2),), run_check=False)


def apply_tp(model: nn.Module, mesh: DeviceMesh, cfg: TPConfig, blocks: List[nn.Module],
             count: bool = True) -> "TensorParallel":
    """Cut ``model`` in place over ``mesh`` (the tp sub-mesh) as its plan says; ``blocks``: its repeated blocks.

    ``count``: count the tp collectives (a dispatch mode over each micro-batch). Not under
    trainer.compile: torch.compile does not trace through a dispatch mode (nothing would compile),
    and what it compiles issues its collectives from inside the graph."""
    plan = checked_plan(model, cfg)
    if cfg.sequence_parallel and not blocks:
        raise ConfigError("dist.tp.sequence_parallel=true cuts the sequence at the first block's input, and the model "
                          "declares no blocks: set dist.blocks, or dist.tp.sequence_parallel=false")
    head = head_of(model, plan)
    tied = _tied_groups(model)
    parents = {name.rpartition(".")[0] for name, style in plan.items()
               if style == "colwise" and name != head and isinstance(model.get_submodule(name), nn.Linear)}
    styles = {}
    for name, style in plan.items():
        parent_gathers = name.rpartition(".")[0] in parents
        chosen = _style(model.get_submodule(name), style, name == head, cfg, parent_gathers)
        if chosen is not None:
            styles[name] = chosen
    parallelize_module(model, mesh, styles)
    for parent in parents:
        model.get_submodule(parent).register_forward_pre_hook(_gather_input(mesh, cfg.sequence_parallel),
                                                              with_kwargs=True)
    if cfg.sequence_parallel:
        blocks[0].register_forward_pre_hook(_cut_sequence(mesh), with_kwargs=True)
        # Padded micro-batches are of any length: padded further here, before the model reads them, to
        # lengths that cut into equal shards (unequal ones abort gloo's all-gathers with no message).
        model.register_forward_pre_hook(_pad_sequence(mesh.size()), with_kwargs=True)
    _tie_again(model, tied)
    float8 = "torchao.float8" in sys.modules and _has_float8(model)  # converted before the cut (run.build)
    return TensorParallel(mesh, cfg.loss_parallel and head is not None, plan, head, count, float8)


def _has_float8(model: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return any(isinstance(m, Float8Linear) for m in model.modules())


def _tie_again(model: nn.Module, groups: List[List[Tuple[str, str]]]) -> None:
    """Each tied group holds the first holder's (now cut) parameter again; both must be cut alike."""
    for (first_module, first_name), *others in groups:
        param = getattr(model.get_submodule(first_module), first_name)
        for module_name, name in others:
            mine = getattr(model.get_submodule(module_name), name)
            if _placements(mine) != _placements(param):
                raise ConfigError(f"dist.tp.plan: {first_module}.{first_name} and {module_name}.{name} are one "
                                  f"tied weight but the plan cuts them differently ({_placements(param)} and "
                                  f"{_placements(mine)}); cut the embedding rowwise and the head colwise")
            setattr(model.get_submodule(module_name), name, param)


def _placements(p: torch.Tensor) -> tuple:
    return tuple(p.placements) if isinstance(p, DTensor) else (Replicate(),)


def local_shapes(model: nn.Module, cfg: TPConfig) -> Dict[int, torch.Size]:
    """id(parameter) -> the shape each tp rank holds of it (parameters the plan cuts; whole shapes given)."""
    if cfg.size == 1:
        return {}
    plan = resolve_plan(model, cfg)
    shapes = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if style not in ("colwise", "rowwise"):
            continue
        dim = cut_dim(module, style)
        for pname, p in module.named_parameters(recurse=False):
            if pname == "bias" and dim == 1:
                continue  # a row-wise Linear's bias is added once, whole
            shape = list(p.shape)
            shape[dim if p.ndim > 1 else 0] = -(-shape[dim if p.ndim > 1 else 0] // cfg.size)  # the largest cut
            shapes[id(p)] = torch.Size(shape)
    return shapes


def tp_sharded(p: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether ``p`` is cut over the tp dimension (each rank a different part) rather than whole on each."""
    if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ()):
        return False
    return p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard()


class _CountCollectives(TorchDispatchMode):
    """Counts the activation collectives DTensor issues (torch's functional collectives) with their bytes."""

    KINDS = {"all_reduce": "allreduces", "all_reduce_": "allreduces", "all_gather_into_tensor": "all_gathers",
             "reduce_scatter_tensor": "reduce_scatters"}

    def __init__(self, counts: Dict[str, int], prefix: str = "tp_"):
        super().__init__()
        self.counts, self.prefix = counts, prefix

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            # A DTensor's op: let DTensor run it, so the collectives it issues inside come back here.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional":
            kind = self.KINDS.get(func._opname)
            if kind == "allreduces" and args[0].dtype == torch.float64 and FP8_AMAX_KEYS[0] in self.counts:
                # float8's scales: an amax over a cut dimension, reduced in float64 (torchao's casts), apart from
                # the activations' (float32 or half)
                self.counts[FP8_AMAX_KEYS[0]] += 1
                self.counts[FP8_AMAX_KEYS[1]] += args[0].numel() * args[0].element_size()
            elif kind is not None:
                # bytes as fsdp counts them: the whole (gathered, or reduced-from) tensor
                big = out if kind == "all_gathers" else args[0]
                self.counts[f"{self.prefix}{kind}"] += 1
                self.counts[f"{self.prefix}{kind[:-1]}_bytes"] += big.numel() * big.element_size()
        return out


def count_collectives(counts: Dict[str, int], prefix: str) -> _CountCollectives:
    """A context counting DTensor's functional collectives into ``counts`` under keys ``prefix`` + kind (the
    keys of TP_COMM_KEYS with ``tp_`` replaced)."""
    return _CountCollectives(counts, prefix)


TP_COMM_KEYS = ("tp_all_gathers", "tp_all_gather_bytes", "tp_reduce_scatters", "tp_reduce_scatter_bytes",
                "tp_allreduces", "tp_allreduce_bytes")
# float8 linears under tp (dist_trainer/fp8.py): each cast whose amax spans a cut dimension all-reduces it
FP8_AMAX_KEYS = ("fp8_amax_allreduces", "fp8_amax_allreduce_bytes")


class TensorParallel:
    """What the strategy keeps of the cut: the loss-parallel context and the tp collectives' counters."""

    def __init__(self, mesh: DeviceMesh, loss_parallel: bool, plan: Dict[str, str], head: Optional[str],
                 counting: bool = True, float8: bool = False):
        self.mesh, self.loss_parallel, self.plan, self.head = mesh, loss_parallel, plan, head
        self.counting = counting
        self.counts = dict.fromkeys(TP_COMM_KEYS + (FP8_AMAX_KEYS if float8 else ()), 0)

    def comm(self) -> Dict[str, int]:
        """The tp collectives under their tp_* keys, and float8's amax all-reduces apart (FP8_AMAX_KEYS)."""
        return dict(self.counts)

    def context(self, count: bool = True) -> ContextManager:
        """Forward and backward of one micro-batch (or evaluation): the vocabulary-sharded loss, counted."""
        stack = ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if count and self.counting:
            stack.enter_context(_CountCollectives(self.counts))
        return stack


def norm_activation_bytes(model: nn.Module, cfg: TPConfig, tokens: int, param_bytes: int) -> int:
    """Bytes the plan's sequence-parallel LayerNorms save for backward in one micro-batch, on one rank.

    Each saves its input (tokens x width, in the parameters' dtype) and its mean and reciprocal
    standard deviation (one FP32 value each per token). Under sequence parallelism a rank holds
    ``tokens / size`` of them; without, all: what sequence parallelism cuts.
    """
    plan = checked_plan(model, cfg)
    held = tokens // cfg.size if cfg.sequence_parallel else tokens
    return sum(held * (module.normalized_shape[-1] * param_bytes + 2 * 4) for name, style in plan.items()
               if style == "sequence_parallel" and isinstance(module := model.get_submodule(name), nn.LayerNorm))


def expected_tp_comm(model: nn.Module, cfg: TPConfig, tokens: int, accum: int, param_bytes: int,
                     linear_bytes: int, checkpointed: List[str], grad_reductions: int = 1,
                     held: Optional[Callable[[str], bool]] = None, chunk_tokens: Optional[int] = None
                     ) -> Dict[str, int]:
    """Calls and bytes of the tp collectives of one optimizer step of ``accum`` micro-batches, by metrics key.

    ``tokens``: a micro-batch's (micro batch x sequence length); ``param_bytes``: bytes of an element of
    the parameters as computed with, which the embeddings, norms and the residual stream carry;
    ``linear_bytes``: of a Linear's output (autocast's dtype, else the parameters'); ``checkpointed``: the
    names of the blocks whose forward runs again in backward (activation checkpointing), but for
    the last row-wise layer of each (recomputation stops at the last activation backward needs).

    Per micro-batch, under sequence parallelism (else all-reduces where marked):
    a row-wise Linear reduce-scatters its output in forward (all-reduce) and all-gathers its
    gradient in backward (nothing); a parent of column-wise layers all-gathers their input once in
    forward (nothing) and reduce-scatters its summed gradient in backward (all-reduce); a row-wise
    Embedding all-reduces its output (it is whole before the first block); the first block's input
    cut all-gathers its gradient in backward (nothing); the head all-gathers its input in forward
    (nothing) and reduce-scatters its gradient in backward (all-reduce), and its loss-parallel
    cross-entropy all-reduces three
    FP32 values per token (the maximum, the sum of exponentials, the target's logit); without
    loss parallelism it all-gathers the logits instead. Each parameter of a sequence-parallel norm
    all-reduces its gradient (summed over the sequence shards), and of a head norm (summed over the heads),
    where FSDP reduces gradients:
    ``grad_reductions`` times a step (once under accum_sync=last, each micro-batch under every). A
    ``replicate`` module under sequence parallelism all-gathers its input in forward and its output's gradient
    in backward (the residual stream's width: the first column-wise layer's input).
    ``held``: which of the plan's modules count (a pipeline stage group's; default all); the first
    block's input cut counts where the first block is held. ``chunk_tokens``: ``model.loss.chunked``'s chunks,
    whose cross-entropy all-reduces the same three values a token in two collectives a chunk
    (``models/loss.py``).
    """
    plan = checked_plan(model, cfg)
    head = head_of(model, plan)
    first_block = next((n for n, style in plan.items() if style == "colwise" and n != head
                        and isinstance(model.get_submodule(n), nn.Linear)), None)
    cut_here = held is None or (first_block is not None and held(first_block))
    plan = {n: style for n, style in plan.items() if held is None or held(n)}
    sp = cfg.sequence_parallel
    counts = dict.fromkeys(TP_COMM_KEYS, 0)

    def add(kind: str, elements: int, element_bytes: int, times: int = 1) -> None:
        counts[f"tp_{kind}s"] += times
        counts[f"tp_{kind}_bytes"] += times * elements * element_bytes

    def block_of(name: str) -> Optional[str]:
        return next((b for b in checkpointed if name == b or name.startswith(b + ".")), None)

    # A checkpointed block's forward runs again in backward, up to the last activation backward
    # needs (torch stops recomputing there): its last row-wise layer's output feeds the residual
    # sum only, so that layer's reduction is not repeated.
    last_rowwise = {block_of(name): name for name, style in plan.items() if style == "rowwise" and block_of(name)}

    def forward_times(name: str) -> int:
        block = block_of(name)
        return 2 * accum if block is not None and last_rowwise.get(block) != name else accum

    parents = {}
    for name, style in plan.items():
        module = model.get_submodule(name)
        if style == "colwise" and name != head and isinstance(module, nn.Linear):
            parents.setdefault(name.rpartition(".")[0], module.in_features)
    reduce = "reduce_scatter" if sp else "allreduce"
    if sp and parents and cut_here:  # the first block's input cut: its gradient all-gathered in backward
        add("all_gather", tokens * next(iter(parents.values())), param_bytes, accum)
    for name, style in plan.items():
        module = model.get_submodule(name)
        if style == "rowwise" and isinstance(module, nn.Embedding):  # before the blocks: whole
            add("allreduce", tokens * module.embedding_dim, param_bytes, accum)
        elif style == "colwise" and isinstance(module, nn.Embedding):
            add("all_gather", tokens * module.embedding_dim, param_bytes, accum)
        elif style == "rowwise":
            add(reduce, tokens * module.out_features, linear_bytes, forward_times(name))
            if sp:
                add("all_gather", tokens * module.out_features, linear_bytes, accum)
        elif (style == "sequence_parallel" and sp) or style == "head_norm":
            for p in module.parameters():
                add("allreduce", p.numel(), 4, grad_reductions)
        elif style == "replicate" and sp and parents:  # run whole: its input gathered, its output's gradient too
            width = next(iter(parents.values()))
            add("all_gather", tokens * width, param_bytes, forward_times(name))
            add("all_gather", tokens * width, param_bytes, accum)
        elif style == "colwise" and name == head:
            if sp:
                add("all_gather", tokens * module.in_features, param_bytes, forward_times(name))
            add(reduce, tokens * module.in_features, param_bytes, accum)
            if chunk_tokens is not None:  # a chunk's maximum, then its sums of exponentials and target logits
                chunks = -(-tokens // chunk_tokens)
                counts["tp_allreduces"] += 2 * chunks * forward_times(name)
                counts["tp_allreduce_bytes"] += 3 * tokens * 4 * forward_times(name)
            elif cfg.loss_parallel:
                add("allreduce", tokens, 4, 3 * forward_times(name))
            else:  # a vocabulary the tp size does not divide is gathered in equal parts, the last one padded
                add("all_gather", tokens * -(-module.out_features // cfg.size) * cfg.size, linear_bytes,
                    forward_times(name))
    for parent, width in parents.items():
        if sp:
            add("all_gather", tokens * width, param_bytes, forward_times(parent))
        add(reduce, tokens * width, param_bytes, accum)
    return counts
