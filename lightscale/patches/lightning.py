"""Lightning names lightscale rebinds or shadows, where Lightning's call order leaves no public hook.

Example:
    >>> check_strategy_names(check_strategy)  # plain lightning.Trainer(strategy="zero3_ofload") names the closest
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.fabric.plugins.io.torch_io as torch_io
import lightning.pytorch.core.saving as saving
from lightning.fabric.utilities.data import _replace_dunder_methods
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
from torch.utils.data import BatchSampler, DataLoader

from lightscale.patches.table import Patch

_MARK = "__lightscale_patch__"
_LOAD = ("path_or_url", "map_location", "weights_only")
_SHADOWED = ("_swap_models", "_copy_average_to_current", "on_save_checkpoint", "on_load_checkpoint")

PATCHES = [
    Patch(
        "_AcceleratorConnector._check_config_and_set_final_flags",
        "global",
        "plain lightning.Trainer(strategy=NAME) with an unknown name lists Lightning's names only; lightscale's check "
        "(all names, the closest match) runs first, a known name takes Lightning's path unchanged",
        "a hook for registries to validate names, or the registry's own error listing every registered name",
        signature=(
            "lightning.pytorch.trainer.connectors.accelerator_connector:_AcceleratorConnector._check_config_and_set_final_flags",
            ("self", "strategy", "accelerator", "precision", "plugins", "sync_batchnorm"),
        ),
    ),
    Patch(
        "lightning.pytorch.core.saving:pl_load",
        "global",
        "Model.load_from_checkpoint(DIR) reads a lightscale checkpoint directory; files load weights-only with "
        "lightscale's allow-list",
        "a CheckpointIO argument to load_from_checkpoint, or a registry of checkpoint formats by path",
        signature=("lightning.pytorch.core.saving:pl_load", _LOAD),
    ),
    Patch(
        "lightning.fabric.plugins.io.torch_io:pl_load",
        "global",
        "Trainer.fit(ckpt_path=DIR) under Lightning's own strategies reads a lightscale checkpoint directory",
        "the same registry of checkpoint formats",
        signature=("lightning.fabric.plugins.io.torch_io:pl_load", _LOAD),
    ),
    Patch(
        "lightning.pytorch.strategies.strategy:Strategy.load_optimizer_state_dict",
        "global",
        "torch checks only group sizes: another optimizer class or order would load silently; the run's optimizers "
        "are compared with the ones the checkpoint recorded first",
        "Lightning recording optimizer classes in its checkpoint and checking them on load",
        signature=("lightning.pytorch.strategies.strategy:Strategy.load_optimizer_state_dict", ("self", "checkpoint")),
    ),
    Patch(
        "WeightAveraging._average_model, _use_buffers, _kwargs",
        "instance",
        "the callback builds its AveragedModel from the unsharded module before the strategy shards it; it is "
        "replaced by an average of this rank's local shards, built with the callback's own settings",
        "a WeightAveraging hook that builds the average after the strategy's setup, from what the strategy holds",
        attributes=("lightning.pytorch.callbacks:WeightAveraging", ("_average_model", "_use_buffers", "_kwargs")),
    ),
    *(
        Patch(
            f"WeightAveraging.{name}",
            "instance",
            "Lightning's version zips pl_module.parameters() (shards, empty ZeRO-3 placeholders) with the full copy; "
            "the shadow works on the local shards (the callback's class untouched)",
            "the same hook: swap and checkpoint through the averaged model's own tensors",
            signature=(
                f"lightning.pytorch.callbacks:WeightAveraging.{name}",
                ("self", "pl_module") if name.startswith("_") else ("self", "trainer", "pl_module", "checkpoint"),
            ),
        )
        for name in _SHADOWED
    ),
    Patch(
        "Trainer._results.log (_ResultCollection.log)",
        "instance",
        "under context parallelism self.log(loss) inside training_step is this rank's mean over its own tokens; for "
        "one step call, values logged without sync_dist are reduced over the cp group",
        "a strategy hook to reduce logged values over a group of its choice",
        signature=(
            "lightning.pytorch.trainer.connectors.logger_connector.result:_ResultCollection.log",
            (
                "self",
                "fx",
                "name",
                "value",
                "prog_bar",
                "logger",
                "on_step",
                "on_epoch",
                "reduce_fx",
                "enable_graph",
                "sync_dist",
                "sync_dist_fn",
                "sync_dist_group",
            ),
        ),
        attributes=("lightning.pytorch.trainer.trainer:Trainer", ("_results",)),
    ),
    Patch(
        "Trainer._data_connector._prepare_dataloader",
        "instance",
        "Lightning re-creates a user's DataLoader (a subclass with its own constructor arguments too) with its "
        "DistributedSampler outside the context that records constructor arguments; the strategy then re-creates "
        "that copy with its ExactlyOnceSampler and needs them: the re-creation runs inside Lightning's own context",
        "Lightning re-creating loaders inside _replace_dunder_methods, or a strategy hook choosing the sampler",
        signature=(
            "lightning.pytorch.trainer.connectors.data_connector:_DataConnector._prepare_dataloader",
            ("self", "dataloader", "shuffle", "mode"),
        ),
        attributes=("lightning.pytorch.trainer.trainer:Trainer", ("_data_connector",)),
    ),
    Patch(
        "Trainer._accelerator_connector.strategy",
        "instance",
        "fit_memory chooses its strategy at connect, when the model is first known, after Lightning built fit_memory "
        "from the name; the Trainer holds the chosen strategy object from then on (Trainer.strategy has no setter)",
        "a Trainer.strategy setter, or a Strategy.connect that may return the strategy to use",
        attributes=("lightning.pytorch.trainer.trainer:Trainer", ("_accelerator_connector",)),
    ),
    Patch(
        "ParallelStrategy._layer_sync, Strategy._launcher (fit_memory's chosen strategy)",
        "instance",
        "the chosen strategy keeps sync_batchnorm's layer sync and the launcher that started this run (rank 0's holds "
        "the other ranks' processes, which it stops on Ctrl-C); neither has a public setter",
        "public setters for layer_sync and launcher, as accelerator and precision_plugin have",
        attributes=("lightning.pytorch.strategies.parallel:ParallelStrategy", ("_layer_sync", "_launcher")),
    ),
]


def check_strategy_names(check: Callable[[Any], None]) -> None:
    """Run ``check(strategy)`` before Lightning's accelerator connector reads the strategy (idempotent)."""
    original = _AcceleratorConnector._check_config_and_set_final_flags
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def checked(self: _AcceleratorConnector, strategy: Any, *args: Any, **kwargs: Any) -> None:
        check(strategy)
        original(self, strategy, *args, **kwargs)

    setattr(checked, _MARK, True)
    _AcceleratorConnector._check_config_and_set_final_flags = checked  # type: ignore[method-assign]


def route_checkpoint_loading(
    wrap_load: Callable[[Callable[..., Any], bool], Callable[..., Any]],
    check_optimizers: Callable[[Strategy, Any], None],
) -> None:
    """Lightning's two checkpoint readers become ``wrap_load(original, optimizer)``, and every strategy's
    ``load_optimizer_state_dict`` calls ``check_optimizers(strategy, checkpoint)`` first (idempotent)."""
    for module, optimizer in ((saving, False), (torch_io, True)):
        if not getattr(module.pl_load, _MARK, False):
            loader = wrap_load(module.pl_load, optimizer)
            setattr(loader, _MARK, True)
            module.pl_load = loader
    original = Strategy.load_optimizer_state_dict
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def load_optimizer_state_dict(self: Strategy, checkpoint: Any) -> None:
        check_optimizers(self, checkpoint)
        original(self, checkpoint)

    setattr(load_optimizer_state_dict, _MARK, True)
    Strategy.load_optimizer_state_dict = load_optimizer_state_dict  # type: ignore[method-assign]


def weight_averaging_settings(callback: WeightAveraging) -> tuple[bool, dict[str, Any]] | None:
    """``(use_buffers, AveragedModel kwargs)`` of a callback that has built its average, else None."""
    if callback._average_model is None:
        return None
    return callback._use_buffers, dict(callback._kwargs)


def give_weight_averaging(callback: WeightAveraging, average: Any, methods: dict[str, Callable[..., Any]]) -> None:
    """Replace the callback's averaged model and shadow its four methods that walk the module (see ``PATCHES``)."""
    assert set(methods) == set(_SHADOWED), sorted(methods)
    callback._average_model = average
    for name, function in methods.items():
        setattr(callback, name, types.MethodType(function, callback))


@contextmanager
def logged_values_synced(trainer: Trainer, reduce: Callable[..., Any], group: Any) -> Iterator[None]:
    """While active, ``self.log(name, value)`` without ``sync_dist`` reduces ``value`` over ``group``."""
    results = trainer._results
    if results is None:
        yield
        return
    log = results.log

    def synced(*args: Any, sync_dist: bool = False, **kwargs: Any) -> None:
        if not sync_dist and not kwargs.get("rank_zero_only", False):
            kwargs.update(sync_dist_fn=reduce, sync_dist_group=group)
            sync_dist = True
        log(*args, sync_dist=sync_dist, **kwargs)

    results.log = synced  # type: ignore[method-assign]
    try:
        yield
    finally:
        del results.log  # the method again


def recreated_loaders_keep_their_arguments(trainer: Trainer) -> None:
    """The loaders Lightning re-creates for ``trainer`` (its DistributedSampler injected) record their constructor
    arguments, as the user's loader did inside ``*_dataloader()``, so the strategy can re-create them once more (see
    ``PATCHES``). Idempotent: one wrapper per trainer, however many fits."""
    connector = trainer._data_connector
    prepare = connector._prepare_dataloader
    if getattr(prepare, _MARK, False):
        return

    @functools.wraps(prepare)
    def recorded(*args: Any, **kwargs: Any) -> object:
        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            return prepare(*args, **kwargs)

    setattr(recorded, _MARK, True)
    connector._prepare_dataloader = recorded  # type: ignore[method-assign]


def hand_over_strategy(trainer: Trainer, connected: ParallelStrategy, chosen: ParallelStrategy) -> None:
    """``trainer.strategy`` becomes ``chosen``, with ``connected``'s layer sync and launcher (see ``PATCHES``); what
    has a public setter (accelerator, plugins, devices) the caller gives ``chosen`` itself."""
    chosen._layer_sync = connected._layer_sync
    chosen._launcher = connected.launcher
    trainer._accelerator_connector.strategy = chosen
