"""FP8 mixed precision (``precision=fp8-rowwise``, ``fp8-rowwise-gw-hp``, ``fp8-tensorwise``): the linear layers'
matmuls in float8 through torchao, over bf16 compute with FP32 master weights (``bf16-master``'s weights, optimizer
and all-reduce; ``precision.fp8.compute=bf16``, the default) or over FP32 weights without autocast (``fp32``).

Scaling decides whether the one-big-batch promise survives. torchao's scales are dynamic (from each tensor's
current amax; no history carried across micro-batches or checkpoints). With scales rounded to a power of two, a
gradient's last-bit difference between two splits of a batch can move a scale only by a factor of 2, and only at a
boundary; the scaled values are then the same up to the exponent, so the float8 rounding is the same: split
invariance holds to the gradients' rounding, provided every factor applied before the cast is a power of two as well:
the trainer's backward factor (1 / the first micro-batch's items, which differ between splits) is rounded to one in
these modes (``Precision.pow2_backward``). Over bf16 compute each micro-batch's gradients are also rounded to bf16
(as bf16-master's are), which bounds the split's agreement at bf16's rounding; over fp32 compute it is the
gradients' rounding (measured 3.7e-7). Without the rounding (tensorwise's default in torchao), the scale
tracks the amax continuously and two splits round differently: ``precision.fp8.pow2_scales=false`` is allowed for
tensorwise and documented as split-dependent. Delayed scaling (an amax history updated each micro-batch) is
split-dependent by construction and is not offered.

On a CPU (or a GPU without float8 matmuls) torchao emulates them (``precision.fp8.emulate: auto``): the numerics
are float8's, the speed is not (2-5x slower than fp32 here), so CPU runs prove numbers, never speed.

Which linears convert (``precision.fp8.filter``): by default all but the head and those with a dimension not a
multiple of 16 (float8 matmuls need it); a list of name patterns (fnmatch) keeps those in bf16 instead. The
start-up line and plan mode print what converts and why each other linear stays.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Dict, List, Optional, Set

from torch import nn

from .config import ConfigError, Fp8Config

# precision.name -> torchao's recipe
RECIPES = {"fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp", "fp8-tensorwise": "tensorwise"}
MULTIPLE = 16  # float8 matmuls need both dimensions a multiple of this
HEADS = ("head", "lm_head")  # the output head: its logits' precision decides the loss's, kept in bf16 by default


def kept(name: str, module: nn.Linear, cfg: Fp8Config) -> Optional[str]:
    """Why the linear ``name`` stays in bf16, or None where it converts to float8."""
    if cfg.filter is not None:
        return "precision.fp8.filter" if any(fnmatch.fnmatchcase(name, p) for p in cfg.filter) else None
    if name.rpartition(".")[2] in HEADS:
        return "the head"
    if module.in_features % MULTIPLE or module.out_features % MULTIPLE:
        return f"a dimension not a multiple of {MULTIPLE} ({module.in_features} x {module.out_features})"
    return None


def plan(model: nn.Module, cfg: Fp8Config) -> Dict[str, Optional[str]]:
    """Every linear of ``model`` by name: None (converts) or why it stays in bf16."""
    return {name: kept(name, m, cfg) for name, m in model.named_modules() if type(m) is nn.Linear}


def gathered_in_float8(model: nn.Module, precision: Any) -> Set[int]:
    """id() of the weights FSDP gathers in float8 (``precision.fp8.all_gather``; none otherwise), of a plain
    model (plan mode's) or a converted one (a run's)."""
    if precision.name not in RECIPES or not precision.fp8.all_gather:
        return set()
    from torchao.float8.float8_linear import Float8Linear

    return {id(m.weight) for name, m in model.named_modules()
            if isinstance(m, Float8Linear) or (type(m) is nn.Linear and kept(name, m, precision.fp8) is None)}


def describe(model: nn.Module, cfg: Fp8Config, name: str) -> str:
    """The start-up and plan-mode line: what converts, what stays and why."""
    linears = plan(model, cfg)
    converted = [n for n, why in linears.items() if why is None]
    stays = "; ".join(f"{n} ({why})" for n, why in linears.items() if why is not None) or "none"
    return (f"{name}: {len(converted)} of {len(linears)} linears in float8 (torchao recipe {RECIPES[name]}, "
            f"power-of-two scales {'on' if cfg.pow2_scales else 'off: split-dependent'}); kept in {cfg.compute}: "
            f"{stays}")


def emulated(cfg: Fp8Config, device_type: str) -> bool:
    """Whether float8 matmuls are emulated: ``auto`` on a CPU, and on a GPU below compute capability 8.9."""
    if cfg.emulate != "auto":
        return bool(cfg.emulate)
    if device_type != "cuda":
        return True
    import torch

    return torch.cuda.get_device_capability() < (8, 9)


def import_torchao(name: str) -> Any:
    """torchao's float8 training module; a ConfigError saying how to install it."""
    try:
        import torchao.float8
    except ImportError as err:
        raise ConfigError(f"precision.name={name} needs torchao: pip install 'dist_trainer[fp8]'") from err
    return torchao.float8


def convert(model: nn.Module, cfg: Fp8Config, name: str, device_type: str) -> nn.Module:
    """The model with its chosen linears swapped for torchao's Float8Linear, in place (parameters, names and
    state_dict keys unchanged)."""
    float8 = import_torchao(name)
    Float8LinearConfig, convert_to_float8_training = float8.Float8LinearConfig, float8.convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(RECIPES[name])
    # the recipe's own config, with emulation where there is no float8 hardware and the scales rounded to
    # powers of two (rowwise's default; tensorwise's only when asked, which is the default here)
    config = dataclasses.replace(config, emulate=emulated(cfg, device_type),
                                 round_scales_to_power_of_2=cfg.pow2_scales,
                                 enable_fsdp_float8_all_gather=cfg.all_gather)
    linears = plan(model, cfg)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: linears.get(fqn, "") is None)
    return model


class ScaleSync:
    """FSDP2's float8 all-gather (``precision.fp8.all_gather``) with the scales ddp's casts take.

    Under the float8 all-gather each rank casts its shard of a weight to float8 before the all-gather, so the
    weight's tensorwise scale (from the whole weight's amax) must be agreed before: torchao computes it inside the
    all-gather without rounding it to a power of two, and so unlike ddp's cast of the same weight. Here the scales
    are computed once per change of the weights, right after each applied optimizer step (in the step), and at
    the first forward after the start or a load: the amaxes of every float8 weight in one all-reduce (``fp8_scale_allreduces``, float32 each), each scale as
    torchao's own cast computes it from that amax, rounded down to a power of two where ``pow2_scales``. The cast
    of each shard is then the cast ddp makes of the same elements of the whole weight: over fp32 compute the
    gathered float8 weight equals ddp's to the bit. Over bf16 compute the FP32 shard is cast to float8 in one
    rounding, where ddp casts the bf16 weight (two roundings): an element in a few hundred lands one float8 step
    apart.

    The first forward's runs from a forward pre-hook put before FSDP's on every FSDP unit (training, evaluation
    or a pipeline stage's), so that no all-gather takes a stale scale.
    """

    def __init__(self, model: nn.Module, optimizer: Any, pow2: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.model, self.pow2, self.stale = model, pow2, True
        self.counts = dict.fromkeys(COMM_KEYS, 0)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.register_forward_pre_hook(self._before_forward, prepend=True)
        optimizer.register_step_post_hook(lambda *_: self.sync())
        model.register_load_state_dict_post_hook(self._loaded)

    def _loaded(self, *_: Any) -> None:
        self.stale = True

    def _before_forward(self, *_: Any) -> None:
        if self.stale:
            self.sync()

    def sync(self) -> None:
        """Each float8 weight's scale from its whole amax, all-reduced once; a power of two where asked."""
        from torchao.float8.float8_utils import _round_scale_down_to_power_of_2
        from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

        from .parallel.tp import count_collectives

        with count_collectives(self.counts, "fp8_scale_"):
            precompute_float8_dynamic_scale_for_fsdp(self.model)
        if self.pow2:
            for module in self.model.modules():
                local = getattr(getattr(module, "weight", None), "_local_tensor", None)
                scale = getattr(local, "_precomputed_scale", None)
                if scale is not None:
                    local._precomputed_scale = _round_scale_down_to_power_of_2(scale)
        self.stale = False

    def comm(self) -> Dict[str, int]:
        return dict(self.counts)


COMM_KEYS = ("fp8_scale_allreduces", "fp8_scale_allreduce_bytes")


def converted(model: nn.Module) -> List[str]:
    """Names of the modules that compute in float8 (Float8Linear)."""
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def describe_converted(model: nn.Module, name: str) -> str:
    """The start-up line, from the converted model: what runs in float8, what stays a Linear."""
    done = converted(model)
    stays = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    return (f"{name}: {len(done)} linears in float8 (torchao recipe {RECIPES[name]}); kept out of float8: "
            + (", ".join(stays) or "none"))


def check(cfg: Any) -> None:
    """The precision's float8 keys against the rest of the configuration: ConfigErrors naming the key."""
    p = cfg.precision
    if p.name not in RECIPES:
        return
    if not p.fp8.pow2_scales and p.name != "fp8-tensorwise":
        raise ConfigError(f"precision.fp8.pow2_scales=false: {p.name}'s scales are powers of two by its recipe; "
                          "only fp8-tensorwise rounds them by this key")
    if p.fp8.compute not in ("bf16", "fp32"):
        raise ConfigError(f"precision.fp8.compute={p.fp8.compute!r}: choose bf16 or fp32")
    if p.fp8.emulate not in ("auto", True, False):
        raise ConfigError(f"precision.fp8.emulate={p.fp8.emulate!r}: choose auto, true or false")
    patterns = p.fp8.filter
    if patterns is not None and not (isinstance(patterns, list) and all(isinstance(x, str) for x in patterns)):
        raise ConfigError(f"precision.fp8.filter={p.fp8.filter!r}: a list of linear name patterns kept in bf16, "
                          "or null for the default")
    for key, size in (("tp", cfg.dist.tp.size), ("cp", cfg.dist.cp.size), ("ep", cfg.dist.ep.size)):
        if size > 1:
            raise ConfigError(f"precision.name={p.name} with dist.{key}.size={size} is not supported yet (float8 "
                              f"linears run under ddp, fsdp, hsdp and pipeline stages): set dist.{key}.size=1 or "
                              "precision=bf16-master")
    if p.fp8.all_gather:
        if p.name != "fp8-tensorwise":
            raise ConfigError(f"precision.fp8.all_gather=true with precision.name={p.name}: FSDP2's float8 "
                              "all-gather casts with one scale a weight (torchao's tensorwise recipe): set "
                              "precision=fp8-tensorwise or precision.fp8.all_gather=false")
        if cfg.dist.strategy not in ("fsdp", "hsdp"):
            raise ConfigError(f"precision.fp8.all_gather=true gathers FSDP's shards in float8; "
                              f"dist.strategy={cfg.dist.strategy} gathers none: set dist.strategy=fsdp (or hsdp) "
                              "or precision.fp8.all_gather=false")
