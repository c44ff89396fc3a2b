"""``lightscale estimate`` and ``lightscale plan``: the estimator and the planner on a training config.

The config is read like ``lightscale fit`` reads it (any override works), the model and data module are built,
the Trainer is not: no process starts, and ``--world-size`` may name ranks that do not exist.

Example:
    $ lightscale estimate --config gpt/7b_fsdp2.yaml --world-size 1024 --device-memory 80GiB
    $ lightscale plan --config gpt/small_ddp.yaml --device-memory 150MiB
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightscale.estimate.core import estimate_memory
from lightscale.estimate.plan import device_budget, format_plan, plan
from lightscale.estimate.report import format_estimate, parse_bytes
from lightscale.plugins.precision_contract import normalize_precision
from lightscale.strategies import BucketedDDPStrategy
from lightscale.strategies.registry import plan_candidates
from lightscale.trainer import Trainer, device_count


@dataclass
class RunConfig:
    """What the estimator needs from a training config."""

    module: Any
    strategy: Any
    world_size: int
    precision: str
    micro_batch: int
    batch: Any = None


class _ConfigOnly(LightningCLI):
    """LightningCLI that builds the model and data but no Trainer (so no devices are checked or processes started)."""

    def instantiate_trainer(self, **kwargs: Any) -> None:  # type: ignore[override]
        return None


def read_run_config(cli_args: list[str], *, world_size: int | None) -> RunConfig:
    """The model, strategy and sizes of a config; ``cli_args`` name config files by path (cli resolves them)."""
    with warnings.catch_warnings():  # "args and sys.argv both given": sys.argv holds our own subcommand
        warnings.simplefilter("ignore")
        cli = _ConfigOnly(
            trainer_class=Trainer,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=cli_args,
            run=False,
            save_config_callback=None,
        )
    trainer = cli.config_init["trainer"]
    ranks = (device_count(trainer.get("devices")) or 1) * (trainer.get("num_nodes") or 1)
    return RunConfig(
        module=cli.model,
        strategy=trainer.get("strategy") or BucketedDDPStrategy.default_name(),
        world_size=world_size or ranks,
        precision=normalize_precision(trainer.get("precision") or "32-true"),
        micro_batch=int(getattr(cli.datamodule, "batch_size", 1) or 1),
        batch=getattr(cli.model, "example_input_array", None),
    )


def estimate_command(argv: list[str]) -> None:
    """``lightscale estimate --config FILE [fit overrides] [--world-size N] [--device-memory 80GiB] [--json]``."""
    ours, rest = own_arguments("lightscale estimate", argv)
    run = read_run_config(rest, world_size=ours.world_size)
    est = estimate_memory(
        run.module,
        run.strategy,
        world_size=run.world_size,
        precision=run.precision,
        micro_batch=run.micro_batch,
        batch=run.batch,
        activation_checkpointing=ours.activation_checkpointing,
    )
    if ours.json:
        print(json.dumps(est.as_dict(), indent=2))
    else:
        print(format_estimate(est, device_memory=ours.device_memory))


def plan_command(argv: list[str]) -> None:
    """``lightscale plan --config FILE [fit overrides] [--world-size N] --device-memory 80GiB``."""
    ours, rest = own_arguments("lightscale plan", argv)
    run = read_run_config(rest, world_size=ours.world_size)
    budget = ours.device_memory or device_budget()
    rows = plan(
        run.module,
        plan_candidates(),
        world_size=run.world_size,
        budget=budget,
        precision=run.precision,
        micro_batch=run.micro_batch,
    )
    print(format_plan(rows, budget=budget))


def own_arguments(prog: str, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    parser.add_argument("--world-size", type=int, default=None, help="ranks to simulate (default: the config's)")
    parser.add_argument("--device-memory", type=parse_bytes, default=None, help="e.g. 80GiB")
    parser.add_argument("--activation-checkpointing", choices=("none", "full", "selective"), default=None)
    parser.add_argument("--json", action="store_true")
    return parser.parse_known_args(argv)
