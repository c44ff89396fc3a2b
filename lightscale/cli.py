"""The `lightscale` command: fit|validate|test --config CONFIG (LightningCLI), strategies, export-zero.

CONFIG is a YAML path or a packaged recipe config such as ``gpt/tiny_ddp.yaml``. Strategies are written in
YAML by name (``strategy: bucketed_ddp``) or with arguments (``class_path``/``init_args``).

Example:
    $ lightscale fit --config gpt/tiny_ddp.yaml --trainer.max_steps 20
"""

from __future__ import annotations

import difflib
import sys
from importlib import resources
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lightscale.errors import ConfigurationError
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


def print_strategies() -> None:
    rows = strategy_table()
    width = max(len(name) for name, _ in rows)
    print(f"{'strategy'.ljust(width)}  description")
    for name, description in rows:
        print(f"{name.ljust(width)}  {description}")


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


def export_zero(args: list[str]) -> None:
    """``lightscale export-zero CHECKPOINT_DIR OUTPUT``: a ZeRO checkpoint as one fp32 state dict file."""
    import argparse

    from lightscale.plugins.zero_checkpoint import export_zero_checkpoint

    parser = argparse.ArgumentParser(prog="lightscale export-zero", description=export_zero.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory saved by a ZeRO strategy (e.g. last.ckpt)")
    parser.add_argument("output", help="file to write (torch.save; load with torch.load(weights_only=True))")
    parser.add_argument("--prefix", default="model.", help="key prefix to strip; keys without it are dropped")
    parsed = parser.parse_args(args)
    try:
        count = export_zero_checkpoint(parsed.checkpoint, parsed.output, prefix=parsed.prefix)
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {count} tensors to {parsed.output}")


COMMANDS = {"strategies": lambda args: print_strategies(), "export-zero": export_zero}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in COMMANDS:
        COMMANDS[args[0]](args[1:])
        return
    if argv is None:  # from the shell: resolve in place, so Lightning re-launches ranks with the same command
        sys.argv[1:] = resolve_config_args(args)
    try:
        build_cli(None if argv is None else resolve_config_args(args))
    except ConfigurationError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
