"""What the strategy classes answer without an instance: a class's keyword arguments as a construction would see
them (for ``layout_for``), every registered name's parameter view (for the optimizer rule's error), the checkpoint
formats a class writes, and what the one-optimizer strategies propose instead. No strategy is built here, so nothing
is patched or started.

Example:
    >>> init_arguments(FSDP2Strategy, {"dp_replicate": 2})["dp_shard"]
    -1
"""

from __future__ import annotations

import inspect
from typing import Any

from lightscale.errors import ConfigurationError
from lightscale.optim.rule import ParameterView
from lightscale.strategies.registry import REGISTERED

# What the strategies that take one optimizer (ZeRO, DiLoCo) name instead, when configure_optimizers returns several.
SEVERAL_OPTIMIZERS = (
    "Several optimizers (e.g. manual optimization of a GAN) run under BucketedDDPStrategy(find_unused_parameters=True) "
    "or an FSDP2 name (fsdp2, hsdp, parallel_3d; tested equal to one process); or use one optimizer with a parameter "
    "group per part of the model."
)


def init_arguments(cls: type, init_params: dict[str, Any]) -> dict[str, Any]:
    """``cls``'s own keyword arguments as a construction with ``init_params`` would see them (its defaults where not
    given), for the answers a class gives without an instance (``layout_for``)."""
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(cls.__init__).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    return defaults | init_params


def names_by_view() -> dict[str, ParameterView]:
    """Every registered strategy name and how its optimizer sees parameters (for lightscale/optim/rule.py's error)."""
    return {
        name: known.parameter_view_for(init_params)
        for known in REGISTERED
        for name, (_, init_params) in known.__dict__["aliases"].items()
    }


def check_checkpoint_format(cls: type[Any], checkpoint_format: str) -> None:
    """Refuse a ``checkpoint_format`` the class does not write, naming its formats and the strategies with "file"."""
    if checkpoint_format in cls.checkpoint_formats:
        return
    with_file = sorted(known.__name__ for known in REGISTERED if "file" in known.checkpoint_formats)
    raise ConfigurationError(
        f"checkpoint_format={checkpoint_format!r} is not available for {cls.__name__}; it writes "
        f"{list(cls.checkpoint_formats)}. 'file' (Lightning's single file, written by rank 0) needs whole parameters "
        f"on every rank: {', '.join(with_file)}. Any checkpoint becomes one file with `lightscale consolidate`."
    )


def no_layout_error(cls: type[Any], default: Any) -> ConfigurationError:
    """The error of a class with no memory layout (``layout_for`` is ``default``), naming the classes that have one."""
    described = [known.__name__ for known in REGISTERED if known.layout_for.__func__ is not default]
    return ConfigurationError(f"No memory layout for {cls.__name__}; lightscale estimates {', '.join(described)}.")
