"""Every line that knows DeepSpeed lives in the family package lightscale/strategies/deepspeed/ (plus the patch module
patches/deepspeed.py and the offline reader of its directories, checkpoint/deepspeed_dir.py): no other module imports
deepspeed, at module level or inside a function, or names one of its attributes. The ZeRO strategy class
(deepspeed/strategy.py) starts the engine through deepspeed/build.py and answers the shard questions from
deepspeed/partition.py (deepspeed/shards.py); callbacks, the estimator, storage and checkpoint code ask the strategy
instead (lightscale/strategies/shards.py: ``local_shard``, ``global_shape``, ``global_numel``, ``parameter_tensors``,
the optimizer's gradient and state tensors)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightscale"
ALLOWED = ("strategies/deepspeed/", "checkpoint/deepspeed_dir.py", "patches/deepspeed.py")

# DeepSpeed's own names: ZeRO-3 parameter attributes, ZeRO optimizer attributes, its helpers (grep of
# strategies/deepspeed/ and patches/deepspeed.py). A name here, as an attribute, a variable or a string (getattr),
# outside ALLOWED fails.
DEEPSPEED_NAMES = frozenset(
    {
        *("ds_tensor", "ds_shape", "ds_numel", "ds_id", "ds_persist", "ds_status", "ds_active_sub_modules"),
        *("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"),
        *("averaged_gradients", "grad_partitions_flat_buffer", "offload_gradient_dict", "flat_partition"),
        *("bit16_groups", "fp16_groups", "fp16_partitioned_groups_flat", "parallel_partitioned_bit16_groups"),
        *("update_lp_params", "reduce_gradients", "get_full_hp_param", "partition_count"),
        *("_hp_optimizer_states_linked", "_lazy_init_hp_params_optimizer_state", "_restore_from_bit16_weights"),
        *("safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state"),
        *("safe_set_full_optimizer_state", "GatheredParameters", "zero_to_fp32", "set_gradient_accumulation_boundary"),
        *("round_robin_bit16_meta", "round_robin_bit16_offsets", "real_dp_process_group", "bit16_groups_flat"),
        *(
            "sub_group_process_groups",
            "partition_numel",
        ),  # the flat layout FlatMuon is given (strategies/deepspeed/partition.py)
    }
)


def _allowed(path: Path) -> bool:
    relative = path.relative_to(ROOT).as_posix()
    return any(relative == rule or (rule.endswith("/") and relative.startswith(rule)) for rule in ALLOWED)


def deepspeed_mentions(path: Path) -> list[str]:
    """``line: what`` for every import of deepspeed and every DeepSpeed name ``path`` uses (docstrings aside)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "deepspeed"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            found.append(f"{node.lineno}: from {node.module} import")
        name = (
            node.attr
            if isinstance(node, ast.Attribute)
            else node.id
            if isinstance(node, ast.Name)
            else node.value
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            else None
        )
        if name in DEEPSPEED_NAMES:
            found.append(f"{node.lineno}: {name}")
    return found


def files_naming_deepspeed() -> dict[str, list[str]]:
    return {
        path.relative_to(ROOT).as_posix(): found
        for path in sorted(ROOT.rglob("*.py"))
        if not _allowed(path) and (found := deepspeed_mentions(path))
    }


def test_only_zero_knows_deepspeed() -> None:
    assert files_naming_deepspeed() == {}, (
        "ask the strategy (lightscale/strategies/shards.py); answer in strategies/deepspeed/"
    )


def test_the_check_sees_a_planted_read(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def numel(p):\n"
        '    """ds_numel in a docstring is prose."""\n'
        '    return getattr(p, "ds_numel", None) or p.ds_tensor.numel()\n'
        "import deepspeed.utils\n"
        "def start():\n"
        "    import deepspeed\n"
        "    from deepspeed.ops.adam import DeepSpeedCPUAdam\n"
    )
    assert sorted(deepspeed_mentions(planted)) == [
        "3: ds_numel",
        "3: ds_tensor",
        "4: import deepspeed.utils",
        "6: import deepspeed",
        "7: from deepspeed.ops.adam import",
    ]
