"""Periodic checkpoints in one place: every N steps or every M minutes, keep the K newest.

Lightning's ``ModelCheckpoint`` already does all of it, spread over arguments whose combination is easy to get
wrong for this purpose: keeping K checkpoints needs a monitored value (without one ``save_top_k`` may only be
-1, 0 or 1), and "newest" means monitoring ``step`` with ``mode="max"``. This subclass sets those and nothing
else, so every strategy's saving, removal of old checkpoints and resuming stays Lightning's (and the strategy's).
Files are named ``step=N.ckpt`` (a directory under sharded strategies); ``resume="auto"`` picks the newest.

Example (YAML, under ``trainer.callbacks``):
    - class_path: lightscale.callbacks.PeriodicCheckpoint
      init_args: {dirpath: ckpts, every_n_steps: 500, keep: 3}
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightscale.errors import ConfigurationError


class PeriodicCheckpoint(ModelCheckpoint):
    """Save ``dirpath/step=N.ckpt`` every ``every_n_steps`` optimizer steps or every ``every_minutes`` of training
    (exactly one of the two), keeping the ``keep`` newest (``-1``: all)."""

    def __init__(
        self,
        dirpath: str | Path,
        *,
        every_n_steps: int | None = None,
        every_minutes: float | None = None,
        keep: int = 3,
    ) -> None:
        check_period(every_n_steps, every_minutes, keep)
        super().__init__(
            dirpath=dirpath,
            filename="{step}",
            monitor="step",
            mode="max",
            save_top_k=keep,
            every_n_train_steps=every_n_steps,
            train_time_interval=timedelta(minutes=every_minutes) if every_minutes is not None else None,
        )


def check_period(every_n_steps: int | None, every_minutes: float | None, keep: int) -> None:
    if (every_n_steps is None) == (every_minutes is None):
        raise ConfigurationError(
            f"PeriodicCheckpoint needs exactly one of every_n_steps or every_minutes (got every_n_steps="
            f"{every_n_steps!r}, every_minutes={every_minutes!r})."
        )
    if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
        raise ConfigurationError(f"every_n_steps={every_n_steps!r} is not valid; valid values are integers >= 1.")
    if every_minutes is not None and not every_minutes > 0:
        raise ConfigurationError(f"every_minutes={every_minutes!r} is not valid; valid values are minutes > 0.")
    if not isinstance(keep, int) or (keep < 1 and keep != -1):
        raise ConfigurationError(f"keep={keep!r} is not valid; valid values are integers >= 1, or -1 to keep all.")
