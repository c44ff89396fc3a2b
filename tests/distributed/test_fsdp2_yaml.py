"""Every FSDP2 recipe config trains the GPT from YAML (shrunk to a tiny model for a few steps)."""

from __future__ import annotations

import pytest

from lightscale.cli import build_cli, resolve_config
from lightscale.testing import run_distributed

TINY_OVERRIDES = [
    "--model.init_args.config.n_layer=2",
    "--model.init_args.config.n_head=2",
    "--model.init_args.config.n_embd=32",
    "--model.init_args.config.block_size=32",
    "--data.init_args.block_size=32",
    "--trainer.max_steps=3",
    "--trainer.logger=false",
    "--trainer.callbacks=[]",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
]


def _fit_from_yaml(name: str, devices: int, cache_dir: str, root: str) -> int:
    args = ["--config", resolve_config(name), *TINY_OVERRIDES, f"--trainer.devices={devices}"]
    args += [f"--data.init_args.cache_dir={cache_dir}", f"--trainer.default_root_dir={root}"]
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli.trainer.global_step


@pytest.mark.parametrize(
    ("name", "devices"),
    [
        ("gpt/small_fsdp2.yaml", 2),
        ("gpt/small_fsdp2_grad_op.yaml", 2),
        ("gpt/small_fsdp2_offload.yaml", 2),
        ("gpt/small_hsdp.yaml", 4),
    ],
)
def test_config_trains(name: str, devices: int, corpus_cache: str, tmp_path) -> None:
    steps = run_distributed(_fit_from_yaml, name, devices, corpus_cache, str(tmp_path), world_size=devices)
    assert steps == [3] * devices
