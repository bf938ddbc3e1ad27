"""DCP's part of a checkpoint: each rank's shards of the sharded state, and their metadata read safely.

``shards`` is a local ``Path`` or a ``storage.Remote`` (DCP's fsspec reader and writer then).
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: no callable outside this list can be reached."""

    ALLOWED = {
        ("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
    } | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
         ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
         ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's shard metadata")


def read_shard_metadata(shards: Any) -> Any:
    """DCP's metadata of a sharded checkpoint, unpickled safely; only tensor items are accepted."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .storage import open_file

    with open_file(shards / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    others = [key for key, item in metadata.state_dict_metadata.items()
              if not isinstance(item, TensorStorageMetadata)]
    if others:
        raise pickle.UnpicklingError(f"shard items {others[:3]} are not tensors; only tensors are loaded")
    return metadata


def save_shards(state: Dict[str, Any], shards: Any, group: Optional[dist.ProcessGroup] = None) -> List[str]:
    """Every rank writes its own shards of ``state`` (DTensors, or tensors every rank holds) with DCP.

    Returns the files this rank wrote: DCP names them ``__<rank in group>_<n>.distcp``.
    """
    import torch.distributed.checkpoint as dcp

    from .storage import is_local, refresh

    writer = (dcp.FileSystemWriter(str(shards), sync_files=True) if is_local(shards) else
              _fsspec().FsspecWriter(str(shards), sync_files=False))  # an object is durable once written
    dcp.save(state, storage_writer=writer, process_group=group)
    refresh(shards)
    return sorted(p.name for p in shards.glob(f"__{dist.get_rank(group)}_*"))


def load_shards(state: Dict[str, Any], shards: Any) -> None:
    """Fill ``state``'s tensors in place from a sharded checkpoint, resharding to their layout.

    ``state`` may hold DTensors of any mesh (fsdp on any world size) or whole
    tensors (each rank then reads every shard of them).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    from .storage import is_local

    class SafeReader(dcp.FileSystemReader if is_local(shards) else _fsspec().FsspecReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_shard_metadata(shards)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:  # DCP would torch.load it with weights_only=False
            from . import CheckpointError

            raise CheckpointError(f"shard item {read_item.dest_index.fqn} is not a tensor; refusing to unpickle it")

    dcp.load(state, storage_reader=SafeReader(str(shards)), planner=TensorsOnly())


def _fsspec() -> Any:
    """DCP's fsspec reader and writer (object storage). torch 2.13 has them in this module only, not in
    torch.distributed.checkpoint's namespace; they are DCP's own file reader and writer over fsspec."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    return _fsspec_filesystem


def shard_tensor_shapes(shards: Any) -> Dict[str, Tuple[torch.Size, torch.dtype]]:
    """Key -> (whole shape, dtype) of every tensor a sharded checkpoint holds."""
    metadata = read_shard_metadata(shards)
    return {key: (item.size, item.properties.dtype) for key, item in metadata.state_dict_metadata.items()}
