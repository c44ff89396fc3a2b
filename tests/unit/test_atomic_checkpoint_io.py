"""A checkpoint is never half-written under its final name: single files and directories, killed at each step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from lightscale.plugins import atomic_dir
from lightscale.plugins.checkpoint import SafeCheckpointIO


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


def test_a_directory_publish_killed_between_its_renames_leaves_the_old_checkpoint_readable(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    _write_dir(atomic_dir.start_staging(target), "step 2")
    atomic_dir.publish(atomic_dir.staging_path(target), target)
    _write_dir(atomic_dir.start_staging(target), "step 4")

    def publish_then_die_after_first_rename() -> None:
        with mock.patch.object(Path, "rename", _rename_once_then_die()):
            atomic_dir.publish(atomic_dir.staging_path(target), target)

    _killed_while(publish_then_die_after_first_rename)
    assert not target.exists()  # the moment with no target: loaders must find the previous one
    assert (atomic_dir.complete_checkpoint(target) / "state").read_text() == "step 2"
    _write_dir(atomic_dir.start_staging(target), "step 6")  # the next save finishes the job
    atomic_dir.publish(atomic_dir.staging_path(target), target)
    assert (atomic_dir.complete_checkpoint(target) / "state").read_text() == "step 6"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def _write_dir(directory: Path, text: str) -> None:
    directory.mkdir(parents=True)
    (directory / "state").write_text(text)


def _rename_once_then_die() -> Any:
    real = Path.rename

    def rename(self: Path, target: Any) -> None:
        real(self, target)
        os._exit(1)

    return rename
