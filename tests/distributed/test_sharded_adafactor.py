"""torch.optim.Adafactor under fsdp2 (2 gloo ranks) steps as in one process: the strategy installs ShardedAdafactor
(lightscale/optim/adafactor.py), which completes the factored statistics and norms across the shards.

One launch runs, on a small MLP whose first weight has an odd number of rows (uneven shards, 8 + 7):
    * fsdp2 for ``STEPS`` steps, saving at ``SAVE_AT``; a second fsdp2 run resuming that checkpoint; a bucketed_ddp run
      (torch's own Adafactor on whole parameters) resuming the same checkpoint: the state is torch's, portable;
    * parallel_3d with its defaults (all dp: FSDP2 through the 3-D path), and DiLoCo with one fsdp2 worker of 2 ranks
      (no outer sync within the run: the inner optimizer alone);
    * ShardedAdafactor on hand-placed DTensors: rows split unevenly, columns split (tensor parallel's Shard(1)), a
      3-D tensor split on its last dimension.
Checked: parameters after every run equal one process's torch.optim.Adafactor (<= 1e-5, fixed batch and init), the
optimizer state per rank is exactly the factored size divided as the shards are, and the step's all-reduces (count
and bytes) are the ones the module docstring names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import quiet_trainer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.estimate import estimate_memory
from lightscale.optim import shard_sums
from lightscale.optim.adafactor import ShardedAdafactor, sharded_adafactor_from
from lightscale.strategies import DiLoCoStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # absolute, on the parameters: the shards' sums differ from one process only in order
STEPS, SAVE_AT, BATCH = 6, 3, 8
ADAFACTOR = {"lr": 0.05, "weight_decay": 0.01}  # a large rate: a wrong statistic moves the weights by far more


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 15)  # 15 rows: shards of 8 and 7
        self.down = nn.Linear(15, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adafactor(self.parameters(), **ADAFACTOR)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch every step, torch's own Adafactor."""
    torch.manual_seed(0)
    module = MLP()
    optimizer = module.configure_optimizers()
    for _ in range(steps):
        module.training_step(_batch(), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ---- on each rank --------------------------------------------------------------------------------------------
class _Record(pl.Callback):
    """The optimizer's class, its state bytes on this rank, and the parameters, after the last step."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        self.out["optimizer"] = type(optimizer).__name__
        self.out["state_bytes"] = {
            name: {key: shard_sums.local(value).nbytes for key, value in optimizer.state[p].items()}
            for name, p in module.named_parameters()
        }
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in module.named_parameters()}
        self.out["params"] = {name: p.detach().clone() for name, p in full.items()}


class _CountingDist:
    """torch.distributed as shard_sums sees it, logging each all-reduce's size in bytes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def all_reduce(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        self.sizes.append(tensor.nbytes)
        return dist.all_reduce(tensor, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def _fit(strategy: Any, root: str, *, save_at: int | None = None, resume: str | None = None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    record, counting = _Record(), _CountingDist()
    callbacks: list[pl.Callback] = [record]
    if save_at is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="saved-{step}", every_n_train_steps=save_at, save_top_k=-1)
        )
    trainer = quiet_trainer(
        strategy, devices=2, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=save_at is not None
    )
    with mock.patch.object(shard_sums, "dist", counting):
        trainer.fit(MLP(), DataLoader(TensorDataset(*_batch()), batch_size=BATCH // 2), ckpt_path=resume)
    return record.out | {"all_reduces": counting.sizes}


SHAPES = {"rows_uneven": (7, 5), "vector": (5,), "columns": (4, 6), "batched_last": (3, 4, 6)}
PLACEMENTS = {"rows_uneven": Shard(0), "vector": Shard(0), "columns": Shard(1), "batched_last": Shard(2)}


def _placed() -> dict[str, Any]:
    """ShardedAdafactor on hand-placed DTensors vs torch's Adafactor on the whole tensors, four steps."""
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(1)
    init = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    grads = [{name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()} for _ in range(4)]
    whole = {name: nn.Parameter(t.clone()) for name, t in init.items()}
    placed = {name: nn.Parameter(distribute_tensor(t.clone(), mesh, [PLACEMENTS[name]])) for name, t in init.items()}
    torch_optimizer = torch.optim.Adafactor(whole.values(), **ADAFACTOR)
    ours = sharded_adafactor_from(torch.optim.Adafactor(placed.values(), **ADAFACTOR))
    for step_grads in grads:
        for name, grad in step_grads.items():
            whole[name].grad = grad.clone()
            placed[name].grad = distribute_tensor(grad.clone(), mesh, [PLACEMENTS[name]])
        torch_optimizer.step()
        ours.step()
    error = max((placed[name].full_tensor() - whole[name]).abs().max().item() for name in SHAPES)
    return {"error": error, "state_keys": {k for s in ours.state.values() for k in s}}


def _run(root: str) -> dict[str, Any]:
    first = _fit("fsdp2", f"{root}/fsdp2", save_at=SAVE_AT)
    saved = str(Path(root) / "fsdp2" / f"saved-step={SAVE_AT}.ckpt")  # written at SAVE_AT: resumed from there
    resumed = _fit("fsdp2", f"{root}/resumed", resume=saved)
    ddp = _fit("bucketed_ddp", f"{root}/ddp", resume=saved)
    p3d = _fit("parallel_3d", f"{root}/p3d")
    diloco = _fit(DiLoCoStrategy(inner="fsdp2", workers=1, sync_every=100), f"{root}/diloco")  # no sync in STEPS
    out = {"fsdp2": first, "resumed": resumed, "ddp": ddp, "parallel_3d": p3d, "diloco_fsdp2": diloco}
    return out | {"placed": _placed()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_run, str(tmp_path_factory.mktemp("adafactor")), world_size=2, timeout_s=600)


# ---- the checks -----------------------------------------------------------------------------------------------
def _error(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((params[name] - expected[name]).abs().max().item() for name in expected)


@pytest.mark.parametrize("run", ["fsdp2", "resumed", "ddp", "parallel_3d", "diloco_fsdp2"])
def test_parameters_equal_one_process(ranks: list[dict[str, Any]], run: str) -> None:
    expected = reference(STEPS)
    for result in ranks:
        assert _error(result[run]["params"], expected) <= TOLERANCE, (run, _error(result[run]["params"], expected))
    assert ranks[0]["fsdp2"]["optimizer"] == ShardedAdafactor.__name__  # installed in place of torch's
    assert ranks[0]["ddp"]["optimizer"] == "Adafactor"  # whole parameters: torch's own


def test_placements_tensor_parallel_and_uneven(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["placed"]["error"] <= TOLERANCE
        assert result["placed"]["state_keys"] == {"step", "row_var", "col_var", "variance"}  # torch's keys


def test_state_bytes_per_rank_exact(ranks: list[dict[str, Any]]) -> None:
    """Factored state: the rows this rank holds (8 or 7 of 15, 2 of 4) plus every column; vectors: the shard."""
    rows = {"up.weight": (8, 7), "down.weight": (2, 2)}
    columns = {"up.weight": 8, "down.weight": 15}
    vectors = {"up.bias": (8, 7), "down.bias": (2, 2)}
    for rank, result in enumerate(ranks):
        state = result["fsdp2"]["state_bytes"]
        for name in rows:
            assert state[name] == {"step": 4, "row_var": 4 * rows[name][rank], "col_var": 4 * columns[name]}
        for name in vectors:
            assert state[name] == {"step": 4, "variance": 4 * vectors[name][rank]}


def test_two_all_reduces_per_step(ranks: list[dict[str, Any]]) -> None:
    """Per step: [4 parameter norms, column sums (8 + 15), row-statistic sums (2)] and [4 update norms], fp32."""
    first, second = 4 * (4 + 8 + 15 + 2), 4 * 4
    for result in ranks:
        assert result["fsdp2"]["all_reduces"] == [first, second] * STEPS
        assert result["ddp"]["all_reduces"] == []  # whole parameters: torch's own step, nothing to complete


@pytest.mark.parametrize(("name", "run"), [("bucketed_ddp", "ddp"), ("fsdp2", "fsdp2")])
def test_estimator_predicts_the_state_bytes_exactly(ranks: list[dict[str, Any]], name: str, run: str) -> None:
    """lightscale/estimate counts Adafactor's factored state as torch stores it and ShardedAdafactor shards it: the
    prediction is the most loaded rank's (rank 0: 8 of 15 rows) measured bytes. bucketed_ddp 260 B, fsdp2 188 B."""
    predicted = estimate_memory(MLP(), name, world_size=2, optimizer=torch.optim.Adafactor, activations=False)
    measured = [sum(sum(state.values()) for state in result[run]["state_bytes"].values()) for result in ranks]
    assert predicted.optimizer.total == max(measured) == measured[0], (predicted.optimizer, measured)
    adam = estimate_memory(MLP(), name, world_size=2, optimizer=torch.optim.Adam, activations=False)
    assert adam.optimizer.total > predicted.optimizer.total  # no longer counted Adam-sized
