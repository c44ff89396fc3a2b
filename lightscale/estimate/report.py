"""``lightscale estimate --config FILE``: the estimator on a training config, as a table or JSON.

The config is read like ``lightscale fit`` reads it (any override works), the model and data module are built,
the Trainer is not: no process starts, and ``--world-size`` may name ranks that do not exist.

Example:
    $ lightscale estimate --config gpt/7b_fsdp2.yaml --world-size 1024 --device-memory 80GiB
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightscale.estimate.core import CATEGORIES, MemoryEstimate, estimate_memory

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_bytes(text: str) -> float:
    """``"80GiB"`` -> 85899345920; decimal (GB) and binary (GiB) units, case-insensitive."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB, 40GB or 512MiB")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def human(nbytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


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
    from lightscale.cli import resolve_config_args
    from lightscale.trainer import Trainer

    with warnings.catch_warnings():  # "args and sys.argv both given": sys.argv holds our own subcommand
        warnings.simplefilter("ignore")
        cli = _ConfigOnly(
            trainer_class=Trainer,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=resolve_config_args(cli_args),
            run=False,
            save_config_callback=None,
        )
    trainer = cli.config_init["trainer"]
    devices = trainer.get("devices")
    ranks = (devices if isinstance(devices, int) and devices > 0 else 1) * (trainer.get("num_nodes") or 1)
    precision = str(trainer.get("precision") or "32-true")
    return RunConfig(
        module=cli.model,
        strategy=trainer.get("strategy") or "bucketed_ddp",
        world_size=world_size or ranks,
        precision="32-true" if precision == "32" else precision,
        micro_batch=int(getattr(cli.datamodule, "batch_size", 1) or 1),
        batch=getattr(cli.model, "example_input_array", None),
    )


def format_estimate(est: MemoryEstimate, *, device_memory: float | None = None) -> str:
    lines = [
        f"lightscale estimate: {est.strategy} on {est.world_size} rank(s), precision {est.precision}, "
        f"micro-batch {est.micro_batch}, activation checkpointing {est.activation_checkpointing}",
        f"  model: {est.num_params:,} parameters; the most loaded rank holds {est.rank_params:,} before sharding",
        f"  activations: {est.activation_source}",
        f"  {'per rank':<12} {'device':>12} {'host':>12}",
    ]
    for category in CATEGORIES:
        placed = getattr(est, category)
        lines.append(f"  {category:<12} {human(placed.device):>12} {human(placed.host):>12}")
    lines.append(f"  {'total':<12} {human(est.device_total):>12} {human(est.host_total):>12}")
    if device_memory is not None:
        verdict = "fits" if est.device_total <= device_memory else "does NOT fit"
        lines.append(f"  {verdict} in {human(device_memory)} of device memory")
    return "\n".join(lines)


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


def own_arguments(prog: str, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog=prog, add_help=False)
    parser.add_argument("--world-size", type=int, default=None, help="ranks to simulate (default: the config's)")
    parser.add_argument("--device-memory", type=parse_bytes, default=None, help="e.g. 80GiB")
    parser.add_argument("--activation-checkpointing", choices=("none", "full", "selective"), default=None)
    parser.add_argument("--json", action="store_true")
    return parser.parse_known_args(argv)
