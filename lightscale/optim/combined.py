"""Several optimizers stepped as one: Muon for the weight matrices, AdamW for the rest, from one configure_optimizers.

Lightning's automatic optimization, ZeRO and DiLoCo take one optimizer; two (the usual Muon recipe) needed manual
optimization. :class:`CombinedOptimizer` is one ``torch.optim.Optimizer`` over the parts' own objects: its
``param_groups`` are theirs (an LR scheduler built on it schedules every group), its ``state`` is a view of theirs,
``step`` runs the closure once and then steps each part on those of its groups in ``param_groups`` (all of them, unless
an engine narrowed ``param_groups`` to the group it steps, as DeepSpeed's ZeRO does), and its ``state_dict`` is torch's
format over the groups in order (the parts' state dicts, renumbered), so checkpoints hold both states and load under
every strategy. torch has no such class (torch.optim lists none). The strategies check each part
(lightscale/optim/rule.py): Muon inside it runs where Muon runs. Under ZeRO, DeepSpeed makes one flat partition per
group, puts it in the group (the part's own dict) and steps the optimizer with ``param_groups`` narrowed to that group:
each part steps its own partitions (torch's Muon as FlatMuon, told where its matrices lie: lightscale/optim/install.py
``attach_flat``).

Example:
    >>> def configure_optimizers(self):
    ...     matrices = [p for p in self.parameters() if p.ndim == 2]
    ...     rest = [p for p in self.parameters() if p.ndim != 2]
    ...     return CombinedOptimizer([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)])
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from lightscale.optim.closure import closure_loss


class CombinedOptimizer(torch.optim.Optimizer):
    """One optimizer made of ``optimizers`` (each parameter in exactly one); see the module docstring."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError(f"CombinedOptimizer takes a list of torch optimizers, got {optimizers!r}.")
        self.optimizers = list(optimizers)
        params = [p for o in self.optimizers for group in o.param_groups for p in group["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("CombinedOptimizer: a parameter is in two of its optimizers; give each to exactly one.")
        super().__init__(params, {})
        self.sync_groups()

    def sync_groups(self) -> None:
        """Take the parts' groups again (after a part was replaced, e.g. by the strategy's exact optimizer)."""
        self.param_groups = [group for o in self.optimizers for group in o.param_groups]

    @property  # type: ignore[override]
    def state(self) -> MutableMapping[torch.Tensor, Any]:
        return _States(self.optimizers)

    @state.setter
    def state(self, value: Any) -> None:
        pass  # torch's __init__ assigns an empty dict; the parts hold the state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        current = {id(group) for group in self.param_groups}  # ZeRO steps one group at a time: only those
        for optimizer in self.optimizers:
            mine = [group for group in optimizer.param_groups if id(group) in current]
            if mine:
                _step_groups(optimizer, mine)
        return loss

    def own(self, tensor: torch.Tensor, group_index: int) -> None:
        """Keep ``tensor``'s state in the part holding group ``group_index``: an engine's stand-in for that group's
        parameters (ZeRO's flat partition, which ZeRO-3 leaves in no group between steps)."""
        group = self.param_groups[group_index]
        part = next(o for o in self.optimizers if any(mine is group for mine in o.param_groups))
        part.state.setdefault(tensor, {})  # an empty entry: torch's optimizers create their state in it

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizers") and self.param_groups:
            raise NotImplementedError("Add the group to one of CombinedOptimizer.optimizers, then call sync_groups().")
        super().add_param_group(param_group)  # torch's __init__: replaced by the parts' groups right after

    def state_dict(self) -> dict[str, Any]:
        """torch's format over all groups in order: each part's state dict with its parameters renumbered."""
        state, groups, offset = {}, [], 0
        for optimizer in self.optimizers:
            part = optimizer.state_dict()
            state.update({offset + index: value for index, value in part["state"].items()})
            groups += [{**group, "params": [offset + i for i in group["params"]]} for group in part["param_groups"]]
            offset += sum(len(group["params"]) for group in part["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Split ``state_dict`` by groups into the parts' and load each. The parameter ids are whatever the writer
        used (:meth:`state_dict`'s numbers, torch.distributed.checkpoint's names): torch matches them by position."""
        groups = list(state_dict["param_groups"])
        for optimizer in self.optimizers:
            mine, groups = groups[: len(optimizer.param_groups)], groups[len(optimizer.param_groups) :]
            ids = [i for group in mine for i in group["params"]]
            state = {i: state_dict["state"][i] for i in ids if i in state_dict["state"]}
            optimizer.load_state_dict({"state": state, "param_groups": mine})
        if groups:
            raise ValueError(f"CombinedOptimizer.load_state_dict: {len(groups)} parameter groups left over.")
        self.sync_groups()  # torch's load_state_dict gives each part new group dicts


def _step_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Step ``optimizer`` on ``groups`` (some or all of its own), as DeepSpeed steps its optimizer per group."""
    if len(groups) == len(optimizer.param_groups):
        optimizer.step()
        return
    original = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = original


class _States(MutableMapping):
    """The parts' ``state`` as one mapping from parameter to its state (each read or written in its owner's)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def _owner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        """The part holding ``param``'s state, else the part whose groups hold ``param`` (state not created yet). The
        state is looked up first: an engine may have replaced the groups' tensors (DeepSpeed's flat partitions)."""
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return optimizer
        for optimizer in self.optimizers:
            if any(p is param for group in optimizer.param_groups for p in group["params"]):
                return optimizer
        raise KeyError(param)

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._owner(param).state[param]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (param for optimizer in self.optimizers for param in optimizer.state)

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self.optimizers)
