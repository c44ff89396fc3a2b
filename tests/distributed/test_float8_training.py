"""float8 training in torchao's emulation on CPU: loss parity with bf16 over 50 steps of the tiny GPT (fsdp2, with
activation checkpointing, and tp2), and FSDP2 all-gathering the converted weights in float8 (exact bytes)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import quiet_trainer, train_tiny_gpt
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.plugins.fsdp_precision import Float8Precision
from lightscale.strategies.fsdp2.strategy import FSDP2Strategy
from lightscale.strategies.parallel_3d.strategy import Parallel3DStrategy
from lightscale.testing import run_distributed

# Emulated float8 vs bf16-mixed, the tiny GPT, the recipe's AdamW, 50 steps: the mean over steps of the relative loss
# difference. Measured: 1.8e-3 tensorwise, 2.4e-3 rowwise (fp32 vs bf16-mixed: 1.4e-3). Single steps differ more
# where the run is chaotic (step 45: 3.5e-2 for float8 and 3.4e-2 for fp32 vs bf16), so the mean is bounded.
# Planted: scales 8x too large (saturating casts) give 6.9e-3 and fail; no scaling at all (scale 1) gives 2.2e-3
# and passes: the tiny GPT's values sit in e4m3's range anyway. The bytes test below catches a lost float8 path.
PARITY = 5e-3


def _precision(name: str) -> dict[str, Any]:
    if name.startswith("float8"):
        return {"plugins": [Float8Precision(name, "cpu", emulate=True)]}
    return {"precision": name}


def _fit(strategy: Any, precision: str, cache_dir: str, steps: int, devices: int = 1) -> list[float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied output head stays bf16: listed once, known here
        return train_tiny_gpt(
            strategy, devices=devices, batch_size=8, cache_dir=cache_dir, max_steps=steps, **_precision(precision)
        )


def _one_process(cache_dir: str) -> dict[str, list[float]]:
    runs = {p: _fit(FSDP2Strategy(), p, cache_dir, 50) for p in ("bf16-mixed", "float8", "float8-rowwise")}
    runs["float8+ac"] = _fit(FSDP2Strategy(activation_checkpointing="full"), "float8", cache_dir, 10)
    runs["float8-10"] = _fit(FSDP2Strategy(), "float8", cache_dir, 10)  # the LR schedule spans max_steps
    return runs


def _difference(a: list[float], b: list[float]) -> float:
    """Mean over steps of the relative loss difference."""
    return sum(abs(x - y) / y for x, y in zip(a, b, strict=True)) / len(b)


def test_float8_tracks_bf16_over_50_steps(corpus_cache: str) -> None:
    runs = run_distributed(_one_process, corpus_cache, world_size=1, timeout_s=300)[0]
    for name in ("float8", "float8-rowwise"):
        difference = _difference(runs[name], runs["bf16-mixed"])
        print(f"{name}: mean relative loss difference vs bf16-mixed over 50 steps {difference:.2e}")
        assert difference < PARITY, name
    assert runs["float8"][-1] < 0.65 * runs["float8"][0]  # it trains
    # Activation checkpointing recomputes the same float8 casts: the same losses.
    assert runs["float8+ac"] == runs["float8-10"]


def _two_ranks(cache_dir: str) -> dict[tuple[str, str], list[float]]:
    strategies = {"tp2": lambda: Parallel3DStrategy(tp=2), "hsdp": lambda: "hsdp"}
    return {
        (name, p): _fit(make(), p, cache_dir, 10, devices=2)
        for name, make in strategies.items()
        for p in ("bf16-mixed", "float8")
    }


def test_float8_under_tensor_parallelism_and_hsdp_tracks_bf16(corpus_cache: str) -> None:
    runs = run_distributed(_two_ranks, corpus_cache, world_size=2, timeout_s=300)[0]
    for name in ("tp2", "hsdp"):
        difference = _difference(runs[name, "float8"], runs[name, "bf16-mixed"])
        print(f"{name} float8: mean relative loss difference vs bf16-mixed over 10 steps {difference:.2e}")
        assert difference < PARITY, name


# ---- FSDP2 moves float8 bytes ----------------------------------------------------------------------------------
SIZES = [(32, 64), (64, 32), (32, 8)]  # the last is not a multiple of 16: it stays bf16


class UserModule(pl.LightningModule):
    """A user's MLP, one FSDP unit (the root), plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Linear(i, o, bias=o == 8) for i, o in SIZES]
        self.net = nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2])

    def sharding_units(self) -> list[nn.Module]:
        return []

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Counted(pl.Callback):
    """The collectives of each training step (forward, backward, optimizer step), and at the end each float8
    weight's precomputed scale beside the one its current weights give (float8 max / global max |w|)."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []
        self.counter: CollectiveCounter | None = None
        self.scales: list[tuple[float, float]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter = CollectiveCounter().__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        assert self.counter is not None
        self.counter.__exit__(None, None, None)
        self.steps.append(list(self.counter.calls))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        for layer in module.modules():
            local = getattr(getattr(layer, "weight", None), "_local_tensor", None)  # the tensor torchao annotates
            if not hasattr(local, "_precomputed_scale"):
                continue
            amax = torch.as_tensor(local.detach()).abs().max().float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            self.scales.append((float(local._precomputed_scale), float(torch.finfo(torch.float8_e4m3fn).max / amax)))


def _gathers(precision: str) -> tuple[list[list[tuple[str, int, int]]], list[tuple[float, float]]]:
    pl.seed_everything(0, verbose=False)
    counted = Counted()
    data = TensorDataset(torch.randn(64, 32), torch.randint(0, 8, (64,)))
    trainer = quiet_trainer("fsdp2", devices=2, max_steps=3, callbacks=[counted], **_precision(precision))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(UserModule(), DataLoader(data, batch_size=8))
    return [[(c.kind, c.elements, c.bytes) for c in step] for step in counted.steps], counted.scales


def test_fsdp2_all_gathers_converted_weights_in_float8() -> None:
    bf16, _ = run_distributed(_gathers, "bf16-mixed", world_size=2)[0]
    float8, scales = run_distributed(_gathers, "float8", world_size=2)[0]
    converted = sum(i * o for i, o in SIZES[:2])  # 4096 weights at 1 byte
    rest = SIZES[2][0] * SIZES[2][1] + 8  # the bf16 layer's weight and bias at 2 bytes
    for step_bf16, step_float8 in zip(bf16, float8, strict=True):
        gathers_bf16 = [c for c in step_bf16 if c[0] == "all_gather"]
        gathers_float8 = [c for c in step_float8 if c[0] == "all_gather"]
        assert len(gathers_float8) == len(gathers_bf16) >= 1
        assert {c[2] for c in gathers_bf16} == {2 * (converted + rest)}  # 8720 bytes per all-gather
        assert {c[2] for c in gathers_float8} == {converted + 2 * rest}  # 4624 bytes
    # The scales the next all-gather casts with were computed after the last optimizer step, from all shards.
    assert len(scales) == 2
    for precomputed, current in scales:
        assert abs(precomputed - current) <= 1e-6 * current
