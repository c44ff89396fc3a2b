"""A checkpoint is never half-written under its final name: single files and directories, killed at each step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightscale.storage import atomic_dir
from lightscale.storage.safe_io import SafeCheckpointIO


def _killed_while(action: Any) -> None:
    """Run ``action`` in a forked child that the kernel-level ``os._exit`` ends part-way, as a kill would."""
    pid = os.fork()
    if pid == 0:
        try:
            action()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _dies_mid_write(obj: Any, file: Any) -> None:
    file.write(b"PK\x03\x04" + b"x" * 4096)  # the start of a zip, as torch.save begins
    file.flush()
    os._exit(1)


def test_a_file_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    SafeCheckpointIO().save_checkpoint({"step": 2, "w": torch.zeros(1000)}, target)

    def save_again() -> None:
        with mock.patch.object(torch, "save", _dies_mid_write):
            SafeCheckpointIO().save_checkpoint({"step": 4, "w": torch.ones(1000)}, target)

    _killed_while(save_again)
    assert SafeCheckpointIO().load_checkpoint(target)["step"] == 2
    SafeCheckpointIO().save_checkpoint({"step": 6}, target)  # a later save replaces the dead one's left-over
    assert SafeCheckpointIO().load_checkpoint(target)["step"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_temporary_file_is_renamed_within_the_target_directory(tmp_path: Path) -> None:
    # A rename across filesystems (Lightning's system-temp file) is a copy, and a copy can be cut short.
    target = tmp_path / "sub" / "last.ckpt"
    with mock.patch.object(os, "replace", wraps=os.replace) as replace:
        SafeCheckpointIO().save_checkpoint({"step": 1}, target)
    (source, destination), _ = replace.call_args
    assert Path(source).parent == target.parent and Path(destination) == target


@pytest.mark.parametrize(
    ("renames", "readable", "lightning_finds"),
    [
        (1, "step 2", {"last.old.ckpt"}),  # previous moved aside, new not yet in: no last.ckpt at all
        (2, "step 4", {"last.ckpt", "last.old.ckpt"}),  # new in place, previous not yet deleted (both complete)
        (3, "step 4", {"last.ckpt"}),  # previous renamed for deletion: invisible to every loader
    ],
)
def test_a_directory_publish_killed_after_each_rename_leaves_a_complete_checkpoint(
    renames: int, readable: str, lightning_finds: set[str], tmp_path: Path
) -> None:
    target = tmp_path / "last.ckpt"
    _write_dir(atomic_dir.start_staging(target), "step 2")
    atomic_dir.publish(atomic_dir.staging_path(target), target)
    _write_dir(atomic_dir.start_staging(target), "step 4")

    def publish_and_die() -> None:
        with mock.patch.object(Path, "rename", _die_after(renames)):
            atomic_dir.publish(atomic_dir.staging_path(target), target)

    _killed_while(publish_and_die)
    assert (atomic_dir.complete_checkpoint(target) / "state").read_text() == readable
    # Lightning's ckpt_path="last" looks for last*.ckpt: it must see only complete checkpoints, and at least one.
    found = ModelCheckpoint(dirpath=tmp_path)._find_last_checkpoints(trainer=None)  # type: ignore[arg-type]
    assert {Path(path).name for path in found} == lightning_finds
    assert all((Path(path) / "state").is_file() for path in found)
    _write_dir(atomic_dir.start_staging(target), "step 6")  # the next save clears every left-over
    atomic_dir.publish(atomic_dir.staging_path(target), target)
    assert (atomic_dir.complete_checkpoint(target) / "state").read_text() == "step 6"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _write_dir(directory: Path, text: str) -> None:
    directory.mkdir(parents=True)
    (directory / "state").write_text(text)


def _die_after(renames: int) -> Any:
    real = Path.rename
    done = []

    def rename(self: Path, target: Any) -> None:
        real(self, target)
        done.append(target)
        if len(done) == renames:
            os._exit(1)

    return rename
