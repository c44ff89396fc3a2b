"""What the old checkpoints were trained with, for ``make.py`` (which wrote them) and
tests/distributed/test_old_checkpoints.py (which loads and resumes them): the model, its data, its optimizer, each
family's strategy and the fit itself.

Only public entry points: strategy names and ``lightscale.strategies``' classes, ``lightning.Trainer``,
``lightscale.data_shard`` and ``lightscale.FaultTolerance``. The internals move; what these fixtures hold must load
through whatever replaces them.

The model is a LightningModule whose network (``self.model``) is an embedding, two residual MLP blocks and a head,
668 parameters, with the hooks tensor and pipeline parallelism ask for. Every step trains on the same global batch
(as tests/conformance/ does): after a resume the data position cannot matter, so the losses after it equal the
uninterrupted run's.

Example:
    >>> run_distributed(fit, FAMILIES["fsdp2"], saves={SAVE_AT: "fsdp2/checkpoint"}, world_size=RANKS)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

import lightscale

WIDTH, GLOBAL_BATCH, LR, MOMENTUM = 8, 8, 0.1, 0.9
STEPS, SAVE_AT = 5, 3  # the fixture is the save at SAVE_AT; the manifest holds the losses of the steps after it
RANKS = 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleDict({str(i): Block(width) for i in range(2)})
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x) if self.embed is not None else x  # a pipeline stage holds some modules only
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


class Model(pl.LightningModule):
    """The user's LightningModule: ``load_from_checkpoint`` opens every fixture with it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(output.float(), target)

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def sharding_units(self) -> list[nn.Module]:
        return list(self.model.blocks.values())

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def pipeline_stages(self, num_stages: int) -> list[list[str]]:
        assert num_stages == 2, num_stages
        return [["embed", "blocks.0"], ["blocks.1", "head"]]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def global_batch() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)


def loader() -> DataLoader:
    """This rank's part of the global batch (its data shard: tp and pp ranks read the same samples)."""
    index, count = lightscale.data_shard()
    mine = [tensor[index::count] for tensor in global_batch()]
    return DataLoader(TensorDataset(*mine), batch_size=GLOBAL_BATCH // count)


@dataclasses.dataclass(frozen=True)
class Family:
    """A checkpoint family: its directory name, the strategy as the manifest names it, and how to build it
    (``lighthouse``: the address a fault-tolerant family meets at)."""

    name: str
    strategy: str
    kwargs: dict[str, Any]
    build: Callable[[str | None], Any]
    lighthouse: bool = False


def _ft_hsdp(lighthouse: str | None) -> Any:
    from lightscale.strategies import FSDP2Strategy

    # One replica of 2 ranks (FSDP2 shards within it; torchft replicates across replicas): the layout and its
    # fault-tolerance state are those of any replica's save.
    ft = lightscale.FaultTolerance(
        replica_id="replica_0", lighthouse=lighthouse, min_replicas=1, timeout_s=10, quorum_timeout_s=30
    )
    return FSDP2Strategy(fault_tolerant=ft, meta_init=False)


def _diloco(lighthouse: str | None) -> Any:
    from lightscale.strategies import DiLoCoStrategy

    return DiLoCoStrategy(sync_every=2)  # an outer sync at step 2, the save mid-round at step 3


FAMILIES = {
    family.name: family
    for family in (
        Family("bucketed_ddp_powersgd", "bucketed_ddp_powersgd", {}, lambda _: "bucketed_ddp_powersgd"),
        Family("fsdp2", "fsdp2", {}, lambda _: "fsdp2"),
        Family(
            "hsdp_fault_tolerant",
            "FSDP2Strategy",
            {"fault_tolerant": "FaultTolerance(replica_id='replica_0', min_replicas=1)", "meta_init": False},
            _ft_hsdp,
            lighthouse=True,
        ),
        Family("zero2", "zero2", {}, lambda _: "zero2"),
        Family("zero3", "zero3", {}, lambda _: "zero3"),
        Family("tp2", "tp2", {}, lambda _: "tp2"),
        Family("pp2", "pp2", {}, lambda _: "pp2"),
        Family("diloco", "DiLoCoStrategy", {"sync_every": 2}, _diloco),
    )
}


def fingerprint(state: dict[str, Tensor]) -> dict[str, dict[str, Any]]:
    """Per tensor: its shape, dtype, sum (float64) and the sha256 of its bytes (bitwise identity)."""
    import hashlib

    return {
        key: {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "sum": value.double().sum().item(),
            "sha256": hashlib.sha256(value.detach().contiguous().cpu().numpy().tobytes()).hexdigest(),
        }
        for key, value in sorted(state.items())
    }


class _Watch(pl.Callback):
    """This rank's loss of every step, the global step when training starts, and the saves."""

    def __init__(self, saves: dict[int, str]) -> None:
        self.saves, self.losses, self.start_step = saves, {}, -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses[trainer.global_step] = None if loss is None else float(loss)
        if trainer.global_step in self.saves:
            trainer.save_checkpoint(self.saves[trainer.global_step])


def fit(
    family: Family, *, saves: dict[int, str], lighthouse: str | None = None, ckpt_path: str | None = None
) -> dict[str, Any]:
    """On every rank: train ``family`` to ``STEPS`` (from ``ckpt_path`` if given), saving at the steps of ``saves``;
    returns the step training started at and this rank's loss of each step."""
    watch = _Watch(saves)
    trainer = pl.Trainer(
        strategy=family.build(lighthouse),
        accelerator="cpu",
        devices=RANKS,
        max_steps=STEPS,
        callbacks=[watch],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=str(Path(next(iter(saves.values()))).parent),
    )
    trainer.fit(Model(), loader(), ckpt_path=ckpt_path)
    return {"start_step": watch.start_step, "losses": watch.losses, "global_step": trainer.global_step}
