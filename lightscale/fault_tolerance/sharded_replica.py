"""What ``FSDP2Strategy(fault_tolerant=...)`` adds (hsdp through torchft): each launch is one replica that shards
inside (plain FSDP2 over its own ranks); the replicate dimension across launches is torchft's, managed per step.

Inside backward, as FSDP2's reduce-scatter of each group is in (its ``set_all_reduce_hook``), rank ``r`` starts
averaging that group's gradient shard with rank ``r`` of the other replicas of the step
(lightscale/fault_tolerance/step.py), while backward goes on; all are waited on before ``should_commit`` gates the
optimizer step. The 0-dimensional parameters FSDP2 leaves out (``ScalarGradients``, lightscale/parallel/fsdp.py)
are averaged once backward ran. A healing rank ``r`` receives rank ``r``'s shards from a live replica: the state
travels as local tensors and is wrapped back into DTensors like this replica's own parameters on load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

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
    """A replica whose ranks hold DTensor shards: they travel as this rank's local shards, and each FSDP2 group's
    gradient shard starts its average across replicas inside backward, once that group's reduce-scatter is in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # This step's works started inside backward, each with the stream it was launched on (FSDP2 runs the hook on
        # its all-reduce stream on GPUs; torchft's wait must be on that stream), waited on before the commit.
        self.launched: list[tuple[Any, Any]] = []
        self.hooked: set[nn.Parameter] = set()  # averaged by the hooks (the rest once backward ran) ...
        self.deferred: set[nn.Parameter] = set()  # ... unless a hook left its group to after backward this step
        self._modules: list[FSDPModule] = []

    @override
    def join(self, trainer: Trainer, loader: object) -> None:
        self.hooked = set()
        self._modules = [module for module in trainer.lightning_module.modules() if isinstance(module, FSDPModule)]
        for module in self._modules:
            params = _group_parameters(module)
            module.set_all_reduce_hook(lambda output, params=params: self._launch_group(output, params))
            self.hooked.update(params)
        super().join(trainer, loader)

    @override
    def finish(self) -> None:
        for module in self._modules:  # a backward after the run (no step to average in) must not reach the replica
            module.set_all_reduce_hook(None)  # type: ignore[arg-type]
        self._modules = []
        super().finish()

    def _launch_group(self, output: Tensor, params: list[nn.Parameter]) -> None:
        """FSDP2's hook: ``output`` is the group's reduce-scattered flat shard, which its gradients view from here on
        (a micro-step under ``no_gradient_sync`` reduces nothing, so calls nothing). Where FSDP2 goes on to read
        ``output`` (a cast to the parameters' dtype, as under ``compression="bf16"``; a copy to the CPU; a sum into
        gradients kept from an earlier backward of the same step; a division after the reduction), the group is
        averaged after backward instead, on the gradients FSDP2 leaves: as before the hooks, the same numbers. The
        works already started are waited on first: a second backward sums into the gradients they write."""
        if not _viewed_in_place(output, params):
            self._wait_launched()
            self.deferred.update(params)
            return
        stream = torch.cuda.current_stream() if output.is_cuda else None
        self.launched.append((self.launch(output), stream))

    def _wait_launched(self) -> None:
        launched, self.launched = self.launched, []
        for work, stream in launched:
            if stream is None:
                work.wait()
                continue
            with torch.cuda.stream(stream):  # torchft's wait checks it is on the stream of the launch
                work.wait()
            torch.cuda.current_stream().wait_stream(stream)  # the optimizer reads what that stream wrote

    @override
    def gradients_after_backward(self) -> list[Tensor]:
        """The averages the hooks started, waited on; then what no hook covered (the 0-dimensional parameters, and
        groups a hook left to after backward this step)."""
        self._wait_launched()
        deferred, self.deferred = self.deferred, set()
        assert self.trainer is not None
        params = (p for p in self.trainer.lightning_module.parameters() if p not in self.hooked or p in deferred)
        return local_gradient_shards(params)

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


def local_gradient_shards(params: Iterable[nn.Parameter]) -> list[Tensor]:
    """This rank's gradient shards of ``params`` after FSDP2's reduce-scatter (empty shards left out: the same on
    rank ``r`` of every replica, since every replica shards alike)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    return [grad for grad in grads if grad.numel() > 0]


def _group_parameters(module: FSDPModule) -> list[nn.Parameter]:
    """The parameters of ``module``'s own FSDP2 group: its own, less those of FSDP modules inside it (their groups)
    and the 0-dimensional ones FSDP2 leaves out (plain tensors, not DTensors)."""
    inner = {p for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    return [p for p in module.parameters() if p not in inner and isinstance(p, DTensor)]


def _viewed_in_place(output: Tensor, params: list[nn.Parameter]) -> bool:
    """Whether FSDP2 (torch 2.13 ``foreach_reduce``) only views ``output`` as the new gradients after the hook: the
    parameters' dtype and device, no gradients to sum into, and a reduction FSDP2 does not divide afterwards (it
    divides after the fp32/bf16 reductions only under ``set_force_sum_reduction_for_comms``, which FSDP2Strategy
    never sets; lightscale sets it on MoE experts only, parallel/experts.py, not sharded by this family)."""
    return output.dtype in (torch.float32, torch.bfloat16) and all(
        p.grad is None and p.dtype == output.dtype and p.device == output.device for p in params
    )
