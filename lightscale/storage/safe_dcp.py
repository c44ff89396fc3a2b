"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with plain ``pickle.load`` and its
``DefaultLoadPlanner`` reads non-tensor entries with ``torch.load(weights_only=False)``: a checkpoint directory
from anywhere could run code on load. These two replacements accept only what DCP itself writes: the metadata
classes, shapes, dtypes and paths; and weights-only entries (tensors, numbers, strings, containers).

Example:
    >>> load_safely({"model": model_state}, path)  # dcp.load, refusing anything that could run code
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # DCP over fsspec (no public name)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.storage.urls import RemotePath

_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # layout by name, as weights_only allows
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


class UnsafeCheckpointError(ConfigurationError):
    """A checkpoint file asks to run code (a pickle global outside DCP's own metadata types)."""


class _MetadataUnpickler(pickle.Unpickler):
    @override
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)  # DCP's metadata dataclasses and enums
        raise UnsafeCheckpointError(
            f"Refusing to read this checkpoint's DCP metadata: it references {module}.{name}, which is not one of "
            "the types DCP writes (its metadata classes, torch.Size, dtypes, paths). The file may run code if "
            "unpickled; load it only if you trust it, with torch.distributed.checkpoint directly."
        )


def read_metadata_safely(file: io.BufferedIOBase) -> Metadata:
    metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata.")
    return metadata


class _SafeMetadata:
    """``read_metadata`` of DCP's file readers through an unpickler that allows DCP's own types only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = read_metadata_safely(file)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by an unpickler that allows DCP's own types only."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """``FsspecReader`` (an fsspec URL: lightscale/storage/urls.py) reading ``.metadata`` as safely."""


def safe_reader(path: str | pathlib.Path | RemotePath) -> FileSystemReader:
    """The safe DCP reader of checkpoint directory ``path``, local or remote."""
    return SafeFsspecReader(str(path)) if isinstance(path, RemotePath) else SafeFileSystemReader(str(path))


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries (optimizer hyper-parameters, counters) weights-only."""

    @override
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"Refusing to read checkpoint entry {read_item.dest_index.fqn!r}: it is not weights-only data "
                f"(tensors, numbers, strings, containers) and may run code if unpickled. {error}"
            ) from None
        super().load_bytes(read_item, _as_stream(loaded))


def _as_stream(value: Any) -> io.BytesIO:
    """The checked value, re-serialized so the parent's loader (``weights_only=False``) reads only safe data."""
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


def load_safely(state: dict[str, Any], path: str | pathlib.Path | RemotePath, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` that refuses code-running content with a clear error.

    The metadata is checked before any collective starts; a bad entry found while reading is re-raised as itself,
    not inside DCP's per-rank ``CheckpointException``.
    """
    reader = safe_reader(path)
    reader.read_metadata()
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as error:
        unsafe = [failure for failure, _ in error.failures.values() if isinstance(failure, UnsafeCheckpointError)]
        if unsafe:
            raise unsafe[0] from None
        raise
