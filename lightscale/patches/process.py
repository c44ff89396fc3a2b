"""Process-wide state lightscale writes: environment variables, ``sys.excepthook``, Lightning's rank-zero rank, and the
attributes it swaps on the user's LightningModule. Each write is one function here, listed in ``PATCHES``.

Example:
    >>> set_environment({"LIGHTSCALE_DATA_SHARD_INDEX": "1"})
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from types import TracebackType
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightscale.patches.table import Patch

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]

PATCHES = [
    Patch(
        "os.environ: LIGHTSCALE_DATA_SHARD_INDEX, _COUNT, _PUBLISHER",
        "environment",
        "lightscale.data_shard() must answer in DataLoader workers and subprocesses the strategy starts, which inherit "
        "the environment and nothing else (lightscale/data/data_shard.py)",
        "a torch.distributed notion of 'the ranks that read different data' that workers inherit",
    ),
    Patch(
        "os.environ: TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_NCCL_DUMP_ON_TIMEOUT, TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "environment",
        "NCCL's flight recorder reads only environment variables, before the process group starts; lightscale sets "
        "the defaults the user did not (lightscale/runtime/flight_recorder.py)",
        "a ProcessGroupNCCL option for the flight recorder",
    ),
    Patch(
        "os.environ: MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE (lightscale.testing)",
        "environment",
        "the gloo test harness starts each rank as a process that must find the others as torchrun's would",
        "none needed: this is torch's documented env:// rendezvous",
    ),
    Patch(
        "os.environ: LIGHTSCALE_LAUNCHER_PID",
        "environment",
        "ranks started by Lightning's launcher learn its pid (to stop when it dies) only through their environment "
        "(lightscale/runtime/launch.py)",
        "a launcher that passes its pid to the processes it starts",
    ),
    Patch(
        "sys.argv",
        "global",
        "`lightscale fit --config X` resolves its arguments in place, so Lightning's launcher re-runs every rank with "
        "the same resolved command (lightscale/cli.py)",
        "a launcher that takes the command to re-run",
    ),
    Patch(
        "sys.excepthook",
        "global",
        "an uncaught exception in one rank is reported to every rank before the process dies "
        "(lightscale/runtime/failure.py wraps the hook in place, torch's [rankK] hook included)",
        "torch.distributed reporting a rank's failure to the others (torchelastic's error files do, per launch)",
    ),
    Patch(
        "rank_zero_only.rank (lightning.pytorch and lightning_utilities)",
        "global",
        "Lightning's rank_zero_* helpers read this module-level rank; lightscale's strategies set it from the "
        "process group as Lightning's own strategies do (lightscale/runtime/processes.py)",
        "a public setter, or the helpers asking the strategy",
    ),
    Patch(
        "LightningModule.model, LightningModule.loss (the user's module)",
        "instance",
        "under a pipeline Lightning calls training_step, which calls self.model / self.loss: for one step call they "
        "run the schedule; the plan's stage names refer to the whole network, swapped back around a report "
        "(lightscale/strategies/parallel_3d/pipeline_step.py, lightscale/callbacks/memory_report.py)",
        "a strategy hook around training_step that may run the step itself (Lightning's _ForwardRedirection is one, "
        "private)",
    ),
]


def set_arguments(arguments: list[str]) -> None:
    """``sys.argv[1:] = arguments``: the command line this process (and every rank Lightning re-launches) sees."""
    sys.argv[1:] = arguments


def set_environment(values: Mapping[str, str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Set ``values`` in ``environ`` (this process and every process it starts)."""
    environ.update(values)


def unset_environment(names: Iterable[str], environ: MutableMapping[str, str] = os.environ) -> None:
    for name in names:
        environ.pop(name, None)


def wrap_excepthook(wrap: Callable[[ExceptHook], ExceptHook]) -> None:
    """``sys.excepthook`` becomes ``wrap(the current hook)``."""
    sys.excepthook = wrap(sys.excepthook)


def set_rank_zero_rank(rank: int) -> None:
    """The rank Lightning's ``rank_zero_*`` helpers (both copies) compare with 0."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # type: ignore[attr-defined]


def set_user_attribute(module: Any, name: str, value: Any) -> Any:
    """``module.name = value`` on the user's module; the previous value (None if it had none)."""
    previous = getattr(module, name, None)
    setattr(module, name, value)
    return previous


def delete_user_attribute(module: Any, name: str) -> None:
    """``del module.name``: an instance attribute set by :func:`set_user_attribute` goes, the method shows again."""
    delattr(module, name)
