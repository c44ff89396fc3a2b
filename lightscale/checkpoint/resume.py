"""``resume="auto"``: continue from the newest complete checkpoint of this run, or start fresh when there is none.

A restarted job (torchrun ``--max-restarts``, a SLURM requeue, a person re-running the same command) must pick up
where the last complete save left it without anyone finding the file. The run's checkpoints are where its
``ModelCheckpoint`` writes them (``dirpath``). Complete checkpoints are the ``*.ckpt`` files and directories there:
lightscale writes every checkpoint beside its final name first (``X.ckpt.partial`` files, ``X.ckpt.tmp``
directories) and renames it into place when complete, so staging left-overs of a killed save never carry the
``.ckpt`` suffix; a save killed between the two renames of a directory swap leaves ``last.old.ckpt``, which counts.
Of those, the newest by modification time wins, the rule Lightning's ``ckpt_path="last"`` applies to ``last*.ckpt``
(here step-named top-k files count too, so ``save_last`` is not required).

In object storage (an fsspec URL, lightscale/storage/urls.py) a checkpoint directory is complete when it holds the
completion marker, which is written last, so its time is the save's; a name whose marker is gone mid-publish counts
through its complete staged copy (``X.ckpt.tmp/``); single objects are complete once they exist.

Lightning's own ``ckpt_path="last"`` cannot see a bucket: it lists ``s3://bucket/run`` through fsspec, gets keys
without the scheme (``bucket/run/last.ckpt``) and looks for those on local disk. ``lightscale.Trainer.fit`` answers
``"last"`` itself when every ModelCheckpoint writes to a URL (:func:`resolve_last`): Lightning's rule (``last*.ckpt``,
newest wins) over the complete checkpoints there, as above. Local directories keep Lightning's answer.

Every rank decides alone from the same directory: at the start of ``fit`` no rank of this attempt has saved yet and
every rank of the previous attempt is gone, so they all see the same files.

Example:
    >>> Trainer(..., callbacks=[PeriodicCheckpoint("ckpts", every_n_steps=100)], resume="auto").fit(model, data)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightscale.errors import ConfigurationError
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.urls import COMPLETE, Location, RemotePath, checkpoint_location, is_complete

RESUME_CHOICES = ("auto", "never")
_STAGING_SUFFIXES = (".tmp", ".partial", ".trash")  # never complete, whatever precedes the suffix


def newest_checkpoint(dirpath: str | Location) -> Location | None:
    """The newest complete checkpoint (file or directory) in ``dirpath``; None when there is none."""
    directory = checkpoint_location(dirpath)
    if isinstance(directory, RemotePath):
        return newest_remote_checkpoint(directory)
    if not directory.is_dir():
        return None
    complete = [path for path in directory.iterdir() if path.suffix == ".ckpt" and _is_complete(path)]
    if not complete:
        return None
    # Ties (a coarse clock): prefer last*.ckpt, which ModelCheckpoint writes after the step-named copy.
    return max(complete, key=lambda path: (path.stat().st_mtime_ns, path.name.startswith("last")))


def newest_remote_checkpoint(directory: RemotePath) -> RemotePath | None:
    """:func:`newest_checkpoint` in object storage: by the time of each complete checkpoint's marker (or object)."""
    times = finished_remote_checkpoints(directory, named=lambda name: name.endswith(".ckpt"))
    return max(times, key=lambda path: (times[path], path.name.startswith("last"))) if times else None


def finished_remote_checkpoints(directory: RemotePath, *, named: Callable[[str], bool]) -> dict[RemotePath, float]:
    """When the save of each complete checkpoint in ``directory`` whose name ``named`` accepts finished: its
    marker's time (written last), or its staged copy's after a cut-short publish, or a single object's."""
    names = {name.removesuffix(".tmp") for name in directory.names()}
    times = {}
    for name in sorted(name for name in names if named(name)):
        found = complete_checkpoint(directory / name)
        if not isinstance(found, RemotePath):
            continue
        if is_complete(found):
            times[directory / name] = (found / COMPLETE).modified()
        elif found.is_file():
            times[directory / name] = found.modified()
    return times


def resolve_last(ckpt_path: Any, callbacks: list[Any]) -> Any:
    """``ckpt_path``, or for ``"last"`` when every ModelCheckpoint writes to a URL, the newest complete
    ``last*.ckpt`` there (None, warning as Lightning does, when there is none); see the module docstring."""
    if ckpt_path != "last" or not callbacks:
        return ckpt_path
    locations = [checkpoint_location(str(callback.dirpath)) for callback in callbacks if callback.dirpath is not None]
    if len(locations) < len(callbacks) or not all(isinstance(location, RemotePath) for location in locations):
        return ckpt_path  # local directories: Lightning's own answer
    times: dict[RemotePath, float] = {}
    for callback, directory in zip(callbacks, locations, strict=True):
        assert isinstance(directory, RemotePath)
        times |= finished_remote_checkpoints(directory, named=_last_names(callback))
    if not times:
        where = ", ".join(str(location) for location in locations)
        rank_zero_warn(f'ckpt_path="last": no complete last checkpoint in {where}; no checkpoint will be loaded.')
        return None
    return str(max(times, key=lambda path: times[path]))


def _last_names(callback: Any) -> Callable[[str], bool]:
    """Lightning's rule for a last checkpoint's name (ModelCheckpoint._find_last_checkpoints), from the callback's
    public class attributes: ``last.ckpt``, ``last-v1.ckpt``, ..."""
    pattern = re.compile(rf"^{callback.CHECKPOINT_NAME_LAST}(-(\d+))?")
    extension = callback.FILE_EXTENSION
    return lambda name: name.endswith(extension) and bool(pattern.match(name[: -len(extension)]))


def _is_complete(path: Path) -> bool:
    if any(path.name.endswith(suffix) for suffix in _STAGING_SUFFIXES):
        return False
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def check_resume(resume: Any) -> None:
    if resume is not None and resume not in RESUME_CHOICES:
        raise ConfigurationError(f"resume={resume!r} is not valid; valid values are {list(RESUME_CHOICES)} or None.")


def checkpoint_dir(callbacks: list[Any], *, has_logger: bool, default_root_dir: str) -> Location:
    """The one directory this run's checkpoints go to; a clear error when that is not one fixed directory."""
    if not callbacks:
        raise ConfigurationError(
            "resume='auto' needs checkpoints to resume from, but no ModelCheckpoint is configured (or "
            "enable_checkpointing=False); add one, e.g. lightscale.callbacks.PeriodicCheckpoint(dirpath='ckpts', "
            "every_n_steps=100)."
        )
    dirpaths = {callback.dirpath for callback in callbacks}
    if len(dirpaths) > 1:
        raise ConfigurationError(
            f"resume='auto' needs one checkpoint directory, but the ModelCheckpoint callbacks write to "
            f"{sorted(str(path) for path in dirpaths)}; give them the same dirpath or pass ckpt_path explicitly."
        )
    (dirpath,) = dirpaths
    if dirpath is not None:
        return checkpoint_location(dirpath)  # a local path or an fsspec URL
    if has_logger:  # Lightning's default is under the logger's version directory, a new one per run
        raise ConfigurationError(
            "resume='auto' needs ModelCheckpoint(dirpath=...): without it checkpoints go to the logger's "
            "version_N directory, which is new in every run, so a restarted run would never find them."
        )
    return Path(default_root_dir) / "checkpoints"  # Lightning's default without a logger


def resolve_resume(resume: str | None, ckpt_path: Any, directory: Location | None) -> Any:
    """The ``ckpt_path`` to hand to Lightning: an explicit one wins; ``resume="auto"`` finds the newest in
    ``directory`` (from :func:`checkpoint_dir`)."""
    if resume != "auto":
        return ckpt_path
    if ckpt_path is not None:
        rank_zero_info(f"lightscale: resume='auto' ignored: the explicit ckpt_path={ckpt_path!r} wins.")
        return ckpt_path
    assert directory is not None
    found = newest_checkpoint(directory)
    if found is None:
        rank_zero_info(f"lightscale: resume='auto' found no complete checkpoint in {directory}; starting fresh.")
        return None
    rank_zero_info(f"lightscale: resume='auto' resumes from {found}.")
    return str(found)
