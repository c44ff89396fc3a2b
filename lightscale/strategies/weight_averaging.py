"""Weight averaging (Lightning's ``WeightAveraging``: EMA, SWA) under every strategy, each rank averaging its shard.

An average is elementwise, so it needs no collective: every rank keeps a copy of its *local shards* only (an FSDP2 or
tensor-parallel DTensor's local tensor, a ZeRO-3 partition, its own pipeline stages and experts, the whole tensor
where the strategy replicates it) and updates it from the same shards of the live model. The average costs one
shard of memory per rank and no gather per update; only a checkpoint save of ZeRO-3 gathers, one tensor at a time,
as the ZeRO-3 save of the weights does (lightscale/strategies/deepspeed/portable_save.py).

Lightning builds the callback's ``AveragedModel`` in ``setup``, before the strategy shards the model, and its
``_swap_models`` / ``_copy_average_to_current`` / checkpoint hooks walk ``pl_module.parameters()`` (DTensors, empty
ZeRO-3 placeholders). :func:`adopt_weight_averaging` runs at the end of the strategy's setup: it replaces the
callback's averaged model by a :class:`ShardAverage` of the local shards and routes those four methods of the callback
instance (its own class and ``should_update`` untouched) through the shard view. This is the one place Lightning's
call order forces a trick here; the user's module is never modified.

The portable checkpoint keeps the raw weights as ``model.*`` (resume and every loader unchanged) and the average
as ``averaged.*``, sharded like the weights (DTensor shards, or whole tensors written once); single files follow
Lightning's own convention (lightscale/checkpoint/averaged.py).

Example (an EMA a user writes on the hooks, under any strategy)::

    class MyEMA(Callback):
        def on_fit_start(self, trainer, pl_module):
            self.ema = [t.clone() for t in trainer.strategy.local_shards(pl_module).values()]

        def on_train_batch_end(self, trainer, pl_module, *args):
            torch._foreach_lerp_(self.ema, list(trainer.strategy.local_shards(pl_module).values()), 0.1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel

from lightscale.checkpoint.averaged import AVERAGED, AVERAGED_META
from lightscale.checkpoint.portable import read_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.patches.lightning import give_weight_averaging, weight_averaging_settings
from lightscale.runtime.collectives import all_gather_single
from lightscale.strategies.shards import shards_of


class HoldsShards(Protocol):
    """What the average asks of the strategy's ``tensor_shards`` (strategies/shards.py; ZeRO: zero_shards.py)."""

    def local_shard(self, tensor: Tensor) -> Tensor: ...

    def after_local_write(self, module: nn.Module) -> None: ...

    def is_flat_slice(self, tensor: Tensor) -> bool: ...

    def global_shape(self, tensor: Tensor) -> torch.Size: ...


def local_shards(module: nn.Module, holder: HoldsShards, *, buffers: bool = True) -> dict[str, Tensor]:
    """The tensors of ``module``'s parameters (then buffers) that this rank holds, by name: writable aliases, by the
    one rule of ``holder.local_shard``."""
    out = {name: holder.local_shard(param) for name, param in module.named_parameters()}
    if buffers:
        out.update((name, holder.local_shard(buffer)) for name, buffer in module.named_buffers())
    return out


class LocalShards(nn.Module):
    """A module whose parameters alias ``tensors`` (no copy): what ``AveragedModel`` averages from and into."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        super().__init__()
        self.names = list(tensors)
        self.shards = nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in tensors.values())


class ShardAverage(AveragedModel):
    """torch's ``AveragedModel`` over this rank's local shards of a module; ``update_parameters(module)`` takes the
    live (sharded) module itself. Built from clones, so it holds exactly one shard of memory."""

    def __init__(self, module: nn.Module, holder: HoldsShards, *, use_buffers: bool, **kwargs: Any) -> None:
        clones = {name: t.clone() for name, t in local_shards(module, holder, buffers=use_buffers).items()}
        super().__init__(LocalShards(clones), use_buffers=True, **kwargs)  # the shards' buffers are its parameters
        self._buffers_too = use_buffers
        self.holder = holder

    def live(self, module: nn.Module) -> list[Tensor]:
        return list(local_shards(module, self.holder, buffers=self._buffers_too).values())

    def shards(self) -> list[Tensor]:
        return [p.detach() for p in self.module.shards]

    def update_parameters(self, model: nn.Module) -> None:  # type: ignore[override]
        super().update_parameters(LocalShards(dict(enumerate(self.live(model)))))  # type: ignore[arg-type]

    def nbytes(self) -> int:
        """Bytes this rank holds for the average (its shards)."""
        return sum(t.numel() * t.element_size() for t in self.shards())


@torch.no_grad()
def swap_into(average: ShardAverage, module: nn.Module, *, keep: bool) -> None:
    """Exchange the average with ``module``'s local shards (``keep=False``: copy it in, keep nothing)."""
    average.holder.after_local_write(module)  # an FSDP2 root left unsharded by an eval forward serves stale weights
    for mine, live in zip(average.shards(), average.live(module), strict=True):
        if keep:
            held = mine.clone()
            mine.copy_(live)
            live.copy_(held)
        else:
            live.copy_(mine)
    average.holder.after_local_write(module)


# ---- the checkpoint: ``averaged.*`` beside ``model.*`` ------------------------------------------------------------
def portable_average(average: ShardAverage, module: nn.Module) -> dict[str, Tensor]:
    """The average in the portable layout, under the names of ``module.state_dict()`` (tied aliases and persistent
    buffers as ``model.*`` has them): a DTensor where the weight is one, a whole tensor elsewhere; a ZeRO-3
    partition is gathered one tensor at a time and kept by its owner only. A buffer the callback does not average
    (``use_buffers=False``) is saved as it is."""
    shards = dict(zip(average.module.names, average.shards(), strict=True))
    by_id = {id(t): shards[name] for name, t in _named_tensors(module) if name in shards}
    out: dict[str, Tensor] = {}
    gathered: dict[int, Tensor | None] = {}
    for index, (name, live) in enumerate(module.state_dict(keep_vars=True).items()):
        shard = by_id.get(id(live), average.holder.local_shard(live))
        if isinstance(live, DTensor):
            out[name] = DTensor.from_local(
                shard, live.device_mesh, live.placements, shape=live.shape, stride=live.stride(), run_check=False
            )
        elif average.holder.is_flat_slice(live):
            if id(live) not in gathered:  # collective: every rank, in the same order; the owner keeps it
                whole = _gather_slices(shard, average.holder.global_shape(live))
                gathered[id(live)] = whole if index % dist.get_world_size() == dist.get_rank() else None
            if gathered[id(live)] is not None:
                out[name] = gathered[id(live)]
        else:
            out[name] = shard
    return out


def _named_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _gather_slices(shard: Tensor, shape: torch.Size) -> Tensor:
    gathered = shard.new_empty(shard.numel() * dist.get_world_size())
    all_gather_single(gathered, shard.contiguous())
    return gathered[: shape.numel()].view(shape).cpu().clone()


def load_portable_average(average: ShardAverage, module: nn.Module, read: Callable[[dict], None]) -> None:
    """Fill the average in place from a checkpoint: ``read(template)`` fills ``{"averaged": {name: tensor}}``
    (DCP reshards); a ZeRO-3 partition reads its whole tensor, one at a time, and keeps its slice."""
    template = {}
    partitions = []
    params = dict(_named_tensors(module))
    saved = set(module.state_dict(keep_vars=True))  # non-persistent buffers are not saved: they keep their copy
    for name, shard in zip(average.module.names, average.shards(), strict=True):
        if name not in saved:
            continue
        live = params[name]
        if isinstance(live, DTensor):
            template[name] = DTensor.from_local(
                shard, live.device_mesh, live.placements, shape=live.shape, stride=live.stride(), run_check=False
            )
        elif average.holder.is_flat_slice(live):
            partitions.append((name, shard, live))
        else:
            template[name] = shard
    read({"averaged": template})
    for name, shard, live in partitions:
        whole = torch.empty(average.holder.global_shape(live), dtype=shard.dtype)
        read({"averaged": {name: whole}})
        start = dist.get_rank() * shard.numel()
        piece = whole.reshape(-1)[start : start + shard.numel()]
        shard[: piece.numel()].copy_(piece)
    average.holder.after_local_write(module)


def _from_lightning_file(average: ShardAverage, module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Lightning's own single file (its WeightAveraging, on a strategy holding whole weights; lightscale loads such
    files into unsharded models only): ``state_dict``, already loaded into ``module``, is the average and
    ``current_model_state`` the raw weights."""
    with torch.no_grad():
        for mine, live in zip(average.shards(), average.live(module), strict=True):
            mine.copy_(live)
    module.load_state_dict(checkpoint["current_model_state"])
    average.n_averaged.fill_(int(checkpoint["averaging_state"]["n_averaged"]))


def drop_average(checkpoint: dict[str, Any], why: str) -> None:
    """For a checkpoint format that keeps no average: leave it out, so a resume restarts it instead of failing."""
    if checkpoint.pop(AVERAGED_META, None) is not None:
        checkpoint.pop(AVERAGED, None)
        rank_zero_warn(f"{why}: a resumed run restarts the WeightAveraging average from the loaded weights.")


# ---- Lightning's callback, routed through the shards ---------------------------------------------------------------
def refuse_stochastic_weight_averaging(trainer: Trainer, strategy: str, *, runs_it: bool) -> None:
    """Refuse Lightning's ``StochasticWeightAveraging`` before training where it cannot run (``runs_it`` False): it
    copies the whole unsharded model, zips its parameters with the live ones (FSDP2's DTensors, ZeRO's partitions)
    and puts ``SWALR`` on the optimizer (DeepSpeed's is not a torch Optimizer). Lightning refuses it under its own
    FSDP and DeepSpeed strategies; ``WeightAveraging`` (the same equal average) runs on the shards here."""
    if runs_it or not any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks):  # type: ignore[attr-defined]
        return
    raise ConfigurationError(
        f"Lightning's StochasticWeightAveraging callback does not run under {strategy}: it keeps a whole copy of the "
        "model and updates it from plain parameters and a torch optimizer, while this strategy shards them or steps "
        "them in its engine (Lightning refuses it under its own FSDP and DeepSpeed strategies too). Use "
        "lightning.pytorch.callbacks.WeightAveraging instead (its default is SWA's equal average; override "
        "should_update to start at an epoch): lightscale runs it on each rank's shards under every strategy "
        "(docs/callbacks/weight_averaging.md). StochasticWeightAveraging itself runs under bucketed_ddp and "
        "DiLoCo with inner='bucketed_ddp'."
    )


def weight_averaging_callbacks(trainer: Trainer) -> Iterator[WeightAveraging]:
    return (callback for callback in trainer.callbacks if isinstance(callback, WeightAveraging))  # type: ignore[attr-defined]


def adopt_weight_averaging(trainer: Trainer, module: LightningModule) -> None:
    """After the strategy sharded ``module``: give every ``WeightAveraging`` callback an average of the local shards.

    Lightning's own ``setup`` made a full copy of the unsharded module (freed here); from now on each rank holds
    its shards only.
    """
    for callback in weight_averaging_callbacks(trainer):
        settings = weight_averaging_settings(callback)
        if settings is None:
            continue
        use_buffers, kwargs = settings
        average = ShardAverage(module, shards_of(trainer.strategy), use_buffers=use_buffers, **kwargs)
        # Lightning's four methods zip ``pl_module.parameters()`` (sharded placeholders) with the average; these zip
        # the local shards instead. See the module docstring and lightscale/patches/lightning.py.
        give_weight_averaging(
            callback,
            average,
            {
                "_swap_models": _swap_models,
                "_copy_average_to_current": _copy_average_to_current,
                "on_save_checkpoint": _on_save_checkpoint,
                "on_load_checkpoint": _on_load_checkpoint,
            },
        )


def _swap_models(self: WeightAveraging, pl_module: LightningModule) -> None:
    swap_into(self._average_model, pl_module, keep=True)


def _copy_average_to_current(self: WeightAveraging, pl_module: LightningModule) -> None:
    swap_into(self._average_model, pl_module, keep=False)


def _on_save_checkpoint(self: WeightAveraging, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
    average = self._average_model
    checkpoint[AVERAGED] = portable_average(average, pl_module)
    checkpoint[AVERAGED_META] = {"n_averaged": int(average.n_averaged.item())}


def _on_load_checkpoint(self: WeightAveraging, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
    meta = checkpoint.get(AVERAGED_META)
    if meta is None and {"current_model_state", "averaging_state"} <= checkpoint.keys():
        _from_lightning_file(self._average_model, pl_module, checkpoint)
        return
    if meta is None:
        rank_zero_warn(
            "The checkpoint holds no averaged weights (it was not saved with WeightAveraging): the average starts "
            "from the loaded weights at the next update."
        )
        return
    path = Path(trainer.ckpt_path)  # the directory the strategy's load_checkpoint read: DCP reads the average here
    load_portable_average(self._average_model, pl_module, lambda state: read_checkpoint(path, state))
    self._average_model.n_averaged.fill_(meta["n_averaged"])
