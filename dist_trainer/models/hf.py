"""``model=hf_causal_lm`` and ``model=hf_masked_lm``: transformers models, trained exactly.

The framework calls every model as ``model(batch)`` and reads back a summed
loss and its item count. A transformers model takes keyword arguments and
computes its own loss, and some of those losses are traps: a mean that ignores
``num_items_in_batch`` weights every micro-batch alike, whatever its number of
tokens, so the accumulated update would not be the big batch's. ``HFModel``
holds the transformers model as ``.model``, calls it with the batch's input
tensors, and computes the loss here from the logits: the cross-entropy summed
in FP32 over the tokens that count (shifted labels for a causal LM, the masked
positions for a masked LM), with the number of those tokens.

A mixture-of-experts model (qwen3_moe, mixtral, olmoe, deepseek_v3, qwen2_moe)
runs through the project's MoE layer (``moe.hf``): its balancing terms are
``model.moe``'s, counted over the same tokens as the loss, and transformers'
own router loss is never computed, so nothing counts twice.

``model.loss.chunked`` (a causal LM): the decoder body runs to its final norm's output and the head and the
cross-entropy run ``chunk_tokens`` tokens at a time (``models/loss.py``), so the ``[tokens, vocab]`` logits never
exist whole; the same loss, from the same targets. Only where that is exact: a family whose head is more than a
bias-free linear map of that output (soft-capped or scaled logits, a bias) is refused when it is built.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ConfigError
from ..moe import Routing, inactive_params
from ..moe.hf import swap_moe_blocks
from .loss import LossOptions, chunked_loss_terms

IGNORE_INDEX = -100
TASKS = {"causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM"}
# model._target_ of this builder: its path, and the one configurations and checkpoints of earlier releases name.
TARGETS = ("dist_trainer.models.hf.hf_model", "dist_trainer.hf.models.hf_model")
# The batch keys passed on to the model; labels are ours (the loss is computed here).
# Hugging Face's tp styles by this project's names; others are the cuts they start with (colwise_rep, rowwise_rep).
HF_STYLES = {"replicated_with_grad_allreduce": "head_norm"}
# Projections Hugging Face gathers whole after the cut (OLMoE's q_proj/k_proj, for a norm over all heads): no style.
WHOLE_PROJECTION_STYLES = ("colwise_gather_output", "rowwise_split_input")
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# The attention function context parallelism registers with transformers (HFModel.attend_through_context).
CONTEXT_ATTENTION = "dist_trainer_context"
# The configuration values by which transformers' causal LMs (5.x) change the head's logits before the loss, found
# in their forward: soft-caps (tanh; any value changes the logits) and multipliers (1: none). A set one refuses
# model.loss.chunked, whose chunks are the head's plain product.
LOGIT_CAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")  # gemma2/3, recurrent_gemma, xlstm
LOGIT_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "logits_mup_width_multiplier",
                "output_multiplier")  # cohere, granite, falcon_h1, inkling (on the head's input), muse


class HFModel(nn.Module):
    """A transformers ``*ForCausalLM`` / ``*ForMaskedLM`` as the framework's model.

    ``forward(batch)`` returns ``{"loss_sum", "num_items"}``. Labels come from
    the batch: ``targets`` (already the next tokens, as ``data=tokens`` and
    ``data=hf_text`` give them: no shift), else ``labels`` (Hugging Face's
    convention: a causal LM's are shifted here, a masked LM's are the masked
    positions), else, for a causal LM, ``input_ids`` themselves (shifted, with
    padding from ``attention_mask`` ignored).
    """

    def __init__(self, model: nn.Module, task: str, tokenizer: Optional[str] = None,
                 block_size: Optional[int] = None, chat_template: Optional[str] = None,
                 routing: Optional[Routing] = None, loss: LossOptions = LossOptions()):
        super().__init__()
        self.model = model
        self.loss_options = loss  # model.loss: chunked (hf_model checked the head), chunk_tokens
        # The head, by name: a pipeline's last stage has no input embedding, where get_output_embeddings finds none.
        head = model.get_output_embeddings() if loss.chunked else None
        self._head_name = next((name for name, m in model.named_modules() if m is head), None)
        # The MoE layers' routing statistics and balancing terms (moe.routing_of finds it); None: a dense model.
        self.routing = routing
        self.task = task
        self.tokenizer_spec = tokenizer  # written beside the weights on export
        self.chat_template = chat_template  # data=hf_chat's choice: the exported tokenizer carries the template
        self.block_size = block_size
        self.name = f"{type(model).__name__} ({model.config.model_type}, transformers)"  # for the start-up log
        self.items_are_tokens = task == "causal_lm"  # a masked LM's items are its masked tokens only
        # The repeated blocks: those of the declared classes that occur more than once. A class
        # declared once (BERT's embeddings) holds weights tied to the output head, which must stay
        # in the same FSDP unit as the head.
        declared = [str(name) for name in (getattr(model, "_no_split_modules", None) or [])]
        counts = {name: sum(type(m).__name__ == name for m in model.modules()) for name in declared}
        self._no_split_modules = [name for name in declared if counts[name] > 1]
        self._call_kwargs = {"use_cache": False} if task == "causal_lm" else {}
        if routing is not None and hasattr(model.config, "output_router_logits"):
            # The balancing terms are the MoE layers' own; transformers' router loss would count them again.
            self._call_kwargs["output_router_logits"] = False
        self._stage_parts = _decoder_parts(model) if task == "causal_lm" else None
        # task=dpo's objective (rl.dpo.DPO: forward returns its loss over the batch's pairs); None: the tokens' loss
        self.objective = None

    # -- pipeline stages (dist.pp.size > 1): decoders laid out as Llama's (llama, qwen2, mistral, ...) -----------
    # The base model's embed_tokens go with the first stage, its norm and the lm_head with the last; its
    # rotary embedding (buffers only) stays on every rank. A model of another layout does not declare them.

    @property
    def pp_first(self) -> tuple:
        if self._stage_parts is None:
            raise AttributeError("pp_first: not a decoder laid out as Llama's")
        return self._stage_parts["first"]

    @property
    def pp_last(self) -> tuple:
        if self._stage_parts is None:
            raise AttributeError("pp_last: not a decoder laid out as Llama's")
        return self._stage_parts["last"]

    def stage_dims(self) -> tuple:
        """The stream's width and the logits' width (the vocabulary)."""
        return self.model.config.hidden_size, self.model.config.vocab_size

    # -- context parallelism (dist.cp.size > 1): decoders laid out as Llama's, full causal attention --------------
    def context_modules(self) -> list:
        """The decoder layers' attention modules context parallelism (``parallel.cp``) takes over; a ConfigError
        for a model whose attention it cannot reproduce (an encoder, sliding windows, another layout)."""
        config = self.model.config
        if self._stage_parts is None:
            raise ConfigError(f"dist.cp.size > 1 needs a causal decoder laid out as Llama's (llama, qwen2, ...); "
                              f"{self.name} is not one: set dist.cp.size=1")
        windows = [t for t in (getattr(config, "layer_types", None) or ()) if t != "full_attention"]
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if windows or (window is not None and window < (self.block_size or config.max_position_embeddings)):
            raise ConfigError(f"dist.cp.size > 1: {self.name} has sliding-window layers; context parallelism "
                              "attends over the whole causal sequence: set dist.cp.size=1")
        if self.routing is not None:  # a type config validation does not know by name (mixtral's experts)
            raise ConfigError(f"dist.cp.size > 1 with MoE layers ({self.name}) is not supported yet: set "
                              "dist.cp.size=1")
        base = getattr(self.model, self.model.base_model_prefix)
        return [layer.self_attn for layer in base.layers]

    def attend_through_context(self) -> None:
        """Route the layers' attention to their ``context`` (set by ``parallel.cp``) through transformers'
        attention interface. Its name has no mask function, so transformers builds no mask: the context's
        attention is causal by the tokens' global positions, and right padding is never attended to."""
        from transformers import AttentionInterface

        AttentionInterface.register(CONTEXT_ATTENTION, _context_attention)
        self.model.set_attn_implementation(CONTEXT_ATTENTION)

    def stage_targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The next token each position predicts (-100: none), aligned with the positions, as the last stage's
        loss takes them: ``targets`` as they are, else the labels shifted by one."""
        if "targets" in batch:
            return batch["targets"]
        labels = self._labels(batch)
        return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)

    def stage_forward(self, x: torch.Tensor, blocks: list, first: bool, last: bool,
                      side: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """One stage: token ids (``first``) or the stream in; the stream or (``last``) logits out. ``side``: the
        micro-batch's ``attention_mask`` and ``position_ids`` (every stage's rank reads its own copy of the
        batch), so that padded and packed sequences mask and rotate in every stage as in the whole model."""
        base = getattr(self.model, self.model.base_model_prefix)
        side = side or {}
        if first:
            x = base.embed_tokens(x)
        positions = side.get("position_ids")
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        masks = _stage_masks(base.config, x, side.get("attention_mask"), positions)
        rotary = base.rotary_emb(x, positions)
        types = getattr(base.config, "layer_types", None)
        for block in blocks:
            index = block.self_attn.layer_idx
            out = block(x, attention_mask=masks[types[index] if types else "full_attention"],
                        position_ids=positions, position_embeddings=rotary, use_cache=False)
            x = out[0] if isinstance(out, tuple) else out
        if not last:
            return x
        if self.loss_options.chunked:  # the summed loss ([1]), not the logits: the chunks run inside the stage
            return self.head_loss(base.norm(x), side["targets"])["loss_sum"].reshape(1)
        return self.model.lm_head(base.norm(x))

    @staticmethod
    def loss_terms(logits: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        return token_loss(logits, targets)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        if self.objective is not None:
            return self.objective(self, batch)
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        if self.routing is not None:  # the positions the balancing terms count: exactly those the loss counts
            targets = self.stage_targets(batch) if self.task == "causal_lm" else self._labels(batch)
            self.routing.token_mask = targets != IGNORE_INDEX
        if self.loss_options.chunked:  # a causal LM's body to its final norm, then the head a chunk at a time
            body = getattr(self._causal_lm, self._causal_lm.base_model_prefix)
            hidden = body(**inputs, **self._call_kwargs).last_hidden_state
            return self.head_loss(hidden, self.stage_targets(batch))
        logits = self.model(**inputs, **self._call_kwargs).logits
        labels = self._labels(batch)
        if self.task == "causal_lm" and "targets" not in batch:
            logits, labels = logits[:, :-1], labels[:, 1:]  # position t predicts token t + 1
        # data=blend: each row's sums too, for the per-source figures (not on a vocabulary-sharded head's logits)
        return token_loss(logits, labels, per_sample="source" in batch and not isinstance(logits, DTensor))

    def answer_logps(self, batch: Mapping[str, torch.Tensor], body: Optional[nn.Module] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's log-probability of its labelled tokens (``labels``, Hugging Face's unshifted convention),
        summed in FP32, and their number: under this model, or under ``body`` (a reference's transformers model)."""
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        logits = (body if body is not None else self.model)(**inputs, **self._call_kwargs).logits[:, :-1]
        labels = batch["labels"][:, 1:]  # position t predicts token t + 1
        nll = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
        return -nll.sum(dim=1), (labels != IGNORE_INDEX).sum(dim=1)

    def token_logps(self, batch: Mapping[str, torch.Tensor], temperature: float = 1.0, entropy: bool = False,
                    entropy_grad: bool = False, body: Optional[nn.Module] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Each labelled position's log-probability of its token under the logits over ``temperature``, in FP32
        (``[rows, length - 1]``, position t predicting token t + 1; 0 where unlabelled), and, with ``entropy``, the
        tempered distribution's entropy there (with its gradient where ``entropy_grad``). Under this model, or
        under ``body``."""
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        logits = (body if body is not None else self.model)(**inputs, **self._call_kwargs).logits[:, :-1]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        labels = batch["labels"][:, 1:]
        mask = labels != IGNORE_INDEX
        token = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
        if not entropy:
            return token, None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            return token, -(logp.exp() * logp).sum(-1) * mask

    def decode_step(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        """One sampling step: the last position's logits (FP32) of ``input_ids`` after ``cache`` (None: a prompt's
        first pass), and the cache grown by them. Rows of one prompt, unpadded."""
        name = self._cache_name
        out = self.model(input_ids=input_ids, use_cache=True, **{name: cache})
        return out.logits[:, -1].float(), getattr(out, name)

    @functools.cached_property
    def _cache_name(self) -> str:
        """The forward's name for the KV cache: ``cache`` from transformers 5.x on, ``past_key_values`` before."""
        return "cache" if "cache" in inspect.signature(self._causal_lm.forward).parameters else "past_key_values"

    def head_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``loss_terms`` of the head's logits of ``hidden`` (the final norm's output), ``chunk_tokens`` rows at a
        time: the head's weight read directly (whole, or a DTensor cut over the vocabulary under tp)."""
        weight = self.model.get_submodule(self._head_name).weight
        return chunked_loss_terms(hidden, weight, targets, self.loss_options.chunk_tokens)

    @property
    def _causal_lm(self) -> nn.Module:
        """The transformers ``*ForCausalLM`` (under a peft model's wrapper, its base: the adapters sit inside)."""
        return self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model

    def _labels(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "targets" in batch:
            return batch["targets"]
        if "labels" in batch:
            return batch["labels"]
        if self.task == "masked_lm":
            raise ValueError("model=hf_masked_lm needs 'labels' in the batch (data=hf_text makes them)")
        labels = batch["input_ids"]
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        return labels

    @property
    def tp_plan(self) -> Optional[Dict[str, str]]:
        """The configuration's ``base_model_tp_plan`` (under this wrapper's names), the head column-wise,
        the norms (classes named ``*Norm``) ``sequence_parallel``.

        A head tied to the input embedding (one weight) cuts the embedding by vocabulary rows
        too. Qwen3's per-head ``q_norm``/``k_norm`` (``replicated_with_grad_allreduce``) are ``head_norm``;
        styles Hugging Face spells out further (``colwise_rep``, ``rowwise_rep``) are the two cuts; a plan
        of a peft model (LoRA adapters) is not known: None.
        """
        base = dict(getattr(self.model.config, "base_model_tp_plan", None) or {})
        if not base or not hasattr(self.model, "base_model_prefix") or hasattr(self.model, "peft_config"):
            return None
        gathered = sorted(p for p, style in base.items() if style in WHOLE_PROJECTION_STYLES)
        if gathered:
            raise ConfigError(f"dist.tp.size: {self.model.config.model_type}'s attention normalises each whole "
                              f"projection across its heads ({', '.join(gathered)}: Hugging Face gathers them "
                              "whole), which this project's tensor parallelism does not cut; set dist.tp.size=1 "
                              "(fsdp, and dist.ep.size for the experts), or give dist.tp.plan a plan of your own")
        names = {id(m): name for name, m in self.model.named_modules()}
        plan = {f"model.{self.model.base_model_prefix}.{pattern}": HF_STYLES.get(style, style.split("_")[0])
                for pattern, style in base.items()}
        if self.routing is not None and self.routing.layers:
            # MoE: each block's mlp (router and experts, or a dense one) runs whole on every tp rank, as the GPT's.
            plan = {k: v for k, v in plan.items() if ".mlp." not in k}
            plan[f"model.{self.model.base_model_prefix}.layers.*.mlp"] = "replicate"
        base_model = getattr(self.model, self.model.base_model_prefix)
        for name, module in base_model.named_modules():  # the norms: on sequence shards under sequence parallelism
            if name and type(module).__name__.endswith("Norm"):
                pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
                plan.setdefault(f"model.{self.model.base_model_prefix}.{pattern}", "sequence_parallel")
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head is not None and id(head) in names:
            plan[f"model.{names[id(head)]}"] = "colwise"
            if embedding is not None and embedding.weight is head.weight:
                plan[f"model.{names[id(embedding)]}"] = "rowwise"
        return plan

    def flops_per_item(self) -> float:
        """Training FLOPs per token (6 per weight a token goes through, and attention's 12 * layers * width *
        context): of an MoE layer the router, ``top_k`` routed experts and the shared ones."""
        cfg = self.model.config
        weights = self.model.num_parameters(exclude_embeddings=True) - inactive_params(self.model)
        layers, width = getattr(cfg, "num_hidden_layers", 0), getattr(cfg, "hidden_size", 0)
        return 6.0 * weights + 12.0 * layers * width * (self.block_size or 0)


def _decoder_parts(model: nn.Module) -> Optional[Dict[str, tuple]]:
    """The first and last stage's modules of a decoder laid out as Llama's (embed_tokens, layers whose attention
    knows its layer index, norm, rotary_emb; lm_head), under HFModel's names; None for another layout."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if prefix else None
    if base is None or hasattr(model, "peft_config") or not hasattr(model, "lm_head"):
        return None
    if not all(hasattr(base, part) for part in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    if not all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in base.layers):
        return None
    return {"first": (f"model.{prefix}.embed_tokens",), "last": (f"model.{prefix}.norm", "model.lm_head")}


def _stage_masks(config: Any, stream: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 positions: torch.Tensor) -> Dict[str, Any]:
    """The attention masks the whole model builds for its layers (``full_attention``, and ``sliding_attention``
    where the configuration has such layers), from the stage's stream, mask and positions."""
    import inspect

    from transformers import masking_utils

    def build(fn: Any) -> Any:
        params = inspect.signature(fn).parameters
        kwargs = {"config": config, "attention_mask": attention_mask, "position_ids": positions,
                  ("inputs_embeds" if "inputs_embeds" in params else "input_embeds"): stream}
        for name in ("cache", "past_key_values"):  # the cache's name differs between transformers releases
            if name in params:
                kwargs[name] = None
        if "cache_position" in params:
            kwargs["cache_position"] = torch.arange(stream.shape[1], device=stream.device)
        return fn(**kwargs)

    masks = {"full_attention": build(masking_utils.create_causal_mask)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        masks["sliding_attention"] = build(masking_utils.create_sliding_window_causal_mask)
    return masks


def _context_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                       **kwargs: Any) -> tuple:
    """transformers' attention call, ``[B, H, T, D]`` in and ``[B, T, H, D]`` out, through ``module.context``;
    grouped keys and values repeated to the query heads first (their gradients sum back through the repeat)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return module.context(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


def token_loss(logits: torch.Tensor, labels: torch.Tensor, per_sample: bool = False) -> Dict[str, torch.Tensor]:
    """Cross-entropy summed in FP32 over the labels that are not -100, and their number; ``per_sample``: each
    row's sum and count beside them (``sample_loss_sum``, ``sample_items``: a blend's per-source figures)."""
    if per_sample:
        rows = F.cross_entropy(logits.reshape(labels.numel(), -1).float(), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape[0], -1).sum(dim=1)
        counted = (labels != IGNORE_INDEX).reshape(labels.shape[0], -1).sum(dim=1)
        return {"loss_sum": rows.sum(), "num_items": counted.sum(), "sample_loss_sum": rows.detach(),
                "sample_items": counted}
    labels = labels.reshape(-1)
    loss_sum = F.cross_entropy(logits.reshape(labels.numel(), -1).float(), labels, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return {"loss_sum": loss_sum, "num_items": (labels != IGNORE_INDEX).sum()}


def hf_model(task: str = "causal_lm", model_type: Optional[str] = None, config: Optional[Dict[str, Any]] = None,
             pretrained: Optional[str] = None, tokenizer: Optional[str] = None, block_size: Optional[int] = None,
             attn_implementation: Optional[str] = "sdpa", chat_template: Optional[str] = None,
             lora: Optional[Dict[str, Any]] = None, load_weights: bool = True,
             moe: Optional[Dict[str, Any]] = None, loss: Optional[Dict[str, Any]] = None) -> HFModel:
    """Build the model: from ``model_type`` and ``config`` (random weights), or from a local ``pretrained`` dir.

    A mixture-of-experts model's sparse blocks become the project's MoE layer on the same tensors, with
    ``moe``'s balancing terms (``model.moe.aux_loss``, ``z_loss``, ``bias_update``; ``moe.hf.balance_config``).

    ``model.config.vocab_size`` (and the eos and pad ids) follow ``tokenizer``
    (the data's, with the tokens ``chat_template`` adds for data=hf_chat)
    unless ``config`` sets them; ``block_size`` (the data's) must fit the
    model's positions. ``loss`` (``model.loss``): ``chunked`` computes a causal LM's head and loss chunk by
    chunk, refused (a ConfigError) for a head that is not a bias-free linear map of the final norm's output.
    """
    loss_options = LossOptions.from_dict(loss)
    if task not in TASKS:
        raise ConfigError(f"model.task={task!r}: choose one of {sorted(TASKS)}")
    try:
        import transformers
    except ImportError as err:
        raise ConfigError("model=hf_causal_lm / hf_masked_lm need transformers: pip install 'dist_trainer[hf]'") from err
    overrides = dict(config or {})
    overrides.update(_from_tokenizer(tokenizer, overrides, chat_template))
    auto = getattr(transformers, TASKS[task])
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    added: list = []  # token ids the tokenizer has and the pretrained weights had not (a template's markers)
    if pretrained:
        if pretrained.startswith(("/", "./", "../", "~")) and not Path(pretrained).expanduser().exists():
            raise ConfigError(f"model.pretrained={pretrained}: no such directory")
        # The saved weights fix the vocabulary: a tokenizer with more ids (a chat template's markers)
        # gets rows added after loading, not a configuration that does not fit the weights.
        vocab = None if "vocab_size" in (config or {}) else overrides.pop("vocab_size", None)
        where = str(Path(pretrained).expanduser()) if pretrained.startswith("~") else pretrained
        try:
            if load_weights:
                model = auto.from_pretrained(where, dtype=torch.float32, **extra, **overrides)
            else:  # the configuration only, with the tokenizer's vocabulary: the rows it adds get the mean on load
                config = transformers.AutoConfig.from_pretrained(where, **overrides)
                saved, config.vocab_size = config.vocab_size, max(config.vocab_size, vocab or 0)
                added = list(range(saved, config.vocab_size))  # as from_pretrained's resize below gives them
                model = auto.from_config(config, dtype=torch.float32, **extra)
        except (OSError, ValueError) as err:
            raise ConfigError(f"model.pretrained={pretrained}: cannot be loaded ({err})") from err
        if load_weights and vocab is not None and vocab > model.config.vocab_size:
            added = list(range(model.config.vocab_size, vocab))
            model.resize_token_embeddings(vocab, mean_resizing=True)  # new rows: the mean of the others
    else:
        if not model_type:
            raise ConfigError("model.model_type is not set: name a transformers model type (e.g. gpt2, llama, "
                              "bert), or set model.pretrained to a local save_pretrained directory")
        model_config = _config(transformers, model_type, overrides)
        try:
            model = auto.from_config(model_config, dtype=torch.float32, **extra)
        except ValueError as err:
            raise ConfigError(f"model.model_type={model_type}: transformers has no {TASKS[task]} for it "
                              f"({err})") from err
    _check_positions(model.config, block_size)
    routing = swap_moe_blocks(model, moe)
    if lora and lora.get("r"):
        model = with_lora(model, task, **lora, new_tokens=added)
    if loss_options.chunked:
        _check_plain_head(model, task)
    return HFModel(model, task, tokenizer, block_size, chat_template, routing, loss_options)


def _check_plain_head(model: nn.Module, task: str) -> None:
    """A ConfigError unless the logits are the head's bias-free product with the body's last hidden state (after
    its final norm), as the chunks compute them: a causal LM, a plain ``nn.Linear`` head (not a peft wrapper) with
    no bias, and none of the configuration values by which a family caps or scales its logits."""
    lm = model.get_base_model() if hasattr(model, "peft_config") else model
    name = f"{type(lm).__name__} ({lm.config.model_type})"
    head = lm.get_output_embeddings()
    problem = None
    if task != "causal_lm":
        problem = "is for causal LMs (model=hf_causal_lm); a masked LM's head transforms the hidden states first"
    elif not hasattr(lm, lm.base_model_prefix or "-"):
        problem = f"needs the decoder body apart from its head; {name} has none"
    elif type(head) is not nn.Linear:  # a subclass, or a peft wrapper (modules_to_save, new rows), computes more
        problem = f"needs a plain linear head; {name}'s is {type(head).__name__}"
    elif head.bias is not None:
        problem = f"computes the head without a bias; {name}'s head has one"
    else:
        text = lm.config.get_text_config()
        caps = [f"{k}={getattr(text, k)}" for k in LOGIT_CAPS if getattr(text, k, None) is not None]
        scales = [f"{k}={getattr(text, k)}" for k in LOGIT_SCALES if getattr(text, k, None) not in (None, 1, 1.0)]
        if caps or scales:
            problem = (f"computes the head's plain logits; {name} changes them ({', '.join(caps + scales)}) "
                       "before its loss")
    if problem:
        raise ConfigError(f"model.loss.chunked=True: {problem}: set model.loss.chunked=false")


def with_lora(model: nn.Module, task: str, r: int, alpha: float = 16, dropout: float = 0.0,
              target_modules: Optional[Any] = None, modules_to_save: Optional[Any] = None,
              new_tokens: Sequence[int] = ()) -> nn.Module:
    """LoRA adapters (peft) on ``model``: its own weights frozen, the adapters the only trained parameters.

    ``target_modules`` None takes peft's default for the model type (the
    attention projections of llama, gpt2, qwen2, ...). ``modules_to_save``
    (e.g. ``[lm_head]``) train in full beside the adapters and are saved with
    them. ``new_tokens``, rows the embeddings got for a tokenizer's added
    tokens (a chat template's markers), train too (peft's trainable tokens,
    ``_new_rows``): a frozen new row is one the model cannot learn to read,
    or, in an untied head, to predict.
    """
    if task != "causal_lm":
        raise ConfigError("model.lora: LoRA adapters are for model=hf_causal_lm")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConfigError(f"model.lora.r={r!r}: the adapters' rank, an integer >= 1 (null or 0: full fine-tuning)")
    try:
        import peft
    except ImportError as err:
        raise ConfigError("model.lora needs peft: pip install 'dist_trainer[hf]'") from err
    targets = list(target_modules) if isinstance(target_modules, (list, tuple)) else target_modules
    saved = list(modules_to_save) if modules_to_save else None
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             modules_to_save=saved, task_type="CAUSAL_LM",
                             trainable_token_indices=_new_rows(model, saved, new_tokens))
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:  # no module matches target_modules, or peft knows no default for the type
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"model.lora.target_modules={target_modules} (modules_to_save={modules_to_save}): {err}. "
                          f"The model's linear layers are "
                          f"named {', '.join(names)}") from err


def _new_rows(model: nn.Module, saved: Optional[list], new_tokens: Sequence[int]) -> Optional[Dict[str, list]]:
    """peft's trainable tokens for the rows a resize added: the input embedding's, and an untied head's.

    A new token's input row is how the model reads it, its head row how the
    model predicts it (a chat's end of turn): both must train. (A frozen head
    row stays the mean of the others, so the model could not learn to end a
    turn.) peft saves the resized layers whole with the adapter, so a base
    resized to the tokenizer's length gets the trained rows back, whatever
    values the resize put there. A module trained whole
    (``modules_to_save``) needs no rows of its own.
    """
    if not new_tokens:
        return None
    names = {id(m): name for name, m in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    modules = [embedding] if head is None or head.weight is embedding.weight else [embedding, head]  # untied: two
    rows: Dict[str, list] = {}
    for module in modules:
        name = names[id(module)]
        if saved and name.rsplit(".", 1)[-1] in saved:
            continue
        if getattr(module, "bias", None) is not None:  # peft's trainable tokens on a head compute without a bias
            raise ConfigError(f"model.lora: the tokenizer adds {len(new_tokens)} tokens and the head ({name}) has "
                              "a bias: add it to model.lora.modules_to_save to train it whole")
        rows[name] = list(new_tokens)
    return rows or None


def _config(transformers: Any, model_type: str, overrides: Dict[str, Any]) -> Any:
    mapping = transformers.CONFIG_MAPPING
    if model_type not in mapping:
        raise ConfigError(f"model.model_type={model_type}: not a model type transformers knows "
                          "(e.g. gpt2, llama, bert, mistral, qwen2)")
    if "vocab_size" in overrides:  # default special ids beyond a smaller vocabulary: none rather than invalid
        defaults = mapping[model_type]()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(defaults, key, None)
            if key not in overrides and isinstance(value, int) and value >= overrides["vocab_size"]:
                overrides[key] = None
    try:
        return transformers.AutoConfig.for_model(model_type, **overrides)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.config: {err}") from err


def _from_tokenizer(spec: Optional[str], config: Dict[str, Any], chat_template: Optional[str]) -> Dict[str, Any]:
    """vocab_size and the special token ids from the data's tokenizer, where model.config leaves them unset."""
    if not spec:
        return {}
    from ..data.tokenizer import load_tokenizer

    tok = load_tokenizer(spec, chat_template=chat_template)
    if "vocab_size" in config and config["vocab_size"] < tok.vocab_size:
        raise ConfigError(f"model.config.vocab_size={config['vocab_size']} is smaller than the vocabulary of "
                          f"data.tokenizer={spec} ({tok.vocab_size} ids): raise it, or leave it unset to follow "
                          "the tokenizer")
    known = {"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id, "bos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    return {key: value for key, value in known.items() if key not in config and value is not None}


def _check_positions(config: Any, block_size: Optional[int]) -> None:
    positions = getattr(config, "max_position_embeddings", None)
    if block_size and positions and block_size > positions:
        raise ConfigError(f"data.block_size={block_size} is longer than the model's {positions} positions: "
                          f"lower data.block_size or raise model.config.max_position_embeddings")
