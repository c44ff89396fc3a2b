"""``fit_memory``: the least-communication strategy whose memory estimate fits the device, chosen at fit time.

When the Trainer attaches the model, the names each strategy class declares ``plannable`` are estimated for this
model, world size, precision and micro-batch (the data module's ``batch_size``); the table is printed, and the chosen
class is built with this strategy's own arguments (``timeout_s``, ``check_batches_every``, ``async_save``, ...), given
what the Trainer connected to this one through Lightning's public setters (accelerator, precision and checkpoint
plugins, cluster environment, devices, nodes), and put in the Trainer's hands (``trainer.strategy`` is the chosen
object from then on; this one stays a ``FitMemoryStrategy`` and names it in ``chosen``). The name avoids Lightning's
``"auto"``, which picks by hardware, not by memory.

Why at ``connect``: the model is first known there, after Lightning built this strategy from the name and launched the
ranks. Choosing when the Trainer is built would need the model (``Trainer(strategy="fit_memory")`` has none), and a
strategy delegating to the chosen one would not *be* it: Lightning and lightscale ask ``isinstance(trainer.strategy,
...)`` and read class data (precision family, parameter view). Lightning's Trainer has no setter for its strategy and
no public one for ``sync_batchnorm``'s layer sync or the running launcher; those three writes are
lightscale/patches/lightning.py's ``hand_over_strategy``.

Example:
    >>> Trainer(strategy="fit_memory", devices=8)  # the GPU's memory is the budget
    >>> Trainer(strategy=FitMemoryStrategy(memory_budget="300MiB"), accelerator="cpu", devices=2)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import choose, device_budget, format_plan, plan
from lightscale.estimate.report import parse_bytes
from lightscale.patches.lightning import hand_over_strategy
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.registry import plan_candidates


class FitMemoryStrategy(LightscaleStrategy):
    """Hands the Trainer the least-communication candidate that fits ``memory_budget`` (see the module docstring).

    Args:
        memory_budget: device bytes per rank (a number or a size such as ``"40GiB"``); default: the GPU's memory,
            or on CPU the machine's memory shared by the local ranks.
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`; the chosen strategy is built with them.
    """

    parameter_view = "flat"  # it may become ZeRO; once chosen, that class checks (lightscale/optim/rule.py)
    aliases = {
        "fit_memory": ("the least-communication strategy whose memory estimate fits the device (lightscale plan)", {})
    }

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        raise ConfigurationError(
            "fit_memory chooses its strategy when training starts: `lightscale plan` prints the candidates and its "
            "choice; estimate one of them by name (e.g. --trainer.strategy zero3)."
        )

    def __init__(self, *, memory_budget: float | str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory_budget = parse_bytes(memory_budget) if isinstance(memory_budget, str) else memory_budget
        self.plan_table = ""
        self.chosen: LightscaleStrategy | None = None
        self._init_kwargs = kwargs  # the user's settings, for the chosen class

    @override
    def connect(self, model: LightningModule) -> None:  # type: ignore[override]
        if self.chosen is None:
            self.chosen = self._choose(model)
        trainer = model.trainer
        self._connect_chosen(self.chosen)
        self.chosen.check_before_launch(trainer)  # its own checks; the launcher ran fit_memory's (the base class's)
        hand_over_strategy(trainer, self, self.chosen)
        self.chosen.connect(model)

    def _choose(self, model: LightningModule) -> LightscaleStrategy:
        budget = self.memory_budget or device_budget(self.num_processes)
        trainer = model.trainer
        with _untouched(model):  # the estimate builds the model on meta; the real build comes later
            candidates = plan(
                model,
                plan_candidates(),
                world_size=self.num_nodes * self.num_processes,
                budget=budget,
                precision=str(trainer.precision),
                micro_batch=int(getattr(trainer.datamodule, "batch_size", 1) or 1),
            )
        self.plan_table = format_plan(candidates, budget=budget)
        chosen = choose(candidates)
        if chosen is None:
            raise ConfigurationError(f"strategy='fit_memory': no candidate fits.\n{self.plan_table}")
        rank_zero_info(self.plan_table)
        return _build(chosen.strategy, chosen.activation_checkpointing, self._init_kwargs)

    def _connect_chosen(self, chosen: LightscaleStrategy) -> None:
        """What Lightning's accelerator connector gave this strategy, given to ``chosen`` through the same public
        setters the connector uses (``_lazy_init_strategy``); ranks recomputed from them."""
        chosen.accelerator = self.accelerator
        chosen.precision_plugin = self.precision_plugin
        chosen.checkpoint_io = self.checkpoint_io
        chosen.cluster_environment = self.cluster_environment
        chosen.parallel_devices = self.parallel_devices
        chosen.num_nodes = self.num_nodes
        chosen.set_world_ranks()


def _build(name: str, activation_checkpointing: str, init_kwargs: dict[str, Any]) -> LightscaleStrategy:
    entry = StrategyRegistry[name]
    kwargs = {**entry["init_params"], **init_kwargs}
    if activation_checkpointing != "none":
        kwargs["activation_checkpointing"] = activation_checkpointing
    return entry["strategy"](**kwargs)


@contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Undo what building the model (on meta) adds to ``module``: its attributes and child tables."""
    state = dict(module.__dict__)
    tables = {key: dict(value) for key, value in state.items() if key in ("_modules", "_parameters", "_buffers")}
    try:
        yield
    finally:
        module.__dict__.clear()
        module.__dict__.update({**state, **tables})
