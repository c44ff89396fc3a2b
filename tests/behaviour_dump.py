"""The behaviour dump: what lightscale answers about its strategies, as one JSON-able dict, to guard refactors.

A reorganisation that moves modules must leave these answers unchanged: the strategy table (names, descriptions,
class names, registered init kwargs), the precision contract of every name and precision (its meaning, or the
refusal and its message), the planner's choice for a few model sizes, world sizes and device budgets, and
``estimate_memory`` (every category, in bytes) and the :class:`Layout` of every name at world sizes 1, 2, 4 and 8.
Everything is read through what users call: Lightning's ``StrategyRegistry`` after ``import lightscale``, the
``lightscale strategies|plan|estimate`` commands, ``lightscale.Trainer``'s up-front precision checks and
``lightscale.estimate``; classes appear by ``__name__`` only, never by module, so a move changes nothing here. The
few functions with no public face are imported in :func:`_contract_functions` alone: update that import when they
move, never the stored answers.

tests/unit/test_behaviour_dump.py compares this with tests/assets/behaviour_7ca1c58.json (the answers before the
reorganisation). After a change of behaviour that is meant (not a refactor), regenerate and review the diff:

Example:
    $ OMP_NUM_THREADS=1 python tests/behaviour_dump.py > tests/assets/behaviour_7ca1c58.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

WORLD_SIZES = (1, 2, 4, 8)
# The small fixed models of the estimate section: GPTConfig keyword arguments (moe: MoEConfig keyword arguments).
MODELS: dict[str, dict[str, Any]] = {
    "gpt_dense": {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 64},
    "gpt_moe": {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 64, "moe": {"n_experts": 4, "top_k": 2}},
}
ESTIMATES = (("gpt_dense", "32-true"), ("gpt_dense", "bf16-mixed"), ("gpt_moe", "bf16-mixed"))
MICRO_BATCH = 4
# Precision names the Trainer refuses outright, beside those with a contract row.
UNSUPPORTED_PRECISIONS = ("16-true", "64-true", "bf16")
COMPRESSIONS = ("none", "bf16", "fp16", "powersgd", "int8")
DEVICE_TYPES = ("cpu", "cuda")
# `lightscale plan`: packaged configs x world sizes x device budgets.
PLAN_CONFIGS = ("gpt/tiny_ddp.yaml", "gpt/small_ddp.yaml", "gpt/tiny_moe.yaml", "gpt/gpt2-124m_ddp.yaml")
PLAN_WORLD_SIZES = (1, 8)
PLAN_BUDGETS = ("2MiB", "150MiB", "2GiB", "80GiB")
# `lightscale estimate --json` of every packaged config at its own world size, or this one where that is the host's
# (devices: auto).
HOST_DEPENDENT_WORLD_SIZE = 8
NO_SEED = ["--seed_everything=false"]  # the commands leave the process's random state alone
UNKNOWN_NAMES = ("zero3_ofload", "fsdp3")


def dump() -> dict[str, Any]:
    """The behaviour dump (sorted keys when written; JSON values only)."""
    import lightscale  # registers the strategies in Lightning's StrategyRegistry

    names = [name for name, _ in lightscale.strategy_table()]
    return {
        "strategies": _strategies(names),
        "precision": _precision(names),
        "estimate": _estimates(names),
        "layout": _layouts(names),
        "plan_cli": _plans(),
        "estimate_cli": _estimate_cli(),
    }


def _strategies(names: list[str]) -> dict[str, Any]:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightscale

    ours = sorted(
        name
        for name in StrategyRegistry.available_strategies()
        if StrategyRegistry[name]["strategy"].__module__.split(".")[0] == "lightscale"
    )
    return {
        "table": [list(row) for row in lightscale.strategy_table()],  # in its order: least communication first
        "cli": _cli(["strategies"]).splitlines(),
        "registered_names": ours,
        "registry": {
            name: {
                "class": StrategyRegistry[name]["strategy"].__name__,
                "description": StrategyRegistry[name]["description"],
                "init_params": _jsonable(StrategyRegistry[name]["init_params"]),
            }
            for name in ours
        },
        "unknown_name": {name: _error(lightscale.Trainer, strategy=name) for name in UNKNOWN_NAMES},
    }


def _precision(names: list[str]) -> dict[str, Any]:
    """Every name x precision: the contract row and what ``lightscale.Trainer`` says on CPU and on CUDA."""
    from lightning.pytorch.strategies import StrategyRegistry

    meaning, _, _, _, supported = _contract_functions()
    contract: dict[str, Any] = {}
    for name in names:
        rules = getattr(StrategyRegistry[name]["strategy"], "precision_rules", None)
        rows: dict[str, Any] = {}
        for precision in (*supported, *UNSUPPORTED_PRECISIONS):
            row: dict[str, Any] = {
                device: _outcome(_trainer_checks, name, precision, device) for device in DEVICE_TYPES
            }
            if rules is not None and precision in supported and precision != "32":
                row["meaning"] = _outcome(meaning, rules, precision)
            if rules is not None and row["cpu"] == "ok" and precision != "32":  # else each would repeat its refusal
                row["compression_cpu"] = {c: _outcome(_compressed, rules, precision, c) for c in COMPRESSIONS}
            rows[precision] = row
        contract[name] = {"family": getattr(rules, "family", None), "precisions": rows}
    return {"supported": list(supported), "contract": contract}


def _contract_functions() -> tuple[Callable[..., Any], ...]:
    """The contract's functions with no public face (the Trainer calls the checks): the one internal import."""
    from lightscale.plugins.precision import SUPPORTED, check_precision, check_strategy_precision
    from lightscale.plugins.precision_contract import meaning, refuse_impossible

    return meaning, check_precision, check_strategy_precision, refuse_impossible, SUPPORTED


def _trainer_checks(name: str, precision: str, device: str) -> str:
    """What ``lightscale.Trainer(strategy=name, precision=precision, accelerator=device)`` checks before any work."""
    _, check_precision, check_strategy_precision, _, _ = _contract_functions()
    check_precision(precision)
    check_strategy_precision(name, precision, device)
    return "ok"


def _compressed(rules: Any, precision: str, compression: str) -> str:
    """The gradient reduction dtype of ``precision`` under ``compression`` on CPU, where the contract allows it."""
    meaning, _, _, refuse_impossible, _ = _contract_functions()
    refuse_impossible(rules, precision, device_type="cpu", compression=compression)
    return f"reduce {meaning(rules, precision, compression=compression).reduce}"


def _gpt(model: str) -> Any:
    from lightscale.layers.moe import MoEConfig
    from lightscale.recipes.gpt import GPTConfig, GPTModule

    kwargs = dict(MODELS[model])
    if "moe" in kwargs:
        kwargs["moe"] = MoEConfig(**kwargs["moe"])
    return GPTModule(GPTConfig(**kwargs))


def _estimates(names: list[str]) -> dict[str, Any]:
    """``estimate_memory`` of every name on each fixed model, a fresh module per call (it builds it on meta)."""
    out: dict[str, Any] = {"models": _jsonable(MODELS), "micro_batch": MICRO_BATCH}
    for model, precision in ESTIMATES:
        out[f"{model} {precision}"] = {
            name: {str(ws): _outcome(_estimate, model, name, world_size=ws, precision=precision) for ws in WORLD_SIZES}
            for name in names
        }
    return out


def _estimate(model: str, name: str, *, world_size: int, precision: str) -> dict[str, Any]:
    from lightscale.estimate import estimate_memory

    module = _gpt(model)
    return estimate_memory(module, name, world_size=world_size, precision=precision, micro_batch=MICRO_BATCH).as_dict()


def _layouts(names: list[str]) -> dict[str, Any]:
    from lightscale.estimate import layout_of

    return {name: {str(ws): _outcome(layout_of, name, world_size=ws) for ws in WORLD_SIZES} for name in names}


def _plans() -> dict[str, Any]:
    """``lightscale plan`` (its printed table and choice) on packaged configs; no seeding, no files written."""
    return {
        f"{config} world_size={ws} device_memory={budget}": _outcome(
            _cli_lines, ["plan", "--config", config, *NO_SEED, f"--world-size={ws}", f"--device-memory={budget}"]
        )
        for config in PLAN_CONFIGS
        for ws in PLAN_WORLD_SIZES
        for budget in PLAN_BUDGETS
    }


def _estimate_cli() -> dict[str, Any]:
    """``lightscale estimate --json`` of every packaged config, at its own world size where it names one."""
    from lightscale.cli import packaged_configs, resolve_config

    out = {}
    for config in packaged_configs():
        trainer = yaml.safe_load(Path(resolve_config(config)).read_text()).get("trainer", {})
        devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
        ws = devices * nodes if isinstance(devices, int) and devices > 0 else HOST_DEPENDENT_WORLD_SIZE
        argv = ["estimate", "--config", config, *NO_SEED, f"--world-size={ws}", "--json"]
        out[f"{config} world_size={ws}"] = _outcome(_cli_json, argv)
    return out


def _cli(argv: list[str]) -> str:
    """What ``lightscale ARGV`` prints; a SystemExit (the command's error) becomes an exception with its message."""
    from lightscale.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exit:
            raise RuntimeError(str(exit.code)) from None
    return out.getvalue()


def _cli_lines(argv: list[str]) -> list[str]:
    return _cli(argv).splitlines()


def _cli_json(argv: list[str]) -> Any:
    return json.loads(_cli(argv))


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` as JSON values, or ``{"error": "Type: message"}`` where it raises."""
    try:
        return _jsonable(call(*args, **kwargs))
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _error(call: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    result = _outcome(call, *args, **kwargs)
    return result["error"] if isinstance(result, dict) and "error" in result else None


def _jsonable(value: Any) -> Any:
    """JSON values; tuples as lists; anything else by type name (never a repr, which may hold an address)."""
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return f"<{type(value).__name__}>"


def main() -> None:
    json.dump(dump(), sys.stdout, indent=1, sort_keys=True, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
