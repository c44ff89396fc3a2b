"""What ``FSDP2Strategy(fault_tolerant=...)`` adds (hsdp through torchft): each launch is one replica that shards
inside (plain FSDP2 over its own ranks); the replicate dimension across launches is torchft's, managed per step.

After FSDP2's reduce-scatter inside the replica, rank ``r`` averages its local gradient shards with rank ``r`` of
the other replicas of the step (lightscale/fault_tolerance/step.py); ``should_commit`` gates the optimizer
step. A healing rank ``r`` receives rank ``r``'s shards from a live replica: the state travels as local tensors and
is wrapped back into DTensors like this replica's own parameters on load.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.replica import FaultTolerantReplica
from lightscale.fault_tolerance.settings import FaultTolerance


def check_replicate_under_ft(ft: FaultTolerance | None, dp_replicate: int) -> None:
    """Under ``fault_tolerant=`` the replicate dimension is torchft's, across launches: replica groups inside a
    launch as well are not supported (refused, not silently set to 1)."""
    if ft is not None and dp_replicate != 1:
        raise ConfigurationError(
            f"dp_replicate={dp_replicate} cannot run with fault_tolerant: each launch is one replica that shards over "
            "its own ranks, and the replicas are the launches torchft meets each step; use dp_replicate=1 "
            "(FSDP2Strategy(fault_tolerant=..., dp_replicate=1); the hsdp name's default is 2) and start one launch "
            "per replica."
        )


def local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def like(value: Any, template: Any) -> Any:
    """``value`` (a local shard) as a DTensor placed like ``template`` when that is one."""
    if not isinstance(template, DTensor) or not isinstance(value, Tensor) or value.shape != local(template).shape:
        return value
    return DTensor.from_local(
        value,
        template.device_mesh,
        template.placements,
        shape=template.shape,
        stride=template.stride(),
        run_check=False,
    )


class ShardedFaultTolerantReplica(FaultTolerantReplica):
    """A replica whose ranks hold DTensor shards: they travel as this rank's local shards, and its gradient shards
    are averaged across replicas once backward ran (FSDP2's reduce-scatter done)."""

    def gradients_after_backward(self) -> list[Tensor]:
        assert self.trainer is not None
        return local_gradient_shards(self.trainer.lightning_module)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["model"] = {name: local(value) for name, value in state["model"].items()}
        state["optimizers"] = [_localized(saved) for saved in state["optimizers"]]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        assert trainer is not None
        own = trainer.lightning_module.state_dict()
        state["model"] = {name: like(value, own[name]) for name, value in state["model"].items()}
        state["optimizers"] = [
            _rewrapped(saved, optimizer)
            for saved, optimizer in zip(state["optimizers"], trainer.optimizers, strict=True)
        ]
        super().load_state_dict(state)


def _localized(saved: dict[str, Any]) -> dict[str, Any]:
    states = {index: {key: local(value) for key, value in per.items()} for index, per in saved["state"].items()}
    return {**saved, "state": states}


def _rewrapped(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """The peer's optimizer states (local shards) as DTensors shaped like this rank's parameters they belong to
    (indices in ``param_groups`` order, as ``Optimizer.state_dict`` numbers them)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = {
        index: {key: like(value, params[int(index)]) for key, value in per.items()}
        for index, per in saved["state"].items()
    }
    return {**saved, "state": states}


def local_gradient_shards(module: nn.Module) -> list[Tensor]:
    """This rank's gradient shards after FSDP2's reduce-scatter (empty shards left out: the same on rank ``r`` of
    every replica, since every replica shards alike)."""
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
    return [grad for grad in grads if grad.numel() > 0]
