"""What an :class:`~lightscale.parallel.diloco.outer_sync.OuterSync` is configured with, and its checks: the modes,
the outer optimizer's defaults by ``H`` (the sweep in docs/benchmarks.md), the factories that build it, and the
refusals of settings that cannot work together (raised before any collective).

Example:
    >>> default_outer_step(30)
    (0.7, 0.5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from lightscale.errors import ConfigurationError
from lightscale.parallel.diloco.wire import validate_compression

Mode = Literal["diloco", "local_sgd"]
MODES: tuple[str, ...] = ("diloco", "local_sgd")
OuterOptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]
Reducer = Callable[[Tensor], "Tensor | None"]  # this worker's flat fp32 payload -> the workers' mean, or None: skip


# (largest H, outer lr, outer momentum): the defaults up to the largest H swept (docs/benchmarks.md, "DiLoCo"), the
# best setting at H = 10 and 30 (first row) and at H = 100 (second); each beat local SGD at its H, which the paper's
# 0.7 / 0.9 (tuned for H=500 over hundreds of rounds) did not at any H swept. Above the sweep the paper's stand.
OUTER_STEP_BY_H: tuple[tuple[int, float, float], ...] = ((50, 0.7, 0.5), (100, 1.0, 0.5))
PAPER_OUTER_STEP = (0.7, 0.9)  # Douillard et al. 2023, H=500


def default_outer_step(sync_every: int) -> tuple[float, float]:
    """The default outer SGD ``(lr, Nesterov momentum)`` for ``H = sync_every`` (the paper's above the table)."""
    for largest_h, lr, momentum in OUTER_STEP_BY_H:
        if sync_every <= largest_h:
            return lr, momentum
    return PAPER_OUTER_STEP


def sgd_outer_optimizer(lr: float, momentum: float) -> OuterOptimizerFactory:
    """Builds the outer SGD (Nesterov when ``momentum > 0``) over the tensors it is given."""

    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return build


def nesterov_outer_optimizer(params: list[Tensor]) -> torch.optim.Optimizer:
    """The DiLoCo paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""
    return sgd_outer_optimizer(*PAPER_OUTER_STEP)(params)


def check_outer_sync(
    named: list[tuple[str, Tensor]], mode: str, compression: str, outer_optimizer: OuterOptimizerFactory | None
) -> None:
    if not named:
        raise ConfigurationError("OuterSync got no parameters; pass model.named_parameters() of a model that has some.")
    check_outer_settings(mode, compression)
    if mode == "local_sgd" and outer_optimizer is not None:
        raise ConfigurationError(
            "mode='local_sgd' averages parameters and has no outer optimizer; "
            "drop outer_optimizer or use mode='diloco'."
        )


def check_outer_settings(mode: str, compression: str) -> None:
    """Refuse an unknown mode or compression, and compression of local SGD's parameters (before any work)."""
    if mode not in MODES:
        raise ConfigurationError(f"mode={mode!r} is not valid; choose one of {', '.join(MODES)}.")
    validate_compression(compression)
    if mode == "local_sgd" and compression != "none":
        raise ConfigurationError(
            f"compression={compression!r} cannot serve mode='local_sgd': it would round the parameters themselves "
            f"at every sync. Use compression='none', or mode='diloco' (whose pseudo-gradients compress well) with "
            f"outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0), which averages parameters the same way."
        )


def check_synchronous_steps(synchronous_steps: int, *, fault_tolerant: bool) -> None:
    """Refuse a negative or non-integer count, and synchronous steps between fault-tolerant workers."""
    if isinstance(synchronous_steps, bool) or not isinstance(synchronous_steps, int) or synchronous_steps < 0:
        raise ConfigurationError(f"synchronous_steps={synchronous_steps!r} is not valid; it must be an integer >= 0.")
    if fault_tolerant and synchronous_steps:
        raise ConfigurationError(
            f"synchronous_steps={synchronous_steps} needs every worker in one job, averaging every step's gradients; "
            f"fault-tolerant workers are separate jobs. Use synchronous_steps=0 with fault tolerance."
        )


def check_reduce(reduce: Reducer | None, compression: str, overlap_steps: int, synchronous_steps: int) -> None:
    check_synchronous_steps(synchronous_steps, fault_tolerant=reduce is not None)
    if reduce is not None and (compression != "none" or overlap_steps != 0):
        raise ConfigurationError(
            f"A custom reduce (fault-tolerant DiLoCo) averages fp32 payloads at once; it needs compression='none' "
            f"and overlap_steps=0, not compression={compression!r}, overlap_steps={overlap_steps}."
        )


def build_outer_optimizer(factory: OuterOptimizerFactory, params: list[Tensor]) -> torch.optim.Optimizer:
    optimizer = factory(params)
    given = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if given != {id(p) for p in params}:
        raise ConfigurationError("outer_optimizer must build an optimizer over exactly the tensors it is given.")
    for group in optimizer.param_groups:
        lr = float(group.get("lr", 1.0))
        if not lr > 0:
            raise ConfigurationError(f"The outer optimizer's lr={lr} is not valid; it must be > 0 (DiLoCo uses 0.7).")
    return optimizer


def check_saved_settings(saved: dict[str, Any], current: dict[str, Any]) -> None:
    changed = {key: (saved.get(key), value) for key, value in current.items() if saved.get(key) != value}
    if changed:
        described = ", ".join(f"{key}: saved {old!r}, now {new!r}" for key, (old, new) in changed.items())
        raise ConfigurationError(
            f"The OuterSync state was saved with other settings ({described}); resume with the saved settings."
        )
