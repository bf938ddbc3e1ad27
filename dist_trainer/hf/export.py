"""Trained weights back to Hugging Face: ``hf_model/`` at the end of a run, or from any checkpoint.

    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR     (a checkpoint, or a run directory: its newest)
    python -m dist_trainer.export s3://bucket/prefix OUT_DIR  (a trainer.ckpt_dir, a path or a URL: its newest)
    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR --adapter-out ADAPTER_DIR    (a LoRA model)
    python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR --max-shard-mb 1024   (files of at most 1 GiB)

The model is rebuilt from the configuration every checkpoint records
(``model_config`` in shared.pt), so only the checkpoint is needed: on the meta
device, for its names, shapes and configuration, while the weights are read
from a sharded checkpoint one tensor at a time.

The directory is what ``save_pretrained`` writes (config.json, the generation
config, ``model.safetensors`` or several files and
``model.safetensors.index.json``) with the FP32 weights (the masters in master
modes) and the tokenizer's files when the data had a tokenizer:
``AutoModelFor*.from_pretrained(OUT_DIR)`` gives the trained model. It is
written tensor by tensor (``HFModelWriter``: at the end of a run from every
rank's shards, ``parallel.state.WholeTensors``; here from the checkpoint), under
a temporary name, and renamed when complete.

A LoRA model (model.lora.r) gives two: the merged model (the adapters folded
into the base weights: a plain transformers model) in OUT_DIR, and the
adapters alone, peft's ``save_pretrained`` (``PeftModel.from_pretrained(base,
ADAPTER_DIR)``), in ADAPTER_DIR (the run directory's ``hf_adapter/``). A LoRA
checkpoint holds the adapters only; the base comes from the recorded model
configuration and must have the digest the checkpoint records.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .. import checkpoint
from ..config import ConfigError
from ..models.export import DEFAULT_SHARD_MB, Entry, SafetensorsWriter, replace_dir, temporary_dir
from ..parallel.state import TensorInfo, parameter_ties

PREFIX = "model."  # HFModel holds the transformers model as .model


class HFWeights:
    """How the framework's FP32 tensors of an HFModel become ``hf_model/``: the names, shapes and files
    ``save_pretrained`` would write, known from the layout alone (before any value), then tensor by tensor.

    As ``save_pretrained``: the ``model.`` prefix goes; of a tied weight (a tied head) only the name transformers
    keeps is written (its ``remove_tied_weights_from_state_dict`` decides, on placeholders); keys the model
    ignores on save go; and a model whose weights transformers converts on load (fused MoE experts) gets its
    checkpoint names back, one tensor at a time (``revert_weight_conversion``, planned on meta tensors).

    ``dtype``: what the floating tensors are written as (FP32; rl.publish.dtype may serve bf16 or fp16), cast as
    each arrives; config.json says so.
    """

    def __init__(self, module: torch.nn.Module, layout: Sequence[TensorInfo], dtype: torch.dtype = torch.float32):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        self.module, self.hf, self.dtype = module, module.model, dtype
        mine = [info for info in layout if info.name.startswith(PREFIX)]
        placeholders: Dict[str, torch.Tensor] = {}  # one per weight: the names of a tied one share it
        for info in mine:
            tied = info.tied_to[len(PREFIX):] if info.tied_to and info.tied_to.startswith(PREFIX) else None
            placeholders[info.name[len(PREFIX):]] = placeholders[tied] if tied in placeholders else torch.empty(1)
        kept = set(remove_tied_weights_from_state_dict(dict(placeholders), self.hf))
        kept -= set(getattr(self.hf, "_keys_to_ignore_on_save", None) or ())
        self.plan: Dict[str, List[Entry]] = {}  # framework name -> what hf_model/ holds of it
        self.renamed = set()  # names whose tensors transformers converts (renames, splits)
        for info in mine:
            key = info.name[len(PREFIX):]
            if key in kept:
                out = self._revert(key, torch.empty(info.shape, dtype=self._written(info.dtype), device="meta"))
                self.plan[info.name] = [Entry(k, tuple(v.shape), v.dtype) for k, v in out]
                if [(k, tuple(v.shape)) for k, v in out] != [(key, info.shape)]:
                    self.renamed.add(info.name)

    def _written(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if dtype.is_floating_point else dtype

    def _revert(self, key: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        from transformers.modeling_utils import revert_weight_conversion

        return list(revert_weight_conversion(self.hf, {key: tensor}).items())

    def entries(self) -> List[Entry]:
        """Every tensor hf_model/ holds, in the layout's order."""
        return [entry for entries in self.plan.values() for entry in entries]

    def convert(self, name: str, tensor: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
        """What hf_model/ holds of the framework's tensor ``name`` (nothing: a dropped tied name)."""
        if name not in self.plan:
            return []
        key = name[len(PREFIX):]
        tensor = tensor.to(self._written(tensor.dtype))  # itself where it is already the written dtype
        return self._revert(key, tensor) if name in self.renamed else [(key, tensor)]

    def write_files(self, directory: Path) -> None:
        """config.json (the dtype the weights are written in), the generation config, the tokenizer's files."""
        config = copy.deepcopy(self.hf.config)  # the training model's own stays as it is
        config.dtype = str(self.dtype).removeprefix("torch.")
        # fully_shard names a unit's class FSDP<Name>; transformers strips the prefix as well
        config.architectures = [type(self.hf).__name__.removeprefix("FSDP")]
        config.save_pretrained(directory)
        if self.hf.can_generate():
            self.hf.generation_config.save_pretrained(directory)
        _save_tokenizer(self.module, directory)


class HFModelWriter:
    """``hf_model/`` written tensor by tensor under a temporary name (``add``), renamed when complete (``close``).

    ``sink``: instead of files, each tensor handed to ``sink(entries)``'s ``write(key, tensor)`` in the entries'
    order (rl.publish's transfer to a server: the same names, shapes and dtypes, no directory)."""

    def __init__(self, module: torch.nn.Module, layout: Sequence[TensorInfo], out: Optional[Path],
                 max_shard_mb: Optional[float] = None, dtype: torch.dtype = torch.float32,
                 sink: Optional[Callable[[List[Entry]], Any]] = None):
        self.weights, self.out, self.tmp = HFWeights(module, layout, dtype), out, None
        if sink is not None:
            self.writer = sink(self.weights.entries())
            return
        self.tmp = temporary_dir(out)
        self.weights.write_files(self.tmp)
        self.writer = SafetensorsWriter(self.tmp, self.weights.entries(),
                                        int((max_shard_mb or DEFAULT_SHARD_MB) * 2**20))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        for key, value in self.weights.convert(name, tensor):
            self.writer.write(key, value)

    def close(self) -> None:
        self.writer.close()
        if self.tmp is not None:
            replace_dir(self.tmp, self.out)

    def abandon(self) -> None:
        self.writer.abandon()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class LoraWriter:
    """A LoRA model's ``hf_model/`` (the adapters merged into the base) and ``hf_adapter/`` (the adapters in
    peft's format), tensor by tensor: each base weight arrives whole, once, and is written with its adapters'
    product added (``W + scaling B A``, peft's merge), so no rank holds the base whole.

    ``adapters``: every adapter tensor whole (small beside the base), known before the walk; they are written
    to ``hf_adapter/`` at once (``adapter_out``; None: the merged model alone, as rl.publish serves it). For plain
    LoRA on linear layers (``streams``); other peft settings (DoRA, a LoRA bias, modules to save, new tokens' rows)
    are written from a whole copy (``save_pretrained``). The merge is in FP32, before the cast to ``dtype``.
    """

    def __init__(self, module: torch.nn.Module, layout: Sequence[TensorInfo], adapters: Dict[str, torch.Tensor],
                 out: Optional[Path], adapter_out: Optional[Path], max_shard_mb: Optional[float] = None,
                 dtype: torch.dtype = torch.float32, sink: Optional[Callable[[List[Entry]], Any]] = None):
        from types import SimpleNamespace

        from ..models.pretrained import base_name

        self.adapters, self.merges = adapters, lora_merges(module)
        self.name = lambda name: PREFIX + base_name(name[len(PREFIX):])  # the base model's name of a tensor
        base = [TensorInfo(self.name(i.name), i.shape, i.dtype, i.holder, self.name(i.tied_to) if i.tied_to else None)
                for i in layout if i.name not in adapters]
        view = SimpleNamespace(model=module.model.get_base_model(), tokenizer_spec=module.tokenizer_spec,
                               chat_template=module.chat_template)
        if adapter_out is not None:
            _write(lambda tmp: _write_adapters(module, adapters, tmp), adapter_out)
        self.merged = HFModelWriter(view, base, out, max_shard_mb, dtype, sink)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.adapters:
            return
        if name in self.merges:
            a, b, scaling, fan_in_fan_out = self.merges[name]
            delta = self.adapters[b] @ self.adapters[a]
            tensor = tensor + (delta.T if fan_in_fan_out else delta) * scaling
        self.merged.add(self.name(name), tensor)

    def close(self) -> None:
        self.merged.close()

    def abandon(self) -> None:
        self.merged.abandon()


def lora_merges(module: torch.nn.Module) -> Dict[str, Tuple[str, str, float, bool]]:
    """Each LoRA-adapted base weight's framework name -> (its A, its B, scaling, fan_in_fan_out)."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.base_layer.weight": (f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight",
                                          float(m.scaling["default"]), bool(getattr(m, "fan_in_fan_out", False)))
            for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def streams(module: torch.nn.Module) -> bool:
    """Whether LoraWriter writes this LoRA model: plain LoRA on linear layers, adapters its only trained tensors."""
    from peft.tuners.lora import Linear, LoraLayer

    layers = [m for m in module.modules() if isinstance(m, LoraLayer)]
    plain = all(type(m) is Linear and not m.use_dora.get("default") and not getattr(m, "lora_bias", {}).get("default")
                for m in layers)
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    return bool(layers) and plain and all(".lora_A." in n or ".lora_B." in n for n in trained)


def adapter_names(module: torch.nn.Module) -> List[str]:
    """The framework names of a LoRA model's adapter tensors (what trains)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _write_adapters(module: torch.nn.Module, adapters: Dict[str, torch.Tensor], directory: Path) -> None:
    """hf_adapter/ as peft's ``save_pretrained`` writes it: adapter_model.safetensors, adapter_config.json, the
    tokenizer."""
    import peft
    from safetensors.torch import save_file

    state = peft.get_peft_model_state_dict(module.model, state_dict={k[len(PREFIX):]: v for k, v in adapters.items()})
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    config = copy.deepcopy(module.model.peft_config["default"])
    config.inference_mode = True
    config.save_pretrained(str(directory))
    _save_tokenizer(module, directory)


def layout_of(state: Dict[str, torch.Tensor], ties: Dict[str, str]) -> List[TensorInfo]:
    """The layout of a whole state dict held in this process (FP32 floating tensors as written)."""
    return [TensorInfo(name, tuple(t.shape), torch.float32 if t.is_floating_point() else t.dtype, 0, ties.get(name))
            for name, t in state.items()]


def write_hf_model(module: torch.nn.Module, layout: Sequence[TensorInfo], tensors: Iterable[Tuple[str, torch.Tensor]],
                   out: Path, max_shard_mb: Optional[float] = None) -> None:
    """``out`` from ``tensors`` (the layout's, in its order, FP32), one at a time; complete, or not there."""
    writer = HFModelWriter(module, layout, out, max_shard_mb)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.close()
    except BaseException:
        writer.abandon()
        raise


def save_pretrained(module: torch.nn.Module, state: Dict[str, torch.Tensor], out: Path,
                    adapter_out: Optional[Path] = None) -> None:
    """Write ``state`` (the framework's full FP32 state dict of an HFModel) as a Hugging Face directory.

    A LoRA model: the merged model in ``out``, the adapters in ``adapter_out``
    (default: ``hf_adapter`` beside ``out``), by peft's own writers on a whole
    copy (merging needs base and adapters together). It is not written tensor by
    tensor: a LoRA base is frozen and built whole on every rank from the start
    (``models.construct.build``), and the adapters are small beside it, so the
    whole copy costs rank 0 what each rank already held.
    """
    if _is_peft(module.model):
        hf_state = {key[len(PREFIX):]: value for key, value in state.items() if key.startswith(PREFIX)}
        lora = _peft_copy(module, hf_state)
        _write(lambda tmp: (lora.save_pretrained(tmp), _save_tokenizer(module, tmp)),
               adapter_out or out.parent / "hf_adapter")
        merged = lora.merge_and_unload()
        _write(lambda tmp: (merged.save_pretrained(tmp), _save_tokenizer(module, tmp)), out)
        return
    fp32 = ((name, t.float() if t.is_floating_point() else t) for name, t in state.items())
    write_hf_model(module, layout_of(state, parameter_ties(module)), fp32, out)


def _write(fill: Callable[[Path], object], out: Path) -> None:
    """``fill(tmp)``, then ``tmp`` renamed to ``out``: a directory complete, or not there."""
    tmp = temporary_dir(out)
    try:
        fill(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(module: torch.nn.Module, directory: Path) -> None:
    if module.tokenizer_spec:
        from .tokenizer import load_tokenizer

        load_tokenizer(module.tokenizer_spec, chat_template=module.chat_template).save(directory)


def is_lora(module: torch.nn.Module) -> bool:
    """An HFModel holding a peft (LoRA) model."""
    return _is_peft(getattr(module, "model", None))


def _is_peft(model: Optional[torch.nn.Module]) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _peft_copy(module: torch.nn.Module, hf_state: Dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of the LoRA model holding ``hf_state``: merging it leaves the training model as it is
    (under fsdp its parameters are shards, and training may go on)."""
    import peft
    import transformers

    from .models import TASKS

    base = module.model.get_base_model()
    auto = getattr(transformers, TASKS[module.task])
    copy_model = peft.get_peft_model(auto.from_config(copy.deepcopy(base.config), dtype=torch.float32),
                                     copy.deepcopy(module.model.peft_config["default"]))
    copy_model.load_state_dict(hf_state)
    return copy_model


def _checkpoint_of(path: checkpoint.Location) -> checkpoint.Location:
    """A checkpoint as given, or the newest valid one of a run directory or of a trainer.ckpt_dir (path or URL)."""
    if (path / checkpoint.MANIFEST).is_file():
        return path
    found = [ckpt for root in (path / "checkpoints", path) for ckpt in checkpoint.list_checkpoints(root)
             if checkpoint.verify(ckpt) is None]  # newest first
    if not found:
        raise ConfigError(f"{path}: neither a checkpoint (no {checkpoint.MANIFEST}) nor a run directory "
                          "or trainer.ckpt_dir with a valid checkpoint")
    return found[0]


def export(path: Union[str, Path], out: Path, adapter_out: Optional[Path] = None,
           max_shard_mb: Optional[float] = None) -> checkpoint.Location:
    """Write ``out`` from a checkpoint: the model's configuration is the one the checkpoint records.

    The model is built on the meta device (names, shapes, ties, its configuration: no weights) and each tensor
    read from the checkpoint, written, and dropped: a sharded checkpoint is never whole in memory (a ddp one is,
    in shared.pt, as its run held it). A LoRA checkpoint (the adapters and the base's digest) rebuilds the base
    whole from the configuration and merges it (``save_pretrained``).
    """
    ckpt = _checkpoint_of(checkpoint.location(path))
    shared, shapes, read = checkpoint.model_tensors(ckpt)
    model_cfg = shared.get("model_config") or {}
    from ..models.hf import TARGETS

    if model_cfg.get("_target_") not in TARGETS:
        raise ConfigError(f"model._target_={model_cfg.get('_target_')}: export writes Hugging Face models "
                          "(model=hf_causal_lm or model=hf_masked_lm); use final_model.pt for this one")
    if shared.get("frozen") is not None:
        _export_lora(shared, ckpt, out, adapter_out)
        return ckpt
    module = _meta_model(model_cfg)
    layout = layout_of(module.state_dict(), parameter_ties(module))
    writer = HFModelWriter(module, layout, out, max_shard_mb)
    try:
        for info in layout:
            if info.name not in writer.weights.plan:
                continue  # a tied name transformers leaves out: not even read
            name = info.name if info.name in shapes else info.tied_to  # a tied weight saved once
            if name not in shapes:
                raise checkpoint.CheckpointError(f"{ckpt}: the model's {info.name} is not in the checkpoint")
            tensor = read(name)
            writer.add(info.name, tensor.float() if tensor.is_floating_point() else tensor)
            del tensor
        writer.close()
    except BaseException:
        writer.abandon()
        raise
    return ckpt


def _meta_model(model_cfg: Dict) -> torch.nn.Module:
    """The configured model on the meta device (a constructor that reads values: built whole)."""
    from hydra.utils import instantiate

    from ..models.construct import NotRecordable, record

    extra = {"load_weights": False} if model_cfg.get("pretrained") else {}  # its configuration, not its files
    make = lambda: instantiate(model_cfg, _convert_="all", **extra)  # noqa: E731
    try:
        return record(make)[0]
    except NotRecordable:
        return make()


def _export_lora(shared: Dict, ckpt: checkpoint.Location, out: Path, adapter_out: Optional[Path]) -> None:
    """A LoRA checkpoint: the base rebuilt whole from the configuration (its digest checked), the adapters
    loaded, the merged model and the adapters written by peft."""
    from hydra.utils import instantiate

    from ..precision import load_trained

    _, state = checkpoint.read_model(ckpt)
    torch.manual_seed(shared.get("model_seed", 0))  # as the run built it: the same weights where none are loaded
    module = instantiate(shared["model_config"], _convert_="all")
    checkpoint.check_frozen(shared.get("frozen"), checkpoint.frozen_digest(module), ckpt)
    load_trained(module, state)  # the adapters; the base is the configuration's
    save_pretrained(module, module.state_dict(), out, adapter_out)  # hf_model builds in FP32


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="a checkpoint, a run directory, or a trainer.ckpt_dir (a path or a URL: s3://bucket/prefix)")
    parser.add_argument("out", type=Path, metavar="OUT_DIR")
    parser.add_argument("--adapter-out", type=Path, metavar="ADAPTER_DIR",
                        help="a LoRA model's adapters (default: hf_adapter beside OUT_DIR)")
    parser.add_argument("--max-shard-mb", type=float, metavar="MB",
                        help=f"the largest safetensors file, in MiB (default {DEFAULT_SHARD_MB}); a larger "
                             "model is split into files with model.safetensors.index.json")
    args = parser.parse_args(argv)
    try:
        ckpt = export(args.checkpoint, args.out, args.adapter_out, args.max_shard_mb)
    except (ConfigError, checkpoint.CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"{args.out}: Hugging Face model from {ckpt}")
