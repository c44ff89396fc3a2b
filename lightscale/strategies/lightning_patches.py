"""Installs lightscale's global patches of Lightning when lightscale's Lightning side is first used, never on import.

``import lightscale`` (and so any ``import lightscale.<module>``, which runs the package's ``__init__`` first) only
registers the strategy names, through Lightning's public ``StrategyRegistry``. The global rebindings
(lightscale/patches/lightning.py) are installed by :func:`patch_lightning`, which runs first thing in every
``LightscaleStrategy`` constructor (a name Lightning resolves through the registry builds one; so does an instance a
user passes), in ``lightscale.Trainer`` before Lightning parses its arguments (so the CLI too), and when a user calls
it: a process that only loads lightscale checkpoints with plain Lightning, or wants lightscale's names in plain
``lightning.Trainer``'s unknown-strategy error, calls ``lightscale.patch_lightning()`` once. Nothing reaches those
patched callables before one of these points: Lightning checks a strategy name in its accelerator connector, inside
``Trainer(...)``, and reads checkpoints in ``load_from_checkpoint`` or ``fit/validate/test/predict(ckpt_path=...)``.

Example:
    >>> import lightscale
    >>> lightscale.patch_lightning()  # once per process: Lightning's loaders then read lightscale directories
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
