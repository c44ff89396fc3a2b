"""Old home of :mod:`lightscale.data.streams`, kept for a release because the docs showed ``lightscale.streams``.

``lightscale.streams.shard_litdata(...)`` after ``import lightscale`` is the package's own name and stays; importing
this module by its path (``from lightscale.streams import shard_hf``) warns and gives the same functions.
"""

from __future__ import annotations

import warnings

from lightscale.data.streams import shard_hf, shard_litdata

__all__ = ["shard_hf", "shard_litdata"]

warnings.warn(
    "lightscale.streams moved to lightscale.data.streams; import it from there (or use lightscale.streams after "
    "`import lightscale`)",
    DeprecationWarning,
    stacklevel=2,
)
