"""``resume="auto"``: the newest complete checkpoint of the run, never a staging left-over; clear errors when the
run could never find its checkpoints; an explicit ckpt_path wins; periodic checkpointing in one place."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
from helpers import TINY
from lightning.pytorch.callbacks import ModelCheckpoint

import lightscale
from lightscale.callbacks import PeriodicCheckpoint
from lightscale.checkpoint.resume import newest_checkpoint, resolve_resume
from lightscale.cli import main, resolve_resume_args
from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPTDataModule, GPTModule
from lightscale.storage.safe_io import SafeCheckpointIO


def _make(path: Path, mtime: int, *, directory: bool = False) -> Path:
    if directory:
        path.mkdir()
        (path / "shard").write_bytes(b"x")
    else:
        path.write_bytes(b"x")
    os.utime(path, ns=(mtime, mtime))
    return path


def test_newest_complete_checkpoint_skips_staging_left_overs(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "absent") is None
    assert newest_checkpoint(tmp_path) is None
    _make(tmp_path / "step=2.ckpt", 1_000, directory=True)
    expected = _make(tmp_path / "step=4.ckpt", 2_000)
    # Newer, but each one a killed save's left-over, an empty directory or not a checkpoint at all.
    _make(tmp_path / "step=6.ckpt.tmp", 3_000, directory=True)
    _make(tmp_path / "step=6.ckpt.partial", 3_000)
    _make(tmp_path / "last.ckpt.trash", 3_000, directory=True)
    (tmp_path / "step=8.ckpt").mkdir()
    _make(tmp_path / "notes.txt", 4_000)
    assert newest_checkpoint(tmp_path) == expected
    # A save killed between the two renames of a directory swap: the previous copy is complete and counts.
    newest = _make(tmp_path / "last.old.ckpt", 5_000, directory=True)
    assert newest_checkpoint(tmp_path) == newest


def test_explicit_ckpt_path_wins_and_nothing_found_starts_fresh(tmp_path: Path) -> None:
    _make(tmp_path / "last.ckpt", 1_000)
    with mock.patch("lightscale.checkpoint.resume.rank_zero_info") as info:
        assert resolve_resume("auto", "other.ckpt", tmp_path) == "other.ckpt"
        assert resolve_resume(None, None, tmp_path) is None
        assert resolve_resume("never", None, tmp_path) is None
        assert resolve_resume("auto", None, tmp_path) == str(tmp_path / "last.ckpt")
        assert resolve_resume("auto", None, tmp_path / "empty") is None
    said = [call.args[0] for call in info.call_args_list]
    assert "explicit ckpt_path='other.ckpt' wins" in said[0]
    assert "found no complete checkpoint" in said[-1] and "starting fresh" in said[-1]


def _trainer(**kwargs: object) -> lightscale.Trainer:
    return lightscale.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resume": "latest"}, r"resume='latest' is not valid; valid values are \['auto', 'never'\] or None"),
        ({"resume": "auto", "enable_checkpointing": False}, r"no ModelCheckpoint is configured"),
        (
            {
                "resume": "auto",
                "callbacks": [ModelCheckpoint("a"), ModelCheckpoint("b", every_n_train_steps=5)],
                "logger": False,
            },
            r"needs one checkpoint directory, but the ModelCheckpoint callbacks write to \[.*/a', .*/b'\]",
        ),
        ({"resume": "auto"}, r"needs ModelCheckpoint\(dirpath=...\).*version_N directory"),  # default logger
    ],
)
def test_resume_auto_that_could_never_find_its_checkpoints_is_refused_at_construction(
    kwargs: dict, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        _trainer(default_root_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"exactly one of every_n_steps or every_minutes"),
        ({"every_n_steps": 5, "every_minutes": 1.0}, r"exactly one of every_n_steps or every_minutes"),
        ({"every_n_steps": 0}, r"every_n_steps=0 is not valid; valid values are integers >= 1"),
        ({"every_minutes": -2.0}, r"every_minutes=-2.0 is not valid; valid values are minutes > 0"),
        ({"every_n_steps": 5, "keep": 0}, r"keep=0 is not valid; valid values are integers >= 1, or -1"),
    ],
)
def test_periodic_checkpoint_refuses_bad_periods(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PeriodicCheckpoint("ckpts", **kwargs)


def test_cli_resume_flag_is_the_trainer_argument() -> None:
    argv = ["fit", "--config", "x.yaml", "--resume", "auto", "--resume=never"]
    assert resolve_resume_args(argv) == [
        "fit",
        "--config",
        "x.yaml",
        "--trainer.resume",
        "auto",
        "--trainer.resume=never",
    ]


class _FirstStep(pl.Callback):
    def __init__(self) -> None:
        self.first: int | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.first is None:
            self.first = trainer.global_step


def _fit(tmp_path: Path, cache: str, max_steps: int) -> _FirstStep:
    pl.seed_everything(1234, verbose=False)
    first = _FirstStep()
    saver = PeriodicCheckpoint(tmp_path / "ckpts", every_n_steps=2, keep=2)
    trainer = _trainer(
        max_steps=max_steps,
        logger=False,
        callbacks=[saver, first],
        resume="auto",
        limit_val_batches=0,
        plugins=[SafeCheckpointIO()],  # lightscale's strategies use it; Lightning's single device does not
    )
    trainer.fit(GPTModule(TINY), GPTDataModule(block_size=TINY.block_size, batch_size=2, cache_dir=cache))
    return first


def test_resume_auto_continues_from_the_newest_and_keeps_k(tmp_path: Path, corpus_cache: str) -> None:
    assert _fit(tmp_path, corpus_cache, max_steps=6).first == 0  # nothing there: from scratch
    assert sorted(path.name for path in (tmp_path / "ckpts").iterdir()) == ["step=4.ckpt", "step=6.ckpt"]
    assert _fit(tmp_path, corpus_cache, max_steps=8).first == 6  # the same command again: from step 6
    assert sorted(path.name for path in (tmp_path / "ckpts").iterdir()) == ["step=6.ckpt", "step=8.ckpt"]


def test_cli_refuses_a_bad_resume_value_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"error: resume='latest' is not valid; valid values are \['auto', 'never'\]"):
        main(["fit", "--config", "gpt/tiny_ddp.yaml", "--resume", "latest", "--trainer.logger", "false"])
