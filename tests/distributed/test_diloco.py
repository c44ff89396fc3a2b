"""The diloco / local_sgd strategies through Lightning: exact against synchronous data parallelism and hand-written
averaging, bytes per step as counted by CommMonitor, gradient accumulation, resume and export of the global model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import quiet_trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.callbacks import CommMonitor
from lightscale.checkpoint.convert import read_model_state
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy
from lightscale.strategies.diloco.checkpoint import global_model
from lightscale.strategies.diloco.inner import BucketedDDPWorker
from lightscale.testing import run_distributed

STEPS = 6


class Net(pl.LightningModule):
    """A small regression network trained with SGD with momentum (linear in the gradients, like DiLoCo's mean)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(512, 8, generator=gen)
        self.y = self.x.sin().sum(-1, keepdim=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=4)


class Losses(pl.Callback):
    """Each optimizer step's loss averaged over the world (Lightning divides micro-batch losses by accumulation)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self._micro = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self._micro += float(outputs["loss"])
        if (idx + 1) % trainer.accumulate_grad_batches == 0:
            mean = torch.tensor(self._micro, dtype=torch.float64)
            dist.all_reduce(mean)
            self.steps.append(mean.item() / dist.get_world_size())
            self._micro = 0.0


class AverageEvery(pl.Callback):
    """Hand-written local SGD: all-reduce the parameters every ``every`` optimizer steps."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            with torch.no_grad():
                for param in module.parameters():
                    dist.all_reduce(param)
                    param /= dist.get_world_size()


class AverageGradientsFirst(pl.Callback):
    """Hand-written synchronous start: all-reduce the gradients of the first ``steps`` optimizer steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        if trainer.global_step < self.steps:
            for param in module.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()


class GlobalsAtEnd(pl.Callback):
    """The strategy's fp32 global parameters when training stops (what a checkpoint saved then holds)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        model = global_model(trainer.lightning_module, trainer.strategy.outer)
        self.values = {name: _full(t) for name, t in model.items()}


def _fit(
    strategy: Any, *, steps: int = STEPS, callbacks: tuple = (), ckpt_path: str | None = None, **kwargs: Any
) -> tuple[list[float], Net]:
    module, losses = Net(), Losses()
    trainer = quiet_trainer(
        strategy, devices=dist.get_world_size(), max_steps=steps, callbacks=[losses, *callbacks], **kwargs
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return losses.steps, module


def _sgd_h1(**kwargs: Any) -> DiLoCoStrategy:
    return DiLoCoStrategy(sync_every=1, outer_lr=1.0, outer_momentum=0.0, **kwargs)


def _exactness() -> dict[str, Any]:
    ddp, _ = _fit(BucketedDDPStrategy())
    ddp_acc, _ = _fit(BucketedDDPStrategy(), accumulate_grad_batches=2)
    out = {"ddp": ddp, "ddp_acc": ddp_acc}
    out["h1_4x1"], _ = _fit(_sgd_h1(workers=4))
    out["h1_2x2"], _ = _fit(_sgd_h1(workers=2))
    out["h1_2x2_fsdp2"], _ = _fit(_sgd_h1(workers=2, inner="fsdp2"))
    out["h1_acc"], _ = _fit(_sgd_h1(workers=4), accumulate_grad_batches=2)
    _, local = _fit(DiLoCoStrategy(workers=4, sync_every=3, mode="local_sgd"))
    _, hand = _fit(DiLoCoStrategy(workers=4, sync_every=1000, mode="local_sgd"), callbacks=(AverageEvery(3),))
    out["local_vs_hand"] = _max_difference(local, hand)
    out["local_moved"] = _max_difference(local, Net())
    return out


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_h1_equals_data_parallel_and_local_sgd_equals_averaging() -> None:
    out = run_distributed(_exactness, world_size=4, timeout_s=300)[0]
    for name in ("h1_4x1", "h1_2x2", "h1_2x2_fsdp2"):
        assert max(abs(a - b) for a, b in zip(out[name], out["ddp"], strict=True)) <= 1e-6, name
    assert max(abs(a - b) for a, b in zip(out["h1_acc"], out["ddp_acc"], strict=True)) <= 1e-6
    assert out["ddp"] != out["ddp_acc"]  # accumulation changes the batches: the comparison is not vacuous
    assert out["local_moved"] > 1e-3 and out["local_vs_hand"] <= 1e-6


class OwnInner:
    """An inner strategy that is no lightscale class: it answers InnerStrategy (strategies/diloco/inner.py) by handing
    each question to a reducer of its own (here bucketed_ddp's adapter, with a smaller bucket)."""

    precision_rules = BucketedDDPStrategy.precision_rules
    shards_parameters = False

    def __init__(self) -> None:
        self._reducer = BucketedDDPWorker(BucketedDDPStrategy(bucket_cap_mb=1.0))

    def check_inner_settings(self) -> None:
        pass

    def inner_precision(self, plugin: Any, device_type: str) -> Any:
        return self._reducer.inner_precision(plugin, device_type)

    def inner_options(self, precision: str, *, activation_checkpointing: Any, compile: bool) -> Any:
        return self._reducer.inner_options(
            precision, activation_checkpointing=activation_checkpointing, compile=compile
        )

    def start_inner_sync(self, module: nn.Module, group: Any) -> None:
        self._reducer.start_inner_sync(module, group)

    def before_inner_step(self) -> None:
        self._reducer.before_inner_step()

    def inner_no_sync(self, model: nn.Module | None) -> Any:
        return self._reducer.inner_no_sync(model)

    def stop_inner_sync(self) -> None:
        self._reducer.stop_inner_sync()

    def optimizer_parameter_view(self) -> Any:
        return "whole"


def _own_inner() -> dict[str, Any]:
    ddp, _ = _fit(BucketedDDPStrategy(), steps=3)
    own, _ = _fit(_sgd_h1(workers=1, inner=OwnInner()), steps=3)
    return {"ddp": ddp, "own": own}


def test_any_inner_strategy_that_answers_the_protocol_runs() -> None:
    """H=1 with outer SGD at lr 1 is data parallelism, whatever object runs the worker's reducer."""
    out = run_distributed(_own_inner, world_size=2, timeout_s=300)[0]
    assert len(out["own"]) == 3 and max(abs(a - b) for a, b in zip(out["own"], out["ddp"], strict=True)) <= 1e-6


def _synchronous_start() -> dict[str, Any]:
    out: dict[str, Any] = {"ddp": _fit(BucketedDDPStrategy())[0]}
    for name, workers, inner in (("4x1", 4, "bucketed_ddp"), ("2x2", 2, "bucketed_ddp"), ("2x2_fsdp2", 2, "fsdp2")):
        out[name] = _fit(DiLoCoStrategy(workers=workers, inner=inner, sync_every=2, synchronous_steps=STEPS))[0]
    _, local = _fit(DiLoCoStrategy(workers=4, sync_every=2, mode="local_sgd", synchronous_steps=2))
    hand_callbacks = (AverageGradientsFirst(2), AverageEvery(2))
    _, hand = _fit(DiLoCoStrategy(workers=4, sync_every=1000, mode="local_sgd"), callbacks=hand_callbacks)
    out["local_vs_hand"] = _max_difference(local, hand)
    _, unsynchronized = _fit(DiLoCoStrategy(workers=4, sync_every=2, mode="local_sgd"))
    out["local_vs_unsynchronized"] = _max_difference(local, unsynchronized)
    return out


def test_synchronous_steps_are_data_parallel_then_the_workers_part() -> None:
    out = run_distributed(_synchronous_start, world_size=4, timeout_s=300)[0]
    for name in ("4x1", "2x2", "2x2_fsdp2"):  # H=2 with the default outer step: synchronous all the way
        assert max(abs(a - b) for a, b in zip(out[name], out["ddp"], strict=True)) <= 1e-6, name
    assert out["local_vs_hand"] <= 1e-6  # synchronous for 2 steps, then averaged every 2: as written by hand
    assert out["local_vs_unsynchronized"] > 1e-4  # the synchronous start changed the run


def _bytes(compression: str, accumulate: int, synchronous_steps: int = 0) -> tuple[list[dict[str, int]], int]:
    monitor = CommMonitor(every_n_steps=1, min_bytes=9)  # Lightning's own reductions are scalars
    strategy = DiLoCoStrategy(workers=2, sync_every=3, compression=compression, synchronous_steps=synchronous_steps)
    _, module = _fit(strategy, callbacks=(monitor,), accumulate_grad_batches=accumulate)
    per_step = [{kind: t.bytes for kind, t in step.items()} for step in monitor.records]
    return per_step, sum(p.numel() for p in module.parameters())


def _all_bytes() -> dict[str, Any]:
    out = {(c, a): _bytes(c, a) for c, a in (("none", 1), ("none", 2), ("int8", 1), ("bf16", 1))}
    out["synchronous"] = _bytes("none", 1, synchronous_steps=3)
    return out


def test_bytes_per_step_are_psi_over_h() -> None:
    out = run_distributed(_all_bytes, world_size=2, timeout_s=300)[0]
    per_step, numel = out.pop("synchronous")  # each synchronous step sends the gradients (Psi), then Psi / H
    assert [step.get("all_reduce", 0) for step in per_step] == [4 * numel] * 3 + [0, 0, 4 * numel]
    for (compression, _), (per_step, numel) in out.items():
        assert len(per_step) == STEPS
        payload = {"none": 4 * numel, "bf16": 2 * numel, "int8": numel + 4 * 4}[compression]  # 4 tensors' scales
        kind = "all_reduce" if compression == "none" else "all_gather"
        sent = [step.get(kind, 0) for step in per_step]
        factor = 1 if compression == "none" else 2  # an all-gather's buffer holds both workers' payloads
        assert sent == [0, 0, factor * payload] * (STEPS // 3), (compression, sent)
        assert set().union(*per_step) <= {kind}  # nothing else crosses between workers of one rank
        assert sum(sent) / STEPS / factor == payload / 3  # Psi / H (x the compression ratio) per step


def _all_reduce_bytes(strategy: Any) -> list[int]:
    monitor = CommMonitor(every_n_steps=1, min_bytes=9)
    _fit(strategy, callbacks=(monitor,))
    return [step["all_reduce"].bytes if "all_reduce" in step else 0 for step in monitor.records]


def _inner_objects() -> dict[str, Any]:
    """2 workers x 2 ranks; the outer sync sends int8 (an all-gather), so every all-reduce is the inner strategy's."""
    out = {}
    for name, make in (
        ("bf16", lambda: BucketedDDPStrategy(compression="bf16", bucket_cap_mb=1)),
        ("powersgd", lambda: BucketedDDPStrategy(compression="powersgd", powersgd_rank=2)),
    ):
        plain = _all_reduce_bytes(make())
        inside = _all_reduce_bytes(DiLoCoStrategy(workers=2, sync_every=3, compression="int8", inner=make()))
        out[name] = (plain, inside)
    out["numel"] = sum(p.numel() for p in Net().parameters())
    return out


def test_a_worker_runs_the_inner_strategy_object_it_is_given() -> None:
    """``inner=BucketedDDPStrategy(compression=...)``: each step's gradient bytes inside a worker are exactly what that
    strategy sends on its own (bf16: half of fp32's; PowerSGD: its rank-2 factors), never DiLoCo's own reducer's."""
    out = run_distributed(_inner_objects, world_size=4, timeout_s=600)[0]
    numel = out.pop("numel")
    for name, (plain, inside) in out.items():
        assert len(plain) == len(inside) == STEPS and inside == plain, (name, plain, inside)
    assert out["bf16"][0] == [2 * numel] * STEPS  # bf16 gradients: 2 bytes per parameter per step
    assert 0 < out["powersgd"][0][0] < 4 * numel  # low-rank factors (and the vectors whole), below fp32


def _resume(tmp: str, inner: str, synchronous_steps: int) -> dict[str, Any]:
    def strategy() -> DiLoCoStrategy:
        return DiLoCoStrategy(
            workers=2,
            inner=inner,
            sync_every=4,
            fragments=2,
            overlap_steps=1,
            compression="int8",
            synchronous_steps=synchronous_steps,
        )

    steps, whole = _fit(strategy(), steps=8)
    ckpt = str(Path(tmp) / "mid.ckpt")
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp, filename="mid", every_n_train_steps=5, save_top_k=-1)
    globals_ = GlobalsAtEnd()
    first, _ = _fit(strategy(), steps=5, callbacks=(saver, globals_), enable_checkpointing=True)
    second, resumed = _fit(strategy(), steps=8, ckpt_path=ckpt)
    exported = read_model_state(ckpt, prefix="net.") if dist.get_rank() == 0 else None
    full, part = [_full(p) for p in whole.parameters()], [_full(p) for p in resumed.parameters()]
    return {
        "steps": steps,
        "resumed": first + second,
        "whole": full,
        "part": part,
        "exported": exported,
        "globals": globals_.values,
    }


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


@pytest.mark.parametrize(
    ("inner", "synchronous_steps"),
    [("bucketed_ddp", 0), ("fsdp2", 0), ("bucketed_ddp", 6)],
    ids=["bucketed_ddp", "fsdp2", "saved_while_synchronous"],  # saved at step 5 of 6 synchronous ones
)
def test_resume_is_bitwise_and_export_gives_the_global_model(
    tmp_path: Path, inner: str, synchronous_steps: int
) -> None:
    results = run_distributed(_resume, str(tmp_path), inner, synchronous_steps, world_size=4, timeout_s=300)
    for out in results:
        assert out["steps"] == out["resumed"]
        assert all(torch.equal(a, b) for a, b in zip(out["whole"], out["part"], strict=True))
    exported, globals_ = results[0]["exported"], results[0]["globals"]
    assert sorted(exported) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(torch.equal(exported[name], globals_["net." + name]) for name in exported)
