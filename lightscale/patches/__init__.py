"""Every runtime rebinding of a Lightning, DeepSpeed, torch or litdata name, in one place, each with why and what
would replace it upstream.

The rest of lightscale calls these functions and never assigns to, shadows or wraps an upstream name itself (a
static test checks it). Each module keeps a ``PATCHES`` table: what is touched, whether globally (for the whole
process) or on one object, why, the upstream change that would remove it, and the parameters of each wrapped
callable, which tests/unit/test_private_apis.py pins with ``inspect.signature`` so an upgrade fails a test, not a run.
docs/architecture.md, "Upstream patches", is this table.

Example:
    >>> from lightscale.patches import all_patches
    >>> sorted({p.scope for p in all_patches()})
    ['environment', 'global', 'instance']
"""

from __future__ import annotations

from lightscale.patches import deepspeed, lightning, litdata, torch_internals
from lightscale.patches.table import Patch

__all__ = ["Patch", "all_patches"]


def all_patches() -> list[Patch]:
    return [*lightning.PATCHES, *deepspeed.PATCHES, *torch_internals.PATCHES, *litdata.PATCHES]
