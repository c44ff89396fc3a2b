"""A stateful training loader's saved position: after the batches trained, not after Lightning's look-ahead.

Lightning saves the ``state_dict()`` of stateful loaders (torchdata's ``StatefulDataLoader``, litdata's
``StreamingDataLoader``) in its checkpoints. A loader without ``len`` (a stream) it reads one batch ahead
(``_PrefetchDataFetcher``, to know which batch is the last), so a checkpoint written after batch ``n`` holds the
position after batch ``n + 1``: resumed, that batch is never trained. lightscale strategies wrap such a loader in
:class:`TrainedPosition`, whose ``state_dict()`` is the state taken right after batch ``n`` was handed out (the one
before the newest, or the newest once the loader ran out, when nothing was read ahead). Sized loaders are not read
ahead and stay as they are.

Example:
    >>> loader = maybe_track_trained_position(StatefulDataLoader(hf_stream, batch_size=8), training=True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.types import _Stateful

_OWN = ("loader", "_states", "_exhausted")


class TrainedPosition:
    """Iterates ``loader``; ``state_dict()`` is its state after the batch before the newest one handed out."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._states: deque[dict[str, Any]] = deque(maxlen=2)
        self._exhausted = False

    def __iter__(self) -> Iterator[Any]:
        self._states.clear()
        self._states.append(self.loader.state_dict())  # before the first batch: nothing of this epoch trained
        self._exhausted = False
        for batch in self.loader:
            self._states.append(self.loader.state_dict())
            yield batch
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        if not self._states:
            return self.loader.state_dict()
        # Exhausted: Lightning's look-ahead found the end, so every batch handed out was trained.
        return self._states[-1] if self._exhausted or len(self._states) == 1 else self._states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # batch_size, dataset, ... as the wrapped loader has them
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:  # e.g. Lightning's worker_init_fn: onto the loader
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)


def maybe_track_trained_position(dataloader: object, *, training: bool) -> object:
    """``dataloader`` wrapped in :class:`TrainedPosition` when it is a stateful training loader without ``len``."""
    if training and isinstance(dataloader, _Stateful) and sized_len(dataloader) is None:
        return TrainedPosition(dataloader)
    return dataloader
