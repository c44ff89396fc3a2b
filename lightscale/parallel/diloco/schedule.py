"""When each fragment syncs: the model split into ``k`` contiguous fragments of similar size, staggered in time.

Fragment ``i`` sends at the inner steps ``s`` (counted from 1) with ``(s - i * H / k) % H == 0``, so over any ``H``
consecutive steps every fragment sends exactly once and the sends are spread evenly. Its result is applied
``overlap_steps`` later (0: at once), so the collective runs during those inner steps.

Example:
    >>> schedule = Schedule(sync_every=4, fragments=2, overlap_steps=1)
    >>> [schedule.sends_at(step) for step in range(1, 7)]
    [[], [1], [], [0], [], [1]]
    >>> split_fragments([10, 10, 5, 5], 2)
    [[0], [1, 2, 3]]
"""

from __future__ import annotations

from dataclasses import dataclass

from lightscale.errors import ConfigurationError


@dataclass(frozen=True)
class Schedule:
    """Sync period ``H``, fragment count ``k`` and how many inner steps a fragment's collective may overlap."""

    sync_every: int
    fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ConfigurationError(f"sync_every={self.sync_every!r} is not valid; it must be an integer >= 1.")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ConfigurationError(f"fragments={self.fragments!r} is not valid; it must be an integer >= 1.")
        if self.sync_every % self.fragments:
            divisors = [d for d in range(1, self.sync_every + 1) if self.sync_every % d == 0]
            raise ConfigurationError(
                f"fragments={self.fragments} does not divide sync_every={self.sync_every}, so the fragments' syncs "
                f"cannot be evenly staggered; choose fragments from {divisors}."
            )
        if not isinstance(self.overlap_steps, int) or not 0 <= self.overlap_steps < self.sync_every:
            raise ConfigurationError(
                f"overlap_steps={self.overlap_steps!r} is not valid; it must be an integer in [0, sync_every - 1] = "
                f"[0, {self.sync_every - 1}] (a fragment's result must land before that fragment sends again)."
            )

    def offset(self, fragment: int) -> int:
        return fragment * self.sync_every // self.fragments

    def sends_at(self, step: int) -> list[int]:
        """The fragments whose pseudo-gradient is sent right after inner step ``step``."""
        return [i for i in range(self.fragments) if (step - self.offset(i)) % self.sync_every == 0]


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of the tensors in each of ``fragments`` contiguous groups of similar total size (none empty)."""
    if fragments > len(sizes):
        raise ConfigurationError(
            f"fragments={fragments} is more than the {len(sizes)} parameter tensors to split; choose fragments "
            f"<= {len(sizes)}."
        )
    total, running, groups = max(sum(sizes), 1), 0, [[] for _ in range(fragments)]
    previous = 0
    for index, size in enumerate(sizes):
        share = int((running + size / 2) * fragments // total)  # the share the tensor's midpoint falls in
        # Never go back, never skip a fragment, and leave at least one tensor for each fragment still empty.
        group = max(min(share, previous + 1 if index else 0), previous, fragments - (len(sizes) - index))
        groups[group].append(index)
        running, previous = running + size, group
    return groups
