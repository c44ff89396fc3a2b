"""Single checkpoint files (``trainer_state.pt``, Lightning ``.ckpt`` files, exports): I/O that never unpickles
arbitrary code and never leaves a half-written file.

Reads: ``torch.load(weights_only=True)``, with the few plain containers Lightning stores in a checkpoint
allow-listed. Writes (:func:`atomic_path`, the one writer of single files): a temporary file *beside* the
target, flushed to disk, then ``os.replace``. Lightning's ``TorchCheckpointIO``
writes its temporary file to the system temp directory and moves it; when that is another filesystem than the
checkpoint's (a local ``/tmp``, a network checkpoint directory: the usual cluster layout), the move is a copy
into the target, and a crash during the copy leaves a truncated checkpoint under the final name.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.data import AttributeDict
from typing_extensions import override

from lightscale.storage.safe_dcp import UnsafeCheckpointError
from lightscale.storage.urls import Location, RemotePath, checkpoint_location, refuse_url_like

_ALLOWED: list[Any] = []
T = TypeVar("T")


def allow_in_checkpoints(*classes: type) -> None:
    """Let plain data classes (e.g. a model config saved in hyper-parameters) load with ``weights_only=True``."""
    _ALLOWED.extend(cls for cls in classes if cls not in _ALLOWED)


def checkpoint_safe_globals() -> list[Any]:
    """Classes a lightscale checkpoint may hold besides tensors and containers (all plain data)."""
    return [AttributeDict, *_ALLOWED]


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic saves; loads with ``weights_only=True`` unless the caller explicitly trusts the file."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        location = checkpoint_location(path)  # refuses a URL whose filesystem is not installed
        if storage_options is not None or isinstance(location, RemotePath):  # one fsspec write (an object store PUT)
            super().save_checkpoint(checkpoint, str(location), storage_options)
            return
        location.parent.mkdir(parents=True, exist_ok=True)
        save_atomically(checkpoint, location)

    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        trusted_code = weights_only is False  # only an explicit False opts out
        parent = super().load_checkpoint

        def load() -> dict[str, Any]:
            with torch.serialization.safe_globals(checkpoint_safe_globals()):
                return parent(path, map_location=map_location, weights_only=not trusted_code)

        location = checkpoint_location(path)
        if isinstance(location, RemotePath):  # fsspec reads it: Lightning's loader, given the URL string
            path = str(location)
        if trusted_code or isinstance(location, RemotePath):  # remote: nothing to scan beforehand
            return load()
        return load_with_package_classes(location, load)

    @override
    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """A remote checkpoint directory loses its completion marker first (never half-deleted yet complete)."""
        location = checkpoint_location(path)
        if isinstance(location, RemotePath):
            location.remove()
        else:
            super().remove_checkpoint(path)


@contextmanager
def atomic_path(output: Path) -> Iterator[Path]:
    """A temporary path beside ``output`` to write the file to; when the block ends, that file is flushed to disk
    (``fsync``) and renamed over ``output`` (atomic on one filesystem); if the block fails, it is removed.

    Never a half-written file under the final name, even after a power loss. The name
    (``OUT.<random>.partial``) is unique, so concurrent writers of one target (ranks caching the same token file)
    never write into each other's file; the ``.partial`` suffix marks it incomplete for ``resume="auto"``.

    Example:
        >>> with atomic_path(Path("gpt.safetensors")) as partial:
        ...     save_file(state, str(partial))
    """
    refuse_url_like(output)
    partial = output.with_name(f"{output.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        yield partial
        _fsync(partial)
        os.replace(partial, output)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)  # fsync flushes the file's pages whichever descriptor asks
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_atomically(state: dict[str, Any], output: Location) -> None:
    """``torch.save`` of ``state`` to ``output`` through :func:`atomic_path`; remote: one object written whole."""
    if isinstance(output, RemotePath):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        output.write_bytes(buffer.getvalue())
        return
    with atomic_path(output) as partial:
        torch.save(state, partial)


def load_with_package_classes(path: str | os.PathLike | io.BytesIO, load: Callable[[], T]) -> T:
    """``load()`` of the ``torch.save`` file ``path``; if it refuses a class, the lightscale modules of the classes
    that ``path`` names are imported (if not yet) and ``load()`` runs once more.

    Why: a recipe allow-lists its config class (saved in the hyper-parameters) when its module is imported, and
    ``lightscale consolidate`` / ``export`` run in a process that imported no recipe. Only modules of the installed
    lightscale package are imported, nothing else the file names; whether a class loads is still the allow-list's
    decision, so a class that no lightscale module registers is refused as before.
    """
    try:
        return load()
    except pickle.UnpicklingError:
        if not _import_package_modules(path):
            raise
    return load()


def _import_package_modules(path: str | os.PathLike | io.BytesIO) -> bool:
    """Import the not yet imported lightscale modules whose classes ``path`` pickles; whether any was imported."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)  # reads the pickle, runs none of it
    except (ValueError, RuntimeError):  # not a zip-format torch.save file: nothing to find
        return False
    modules = {name.rpartition(".")[0] for name in names if name.startswith("lightscale.")} - set(sys.modules)
    imported = False
    for module in sorted(modules):
        with contextlib.suppress(ImportError):  # a class of another lightscale version: the load refuses it
            importlib.import_module(module)
            imported = True
    return imported


def load_weights_only(path: Location, *, hint: str = "Load it only if you trust it.", trusted: bool = False) -> Any:
    """``torch.load`` of one file (local or remote) onto the CPU, refusing anything but weights-only data (plus the
    allow-listed classes, :func:`load_with_package_classes`) with a message naming ``path``; ``trusted=True`` is the
    caller's explicit ``weights_only=False``."""
    data = path.read_bytes().getvalue() if isinstance(path, RemotePath) else None  # read once, parsed as a file

    def source() -> Path | io.BytesIO:
        return io.BytesIO(data) if data is not None else path

    def load() -> Any:
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return torch.load(source(), map_location="cpu", weights_only=not trusted)

    try:
        return load() if trusted else load_with_package_classes(source(), load)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0]
        raise UnsafeCheckpointError(
            f"Refusing to read {path}: it is not weights-only data (tensors, numbers, strings, containers) and may "
            f"run code if unpickled. {hint} ({first_line})"
        ) from None
