"""Checkpoint directories that are never half-written: write beside, then swap in with two renames.

A save writes everything into ``CKPT.tmp`` and then :func:`publish` renames the previous ``CKPT`` to ``CKPT.old``,
``CKPT.tmp`` to ``CKPT``, and deletes ``CKPT.old``. A crash at any point leaves a complete checkpoint under
``CKPT`` or, between the two renames only, under ``CKPT.old``; :func:`complete_checkpoint` is what every loader
reads, so it finds whichever exists. A left-over ``CKPT.tmp`` is never read and is cleared by the next save.

Example:
    >>> staging = start_staging(Path("last.ckpt"))  # rank 0, then a barrier
    >>> ...  # every rank writes its shards into staging
    >>> publish(staging, Path("last.ckpt"))  # rank 0, after a barrier
"""

from __future__ import annotations

import shutil
from pathlib import Path


def staging_path(target: Path) -> Path:
    return target.with_name(target.name + ".tmp")


def previous_path(target: Path) -> Path:
    return target.with_name(target.name + ".old")


def start_staging(target: Path) -> Path:
    """An empty ``TARGET.tmp`` (a crashed save's left-overs removed); call on one rank."""
    staging = staging_path(target)
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    return staging


def publish(staging: Path, target: Path) -> None:
    """Make the complete ``staging`` directory the checkpoint ``target``; call on one rank."""
    old = previous_path(target)
    if target.is_dir():
        if old.exists():  # a crash after the first rename of an earlier publish: target is the newer one
            shutil.rmtree(old)
        target.rename(old)
    elif target.exists():
        target.unlink()
    staging.rename(target)  # from here the new checkpoint is complete under its name
    if old.exists():
        shutil.rmtree(old)


def complete_checkpoint(target: Path) -> Path:
    """``target``, or ``target.old`` if a save crashed between the two renames of :func:`publish`."""
    old = previous_path(target)
    return old if not target.exists() and old.is_dir() else target
