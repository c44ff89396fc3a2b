"""Installs lightscale's global patches of Lightning: on ``import lightscale``, and again (idempotently) first thing
in every ``LightscaleStrategy`` constructor and in ``lightscale.Trainer``.

Lightning runs none of lightscale's code before it checks a strategy name inside ``Trainer(...)`` or reads a
checkpoint in ``load_from_checkpoint`` / ``ckpt_path=``, so the import is the one point lightscale has: a notebook or
serving process that only loads lightscale checkpoint directories, or mistypes a name in plain
``lightning.Trainer(strategy=...)``, needs nothing more than ``import lightscale``. Python runs the package's
``__init__`` before any of its modules, so importing a torch-only building block (``lightscale.parallel.mesh``)
installs them too: the rebindings only add lightscale's directories and names to what Lightning accepts
(lightscale/patches/lightning.py lists each with its reason), and telling the imports apart would mean reading
CPython's import frames.

Example:
    >>> import lightscale  # Lightning's loaders now read lightscale directories
    >>> model = MyModel.load_from_checkpoint("checkpoints/last.ckpt")
"""

from __future__ import annotations

from lightscale.checkpoint.lightning_load import install_lightning_loading
from lightscale.patches.lightning import check_strategy_names
from lightscale.strategies.names import check_strategy


def patch_lightning() -> None:
    """Install every global Lightning patch lightscale makes (idempotent; see the module docstring):
    plain ``lightning.Trainer(strategy=NAME)`` names lightscale's strategies and the closest match for an unknown
    name; ``Model.load_from_checkpoint`` and Lightning's own strategies read lightscale checkpoint directories, and
    check the run's optimizers against the checkpoint's before loading their state."""
    check_strategy_names(check_strategy)
    install_lightning_loading()
