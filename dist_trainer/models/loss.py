"""The language-model loss in chunks of tokens (``model.loss.chunked``): the head and the cross-entropy without the
whole ``[tokens, vocab]`` logits.

The plain loss (``GPT.loss_terms``) computes the logits of the whole micro-batch, upcasts them to float32 and keeps
them until backward, with the cross-entropy's own copy: at a 128k vocabulary that is 512 KiB per token per
float32 copy, far more than everything else a small model keeps for a token. The chunked loss computes
``chunk_tokens`` rows of logits at a time and keeps none of them for backward; the numbers are the plain path's
(the sum of the tokens' cross-entropies in float32, ignored targets excluded), only summed chunk by chunk.

Two implementations, picked by the dtype the head's matmul runs in (``head_dtype``):

* float32 (fp32 weights, no autocast): torch's ``F.linear_cross_entropy`` with chunking options. It computes each
  chunk's gradients during the forward (3 matmuls a chunk, nothing recomputed) and keeps two gradient-sized
  buffers (the input's and the head weight's) until backward.
* a half type (autocast, or half weights): ``_ChunkedHeadLoss`` below. ``F.linear_cross_entropy`` would return
  the loss in the half type (a bf16 sum of thousands of token losses is off by whole nats) and, computing the
  gradients in forward, would form the softmax's small probabilities before fp16's loss scale reaches them. Ours
  computes each chunk's logits in the half type as autocast would, the cross-entropy in float32, keeps nothing of
  the chunk, and recomputes it in backward (a 4th matmul a chunk), where the incoming gradient (the loss scale
  included) multiplies the cross-entropy's gradient before it is cast to the half type, as on the plain path.
  The head weight's gradient is summed over the chunks in float32 (each chunk's rounded once, like the plain
  path's single product).

Under tensor parallelism the head's weight is a DTensor cut over the vocabulary (``dist.tp.loss_parallel``'s
layout), and ``_VocabParallelChunks`` computes each chunk's cross-entropy on the rank's vocabulary slice, as torch's
``loss_parallel`` does on the whole logits: a chunk's maximum all-reduced, then its sum of exponentials and its
targets' logits in one all-reduce (3 float32 values a token in 2 collectives a chunk, loss_parallel's bytes), the
log-sum-exp kept for backward, which needs no collective of its own. The head's input is gathered as the
column-wise head gathers it, and its gradient, a partial sum on each rank, reduced (or reduce-scattered back to
the sequence shards) as the head's would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..config import Config, ConfigError, MeshShape, require

IGNORE_INDEX = -100
# Rows of the head's matmul at a time. 1024 rows keep each chunk's matmuls large enough to run at full speed
# (every chunk reads the whole head weight; far fewer rows make that read the cost), while a chunk's float32
# logits stay at 4 KiB per vocabulary entry: 512 MiB at a 128k vocabulary, against 4 GiB for 8k tokens whole.
DEFAULT_CHUNK_TOKENS = 1024
KEYS = ("chunked", "chunk_tokens")


@dataclass(frozen=True)
class LossOptions:
    """``model.loss``: ``chunked`` (false: the plain loss), ``chunk_tokens`` (rows of logits at a time)."""

    chunked: bool = False
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS

    @classmethod
    def from_dict(cls, loss: Optional[Mapping[str, Any]]) -> "LossOptions":
        """The one reader of ``model.loss``; a ConfigError naming the key."""
        loss = dict(loss or {})
        for key in loss:
            if key not in KEYS:
                raise ConfigError(f"model.loss.{key}: not a key of model.loss (one of {list(KEYS)})")
        chunked, size = loss.get("chunked", False), loss.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
        if not isinstance(chunked, bool):
            raise ConfigError(f"model.loss.chunked={chunked!r}: must be true or false")
        if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ConfigError(f"model.loss.chunk_tokens={size!r}: must be an integer >= 1 (rows of logits at a time)")
        return cls(chunked, size)


# The Hugging Face builder (models.hf): model.loss reaches it as it reaches the GPT; its chunks are a causal LM's.
HF_MODELS = ("dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")


def check_loss(cfg: Config, mesh: MeshShape) -> None:
    """``model.loss`` (the built-in GPT's, a Hugging Face causal LM's): its keys, and ``chunked`` refused where
    the chunks would not be exact.

    The chunked loss runs in the model's own forward, reading the head's weight whole (``chunked_loss_terms``
    below). A Hugging Face family whose head is more than a bias-free linear map is refused when it is built
    (models.hf).
    """
    loss = cfg.model.get("loss")
    if not isinstance(loss, dict):
        return  # absent, or a custom model's own constructor argument
    if not LossOptions.from_dict(loss).chunked:
        return
    key, fix = "model.loss.chunked", "set model.loss.chunked=false"
    require(cfg.model.get("_target_") not in HF_MODELS or cfg.model.get("task", "causal_lm") == "causal_lm", key,
            True, f"is for causal LMs (model=hf_causal_lm); a masked LM's head transforms the hidden states: {fix}")
    # Under tp the chunks are computed on each rank's slice of the vocabulary, the layout loss_parallel gives.
    require(mesh.tp == 1 or cfg.dist.tp.loss_parallel, key, True, f"with dist.tp.size={mesh.tp} computes each "
            "chunk's cross-entropy on the ranks' vocabulary slices, which dist.tp.loss_parallel=false gathers "
            f"instead; set dist.tp.loss_parallel=true (or {fix})")


def chunked_loss_terms(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                       chunk_tokens: int) -> Dict[str, torch.Tensor]:
    """``GPT.loss_terms`` of the logits ``hidden @ weight.T``, computed ``chunk_tokens`` rows at a time.

    ``hidden`` ``[..., width]``: the final norm's output; ``weight`` ``[vocab, width]``: the head's (no bias).
    """
    if isinstance(weight, DTensor):  # tensor parallelism: the head cut over the vocabulary
        return _vocab_parallel_terms(hidden, weight, targets, chunk_tokens)
    x, t = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    dtype = head_dtype(x, weight)
    if dtype == torch.float32 and hasattr(F, "linear_cross_entropy"):  # torch >= 2.13; else ours, in float32
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None)
        loss_sum = F.linear_cross_entropy(x, weight, t, reduction="sum", ignore_index=IGNORE_INDEX, options=options)
    else:
        loss_sum = _ChunkedHeadLoss.apply(x, weight, t, chunk_tokens, dtype)
    return {"loss_sum": loss_sum, "num_items": (targets != IGNORE_INDEX).sum()}


def head_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes in here: autocast's where it is on for the device, else the
    weight's (the plain path requires the input's to match it)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _chunks(tokens: int, size: int) -> Iterator[slice]:
    return (slice(start, min(start + size, tokens)) for start in range(0, tokens, size))


def _chunk_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The plain path on one chunk: logits in the inputs' dtype, the summed cross-entropy in float32."""
    logits = F.linear(x, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedHeadLoss(torch.autograd.Function):
    """Sum of the tokens' cross-entropies of ``x @ weight.T`` computed in ``dtype``, chunk by chunk; only ``x``,
    the weight and the targets are kept for backward, which recomputes each chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight, targets)
        ctx.chunk_tokens, ctx.dtype = chunk_tokens, dtype
        with torch.autocast(x.device.type, enabled=False):  # the casts are explicit: autocast's, done once
            w = weight.to(dtype)
            total = torch.zeros((), dtype=torch.float32, device=x.device)
            for rows in _chunks(x.shape[0], chunk_tokens):
                total += _chunk_loss(x[rows].to(dtype), w, targets[rows])
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, targets = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # The weight's gradient summed over the chunks in float32: each chunk's product is rounded to the half
        # type once, as the plain path's one product is; a sum in the half type would round at every chunk.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        with torch.autocast(x.device.type, enabled=False), torch.enable_grad():
            w = weight.detach().to(ctx.dtype).requires_grad_()
            for rows in _chunks(x.shape[0], ctx.chunk_tokens):
                xc = x[rows].detach().to(ctx.dtype).requires_grad_()
                gx, gw = torch.autograd.grad(_chunk_loss(xc, w, targets[rows]), (xc, w), grad)
                if grad_x is not None:
                    grad_x[rows] = gx
                grad_w += gw
        return grad_x, grad_w.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None


def _vocab_parallel_terms(hidden: torch.Tensor, weight: DTensor, targets: torch.Tensor,
                          chunk_tokens: int) -> Dict[str, torch.Tensor]:
    """``chunked_loss_terms`` with the head's weight cut over the vocabulary (``Shard(0)`` on a tp mesh)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        raise ValueError(f"model.loss.chunked: the head's weight must be cut over the vocabulary on the tp mesh "
                         f"alone; got {weight.placements} on {mesh}")
    # The head's input whole on every rank, as the column-wise head takes it: gathered from the sequence shards
    # under sequence parallelism. Its gradient here is each rank's part of a sum over the vocabulary slices
    # (Partial), reduced on the way back (reduce-scattered to the shards, or all-reduced).
    if isinstance(hidden, DTensor):
        whole = hidden.redistribute(mesh, [Replicate()])
    else:
        whole = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    x = whole.to_local(grad_placements=[Partial()])
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's cut: every rank but the last holds this many
    first = mesh.get_local_rank() * rows
    loss_sum = _VocabParallelChunks.apply(x.reshape(-1, x.size(-1)), weight.to_local(), targets.reshape(-1),
                                          first, chunk_tokens, head_dtype(x, weight), mesh.get_group())
    return {"loss_sum": loss_sum, "num_items": (targets != IGNORE_INDEX).sum()}


def _slice_logits(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One chunk's logits of this rank's vocabulary slice, in ``dtype`` as autocast computes them, as float32."""
    return F.linear(x.to(dtype), weight.to(dtype)).float()


def _target_columns(targets: torch.Tensor, first: int, held: int) -> tuple:
    """(column of each target in this rank's slice, clamped; whether the slice holds it)."""
    column = targets - first
    here = (column >= 0) & (column < held) & (targets != IGNORE_INDEX)
    return column.clamp(0, max(held - 1, 0)), here


class _VocabParallelChunks(torch.autograd.Function):
    """Sum of the tokens' cross-entropies over a vocabulary cut between the tp ranks, chunk by chunk; keeps ``x``,
    the rank's slice of the weight, the targets and each token's log-sum-exp (one float32) for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, first: int,
                chunk_tokens: int, dtype: torch.dtype, group: Any) -> torch.Tensor:
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):  # the casts are explicit: autocast's, done once
            for rows in _chunks(x.shape[0], chunk_tokens):
                logits = _slice_logits(x[rows], weight, dtype)
                column, here = _target_columns(targets[rows], first, weight.shape[0])
                # The functional collectives, like DTensor's: tp's counter sees them as it sees loss_parallel's.
                top = funcol.wait_tensor(funcol.all_reduce(logits.amax(dim=-1), "max", group))
                picked = logits.gather(1, column[:, None]).squeeze(1) * here
                sums = torch.stack([(logits - top[:, None]).exp().sum(dim=-1), picked])
                exp_sum, target_logit = funcol.wait_tensor(funcol.all_reduce(sums, "sum", group)).unbind(0)
                lse[rows] = exp_sum.log() + top
                total += ((lse[rows] - target_logit) * (targets[rows] != IGNORE_INDEX)).sum()
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.first, ctx.chunk_tokens, ctx.dtype = first, chunk_tokens, dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, targets, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # see _ChunkedHeadLoss
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(ctx.dtype)
            for rows in _chunks(x.shape[0], ctx.chunk_tokens):
                logits = _slice_logits(x[rows], weight, ctx.dtype)
                column, here = _target_columns(targets[rows], ctx.first, weight.shape[0])
                # d loss / d logits: softmax minus the target's one-hot, on valid targets, times the incoming grad
                dlogits = (logits - lse[rows, None]).exp()
                dlogits[here.nonzero().squeeze(1), column[here]] -= 1.0
                dlogits = (dlogits * ((targets[rows] != IGNORE_INDEX)[:, None] * grad)).to(ctx.dtype)
                grad_x[rows] = (dlogits @ w).to(x.dtype)
                grad_w += (dlogits.t() @ x[rows].to(ctx.dtype)).float()
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None
