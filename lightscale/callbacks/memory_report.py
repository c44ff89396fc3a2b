"""What MemoryProfiler writes: the estimate for the running job, the timeline PNG and the out-of-memory report."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn

from lightscale.estimate.core import CATEGORIES, MemoryEstimate, estimate_memory
from lightscale.estimate.report import format_estimate, human
from lightscale.patches.process import set_user_attribute
from lightscale.strategies.registry import memory_alternatives
from lightscale.strategies.shards import shards_of

log = logging.getLogger(__name__)
COLORS = {"parameters": "#4878d0", "gradients": "#ee854a", "optimizer": "#6acc64", "activations": "#d65f5f"}


def estimate_for(trainer: Trainer, module: LightningModule, batch: Any, **overrides: Any) -> MemoryEstimate | None:
    """The estimator's figures for the running job (None, with a log line, where it cannot say)."""
    kwargs = {
        "world_size": trainer.world_size,
        "precision": str(trainer.precision),
        "micro_batch": _batch_size(batch),
        "activations": callable(getattr(module, "transformer_shape", None)),  # no second forward of a live model
        "numel": shards_of(trainer.strategy).global_numel,  # the live model's parameters may be partitions
    }
    try:
        with _whole_network(trainer.strategy, module):
            return estimate_memory(module, overrides.pop("strategy", trainer.strategy), **{**kwargs, **overrides})
    except Exception as error:  # an estimate is a help, never a reason to stop training
        log.info("lightscale: no memory estimate for this run (%s)", error)
        return None


@contextmanager
def _whole_network(strategy: Any, module: LightningModule) -> Iterator[None]:
    """Under a pipeline ``module.model`` is this rank's stages; the plan's stage names refer to the whole network,
    which parallel_3d keeps aside."""
    network = getattr(strategy, "whole_network", None)
    if network is None or not isinstance(getattr(module, "model", None), nn.Module):
        yield
        return
    stages = set_user_attribute(module, "model", network)
    try:
        yield
    finally:
        set_user_attribute(module, "model", stages)


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    if isinstance(first, dict):
        first = next(iter(first.values()))
    return int(first.shape[0]) if isinstance(first, Tensor) else 1


def draw_timeline(all_ranks: list[list[dict[str, float]]], estimate: MemoryEstimate | None, path: Path) -> Path | None:
    """A stacked timeline by category, one panel per rank, the estimate drawn as a bar beside each."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("lightscale: matplotlib is not installed (pip install lightscale[plot]); no memory.png")
        return None
    ranks = len(all_ranks[0])
    fig, axes = plt.subplots(1, ranks, figsize=(4.5 * ranks, 3.6), squeeze=False, sharey=True)
    for rank, ax in enumerate(axes[0]):
        records = [step[rank] for step in all_ranks]
        steps = [r["step"] for r in records]
        stacks = [[r[c] / 2**20 for r in records] for c in CATEGORIES]
        ax.stackplot(steps, *stacks, labels=CATEGORIES, colors=[COLORS[c] for c in CATEGORIES], alpha=0.85)
        if estimate is not None:
            _estimate_bar(ax, estimate, x=max(steps) + max(1, (max(steps) - min(steps)) * 0.15))
        ax.set_title(f"rank {rank}")
        ax.set_xlabel("optimizer step")
    axes[0][0].set_ylabel("MiB")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle("measured (stacked, per step) and estimated (bar) memory per rank")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _estimate_bar(ax: Any, estimate: MemoryEstimate, *, x: float) -> None:
    bottom = 0.0
    for category in CATEGORIES:
        height = getattr(estimate, category).total / 2**20
        ax.bar(x, height, bottom=bottom, width=0.6, color=COLORS[category], edgecolor="black", hatch="//")
        bottom += height
    ax.annotate("estimate", (x, bottom), ha="center", va="bottom", fontsize=8)


def write_oom_report(
    path: Path, trainer: Trainer, module: LightningModule, error: BaseException, estimate: MemoryEstimate | None
) -> None:
    lines = [f"lightscale out-of-memory report, rank {trainer.global_rank}, step {trainer.global_step}", ""]
    lines += [f"error: {type(error).__name__}: {error}", "", "largest live tensors:"]
    lines += [f"  {human(nbytes):>12}  {kind:<11} {name}" for nbytes, kind, name in top_tensors(module, trainer)]
    lines += ["", "estimate for this run:"]
    lines += [format_estimate(estimate) if estimate is not None else "  (none: see the log)", ""]
    lines += ["what would change it (estimated device bytes per rank):", *_alternatives(trainer, module, estimate)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def top_tensors(module: LightningModule, trainer: Trainer, *, limit: int = 20) -> list[tuple[int, str, str]]:
    """(bytes, category, name) of the largest live tensors, each storage once: parameters and gradients by name,
    optimizer state by its parameter, anything else by shape."""
    names = _tensor_names(module, trainer.optimizers)
    seen: dict[int, tuple[int, str, str]] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, Tensor) or obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue  # tensor subclasses without storage; a storage already freed ("invalid python storage")
        kind, name = names.get(id(obj), ("other", f"{tuple(obj.shape)} {obj.dtype}"))
        if key not in seen or seen[key][1] == "other":
            seen[key] = (size, kind, name)
    return sorted(seen.values(), reverse=True)[:limit]


def _tensor_names(module: LightningModule, optimizers: list[Any]) -> dict[int, tuple[str, str]]:
    names: dict[int, tuple[str, str]] = {}
    for name, param in module.named_parameters():
        names[id(param)] = ("parameter", name)
        if param.grad is not None:
            names[id(param.grad)] = ("gradient", name)
        for optimizer in optimizers:
            state = getattr(getattr(optimizer, "_optimizer", optimizer), "state", {})
            for key, value in state.get(param, {}).items() if isinstance(state, dict) else ():
                if isinstance(value, Tensor):
                    names[id(value)] = ("optimizer", f"{name} [{key}]")
    return names


def _alternatives(trainer: Trainer, module: LightningModule, estimate: MemoryEstimate | None) -> list[str]:
    if estimate is None:
        return ["  (no estimate)"]
    lines = []
    for strategy, checkpointing in memory_alternatives():
        other = estimate_for(
            trainer,
            module,
            None,
            strategy=strategy,
            activation_checkpointing=checkpointing,
            micro_batch=estimate.micro_batch,
        )
        if other is not None and other.device_total < estimate.device_total:
            label = strategy + (f" + {checkpointing} activation checkpointing" if checkpointing else "")
            lines.append(f"  {label} would hold {human(other.device_total)} here (now {human(estimate.device_total)})")
    if not lines:
        lines.append("  no other data-parallel strategy holds less here")
    lines.append("  or lower the micro-batch (activations scale with it) and raise accumulate_grad_batches")
    return lines
