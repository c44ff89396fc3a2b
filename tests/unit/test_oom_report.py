"""The out-of-memory report never replaces the user's error: a live tensor whose storage cannot be read is left out
of its table, and a report that cannot be written is logged while the original error goes on.

Found under two pytest workers: a rank forked from a process that had run other tests met such a tensor among the
objects it inherited, and the user's ``MemoryError`` became ``RuntimeError: Attempted to access the data pointer on
an invalid python storage.``
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightscale.callbacks import MemoryProfiler
from lightscale.callbacks import memory as memory_callback
from lightscale.callbacks.memory_report import top_tensors

INVALID = "Attempted to access the data pointer on an invalid python storage."


class _FreedStorage:
    def data_ptr(self) -> int:
        raise RuntimeError(INVALID)

    def nbytes(self) -> int:
        raise RuntimeError(INVALID)


class FreedTensor(torch.Tensor):
    """A live tensor whose storage is gone (what the forked rank inherited)."""

    def untyped_storage(self) -> Any:  # type: ignore[override]
        return _FreedStorage()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(64, 64)


def test_a_tensor_whose_storage_is_gone_is_left_out_of_the_table() -> None:
    model, trainer = Model(), SimpleNamespace(optimizers=[])
    freed = torch.Tensor._make_subclass(FreedTensor, torch.zeros(3))
    table = top_tensors(model, trainer)  # type: ignore[arg-type]
    assert (64 * 64 * 4, "parameter", "layer.weight") in table
    assert freed is not None


def test_a_report_that_cannot_be_written_is_logged_and_the_error_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fails(*args: Any) -> None:
        raise RuntimeError(INVALID)

    monkeypatch.setattr(memory_callback, "write_oom_report", fails)
    profiler = MemoryProfiler(out_dir=tmp_path)
    trainer = SimpleNamespace(global_rank=0)
    with caplog.at_level(logging.ERROR):
        profiler.on_exception(trainer, Model(), MemoryError("injected"))  # type: ignore[arg-type]
    assert f"the report could not be written (RuntimeError('{INVALID}'))" in caplog.text
    assert not list(tmp_path.iterdir())
