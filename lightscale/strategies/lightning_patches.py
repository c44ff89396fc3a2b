"""Installs lightscale's global patches of Lightning when the package users import is imported, never when only a
torch-only building block is.

``import lightscale`` (or ``from lightscale import Trainer``, or a first import of any module of lightscale's
Lightning side: strategies, checkpoint, callbacks, recipes, the CLI) registers the strategy names through
Lightning's public ``StrategyRegistry`` and installs the global rebindings (lightscale/patches/lightning.py) with
:func:`patch_lightning`: a notebook or serving process that saved nothing then reads lightscale checkpoint
directories with ``Model.load_from_checkpoint`` and plain ``lightning.Trainer(...).validate(ckpt_path=...)``, and
plain ``lightning.Trainer(strategy=NAME)`` names the closest match for a mistyped name. Lightning runs none of
lightscale's code before it checks a name or reads a checkpoint, so the import is the one point lightscale has.

A torch-only building block (the floors below the Lightning side: ``lightscale.parallel``, ``lightscale.runtime``,
``lightscale.optim``, ``lightscale.storage``, ``lightscale.layers`` and the leaf modules beside them) leaves
Lightning as it is: Python runs the package's ``__init__`` before importing any of its modules, so the ``__init__``
asks which import it is running for (:func:`import_being_served`, the one read of CPython's import machinery) and
patches nothing when it is a building block's. Such a process gets the patches when it builds a lightscale strategy
or ``lightscale.Trainer`` (both call :func:`patch_lightning` first thing), or by calling it; a later plain
``import lightscale`` there is Python's no-op (the package is already imported), so a process that imported a building
block first and then loads checkpoints with plain Lightning calls ``lightscale.patch_lightning()`` itself.

Example:
    >>> import lightscale  # Lightning's loaders now read lightscale directories
    >>> model = MyModel.load_from_checkpoint("checkpoints/last.ckpt")
"""

from __future__ import annotations

import sys

from lightscale.checkpoint.lightning_load import install_lightning_loading
from lightscale.patches.lightning import check_strategy_names
from lightscale.strategies.names import check_strategy

# The parts of lightscale below its Lightning side (floors 0-2 in docs/architecture.md and
# tests/unit/test_import_layers.py): importing one of them installs nothing.
BUILDING_BLOCKS = frozenset(
    f"lightscale.{part}"
    for part in (
        "errors",
        "saved_tensors",
        "comm_counter",
        "moved",
        "patches",
        "runtime",
        "storage",
        "layers",
        "resume",
        "parallel",
        "optim",
    )
)


def patch_lightning() -> None:
    """Install every global Lightning patch lightscale makes (idempotent; see the module docstring):
    plain ``lightning.Trainer(strategy=NAME)`` names lightscale's strategies and the closest match for an unknown
    name; ``Model.load_from_checkpoint`` and Lightning's own strategies read lightscale checkpoint directories, and
    check the run's optimizers against the checkpoint's before loading their state."""
    check_strategy_names(check_strategy)
    install_lightning_loading()


def import_being_served(package: str) -> str | None:
    """The module whose import is running ``package``'s ``__init__`` right now: ``lightscale.parallel`` for
    ``import lightscale.parallel.mesh`` (Python imports the parents first), else the importer of the package itself
    (``None`` at top level). Read from the frames of ``importlib._bootstrap._find_and_load_unlocked(name, import_)``
    (CPython 3.10-3.13; tests/unit/test_private_apis.py pins its parameters); if they are not found, ``None``: the
    package is treated as imported for itself and patches, the safe side for a user of its API."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load_unlocked" and code.co_filename.startswith("<frozen importlib"):
            name = frame.f_locals.get("name")
            if name != package:
                return name
        frame = frame.f_back
    return None


def maybe_patch_lightning_on_import(package: str) -> None:
    """Run from ``lightscale/__init__.py``: :func:`patch_lightning`, unless this import is a building block's."""
    served = import_being_served(package) or ""
    if ".".join(served.split(".")[:2]) not in BUILDING_BLOCKS:
        patch_lightning()
