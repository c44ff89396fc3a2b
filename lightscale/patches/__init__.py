"""Every runtime rebinding of a Lightning, DeepSpeed, torch or litdata name, every process-wide write (environment,
``sys.excepthook``, ``sys.argv``, Lightning's rank-zero rank, attributes swapped on the user's module) and every
private upstream name read, in one table, each with why and what would replace it upstream.

The rest of lightscale calls these functions and never assigns to, shadows or wraps an upstream name or process state
itself, nor reads a private name no row names (tests/unit/test_private_apis.py reads every module's syntax tree).
Each module keeps a ``PATCHES`` table: what is touched, whether globally (for the whole
process) or on one object, why, the upstream change that would remove it, and the parameters of each wrapped
callable, which tests/unit/test_private_apis.py pins with ``inspect.signature`` so an upgrade fails a test, not a run.
docs/architecture.md, "Upstream patches", is this table.

Example:
    >>> from lightscale.patches import all_patches
    >>> sorted({p.scope for p in all_patches()})
    ['environment', 'global', 'instance', 'read']
"""

from __future__ import annotations

from lightscale.patches import deepspeed, lightning, litdata, private_reads, process, torch_internals
from lightscale.patches.table import Patch

__all__ = ["Patch", "all_patches"]


def all_patches() -> list[Patch]:
    return [
        *lightning.PATCHES,
        *deepspeed.PATCHES,
        *torch_internals.PATCHES,
        *litdata.PATCHES,
        *process.PATCHES,
        *private_reads.PATCHES,
    ]
