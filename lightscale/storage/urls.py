"""Checkpoint locations that are fsspec URLs (``s3://``, ``gs://``, ``az://``, ``memory://``, ``file://``).

Every checkpoint path lightscale writes or reads goes through :func:`checkpoint_location`: a local path stays a
``pathlib.Path``; ``file://`` becomes the local path it names; any other URL becomes a :class:`RemotePath`, which
has the few ``Path`` operations the checkpoint code uses (``/``, ``name``, ``parent``, ``with_name``, ``exists``,
``is_file``, ``is_dir``) answered by the URL's fsspec filesystem, and deliberately no ``__fspath__``: ``open``,
``os.makedirs`` or ``torch.save`` given one raise instead of creating a local folder named ``s3:`` (what
``Path("s3://bucket/run")`` silently did). A scheme whose filesystem package is missing is refused when the location
is made, before training, naming the package (``s3fs``, ``gcsfs``, ``adlfs``).

Object stores have no rename, so the atomic commit of a checkpoint directory rests on a completion marker,
:data:`COMPLETE`, written last: a remote directory without it is never read as a checkpoint. Where no complete
checkpoint is at ``CKPT/`` (a new name: ModelCheckpoint's ``step=N.ckpt``), every rank writes straight into it and rank
0 adds the marker. Where one is (``last.ckpt`` saved again), every rank writes under the staging prefix
``CKPT.tmp/``; rank 0 marks it complete, then unmarks and deletes the previous ``CKPT/``, copies the staged objects
(server-side) to ``CKPT/``, marks it, and deletes the staging prefix, marker first. After a crash mid-publish
:func:`complete_remote` finds the complete staged copy.

Example:
    >>> location = checkpoint_location("s3://bucket/run/last.ckpt")  # RemotePath, or ConfigurationError
    >>> location / "trainer_state.pt"
    RemotePath('s3://bucket/run/last.ckpt/trainer_state.pt')
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import fsspec
from fsspec.registry import known_implementations
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # DCP over fsspec (no public name)

from lightscale.errors import ConfigurationError

COMPLETE = ".lightscale_complete"  # written last into a remote checkpoint directory: the directory is whole
_EXTRA = {"s3fs": ", or pip install 'lightscale[s3]'"}  # the filesystems lightscale's extras install
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# what pathlib makes of a URL: "s3://b/x" -> "s3:/b/x"; such a path must never become a local folder (schemes have
# two letters or more: "C:/x" stays a Windows drive)
_MANGLED = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):/[^/]")


def url_scheme(path: Any) -> str | None:
    """The scheme of ``path`` if it is a URL string (``"s3"`` for ``"s3://bucket/x"``), else None."""
    match = _URL.match(str(path)) if isinstance(path, str | RemotePath) else None
    return match.group(1).lower() if match else None


def filesystem_package(scheme: str) -> str | None:
    """The package that provides fsspec's filesystem for ``scheme`` (``s3`` -> ``s3fs``); None for fsspec's own."""
    known = known_implementations.get(scheme)
    if known is None:
        return None
    top = known["class"].split(".")[0]
    return None if top == "fsspec" else top


def check_scheme(scheme: str, url: str) -> None:
    """Refuse a scheme fsspec does not know, or whose filesystem package is not installed, naming the package."""
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        package = filesystem_package(scheme)
        raise ConfigurationError(
            f"Checkpoint location {url!r} needs the {package} package for {scheme}:// URLs, which is not installed. "
            f"Install it (pip install {package}{_EXTRA.get(package, '')}) or use a local path."
        ) from None
    except ValueError:
        known = ", ".join(f"{name}://" for name in ("s3", "gs", "az", "memory", "file"))
        raise ConfigurationError(
            f"Checkpoint location {url!r}: fsspec knows no filesystem for {scheme}://. Use a local path or an fsspec "
            f"URL such as {known}."
        ) from None


def checkpoint_location(path: str | os.PathLike[str] | RemotePath) -> Path | RemotePath:
    """``path`` as what the checkpoint code reads and writes: a local ``Path`` or a :class:`RemotePath`."""
    if isinstance(path, RemotePath):
        return path
    text = os.fspath(path)
    scheme = url_scheme(text)
    if scheme is None:
        refuse_url_like(Path(text))
        return Path(text)
    check_scheme(scheme, text)
    if scheme in ("file", "local"):
        return Path(fsspec.core.url_to_fs(text)[1])
    return RemotePath(text)


def refuse_url_like(path: Path) -> None:
    """Refuse a local path that is a URL mangled by pathlib (``s3:/bucket``): never a local folder named ``s3:``."""
    if _MANGLED.match(str(path)):
        raise ConfigurationError(
            f"{str(path)!r} looks like a URL that lost one '/' of its '://' (pathlib.Path does that to URLs); "
            "pass the URL as a string, e.g. 's3://bucket/run', not Path('s3://bucket/run')."
        )


def is_remote(path: Any) -> bool:
    return isinstance(path, RemotePath)


class RemotePath:
    """A location in an fsspec filesystem, with the ``Path`` operations the checkpoint code uses (no ``__fspath__``:
    see the module docstring). Listings are read fresh: another rank (process) may just have written."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.key = fsspec.core.url_to_fs(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return Path(self.name).stem

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0])

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def _fresh(self) -> None:
        self.fs.invalidate_cache(self.key)
        self.fs.invalidate_cache(self.parent.key)

    def exists(self) -> bool:
        self._fresh()
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        self._fresh()
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        self._fresh()
        return self.fs.isdir(self.key)

    def names(self) -> list[str]:
        """Names of the objects and prefixes directly under this location (fresh listing)."""
        self._fresh()
        if not self.fs.isdir(self.key):
            return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(self.key, detail=False)]

    def modified(self) -> float:
        """When this object was last written (seconds since the epoch)."""
        return self.fs.modified(self.key).timestamp()

    def read_bytes(self) -> io.BytesIO:
        with self.fs.open(self.key, "rb") as file:
            return io.BytesIO(file.read())

    def write_bytes(self, data: bytes) -> None:
        """One PUT on an object store: the object appears whole or not at all."""
        with self.fs.open(self.key, "wb") as file:
            file.write(data)

    def files(self) -> list[str]:
        """Keys of every object under this prefix (fresh listing)."""
        self._fresh()
        return self.fs.find(self.key) if self.fs.isdir(self.key) else []

    def remove(self) -> None:
        """Delete everything under this location; the completion marker first, so a half-deleted directory is never
        complete."""
        marker = self / COMPLETE
        if marker.exists():
            self.fs.rm(marker.key)
        if self.exists():
            self.fs.rm(self.key, recursive=True)


Location = Path | RemotePath  # what checkpoint_location returns


# ---- the atomic commit of a remote checkpoint directory -------------------------------------------------------
def start_remote_staging(target: RemotePath, staging: RemotePath) -> RemotePath:
    """Where every rank writes ``target`` (rank 0 decides and clears it, before anyone writes): ``target`` itself when
    it holds no complete checkpoint to keep (a new name, the usual case: no copy at publish), else ``staging``."""
    staging.remove()
    if is_complete(target) or target.is_file():  # a checkpoint (directory or single file) to keep until published
        return staging
    target.remove()  # left-overs of a save that died before its marker: never complete, nothing to keep
    return target


def publish_remote(staging: RemotePath, target: RemotePath) -> None:
    """Make the fully written ``staging`` prefix the checkpoint ``target`` (rank 0, after every rank wrote)."""
    if staging == target:  # written in place (nothing to keep was there): the marker completes it
        (target / COMPLETE).write_bytes(b"")
        return
    (staging / COMPLETE).write_bytes(b"")  # from here the staged copy is complete
    target.remove()  # marker first: from here until the copy's marker, loaders read the staged copy
    sources = [key for key in staging.files() if not key.endswith("/" + COMPLETE)]
    if sources:
        staging.fs.copy(sources, [target.key + key[len(staging.key) :] for key in sources])
    (target / COMPLETE).write_bytes(b"")  # last: the new checkpoint is complete under its name
    staging.remove()


def is_complete(path: RemotePath) -> bool:
    return (path / COMPLETE).is_file()


def complete_remote(target: RemotePath, staging: RemotePath) -> RemotePath:
    """``target`` when complete (or a single object), else its staged copy when that is complete (a crash between
    unmarking the previous checkpoint and marking the new one), else ``target`` (which readers then refuse)."""
    if target.is_file() or is_complete(target):
        return target
    return staging if is_complete(staging) else target


def refuse_incomplete(path: Location) -> None:
    """Refuse a remote checkpoint directory without its completion marker: its save did not finish."""
    if isinstance(path, RemotePath) and path.is_dir() and not is_complete(path):
        raise ConfigurationError(
            f"{path} is an incomplete checkpoint: its save did not finish (no completion marker, written last; "
            "lightscale/storage/urls.py). Resume from an earlier checkpoint."
        )


def check_shared(location: Location, world_size: int) -> None:
    """Refuse ``memory://`` for several processes: each process has its own memory filesystem."""
    if is_remote(location) and url_scheme(location) == "memory" and world_size > 1:
        raise ConfigurationError(
            f"Checkpoint location {location} is in memory://, which each process keeps to itself; {world_size} "
            "ranks cannot share it. Use a shared filesystem or an object store (s3://, gs://, az://)."
        )


def storage_writer(path: Location) -> FileSystemWriter:
    """DCP's writer for checkpoint directory ``path``: its fsspec writer for a remote location."""
    return FsspecWriter(str(path)) if isinstance(path, RemotePath) else FileSystemWriter(str(path))
