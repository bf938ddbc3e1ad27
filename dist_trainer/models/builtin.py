"""Built-in models for ``dist_trainer``.

Every model's ``forward`` takes the collated batch dict and returns either

* a scalar tensor: the mean loss over the samples of the micro-batch, or
* ``{"loss_sum": tensor, "num_items": int64 tensor}``: the summed loss over
  items (e.g. tokens) and how many items were summed. ``num_items`` stays a
  tensor so computing it never forces a host/device sync.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..moe import BalanceConfig, Experts, MoE, Routing, SharedExperts, inactive_params
from .loss import LossOptions, chunked_loss_terms

__all__ = ["GPT", "DigitsConvNet", "BranchyMLP"]

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using fused ``scaled_dot_product_attention``.

    Queries, keys and values are three projections (not one fused ``qkv``), so
    that a column-wise tensor-parallel cut of each gives every rank whole heads;
    the forward reads the number of heads it holds from the projection's width.
    ``qkv.*`` in an older state dict is split into the three on load.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"model.n_embd ({n_embd}) must be divisible by model.n_head ({n_head})")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj.is_residual_proj = True  # type: ignore[attr-defined]
        self.attn_dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        # Context parallelism (parallel/cp.py) sets the attention over the cp group's tokens here:
        # (q, k, v) of this rank's tokens -> their causal attention output. None: the local sequence is whole.
        self.context: Optional[Callable[..., torch.Tensor]] = None
        self.register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        # (B, T, heads x head_dim) -> (B, heads, T, head_dim); heads: those this rank holds
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if self.context is not None:
            y = self.context(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))


def _split_fused_qkv(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """A state dict of the fused layout (``qkv``: queries, keys, values stacked) loads into q, k, v."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip("qkv", fused.chunk(3)):
                state_dict[f"{prefix}{name}.{kind}"] = part


class MLP(nn.Module):
    """Position-wise feed-forward block: Linear(4x) -> GELU -> Linear -> Dropout."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.proj.is_residual_proj = True  # type: ignore[attr-defined]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block; its feed-forward part a mixture of experts where ``moe`` says so."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool,
                 moe: Optional[Callable[[], nn.Module]] = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias) if moe is None else moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Small GPT-style decoder-only transformer language model.

    ``forward(batch)`` takes ``{"input_ids": int64[B, T], "targets": int64[B, T]}``
    (``T <= block_size`` tokens; targets of ``-100`` are ignored) and returns
    ``{"loss_sum": float32 scalar, "num_items": int64 scalar}``: the summed
    next-token cross-entropy in nats over all non-ignored target tokens, and
    the number of such tokens.

    ``loss`` (``model.loss``): ``chunked: true`` computes the head and the cross-entropy ``chunk_tokens``
    tokens at a time (``models/loss.py``), so the whole ``[tokens, vocab]`` logits never exist; same numbers.
    """

    items_are_tokens = True  # num_items counts tokens: the trainer reports tokens_per_s
    # The repeated blocks, declared as Hugging Face models do: FSDP units and the unit of
    # activation checkpointing (dist.blocks overrides it).
    _no_split_modules = ["Block"]
    # The tensor-parallel plan (dist.tp.plan=auto), as Hugging Face configurations declare theirs:
    # each block's attention and MLP column-wise in, row-wise out; the embedding and the tied head
    # cut by vocabulary rows; the norms on sequence shards under dist.tp.sequence_parallel.
    tp_plan = {
        "tok_emb": "rowwise", "head": "colwise",
        "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
        "blocks.*.ln_1": "sequence_parallel", "blocks.*.ln_2": "sequence_parallel", "ln_f": "sequence_parallel",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        moe: Optional[Dict[str, Any]] = None,
        loss: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        for key, val in (("vocab_size", vocab_size), ("block_size", block_size),
                         ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if val < 1:
                raise ValueError(f"model.{key} must be >= 1, got {val}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {dropout}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        # model.moe.num_experts > 0: every block's MLP is a mixture of experts sharing one Routing.
        self.moe = moe_options(moe, n_embd)
        self.routing = Routing(BalanceConfig.from_dict(moe)) if self.moe else None
        layer = (lambda: moe_layer(self.routing, self.moe)) if self.moe else None  # noqa: E731
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias, layer) for _ in range(n_layer))
        if self.moe:  # tensor parallelism cuts the attention only; each MoE layer runs whole on every tp rank
            self.tp_plan = {**{k: v for k, v in GPT.tp_plan.items() if ".mlp." not in k}, "blocks.*.mlp": "replicate"}
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.loss_options = LossOptions.from_dict(loss)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2*n_layer))."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std /= math.sqrt(2 * self.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, Experts):  # the experts' output projections are residual ones too
            nn.init.normal_(module.down_proj, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer))
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (tied weights counted once); optionally minus position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.pos_emb.weight.numel()
        return n

    def flops_per_item(self) -> float:
        """Training FLOPs per token (forward + backward), for model FLOPs utilisation.

        6 per parameter per token for the matrix multiplies (2 forward, 4
        backward), plus attention's scores and weighted sum over a full
        context: 12 x layers x width x block_size (the PaLM appendix formula).
        """
        matmul_params = self.num_params(non_embedding=True)
        # A token goes through top_k routed experts of each MoE layer, not all of them.
        matmul_params -= inactive_params(self)
        return 6.0 * matmul_params + 12.0 * self.n_layer * self.n_embd * self.block_size

    # Pipeline stages (dist.pp.size): the modules of the first stage before the blocks, of the last after.
    pp_first = ("tok_emb", "pos_emb", "drop")
    pp_last = ("ln_f", "head")

    def embed(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The residual stream ``[B, T, n_embd]`` before the first block; ``position_ids`` ``[T]`` or ``[1, T]``: the
        tokens' positions in their sequence (context parallelism holds a part of it), ``0 .. T-1`` if not given."""
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device) if position_ids is None else position_ids
        assert T <= self.block_size, (
            f"sequence length {T} exceeds model block_size {self.block_size}"
        )
        return self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))

    def hidden(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The final norm's output ``[B, T, n_embd]``, which the head turns into logits."""
        x = self.embed(input_ids, position_ids)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def logits(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]`` for ``input_ids`` ``[B, T]``."""
        return self.head(self.hidden(input_ids, position_ids))

    def stage_dims(self) -> tuple[int, int]:
        """The stream's width and the logits' width (the vocabulary)."""
        return self.n_embd, self.vocab_size

    def context_modules(self) -> list[nn.Module]:
        """The attention modules context parallelism (``parallel.cp``) gives the cp group's tokens."""
        return [block.attn for block in self.blocks]

    @staticmethod
    def stage_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The next token each position predicts, as the last stage's loss takes them."""
        return batch["targets"]

    def stage_forward(self, x: torch.Tensor, blocks: list, first: bool, last: bool,
                      side: Optional[dict] = None) -> torch.Tensor:
        """One pipeline stage: token ids (``first``) or the stream in; the stream or (``last``) logits out.
        ``side``: the micro-batch's ``position_ids`` where context parallelism cut it, and its ``targets`` under
        ``model.loss.chunked``, where the last stage returns the summed loss (``[1]``) instead of the logits: the
        chunks run inside the stage, where its parameters are gathered and their gradients reach FSDP."""
        if first:
            x = self.embed(x, (side or {}).get("position_ids"))
        for block in blocks:
            x = block(x)
        if not last:
            return x
        if self.loss_options.chunked:
            return self.head_loss(self.ln_f(x), side["targets"])["loss_sum"].reshape(1)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss_terms(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """The summed next-token cross-entropy over the non-ignored targets, and their number."""
        # Cross-entropy in float32 so it stays accurate under autocast.
        loss_sum = F.cross_entropy(
            logits.float().view(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        num_items = (targets != IGNORE_INDEX).sum()
        return {"loss_sum": loss_sum, "num_items": num_items}

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.routing is not None:  # the positions the balancing terms count: those whose target counts
            self.routing.token_mask = batch["targets"] != IGNORE_INDEX
        hidden = self.hidden(batch["input_ids"], batch.get("position_ids"))
        # data=blend: each row's sums too, for the per-source figures (the plain loss only: not chunked, and a
        # head cut over the vocabulary under tp computes its loss on shards)
        if "source" in batch and not self.loss_options.chunked and not isinstance(self.head.weight, DTensor):
            return self.sample_loss_terms(self.head(hidden), batch["targets"])
        return self.head_loss(hidden, batch["targets"])

    @staticmethod
    def sample_loss_terms(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """``loss_terms`` with each row's summed loss and counted targets beside them (``sample_loss_sum``,
        ``sample_items``): the per-source figures of a blend. The total is the rows' sum (the same terms,
        summed in another order than ``loss_terms``' one reduction)."""
        per_token = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                    ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
        rows = per_token.sum(dim=1)
        counted = (targets != IGNORE_INDEX).sum(dim=1)
        return {"loss_sum": rows.sum(), "num_items": counted.sum(), "sample_loss_sum": rows.detach(),
                "sample_items": counted}

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """``loss_terms`` of the head's logits of ``hidden`` (the final norm's output), whole or chunk by chunk."""
        if self.loss_options.chunked:  # the head's weight read directly: its logits exist a chunk at a time
            return chunked_loss_terms(hidden, self.head.weight, targets, self.loss_options.chunk_tokens)
        return self.loss_terms(self.head(hidden), targets)


def moe_options(moe: Optional[Dict[str, Any]], n_embd: int) -> Optional[Dict[str, Any]]:
    """The MoE layer's arguments from ``model.moe`` (None: dense, ``num_experts`` 0 or unset)."""
    moe = dict(moe or {})
    experts = int(moe.get("num_experts") or 0)
    if experts <= 0:
        return None
    hidden = int(moe.get("hidden") or 4 * n_embd)
    shared = int(moe.get("shared_experts") or 0)
    bias_rate = float(dict(moe.get("bias_update") or {}).get("rate", 0.0) or 0.0)
    return {"dim": n_embd, "hidden": hidden, "num_experts": experts, "top_k": int(moe.get("top_k", 2)),
            "shared_hidden": shared * hidden,
            "score": str(moe.get("router", "softmax")), "norm_topk": bool(moe.get("norm_topk", True)),
            "selection_bias": bias_rate > 0, "capacity_factor": moe.get("capacity_factor")}


def moe_layer(routing: Routing, options: Dict[str, Any]) -> MoE:
    """One block's MoE layer; ``shared_experts`` of them merged into one SwiGLU MLP that is ``hidden`` times as
    wide (DeepSeek's layout)."""
    options = dict(options)
    shared_hidden = options.pop("shared_hidden")
    shared = SharedExperts(options["dim"], shared_hidden) if shared_hidden else None
    return MoE(routing, shared=shared, **options)


class DigitsConvNet(nn.Module):
    """Small conv net with BatchNorm for 1x8x8 digit images.

    ``forward(batch)`` takes ``{"image": float[B, 1, 8, 8], "label": int64[B]}``
    and returns the scalar mean cross-entropy (nats per sample).
    """

    def __init__(self, width: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"model.width must be >= 1, got {width}")
        if num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2, got {num_classes}")
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 4 * 4, num_classes),
        )

    def logits(self, image: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]``."""
        return self.net(image)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self.logits(batch["image"]).float(), batch["label"])


class BranchyMLP(nn.Module):
    """Tiny MLP with a conditionally used ``branch`` layer (for DDP unused-parameter tests).

    ``forward(batch)`` takes ``{"x": float[B, in_dim], "y": float[B],
    "use_branch": bool[B]}``. The branch is used for the whole micro-batch iff
    ``use_branch[0]`` is True (this reads the flag on the host). Returns the
    scalar mean squared error per sample.
    """

    def __init__(self, in_dim: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.trunk = nn.Linear(in_dim, hidden)
        self.branch = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.trunk(batch["x"]))
        if bool(batch["use_branch"][0]):
            h = torch.tanh(self.branch(h))
        pred = self.head(h).squeeze(-1)
        return F.mse_loss(pred.float(), batch["y"].float())
