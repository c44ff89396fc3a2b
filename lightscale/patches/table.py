"""One row of the upstream-patch table (lightscale/patches/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Patch:
    """``target``: what is rebound, shadowed, read or written. ``signature``: ``("module:qualname", parameter names)``
    of a callable lightscale wraps or calls by position, as it relies on them. ``attributes``: ``("module:qualname" of
    a class, names)`` of private attributes lightscale reads or writes on its instances. tests/unit/test_private_apis.py
    pins both against the installed release."""

    target: str
    scope: Literal["global", "instance", "environment", "read"]  # read: a private name read or called, not rebound
    why: str
    upstream: str
    signature: tuple[str, tuple[str, ...]] | None = None
    attributes: tuple[str, tuple[str, ...]] | None = None
