"""One meaning of each precision name under every lightscale strategy.

Lightning silently turns ``precision="16-mixed"`` into ``"bf16-mixed"`` on CPU; lightscale never changes a
setting behind the user's back, so on CPU it runs fp16 autocast with a real gradient scaler (torch supports
both on CPU) and otherwise leaves the choice to Lightning's standard plugins.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry

from lightscale.errors import ConfigurationError
from lightscale.plugins.fsdp_precision import Float8Precision
from lightscale.plugins.precision_contract import (
    FLOAT8,
    PRECISIONS,
    PrecisionRules,
    normalize_precision,
    refuse_impossible,
)

SUPPORTED = ("32", *PRECISIONS)  # Lightning's "32" too: normalize_precision reads it as "32-true"


def check_precision(precision: str | int | None) -> None:
    """Reject precision names lightscale strategies do not give one meaning to."""
    if precision is None or str(precision) in SUPPORTED:
        return
    raise ConfigurationError(
        f"precision={precision!r} is not supported by lightscale; choose one of {', '.join(SUPPORTED)}."
    )


def maybe_cpu_fp16_plugin(precision: str | int | None, accelerator: object) -> Precision | None:
    """The plugin that keeps ``16-mixed`` meaning fp16 + loss scaling on CPU, or None to let Lightning decide."""
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if str(precision) != "16-mixed" or not on_cpu:
        return None
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def maybe_float8_plugin(
    precision: str | int | None, plugins: list[object], accelerator: object
) -> Float8Precision | None:
    """The Float8Precision a Trainer runs with: the one in ``plugins``, or one made for ``precision="float8"`` /
    ``"float8-rowwise"`` on this device; None without float8."""
    given = [plugin for plugin in plugins if isinstance(plugin, Float8Precision)]
    if given and precision is not None:
        raise ConfigurationError(
            f"precision={precision!r} and a Float8Precision plugin were both given; pass one of them (the plugin "
            "carries the float8 recipe)."
        )
    if given:
        return given[0]
    if str(precision) in FLOAT8:
        return Float8Precision(str(precision), "cpu" if _on_cpu(accelerator) else "cuda")
    return None


def check_strategy_precision(
    strategy: object, precision: str | int | None, accelerator: object, *, emulate: bool = False
) -> None:
    """Refuse, at Trainer construction, a precision the strategy's engine cannot run on this device."""
    rules = _precision_rules(strategy)
    if rules is None and str(precision) in FLOAT8:
        raise ConfigurationError(
            f"precision={precision!r} runs under the fsdp2 and parallel_3d strategies (fsdp2 also on one device), "
            f"which convert the model's Linear layers on their parallelize path; strategy={strategy!r} has none."
        )
    if rules is None or precision is None:
        return
    name = normalize_precision(precision)
    compression = getattr(strategy, "compression", "none")  # an instance's argument; a name's class has none
    compression = compression if isinstance(compression, str) else "none"
    device_type = "cpu" if _on_cpu(accelerator) else "cuda"
    refuse_impossible(rules, name, device_type=device_type, compression=compression, emulate=emulate)


def _on_cpu(accelerator: object) -> bool:
    return accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())


def _precision_rules(strategy: object) -> PrecisionRules | None:
    """The rules the strategy's class declares (a name's class is read from the registry, no instance built)."""
    if isinstance(strategy, str):
        strategy = dict.get(StrategyRegistry, strategy.lower(), {}).get("strategy")  # the class, not an instance
    return getattr(strategy, "precision_rules", None)
