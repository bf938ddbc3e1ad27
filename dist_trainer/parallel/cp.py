"""Context parallelism (``dist.cp.size``): each sequence's tokens split over the ranks of a cp group.

The cp ranks of a group see the same micro-batches (``MeshShape.data_rank``). Before the model runs, each keeps
its share of every sequence's positions (``positions``): labels are shifted before the cut (the data's targets,
or the model's ``stage_targets`` of its labels), the positions stay global (the position embeddings read them), and the loss is each rank's tokens' sum, divided
like any other by the step's valid tokens over every rank and micro-batch (the trainer's one all-reduce). Only
attention needs the other ranks' tokens:

* ``ring``: the keys and values travel around the group (cp - 1 exchanges a layer's forward); this rank's chunks
  are paired with the block's (an earlier chunk attended whole, the same chunk causally, a later one not at all),
  each pair through torch's fused kernel on CPU, and the pairs merged by their log-sum-exp (flash attention's
  online softmax). Backward passes the keys and values around again with their gradients, which end on their
  owner (cp - 1 and cp exchanges).
* ``ulysses``: one all-to-all turns (this rank's tokens, every head) into (every token, cp-th of the heads) for
  q, k and v at once, attention runs causally over the whole sequence, a second all-to-all turns the output
  back (DeepSpeed-Ulysses). Backward mirrors both.

``zigzag`` gives rank r chunks r and 2 cp - 1 - r of 2 cp equal chunks, so every rank has the same causal work;
``contiguous`` gives it chunk r of cp (the last rank then does 2 cp - 1 times the first's work). A sequence
shorter than a multiple of the layout's unit is padded at its end (input 0, label ignored): under a causal mask
no earlier position sees the padding, so the result is exact.

Models: the built-in GPT (learned positions) and Hugging Face causal decoders laid out as Llama's (llama, qwen2,
...; rotary positions from ``position_ids``, grouped keys and values repeated to the heads), whose attention
function transformers calls through the interface ``models.hf`` registers. Batches may be right-padded (an
``attention_mask`` of ones then zeros): causal attention never looks past a real token. Packed sequences, whose
positions restart, cannot be split this way by either method (a ConfigError, ``data.packing``).

Under tensor parallelism a cp group is the ranks of one data rank with the same tp index: each holds its tp
rank's heads, and the exchange runs over those heads; sequence parallelism's shards are cut from a rank's share
of the sequence, so the share is padded to a multiple of tp too (``unit``).

Under pipeline stages each stage group has its own cp groups; the strategy cuts each window's micro-batches
(``ContextParallel.cut``) before its schedule runs them, and the stages read the positions as a side input.

Gradients: every cp rank's parameters receive the gradient of its tokens' loss (attention's cross terms arrive
through the exchanged keys' and values' gradients); the strategy's reduction over all gradient ranks (cp ranks
included) sums them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, CPConfig, MeshShape

IGNORE_INDEX = -100
# Devices whose ring pairs run torch's fused attention kernel (CPU's flash kernel, which returns the log-sum-exp the
# merge needs); elsewhere the same math written out. CUDA's fused kernels are not wired yet: no GPU has run them.
FUSED_DEVICES = ("cpu",)


def positions(length: int, cp: int, rank: int, layout: str, device: Any = None) -> torch.Tensor:
    """The global positions (ascending) of cp rank ``rank``'s tokens in a sequence of ``length`` tokens."""
    if layout == "zigzag":
        chunk = length // (2 * cp)
        low, high = rank * chunk, (2 * cp - 1 - rank) * chunk
        return torch.cat([torch.arange(low, low + chunk, device=device),
                          torch.arange(high, high + chunk, device=device)])
    chunk = length // cp
    return torch.arange(rank * chunk, (rank + 1) * chunk, device=device)


class CPCounter:
    """The cp collectives a rank issued: ring exchanges (a send each) or all-to-alls, with their bytes."""

    def __init__(self) -> None:
        self.counts = {"cp_sends": 0, "cp_send_bytes": 0, "cp_all_to_alls": 0, "cp_all_to_all_bytes": 0}

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.counts[f"cp_{kind}s"] += 1
        self.counts[f"cp_{kind}_bytes"] += tensor.numel() * tensor.element_size()


class CPGroup:
    """A rank's context-parallel group: its size, its index, its neighbours and the layout."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int, layout: str, counter: CPCounter) -> None:
        self.group, self.size, self.rank, self.layout, self.counter = group, size, rank, layout, counter
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def positions(self, local: int, rank: int, device: Any) -> torch.Tensor:
        """The global positions of cp rank ``rank``'s ``local`` tokens (every rank holds as many)."""
        return positions(local * self.size, self.size, rank, self.layout, device)

    def pass_on(self, tensor: torch.Tensor, tag: int = 0) -> tuple[torch.Tensor, List[Any]]:
        """Send ``tensor`` to the next rank and receive the previous rank's into a new one (not yet waited);
        ``tag`` tells two exchanges in flight at once apart (a block's values and its gradients)."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)  # contiguous too: empty_like keeps a permuted tensor's strides
        self.counter.add("send", tensor)
        works = [dist.isend(tensor, self.next, group=self.group, tag=tag),
                 dist.irecv(received, self.prev, group=self.group, tag=tag)]
        return received, works

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Dim 0 (``size`` equal parts) scattered over the group: part j to rank j, rank i's part j-th."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)  # contiguous too: empty_like keeps a permuted tensor's strides
        self.counter.add("all_to_all", tensor)
        dist.all_to_all_single(received, tensor, group=self.group)
        return received


def _wait(works: List[Any]) -> None:
    for work in works:
        work.wait()


def chunk_ids(cp: int, rank: int, layout: str) -> List[int]:
    """Which of the sequence's equal chunks cp rank ``rank`` holds, in order (2 cp chunks under zigzag, cp
    contiguous)."""
    return [rank, 2 * cp - 1 - rank] if layout == "zigzag" else [rank]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One (query chunk, key chunk) pair's attention output and its log-sum-exp per query: torch's fused CPU
    kernel (flash attention's, ``aten._scaled_dot_product_flash_attention_for_cpu``: the one fused kernel that
    returns the log-sum-exp the merge needs) on CPU, the same math written out elsewhere. ``causal``: the
    diagonal pair (equal chunks, the mask aligned at their first position)."""
    if q.device.type in FUSED_DEVICES:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _attend_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """One pair's q, k, v gradients given the whole attention's output and log-sum-exp of these queries (so the
    pair's weights are its share of the whole softmax)."""
    if q.device.type in FUSED_DEVICES:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            0.0, causal, scale=scale)
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(scores - lse[..., None])
    ds = p * (grad @ v.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ grad


def _pairs(ring: CPGroup, source: int) -> List[tuple[int, int, bool]]:
    """(this rank's chunk, ``source``'s chunk, diagonal) for every pair a causal mask leaves anything of: a key
    chunk before the query chunk whole, the same chunk causally, a later one not at all."""
    mine, theirs = chunk_ids(ring.size, ring.rank, ring.layout), chunk_ids(ring.size, source, ring.layout)
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def _merge(acc: Optional[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor,
           lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge: two partial attentions of the same queries over disjoint keys as one."""
    if acc is None:
        return out, lse
    merged = torch.logaddexp(acc[1], lse)
    return (acc[0] * torch.exp(acc[1] - merged)[..., None] + out * torch.exp(lse - merged)[..., None]), merged


class _RingAttention(torch.autograd.Function):
    """Causal attention over the group's tokens, keys and values passed around the ring; float32 at least inside
    (autocast off: the merge and the kernels in the inputs' type promoted to float32)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: CPGroup,
                scale: Optional[float] = None) -> torch.Tensor:
        dtype = q.dtype
        inner = torch.promote_types(dtype, torch.float32)  # float32 under autocast's half types, float64 kept
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        given = (q, k, v)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(inner), k.to(inner), v.to(inner)
            n = len(chunk_ids(ring.size, ring.rank, ring.layout))
            qs = q.chunk(n, dim=-2)
            acc: List[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * n
            kv = torch.stack([k, v])
            for step in range(ring.size):
                works: List[Any] = []
                if step < ring.size - 1:  # the next block travels while this one is computed
                    incoming, works = ring.pass_on(kv)
                ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
                for i, j, diagonal in _pairs(ring, (ring.rank - step) % ring.size):
                    acc[i] = _merge(acc[i], *_attend(qs[i], ks[j], vs[j], diagonal, scale))
                if works:
                    _wait(works)
                    kv = incoming
            # every query chunk has its diagonal pair: every query sees at least itself, its lse is finite
            out = torch.cat([a[0] for a in acc], dim=-2)
            lse = torch.cat([a[1] for a in acc], dim=-1)
        # q, k, v kept as they came (a half type's upcast is exact, redone in backward): under autocast half the
        # bytes of float32 copies; the output and log-sum-exp in float32, as the merge made them
        ctx.save_for_backward(*given, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dtype = grad_out.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = q.to(out.dtype), k.to(out.dtype), v.to(out.dtype)
            n = len(chunk_ids(ring.size, ring.rank, ring.layout))
            grad_out = grad_out.to(q.dtype)
            qs, gs = q.chunk(n, dim=-2), grad_out.chunk(n, dim=-2)
            outs, lses = out.chunk(n, dim=-2), lse.chunk(n, dim=-1)
            dq = [torch.zeros_like(c) for c in qs]
            kv = torch.stack([k, v])
            dkv = torch.zeros_like(kv)  # the gradients of the block held, travelling with it back to its owner
            for step in range(ring.size):
                works: List[Any] = []
                if step < ring.size - 1:
                    incoming, works = ring.pass_on(kv)
                ks, vs = kv[0].chunk(n, dim=-2), kv[1].chunk(n, dim=-2)
                dks, dvs = [torch.zeros_like(c) for c in ks], [torch.zeros_like(c) for c in vs]
                for i, j, diagonal in _pairs(ring, (ring.rank - step) % ring.size):
                    gq, gk, gv = _attend_backward(gs[i], qs[i], ks[j], vs[j], outs[i], lses[i], diagonal, scale)
                    dq[i] += gq
                    dks[j] += gk
                    dvs[j] += gv
                dkv = dkv + torch.stack([torch.cat(dks, dim=-2), torch.cat(dvs, dim=-2)])
                dkv, grad_works = ring.pass_on(dkv, tag=1)  # after cp passes it is back on its owner: this rank's
                _wait(grad_works)
                if works:
                    _wait(works)
                    kv = incoming
            dq_all = torch.cat(dq, dim=-2)
        return dq_all.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None


class _AllToAll(torch.autograd.Function):
    """The group's all-to-all over dim 0; its backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CPGroup) -> torch.Tensor:
        ctx.group = group
        return group.all_to_all(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        return ctx.group.all_to_all(grad), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: CPGroup,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention: heads cut over the group, each rank attending over the whole sequence."""
    B, H, local, D = q.shape
    cp = group.size
    # [3, B, H, T/cp, D] -> [cp (heads' group), 3, B, H/cp, T/cp, D]: part j to rank j
    qkv = torch.stack([q, k, v]).view(3, B, cp, H // cp, local, D).permute(2, 0, 1, 3, 4, 5)
    got = _AllToAll.apply(qkv, group)  # [cp (source rank), 3, B, H/cp, T/cp, D]
    # The sources' tokens side by side, then in sequence order (each rank's positions are its own).
    order = torch.cat([group.positions(local, r, q.device) for r in range(cp)])
    to_natural = torch.argsort(order)
    whole = got.permute(1, 2, 3, 0, 4, 5).reshape(3, B, H // cp, cp * local, D)[:, :, :, to_natural]
    y = F.scaled_dot_product_attention(whole[0], whole[1], whole[2], is_causal=True, scale=scale)  # [B, H/cp, T, D]
    back = y[:, :, order].view(B, H // cp, cp, local, D).permute(2, 0, 1, 3, 4)  # [cp (tokens' owner), ...]
    mine = _AllToAll.apply(back, group)  # [cp (heads' group), B, H/cp, T/cp, D]
    return mine.permute(1, 0, 2, 3, 4).reshape(B, H, local, D)


class ContextParallel:
    """``dist.cp.size`` applied to a model: its batch cut into this rank's positions, its attention exchanged.

    The model declares where (``context_modules()``: its attention modules, each calling its ``context``
    attribute where set; ``position_ids`` read from the batch; a Hugging Face model routes its attention
    function there, ``attend_through_context``); nothing of its forward is replaced."""

    def __init__(self, model: nn.Module, mesh: MeshShape, cfg: CPConfig, rank: int, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.counter = CPCounter()
        self.size = mesh.cp
        self.groups: List[dist.ProcessGroup] = []
        if mesh.cp == 1:
            return
        modules = _attention_modules(model, mesh.cp, cfg.method, mesh.tp)  # checked before the first collective
        # cp groups: the ranks of one stage group, data rank and tp index
        # (rank = ((stage group x data ranks + data rank) x cp + cp rank) x tp + tp index)
        root = init_device_mesh(device_type, (mesh.pp, mesh.grad_ranks // mesh.cp, mesh.cp, mesh.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))
        group = root["cp"].get_group()
        self.groups = [group]
        self.group = CPGroup(group, mesh.cp, mesh.cp_rank(rank), cfg.layout, self.counter)
        self.unit = unit(mesh.cp, cfg.layout, mesh.tp)
        self.targets = getattr(model, "stage_targets", None)  # the next tokens, shifted before the cut
        attention = (lambda q, k, v, scale=None: _RingAttention.apply(q, k, v, self.group, scale)) \
            if cfg.method == "ring" else (lambda q, k, v, scale=None: ulysses_attention(q, k, v, self.group, scale))
        for module in modules:
            module.context = attention
        if hasattr(model, "attend_through_context"):
            model.attend_through_context()
        # before any other pre-hook (tensor parallelism's padding to its size): the whole sequence is cut here
        model.register_forward_pre_hook(self._cut, prepend=True)

    def _cut(self, module: nn.Module, args: tuple) -> tuple:
        """The micro-batch's sequences cut to this rank's positions (padded to the layout's unit first): every
        ``[B, T]`` tensor of it, the targets shifted from the labels first where the batch has none."""
        batch: Dict[str, torch.Tensor] = dict(args[0])
        if "position_ids" in batch:
            raise ValueError(f"dist.cp.size={self.size}: the batch brings its own position_ids (packed sequences, "
                             "data.packing=true): ring and ulysses attend causally over the whole row; set "
                             "data.packing=false")
        mask = batch.get("attention_mask")
        if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError(f"dist.cp.size={self.size}: the batch is not right-padded (a position attended after "
                             "a padded one): context parallelism masks causally by position only")
        if self.targets is not None:
            batch["targets"] = self.targets(batch)
        return (self.cut(batch), *args[1:])

    def padded(self, length: int) -> int:
        """A sequence's length once padded to the unit (pipeline stages fix their shapes to it)."""
        return -(-length // self.unit) * self.unit

    def cut(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Every ``[B, T]`` tensor of ``batch`` padded to the unit and cut to this rank's positions, and those
        positions as ``position_ids`` (also for pipeline stages, which cut their window's micro-batches here)."""
        batch = dict(batch)
        length = batch["input_ids"].shape[1]
        pad = -length % self.unit
        mine = self.group.positions((length + pad) // self.size, self.group.rank, batch["input_ids"].device)
        for key, tensor in batch.items():
            if tensor.dim() >= 2 and tensor.shape[1] == length:
                if pad:  # at the end, where a causal mask hides it from every real position
                    fill = IGNORE_INDEX if key in ("targets", "labels") else 0
                    tensor = F.pad(tensor, (0, pad), value=fill)
                batch[key] = tensor[:, mine]
        return {**batch, "position_ids": mine.unsqueeze(0)}

    def comm(self) -> Dict[str, int]:
        return dict(self.counter.counts) if self.size > 1 else {}


def heads(module: nn.Module, tp: int = 1) -> tuple[int, int]:
    """An attention module's query heads on a rank (whole heads cut over ``tp``) and their width."""
    n_head = getattr(module, "n_head", None) or module.config.num_attention_heads
    return n_head // tp, module.head_dim


def _attention_modules(model: nn.Module, cp: int, method: str, tp: int) -> List[nn.Module]:
    """The modules whose attention context parallelism takes over; a ConfigError for what cannot work."""
    if not hasattr(model, "context_modules"):
        raise ConfigError(f"dist.cp.size={cp}: {type(model).__name__} declares no attention for context "
                          "parallelism (context_modules()): set dist.cp.size=1")
    modules = model.context_modules()
    for module in modules:
        if method == "ulysses" and heads(module, tp)[0] % cp:
            raise ConfigError(f"dist.cp.method=ulysses needs the attention heads of a tp rank ({heads(module, tp)[0]})"
                              f" divisible by dist.cp.size={cp}: use ring, or another cp size")
        if getattr(module, "attention_dropout", 0.0) or getattr(module, "attn_dropout", 0.0):
            raise ConfigError(f"dist.cp.size={cp}: attention dropout is not split over the cp ranks: set the "
                              "model's attention dropout to 0")
    return modules


def apply_cp(model: nn.Module, mesh: MeshShape, cfg: CPConfig, rank: int, device_type: str) -> ContextParallel:
    """Context parallelism on ``model`` in place (nothing without it)."""
    return ContextParallel(model, mesh, cfg, rank, device_type)


def unit(cp: int, layout: str, tp: int = 1) -> int:
    """What a sequence's length is padded to a multiple of: every chunk of the layout (2 cp of them under zigzag,
    cp contiguous) of equal length, and a rank's share cut into tp equal shards under sequence parallelism."""
    return (2 * cp if layout == "zigzag" else cp) * tp


def padded_length(length: int, cp: int, layout: str, tp: int = 1) -> int:
    """A sequence's length once ``ContextParallel`` has padded it to the layout's unit."""
    return -(-length // unit(cp, layout, tp)) * unit(cp, layout, tp)


def attention_work(length: int, cp: int, layout: str) -> List[int]:
    """Each cp rank's (query, key) pairs under the causal mask, for one sequence of ``length`` tokens: equal
    under ``zigzag``, growing with the rank under ``contiguous``."""
    length = padded_length(length, cp, layout)
    return [int((positions(length, cp, r, layout) + 1).sum()) for r in range(cp)]


def expected_cp_comm(layers: List[nn.Module], cfg: CPConfig, micro_batch_size: int, length: int,
                     accum_steps: int, forwards: int, element_size: int, tp: int = 1) -> Dict[str, int]:
    """The cp collectives of one step on a rank: per attention module of ``layers`` (``context_modules()``, or a
    stage group's) and
    micro-batch, ``forwards`` forward passes (2 under activation checkpointing's recomputation) and one backward.

    ring: a forward passes the stacked keys and values on cp - 1 times, a backward cp - 1 times again and their
    gradients cp times, all at least float32 (``_RingAttention``). ulysses: a forward exchanges q, k, v (3 x) and
    the output (1 x) once each, a backward their gradients, in the activations' dtype (``element_size``)."""
    cp = cfg.size
    counts = dict.fromkeys(CPCounter().counts, 0)
    local = padded_length(length, cp, cfg.layout, tp) // cp
    for layer in layers:
        block = micro_batch_size * math.prod(heads(layer, tp)) * local  # one of q, k, v: [B, H / tp, T / cp, D]
        if cfg.method == "ring":
            sends = forwards * (cp - 1) + (cp - 1) + cp
            counts["cp_sends"] += accum_steps * sends
            counts["cp_send_bytes"] += accum_steps * sends * 2 * block * max(element_size, 4)
        else:
            counts["cp_all_to_alls"] += accum_steps * (2 * forwards + 2)
            counts["cp_all_to_all_bytes"] += accum_steps * (4 * forwards + 4) * block * element_size
    return counts
