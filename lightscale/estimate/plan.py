"""Choosing a strategy by memory: the least-communication candidate whose estimate fits the device.

Candidates, in order of communication per optimizer step and rank (Ψ = gradient bytes of the model):
bucketed_ddp, zero1 and zero2 (2Ψ: all-reduce, or reduce-scatter + all-gather), fsdp2 (3Ψ: parameters gathered
again in backward), fsdp2 with full activation checkpointing (3Ψ and a second forward), fsdp2_offload (3Ψ plus
host transfers), then tensor parallelism (tp2: per-layer collectives) when the model has a TP plan.

Example:
    >>> rows = plan(GPTModule(config), world_size=8, budget=40 * 2**30, precision="bf16-mixed", micro_batch=8)
    >>> print(format_plan(rows))
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightscale.estimate.core import MemoryEstimate, estimate_memory
from lightscale.estimate.report import human
from lightscale.parallel.contract import has_hook

# (strategy name, activation checkpointing, communication per step in units of Ψ, what it adds)
CANDIDATES: tuple[tuple[str, str | None, str, str], ...] = (
    ("bucketed_ddp", None, "2Ψ", "replicated states, one all-reduce of the gradients"),
    ("zero1", None, "2Ψ", "optimizer state sharded"),
    ("zero2", None, "2Ψ", "+ gradients sharded"),
    ("fsdp2", None, "3Ψ", "+ parameters sharded, re-gathered in backward"),
    ("fsdp2", "full", "3Ψ", "+ activations recomputed per block (a second forward)"),
    ("fsdp2_offload", "full", "3Ψ + host", "+ states in host memory (the optimizer steps on the CPU)"),
)
TP_CANDIDATE = ("tp2", "full", "3Ψ/2 + 4bsh/layer", "+ tensor parallel over 2 ranks (layers split)")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    activation_checkpointing: str
    communication: str
    note: str
    estimate: MemoryEstimate
    fits: bool


def plan(
    module: nn.Module, *, world_size: int, budget: float, precision: str = "32-true", micro_batch: int = 1
) -> list[Candidate]:
    """Every candidate with its estimate and whether it fits ``budget`` device bytes per rank."""
    rows = list(CANDIDATES)
    if has_hook(module, "tp_plan") and world_size % 2 == 0:
        rows.append(TP_CANDIDATE)
    candidates = []
    for name, checkpointing, comm, note in rows:
        est = estimate_memory(
            module,
            name,
            world_size=world_size,
            precision=precision,
            micro_batch=micro_batch,
            activation_checkpointing=checkpointing,
            activations=has_hook(module, "transformer_shape"),  # else model states only: no forward at plan time
        )
        candidates.append(Candidate(name, est.activation_checkpointing, comm, note, est, est.device_total <= budget))
    return candidates


def choose(candidates: list[Candidate]) -> Candidate | None:
    """The first (least-communication) candidate that fits, or None."""
    return next((c for c in candidates if c.fits), None)


def format_plan(candidates: list[Candidate], *, budget: float) -> str:
    chosen = choose(candidates)
    source = candidates[0].estimate.activation_source if candidates else ""
    lines = [
        f"activations: {source}",
        f"candidates by communication per step (Ψ = gradient bytes), device budget {human(budget)} per rank:",
        f"  {'strategy':<14} {'act. ckpt':<9} {'comm':<18} {'device':>11} {'host':>11}  fits",
    ]
    for c in candidates:
        mark = "  <- chosen" if c is chosen else ""
        lines.append(
            f"  {c.strategy:<14} {c.activation_checkpointing:<9} {c.communication:<18} "
            f"{human(c.estimate.device_total):>11} {human(c.estimate.host_total):>11}  "
            f"{'yes' if c.fits else 'no':<3}{mark}"
        )
    if chosen is None:
        lines.append("  nothing fits: lower the micro-batch, add ranks, or raise the budget")
    else:
        lines.append(f"  chose {chosen.strategy}: the least communication that fits ({chosen.note})")
    return "\n".join(lines)


def plan_command(argv: list[str]) -> None:
    """``lightscale plan --config FILE [fit overrides] [--world-size N] --device-memory 80GiB``."""
    from lightscale.estimate.report import own_arguments, read_run_config

    ours, rest = own_arguments("lightscale plan", argv)
    run = read_run_config(rest, world_size=ours.world_size)
    budget = ours.device_memory or device_budget()
    rows = plan(
        run.module, world_size=run.world_size, budget=budget, precision=run.precision, micro_batch=run.micro_batch
    )
    print(format_plan(rows, budget=budget))


def device_budget(local_ranks: int = 1) -> float:
    """This machine's accelerator memory, or (without CUDA) its physical memory shared by ``local_ranks``."""
    import os

    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / max(1, local_ranks)
