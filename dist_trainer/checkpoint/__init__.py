"""The only module that writes or reads checkpoints.

Layout, in ``<run dir>/checkpoints/`` (or ``trainer.ckpt_dir``: a path, or an fsspec URL such as
``s3://bucket/prefix``; storage.py)::

    step_00000100/
        shared.pt          model (FP32; the masters in master modes), optimizer,
                           loss scaler, lr schedule and loop position: rank 0 writes it
        rng_rank<N>.pt     each rank's RNG states (python, numpy, torch, cuda)
        shards/            dist.strategy=fsdp only: model and optimizer state, each rank
                           writing its own shards with torch.distributed.checkpoint (DCP);
                           shared.pt then holds no tensor of the model
        manifest.json      size and sha256 of every file above, written last

A checkpoint is written under a temporary name, every file flushed and fsynced,
then renamed into place (in object storage: in place, its manifest the last
object written), so a crash mid-write never leaves one that looks valid; on
resume the manifest is checked and a corrupt or truncated checkpoint is
reported and skipped for the previous one. Everything is read with
``torch.load(weights_only=True)``: a checkpoint cannot run code when loaded.
DCP's own metadata file is a pickle; it is read with an unpickler that admits
only DCP's metadata classes, torch dtypes, sizes and paths, and shard items
that are not tensors (DCP would unpickle them in full) are refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..distributed import DistEnv
from ..parallel.state import local_tensor
from .shards import load_shards, read_shard_metadata, save_shards, shard_tensor_shapes  # noqa: F401
from .storage import (Location, fsync_dir, free_bytes, is_local, location, open_file, refresh, remove_tree,
                      size_of)

log = logging.getLogger("dist_trainer")

PREFIX = "step_"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SHARDS = "shards"
SHARD_METADATA = f"{SHARDS}/.metadata"


def checkpoint_dir(run_dir: Path, ckpt_dir: Optional[str] = None) -> Location:
    """Where a run's checkpoints go: ``trainer.ckpt_dir`` (a path or an fsspec URL), else the run dir's checkpoints/."""
    return location(ckpt_dir) if ckpt_dir else run_dir / "checkpoints"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _needed_files(world_size: int, sharded: bool = False) -> List[str]:
    """Every file a checkpoint of ``world_size`` ranks must hold for a resume (DCP's data files besides)."""
    return ["shared.pt"] + [_rng_file(r) for r in range(world_size)] + ([SHARD_METADATA] if sharded else [])


def _save_file(obj: Any, path: Location) -> Dict[str, Any]:
    with open_file(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        if is_local(path):
            os.fsync(f.fileno())
    return _describe(path)


def _describe(path: Location) -> Dict[str, Any]:
    """A file's manifest entry: its size and sha256."""
    return {"bytes": size_of(path), "sha256": sha256_file(path)}


def _load(path: Location) -> Any:
    """torch.load(weights_only=True) of a checkpoint file, local or in object storage."""
    if is_local(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    with open_file(path, "rb") as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)


def frozen_digest(model: torch.nn.Module) -> Optional[str]:
    """sha256 of the frozen parameters, by name (None if every parameter trains).

    Checkpoints leave frozen parameters out (a LoRA model's base) and record
    this instead: a resume or an export on a different base is refused.
    """
    frozen = sorted((name, p) for name, p in model.named_parameters() if not p.requires_grad)
    if not frozen or any(p.is_meta for _, p in frozen):
        return None  # built on the meta device: taken from the shards once they hold values (run.build)
    return digest_of(frozen)


def digest_of(named: Iterable[Tuple[str, torch.Tensor]]) -> str:
    """sha256 of whole tensors by name, in the order given (frozen_digest's: sorted by name)."""
    digest = hashlib.sha256()
    for name, t in named:
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_frozen(saved: Optional[str], built: Optional[str], where: Path) -> None:
    if saved != built:
        raise CheckpointError(f"{where} was trained on other frozen weights (sha256 {saved}) than this model's "
                              f"(sha256 {built}): set model.pretrained (and model.lora) as the run that wrote it "
                              "did, or start a new run directory")


def sha256_file(path: Location) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open_file(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def capture_rng(device: torch.device) -> Dict[str, Any]:
    """This rank's RNG states, as tensors and plain values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: Dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(root: Location, step: int, shared: Dict[str, Any], env: DistEnv, keep: int,
         sharded: Optional[Dict[str, Any]] = None, keep_every: int = 0, *, rng: Optional[Dict[str, Any]] = None,
         group: Optional[dist.ProcessGroup] = None, before_seal: Callable[[], None] = lambda: None) -> Path:
    """Write one checkpoint; every rank calls this (each writes its own RNG file, and its shards).

    Three phases, each ending with every rank learning whether any rank failed
    in it: rank 0 makes the temporary directory; every rank writes and hashes
    its files; rank 0 seals (manifest, rename) and prunes. A write that fails
    anywhere (a full disk, a read-only directory, no permission) makes every
    rank raise the same CheckpointWriteError after the partial directory is
    removed, so all ranks stop alike and no earlier checkpoint is touched.

    ``rng``: this rank's RNG states as captured at the step (a background save
    runs after training went on); ``group``: the process group of the save's
    collectives (a background save has its own); ``before_seal``: called on
    every rank once every file is written, before any rank seals.
    """
    final = root / f"{PREFIX}{step:08d}"
    # Object storage cannot rename a directory: there the checkpoint is written in place, its manifest last.
    tmp = root / f".tmp-{PREFIX}{step:08d}" if is_local(root) else final

    def make_tmp() -> None:
        remove_tree(tmp)
        tmp.mkdir(parents=True)

    _phase(env, "creating the checkpoint directory", tmp, make_tmp if env.is_main else None, shared, sharded, group)

    def write_files() -> Dict[str, Optional[Dict[str, Any]]]:
        """This rank's files, each hashed by its writer (in parallel over ranks, from the page cache)."""
        written = {_rng_file(env.rank): _save_file(rng if rng is not None else capture_rng(env.device),
                                                   tmp / _rng_file(env.rank))}
        if sharded is not None:  # collective: each rank its own files, rank 0 the metadata
            own = save_shards(sharded, tmp / SHARDS, group) + ([".metadata"] if env.is_main else [])
            written.update({f"{SHARDS}/{name}": _describe(tmp / SHARDS / name) for name in own})
        if env.is_main:
            written["shared.pt"] = _save_file({"format": FORMAT_VERSION, "world_size": env.world_size, **shared},
                                              tmp / "shared.pt")
        return written

    described = _phase(env, "writing the checkpoint files", tmp, write_files, shared, sharded, group)
    # The manifest names every file a resume needs, not what the ranks happen to report:
    # a rank's RNG file rank 0 cannot see (run dir not shared by all nodes, or a stale
    # NFS directory cache) must stop the run, not seal a checkpoint without it.
    files: Dict[str, Any] = {name: meta for part in described for name, meta in part.items() if meta is not None}
    needed = _needed_files(env.world_size, sharded is not None)
    refresh(tmp)  # other ranks wrote there: a cached listing would not show their files
    missing = [[name for name in needed + sorted(files) if not (tmp / name).is_file()] if env.is_main else None]
    dist.broadcast_object_list(missing, src=0, group=group)
    if missing[0]:
        raise CheckpointError(
            f"checkpoint {final.name}: rank 0 cannot see {', '.join(dict.fromkeys(missing[0]))} in {tmp}; every "
            "rank must write to the same run directory (set hydra.run.dir to storage all nodes share). Earlier "
            "checkpoints are untouched.")
    before_seal()

    def seal() -> None:
        manifest = {"step": step, "world_size": env.world_size, "format": FORMAT_VERSION,
                    "sharded": sharded is not None, "files": dict(sorted(files.items()))}
        with open_file(tmp / MANIFEST, "wb") as f:
            f.write(json.dumps(manifest, indent=1).encode())
            f.flush()
            if is_local(tmp):
                os.fsync(f.fileno())
        if is_local(root):
            fsync_dir(tmp)
            remove_tree(final)  # a re-save of the same step replaces it
            os.replace(tmp, final)
            fsync_dir(root)
        _prune(root, keep, keep_every)

    _phase(env, "sealing the checkpoint", tmp, seal if env.is_main else None, shared, sharded, group)
    return final


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the earlier ones are intact and the partial one is gone."""


# What a failed write raises: the OS's errors, torch.save's (its zip writer reports a full
# disk as a RuntimeError), and DCP's (which gathers every rank's failure).
WRITE_ERRORS: Tuple[type, ...] = (OSError, RuntimeError)


def _phase(env: DistEnv, what: str, tmp: Path, action: Optional[Callable[[], Any]], shared: Dict[str, Any],
           sharded: Optional[Dict[str, Any]], group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Run this rank's part of one phase of a save; then every rank learns what failed anywhere.

    Returns what each rank's ``action`` returned, in rank order.
    """
    failure, result = None, None
    if action is not None:
        try:
            result = action()
        except WRITE_ERRORS as err:
            failure = f"rank {env.rank}: {type(err).__name__}: {err}"
    outcomes: List[Any] = [None] * env.world_size
    dist.all_gather_object(outcomes, (failure, result), group=group)
    failed = [f for f, _ in outcomes if f is not None]
    if not failed:
        return [r for _, r in outcomes]
    message = [None]
    if env.is_main:
        remove_tree(tmp)  # the partial checkpoint: debris that would fill the disk again
        message = [_write_failure(what, tmp, failed, shared, sharded, env.world_size)]
    dist.broadcast_object_list(message, src=0, group=group)
    raise CheckpointWriteError(message[0])


def _write_failure(what: str, tmp: Path, failed: List[str], shared: Dict[str, Any],
                   sharded: Optional[Dict[str, Any]], world_size: int) -> str:
    root = tmp.parent
    intact = list_checkpoints(root)
    if intact:
        manifest = json.loads((intact[0] / MANIFEST).read_text())
        need = sum(meta["bytes"] for meta in manifest["files"].values())  # as big as the last one
    else:
        need = _tensor_bytes(shared) + world_size * _tensor_bytes(sharded or {})
    try:
        left = free_bytes(root)
        free = ("the free space of object storage cannot be known" if left is None else
                f"{left / 2**20:,.1f} MiB are free there" + (" (the disk is full)" if left < need else ""))
    except OSError:
        free = "the free space there cannot be read"
    return (f"checkpoint {tmp.name.replace('.tmp-', '')} failed while {what} in {root}: " + "; ".join(failed)
            + f". A checkpoint needs about {need / 2**20:,.1f} MiB; {free}. The partial checkpoint was removed; "
            + (f"the newest intact one is {intact[0].name}, untouched" if intact else "no earlier checkpoint exists")
            + ". Free space or make the directory writable (or set hydra.run.dir elsewhere, or lower "
            "trainer.keep_checkpoints), then start the run again in the same directory: it resumes from there.")


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested structure (this rank's part of a DTensor)."""
    if isinstance(obj, torch.Tensor):
        local = local_tensor(obj)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def kept_for_good(path: Path, keep_every: int) -> bool:
    """Whether ``trainer.keep_every`` keeps this checkpoint from pruning: its step is a multiple of it."""
    return keep_every > 0 and int(path.name[len(PREFIX):]) % keep_every == 0


def _prune(root: Location, keep: int, keep_every: int = 0) -> None:
    for old in list_checkpoints(root)[keep:]:
        if not kept_for_good(old, keep_every):
            remove_tree(old)


def list_checkpoints(root: Location) -> List[Location]:
    """Sealed checkpoints, newest first (temporary, unsealed ones never match).

    A local one is sealed by its rename; one in object storage by its manifest.
    """
    refresh(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and p.is_dir() and _sealed(p)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _sealed(path: Location) -> bool:
    """Whether a checkpoint under its final name was sealed: local ones are by their rename, ones in object
    storage by their manifest."""
    return is_local(path) or (path / MANIFEST).exists()


def verify(path: Location) -> Optional[str]:
    """None if the checkpoint is intact, else what is wrong with it."""
    return _read_verified(path)[0]


def _read_verified(path: Location) -> tuple[Optional[str], Dict[str, Any]]:
    """(what is wrong with the checkpoint or None, its files loaded by name when intact)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, meta in manifest["files"].items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing", {}
            if size_of(file) != meta["bytes"]:
                return f"{name} has {size_of(file)} bytes, the manifest says {meta['bytes']}", {}
            if sha256_file(file) != meta["sha256"]:
                return f"{name} does not match its sha256", {}
        absent = [name for name in _needed_files(manifest["world_size"], manifest.get("sharded", False))
                  if name not in manifest["files"]]
        if absent:
            return f"{', '.join(absent)} not in the manifest of a {manifest['world_size']}-rank checkpoint", {}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest ({err})", {}
    loaded = {}
    for name in manifest["files"]:
        try:  # intact is not enough: it must hold nothing but tensors and plain values
            if name == SHARD_METADATA:
                read_shard_metadata(path / SHARDS)
            elif not name.startswith(f"{SHARDS}/"):  # DCP's data files: read as tensors only, when loaded
                loaded[name] = _load(path / name)
        except pickle.UnpicklingError as err:
            how = "torch.load(weights_only=True)" if name != SHARD_METADATA else f"the metadata unpickler ({err})"
            return (f"{name} holds objects other than tensors and plain values; {how} refused it, "
                    "so nothing in it ran"), {}
    return None, loaded


def read_model(path: Location) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(shared.pt, the whole FP32 model state dict) of one checkpoint, read in this process alone.

    Any checkpoint: ddp (rank 0 wrote the model whole) or fsdp of any world size.
    """
    problem, loaded = _read_verified(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    shared = loaded["shared.pt"]
    if "model" in shared["trainer"]:
        return shared, shared["trainer"]["model"]
    shapes = shard_tensor_shapes(path / SHARDS)
    whole = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in shapes.items() if key.startswith("model.")}
    load_shards(whole, path / SHARDS)  # with no process group, DCP reads every shard in this process
    return shared, {key[len("model."):]: value for key, value in whole.items()}


def model_tensors(path: Location) -> Tuple[Dict[str, Any], Dict[str, Tuple[torch.Size, torch.dtype]],
                                            Callable[[str], torch.Tensor]]:
    """(shared.pt, the model's tensors by name: (whole shape, dtype), a reader of one whole tensor by name) of one
    checkpoint, read in this process alone.

    A sharded checkpoint is read one tensor at a time (DCP reads that tensor's byte ranges of each shard
    file), so an export holds one tensor, not the model; a ddp checkpoint holds the model in shared.pt, read whole.
    """
    problem, loaded = _read_verified(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    shared = loaded["shared.pt"]
    if "model" in shared["trainer"]:
        model = shared["trainer"]["model"]
        return shared, {key: (value.shape, value.dtype) for key, value in model.items()}, model.__getitem__
    shards = path / SHARDS
    shapes = {key[len("model."):]: shape for key, shape in shard_tensor_shapes(shards).items()
              if key.startswith("model.")}

    def read(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        one = {f"model.{name}": torch.empty(shape, dtype=dtype)}
        load_shards(one, shards)  # with no process group, DCP reads every shard of it in this process
        return one[f"model.{name}"]

    return shared, shapes, read


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be used; nothing was changed."""


def _newest_valid(root: Location) -> tuple[Optional[Location], List[str], Dict[str, Any]]:
    """The newest checkpoint that passes ``verify``, what was wrong with newer ones, and its loaded files."""
    problems = []
    for path in list_checkpoints(root):
        problem, loaded = _read_verified(path)
        if problem is None:
            return path, problems, loaded
        log.warning("checkpoint %s is unusable (%s); trying the previous one", path, problem)
        problems.append(f"{path.name}: {problem}")
    return None, problems, {}


def clean_up(root: Location, keep: int, keep_every: int = 0) -> None:
    """At start (rank 0): remove this run's stale temporary checkpoints and prune beyond ``keep``.

    A temporary directory is never a checkpoint (it was not sealed): a write
    that died left it, and it would take the space the next checkpoint needs.
    Sealed checkpoints older than the ``keep``-th newest valid one are removed;
    so nothing valid goes unless ``keep`` newer valid ones exist, and newer
    unusable ones stay for inspection.
    """
    refresh(root)
    if not root.is_dir():
        return
    # Local: a temporary name; object storage: a checkpoint's prefix without its manifest.
    unsealed = list(root.glob(f".tmp-{PREFIX}*")) if is_local(root) else \
        [p for p in root.glob(f"{PREFIX}*") if not _sealed(p)]
    for stale in unsealed:
        log.warning("removing %s, a checkpoint that was never sealed (its write did not finish)", stale)
        remove_tree(stale)
    sealed = list_checkpoints(root)
    if len(sealed) <= keep:
        return
    valid = 0
    for i, path in enumerate(sealed):
        valid += verify(path) is None
        if valid == keep:
            for old in sealed[i + 1:]:
                if kept_for_good(old, keep_every):
                    continue
                log.info("removing %s: %d newer valid checkpoints are kept (trainer.keep_checkpoints)", old, keep)
                remove_tree(old)
            return


def load_latest(root: Location, env: DistEnv) -> Optional[Tuple[Dict[str, Any], Optional[Dict[str, Any]], Location]]:
    """(shared state, this rank's RNG state or None, its directory) of the newest valid checkpoint.

    Rank 0 checks the files and broadcasts its choice, so every rank resumes
    from the same checkpoint even if they would see the directory differently.
    """
    choice: List[Any] = [None, []]
    loaded: Dict[str, Any] = {}  # rank 0: the files it verified, so that it does not read them twice
    if env.is_main:
        path, problems, loaded = _newest_valid(root)
        choice = [str(path) if path else "", problems]
    dist.broadcast_object_list(choice, src=0)
    if not choice[0]:
        if choice[1]:  # starting afresh would overwrite and prune them: stop, and lose nothing
            raise CheckpointError(
                f"no usable checkpoint in {root}: " + "; ".join(choice[1])
                + ". Nothing was changed. Move the checkpoints away to start this run directory afresh, "
                "or set hydra.run.dir to a new directory."
            )
        return None
    path = location(choice[0])
    shared = loaded["shared.pt"] if "shared.pt" in loaded else _load(path / "shared.pt")
    rng_name = _rng_file(env.rank)
    rng = loaded.get(rng_name)
    if rng is None and (path / rng_name).exists():
        rng = _load(path / rng_name)
    log.info("resuming from %s (step %d)", path, shared["loop"]["step"])
    return shared, rng, path
