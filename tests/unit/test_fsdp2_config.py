"""FSDP2 settings: names registered, bad input refused with a ConfigurationError before training."""

from __future__ import annotations

import pytest
import torch

from lightscale.errors import ConfigurationError
from lightscale.parallel.activation_checkpoint import apply_activation_checkpointing
from lightscale.parallel.fsdp import check_unit_classes, find_units
from lightscale.plugins.fsdp_precision import mp_policy
from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.strategies import FSDP2Strategy

TINY = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16)
NAMES = ["fsdp2", "fsdp2_grad_op", "hsdp", "fsdp2_offload"]


def test_lightning_trainer_knows_every_name() -> None:
    import lightning

    import lightscale  # noqa: F401  (registers the names)

    for name in NAMES:
        trainer = lightning.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, FSDP2Strategy)
    strategies = {name: lightning.Trainer(strategy=name, accelerator="cpu", devices=2).strategy for name in NAMES}
    assert strategies["fsdp2"].reshard_after_forward and not strategies["fsdp2_grad_op"].reshard_after_forward
    assert strategies["hsdp"].dp_replicate == 2 and strategies["fsdp2_offload"].offload


@pytest.mark.parametrize(("replicate", "shard"), [(3, 2), (2, 3), (4, -1)])
def test_hsdp_degrees_must_multiply_to_the_world_size(replicate: int, shard: int) -> None:
    strategy = FSDP2Strategy(dp_replicate=replicate, dp_shard=shard)
    with pytest.raises(ConfigurationError, match=r"world size (is )?(4|6)|Cannot infer dp_shard"):
        strategy.parallel_dims(6 if shard == -1 else 4)


def test_hsdp_layout() -> None:
    dims = FSDP2Strategy(**FSDP2Strategy.aliases["hsdp"][1]).parallel_dims(8)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (2, 4, 8)


def test_unknown_unit_class_names_the_closest_match() -> None:
    with torch.device("meta"):
        model = GPT(TINY)
    with pytest.raises(
        ConfigurationError,
        match=r"'TransformerBlok' does not occur in GPT\. Did you mean "
        r"'TransformerBlock'\?.*Class names in the model: Attention, Dropout, Embedding.*TransformerBlock\.",
    ):
        check_unit_classes(model, ["TransformerBlok"])


def test_units_are_outermost_matches_in_order() -> None:
    with torch.device("meta"):
        model = GPT(TINY)
    units = find_units(model, ["TransformerBlock", "Attention"])  # attention lives inside a block: not twice
    assert units == [model.layers["0"], model.layers["1"]]


def test_bad_activation_checkpointing_mode() -> None:
    with pytest.raises(ConfigurationError, match=r"activation_checkpointing='some' is not valid; choose one of"):
        FSDP2Strategy(activation_checkpointing="some")  # type: ignore[arg-type]


def test_activation_checkpointing_keeps_parameter_names() -> None:
    model = GPT(TINY)
    names = [name for name, _ in model.named_parameters()]
    apply_activation_checkpointing(find_units(model, ["TransformerBlock"]), mode="full")
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory is valid with CUDA")
def test_offload_with_pinned_memory_needs_cuda() -> None:
    with pytest.raises(ConfigurationError, match=r"offload=True with pin_memory=True needs CUDA"):
        FSDP2Strategy(offload=True, pin_memory=True)


def test_precision_names_map_to_fsdp_policies() -> None:
    assert mp_policy("32-true").param_dtype is None
    bf16 = mp_policy("bf16-mixed")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mp_policy("16-mixed").param_dtype == torch.float16
