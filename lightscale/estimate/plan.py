"""Choosing a strategy by memory: the least-communication candidate whose estimate fits the device.

Each strategy class declares which of its names the planner may choose (``plannable``: a tuple of
:class:`Plannable`); ``lightscale.strategies.registry.plan_candidates()`` collects them in ``registry.ORDER``,
which is the order of communication per optimizer step and rank (Ψ = gradient bytes of the model): bucketed_ddp, zero1
and zero2 (2Ψ: all-reduce, or reduce-scatter + all-gather), fsdp2 (3Ψ: parameters gathered again in backward),
fsdp2 with full activation checkpointing (3Ψ and a second forward), fsdp2_offload (3Ψ plus host transfers), then
context parallelism (cp2: the K/V of each attention layer passed around a ring; sequences, so activations, split in
two) for declared transformers, then tensor parallelism (tp2: per-layer collectives) when the model has a TP plan.

Example:
    >>> rows = plan(GPTModule(config), plan_candidates(), world_size=8, budget=40 * 2**30, micro_batch=8)
    >>> print(format_plan(rows, budget=40 * 2**30))
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightscale.estimate.core import MemoryEstimate, estimate_memory
from lightscale.estimate.report import human
from lightscale.parallel.contract import has_hook


@dataclass(frozen=True)
class Plannable:
    """One registered name the planner may choose, as its strategy class declares it.

    Example:
        >>> Plannable("fsdp2", "3Ψ", "+ activations recomputed per block", activation_checkpointing="full")
    """

    strategy: str  # a registered name
    communication: str  # per step and rank, in units of Ψ
    note: str  # what it adds over the previous candidate
    activation_checkpointing: str | None = None  # None: the strategy's own mode
    tp: int = 1  # > 1: only for models with a TP plan, on a world size this divides
    cp: int = 1  # > 1: only for declared transformers (transformer_shape: SDPA attention), on a world size it divides
    needs: str | None = None  # the module of an optional engine (an extra): without it the row is shown, never chosen

    @classmethod
    def of(
        cls,
        aliases: dict[str, tuple[str, dict[str, object]]],
        name: str,
        communication: str,
        note: str,
        **kwargs: object,
    ) -> Plannable:
        """The candidate ``name`` with the ``tp``/``cp`` degrees its alias registers, so they are typed once.

        Example:
            >>> Plannable.of({"tp2": ("...", {"tp": 2})}, "tp2", "3Ψ/2", "+ layers split").tp
            2
        """
        degrees = {axis: aliases[name][1][axis] for axis in ("tp", "cp") if axis in aliases[name][1]}
        return cls(name, communication, note, **degrees, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Candidate:
    strategy: str
    activation_checkpointing: str
    communication: str
    note: str
    estimate: MemoryEstimate
    fits: bool
    missing: str | None = None  # the engine this candidate needs and this environment lacks


def plan(
    module: nn.Module,
    options: Sequence[Plannable],
    *,
    world_size: int,
    budget: float,
    precision: str = "32-true",
    micro_batch: int = 1,
) -> list[Candidate]:
    """Every applicable option with its estimate and whether it fits ``budget`` device bytes per rank."""
    tensor_parallel = has_hook(module, "tp_plan")
    transformer = has_hook(module, "transformer_shape")
    candidates = []
    for option in options:
        if option.tp > 1 and not (tensor_parallel and world_size % option.tp == 0):
            continue
        if option.cp > 1 and not (transformer and world_size % option.cp == 0):
            continue
        est = estimate_memory(
            module,
            option.strategy,
            world_size=world_size,
            precision=precision,
            micro_batch=micro_batch,
            activation_checkpointing=option.activation_checkpointing,
            activations=has_hook(module, "transformer_shape"),  # else model states only: no forward at plan time
        )
        missing = option.needs if option.needs and importlib.util.find_spec(option.needs) is None else None
        fits = est.device_total <= budget and missing is None
        candidates.append(
            Candidate(
                option.strategy, est.activation_checkpointing, option.communication, option.note, est, fits, missing
            )
        )
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
            f"{'yes' if c.fits else 'no':<3}{mark}{f'  (needs the [{c.missing}] extra)' if c.missing else ''}"
        )
    if chosen is None:
        lines.append("  nothing fits: lower the micro-batch, add ranks, or raise the budget")
    else:
        lines.append(f"  chose {chosen.strategy}: the least communication that fits ({chosen.note})")
    return "\n".join(lines)


def device_budget(local_ranks: int = 1) -> float:
    """This machine's accelerator memory, or (without CUDA) its physical memory shared by ``local_ranks``."""
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / max(1, local_ranks)
