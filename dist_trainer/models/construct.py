"""Build a model on the meta device, shard it, then materialise each rank's shards only.

No rank ever holds the whole model, and the initial weights still equal what
one process builds from the same seed, bit for bit, on any mesh. How:

1. ``record(build)`` runs the model's constructor (the built-in GPT, a Hugging
   Face model from its configuration, a user's own class) on the meta device
   under a dispatch mode that writes down every operation it runs: the
   allocations, the initialisers (``normal_``, ``uniform_``, ``fill_``...), the
   arithmetic that computes buffers such as rotary frequencies. Meta tensors
   draw nothing from the random generator.
2. The strategy cuts and shards the meta model (tp, pp stages, fully_shard);
   ``to_empty`` gives each rank storage for its own shards.
3. ``Trace.replay`` runs the recorded operations again on the CPU, in order, from
   the generator state the constructor started with: every draw happens as in a
   one-process build, so each tensor gets the same values. A tensor lives only
   while a later operation reads it: one whose next use overwrites it whole (an
   ``nn.Linear``'s default init before the model's own) is dropped at once, and
   one whose value is final is handed to ``fill``, which keeps this rank's slice
   and frees the rest. Host memory stays near the rank's shards plus the largest
   few tensors alive at once (``Trace.peak_bytes`` says how much).

A constructor that needs real values (``.item()``, a Python branch on data) or
draws from a real tensor cannot be recorded; ``record`` raises
``NotRecordable`` and the caller builds the model whole, as before, saying what
that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

META = torch.device("meta")

# In-place operations that write every element without reading the old value: a tensor overwritten whole by
# one of these is dead before it, and is not kept alive from an earlier write.
OVERWRITES = {"normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
              "geometric_", "log_normal_", "cauchy_"}


# torch.tensor(data): the tensor made from Python data stays real (a constant of the trace). transformers asks
# torch.tensor([]).device whether a meta context is active, and skips its initialisation if so.
LIFTS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class NotRecordable(RuntimeError):
    """The constructor cannot be replayed shard by shard (it reads values, or draws on a real tensor)."""


@dataclass(frozen=True)
class Ref:
    """A meta tensor as an operation saw it: which storage, and the view of it."""

    storage: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Op:
    func: Any
    args: Any  # the arguments with each meta tensor replaced by its Ref
    kwargs: Any
    outs: List[Ref]  # the meta tensors it returned (new storages, or views of old ones)
    reads: List[int]  # storages it reads
    overwrites: Optional[int] = None  # the storage it writes whole without reading, if any


@dataclass
class Trace:
    """The constructor's operations, and which storage each parameter and buffer of the built model is."""

    ops: List[Op]
    storages: Dict[int, Tuple[int, torch.dtype]]  # storage -> (elements, dtype)
    names: Dict[str, int]  # every parameter and buffer name (tied ones each) -> its storage
    views: Dict[str, Ref]  # every parameter and buffer name -> its view of that storage
    rng_state: torch.Tensor  # the CPU generator's state when construction began
    keep: List[torch.Tensor] = field(default_factory=list)  # the meta tensors, alive: storage ids stay unique

    def aliases(self) -> Dict[str, List[str]]:
        """Each name -> every name of the same tensor (a tied embedding and head)."""
        holders = self.holders()
        return {name: holders[sid] for name, sid in self.names.items()}

    def holders(self) -> Dict[int, List[str]]:
        out: Dict[int, List[str]] = {}
        for name, sid in self.names.items():
            out.setdefault(sid, []).append(name)
        return out

    def replay(self, fill: Callable[[List[str], torch.Tensor], None],
               skip: Callable[[List[str]], bool] = lambda _: False) -> int:
        """Run the operations on the CPU; call ``fill(names, storage)`` with the storage of each parameter or
        buffer (flat, whole, final) as soon as no later operation touches it (``views`` shapes it per name).
        Returns the most bytes held at once.

        ``skip(names)``: true for tensors another source fills (a pretrained file): their writes are not run.
        The CPU generator ends where a one-process build leaves it.
        """
        holders = self.holders()
        skipped = {sid for sid, names in holders.items() if skip(names)}
        ops = self.ops if not skipped else _needed(self.ops, set(holders) - skipped)
        last_touch, next_overwrite = _liveness(ops)
        live: Dict[int, torch.Tensor] = {}  # storage -> a real CPU tensor over its elements
        held = peak = 0
        torch.random.set_rng_state(self.rng_state)
        for i, op in enumerate(ops):
            touched = _touched(op)
            for sid in [op.overwrites] if op.overwrites is not None and op.overwrites not in live else []:
                live[sid] = _allocate(self.storages[sid])
                held += live[sid].numel() * live[sid].element_size()
            args, kwargs = tree_map(lambda a: _real(a, live), (op.args, op.kwargs))
            out = op.func(*args, **kwargs)
            for ref, real in zip(op.outs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]):
                if ref.storage not in live:  # a new storage: its real tensor is this output seen as the whole storage
                    live[ref.storage] = real.as_strided((self.storages[ref.storage][0],), (1,), real.storage_offset()
                                                        - ref.offset)
                    held += live[ref.storage].numel() * live[ref.storage].element_size()
            peak = max(peak, held)
            for sid in touched:
                if sid not in live:
                    continue
                if last_touch[sid] == i:  # final: the model's tensors are handed over, temporaries dropped
                    tensor = live.pop(sid)
                    held -= tensor.numel() * tensor.element_size()
                    if sid in holders and sid not in skipped:
                        fill(holders[sid], tensor)
                elif next_overwrite.get((sid, i)):  # dead until rewritten whole: no need to hold it
                    tensor = live.pop(sid)
                    held -= tensor.numel() * tensor.element_size()
        missing = [names for sid, names in holders.items() if sid not in last_touch and sid not in skipped]
        if missing:
            raise NotRecordable(f"{missing[0]} was never written by the recorded constructor")
        return peak


def _touched(op: Op) -> set:
    return {*op.reads, *(r.storage for r in op.outs), *([op.overwrites] if op.overwrites is not None else [])}


def _needed(ops: List[Op], wanted: set) -> List[Op]:
    """The operations that compute ``wanted`` storages (and what they read), nothing else: where another source
    (a pretrained file) fills the rest, their initialisation, random draws included, is not run."""
    needed, keep = set(wanted), []
    for op in reversed(ops):
        if _touched(op) & needed:
            needed |= _touched(op)
            keep.append(op)
    return keep[::-1]


def _draws(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _allocate(spec: Tuple[int, torch.dtype]) -> torch.Tensor:
    return torch.empty(spec[0], dtype=spec[1])


def _real(a: Any, live: Dict[int, torch.Tensor]) -> Any:
    if isinstance(a, Ref):
        base = live.get(a.storage)
        if base is None:
            raise NotRecordable("a recorded operation reads a tensor that no earlier operation made")
        view = base if base.dtype == a.dtype else base.view(a.dtype)
        return view.as_strided(a.size, a.stride, a.offset)
    if isinstance(a, torch.device) and a.type == "meta":
        return torch.device("cpu")
    return a


def _liveness(ops: List[Op]) -> Tuple[Dict[int, int], Dict[Tuple[int, int], bool]]:
    """The last operation touching each storage, and for each (storage, op) whether the storage's next use after
    that op overwrites it whole (so its value need not be kept in between)."""
    last: Dict[int, int] = {}
    touches: Dict[int, List[int]] = {}
    for i, op in enumerate(ops):
        for sid in _touched(op):
            last[sid] = i
            touches.setdefault(sid, []).append(i)
    dead: Dict[Tuple[int, int], bool] = {}
    for sid, seen in touches.items():
        for a, b in zip(seen, seen[1:]):
            dead[(sid, a)] = ops[b].overwrites == sid
    return last, dead


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[Op] = []
        self.storages: Dict[int, Tuple[int, torch.dtype]] = {}
        self.keep: List[torch.Tensor] = []

    def _ref(self, t: torch.Tensor) -> Ref:
        storage = t.untyped_storage()
        sid = storage._cdata
        if sid not in self.storages:
            self.storages[sid] = (storage.nbytes() // t.element_size(), t.dtype)
            self.keep.append(t)
        return Ref(sid, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        real = [t for t in flat if t.device.type != "meta"]
        if real and _draws(func):
            raise NotRecordable(f"the constructor draws random numbers into a real ({real[0].device}) tensor")
        if func in LIFTS or (flat and len(real) == len(flat)):
            return func(*args, **kwargs)  # Python data made a tensor, or arithmetic on such constants: run as is
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            raise NotRecordable(f"the constructor writes into a real ({args[0].device}) tensor with {name}")
        if func is torch.ops.aten._local_scalar_dense.default:
            raise NotRecordable("the constructor reads a tensor's value (.item())")
        if not flat and any(a.name == "device" for a in func._schema.arguments):  # a factory: onto the meta device
            device = kwargs.get("device")
            if device is not None and torch.device(device).type not in ("cpu", "meta"):
                raise NotRecordable(f"the constructor puts a tensor on {device}")
            kwargs = {**kwargs, "device": META}
        mutated = args[0] if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor) else None
        known = mutated is not None and mutated.untyped_storage()._cdata in self.storages  # made by an earlier op
        # Real tensors (constants the constructor made from Python data) are kept as they are for the replay.
        spec_args, spec_kwargs = tree_map(lambda a: self._ref(a) if isinstance(a, torch.Tensor) and
                                          a.device.type == "meta" else a, (args, kwargs))
        args, kwargs = tree_map(lambda a: a.to(META) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        out_refs = [self._ref(t) for t in outs if t.device.type == "meta"]
        reads = [r.storage for r in tree_flatten((spec_args, spec_kwargs))[0] if isinstance(r, Ref)]
        overwrites = None
        if known and name in OVERWRITES:
            target = spec_args[0]
            whole = (target.offset == 0 and args[0].is_contiguous() and
                     args[0].numel() == self.storages[target.storage][0] and target.dtype ==
                     self.storages[target.storage][1])
            others = reads[1:]
            if whole and target.storage not in others:
                overwrites = target.storage
                reads = others
        self.ops.append(Op(func, spec_args, spec_kwargs, out_refs, reads, overwrites))
        return out


def record(build: Callable[[], nn.Module]) -> Tuple[nn.Module, Trace]:
    """Run ``build`` on the meta device, recording it: (the meta model, its trace)."""
    rng_state = torch.random.get_rng_state()
    recorder = _Recorder()
    # Factories are sent to the meta device by the recorder itself, not by a device context: libraries that
    # skip their initialisation under a meta context (transformers does) initialise as in a real build.
    with recorder:
        model = build()
    views: Dict[str, Ref] = {}
    for name, t in _tensors(model):
        if t.device.type != "meta":
            raise NotRecordable(f"{name} was built on {t.device}, not on the meta device")
        views[name] = recorder._ref(t)
    names = {name: ref.storage for name, ref in views.items()}
    return model, Trace(recorder.ops, recorder.storages, names, views, rng_state, recorder.keep)


def _tensors(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _tied(model: nn.Module) -> List[Tuple[str, str, Tuple[str, str]]]:
    """(module, attribute, the first holder's (module, attribute)) for every later holder of a shared tensor."""
    first: Dict[int, Tuple[str, str]] = {}
    out = []
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None:
                continue
            if id(t) in first and first[id(t)] != (mname, attr):
                out.append((mname, attr, first[id(t)]))
            first.setdefault(id(t), (mname, attr))
    return out


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``full`` where ``like`` is its (possibly distributed) parameter or buffer."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        # Each rank has the whole tensor: cut it locally, no collective (src_data_rank=None).
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


def materialise(model: nn.Module, trace: Trace, device: torch.device,
                skip: Callable[[List[str]], bool] = lambda _: False) -> int:
    """Give a meta model (sharded or not) this rank's storage and its initial values; returns the replay's
    peak bytes. Every name the model still holds (a pipeline stage holds some) must be in the trace."""
    held = dict(_tensors(model))
    unknown = [name for name in held if name not in trace.names]
    if unknown:
        raise NotRecordable(f"{unknown[0]} is not a tensor the constructor made")
    tied = _tied(model)
    model.to_empty(device=device)
    for owner, attr, (first_owner, first_attr) in tied:  # to_empty gives each holder of a tied tensor its own copy
        setattr(model.get_submodule(owner), attr, getattr(model.get_submodule(first_owner), first_attr))
    held = dict(_tensors(model))

    @torch.no_grad()
    def fill(names: List[str], storage: torch.Tensor) -> None:
        for name in names:
            if name in held:
                target, ref = held[name], trace.views[name]
                full = storage.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)
                local = target.to_local() if hasattr(target, "to_local") else target
                local.copy_(local_part(full, target))

    return trace.replay(fill, skip)  # the generator is left where a one-process build leaves it


def build(make: Callable[[], nn.Module], sharded: bool, device: torch.device, warn: Callable[[str], None],
          make_whole: Optional[Callable[[], nn.Module]] = None, pretrained: Optional[Any] = None
          ) -> Tuple[nn.Module, Optional["Materialiser"]]:
    """(the model, how to materialise it once sharded), or (the model built whole, None).

    ``sharded``: the strategy cuts the model (fsdp, hsdp, tp, pp), so it is built on the meta device (a LoRA
    model too: its frozen base is sharded like any weight). A model whose constructor cannot be recorded is
    built whole (``make_whole``, default ``make``), and ``warn`` says what that costs.
    ``pretrained``: a ``pretrained.SafetensorsSource`` whose tensors replace the recorded initialisation.
    """
    make_whole = make_whole or make
    if not sharded:
        return make_whole(), None
    state = torch.random.get_rng_state()
    try:
        model, trace = record(make)
        # peft's copies of base tensors (new tokens' rows, a module to save) are made from the base's initial
        # values, before a pretrained file fills them: built whole, they copy the file's
        copies = [n for n, _ in model.named_parameters() if "trainable_tokens_delta" in n or "modules_to_save" in n]
        why = f"its LoRA adapters copy base tensors ({copies[0]})" if copies else None
    except NotRecordable as err:
        why = str(err)
    if why is None:
        if pretrained is not None:
            pretrained.check_covers(trace.aliases())
        return model, Materialiser(trace, device, pretrained)
    torch.random.set_rng_state(state)
    model = make_whole()
    size = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.state_dict().values()}.values())
    warn(f"the model is built whole on every rank before it is sharded ({size / 2**20:,.0f} MiB of host memory "
         f"each), since it cannot be built on the meta device: {why}")
    return model, None


class Materialiser:
    """Called by the strategy with the sharded meta model: storage for this rank's shards, their values (the
    replayed constructor, then the pretrained files' slices). ``peak_bytes``: the most held beyond the shards."""

    def __init__(self, trace: Trace, device: torch.device, pretrained: Optional[Any] = None):
        self.trace, self.device, self.pretrained = trace, device, pretrained
        self.peak_bytes = 0
        self.mb: Optional[float] = None  # measured: what materialising added to the process's resident memory

    def __call__(self, model: nn.Module) -> None:
        from ..hostmem import PhasePeak

        source = self.pretrained
        skip = (lambda names: source.key(names) is not None) if source is not None else (lambda _: False)
        with PhasePeak() as phase:  # the host memory the model's shards and their initialisation take
            try:
                self.peak_bytes = materialise(model, self.trace, self.device, skip)
            except NotRecordable as err:  # found only now, with the model already cut: say how to build it whole
                from ..config import ConfigError

                raise ConfigError(f"the model cannot be materialised shard by shard ({err}): set "
                                  "dist.meta_init=false to build it whole on every rank") from err
            if source is not None:
                self.peak_bytes = max(self.peak_bytes, source.load_into(model, self.trace.aliases()))
        self.mb = phase.mb
