"""``fit_memory``: the least-communication strategy whose memory estimate fits the device, chosen at fit time.

When the Trainer attaches the model, the names each strategy class declares ``plannable`` are estimated for this
model, world size, precision and micro-batch (the data module's ``batch_size``); the table is printed, and this
strategy object becomes the chosen one (its class and state, keeping what the Trainer already gave it: devices, cluster
environment, precision and checkpoint plugins, launcher). The name avoids Lightning's ``"auto"``, which picks by
hardware, not by memory.

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
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.registry import plan_candidates

# What the Trainer's connector set on this object before fit; the chosen strategy keeps it.
_CONNECTED = (
    "_accelerator",
    "_precision_plugin",
    "_checkpoint_io",
    "cluster_environment",
    "_parallel_devices",
    "_num_nodes",
    "_layer_sync",
    "_launcher",
    "_timeout",
    "_backend",
    "check_batches_every",  # the user's, given to fit_memory
)


class FitMemoryStrategy(LightscaleStrategy):
    """Becomes the least-communication candidate that fits ``memory_budget`` (see the module docstring).

    Args:
        memory_budget: device bytes per rank (a number or a size such as ``"40GiB"``); default: the GPU's memory,
            or on CPU the machine's memory shared by the local ranks.
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.
    """

    parameter_view = "flat"  # it may become ZeRO; once chosen, that class checks (lightscale/optim/rule.py)
    aliases = {
        "fit_memory": ("the least-communication strategy whose memory estimate fits the device (lightscale plan)", {})
    }

    @override
    def memory_layout(self, world_size: int) -> Layout:
        raise ConfigurationError(
            "fit_memory chooses its strategy when training starts: `lightscale plan` prints the candidates and its "
            "choice; estimate one of them by name (e.g. --trainer.strategy zero3)."
        )

    def __init__(self, *, memory_budget: float | str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.memory_budget = parse_bytes(memory_budget) if isinstance(memory_budget, str) else memory_budget
        self.plan_table = ""

    @override
    def connect(self, model: LightningModule) -> None:  # type: ignore[override]
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
        table = self.plan_table
        self._become(_build(chosen.strategy, chosen.activation_checkpointing))
        self.plan_table = table
        self.connect(model)  # the chosen class's connect

    def _become(self, strategy: LightscaleStrategy) -> None:
        kept = {name: self.__dict__[name] for name in _CONNECTED if name in self.__dict__}
        self.__class__ = type(strategy)  # type: ignore[assignment]
        self.__dict__.clear()
        self.__dict__.update({**strategy.__dict__, **kept})


def _build(name: str, activation_checkpointing: str) -> LightscaleStrategy:
    entry = StrategyRegistry[name]
    kwargs = dict(entry["init_params"])
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
