"""Lightning's model summary with honest totals under every strategy.

Lightning counts ``p.numel()`` of each local parameter, which is 0 for a DeepSpeed ZeRO-3 partition, and counts FLOPs
only by running ``example_input_array``, so it prints ``0 Params`` under ZeRO-3 and ``0 Total Flops`` for most
models. :class:`ModelSummary` (installed by ``lightscale.Trainer`` in place of Lightning's) counts each parameter's
global size as the strategy answers it (lightscale/strategies/shards.py ``global_numel``: the full size of a ZeRO-3
partition, the global shape of an FSDP2/TP shard (DTensor), the declared shape on the meta device); and takes the
total FLOPs from the module's ``flops_per_batch`` when it declares one (the GPT, ViT and CLIP recipes do: one
training step, forward and backward, of the batch size they assume until the first batch arrives), else from
Lightning's count.

Example:
    >>> Trainer(callbacks=[ModelSummary(max_depth=2)])  # lightscale.Trainer installs ModelSummary() by default
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary
from torch import Tensor, nn
from typing_extensions import override

from lightscale.strategies.shards import shards_of


def global_numel(parameter: nn.Parameter, strategy: object = None) -> int:
    """Elements of the whole parameter, whichever rank holds which part, as ``strategy`` answers it (0 if its shape
    is not known yet)."""
    return shards_of(strategy).global_numel(parameter)


def declared_flops(module: nn.Module) -> int | None:
    """The module's ``flops_per_batch`` (the attribute the throughput callbacks read), or None."""
    flops = getattr(module, "flops_per_batch", None)
    return int(flops) if isinstance(flops, (int, float)) and flops > 0 else None


class GlobalLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, numel: Callable[[Tensor], int]) -> None:
        self.numel = numel  # before Lightning's __init__, which may read num_parameters
        super().__init__(module)

    @property
    @override
    def num_parameters(self) -> int:
        return sum(self.numel(p) for p in self._module.parameters())


class GlobalSummary(Summary):
    """Lightning's summary table with global parameter counts (``strategy``'s answer: the trainer's) and the
    module's declared FLOPs."""

    def __init__(self, model: pl.LightningModule, *args: Any, strategy: object = None, **kwargs: Any) -> None:
        self.numel = shards_of(strategy).global_numel  # before Lightning's __init__, which summarizes
        super().__init__(model, *args, **kwargs)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary = OrderedDict((name, GlobalLayerSummary(module, self.numel)) for name, module in self.named_modules)
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:  # as Lightning does: drop entries deeper than max_depth
            for name in [name for name in summary if name.count(".") >= self._max_depth]:
                del summary[name]
        return summary  # type: ignore[return-value]

    @property
    @override
    def total_parameters(self) -> int:
        return sum(self.numel(p) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(self.numel(p) for p in self._model.parameters() if p.requires_grad)

    @property
    @override
    def total_flops(self) -> int:
        declared = declared_flops(self._model)
        return declared if declared is not None else super().total_flops


class ModelSummary(LightningModelSummary):
    """Lightning's ``ModelSummary`` callback, counting parameters and FLOPs as :class:`GlobalSummary` does."""

    @override
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        return GlobalSummary(pl_module, max_depth=self._max_depth, strategy=trainer.strategy)


def with_global_summary(callbacks: list[Any], *, enabled: bool) -> list[Any]:
    """``callbacks`` with Lightning's own ModelSummary replaced by lightscale's (same depth), or lightscale's
    added when none is there and the summary is enabled; a subclass the user chose (RichModelSummary) is kept."""
    swapped = [
        ModelSummary(cb._max_depth, **cb._summarize_kwargs) if type(cb) is LightningModelSummary else cb
        for cb in callbacks
    ]
    if enabled and not any(isinstance(cb, LightningModelSummary) for cb in swapped):
        swapped.append(ModelSummary())
    return swapped
