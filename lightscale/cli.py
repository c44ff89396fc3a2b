"""The `lightscale` command: fit|validate|test --config CONFIG (LightningCLI) and strategies, export, schedule,
estimate, plan, doctor.

CONFIG is a YAML path or a packaged recipe config such as ``gpt/tiny_ddp.yaml``. Strategies are written in
YAML by name (``strategy: bucketed_ddp``) or with arguments (``class_path``/``init_args``).

``--resume auto`` continues from the newest complete checkpoint of the run (see ``lightscale.plugins.resume``).

Example:
    $ lightscale fit --config gpt/tiny_ddp.yaml --trainer.max_steps 20
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lightscale.doctor import main as doctor_main
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


def print_strategies() -> None:
    rows = strategy_table()
    width = max(len(name) for name, _ in rows)
    print(f"{'strategy'.ljust(width)}  description")
    for name, description in rows:
        print(f"{name.ljust(width)}  {description}")


def draw_schedule_command(argv: list[str]) -> None:
    """``lightscale schedule NAME --pp P --microbatches M [--stages-per-rank S] [--out FILE.png]``."""
    import argparse

    from lightscale.parallel.pipeline import SCHEDULES, default_stages_per_rank, validate_schedule
    from lightscale.parallel.schedule_plot import draw_schedule, idle_fractions, schedule_slots

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


def export(args: list[str], *, format: str = "auto") -> None:
    """``lightscale export CHECKPOINT OUTPUT``: any strategy's checkpoint as one state dict file.

    Reads ZeRO directories, DCP directories (FSDP2 and parallel_3d) and single files (bucketed_ddp, one device);
    ``export-zero`` and ``export-fsdp2`` force one format.
    """
    import argparse

    from lightscale.plugins.atomic_dir import complete_checkpoint
    from lightscale.plugins.checkpoint import export_single_file
    from lightscale.plugins.distributed_checkpoint import export_full_state_dict
    from lightscale.plugins.zero_checkpoint import CHECKPOINT_TAG, export_zero_checkpoint

    parser = argparse.ArgumentParser(prog="lightscale export", description=export.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint saved by any lightscale strategy (e.g. last.ckpt)")
    parser.add_argument("output", help="file to write (torch.save; load with torch.load(weights_only=True))")
    parser.add_argument("--prefix", default="model.", help="key prefix to strip; keys without it are dropped")
    parsed = parser.parse_args(args)
    source = complete_checkpoint(Path(parsed.checkpoint))
    if format == "auto":
        format = "zero" if (source / CHECKPOINT_TAG).is_dir() else "fsdp2" if source.is_dir() else "file"
    exporters = {
        "zero": export_zero_checkpoint,
        "fsdp2": lambda *args, **kwargs: len(export_full_state_dict(*args, **kwargs)),
        "file": export_single_file,
    }
    try:
        count = exporters[format](parsed.checkpoint, parsed.output, prefix=parsed.prefix)
    except (FileNotFoundError, ValueError) as error:  # ConfigurationError is a ValueError
        raise SystemExit(f"error: {error}") from None
    print(f"wrote {count} tensors to {parsed.output}")


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    "strategies": lambda args: print_strategies(),
    "export": export,
    "export-zero": partial(export, format="zero"),
    "export-fsdp2": partial(export, format="fsdp2"),
    "schedule": lambda args: draw_schedule_command(args),
    "doctor": lambda args: doctor_main(args),
    "estimate": lambda args: _estimate_command(args),
    "plan": lambda args: _plan_command(args),
}


def _plan_command(args: list[str]) -> None:
    from lightscale.estimate.plan import plan_command

    plan_command(args)


def _estimate_command(args: list[str]) -> None:
    from lightscale.estimate.report import estimate_command

    estimate_command(args)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in COMMANDS:
        try:
            COMMANDS[args[0]](args[1:])
        except ConfigurationError as error:
            raise SystemExit(f"error: {error}") from None
        return
    resolved = resolve_resume_args(resolve_config_args(args))
    if argv is None:  # from the shell: resolve in place, so Lightning re-launches ranks with the same command
        sys.argv[1:] = resolved
    try:
        build_cli(None if argv is None else resolved)
    except ConfigurationError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
