"""Lightning's behaviours users rely on, in the matrix's launches: one fit per name of a small classifier with what
users combine, recorded on every rank and compared with Lightning's own single-device run (``plain=True``).

Recorded: the order of every hook a callback sees; ``trainer.strategy``'s ``root_device``, ``global_rank``,
``world_size``, ``reduce``, ``broadcast``, ``barrier`` and ``all_gather``; ``sync_dist`` logging of a loss and of a
value computed from a parameter; ``ModelCheckpoint(monitor=..., save_top_k=2, save_last=True)``'s files;
``EarlyStopping``'s stop; ``validate``, ``test`` and ``predict`` after fit; a callback's state restored by
``fit(ckpt_path=last)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from zoo import GLOBAL_BATCH, LR, MOMENTUM

HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_train_end",
    "on_fit_end",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_load_checkpoint",
)
MAX_STEPS = 6  # EarlyStopping stops before (at the 2nd validation)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.sync_error: str | None = None

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(self.body(batch[0]), batch[1])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        try:  # computed from a parameter: a failure is the sync_dist check's, the other checks go on
            self.log("weight_norm", self.body[0].weight.norm(), sync_dist=True)
        except Exception as error:
            self.sync_error = f"{type(error).__name__}: {error}"
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grad = self.body[0].weight.grad
        if grad is None:  # ZeRO keeps gradients in DeepSpeed's buffers, as under Lightning's DeepSpeedStrategy
            return
        try:  # computed from a gradient (a DTensor under FSDP2)
            self.log("grad_norm", grad.norm(), sync_dist=True)
        except Exception as error:
            self.sync_error = f"{type(error).__name__}: {error}"

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.body(batch[0]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class Recorder(pl.Callback):
    """Every hook in order, the strategy's collectives at the start of training, and a state of its own."""

    def __init__(self) -> None:
        self.hooks: list[str] = []
        self.batches = 0
        self.restored: int | None = None
        self.api: dict[str, Any] = {}
        for hook in HOOKS:
            setattr(self, hook, self._recording(hook))

    def _recording(self, hook: str) -> Any:
        def record(trainer: pl.Trainer, *args: Any) -> None:
            self.hooks.append(hook)
            if hook == "on_train_batch_end":
                self.batches += 1
            if hook == "on_train_start":
                self.api = strategy_api(trainer.strategy)

        return record

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.restored = state_dict["batches"]


def strategy_api(strategy: Any) -> dict[str, Any]:
    """What each of ``trainer.strategy``'s collectives answers on this rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    strategy.barrier("conformance")
    return {
        "root_device": str(strategy.root_device),
        "global_rank": strategy.global_rank == rank,
        "world_size": strategy.world_size == world,
        "reduce": float(strategy.reduce(torch.tensor(float(rank)), reduce_op="sum")) == sum(range(world)),
        "broadcast": strategy.broadcast(f"from {rank}") == "from 0",
        "all_gather": strategy.all_gather(torch.tensor([rank])).flatten().tolist() == list(range(world)),
    }


def _loader(shards: tuple[int, int]) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)
    index, count = shards
    return DataLoader(TensorDataset(x[index::count], y[index::count]), batch_size=GLOBAL_BATCH // count)


def run(strategy: Any, root: Path, *, plain: bool = False) -> dict[str, Any]:
    """One fit with everything, then validate, test, predict and a resumed fit; what each gave on this rank."""
    import lightscale

    pl.seed_everything(0, verbose=False)
    recorder = Recorder()
    saver = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2, save_last=True)
    stopper = EarlyStopping(monitor="val_loss", mode="max", patience=1)  # the loss falls: stops at the 2nd check
    kwargs = dict(
        accelerator="cpu",
        devices=1 if plain else dist.get_world_size(),
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    trainer_class = pl.Trainer if plain else lightscale.Trainer
    trainer = trainer_class(strategy=strategy, callbacks=[recorder, saver, stopper], **kwargs)
    shards = (0, 1) if plain else tuple(lightscale.data_shard())
    model = Classifier()
    trainer.fit(model, _loader(shards), _loader(shards))
    out: dict[str, Any] = {"step": trainer.global_step, "api": recorder.api, "shards": shards}
    out["sync_error"] = model.sync_error
    out["logged"] = {key: float(value) for key, value in trainer.callback_metrics.items()}
    out["kept"] = sorted(path.name for path in Path(root).iterdir())
    out["saved_batches"] = recorder.batches
    out["validate"] = trainer.validate(model, _loader(shards), verbose=False)[0]["val_loss"]
    out["test"] = trainer.test(model, _loader(shards), verbose=False)[0]["test_loss"]
    out["predict"] = torch.cat(trainer.predict(model, _loader(shards))).tolist()
    out["hooks"] = recorder.hooks
    resumed = Recorder()
    trainer = trainer_class(strategy=strategy, callbacks=[resumed], **(kwargs | {"max_steps": out["step"] + 1}))
    trainer.fit(Classifier(), _loader(shards), _loader(shards), ckpt_path=saver.last_model_path)
    out["restored"] = resumed.restored
    return out
