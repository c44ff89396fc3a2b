"""model_state_bytes counts exactly what this rank stores: tied weights once, optimizer state, local shards."""

from __future__ import annotations

import torch

from lightscale.callbacks.measured_state import model_state_bytes
from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.testing import run_distributed


def test_parameters_gradients_and_adam_state_exactly() -> None:
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8))
    params = model.num_params()  # tied embedding/head counted once
    optimizer = torch.optim.AdamW(model.parameters())
    assert model_state_bytes(model, [optimizer]).total == 4 * params  # no gradients or state yet

    model(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    sizes = model_state_bytes(model, [optimizer])
    tensors = len(list(model.parameters()))
    assert sizes.parameters == 4 * params
    assert sizes.gradients == 4 * params
    assert sizes.optimizer == 2 * 4 * params + 4 * tensors  # exp_avg + exp_avg_sq, plus a float32 step each


def _sharded_bytes() -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    layer = torch.nn.Linear(8, 6, bias=False)
    layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
    return model_state_bytes(layer).parameters, 4 * 8 * 6


def test_dtensor_counts_only_the_local_shard() -> None:
    local, full = run_distributed(_sharded_bytes, world_size=2)[0]
    assert local == full // 2
