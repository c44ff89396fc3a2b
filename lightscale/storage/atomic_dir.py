"""Checkpoint directories that are never half-written: write beside, then swap in with renames.

A save writes everything into ``last.ckpt.tmp``; then :func:`publish` renames the previous ``last.ckpt`` to
``last.old.ckpt``, ``last.ckpt.tmp`` to ``last.ckpt``, and the previous one out of the way (``last.ckpt.trash``)
to delete it. A crash at any point leaves a complete checkpoint under ``last.ckpt`` or, between the first two
renames only, under ``last.old.ckpt``:

* every lightscale loader reads through :func:`complete_checkpoint`, which falls back to ``last.old.ckpt`` when
  ``last.ckpt`` is missing;
* Lightning's ``ckpt_path="last"`` finds it too: it picks files named ``last*.ckpt``, which is why the previous
  copy keeps the ``.ckpt`` suffix (``last.ckpt.old`` would be invisible to it and the run would restart from
  scratch). Half-written or half-deleted directories never carry that suffix (``.tmp``, ``.trash``).

Why not versioned directories behind an atomically replaced symlink (no window at all)? Lightning removes old
checkpoints with ``fsspec``'s ``rm``, which deletes the link and leaks the directory it points to, and a copy or
upload of ``last.ckpt`` (object stores, ``rsync`` without ``-L``) carries a dangling link. The rename-based swap
keeps every checkpoint one plain directory, with one window that every loader handles.

A remote location (an fsspec URL, lightscale/storage/urls.py) has no rename: the same three functions stage under
``CKPT.tmp/``, then copy it in behind a completion marker written last (urls.py's ``publish_remote``).

Example:
    >>> staging = start_staging(Path("last.ckpt"))  # rank 0, then a barrier
    >>> ...  # every rank writes its shards into staging
    >>> publish(staging, Path("last.ckpt"))  # rank 0, after a barrier
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from lightscale.storage.urls import (
    Location,
    RemotePath,
    checkpoint_location,
    complete_remote,
    publish_remote,
    refuse_url_like,
    start_remote_staging,
)


def staging_path(target: Location) -> Location:
    return target.with_name(target.name + ".tmp")


def previous_path(target: Location) -> Location:
    """``last.ckpt`` -> ``last.old.ckpt``: still a ``last*.ckpt`` for Lightning's ``ckpt_path="last"``."""
    return target.with_name(f"{target.stem}.old{target.suffix}")


def _trash_path(target: Path) -> Path:
    return target.with_name(target.name + ".trash")


def start_staging(target: Location) -> Location:
    """An empty ``TARGET.tmp`` (a crashed save's left-overs removed), where every rank then writes; call on one rank
    and give the others its answer. Remote: possibly ``target`` itself (urls.py's ``start_remote_staging``)."""
    staging = staging_path(target)
    if isinstance(staging, RemotePath) and isinstance(target, RemotePath):
        return start_remote_staging(target, staging)
    refuse_url_like(target)
    for leftover in (staging, _trash_path(target)):
        if leftover.exists():
            shutil.rmtree(leftover)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def agreed_staging(path: Location) -> Location:
    """Collective: where every rank writes checkpoint ``path``, as rank 0's :func:`start_staging` decided after
    clearing it (nobody writes before)."""
    where = [str(start_staging(path)) if (not dist.is_initialized() or dist.get_rank() == 0) else None]
    if dist.is_initialized():
        dist.broadcast_object_list(where, src=0)
    return checkpoint_location(where[0]) if isinstance(path, RemotePath) else staging_path(path)


def publish(staging: Location, target: Location) -> None:
    """Make the complete ``staging`` directory the checkpoint ``target``; call on one rank."""
    if isinstance(staging, RemotePath) and isinstance(target, RemotePath):
        publish_remote(staging, target)
        return
    assert isinstance(staging, Path) and isinstance(target, Path)
    old = previous_path(target)
    if target.is_dir():
        if old.exists():  # a crash after the second rename of an earlier publish: target is the newer one
            _delete(old, target)
        target.rename(old)
    elif target.exists():
        target.unlink()
    staging.rename(target)  # from here the new checkpoint is complete under its name
    if old.exists():
        _delete(old, target)


def _delete(directory: Path, target: Path) -> None:
    """Rename first: a directory that is half deleted never keeps a name a loader would read."""
    trash = _trash_path(target)
    if trash.exists():
        shutil.rmtree(trash)
    directory.rename(trash)
    shutil.rmtree(trash)


def complete_checkpoint(target: Location) -> Location:
    """``target``, or its previous copy if a save crashed between the first two renames of :func:`publish` (remote:
    its staged copy, if the crash came between unmarking the previous checkpoint and marking the new one)."""
    if isinstance(target, RemotePath):
        return complete_remote(target, RemotePath(str(staging_path(target))))
    old = previous_path(target)
    return old if not target.exists() and old.is_dir() else target
