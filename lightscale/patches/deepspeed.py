"""DeepSpeed names and environment lightscale sets, swaps or stubs, where DeepSpeed offers no argument for it.

DeepSpeed itself is imported inside the functions that need it (the ``[deepspeed]`` extra stays optional).

Example:
    >>> name_cpu_accelerator()  # before DeepSpeed's first import on a machine without CUDA
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightscale.patches.private_reads import read
from lightscale.patches.table import Patch

PATCHES = [
    Patch(
        "os.environ:DS_ACCELERATOR",
        "environment",
        "without CUDA DeepSpeed probes every accelerator at its first import and warns in every process; naming the "
        "CPU first (setdefault: a user's value wins) skips the probe",
        "DeepSpeed detecting the CPU quietly when torch has no other device",
    ),
    Patch(
        "os.environ:TORCH_EXTENSIONS_DIR",
        "environment",
        "DeepSpeed JIT-builds its CPU ops (CPU Adam, async I/O) into torch's extensions directory; one per virtual "
        "environment (setdefault) lets `make venv` build them once where every run finds them",
        "DeepSpeed shipping its CPU ops prebuilt, or a per-environment default in torch",
    ),
    Patch(
        "DeepSpeedEngine.checkpoint_engine",
        "instance",
        "DeepSpeed's TorchCheckpointEngine loads with weights_only=False: a resumed engine gets one that never "
        "unpickles code",
        "a weights_only option in DeepSpeed's checkpoint config",
        signature=(
            "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.load",
            ("self", "path", "map_location"),
        ),
        attributes=("deepspeed.runtime.engine:DeepSpeedEngine", ("checkpoint_engine", "_config")),
    ),
    Patch(
        "DeepSpeedZeRoOffload._restore_from_bit16_weights",
        "instance",
        "ZeRO-3 evaluation has no optimizer (DeepSpeedZeRoOffload stands in) yet DeepSpeed's load_checkpoint calls "
        "this refresh; a no-op on the stand-in",
        "DeepSpeed skipping the refresh when load_optimizer_states=False and there is no optimizer",
        attributes=("deepspeed.runtime.engine:DeepSpeedEngine", ("optimizer._restore_from_bit16_weights",)),
    ),
    Patch(
        "DeepSpeedZeroOptimizer._hp_optimizer_states_linked",
        "instance",
        "ZeRO-1/2 link each parameter to views of its optimizer state once, after stepping the first group only; "
        "resetting the flag and linking again makes every group's links whole before a portable save",
        "DeepSpeed linking every group in _lazy_init_hp_params_optimizer_state",
        signature=(
            "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
            ("self",),
        ),
        attributes=("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", ("_hp_optimizer_states_linked",)),
    ),
    Patch(
        "deepspeed.utils.zero_to_fp32.torch (module global)",
        "global",
        "zero_to_fp32 loads every shard with weights_only=False; while lightscale consolidates, its module global "
        "`torch` is a stand-in whose load is weights-only (restored after, also on error)",
        "a weights_only argument to get_fp32_state_dict_from_zero_checkpoint",
        signature=("deepspeed.utils.zero_to_fp32:get_fp32_state_dict_from_zero_checkpoint", ("checkpoint_dir", "tag")),
    ),
    Patch(
        "DeepSpeedZeroOptimizer._grad_acc_hooks, parameter_offload.FWD_MODULE_STACK, "
        "PartitionedParameterCoordinator.__params_to_release's lru_cache",
        "global",
        "after a fit the engine stays (save_checkpoint, evaluation) but its gradient hooks, held by autograd in C++, "
        "close a cycle Python's collector cannot see, and ZeRO-3's module stack and a class-wide cache keep the "
        "module: every ZeRO fit in a process kept its whole model and optimizer. The hooks are removed (backward "
        "is over), the engine's module leaves the stack and the cache is emptied",
        "DeepSpeed releasing these when an engine is dropped (DeepSpeedEngine.destroy also removes the forward hooks "
        "evaluation after fit still needs)",
        attributes=("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3", ("_grad_acc_hooks",)),
    ),
    # private DeepSpeed names read or called (as lightscale/patches/private_reads.py lists the others'), kept here:
    # DeepSpeed's names appear only in zero/ and this module (tests/unit/test_deepspeed_confined.py)
    read("deepspeed.runtime.engine", "DeepSpeedEngine.set_gradient_accumulation_boundary", "ZeRO accumulation"),
    read("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.load", "weights-only"),
    read("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint", "lightscale export (ZeRO)"),
    read(
        "deepspeed.runtime.zero.stage_1_and_2",
        "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
        "ZeRO DCP",
    ),
    read("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_lp_params", "ZeRO DCP: bit16 copies"),
    read(
        "deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.get_full_hp_param", "ZeRO DCP: safe_get_full_*"
    ),
    read("deepspeed.utils", "safe_set_full_optimizer_state", "ZeRO DCP load (public, checked for 0.19.x)"),
    read("deepspeed.utils", "safe_set_local_fp32_param", "ZeRO-3 DCP load: this rank's padded piece (public)"),
    read("deepspeed.utils", "safe_set_local_optimizer_state", "ZeRO-3 DCP load: this rank's padded piece (public)"),
]


def name_cpu_accelerator() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def extensions_dir() -> Path:
    """Where DeepSpeed's CPU ops are built and found (set for this process if the user has not)."""
    return Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")))


def replace_checkpoint_engine(engine: Any, make: Callable[[Any], Any]) -> None:
    """Give ``engine`` the checkpoint engine ``make(engine._config)`` when it has DeepSpeed's torch one."""
    if type(engine.checkpoint_engine).__name__ == "TorchCheckpointEngine":
        engine.checkpoint_engine = make(engine._config)


def skip_bit16_refresh(optimizer: Any) -> None:
    """On ZeRO-3's evaluation stand-in (no fp32 master): the refresh DeepSpeed calls after loading does nothing."""
    if optimizer is not None and not hasattr(optimizer, "_restore_from_bit16_weights"):
        optimizer._restore_from_bit16_weights = lambda: None


def relink_optimizer_states(zero: Any) -> None:
    """ZeRO-1/2: link every parameter group to views of its optimizer state (see ``PATCHES``)."""
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


@contextmanager
def zero_to_fp32_loading_with(load: Callable[..., Any]) -> Iterator[Any]:
    """DeepSpeed's zero_to_fp32 module, every ``torch.load`` in it served by ``load(path, map_location, mmap)``."""
    from deepspeed.utils import zero_to_fp32

    class _Torch:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def load(path: Any, map_location: Any = None, mmap: bool = False, **_: Any) -> Any:
            return load(path, map_location=map_location, mmap=mmap)

    original = zero_to_fp32.torch
    zero_to_fp32.torch = _Torch()
    try:
        yield zero_to_fp32
    finally:
        zero_to_fp32.torch = original


def release_training_references(engine: Any) -> None:
    """Let ``engine``'s model and optimizer be freed once nothing else holds them (see ``PATCHES``); the engine
    still saves and evaluates."""
    optimizer = getattr(engine, "optimizer", None)
    for hook in getattr(optimizer, "_grad_acc_hooks", ()):
        hook.remove()
    if optimizer is not None and hasattr(optimizer, "_grad_acc_hooks"):
        optimizer._grad_acc_hooks = []
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:
        offload.FWD_MODULE_STACK[:] = [m for m in offload.FWD_MODULE_STACK if m is not engine.module]
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        owner = coordinator.PartitionedParameterCoordinator
        cached = vars(owner).get("_PartitionedParameterCoordinator__params_to_release")
        for cell in getattr(cached, "__closure__", None) or ():  # under DeepSpeed's nvtx wrapper
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()
