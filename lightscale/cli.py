"""The `lightscale` command: fit|validate|test --config CONFIG (LightningCLI) and strategies, export, schedule,
estimate, plan, doctor, convert, consolidate.

CONFIG is a YAML path or a packaged recipe config such as ``gpt/tiny_ddp.yaml``. Strategies are written in
YAML by name (``strategy: bucketed_ddp``) or with arguments (``class_path``/``init_args``).

``--resume auto`` continues from the newest complete checkpoint of the run (see ``lightscale.checkpoint.resume``).
``--trainer.strategy.init_args.NAME VALUE`` overrides one argument of the strategy in effect, also when it was given
by name (``strategy: fsdp2_zeropp``): the name becomes its class and registered arguments first.

Example:
    $ lightscale fit --config gpt/tiny_ddp.yaml --trainer.max_steps 20
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

from lightscale.checkpoint.convert import (
    check_target,
    convert,
    detect_source,
    infer_target,
    read_model_state,
    write_model_state,
)
from lightscale.checkpoint.hf_export import DEFAULT_SHARD_SIZE, export_hf
from lightscale.commands.consolidate import consolidate_command
from lightscale.commands.doctor import main as doctor_main
from lightscale.commands.estimate import estimate_command, plan_command
from lightscale.commands.schedule_plot import draw_schedule, idle_fractions, schedule_slots
from lightscale.errors import ConfigurationError
from lightscale.parallel.pipeline import SCHEDULES, default_stages_per_rank, validate_schedule
from lightscale.patches.process import set_arguments
from lightscale.storage.urls import checkpoint_location
from lightscale.strategies.registry import strategy_table
from lightscale.trainer import Trainer

CONFIG_FLAGS = ("--config", "-c")


def packaged_configs() -> list[str]:
    """Names of the configs shipped with the recipes, e.g. ``gpt/tiny_ddp.yaml``."""
    root = resources.files("lightscale.recipes")
    return sorted(
        f"{recipe.name}/{config.name}"
        for recipe in root.iterdir()
        if recipe.is_dir() and (recipe / "configs").is_dir()
        for config in (recipe / "configs").iterdir()
        if config.name.endswith(".yaml")
    )


def resolve_config(name: str) -> str:
    """A config path for ``name``: an existing file, or the packaged recipe config of that name."""
    if Path(name).is_file():
        return name
    recipe, _, file = name.partition("/")
    packaged = resources.files("lightscale.recipes") / recipe / "configs" / file
    if file and packaged.is_file():
        return str(packaged)
    known = packaged_configs()
    closest = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {closest[0]!r}?" if closest else ""
    raise SystemExit(f"error: config {name!r} is neither a file nor a packaged config.{hint} Packaged: {known}")


def resolve_config_args(argv: list[str]) -> list[str]:
    """Replace packaged config names after ``--config``/``-c`` (also ``--config=NAME``) by their paths."""
    resolved: list[str] = []
    expect_config = False
    for arg in argv:
        if expect_config:
            resolved.append(resolve_config(arg))
            expect_config = False
        elif arg in CONFIG_FLAGS:
            resolved.append(arg)
            expect_config = True
        elif arg.startswith("--config="):
            resolved.append("--config=" + resolve_config(arg.split("=", 1)[1]))
        else:
            resolved.append(arg)
    return resolved


def resolve_resume_args(argv: list[str]) -> list[str]:
    """``--resume auto`` (or ``--resume=auto``) is short for ``--trainer.resume auto``: see Trainer(resume=...)."""
    resolved: list[str] = []
    for arg in argv:
        if arg == "--resume":
            resolved.append("--trainer.resume")
        elif arg.startswith("--resume="):
            resolved.append("--trainer.resume=" + arg.split("=", 1)[1])
        else:
            resolved.append(arg)
    return resolved


STRATEGY_FLAG = "--trainer.strategy"


def _strategy_value(arg: str, following: str | None) -> str | None:
    """The value ``arg`` (with the argument after it) gives ``trainer.strategy``: ``--trainer.strategy NAME``,
    ``--trainer.strategy=NAME`` or a config file's ``trainer: strategy:``; None if it gives none."""
    if arg == STRATEGY_FLAG:
        return following
    if arg.startswith(STRATEGY_FLAG + "="):
        return arg.split("=", 1)[1]
    if arg in CONFIG_FLAGS and following is not None and Path(following).is_file():
        config = yaml.safe_load(Path(following).read_text()) or {}
        trainer = config.get("trainer") if isinstance(config, dict) else None
        return trainer.get("strategy") if isinstance(trainer, dict) else None
    if arg.startswith("--config=") and Path(arg.split("=", 1)[1]).is_file():
        return _strategy_value("--config", arg.split("=", 1)[1])
    return None


def strategy_as_class(name: str) -> str | None:
    """A registered strategy name as jsonargparse's class form, ``{"class_path": ..., "init_args": ...}`` (JSON): the
    class and the arguments the name stands for (``fsdp2_zeropp`` -> FSDP2Strategy with its three ZeRO++ options)."""
    if name.lower() not in StrategyRegistry:
        return None
    entry = StrategyRegistry[name.lower()]
    cls = entry["strategy"]
    try:
        return json.dumps({"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": entry["init_params"]})
    except TypeError:  # an argument with no JSON form: left to jsonargparse (its error names the option)
        return None


def resolve_strategy_args(argv: list[str]) -> list[str]:
    """``--trainer.strategy.init_args.X V`` over a strategy given by name (in a config or on the command line): the
    name is replaced by its class form just before the first such option, so jsonargparse sets X on that class
    (given a name, it cannot: ``NestedArg(...)`` reached the Trainer). A class form already in effect is untouched.

    Example:
        >>> resolve_strategy_args(["--trainer.strategy", "zero3", "--trainer.strategy.init_args.stage", "2"])
        ['--trainer.strategy', 'zero3', '--trainer.strategy={"class_path":
         "lightscale.strategies.deepspeed.strategy.ZeroStrategy", "init_args": {"stage": 3}}',
         '--trainer.strategy.init_args.stage', '2']
    """
    name: Any = None
    for index, arg in enumerate(argv):
        if arg.startswith(STRATEGY_FLAG + ".init_args."):
            form = strategy_as_class(name) if isinstance(name, str) else None
            if form is None:
                return argv
            return [*argv[:index], f"{STRATEGY_FLAG}={form}", *argv[index:]]
        value = _strategy_value(arg, argv[index + 1] if index + 1 < len(argv) else None)
        name = value if value is not None else name
    return argv


def print_strategies() -> None:
    rows = strategy_table()
    width = max(len(name) for name, _ in rows)
    print(f"{'strategy'.ljust(width)}  description")
    for name, description in rows:
        print(f"{name.ljust(width)}  {description}")


def draw_schedule_command(argv: list[str]) -> None:
    """``lightscale schedule NAME --pp P --microbatches M [--stages-per-rank S] [--out FILE.png]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightscale schedule", description="Draw a pipeline schedule to PNG.")
    parser.add_argument("name", choices=list(SCHEDULES))
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--out", default=None, help="PNG path (default: NAME.png)")
    args = parser.parse_args(argv)
    per_rank = args.stages_per_rank or default_stages_per_rank(args.name)
    validate_schedule(args.name, pp=args.pp, microbatches=args.microbatches, stages_per_rank=per_rank)
    out = draw_schedule(
        args.name,
        pp=args.pp,
        microbatches=args.microbatches,
        stages_per_rank=per_rank,
        path=args.out or f"{args.name}.png",
    )
    slots = schedule_slots(args.name, pp=args.pp, microbatches=args.microbatches, stages_per_rank=per_rank)
    idle = idle_fractions(slots, args.pp)
    print(f"wrote {out}: idle per rank {', '.join(f'{x:.1%}' for x in idle)}")


def build_cli(args: list[str] | None, *, run: bool = True) -> LightningCLI:
    """LightningCLI over any LightningModule/DataModule (``class_path`` in YAML) and ``lightscale.Trainer``."""
    return LightningCLI(
        trainer_class=Trainer,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def export(args: list[str], *, source: str | None = None) -> None:
    """``lightscale export CHECKPOINT OUTPUT [--format safetensors|torch]``: any strategy's checkpoint as one file
    that the single-device model loads.

    Reads ZeRO directories, DCP directories (FSDP2 and parallel_3d) and single files (bucketed_ddp, one device);
    ``export-zero`` and ``export-fsdp2`` force one format. Writes safetensors unless OUTPUT ends in .pt, .pth or
    .bin (then ``torch.save``, weights-only loadable) or ``--format`` says otherwise. ``--hf``: OUTPUT is a
    directory that Hugging Face's ``from_pretrained`` loads (lightscale/checkpoint/hf_export.py); ``--averaged``:
    a WeightAveraging callback's average instead of the raw weights.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="lightscale export", description=export.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint saved by any lightscale strategy (e.g. last.ckpt)")
    parser.add_argument("output", help="file to write: safetensors, or torch.save for a .pt/.pth/.bin name")
    parser.add_argument("--prefix", default="model.", help="key prefix to strip; keys without it are dropped")
    parser.add_argument("--format", default=None, help="safetensors or torch (default: from OUTPUT's suffix)")
    parser.add_argument("--averaged", action="store_true", help="a WeightAveraging callback's average, not the raw")
    parser.add_argument("--hf", action="store_true", help="OUTPUT is a directory from_pretrained loads")
    parser.add_argument("--module", default=None, help="with --hf: the LightningModule attribute holding the model")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE, help="with --hf: split safetensors above it")
    parsed = parser.parse_args(args)
    if parsed.hf:
        _export_hf(parsed)
        return
    target = parsed.format or infer_target(parsed.output, default="safetensors")
    if target not in ("safetensors", "torch"):
        raise ConfigurationError(f"--format {target!r} is not an export format; valid: ['safetensors', 'torch'].")
    try:
        source = source or detect_source(checkpoint_location(parsed.checkpoint))
        state = read_model_state(parsed.checkpoint, prefix=parsed.prefix, source=source, averaged=parsed.averaged)
        write_model_state(state, parsed.output, target)
    except (FileNotFoundError, ValueError) as error:  # ConfigurationError is a ValueError
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {len(state)} tensors to {parsed.output} ({target})")


def _export_hf(parsed: Any) -> None:
    try:
        entry = export_hf(
            parsed.checkpoint,
            parsed.output,
            module=parsed.module,
            averaged=parsed.averaged,
            max_shard_size=parsed.max_shard_size,
        )
    except (FileNotFoundError, ValueError) as error:  # ConfigurationError is a ValueError
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {entry['class']} ({entry['attribute']}) to {parsed.output}: config.json + safetensors")


def convert_command(args: list[str]) -> None:
    """``lightscale convert IN OUT [--to safetensors|torch|dcp] [--prefix model.]``: a checkpoint of any strategy
    (DCP or DeepSpeed directory, Lightning .ckpt, torch or safetensors state dict) as another format, offline."""
    import argparse

    parser = argparse.ArgumentParser(prog="lightscale convert", description=convert_command.__doc__)
    parser.add_argument("input", help="a checkpoint directory or file")
    parser.add_argument("output", help="where to write (a file for safetensors/torch, a directory for dcp)")
    parser.add_argument("--to", default=None, help="safetensors, torch or dcp (default: from OUT's suffix)")
    parser.add_argument("--prefix", default="model.", help="LightningModule attribute holding the model")
    parsed = parser.parse_args(args)
    target = parsed.to or infer_target(parsed.output)
    check_target(target)  # before any work
    try:
        convert(parsed.input, parsed.output, target=target, prefix=parsed.prefix)
    except (FileNotFoundError, ValueError) as error:  # ConfigurationError is a ValueError
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {parsed.output} ({target})")


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "strategies": lambda args: print_strategies(),
    "export": export,
    "export-zero": partial(export, source="deepspeed"),
    "export-fsdp2": partial(export, source="dcp"),
    "schedule": lambda args: draw_schedule_command(args),
    "doctor": lambda args: doctor_main(args),
    "estimate": lambda args: estimate_command(resolve_config_args(args)),
    "plan": lambda args: plan_command(resolve_config_args(args)),
    "convert": convert_command,
    "consolidate": consolidate_command,
}


def resolve_args(argv: list[str]) -> list[str]:
    """The command line LightningCLI parses: packaged config names, ``--resume`` and strategy names resolved."""
    return resolve_strategy_args(resolve_resume_args(resolve_config_args(argv)))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in COMMANDS:
        try:
            COMMANDS[args[0]](args[1:])
        except ConfigurationError as error:
            raise SystemExit(f"error: {error}") from None
        return
    resolved = resolve_args(args)
    if argv is None:  # from the shell: resolve in place, so Lightning re-launches ranks with the same command
        set_arguments(resolved)
    try:
        build_cli(None if argv is None else resolved)
    except ConfigurationError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
