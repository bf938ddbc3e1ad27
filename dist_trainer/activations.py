"""Activation memory: the bytes autograd keeps for backward from one micro-batch's forward on a rank.

Measured by ``saved_bytes``: every tensor autograd saves (``saved_tensors_hooks``), each storage once, the
parameters left out, and the inputs of checkpointed blocks (activation checkpointing keeps those instead of what
the block would save). Predicted for plan mode by ``predicted_bytes``: the same measure of the same forward on
fake tensors (shapes and dtypes, no memory), at the shape one rank runs, built from the configuration.

Fake tensors, not the meta device: a fake CPU tensor dispatches to the kernels a CPU run picks, so attention runs
torch's fused kernel, which keeps a log-sum-exp per query, where a meta-device forward takes the math path and
keeps the ``[T, T]`` attention weights (measured 12.5 against 8.5 MiB at 256 tokens).

Context parallelism: a rank runs its ``T / cp`` tokens of each sequence; its attention keeps its own queries,
keys and values, its output and log-sum-exp (the ring's two at least float32; Ulysses' the same amounts over the
whole sequence for a cp-th of the heads, and its two orders of positions), and the exchanges keep nothing. The
prediction runs the rank's share through the method's own attention with a group whose exchanges only make
tensors of the shapes the real ones receive.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from . import fp8
from .config import BatchPlan, Config


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(an id of ``t``'s storage, its bytes). The StorageImpl's address: views share it, and fake tensors, which
    have no data pointer, have one too."""
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


def saved_bytes(model: nn.Module, forward: Callable[[], Any], blocks: Iterable[nn.Module] = ()) -> tuple[int, Any]:
    """(bytes autograd saves in ``forward()`` of ``model``, each storage once, parameters excluded; the output).

    ``blocks``: checkpointed blocks, whose inputs are what they keep."""
    params = {_storage(p)[0] for p in model.parameters()}
    seen: Dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        key, size = _storage(t)
        if key not in params:
            seen[key] = max(seen.get(key, 0), size)

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    def inputs(module: nn.Module, args: tuple) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                keep(arg)

    hooks = [block.register_forward_pre_hook(inputs) for block in blocks]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        for hook in hooks:
            hook.remove()
    return sum(seen.values()), out


class _ShapesOnly:
    """A cp group for fake tensors: rank 0 of ``size``, its exchanges returning tensors of their inputs' shapes (what
    the real ones return), so the ring and Ulysses run at a rank's real shapes and keep what a rank keeps."""

    rank = 0

    def __init__(self, size: int, layout: str) -> None:
        self.size, self.layout = size, layout

    def positions(self, local: int, rank: int, device: Any) -> torch.Tensor:
        from .parallel.cp import positions

        return positions(local * self.size, self.size, rank, self.layout, device)

    def pass_on(self, tensor: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, list]:
        return torch.empty_like(tensor), []

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor.contiguous())


def predicted_bytes(cfg: Config, plan: BatchPlan, precision: Any) -> Optional[int]:
    """``saved_bytes`` of one micro-batch's forward on a rank, on fake tensors; None where plan mode cannot run the
    rank's forward alone (tensor-parallel or pipeline-stage ranks: DTensors and stages; ``auto`` micro-batches),
    or cannot run it on fake tensors: MoE layers (how many tokens an expert gets is data: fake tensors have no
    shape for it) and models other than the built-in GPT and Hugging Face decoders (their forward is unknown)."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # torch's own tracer (torch.compile's, export's)

    from .parallel.blocks import checkpoint_blocks, find_blocks
    from .parallel.cp import _RingAttention, padded_length, ulysses_attention

    from .parallel.checks import CP_MODELS
    from .moe.routing import routing_of

    mesh = plan.mesh
    if mesh.tp > 1 or mesh.pp > 1 or cfg.batch.micro_batch_size == "auto" or cfg.model.get("_target_") not in \
            CP_MODELS or cfg.model.get("task", "causal_lm") != "causal_lm":
        return None
    length = cfg.data.get("block_size") or cfg.model.get("block_size")
    if not length:
        return None
    # a pretrained model's shapes without its weights (from_pretrained refuses the meta device)
    weights = {"load_weights": False} if cfg.model.get("pretrained") else {}
    with torch.device("meta"):  # built and cast as the strategy holds it (FakeTensor parameters cannot be cast)
        model = precision.prepare(precision.fp32_norms(instantiate(cfg.model, _convert_="all", **weights)))
    if routing_of(model).layers:
        return None
    if cfg.precision.name in fp8.RECIPES:  # what float8 linears keep: their inputs' float8 copies and scales
        fp8.convert(model, cfg.precision.fp8, cfg.precision.name, "cpu")
    with FakeTensorMode():
        fake_cpu(model)
        blocks = find_blocks(model, cfg.dist.blocks) if cfg.dist.activation_checkpointing else []
        checkpoint_blocks(blocks) if blocks else None
        if mesh.cp > 1:
            length = padded_length(length, mesh.cp, cfg.dist.cp.layout, mesh.tp) // mesh.cp
            group = _ShapesOnly(mesh.cp, cfg.dist.cp.layout)
            attention = (lambda q, k, v, scale=None: _RingAttention.apply(q, k, v, group, scale)) \
                if cfg.dist.cp.method == "ring" else \
                (lambda q, k, v, scale=None: ulysses_attention(q, k, v, group, scale))
            for module in model.context_modules():
                module.context = attention
            if hasattr(model, "attend_through_context"):
                model.attend_through_context()
        batch = sample_batch(model, plan.micro_batch_size, length)
        model.train()
        with precision.autocast():
            return saved_bytes(model, lambda: model(batch), blocks)[0]


def fake_cpu(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` replaced by a fake CPU tensor of its shape and dtype (under the
    caller's FakeTensorMode), tied ones still tied."""
    made: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            if id(t) not in made:
                new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
            setattr(module, key, made[id(t)])


def sample_batch(model: nn.Module, micro: int, length: int, device: Any = None) -> Dict[str, torch.Tensor]:
    """A micro-batch of ``micro`` sequences of ``length`` random tokens of the model's vocabulary with their
    targets, as the built-in datasets give (no padding mask: a padded batch's mask adds its own tensors)."""
    vocab = getattr(model, "vocab_size", None) or model.model.config.vocab_size  # the GPT's, a Hugging Face model's
    return {"input_ids": torch.randint(0, vocab, (micro, length), device=device),
            "targets": torch.randint(0, vocab, (micro, length), device=device)}  # their own storage, as the data's
