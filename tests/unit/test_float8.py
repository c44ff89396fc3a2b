"""float8 training (torchao): which Linear layers convert, what is refused, and the extra's error (one process).
Training runs: tests/distributed/test_float8_training.py."""

from __future__ import annotations

import sys
import warnings

import pytest
from torch import nn

import lightscale
from lightscale.errors import ConfigurationError
from lightscale.layers.float8 import Float8Options, apply_float8, ineligible_linears
from lightscale.plugins.fsdp_precision import Float8Precision


class Tied(nn.Module):
    """A user's network: two eligible layers, one whose sizes are not multiples of 16, one tied to an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(48, 32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.odd = nn.Linear(32, 24)
        self.head = nn.Linear(32, 48, bias=False)
        self.head.weight = self.embed.weight


def test_eligible_layers_convert_and_the_rest_are_listed_once() -> None:
    from torchao.float8.float8_linear import Float8Linear

    model = Tied()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        converted = apply_float8(model, Float8Options(emulate=True), fsdp_all_gather=False)
    assert converted == ["up", "down"]
    assert isinstance(model.up, Float8Linear) and type(model.odd) is nn.Linear and type(model.head) is nn.Linear
    assert model.head.weight is model.embed.weight  # still tied
    messages = [str(w.message) for w in caught if "lightscale float8" in str(w.message)]
    assert (
        len(messages) == 1
        and "odd (32 x 24 not multiples of 16)" in messages[0]
        and "head (weight shared" in messages[0]
    )
    assert ineligible_linears(Tied(), tp=4)["up"] == "32 x 64 not multiples of 64"  # each tp shard 16-aligned


def test_float8_is_refused_where_it_cannot_run() -> None:
    cpu = {"accelerator": "cpu", "devices": 1}
    with pytest.raises(ConfigurationError, match=r"precision='float8' cannot run under the zero .*DeepSpeed"):
        lightscale.Trainer(strategy="zero2", precision="float8", **cpu)
    with pytest.raises(ConfigurationError, match=r"on cpu: float8 matmuls need a CUDA GPU.*emulate=True"):
        lightscale.Trainer(strategy="fsdp2", precision="float8-rowwise", **cpu)
    with pytest.raises(ConfigurationError, match=r"strategy='auto' has none"):
        lightscale.Trainer(precision="float8", **cpu)
    with pytest.raises(ConfigurationError, match=r"both given"):
        lightscale.Trainer(strategy="fsdp2", precision="bf16-mixed", plugins=[Float8Precision(emulate=True)], **cpu)
    with pytest.raises(ConfigurationError, match=r"name='float9' is not valid; choose one of float8, float8-rowwise"):
        Float8Precision("float9")
    with pytest.raises(ConfigurationError, match=r"recipe='blockwise' is not valid"):
        Float8Options(recipe="blockwise")  # type: ignore[arg-type]
    trainer = lightscale.Trainer(strategy="fsdp2", plugins=[Float8Precision("float8", "cpu", emulate=True)], **cpu)
    assert isinstance(trainer.strategy.precision_plugin, Float8Precision)


def test_missing_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'lightscale\[float8\]'"):
        apply_float8(Tied(), Float8Options(), fsdp_all_gather=False)


def test_float8_tp_styles_replace_the_plain_ones_for_converted_layers_on_cuda() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from lightscale.layers.float8 import float8_tp_plan
    from lightscale.recipes.gpt import GPTConfig
    from lightscale.recipes.gpt.model import GPT
    from lightscale.recipes.gpt.parallelize import gpt_tp_plan

    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_float8(model, Float8Options(), fsdp_all_gather=False, tp=2)
    plan = gpt_tp_plan()
    cuda = float8_tp_plan(plan, model, Float8Options(), device_type="cuda")
    assert type(cuda["layers.*.attention.wq"]) is Float8ColwiseParallel
    assert type(cuda["layers.*.attention.wo"]) is Float8RowwiseParallel
    assert cuda["layers.*.attention.wo"].output_layouts == plan["layers.*.attention.wo"].output_layouts
    assert type(cuda["output"]) is ColwiseParallel  # tied head: not converted
    assert type(cuda["tok_embeddings"]) is RowwiseParallel  # an embedding
    assert float8_tp_plan(plan, model, Float8Options(), device_type="cpu") is plan  # gloo moves no float8
    assert float8_tp_plan(plan, model, Float8Options(recipe="rowwise"), device_type="cuda") is plan


def test_diloco_refuses_float8_reached_through_plain_lightning() -> None:
    """A plain lightning.Trainer skips lightscale.Trainer's family check: DiLoCo's own precision step refuses."""
    strategy = lightscale.strategies.DiLoCoStrategy(inner="fsdp2")
    with pytest.raises(ConfigurationError, match=r"precision='float8' cannot run under DiLoCo.*fsdp2 or parallel_3d"):
        strategy.configure_precision(Float8Precision("float8", "cpu", emulate=True))
