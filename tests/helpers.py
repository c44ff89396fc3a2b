"""Training runs shared by the distributed tests: the tiny GPT for a few steps under a given strategy."""

from __future__ import annotations

import os
import re
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

import lightscale
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
# Plain SGD sees a wrong gradient scale: a 2x gradient is a 2x step (AdamW would cancel it). The rate is large
# enough that 2x moves the tiny GPT's losses by far more than the parity tolerance (test_parity.py measures it).
SGD_LR = 0.25
# Relative difference per step allowed between a strategy and one process, fp32 (measured ~1e-7 on gloo:
# reassociation of the gradient sums); test_parity.py on gloo and tests/gpu on NCCL use the same bound.
PARITY_TOLERANCE = 1e-5
S3_BUCKET = "lightscale-test"  # created by the `s3` fixture (tests/conftest.py: a local S3 server per module)


def backward_as_two_ranks(module: nn.Module, batch: tuple[torch.Tensor, ...], *, epoch: int) -> None:
    """Set each parameter's ``.grad`` to the gradient two data-parallel ranks average from ``batch``, bitwise.

    In ``epoch``, rank r trains on rows ``order[r*b : (r+1)*b]`` of the global batch (``order``: DistributedSampler's
    shuffle, seeded by ``seed_everything(0)`` plus the epoch; lightscale's ExactlyOnceSampler keeps it), back-propagates
    its own mean loss, and the ranks average: ``(g0 + g1) / 2`` (DDP, fsdp2 and ZeRO halve before or after the sum:
    the same bits, halving is exact in fp32 barring underflow). Each half here runs the same kernels on the same rows
    in the same order as on its rank, and a sum of two fp32 values is one correctly rounded operation, the same in
    either order. So a strategy that steps like one process matches this bitwise, on any CPU. One backward over the
    whole batch sums in another order: last-bit differences that Muon's bf16 Newton-Schulz turns into bf16 ulps
    (2**-8) of an update, so a bound against it holds by the machine's luck (issue 39: 0.0095 with AVX512-BF16).
    """
    params = [p for p in module.parameters() if p.requires_grad]
    order = torch.randperm(len(batch[0]), generator=torch.Generator().manual_seed(epoch))
    half = len(order) // 2
    per_rank = []
    for rank in range(2):
        rows = order[rank * half : (rank + 1) * half]
        loss = module.training_step(tuple(t[rows] for t in batch), 0)  # type: ignore[operator]
        per_rank.append(torch.autograd.grad(loss, params))
    for param, first, second in zip(params, *per_rank, strict=True):
        param.grad = (first + second) / 2


class CountingDist:
    """torch.distributed as lightscale/optim/muon.py sees it (``mock.patch.object(muon, "dist", ...)``), logging
    each gather's and scatter's local bytes (ShardedMuon and FlatMuon share that module's gather and scatter)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (kind, bytes of this rank's piece, owner)

    def gather(self, tensor: torch.Tensor, *args: Any, group_dst: int, **kwargs: Any) -> Any:
        self.calls.append(("gather", tensor.nbytes, group_dst))
        return dist.gather(tensor, *args, group_dst=group_dst, **kwargs)

    def scatter(self, tensor: torch.Tensor, *args: Any, group_src: int, **kwargs: Any) -> Any:
        self.calls.append(("scatter", tensor.nbytes, group_src))
        return dist.scatter(tensor, *args, group_src=group_src, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def quiet_trainer(
    strategy: Any, *, devices: int, max_steps: int, accelerator: str = "cpu", **kwargs: Any
) -> pl.Trainer:
    """A lightscale Trainer that only trains: no logger, checkpoints, progress bar, summary or validation."""
    quiet: dict[str, Any] = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    return lightscale.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, max_steps=max_steps, **(quiet | kwargs)
    )


class SGDGPTModule(GPTModule):
    """The GPT recipe's module trained with plain SGD (no momentum, constant rate), for parity tests."""

    def __init__(self, config: GPTConfig, *, sgd_lr: float = SGD_LR) -> None:
        super().__init__(config)
        self.sgd_lr = sgd_lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)


class StepLosses(pl.Callback):
    """Loss of every optimizer step, averaged over micro-batches and over data-parallel ranks.

    ``local`` keeps this rank's own loss per step (before any reduction across ranks), so a test can check each
    rank's share instead of a value that was already all-reduced.
    """

    def __init__(self) -> None:
        self.micro: list[float] = []
        self.steps: list[float] = []
        self.local: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.micro.append(float(outputs["loss"]))
        if len(self.micro) == trainer.accumulate_grad_batches:
            # Lightning reports each micro-batch loss already divided by accumulate_grad_batches: sum them.
            mean = torch.tensor(sum(self.micro), dtype=torch.float64)
            self.local.append(mean.item())
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            self.steps.append(mean.item())
            self.micro.clear()


class StopAfter(pl.Callback):
    """Interrupt fit after ``steps`` optimizer steps (the LR schedule still spans ``max_steps``), the way a
    killed job is: the last checkpoint is the one ModelCheckpoint wrote mid-epoch."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


def train_tiny_gpt(
    strategy: Any,
    *,
    devices: int,
    batch_size: int,
    cache_dir: str,
    max_steps: int = 20,
    accumulate: int = 1,
    config: GPTConfig = TINY,
    extra_callbacks: list[pl.Callback] | tuple = (),
    stop_after: int | None = None,
    save_checkpoint_to: str | None = None,
    resume_from: str | None = None,
    sgd_lr: float | None = None,
    local_losses: bool = False,
    seed_per_rank: bool = False,
    **trainer_kwargs: Any,
) -> list[float]:
    """Fit the tiny GPT for ``max_steps`` optimizer steps on this rank; return the global loss of each step.

    ``sgd_lr`` trains with plain SGD at that rate instead of the recipe's AdamW; ``local_losses`` returns this
    rank's own losses (not reduced across ranks).
    """
    # seed_per_rank: each rank its own seed, so only a strategy that starts every rank from rank 0's weights matches.
    pl.seed_everything(1234 + (dist.get_rank() if seed_per_rank and dist.is_initialized() else 0), verbose=False)
    if sgd_lr is None:
        module: GPTModule = GPTModule(config, learning_rate=3e-3, warmup_steps=3)
    else:
        module = SGDGPTModule(config, sgd_lr=sgd_lr)
    data = GPTDataModule(block_size=config.block_size, batch_size=batch_size, cache_dir=cache_dir)
    losses = StepLosses()
    trainer = quiet_trainer(
        strategy,
        devices=devices,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=save_checkpoint_to is not None,
        callbacks=[losses, *extra_callbacks, *_interruption(stop_after, save_checkpoint_to)],
        **trainer_kwargs,
    )
    trainer.fit(module, data, ckpt_path=resume_from)
    return losses.local if local_losses else losses.steps


def _interruption(stop_after: int | None, checkpoint: str | None) -> list[pl.Callback]:
    if stop_after is None:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    assert checkpoint is not None and checkpoint.endswith(".ckpt")
    directory = os.path.dirname(checkpoint) or "."  # a string: an fsspec URL keeps its "//" (Path would drop one)
    name = os.path.basename(checkpoint).removesuffix(".ckpt")
    saver = ModelCheckpoint(dirpath=directory, filename=name, every_n_train_steps=stop_after, save_top_k=-1)
    return [saver, StopAfter(stop_after)]


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# A line is warning-like if it names a warning, a deprecation, or has Python's "file.py:LINE: message" form.
WARNING_LIKE = re.compile(r"warn|deprecat|\.py:\d+: ", re.IGNORECASE)
# pattern -> why the line stays (empty: nothing is left). The same list is in docs/architecture.md ("Logs").
ALLOWED_WARNINGS: dict[str, str] = {}


def warning_lines(output: str) -> list[str]:
    """The warning-like lines of a run's output (not the progress bar's)."""
    lines = (line.strip() for chunk in output.splitlines() for line in chunk.split("\r"))
    return [line for line in lines if WARNING_LIKE.search(line) and "it/s" not in line]


def unexplained_warnings(output: str) -> list[str]:
    """The warning-like lines of ``output`` that no ``ALLOWED_WARNINGS`` entry explains: a default run of a packaged
    config prints no warning a user cannot act on (tests/recipes/test_quiet_logs.py)."""
    return [line for line in warning_lines(output) if not any(re.search(p, line) for p in ALLOWED_WARNINGS)]
