"""The conformance matrix: every zoo model (zoo.py) under every registered strategy name with its defaults.

One launch per name runs every model (cells.py); each (model, name) cell is then checked here:
    * fit: the trained weights equal one process's (SGD + momentum, fp32: only the order of the gradient sums
      differs, ``TOLERANCE``); approximate names against their own bound (``LOSS_BOUND``, as the former
      tests/distributed/test_any_model.py, folded in here, had them) or, where no per-step bound exists (PowerSGD,
      DiLoCo's workers training alone between syncs, H=100 by default), the first step equals one process's and the
      loss falls (tests/distributed/test_powersgd.py and test_diloco.py check them against their own references);
    * resume: a fit resumed from the checkpoint of step ``SAVE_AT`` ends bitwise where the uninterrupted one ends
      (every tensor of the final checkpoint, weights and optimizer state, and the losses after the resume);
    * load, validate: after only ``import lightscale``, in a fresh Python, ``Model.load_from_checkpoint(dir)`` gives
      the trained tensors bitwise and plain ``lightning.Trainer(devices=1).validate(model, ckpt_path=dir)`` the
      trained model's loss;
    * consolidate: ``lightscale consolidate`` output loads through ``load_from_checkpoint`` in a Python where
      lightscale cannot be imported, bitwise.
A name that cannot run a model refuses before any training step with an error naming what would work
(``REFUSALS``). ``KNOWN_BROKEN`` lists cells that fail today, each with why: they xfail strictly, so a fix that
lands makes its entry fail until removed. With ``-s`` the module prints the table of pass / refused / known-broken
cells per name (also written to conformance.md in pytest's base temp directory).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from cells import SAVE_AT, Cell, one_process, run_name
from checkpoint_matrix import read_offline
from helpers import relative_difference
from zoo import ZOO, batch, build

import lightscale
from lightscale.cli import main as cli_main
from lightscale.testing import run_distributed

NAMES = [name for name, _ in lightscale.strategy_table()]
MODELS = list(ZOO)
# One name per engine path (DDP, ZeRO's flat partitions and ZeRO-3's partitioned parameters, FSDP2, the 3-D mesh,
# context parallel, DiLoCo's workers, the planner's pick) runs the two Hugging Face models and Lightning's behaviours;
# every name runs the native models, whose quirks (0-dim, tied, frozen, buffers, configure_model) are what differs
# between names of one engine. The matrix fits in the suite's time this way (docs/conformance.md).
BROAD_NAMES = ("bucketed_ddp", "zero2", "zero3", "fsdp2", "parallel_3d", "cp2", "diloco", "fit_memory")
HF_MODELS = ("hf_gpt2", "hf_llama")


def models_of(name: str) -> list[str]:
    return [model for model in MODELS if name in BROAD_NAMES or model not in HF_MODELS]


CHECKS = ("fit", "resume", "load", "validate", "consolidate")
RANKS = {"hsdp": 4, "tp2_pp2": 4, "ep2_pp2": 4, "ep2_tp2": 4, "cp2_tp2": 4}
TOLERANCE = 1e-5  # relative (per tensor, in norm) after 4 fp32 steps: only the order of the gradient sums differs
# bf16 on the wire: gradients within 2 * 2**-9 relative, so each step's loss change within that fraction of itself
# (first order; test_parity.py's derivation, there 2e-2 over 10 steps); ZeRO++: int8 weights and gradients rounded
# stochastically, each value within one step, absmax/127, of its block (docs/strategies/fsdp2.md), so first order
# the loss within 1/127 of itself.
LOSS_BOUND = {"bucketed_ddp_bf16": 1e-2, "fsdp2_zeropp": 1 / 127}
# Rank-4 factors of each gradient matrix (error feedback repays the rest over later steps) bound no per-step error:
# 5e-2 on tied_lm here. Its first step equals one process's, it learns, and tests/distributed/test_powersgd.py
# checks it against its own reference (PowerSGD in one process).
OWN_REFERENCE = {"bucketed_ddp_powersgd"}
TRAIN_ALONE = {"diloco", "streaming_diloco", "local_sgd"}

_NO_PLAN = "Tensor parallelism (tp > 1) needs a plan: define"
_NO_STAGES = "Pipeline parallelism (pp > 1) needs the hooks"
_NO_EXPERTS = "shards MoE experts, but the model has no"
_NO_SEQUENCE = "batch is not a (tokens, targets)-like batch"
_NO_ATTENTION = "called it nowhere during the first training step"  # cp2 splits sequences SDPA must see whole
_NOT_TP = {"tp2": _NO_PLAN, "tp2_pp2": _NO_PLAN, "pp2": _NO_STAGES, "cp2_tp2": _NO_PLAN}
_NOT_EP = {"ep2": _NO_EXPERTS, "ep2_pp2": _NO_STAGES, "ep2_tp2": _NO_PLAN}  # the pp and tp hooks are asked first
# (model, name) -> a fragment of the error raised before training. No zoo model has a TP plan, a pipeline split or
# MoE layers; three have no sequence to split.
REFUSALS: dict[tuple[str, str], str] = {
    **{(model, name): text for model in MODELS for name, text in (_NOT_TP | _NOT_EP).items()},
    **{(model, "cp2"): _NO_SEQUENCE for model in ("temperature", "regressor", "quirks")},
    ("tied_lm", "cp2"): _NO_ATTENTION,
    # streaming DiLoCo's default 4 fragments need 4 parameter tensors; the tied LM has 3 (the head is the embedding)
    ("tied_lm", "streaming_diloco"): "fragments=4 is more than the 3 parameter tensors to split; choose fragments <=",
}

# Cells that fail today, each with why: they xfail strictly, so a fix makes its entry fail until removed.
# (model, name, check) -> the finding.
KNOWN_BROKEN: dict[tuple[str, str, str], str] = {}


# Lightning's behaviours (behaviours.py) run in the same launches, under the broad names that run a (features, labels)
# classifier.
ASPECTS = ("hooks", "strategy_api", "sync_dist", "model_checkpoint", "early_stopping", "evaluate", "callback_state")
BEHAVIOUR_NAMES = [name for name in BROAD_NAMES if ("regressor", name) not in REFUSALS]


def _cells() -> Iterator[Any]:
    """Check by check: every launch (by the fit checks) before the outside processes, which load every cell once."""
    for check in CHECKS:
        for name in NAMES:
            for model in models_of(name):
                if check != "fit" and (model, name) in REFUSALS:
                    continue
                reason = KNOWN_BROKEN.get((model, name, check))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                yield pytest.param(name, model, check, marks=marks, id=f"{name}-{model}-{check}")


class Matrix:
    """The launches (one per name, on first use), the one-process reference and the two outside processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.launches: dict[str, dict[str, Cell]] = {}
        self.behaviours: dict[str, list[dict[str, Any]]] = {}  # per rank
        self.all_ranks_failed: dict[str, dict[str, bool]] = {}
        self.outcomes: dict[tuple[str, str, str], str] = {}
        self._reference: dict[str, dict[str, Any]] | None = None
        self._outside: dict[str, dict[str, Any]] = {"lightscale": {}, "plain": {}}
        self._outside_names: dict[str, set[str]] = {"lightscale": set(), "plain": set()}

    @property
    def reference(self) -> dict[str, dict[str, Any]]:
        if self._reference is None:
            self._reference = run_distributed(one_process, MODELS, str(self.root), world_size=1, timeout_s=300)[0]
        return self._reference

    def cell(self, name: str, model: str) -> Cell:
        if name not in self.launches:
            ranks = RANKS.get(name, 2)
            behaviours = name in BEHAVIOUR_NAMES
            per_rank = run_distributed(
                run_name, name, str(self.root), models_of(name), behaviours=behaviours, world_size=ranks, timeout_s=600
            )
            self.launches[name] = per_rank[0]
            self.behaviours[name] = [rank.get("behaviours") for rank in per_rank]
            failed = {m: all(r[m].fit.error is not None for r in per_rank) for m in models_of(name)}
            self.all_ranks_failed[name] = failed
        return self.launches[name][model]

    def checkpoint(self, name: str, model: str, which: str = "final") -> Path:
        return self.root / name / model / f"{which}.ckpt"

    def outside(self, mode: str, name: str) -> dict[str, Any]:
        """Every trained cell of the names launched so far loaded in one fresh Python: ``lightscale`` (only
        ``import lightscale``) or ``plain`` (consolidated files; lightscale not importable)."""
        self.cell(name, MODELS[0])
        if name not in self._outside_names[mode]:
            names = set(self.launches) - self._outside_names[mode]
            self._outside[mode] |= self._run_outside(mode, [n for n in NAMES if n in names])
            self._outside_names[mode] |= names
        return self._outside[mode]

    def _run_outside(self, mode: str, names: list[str]) -> dict[str, Any]:
        manifest = []
        for name in names:
            for model in models_of(name):
                if (model, name) in REFUSALS or self.cell(name, model).fit.error is not None:
                    continue
                checkpoint = self.checkpoint(name, model)
                expected = self.root / name / model / "expected.pt"
                torch.save(_model_tensors(checkpoint), expected)
                if mode == "plain":
                    consolidated = checkpoint.with_suffix(".consolidated.ckpt")
                    cli_main(["consolidate", str(checkpoint), str(consolidated)])
                    checkpoint = consolidated
                entry = {"cell": f"{name}/{model}", "model": model, "checkpoint": str(checkpoint)}
                manifest.append(entry | {"expected": str(expected)})
        path = self.root / f"manifest_{mode}_{len(self._outside[mode])}.json"
        path.write_text(json.dumps(manifest))
        isolated = ["-I"] if mode == "plain" else []
        script = str(Path(__file__).parent / "outside.py")
        done = subprocess.run(
            [sys.executable, *isolated, script, mode, str(path)], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report.pop("lightscale imported") is (mode == "lightscale")
        return report

    def table(self) -> str:
        """Per name: models refused, and the checks (fit, resume, load, validate, consolidate of each model it runs)
        that passed, are known broken (KNOWN_BROKEN) and failed."""
        kinds = ("refused", "pass", "known-broken", "failed")
        rows = ["| name | models refused | checks passed | checks known broken | checks failed |", "|---" * 5 + "|"]
        for name in NAMES:
            counts = Counter(outcome for (_, n, _), outcome in self.outcomes.items() if n == name)
            if counts:
                rows.append(f"| {name} | " + " | ".join(str(counts[kind]) for kind in kinds) + " |")
        total = Counter(self.outcomes.values())
        rows.append("| all | " + " | ".join(str(total[kind]) for kind in kinds) + " |")
        return "\n".join(rows)


def _model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as the checkpoint holds them, read without lightscale's loaders (DCP offline)."""
    if checkpoint.is_file():
        return torch.load(checkpoint, weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in read_offline(checkpoint).items() if k.startswith("model.")}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    for model in MODELS:  # imports and lazily loaded code once here (HF's attention, masks): every rank inherits them
        module = build(model)
        module.configure_model()
        module.compute_loss(batch(module)).backward()
    for name in ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer"):  # what a ZeRO engine imports
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    matrix = Matrix(tmp_path_factory.mktemp("conformance"))
    yield matrix
    table = matrix.table()
    (tmp_path_factory.getbasetemp() / "conformance.md").write_text(table + "\n")
    print("\n" + table)


# ---- the checks ---------------------------------------------------------------------------------------------------
def _fit(matrix: Matrix, name: str, model: str) -> str:
    cell = matrix.cell(name, model)
    if (model, name) in REFUSALS:
        assert cell.fit.error is not None, f"{model} trained under {name}; the matrix expects a refusal"
        assert REFUSALS[model, name] in cell.fit.error, cell.fit.error
        assert cell.fit.steps == 0, f"refused after {cell.fit.steps} optimizer steps"
        assert matrix.all_ranks_failed[name][model], "refused on some ranks only"
        return "refused"
    if cell.fit.error is not None:
        pytest.fail(cell.fit.error, pytrace=False)
    reference = matrix.reference[model]
    if name in TRAIN_ALONE | OWN_REFERENCE:  # the first step is every worker's and one process's; then it learns
        assert relative_difference(cell.fit.losses[:1], reference["losses"][:1]) <= TOLERANCE
        assert all(math.isfinite(loss) for loss in cell.fit.losses)
        assert cell.fit.losses[-1] < cell.fit.losses[0]
        return "pass"
    if name in LOSS_BOUND:
        assert relative_difference(cell.fit.losses, reference["losses"]) <= LOSS_BOUND[name]
        return "pass"
    trained = _model_tensors(matrix.checkpoint(name, model))
    expected = reference["state"]
    assert sorted(trained) == sorted(expected)
    for key, value in expected.items():
        if value.is_floating_point():
            assert torch.linalg.vector_norm(trained[key] - value) <= TOLERANCE * torch.linalg.vector_norm(value), key
        else:
            assert torch.equal(trained[key], value), key
    return "pass"


def _resume(matrix: Matrix, name: str, model: str) -> str:
    cell = matrix.cell(name, model)
    if cell.resumed is None or cell.resumed.error is not None:
        pytest.fail(cell.resumed.error if cell.resumed else f"not resumed: {cell.fit.error}", pytrace=False)
    assert cell.resumed.losses == cell.fit.losses[SAVE_AT:]
    ended = read_or_load(matrix.checkpoint(name, model))
    resumed = read_or_load(matrix.checkpoint(name, model, "resumed"))
    assert sorted(ended) == sorted(resumed)
    different = [key for key, value in ended.items() if not _same(value, resumed[key])]
    assert not different, different
    return "pass"


def read_or_load(checkpoint: Path) -> dict[str, Any]:
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        return {f"model.{k}": v for k, v in saved["state_dict"].items()} | {"optimizer": saved["optimizer_states"]}
    return read_offline(checkpoint)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return repr(a) == repr(b)


def _outside(mode: str, check: str) -> Any:
    def run(matrix: Matrix, name: str, model: str) -> str:
        if matrix.cell(name, model).fit.error is not None:
            pytest.fail(f"not trained: {matrix.cell(name, model).fit.error}", pytrace=False)
        result = matrix.outside(mode, name)[f"{name}/{model}"][check]
        if result != "ok":
            pytest.fail(result, pytrace=False)
        return "pass"

    return run


CHECK = {
    "fit": _fit,
    "resume": _resume,
    "load": _outside("lightscale", "load"),
    "validate": _outside("lightscale", "validate"),
    "consolidate": _outside("plain", "load"),
}


@cache
def _unavailable(name: str) -> str | None:
    """Why ``name`` cannot start on this machine at all (then its cells skip), or None."""
    if name != "zero_infinity":
        return None
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return "zero_infinity needs libaio (apt-get install libaio-dev) for its NVMe swap"


@pytest.mark.parametrize(("name", "model", "check"), list(_cells()))
def test_cell(matrix: Matrix, name: str, model: str, check: str) -> None:
    if reason := _unavailable(name):
        pytest.skip(reason)
    key = (model, name, check)
    try:
        matrix.outcomes[key] = CHECK[check](matrix, name, model)
    except BaseException:
        matrix.outcomes[key] = "known-broken" if key in KNOWN_BROKEN else "failed"
        raise


# ---- Lightning's behaviours -----------------------------------------------------------------------------------------
def _aspects() -> Iterator[Any]:
    for aspect in ASPECTS:
        for name in BEHAVIOUR_NAMES:
            reason = KNOWN_BROKEN.get(("behaviours", name, aspect))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(name, aspect, marks=marks, id=f"{name}-{aspect}")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * abs(b)


def _check_behaviour(ranks: list[dict[str, Any]], reference: dict[str, Any], aspect: str, exact: bool) -> None:
    mine = ranks[0]
    if aspect == "hooks":  # every hook a callback sees, in Lightning's single-device order
        assert mine["hooks"] == reference["hooks"]
    elif aspect == "strategy_api":
        for rank in ranks:
            assert rank["api"] == reference["api"], rank["api"]
    elif aspect == "sync_dist":
        for rank in ranks:
            if rank["sync_error"] is not None:
                pytest.fail(rank["sync_error"], pytrace=False)
            assert rank["logged"] == mine["logged"]  # synced: every rank logged the same values
        assert {"train_loss", "weight_norm", "val_loss"} <= mine["logged"].keys()
        assert "grad_norm" in mine["logged"] or reference["logged"].keys() - mine["logged"].keys() == {"grad_norm"}
        if exact:
            assert all(_close(value, reference["logged"][key]) for key, value in mine["logged"].items())
    elif aspect == "model_checkpoint":  # top-2 by val_loss and last
        assert mine["kept"] == reference["kept"] if exact else len(mine["kept"]) == len(reference["kept"])
    elif aspect == "early_stopping":
        assert mine["step"] == reference["step"] < 6
    elif aspect == "evaluate":  # validate, test, predict after fit
        assert all(rank["validate"] == mine["validate"] and rank["test"] == mine["test"] for rank in ranks)
        index, count = mine["shards"]
        assert len(mine["predict"]) == len(reference["predict"][index::count])
        if exact:
            assert _close(mine["validate"], reference["validate"]) and _close(mine["test"], reference["test"])
            assert mine["predict"] == reference["predict"][index::count]
    elif aspect == "callback_state":  # a callback's state_dict saved in the checkpoint, restored by fit(ckpt_path)
        assert all(rank["restored"] == rank["saved_batches"] == reference["restored"] for rank in ranks)


@pytest.mark.parametrize(("name", "aspect"), list(_aspects()))
def test_lightning_behaviour(matrix: Matrix, name: str, aspect: str) -> None:
    if reason := _unavailable(name):
        pytest.skip(reason)
    key = ("behaviours", name, aspect)
    try:
        matrix.cell(name, MODELS[0])
        ranks = matrix.behaviours[name]
        for rank in ranks:
            if "error" in rank:
                pytest.fail(rank["error"], pytrace=False)
        exact = name not in LOSS_BOUND.keys() | OWN_REFERENCE | TRAIN_ALONE
        _check_behaviour(ranks, matrix.reference["behaviours"], aspect, exact)
    except BaseException:
        matrix.outcomes[key] = "known-broken" if key in KNOWN_BROKEN else "failed"
        raise
    matrix.outcomes[key] = "pass"
