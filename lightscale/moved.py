"""Module paths that moved in the 0.2 reorganisation keep importing, as aliases of the modules' new homes.

One table, read by a finder on ``sys.meta_path``: ``import lightscale.strategies.processes`` (or a pickle naming a
class there, or ``python -m lightscale.strategies.deepspeed_ops``) gets the very module object now at
``lightscale.runtime.processes`` - not a copy, so classes and ``isinstance`` stay one. Remove a row a release after
its move.

Example:
    >>> import lightscale.strategies.processes as old, lightscale.runtime.processes as new
    >>> old is new
    True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

MOVED = {
    "lightscale.streams": "lightscale.data.streams",
    "lightscale.strategies.processes": "lightscale.runtime.processes",
    "lightscale.strategies.launch": "lightscale.runtime.launch",
    "lightscale.strategies.failure": "lightscale.runtime.failure",
    "lightscale.strategies.flight_recorder": "lightscale.runtime.flight_recorder",
    "lightscale.parallel.collectives": "lightscale.runtime.collectives",
    "lightscale.strategies.sampler": "lightscale.data.sampler",
    "lightscale.strategies.loader_position": "lightscale.data.loader_position",
    "lightscale.parallel.data_shard": "lightscale.data.data_shard",
    "lightscale.parallel.batch_agreement": "lightscale.data.batch_agreement",
    "lightscale.checkpoint.loader_state": "lightscale.data.loader_state",
    "lightscale.parallel.moe": "lightscale.layers.moe",
    "lightscale.parallel.grouped_mm": "lightscale.layers.grouped_mm",
    "lightscale.parallel.float8": "lightscale.layers.float8",
    "lightscale.strategies.deepspeed_config": "lightscale.zero.config",
    "lightscale.strategies.deepspeed_engine": "lightscale.zero.engine",
    "lightscale.strategies.deepspeed_ops": "lightscale.zero.ops",
    "lightscale.checkpoint.deepspeed_dir": "lightscale.zero.checkpoint_dir",
    "lightscale.checkpoint.zero_portable": "lightscale.zero.portable_save",
    "lightscale.checkpoint.atomic_dir": "lightscale.storage.atomic_dir",
    "lightscale.checkpoint.safe_io": "lightscale.storage.safe_io",
    "lightscale.checkpoint.safe_dcp": "lightscale.storage.safe_dcp",
    "lightscale.checkpoint.shape_check": "lightscale.storage.shape_check",
    "lightscale.checkpoint.shared_dir": "lightscale.storage.shared_dir",
    "lightscale.strategies.checkpointing": "lightscale.strategies.checkpoint_hooks",
    "lightscale.checkpoint.layout_file": "lightscale.checkpoint.portable_file",
    "lightscale.checkpoint.layout": "lightscale.checkpoint.portable",
    "lightscale.parallel.context_parallel.layout": "lightscale.parallel.context_parallel.token_split",
    "lightscale.estimate.layout": "lightscale.estimate.memory_layout",
    "lightscale.parallel.schedule_plot": "lightscale.commands.schedule_plot",
    "lightscale.strategies.parallel_3d_model": "lightscale.strategies.parallel_3d.model",
    "lightscale.strategies.pipeline_step": "lightscale.strategies.parallel_3d.pipeline_step",
    "lightscale.strategies.context_parallel_step": "lightscale.strategies.parallel_3d.context_parallel_step",
    "lightscale.strategies.diloco_fault_tolerant": "lightscale.strategies.diloco.fault_tolerant",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds an old path and loads it as the module at the new one (``get_code`` serves ``python -m old``)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Already executed under its new name; importlib just gave it the alias's ``__spec__``: its own back."""
        module.__spec__ = importlib.util.spec_from_file_location(module.__name__, module.__file__)

    def get_code(self, fullname: str) -> CodeType | None:
        spec = importlib.util.find_spec(MOVED[fullname])
        assert spec is not None and isinstance(spec.loader, importlib.abc.InspectLoader)
        return spec.loader.get_code(MOVED[fullname])

    def get_source(self, fullname: str) -> str | None:
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once per process."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
