"""Where checkpoints live: a local directory, or object storage behind an fsspec URL (``trainer.ckpt_dir``).

A local directory is a ``pathlib.Path``, written as before: under a temporary
name, every file and directory fsynced, sealed by a rename. Object storage has
no atomic rename of a directory: a checkpoint is written in place and sealed by
its manifest, the last object written; one without a manifest was never sealed
and is never resumed from (the next start removes it).

``Remote`` is the little of ``Path``'s interface the checkpoint code uses, over
an fsspec filesystem (s3fs for ``s3://``). Credentials and endpoints come from
the client's usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ...), never from the config file.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import IO, Any, Iterator, Union


class Remote:
    """A path in an fsspec filesystem, with the ``Path`` methods the checkpoint code calls."""

    def __init__(self, fs: Any, path: str, protocol: str):
        self.fs, self.path, self.protocol = fs, path.rstrip("/"), protocol

    def __truediv__(self, name: str) -> "Remote":
        return Remote(self.fs, posixpath.join(self.path, name), self.protocol)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"


    def __repr__(self) -> str:
        return f"Remote({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "Remote":
        return Remote(self.fs, posixpath.dirname(self.path), self.protocol)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.path)

    def iterdir(self) -> Iterator["Remote"]:
        for entry in self.fs.ls(self.path, detail=False):
            yield Remote(self.fs, entry, self.protocol)

    def glob(self, pattern: str) -> Iterator["Remote"]:
        for entry in self.fs.glob(posixpath.join(self.path, pattern)):
            yield Remote(self.fs, entry, self.protocol)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass  # object storage has no directories: a prefix exists once an object is under it

    def size(self) -> int:
        return int(self.fs.info(self.path)["size"])

    def open(self, mode: str = "rb") -> IO:
        return self.fs.open(self.path, mode)

    def read_text(self) -> str:
        with self.fs.open(self.path, "rb") as f:
            return f.read().decode()

    def write_text(self, text: str) -> None:
        with self.fs.open(self.path, "wb") as f:
            f.write(text.encode())


Location = Union[Path, Remote]


def location(spec: Union[str, Path]) -> Location:
    """A local path (``~`` expanded) or, for a URL with a scheme other than file://, a ``Remote``."""
    text = str(spec)
    if "://" not in text or text.startswith("file://"):
        return Path(os.path.expanduser(text.removeprefix("file://")))
    import fsspec

    fs, path = fsspec.core.url_to_fs(text)
    return Remote(fs, path, text.split("://", 1)[0])


def is_local(path: Location) -> bool:
    return isinstance(path, Path)


def size_of(path: Location) -> int:
    return path.stat().st_size if is_local(path) else path.size()


def open_file(path: Location, mode: str = "rb") -> IO:
    return open(path, mode) if is_local(path) else path.open(mode)


def remove_tree(path: Location) -> None:
    """Remove a directory (a prefix) and everything under it; nothing if it is not there."""
    if is_local(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass
    path.fs.invalidate_cache(path.path)


def fsync_dir(path: Location) -> None:
    """Make a directory's entries durable (a rename, a new file); object storage's writes already are."""
    if not is_local(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: Location) -> Any:
    """Free space where ``path`` is, or None where that cannot be known (object storage)."""
    return shutil.disk_usage(path).free if is_local(path) else None


def refresh(path: Location) -> None:
    """Forget what the fsspec client cached of ``path``'s listing: other processes write there."""
    if not is_local(path):
        path.fs.invalidate_cache(path.path)
