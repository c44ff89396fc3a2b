"""The private APIs of torch, Lightning and DeepSpeed that lightscale relies on still exist where we use them, and
nothing outside lightscale/patches/ touches an upstream name or process-wide state unless the table there lists it.

Private names move between releases without notice; pyproject.toml caps the versions tested, and this test fails
naming the API (one table: ``lightscale.patches.all_patches()``; docs/architecture.md, "Upstream patches") when an
upgrade moves one. The guard at the end reads every module's syntax tree, so ``setattr``, ``environ.update`` and
attribute stores are seen as well as plain assignments.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

from lightscale.patches import Patch, all_patches, private_reads
from lightscale.runtime.processes import RESTORING

OPTIONAL = {"deepspeed", "torchao", "litdata"}  # extras of pyproject.toml, not dependencies


def _resolve(module: str, path: str) -> object:
    value: object = importlib.import_module(module)
    for name in path.split("."):
        value = getattr(value, name)
    return value


_READS = [p for p in all_patches() if p.scope == "read" and p.attributes is None]


@pytest.mark.parametrize("patch", _READS, ids=[p.target for p in _READS])
def test_private_name_exists(patch: Patch) -> None:
    module, _, path = patch.target.partition(":")
    if module.split(".")[0] in OPTIONAL:  # `make test`'s venv has every extra; a `make compat` venv may lack one
        pytest.importorskip(module.split(".")[0])
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{module}.{path} (used for: {patch.why}) moved or vanished: {error}. See lightscale/patches/.")


def test_the_restoring_methods_are_the_pinned_ones() -> None:
    assert RESTORING == private_reads.RESTORING


def test_fsdp2_custom_comm_hooks_keep_their_signatures() -> None:  # lightscale/parallel/fsdp_wires.py implements them
    import inspect

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    assert list(inspect.signature(AllGather.__call__).parameters) == [
        "self",
        "output_tensor",
        "input_tensor",
        "group",
        "async_op",
    ]
    assert list(inspect.signature(ReduceScatter.__call__).parameters) == [
        "self",
        "output_tensor",
        "input_tensor",
        "group",
        "op",
        "async_op",
    ]
    assert list(inspect.signature(AllGather.allocate).parameters) == ["self", "size", "dtype", "device"]
    assert callable(FSDPModule.set_custom_all_gather) and callable(FSDPModule.set_custom_reduce_scatter)


def test_lightning_strategies_redirect_forward() -> None:  # FSDP roots enter training_step through it
    from lightning.pytorch.strategies import SingleDeviceStrategy

    assert callable(SingleDeviceStrategy("cpu")._forward_redirection), "Strategy._forward_redirection moved"


@pytest.mark.parametrize(
    ("pattern", "used_for"),
    [
        ("self._config", "ZeRO: its checkpoint engine is rebuilt weights-only from engine._config"),
        ("self.optimizer._restore_from_bit16_weights()", "ZeRO-3 evaluation stubs it on the offload stand-in"),
        ("elif hasattr(p, 'ds_optim_param'):", "ZeRO-0/1/2: 0-dim parameters skip the start-up broadcast by this mark"),
    ],
)
def test_deepspeed_engine_internals(pattern: str, used_for: str) -> None:
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    assert pattern in inspect.getsource(DeepSpeedEngine), f"DeepSpeedEngine no longer uses {pattern} ({used_for})"


@pytest.mark.parametrize(
    "attribute",
    [
        "single_partition_of_fp32_groups",
        "real_dp_process_group",
        "partition_size",
        "round_robin_bit16_meta",
        "round_robin_bit16_offsets",
        "bit16_groups_flat",
    ],
)
def test_zero12_flat_layout_attributes(
    attribute: str,
) -> None:  # lightscale/strategies/deepspeed/partition.py flat_groups (FlatMuon)
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(DeepSpeedZeroOptimizer)
    assert f"self.{attribute}" in source, f"ZeRO-1/2 no longer keeps {attribute}: flat_groups reads the layout from it"
    assert "self.optimizer.param_groups = [original_param_groups[group_no]]" in source  # one group per inner step


@pytest.mark.parametrize("attribute", ["fp32_partitioned_groups_flat", "sub_group_process_groups", "fp16_groups"])
def test_zero3_flat_layout_attributes(
    attribute: str,
) -> None:  # lightscale/strategies/deepspeed/partition.py flat_groups (FlatMuon)
    import inspect

    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    assert f"self.{attribute}" in source, f"ZeRO-3 no longer keeps {attribute}: flat_groups reads the layout from it"
    assert "start = start + src.ds_numel" in source  # each parameter's partition laid end to end in a sub-group
    assert "def partition_numel" in inspect.getsource(Init)  # the per-rank piece, ceil(numel / ranks)


def test_zero3_gathers_to_ds_shape() -> (
    None
):  # lightscale/strategies/deepspeed/engine.py scalars_as_vectors sets it back to []
    import inspect

    from deepspeed.runtime.zero import partition_parameters

    source = inspect.getsource(partition_parameters)
    assert "param.ds_shape = param.shape" in source and ".view(param.ds_shape)" in source
    assert "dist.broadcast(param.data.view(torch.uint8)" in source  # why 0-dim parameters start as [1]


def test_zero_to_fp32_loads_through_its_torch_global() -> None:  # export swaps that global for weights-only loads
    from deepspeed.utils import zero_to_fp32

    assert zero_to_fp32.torch is torch, "deepspeed.utils.zero_to_fp32.torch moved: export would load unsafely"


def test_fit_loop_keeps_its_data_source() -> None:  # ZeRO reads the micro-batch size from it
    from lightning.pytorch import Trainer

    loop = Trainer(accelerator="cpu", devices=1, logger=False).fit_loop
    assert hasattr(loop, "_data_source") and hasattr(loop._data_source, "is_defined")


def test_fsdp_state_says_whether_its_root_ran_forward() -> None:  # lightscale/parallel/fsdp.py reset_interrupted_roots
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert hasattr(FSDPModule, "_get_fsdp_state")
    assert FSDPState()._is_root is None  # set by the lazy init of the first forward


def test_graph_task_id_outside_backward() -> None:
    assert torch._C._current_graph_task_id() == -1  # bucketed_ddp relies on -1 outside a backward pass


def test_pipeline_schedules_take_scale_grads() -> None:
    import inspect

    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert "scale_grads" in inspect.signature(_PipelineSchedule.__init__).parameters  # 1/microbatches scaling


# ---- every upstream patch (lightscale/patches/): wrapped signatures and private attributes, pinned ----------------
def _resolve_target(target: str) -> object:
    """``module:qualname``, or the module itself for ``module:``."""
    module, _, qualname = target.partition(":")
    return _resolve(module, qualname) if qualname else importlib.import_module(module)


_PATCHES = all_patches()


@pytest.mark.parametrize("patch", [p for p in _PATCHES if p.signature], ids=[p.target for p in _PATCHES if p.signature])
def test_wrapped_callable_keeps_its_parameters(patch: Patch) -> None:
    target, names = patch.signature  # type: ignore[misc]
    found = tuple(inspect.signature(_resolve_target(target)).parameters)
    assert found[: len(names)] == names, f"{target} now takes {found}; lightscale relies on {names} ({patch.why})"


@pytest.mark.parametrize(
    "patch", [p for p in _PATCHES if p.attributes], ids=[p.target for p in _PATCHES if p.attributes]
)
def test_private_attributes_are_still_used_upstream(patch: Patch) -> None:
    owner, names = patch.attributes  # type: ignore[misc]
    found = _resolve_target(owner)
    source = "".join(_source(cls) for cls in (inspect.getmro(found) if isinstance(found, type) else [found]))
    missing = [name for name in names if f".{name}" not in source]
    assert not missing, f"{owner} no longer has {missing} ({patch.why}); see lightscale/patches/"


def _source(cls: object) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # builtins, generics
        return ""


# ---- the guard: upstream names and process state are touched only in lightscale/patches/ -----------------------
ROOT = Path(__file__).resolve().parents[2] / "lightscale"
# Underscored names that are public API: namedtuple's methods and fields, os._exit.
PUBLIC = {"_replace", "_fields", "_asdict", "_make", "_exit"}
MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(), str(path))) for path in sorted(ROOT.rglob("*.py"))]


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _upstream_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing something that is not lightscale (``os``, ``sys``, ``rank_zero_only``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if not a.name.startswith("lightscale")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("lightscale"):
            names |= {a.asname or a.name for a in node.names}
    return names


def _own_private_names(modules: list[tuple[Path, ast.Module]]) -> set[str]:
    """``_names`` lightscale defines itself (functions, classes, variables, attributes it stores, parameters)."""
    own: set[str] = set()
    for _, tree in modules:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)) or isinstance(node, ast.arg):
                own.add(node.id if isinstance(node, ast.Name) else node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and not node.name.startswith("_"):
                own.add(node.asname or node.name)
            elif isinstance(node, ast.keyword) and node.arg:
                own.add(node.arg)
    return own


def _writes(tree: ast.Module) -> list[tuple[int, str]]:
    """Stores, ``setattr``/``delattr``, environment mutations and method shadowing that reach upstream objects or
    process state: (line, what)."""
    upstream = _upstream_names(tree)
    shadowed = {  # attributes this module sets to a lambda on an object other than self: a method shadowed
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)
        for target in node.targets
        if isinstance(target, ast.Attribute) and ast.unparse(_root(target)) != "self"
    }
    found = [
        (node.lineno, f"{attribute} = lambda (a shadowed method)")
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda)
        for target in node.targets
        if isinstance(target, ast.Attribute) and ast.unparse(_root(target)) != "self"
        for attribute in [ast.unparse(target)]
    ]
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(part, (ast.Attribute, ast.Subscript)):
                    continue
                root = _root(part)
                if isinstance(root, ast.Name) and root.id in upstream:
                    found.append((node.lineno, f"store {ast.unparse(part)}"))
                elif isinstance(node, ast.Delete) and isinstance(part, ast.Attribute) and part.attr in shadowed:
                    found.append((node.lineno, f"del {ast.unparse(part)} (a shadowed method)"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            root = _root(node.args[0])
            if isinstance(root, ast.Name) and root.id in upstream:
                found.append((node.lineno, f"{func.id}({ast.unparse(node.args[0])}, ...)"))
        elif isinstance(func, ast.Attribute) and (
            (func.attr in MUTATORS and "environ" in ast.unparse(func.value)) or func.attr in ("putenv", "unsetenv")
        ):
            found.append((node.lineno, f"{ast.unparse(func)}(...)"))
        elif "MethodType" in ast.unparse(func):
            found.append((node.lineno, "types.MethodType (a shadowed method)"))
    found += [
        (node.lineno, "unittest (a mock in the package)")
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and "unittest" in [getattr(node, "module", None), *(a.name.split(".")[0] for a in node.names)]
    ]
    return sorted(found)


def _private_reads(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    """Private names of other packages read: ``x._name``, ``getattr(x, "_name")``, ``from pkg import _name``, where
    lightscale defines no ``_name`` itself."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr") and node.args[1:]:
            value = node.args[1]
            name = value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
        elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("lightscale") and node.level == 0:
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("_") and a.name not in own]
        if name and name.startswith("_") and not name.startswith("__") and name not in own | PUBLIC:
            found.append((node.lineno, name))
    return sorted(found)


def _pinned_words() -> set[str]:
    words: set[str] = set()
    for patch in all_patches():
        text = " ".join([patch.target, *(patch.signature or ("", ()))[:1], *((patch.attributes or ("", ()))[1])])
        words |= set(re.findall(r"_?\w+", text))
    return words


def test_only_the_patches_package_writes_upstream_or_process_state() -> None:
    """Outside lightscale/patches/: no store, ``setattr``/``delattr`` or environment mutation on an imported module or
    upstream object, no shadowed method, no mock. lightscale/patches/process.py holds the writes, each in the table."""
    found = [
        f"{path.relative_to(ROOT.parent)}:{line} {what}"
        for path, tree in _modules()
        if "patches" not in path.relative_to(ROOT).parts
        for line, what in _writes(tree)
    ]
    assert not found, "write it through lightscale/patches/ (a function there, a row in its PATCHES):\n" + "\n".join(
        found
    )


def test_every_private_read_is_pinned() -> None:
    """A private name of torch, Lightning, DeepSpeed or another package read anywhere in lightscale is named by a row
    of the table (lightscale/patches/private_reads.py for reads), so the tests above pin it to the release."""
    modules = _modules()
    own, pinned = _own_private_names(modules), _pinned_words()
    unpinned = [
        f"{path.relative_to(ROOT.parent)}:{line} {name}"
        for path, tree in modules
        for line, name in _private_reads(tree, own)
        if name not in pinned
    ]
    assert not unpinned, "pin these in lightscale/patches/private_reads.py:\n" + "\n".join(unpinned)


def test_the_guard_sees_what_a_text_search_missed() -> None:
    tree = ast.parse(
        "import os, sys\nfrom lightning.pytorch.utilities.rank_zero import rank_zero_only\n"
        "os.environ.update(A='1')\nsetattr(sys, 'excepthook', print)\nrank_zero_only.rank = 0\n"
        "sys.excepthook = print\nos.environ['B'] = '1'\nmodule.loss = lambda batch: batch\ndel module.loss\n"
    )
    assert [line for line, _ in _writes(tree)] == [3, 4, 5, 6, 7, 8, 9]
    reads = ast.parse("import torch\ntorch._C._current_graph_task_id()\nmodule._trainer\nself._mine = 1\nx._mine\n")
    assert [name for _, name in _private_reads(reads, {"_mine"})] == ["_C", "_current_graph_task_id", "_trainer"]


def test_architecture_page_lists_every_patch() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    assert not [p.target for p in _PATCHES if p.scope != "read" and f"`{p.target}`" not in page]
