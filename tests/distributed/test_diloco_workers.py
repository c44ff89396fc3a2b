"""DiLoCo inside a worker and across worker counts: the one parallelize path (meta init, activation checkpointing,
compile) under both inner strategies, and a checkpoint resumed at another number of workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import S3_BUCKET, quiet_trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.errors import ConfigurationError
from lightscale.strategies import DiLoCoStrategy
from lightscale.strategies.diloco.checkpoint import global_model
from lightscale.strategies.diloco.saved_state import like_param
from lightscale.testing import run_distributed

STEPS = 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0  # forwards run: activation checkpointing runs each a second time in backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.linear(x))


class BlockNet(pl.LightningModule):
    """Built in configure_model (the meta device under meta_init), two repeated blocks, SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(256, 8, generator=gen)
        self.y = self.x.sin().sum(-1, keepdim=True)
        self.built_on_meta: bool | None = None

    def configure_model(self) -> None:
        if self.built_on_meta is not None:
            return
        torch.manual_seed(0)  # the same draws whichever rank materializes them
        self.net = nn.Sequential(Block(), Block(), nn.Linear(8, 1))
        self.built_on_meta = self.net[0].linear.weight.is_meta

    def sharding_units(self) -> list[nn.Module]:
        return [self.net[0], self.net[1]]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.compiled: list[bool] = []
        self.globals: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: pl.Trainer, module: Any) -> None:
        self.compiled = [unit._compiled_call_impl is not None for unit in module.sharding_units()]

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.globals = {name: _full(t) for name, t in _global_parameters(trainer).items()}


def _global_parameters(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The fp32 global copies of the module's parameters (each name of a tied one), without its buffers."""
    module = trainer.lightning_module
    names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in global_model(module, trainer.strategy.outer).items() if name in names}


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _fit(strategy: DiLoCoStrategy, *, steps: int = STEPS, **kwargs: Any) -> dict[str, Any]:
    module, record = BlockNet(), Record()
    trainer = quiet_trainer(strategy, devices=dist.get_world_size(), max_steps=steps, callbacks=[record], **kwargs)
    trainer.fit(module)
    return {
        "losses": record.losses,
        "meta": module.built_on_meta,
        "calls": [b.calls for b in module.sharding_units()],
        "compiled": record.compiled,
        "globals": record.globals,
    }


def _inner_paths() -> dict[str, Any]:
    def diloco(inner: str, **kwargs: Any) -> DiLoCoStrategy:
        return DiLoCoStrategy(workers=2, inner=inner, sync_every=2, **kwargs)  # type: ignore[arg-type]

    out = {}
    for inner in ("bucketed_ddp", "fsdp2"):
        out[inner, "eager"] = _fit(diloco(inner, meta_init=False))
        out[inner, "meta_ac"] = _fit(diloco(inner, activation_checkpointing="full"))
        out[inner, "compile"] = _fit(diloco(inner, compile=True), steps=0)  # compiled units: checked, not run
    return out


def test_inner_strategies_go_through_the_parallelize_path() -> None:
    results = run_distributed(_inner_paths, world_size=4, timeout_s=300)
    for out in results:
        for inner in ("bucketed_ddp", "fsdp2"):
            eager, meta = out[inner, "eager"], out[inner, "meta_ac"]
            assert eager["meta"] is False and meta["meta"] is True
            assert eager["calls"] == [STEPS, STEPS] and meta["calls"] == [2 * STEPS, 2 * STEPS]  # recomputed
            assert meta["losses"] == eager["losses"], inner  # materialized as built for real, bit for bit
            assert all(torch.equal(meta["globals"][k], v) for k, v in eager["globals"].items())
            assert out[inner, "compile"]["compiled"] == [True, True]
    assert results[0]["fsdp2", "eager"]["losses"] == results[0]["bucketed_ddp", "eager"]["losses"]
    assert results[0]["fsdp2", "eager"]["losses"] != results[2]["fsdp2", "eager"]["losses"]  # workers differ


class Snapshot(pl.Callback):
    """The DiLoCo state at the start and at the end of a fit: local parameters, globals, outer momentum, step."""

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def _take(self, trainer: pl.Trainer, module: Any) -> dict[str, Any]:
        outer = trainer.strategy.outer
        optimizer = outer.fragments[0].optimizer
        momentum = [optimizer.state[g]["momentum_buffer"] for g in outer.fragments[0].globals]
        return {
            "locals": [_full(p) for p in module.parameters()],
            "step": outer.step,
            "globals": [_full(t) for t in _global_parameters(trainer).values()],
            "momentum": [_full(like_param(outer.params[i], m)) for i, m in enumerate(momentum)],
            "rounds": None if trainer.strategy.ft is None else trainer.strategy.ft.rounds_committed,
        }

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        if trainer.global_step:  # resumed
            self.states["start"] = self._take(trainer, module)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.states["end"] = self._take(trainer, module)


def _reshape(tmp: str, inner: str) -> dict[str, Any]:
    def fit(workers: int, steps: int, callbacks: tuple = (), ckpt_path: str | None = None, **kwargs: Any) -> Any:
        strategy = DiLoCoStrategy(workers=workers, inner=inner, sync_every=2)  # type: ignore[arg-type]
        snapshot, record = Snapshot(), Record()
        trainer = quiet_trainer(
            strategy, devices=4, max_steps=steps, callbacks=[snapshot, record, *callbacks], **kwargs
        )
        trainer.fit(BlockNet(), ckpt_path=ckpt_path)
        return {**snapshot.states, "losses": record.losses}

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp, filename="mid", every_n_train_steps=4, save_top_k=-1)
    out = {2: fit(2, 4, callbacks=(saver,), enable_checkpointing=True)}
    for workers in (1, 4):
        out[workers] = fit(workers, 6, ckpt_path=str(Path(tmp) / "mid.ckpt"))
    return out


def _in_flight(tmp: str) -> str:
    def strategy(workers: int) -> DiLoCoStrategy:
        return DiLoCoStrategy(workers=workers, sync_every=2, fragments=2, overlap_steps=1)

    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp, filename="odd", every_n_train_steps=3, save_top_k=-1)
    quiet_trainer(strategy(2), devices=4, max_steps=3, callbacks=[saver], enable_checkpointing=True).fit(BlockNet())
    with pytest.raises(ConfigurationError) as refused:  # every rank refuses alike: none waits for another
        quiet_trainer(strategy(4), devices=4, max_steps=4).fit(BlockNet(), ckpt_path=str(Path(tmp) / "odd.ckpt"))
    return str(refused.value)


def test_resume_at_another_number_of_workers_refuses_results_in_flight(tmp_path: Path) -> None:
    message = run_distributed(_in_flight, str(tmp_path), world_size=4, timeout_s=300)[0]
    assert "saved with 1 outer result(s) in flight" in message and "2 workers x 1 shards" in message


@pytest.mark.parametrize("inner", ["bucketed_ddp", "fsdp2"])
def test_resume_at_another_number_of_workers_restarts_them_from_the_global_model(tmp_path: Path, inner: str) -> None:
    results = run_distributed(_reshape, str(tmp_path), inner, world_size=4, timeout_s=300)
    saved = results[0][2]["end"]
    assert saved["step"] == 4 and all(m.abs().sum() > 0 for m in saved["momentum"])
    for out in results:
        for workers in (1, 4):  # 2 workers x 2 ranks -> 1 x 4 and 4 x 1 (FSDP2: resharded 2 -> 4 and 1)
            start = out[workers]["start"]
            assert start["step"] == 4 and len(out[workers]["losses"]) == 2
            for name in ("globals", "momentum"):
                assert all(torch.equal(a, b) for a, b in zip(start[name], saved[name], strict=True)), (workers, name)
            assert all(torch.equal(a, b) for a, b in zip(start["locals"], saved["globals"], strict=True))


def _ft_resume(tmp: str) -> dict[str, Any]:
    """One fault-tolerant worker (its own lighthouse, min_replicas=1): 8 steps at once, and 5 + resume="auto" to 8;
    checkpoints under ``tmp``, a local directory or an ``s3://`` URL."""
    import lightscale
    from lightscale.fault_tolerance import FaultTolerance
    from lightscale.fault_tolerance.lighthouse import start_lighthouse

    server, address = start_lighthouse(min_replicas=1)
    out: dict[str, Any] = {}
    try:
        for name, steps in (("whole", 8), ("first", 5), ("resumed", 8)):
            ft = FaultTolerance(replica_id="worker_0", min_replicas=1, lighthouse=address)
            strategy = DiLoCoStrategy(sync_every=2, fault_tolerant=ft)
            directory = f"{tmp}/{'whole' if name == 'whole' else 'parts'}"
            saver = pl.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=5, save_top_k=-1)
            snapshot, record = Snapshot(), Record()
            trainer = lightscale.Trainer(
                strategy=strategy,
                accelerator="cpu",
                devices=1,
                max_steps=steps,
                logger=False,
                resume="auto",
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                callbacks=[saver, snapshot, record],
            )
            trainer.fit(BlockNet())
            out[name] = {**snapshot.states, "losses": record.losses}
    finally:
        server.shutdown()
    return out


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_fault_tolerant_worker_checkpoints_and_resumes_auto(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if where == "s3":
        request.getfixturevalue("s3")  # a local S3 server (tests/conftest.py)
    base = str(tmp_path) if where == "local" else f"s3://{S3_BUCKET}/ft-diloco"
    out = run_distributed(_ft_resume, base, world_size=1, timeout_s=300)[0]
    whole, first, resumed = out["whole"], out["first"], out["resumed"]
    assert resumed["start"]["step"] == 5 and first["losses"] + resumed["losses"] == whole["losses"]
    for name in ("locals", "globals", "momentum"):
        assert all(torch.equal(a, b) for a, b in zip(resumed["end"][name], whole["end"][name], strict=True)), name
    rounds = [first["end"]["rounds"], resumed["start"]["rounds"], resumed["end"]["rounds"], whole["end"]["rounds"]]
    assert rounds == [2, 2, 4, 4]  # torchft's count of committed rounds is saved and restored
