"""One argument of the strategy on the command line: ``--trainer.strategy.init_args.NAME VALUE`` over a strategy given
by name (in the config or on the command line) or as a class, parsed as ``lightscale fit`` parses it (issue 39: it
reached Lightning as ``NestedArg(...)``; lightscale.Trainer's ``strategy`` was untyped for jsonargparse)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from lightscale.cli import build_cli, main, resolve_args
from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy

FIT = ["fit", "--config", "gpt/tiny_ddp.yaml"]  # strategy: bucketed_ddp (a name)
INIT = "--trainer.strategy.init_args."


def _printed_strategy(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    with pytest.raises(SystemExit) as ended:
        main([*FIT, *args, "--print_config"])
    assert ended.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]


def test_an_argument_over_the_configs_name(capsys: pytest.CaptureFixture[str]) -> None:
    strategy = _printed_strategy(capsys, f"{INIT}find_unused_parameters", "true")
    assert strategy["class_path"].endswith("BucketedDDPStrategy")
    assert strategy["init_args"]["find_unused_parameters"] is True


def test_arguments_over_a_name_keep_the_names_others(capsys: pytest.CaptureFixture[str]) -> None:
    """fsdp2_zeropp is FSDP2Strategy with three ZeRO++ arguments: two overridden, the third kept."""
    args = ["--trainer.strategy", "fsdp2_zeropp", f"{INIT}quantized_weights", "none", f"{INIT}secondary_shard", "2"]
    strategy = _printed_strategy(capsys, *args)
    assert strategy["class_path"].endswith("FSDP2Strategy")
    init = strategy["init_args"]
    assert (init["quantized_weights"], init["quantized_gradients"], init["secondary_shard"]) == ("none", "int8", 2)


def test_an_argument_over_the_class_form(capsys: pytest.CaptureFixture[str]) -> None:
    """The form docs/strategies/fsdp2.md shows, then one more argument on top."""
    form = '{"class_path": "lightscale.strategies.FSDP2Strategy", "init_args": {"quantized_weights": "int8"}}'
    strategy = _printed_strategy(capsys, "--trainer.strategy", form, f"{INIT}quantized_gradients", "int8")
    assert (strategy["init_args"]["quantized_weights"], strategy["init_args"]["quantized_gradients"]) == (
        "int8",
        "int8",
    )


def test_the_trainer_gets_the_strategy_with_the_argument() -> None:
    args = [*FIT, "--trainer.devices", "1", "--trainer.strategy", "fsdp2", f"{INIT}quantized_weights", "int8"]
    cli = build_cli(resolve_args(args)[1:], run=False)
    assert isinstance(cli.trainer.strategy, FSDP2Strategy)
    assert cli.trainer.strategy.zeropp.weights == "int8"


def test_a_name_without_overrides_stays_a_name() -> None:
    assert resolve_args([*FIT, "--trainer.strategy", "fsdp2"])[-2:] == ["--trainer.strategy", "fsdp2"]
    cli = build_cli(resolve_args([*FIT, "--trainer.devices", "1"])[1:], run=False)
    assert isinstance(cli.trainer.strategy, BucketedDDPStrategy)
