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
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec transaction
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_atomically(checkpoint, Path(path))

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

        if trusted_code or "://" in str(path):  # remote: fsspec reads it, nothing to scan beforehand
            return load()
        return load_with_package_classes(Path(path), load)


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


def save_atomically(state: dict[str, Any], output: Path) -> None:
    """``torch.save`` of ``state`` to ``output`` through :func:`atomic_path`."""
    with atomic_path(output) as partial:
        torch.save(state, partial)


def load_with_package_classes(path: str | os.PathLike, load: Callable[[], T]) -> T:
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


def _import_package_modules(path: str | os.PathLike) -> bool:
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


def load_weights_only(path: Path, *, hint: str = "Load it only if you trust it.", trusted: bool = False) -> Any:
    """``torch.load`` of one file onto the CPU, refusing anything but weights-only data (plus the allow-listed
    classes, :func:`load_with_package_classes`) with a message naming ``path``; ``trusted=True`` is the caller's
    explicit ``weights_only=False``."""

    def load() -> Any:
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=not trusted)

    try:
        return load() if trusted else load_with_package_classes(path, load)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0]
        raise UnsafeCheckpointError(
            f"Refusing to read {path}: it is not weights-only data (tensors, numbers, strings, containers) and may "
            f"run code if unpickled. {hint} ({first_line})"
        ) from None
