"""Every packaged YAML parses against its recipe's signature and builds its model, data and trainer."""

from __future__ import annotations

import pytest

from lightscale.cli import build_cli, packaged_configs, resolve_config
from lightscale.strategies import LightscaleStrategy


def test_configs_are_packaged() -> None:
    gpt = {"gpt/tiny_ddp.yaml", "gpt/small_ddp.yaml", "gpt/gpt2-124m_ddp.yaml", "gpt/gpt2-124m_fsdp2.yaml"}
    assert gpt <= set(packaged_configs())
    assert {"gpt/small_zero3_offload.yaml", "gpt/tiny_zero3_offload.yaml"} <= set(packaged_configs())
    for recipe in ("vit", "clip"):
        names = {f"{recipe}/{size}_{strategy}.yaml" for size in ("tiny", "small") for strategy in RECIPE_STRATEGIES}
        assert names <= set(packaged_configs())


RECIPE_STRATEGIES = ("ddp", "zero2", "zero3_offload", "fsdp2", "3d")


@pytest.mark.parametrize("name", packaged_configs())
def test_config_builds(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    # As under torchrun, so configs written for more processes than this machine has cores (tiny_3d: 8) build too.
    monkeypatch.setenv("LOCAL_RANK", "0")
    cli = build_cli(["--config", resolve_config(name), "--trainer.accelerator", "cpu"], run=False)
    assert isinstance(cli.trainer.strategy, LightscaleStrategy)
    CHECKS[name.partition("/")[0]](cli.model, cli.datamodule)


def check_gpt(model, data) -> None:
    assert data.block_size == model.config.block_size, "data windows must fit the model's context"
    if data.tokenizer is not None:  # a data_dir of tokens tells its vocabulary at setup (GPTModule checks it then)
        assert model.config.vocab_size >= data.tokenizer.vocab_size


def check_vit(model, data) -> None:
    check_images(model.config, data)


def check_images(config, data) -> None:
    assert data.image_size == config.image_size, "images must have the size the patch grid expects"
    assert data.channels == config.channels


def check_clip(model, data) -> None:
    check_images(model.config.vision, data)  # the image tower reads the same images
    assert data.context_length == model.config.text.context_length, "captions must fit the text tower's context"


CHECKS = {"gpt": check_gpt, "vit": check_vit, "clip": check_clip}


def test_long_context_config_fits_its_activation_budget_only_with_cp() -> None:
    # gpt/long_cp4.yaml states a 32 MiB per-rank budget for activations: 8192 tokens exceed it on one process and fit
    # at cp=4 (each rank saves a quarter; measured 19.2 vs 76.7 MiB, docs/strategies/context_parallel.md).
    from lightscale.estimate import estimate_memory

    cli = build_cli(["--config", resolve_config("gpt/long_cp4.yaml"), "--trainer.devices", "1"], run=False)
    budget = 32 * 2**20
    cp4 = estimate_memory(cli.model, cli.trainer.strategy, world_size=4).activations.device
    cp1 = estimate_memory(cli.model, "parallel_3d", world_size=1).activations.device
    assert cp4 <= budget < cp1 and cp4 == pytest.approx(cp1 / 4, rel=1e-3)
