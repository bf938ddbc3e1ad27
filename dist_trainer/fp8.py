"""FP8 mixed precision (``precision=fp8-rowwise``, ``fp8-rowwise-gw-hp``, ``fp8-tensorwise``, ``fp8-mxfp8``): the
linear layers' matmuls in float8 through torchao (Float8Linear's recipes; MXFP8Linear's blocks of 32 elements with
power-of-two scales for ``fp8-mxfp8``), over bf16 compute with FP32 master weights (``bf16-master``'s weights, optimizer
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
multiple of 16 (float8 matmuls need it; 32 under MXFP8, whose blocks run along every matmul's inner dimension:
the features forward, the micro-batch's tokens for the weight's gradient, so a micro-batch's tokens must be a
multiple of 32 too, checked at validation and at each forward); a list of name patterns (fnmatch) keeps those in bf16 instead. The
start-up line and plan mode print what converts and why each other linear stays.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

from torch import nn

from .config import ConfigError, Fp8Config

# precision.name -> torchao's recipe
RECIPES = {"fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp", "fp8-tensorwise": "tensorwise",
           "fp8-mxfp8": "mxfp8"}
MULTIPLE = 16  # float8 matmuls need both dimensions a multiple of this
MX_BLOCK = 32  # MXFP8's blocks: 32 elements share a power-of-two (E8M0) scale, along every matmul's inner dimension
HEADS = ("head", "lm_head")  # the output head: its logits' precision decides the loss's, kept in bf16 by default


def kept(name: str, module: nn.Linear, cfg: Fp8Config, multiple: int = MULTIPLE) -> Optional[str]:
    """Why the linear ``name`` stays in bf16, or None where it converts to float8 (``multiple``: what its
    dimensions must divide by, MX_BLOCK under MXFP8)."""
    if cfg.filter is not None:
        return "precision.fp8.filter" if any(fnmatch.fnmatchcase(name, p) for p in cfg.filter) else None
    if name.rpartition(".")[2] in HEADS:
        return "the head"
    if module.in_features % multiple or module.out_features % multiple:
        return f"a dimension not a multiple of {multiple} ({module.in_features} x {module.out_features})"
    return None


def plan(model: nn.Module, cfg: Fp8Config, name: str = "fp8-rowwise") -> Dict[str, Optional[str]]:
    """Every linear of ``model`` by name: None (converts) or why it stays in bf16, under the mode ``name``."""
    multiple = MX_BLOCK if name == "fp8-mxfp8" else MULTIPLE
    return {n: kept(n, m, cfg, multiple) for n, m in model.named_modules() if type(m) is nn.Linear}


def float8_linears(model: nn.Module, precision: Any) -> Dict[str, nn.Linear]:
    """The linears that compute in float8 under ``precision`` by name, of a plain model (plan mode's: those the
    filter converts) or a converted one (a run's)."""
    if precision.name not in RECIPES:
        return {}
    classes = tuple(_MX_CLASS)
    if "torchao.float8" in sys.modules:
        from torchao.float8.float8_linear import Float8Linear

        classes += (Float8Linear,)
    multiple = MX_BLOCK if precision.name == "fp8-mxfp8" else MULTIPLE
    return {name: m for name, m in model.named_modules()
            if isinstance(m, classes) or (type(m) is nn.Linear and kept(name, m, precision.fp8, multiple) is None)}


def gathered_in_float8(model: nn.Module, precision: Any) -> Set[int]:
    """id() of the weights FSDP gathers in float8 (``precision.fp8.all_gather``; none otherwise)."""
    if precision.name not in RECIPES or not precision.fp8.all_gather:
        return set()
    return {id(m.weight) for m in float8_linears(model, precision).values()}


# Under tp each of torchao's six casts of a Float8Linear takes its scale from the amax of one tensor over one
# dimension (axiswise) or all of them (tensorwise); where that spans the dimension the tp style cuts, DTensor
# all-reduces the amax (float64). (Float8LinearConfig's key, the tensor, the dimension an axiswise amax spans,
# cast in the forward). The weight is (out, in); input and grad_output are (tokens, features).
CASTS = (("cast_config_input", "input", -1, True), ("cast_config_weight", "weight", -1, True),
         ("cast_config_grad_output", "grad_output", -1, False),
         ("cast_config_weight_for_grad_input", "weight", 0, False),
         ("cast_config_grad_output_for_grad_weight", "grad_output", 0, False),
         ("cast_config_input_for_grad_weight", "input", 0, False))
CUT = {"colwise": {"weight": 0, "grad_output": -1}, "rowwise": {"input": -1, "weight": -1}}  # the cut dimension


def tp_amax_allreduces(linear: nn.Linear, mode: str, style: str, tokens: int,
                       gathered: bool = False) -> List[Tuple[int, bool]]:
    """One micro-batch's amax all-reduces of the float8 ``linear`` (precision ``mode``) cut ``style``-wise under
    tp, as (bytes, in the forward) each: a tensorwise amax is one float64, an axiswise one a float64 a row it
    keeps (the tokens for input and grad_output, the other dimension for the weight). ``gathered``: the weight
    arrives in float8 from FSDP's float8 all-gather, its scale agreed after the update (ScaleSync), so its casts
    take no amax."""
    config = recipe_config(mode)
    done = []
    for key, tensor, dim, forward in CASTS:
        cast, cut = getattr(config, key), CUT.get(style, {}).get(tensor)
        if cut is None or cast.scaling_type.name == "DISABLED" or (gathered and tensor == "weight"):
            continue
        if cast.scaling_granularity.name == "TENSORWISE":
            done.append((8, forward))
        elif dim == cut:
            rows = tokens if tensor != "weight" else (linear.out_features if dim == -1 else linear.in_features)
            done.append((8 * rows, forward))
    return done


def recipe_config(mode: str) -> Any:
    """torchao's Float8LinearConfig of the mode ``mode`` (its recipe's casts; emulation does not change them)."""
    return import_torchao(mode).Float8LinearConfig.from_recipe_name(RECIPES[mode])


def describe(model: nn.Module, cfg: Fp8Config, name: str) -> str:
    """The start-up and plan-mode line: what converts, what stays and why."""
    linears = plan(model, cfg, name)
    converted = [n for n, why in linears.items() if why is None]
    stays = "; ".join(f"{n} ({why})" for n, why in linears.items() if why is not None) or "none"
    how = (f"torchao MXFP8Linear: blocks of {MX_BLOCK}" if name == "fp8-mxfp8" else
           f"torchao recipe {RECIPES[name]}")
    return (f"{name}: {len(converted)} of {len(linears)} linears in float8 ({how}, "
            f"power-of-two scales {'on' if cfg.pow2_scales else 'off: split-dependent'}); kept in {cfg.compute}: "
            f"{stays}")


def emulated(cfg: Fp8Config, device_type: str, name: str = "fp8-rowwise") -> bool:
    """Whether float8 matmuls are emulated: ``auto`` on a CPU, and on a GPU below compute capability 8.9 (10.0 for
    MXFP8's block-scaled matmuls, Blackwell's)."""
    if cfg.emulate != "auto":
        return bool(cfg.emulate)
    if device_type != "cuda":
        return True
    import torch

    return torch.cuda.get_device_capability() < ((10, 0) if name == "fp8-mxfp8" else (8, 9))


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
    linears = plan(model, cfg, name)
    if name == "fp8-mxfp8":
        from torchao.quantization.quantize_.common import KernelPreference

        preference = KernelPreference.EMULATED if emulated(cfg, device_type, name) else KernelPreference.AUTO
        for fqn, why in linears.items():
            if why is None:
                _to_mx(model.get_submodule(fqn), preference)
        return model
    Float8LinearConfig, convert_to_float8_training = float8.Float8LinearConfig, float8.convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(RECIPES[name])
    # the recipe's own config, with emulation where there is no float8 hardware and the scales rounded to
    # powers of two (rowwise's default; tensorwise's only when asked, which is the default here)
    config = dataclasses.replace(config, emulate=emulated(cfg, device_type),
                                 round_scales_to_power_of_2=cfg.pow2_scales,
                                 enable_fsdp_float8_all_gather=cfg.all_gather)
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

        self.pow2, self.stale = pow2, True
        # the float8 linears by their weights' mesh, once: the modules and meshes stay, while FSDP swaps the
        # tensors each module holds (sync reads module.weight at the time)
        self.groups = list(float8_gathered_groups(model).values())
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
        """Each float8 weight's scale from its whole amax, a power of two where asked: the weights of one mesh
        (fsdp's shard group; under tp the tp-cut ones on fsdp x tp, the others on fsdp's alone) in one stack,
        whose max DTensor all-reduces once over each mesh dimension that shards them (fp8_scale_comm)."""
        import torch
        from torchao.float8.float8_utils import EPS, _round_scale_down_to_power_of_2

        from .parallel.tp import count_collectives

        with count_collectives(self.counts, "fp8_scale_"):
            for linears in self.groups:
                weights = [m.weight for m in linears]
                # the inf-norm is max|w| (Partial over the sharded dimensions); clamped as torchao's cast clamps
                amax = torch.clamp(torch.stack(torch._foreach_norm(weights, ord=float("inf"))), EPS)
                dtype = linears[0].config.cast_config_weight.target_dtype
                # torchao's own arithmetic (float64, then float32: eager's and compile's scales alike); the
                # shards are FP32 (the masters), so no float16 clamp
                scales = (torch.finfo(dtype).max / amax.to(torch.float64)).to_local().to(torch.float32)
                if self.pow2:
                    scales = _round_scale_down_to_power_of_2(scales)
                for linear, scale in zip(linears, scales):
                    linear.weight._local_tensor._precomputed_scale = scale
        self.stale = False

    def comm(self) -> Dict[str, int]:
        return dict(self.counts)


COMM_KEYS = ("fp8_scale_allreduces", "fp8_scale_allreduce_bytes")


def float8_gathered_groups(model: nn.Module) -> Dict[Any, List[nn.Module]]:
    """The float8 linears whose weights FSDP gathers in float8, by the mesh their weights live on: the weights of
    one mesh stack into one DTensor (those of two cannot: under fsdp x tp a weight the tp plan leaves whole lives
    on fsdp's mesh alone, the cut ones on fsdp x tp, each sharded over every dimension of its mesh)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    groups: Dict[Any, List[nn.Module]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, Float8Linear) and isinstance(weight, DTensor) and \
                isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor):
            groups.setdefault(weight.device_mesh, []).append(module)
    return groups


_MX_CLASS: List[type] = []


def _mx_class() -> type:
    """torchao's MXFP8Linear, with its input cast to its weight's dtype: its matmul is outside autocast and
    needs both in one dtype (under bf16 compute a norm's output may be FP32)."""
    if not _MX_CLASS:
        from torch.distributed.tensor import DTensor
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

        class MXLinear(MXFP8Linear):
            def forward(self, input: Any) -> Any:
                tokens = input.numel() // max(input.shape[-1], 1)
                if tokens % MX_BLOCK:  # torchao's own error is an assertion deep in the backward
                    raise ConfigError(f"precision=fp8-mxfp8: a micro-batch of {tokens} tokens, not a multiple of "
                                      f"{MX_BLOCK} (MXFP8 blocks the weight gradient along the tokens): make "
                                      "batch.micro_batch_size x data.block_size a multiple of it, for a smaller "
                                      "last micro-batch too (data.block_size a multiple of it)")
                if isinstance(self.weight, DTensor):  # cut by tp's column- or row-wise style
                    return _mx_tp_forward(self, input)
                return super().forward(input.to(self.weight.dtype))

        _MX_CLASS.append(MXLinear)
    return _MX_CLASS[0]


def _mx_tp_forward(linear: nn.Module, input: Any) -> Any:
    """MXFP8Linear cut by tp's plain column- or row-wise style: the MXFP8 matmul of each rank's slices, its output
    in the placements DTensor's own matmul of a Linear gives (column-wise: a shard of the output features;
    row-wise: a partial sum, the replicated bias added as DTensor adds it to a Linear's), so that the style's
    redistributions, and nothing else, move data (DTensor has no sharding rule for MXFP8's casts: left to it, it
    moves the operands in collectives of its own). Every block of 32 lies within one slice (checked here), so
    each rank's blocks and scales are one process's."""
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

    weight = linear.weight
    mesh, (cut,) = weight.device_mesh, weight.placements
    local_weight = weight.to_local()  # its gradient: this rank's slice, as the weight's placement says
    if local_weight.shape[0] % MX_BLOCK or local_weight.shape[1] % MX_BLOCK:
        raise ConfigError(f"precision=fp8-mxfp8 with dist.tp.size={mesh.size()}: a linear's slice is "
                          f"{tuple(local_weight.shape)}, not a multiple of {MX_BLOCK} both ways (MXFP8's blocks "
                          "must not straddle two ranks): keep it in bf16 with precision.fp8.filter, or set a "
                          "smaller dist.tp.size")
    rowwise = cut.is_shard(1)  # the weight is (out, in): row-wise cuts the input features, column-wise the output
    # the input's gradient: column-wise, each rank's is a partial sum over its output features; row-wise, the
    # shard of the input features it took
    local = input.to_local(grad_placements=input.placements if rowwise else [Partial()])
    out = _to_mxfp8_then_scaled_mm(local.to(local_weight.dtype), local_weight, linear.kernel_preference,
                                   linear.scale_calculation_mode, linear.wgrad_with_hp)
    if rowwise:
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return out + linear.bias.to(out.dtype) if linear.bias is not None else out
    if linear.bias is not None:  # column-wise: this rank's slice of it
        out = out + linear.bias.to_local().to(out.dtype)
    return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], run_check=False)


def _to_mx(linear: nn.Linear, preference: Any) -> None:
    """The Linear made torchao's MXFP8Linear in place: its parameters (bias included: MXFP8Linear adds it after
    the matmul, where torchao's quantize_ route drops it), hooks and names stay. MXFP8Linear's own state is the
    three attributes set here; its blocks' scales are powers of two (E8M0), rounded up (RCEIL)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    linear.__class__ = _mx_class()
    linear.kernel_preference, linear.scale_calculation_mode = preference, ScaleCalculationMode.RCEIL
    linear.wgrad_with_hp = False  # the weight gradient in MXFP8 too, blocked along the micro-batch's tokens


def converted(model: nn.Module) -> List[str]:
    """Names of the modules that compute in float8 (Float8Linear, MXFP8Linear)."""
    from torchao.float8.float8_linear import Float8Linear

    classes = (Float8Linear, *_MX_CLASS)
    return [n for n, m in model.named_modules() if isinstance(m, classes)]


def describe_converted(model: nn.Module, name: str) -> str:
    """The start-up line, from the converted model: what runs in float8, what stays a Linear."""
    done = converted(model)
    stays = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    how = (f"torchao MXFP8Linear: blocks of {MX_BLOCK}" if name == "fp8-mxfp8" else
           f"torchao recipe {RECIPES[name]}")
    return (f"{name}: {len(done)} linears in float8 ({how}); kept out of float8: "
            + (", ".join(stays) or "none"))


def _check_mx_tokens(cfg: Any) -> None:
    """MXFP8's weight gradient takes blocks of MX_BLOCK tokens: a micro-batch's tokens must fill them."""
    micro, cp = cfg.batch.micro_batch_size, cfg.dist.cp.size
    model = cfg.model if isinstance(cfg.model, dict) else {}
    block = cfg.data.get("block_size") or model.get("block_size")
    if micro == "auto":
        raise ConfigError("precision=fp8-mxfp8 with batch.micro_batch_size=auto: MXFP8 needs a micro-batch's tokens "
                          f"a multiple of {MX_BLOCK}; set batch.micro_batch_size to a number")
    if isinstance(block, int) and (micro * block // cp) % MX_BLOCK:  # a rank's share of each sequence under cp
        share = f" / dist.cp.size={cp}" if cp > 1 else ""
        raise ConfigError(f"precision=fp8-mxfp8: batch.micro_batch_size={micro} x data.block_size={block}{share} = "
                          f"{micro * block // cp} tokens a micro-batch, not a multiple of {MX_BLOCK} (MXFP8 blocks "
                          "the weight gradient along the tokens): change batch.micro_batch_size or data.block_size")


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
    if p.name == "fp8-mxfp8":
        _check_mx_tokens(cfg)
    if p.fp8.all_gather:
        if p.name != "fp8-tensorwise":
            raise ConfigError(f"precision.fp8.all_gather=true with precision.name={p.name}: FSDP2's float8 "
                              "all-gather casts with one scale a weight (torchao's tensorwise recipe): set "
                              "precision=fp8-tensorwise or precision.fp8.all_gather=false")
        if cfg.dist.strategy not in ("fsdp", "hsdp"):
            raise ConfigError(f"precision.fp8.all_gather=true gathers FSDP's shards in float8; "
                              f"dist.strategy={cfg.dist.strategy} gathers none: set dist.strategy=fsdp (or hsdp) "
                              "or precision.fp8.all_gather=false")
