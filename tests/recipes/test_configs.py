"""Every packaged YAML parses against its recipe's signature and builds its model, data and trainer."""

from __future__ import annotations

import pytest

from lightscale.cli import build_cli, packaged_configs, resolve_config
from lightscale.strategies import LightscaleStrategy


def test_configs_are_packaged() -> None:
    assert {"gpt/tiny_ddp.yaml", "gpt/small_ddp.yaml", "gpt/gpt2-124m_ddp.yaml"} <= set(packaged_configs())
    assert {"gpt/small_zero3_offload.yaml", "gpt/tiny_zero3_offload.yaml"} <= set(packaged_configs())


@pytest.mark.parametrize("name", packaged_configs())
def test_config_builds(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    # As under torchrun, so configs written for more processes than this machine has cores (tiny_3d: 8) build too.
    monkeypatch.setenv("LOCAL_RANK", "0")
    cli = build_cli(["--config", resolve_config(name), "--trainer.accelerator", "cpu"], run=False)
    assert isinstance(cli.trainer.strategy, LightscaleStrategy)
    model_block = cli.model.config.block_size
    assert cli.datamodule.block_size == model_block, "data windows must fit the model's context"
    assert cli.model.config.vocab_size >= cli.datamodule.tokenizer.vocab_size
