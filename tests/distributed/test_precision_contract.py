"""The precision contract, observed: every strategy family x the four precisions, real steps on 2 gloo ranks.

A user's own model (below; not the GPT recipe) trains under each strategy name and precision in turn, inside one
launch per family. Probes read what actually happened: the dtype the parameters are stored in, the dtype of every
Linear's output (compute), the dtype handed to each gradient collective during backward (the collectives are
wrapped before any engine starts), whether the optimizer steps a separate master copy and in which dtype, the
optimizer state's dtype, and whether a loss scaler runs. Each must equal lightscale/plugins/precision_contract.py.
The bf16-mixed runs are 20 plain-SGD steps compared with one process in bf16-mixed on the same global batch
(relative 2e-2), and the 32-true runs with one process in fp32 (relative 1e-5).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import relative_difference
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightscale
from lightscale.layers.moe import MoE, MoEConfig
from lightscale.parallel.pipeline import even_stage_split
from lightscale.plugins.precision_contract import NAMES, PRECISIONS, meaning, refusal
from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy, LightscaleStrategy, Parallel3DStrategy
from lightscale.strategies.deepspeed.strategy import ZeroStrategy
from lightscale.testing import run_distributed

GLOBAL_BATCH = 8
PARITY_STEPS = 20
PROBE_STEPS = 2
# bf16-mixed on both sides: every op's output is rounded to 8 bits; an fp32 accumulation in another order (sharded,
# bucketed, another CPU's kernels) flips a rounding by one ulp, 2**-8 = 3.9e-3 relative. The bound is 5 such ulps of the
# loss after 20 SGD steps (the compression names in 32-true: bf16/int8 on the wire, test_parity.py's derivations).
# fp32: the gradient sums reassociated, ~1e-7 relative per step (helpers.PARITY_TOLERANCE).
BF16_TOLERANCE = 2e-2
FP32_TOLERANCE = 1e-5
# Strategy name -> (the class whose precision rules apply, data-parallel degree on 2 ranks). tp2 and pp2 have no
# data-parallel gradient reduction.
CASES: dict[str, tuple[type[LightscaleStrategy], int]] = {
    "bucketed_ddp": (BucketedDDPStrategy, 2),
    "bucketed_ddp_bf16": (BucketedDDPStrategy, 2),
    "fsdp2": (FSDP2Strategy, 2),
    "hsdp": (FSDP2Strategy, 2),
    "fsdp2_offload": (FSDP2Strategy, 2),
    "fsdp2_bf16": (FSDP2Strategy, 2),
    "parallel_3d": (Parallel3DStrategy, 2),
    "tp2": (Parallel3DStrategy, 1),
    "pp2": (Parallel3DStrategy, 1),
    "ep2": (Parallel3DStrategy, 2),  # experts sharded over both ranks, each a data-parallel rank; the model has an MoE
    "zero1": (ZeroStrategy, 2),
    "zero3": (ZeroStrategy, 2),
    "zero3_offload": (ZeroStrategy, 2),
    "zero2_bf16": (ZeroStrategy, 2),
}
COMPRESSION = {"bucketed_ddp_bf16": "bf16", "fsdp2_bf16": "bf16", "zero2_bf16": "bf16"}
LAUNCHES = {
    "ddp_fsdp2": ["bucketed_ddp", "bucketed_ddp_bf16", "fsdp2", "hsdp", "fsdp2_offload", "fsdp2_bf16"],
    "parallel_3d": ["parallel_3d", "tp2", "pp2", "ep2"],
    "zero": ["zero1", "zero2_bf16", "zero3", "zero3_offload"],  # stage 2 runs with compression="bf16"
}


def _strategy(name: str) -> Any:
    """Strategy objects, so that the SGD-under-offload exemption and compression can be given."""
    if name == "zero3_offload":  # plain SGD on the offloaded fp32 partitions instead of DeepSpeed's CPU Adam
        cfg = {"zero_force_ds_cpu_optimizer": False}
        return ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, config=cfg)
    if name == "zero2_bf16":
        return ZeroStrategy(stage=2, compression="bf16")
    if name == "bucketed_ddp_bf16":
        return BucketedDDPStrategy(compression="bf16")
    if name == "fsdp2_bf16":
        return FSDP2Strategy(compression="bf16")
    return name


# ---- the user's model ----------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleDict({str(i): Block(width) for i in range(2)})
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # pipeline stages hold some modules only
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


class MoENet(Net):
    """The same network with a mixture-of-experts layer (lightscale's) after the blocks, for expert parallelism."""

    def __init__(self, width: int = 16) -> None:
        super().__init__(width)
        self.moe = MoE(width, MoEConfig(n_experts=2, top_k=1, hidden=width, balance="none"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks.values():
            h = block(h)
        return self.head(h + self.moe(h.unsqueeze(1)).squeeze(1))


class UserModule(pl.LightningModule):
    def __init__(self, *, experts: bool = False) -> None:
        super().__init__()
        self.model = MoENet() if experts else Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), target)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def pipeline_stages(self, num_stages: int) -> list[list[str]]:
        return even_stage_split(["blocks.0", "blocks.1"], num_stages, first=["embed"], last=["head"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Momentum gives the optimizer a state to inspect; a wrong gradient scale still changes every step.
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


# ---- the probes ------------------------------------------------------------------------------------------------
_REDUCED: set[str] = set()
_IN_BACKWARD = [False]
_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "all_reduce_coalesced",
)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _wrap_gradient_collectives() -> None:
    """Record the dtype of every reduction issued during backward (DeepSpeed binds its functions at init: wrap
    before any engine starts)."""
    for name in _COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def recorded(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            tensor = _first_tensor(args, kwargs)
            if _IN_BACKWARD[0] and tensor is not None and tensor.is_floating_point() and tensor.numel() > 1:
                _REDUCED.add(NAMES[tensor.dtype])
            return _original(*args, **kwargs)

        setattr(dist, name, recorded)


@dataclass
class Observed:
    params: set[str] = field(default_factory=set)
    compute: set[str] = field(default_factory=set)
    reduce: set[str] = field(default_factory=set)
    master: str = "none"
    optimizer_state: set[str] = field(default_factory=set)
    loss_scaling: bool = False
    losses: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Probe(pl.Callback):
    def __init__(self, module: nn.Module) -> None:
        self.seen = Observed()
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(self._record_compute)

    def _record_compute(self, layer: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self.seen.compute.add(NAMES[output.dtype])

    def on_before_backward(self, *args: Any) -> None:
        _IN_BACKWARD[0] = True

    def on_after_backward(self, *args: Any) -> None:
        _IN_BACKWARD[0] = False

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = torch.tensor(float(outputs["loss"]), dtype=torch.float64)
        dist.all_reduce(loss)  # every rank's loss is its batch share's mean (tp/pp ranks agree): the mean is global
        self.seen.losses.append(loss.item() / dist.get_world_size())

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        seen, strategy = self.seen, trainer.strategy
        seen.params = {NAMES[p.dtype] for p in module.parameters()}
        seen.reduce = set(_REDUCED)
        engine = getattr(strategy, "engine", None)
        optimizer = engine.optimizer.optimizer if engine is not None else trainer.optimizers[0]
        # What the optimizer steps: its state's keys (ZeRO-3 puts its partitions in param_groups only while stepping).
        stepped = [*optimizer.state.keys(), *(p for group in optimizer.param_groups for p in group["params"])]
        own = {id(p) for p in module.parameters()}
        if any(id(p) not in own for p in stepped):
            seen.master = NAMES[stepped[0].dtype]
        seen.optimizer_state = {
            NAMES[t.dtype]
            for state in optimizer.state.values()
            for key, t in state.items()
            if key != "step" and isinstance(t, torch.Tensor) and t.is_floating_point()
        }
        seen.loss_scaling = getattr(strategy.precision_plugin, "scaler", None) is not None
        seen.loss_scaling |= engine is not None and engine.fp16_enabled()


def _fit(name: str, precision: str, steps: int) -> Observed:
    _REDUCED.clear()
    pl.seed_everything(7, verbose=False)
    module = UserModule(experts=name.startswith("ep") or name == "auto-moe")
    probe = Probe(module)
    generator = torch.Generator().manual_seed(0)
    size = GLOBAL_BATCH * steps
    data = TensorDataset(torch.randn(size, 8, generator=generator), torch.randint(0, 4, (size,), generator=generator))
    dp = CASES[name][1] if name in CASES else 1
    strategy = "auto" if name.startswith("auto") else _strategy(name)
    rank = dist.get_rank() % dp  # data-parallel ranks take every dp-th sample: their batches make the global one
    trainer = lightscale.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        use_distributed_sampler=False,  # Lightning's sampler shuffles training data: deal it in order instead
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(Subset(data, range(rank, size, dp)), batch_size=GLOBAL_BATCH // dp))
    probe.seen.warnings = [str(w.message) for w in caught if "lightscale: precision=" in str(w.message)]
    return probe.seen


def _steps(precision: str) -> int:
    return PARITY_STEPS if precision in ("bf16-mixed", "32-true") else PROBE_STEPS


def _launch(names: list[str]) -> dict[tuple[str, str], Observed]:
    if names == LAUNCHES["zero"]:
        import deepspeed  # noqa: F401  (imported once here, not in every Trainer.fit)
    _wrap_gradient_collectives()
    runs = {}
    for name in names:
        for precision in PRECISIONS:
            if refusal(CASES[name][0].precision_rules, precision, "cpu") is None:
                runs[name, precision] = _fit(name, precision, _steps(precision))
    return runs


def _references() -> dict[tuple[str, str], list[float]]:
    runs = [(model, p) for model in ("auto", "auto-moe") for p in ("32-true", "bf16-mixed")]
    return {(model, p): _fit(model, p, PARITY_STEPS).losses for model, p in runs}


@pytest.fixture(scope="module")
def one_process() -> dict[tuple[str, str], list[float]]:
    return run_distributed(_references, world_size=1)[0]


def _mismatches(name: str, precision: str, seen: Observed) -> list[str]:
    cls, dp = CASES[name]
    want = meaning(cls.precision_rules, precision, compression=COMPRESSION.get(name, "none"))
    checks = {
        "params": (seen.params, {want.params}),
        "compute": (seen.compute, {want.compute}),
        "reduce": (seen.reduce, {want.reduce} if dp > 1 else set()),
        "master": (seen.master, want.master),
        "optimizer_state": (seen.optimizer_state, {want.optimizer_state}),
        "loss_scaling": (seen.loss_scaling, want.loss_scaling),
        "warned": (bool(seen.warnings), bool(want.difference) and not want.same_values),
    }
    return [f"{name} {precision} {key}: saw {got}, contract {exp}" for key, (got, exp) in checks.items() if got != exp]


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_dtypes_follow_the_contract_and_bf16_mixed_matches_one_process(
    launch: str, one_process: dict[tuple[str, str], list[float]]
) -> None:
    per_rank = run_distributed(_launch, LAUNCHES[launch], world_size=2, timeout_s=400)
    wrong = []
    for (name, precision), seen in per_rank[0].items():
        other = per_rank[1][name, precision]
        seen.reduce |= other.reduce  # a rank of a pipeline or of an uneven split may see only some collectives
        seen.compute |= other.compute
        wrong += _mismatches(name, precision, seen)
        reference = one_process.get(("auto-moe" if name.startswith("ep") else "auto", precision))
        if reference is not None:
            tolerance = BF16_TOLERANCE if precision == "bf16-mixed" or name in COMPRESSION else FP32_TOLERANCE
            difference = relative_difference(seen.losses, reference)
            print(f"{name} {precision}: max relative loss difference {difference:.2e} over {PARITY_STEPS} steps")
            if difference > tolerance:
                wrong.append(f"{name} {precision}: losses differ by {difference:.2e} > {tolerance}")
    assert not wrong, "\n".join(wrong)
    assert one_process["auto", "bf16-mixed"][-1] < one_process["auto", "bf16-mixed"][0]  # it learned
