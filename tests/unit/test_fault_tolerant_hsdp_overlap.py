"""``FSDP2Strategy(fault_tolerant=...)``'s average across replicas starts inside backward: each FSDP2 group's
reduce-scattered shard is handed to torchft's ``allreduce`` from FSDP2's own ``set_all_reduce_hook`` while backward
goes on (as bucketed_ddp's buckets), and the step applies the same mean as one reduction after backward would.

The fit runs in one forked rank with the fake manager of tests/unit/test_fault_tolerant_commit.py playing the peer
replica (a second replica whose gradient is a known value per element): the allreduce calls are recorded with
whether autograd's graph task was still running, the parameters compared bitwise with plain SGD on the mean.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from test_fault_tolerant_commit import SETTINGS, FakeManager, Regression, _assert_equal, _network, _plain_sgd
from torch import nn

from lightscale.fault_tolerance.sharded_replica import ShardedFaultTolerantReplica
from lightscale.strategies import FSDP2Strategy
from lightscale.testing import run_distributed

pytest.importorskip("torchft")


class WithScalar(Regression):
    """A 0-dimensional parameter beside the sharded ones (FSDP2 leaves it out: lightscale/parallel/fsdp.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]) * self.scale, batch[1])


def _fit_in_this_process(module: pl.LightningModule, steps: int, accumulate: int) -> dict[str, Any]:
    manager = FakeManager(participants=2)
    strategy = FSDP2Strategy(fault_tolerant=SETTINGS, dp_replicate=1, unit_classes=["Linear"])
    strategy.ft = ShardedFaultTolerantReplica(SETTINGS, manager=manager)  # the fake in place of torchft's
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module)
    params = [p.detach() for p in module.parameters()]
    return {"params": [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params], "reduced": manager.reduced}


def _fit(module: pl.LightningModule, steps: int, accumulate: int = 1) -> dict[str, Any]:
    return run_distributed(_fit_in_this_process, module, steps, accumulate, world_size=1, timeout_s=120)[0]


def _group_sizes() -> list[int]:
    """One FSDP2 group per Linear, the last layer's first in backward: [13, 72]."""
    return [sum(p.numel() for p in layer.parameters()) for layer in _network() if isinstance(layer, nn.Linear)][::-1]


def test_each_fsdp2_group_is_averaged_across_replicas_inside_backward() -> None:
    fit = _fit(Regression(), steps=3)
    assert fit["reduced"] == [(size, True) for size in _group_sizes()] * 3
    _assert_equal(fit["params"], _plain_sgd(3))  # the mean, as one reduction after backward gave


def test_accumulation_micro_steps_launch_nothing() -> None:
    fit = _fit(Regression(), steps=2, accumulate=2)  # 4 batches, 2 optimizer steps
    assert fit["reduced"] == [(size, True) for size in _group_sizes()] * 2


def test_a_scalar_parameter_is_averaged_once_backward_ran() -> None:
    fit = _fit(WithScalar(), steps=2)
    assert fit["reduced"] == ([(size, True) for size in _group_sizes()] + [(1, False)]) * 2


def test_fsdp2s_hook_is_the_one_this_replica_registers() -> None:
    """The upstream seam, pinned: ``set_all_reduce_hook(hook, *, stream=None)``, the hook called with one tensor."""
    import inspect

    from torch.distributed.fsdp import FSDPModule

    parameters = inspect.signature(FSDPModule.set_all_reduce_hook).parameters
    assert (
        list(parameters) == ["self", "hook", "stream"] and parameters["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    )


def test_a_second_backward_of_the_step_waits_the_first_and_leaves_its_group_to_after_backward() -> None:
    """Manual optimization may run backward twice before the step: FSDP2 then sums the new shard into gradients that
    the first backward's average (still in flight) writes, so that average is waited on first and the group is
    averaged once backward ran, on the sum (the first part is already the same on every replica: linear)."""
    replica = ShardedFaultTolerantReplica(SETTINGS, manager=FakeManager(participants=2))
    events: list[str] = []

    class Work:
        def wait(self, timeout: Any = None) -> bool:
            events.append("waited")
            return True

    replica.launch = lambda tensor: events.append("launched") or Work()  # type: ignore[method-assign]
    param = nn.Parameter(torch.zeros(3))
    replica._launch_group(torch.zeros(3), [param])  # the first backward: FSDP2 will only view the shard
    assert events == ["launched"] and not replica.deferred
    param.grad = torch.ones(3)  # what the first backward left
    replica._launch_group(torch.zeros(3), [param])  # the second: FSDP2 sums into param.grad after the hook
    assert events == ["launched", "waited"] and replica.deferred == {param}
