"""Bytes of activations: the tensors autograd saves for backward, each storage once, parameters excluded.

:class:`SavedTensors` is a ``saved_tensors_hooks`` pair that adds a tensor's storage when autograd saves it and
subtracts it when the last saved reference dies, so ``peak`` is the most activation memory held at once, pipelines
and gradient accumulation included. It runs on real tensors (the MemoryProfiler) and on meta tensors (the
estimator's one-sample forward) alike. Activation checkpointing keeps a unit's inputs outside autograd's saved
tensors: :func:`count_checkpoint_inputs` adds them through forward pre-hooks, and lightscale's selective policy
reports the outputs it keeps through :func:`note_kept`.

Example:
    >>> with SavedTensors() as saved:
    ...     loss = model(x).sum()
    >>> saved.peak
    1048576
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle


class SavedTensors:
    """Live and peak bytes of saved activations while the context is active (see the module docstring)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.weight_copies = 0  # casts of parameters autocast saves (counted apart: they are not activations)
        self._held: dict[int, int] = {}  # storage id -> bytes, while the storage lives
        self._hooks: Any = None

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)
        self._hooks.__exit__(*exc)
        self._hooks = None

    def add(self, tensor: Tensor) -> None:
        """Count ``tensor``'s storage until the storage is freed (once however many tensors share it)."""
        storage = _local(tensor).untyped_storage()
        key = storage._cdata
        if key in self._held:
            return
        self._held[key] = storage.nbytes()
        self.live += self._held[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)  # storages keep their Python object while alive

    def _release(self, key: int) -> None:
        nbytes = self._held.pop(key, None)
        if nbytes is not None:
            self.live -= nbytes

    def _pack(self, tensor: Tensor) -> Tensor:
        if is_parameter(tensor):
            return tensor
        if is_parameter_copy(tensor):
            self.weight_copies += _local(tensor).untyped_storage().nbytes()
            return tensor
        self.add(tensor)
        return tensor


_ACTIVE: list[SavedTensors] = []  # counters now counting (one per MemoryProfiler step, or an estimate)


def note_kept(value: Any) -> None:
    """Count tensors kept for backward outside saved-tensor hooks (selective checkpointing's cache)."""
    if not _ACTIVE:
        return
    for tensor in _tensors(value):
        if not is_parameter(tensor):
            for counter in _ACTIVE:
                counter.add(tensor)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def is_parameter(tensor: Tensor) -> bool:
    """A leaf that requires grad (a parameter, FSDP's unsharded one included), or a view of one."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def is_parameter_copy(tensor: Tensor) -> bool:
    """A dtype cast of a parameter (autocast keeps one per weight and step)."""
    fn = tensor.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


def checkpointed_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules under torch's composable activation checkpointing."""
    from torch.distributed._composable.contract import _get_registry

    return [m for m in module.modules() if "checkpoint" in (_get_registry(m) or {})]


def count_checkpoint_inputs(modules: Iterable[nn.Module], saved: SavedTensors) -> list[RemovableHandle]:
    """Add each checkpointed module's tensor inputs to ``saved`` while grad is on (checkpoint keeps them for the
    recompute); not during the recompute in backward, which runs its forward again."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and not _in_backward():
            for value in (*args, *kwargs.values()):
                if isinstance(value, Tensor) and value.requires_grad:
                    saved.add(value)

    return [m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True) for m in modules]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
