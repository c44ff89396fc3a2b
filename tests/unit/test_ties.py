"""Tied weights survive materialization from the meta device (DiLoCo and fsdp2's meta_init path)."""

from __future__ import annotations

import torch
from torch import nn

from lightscale.parallel.fsdp import materialize_meta_module, torch_generator_states


class TiedLM(nn.Module):
    """A user's language model whose output head shares the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_materialized_model_keeps_its_tie_and_the_constructors_values() -> None:
    torch.manual_seed(3)
    real = TiedLM()
    torch.manual_seed(3)
    rng = torch_generator_states()
    with torch.device("meta"):
        meta = TiedLM()
    materialize_meta_module(meta, torch.device("cpu"), rng_state=rng)
    assert meta.head.weight is meta.embed.weight
    assert sum(p.numel() for p in meta.parameters()) == sum(p.numel() for p in real.parameters())
    for (name, got), (_, want) in zip(meta.state_dict().items(), real.state_dict().items(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
