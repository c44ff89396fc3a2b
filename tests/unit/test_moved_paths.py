"""Moving a file never breaks a user: an import path the docs show keeps working after its module moves, as a plain
re-export module that warns (``DeprecationWarning``) and gives the very objects of the new home (one class, one
``isinstance``). Undocumented old paths just move (docs/architecture.md, "Folders")."""

from __future__ import annotations

import importlib
import sys

import pytest

# old documented path -> new home; each old path is a file of lightscale/ that re-exports the new one's __all__
MOVED = {
    "lightscale.streams": "lightscale.data.streams",
    "lightscale.comm_counter": "lightscale.measure.comm_counter",  # docs/strategies/diloco.md's SlowLink
    "lightscale.storage.local_s3": "lightscale.testing.local_s3",  # python -m, docs/plugins/checkpoint.md
    # the house by concept: the ZeRO family's engine, fault tolerance and DiLoCo's inner strategies moved
    "lightscale.zero.ops": "lightscale.strategies.deepspeed.ops",  # python -m, Makefile and docs/strategies/zero.md
    "lightscale.zero.checkpoint_dir": "lightscale.checkpoint.deepspeed_dir",  # docs/strategies/zero.md
    "lightscale.parallel.diloco.lighthouse": "lightscale.fault_tolerance.lighthouse",  # python -m, the FT docs
    "lightscale.strategies.inner": "lightscale.strategies.diloco.inner",  # docs/strategies/diloco.md
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_documented_old_path_warns_and_gives_the_same_objects(old: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh, so its warning runs
    with pytest.warns(DeprecationWarning, match=MOVED[old]):
        shim = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert shim.__all__ and all(getattr(shim, name) is getattr(new, name) for name in shim.__all__)


def test_package_level_streams_stays_without_a_warning() -> None:  # docs/data.md: lightscale.streams.shard_hf(...)
    import lightscale
    from lightscale.data import streams

    assert lightscale.streams.shard_hf is streams.shard_hf


def test_old_script_path_runs_the_server_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m lightscale.storage.local_s3 --help`` still answers (the docs' command before the move)."""
    import runpy

    monkeypatch.setattr(sys, "argv", ["local_s3", "--help"])
    with pytest.raises(SystemExit) as done, pytest.warns(DeprecationWarning):
        runpy.run_module("lightscale.storage.local_s3", run_name="__main__")
    assert done.value.code == 0


@pytest.mark.parametrize("name", ["FaultTolerance", "FaultTolerantOuterSync", "RoundRecord"])
def test_old_diloco_names_warn_and_give_the_fault_tolerance_ones(name: str) -> None:
    """``from lightscale.parallel.diloco import FaultTolerance`` (docs/strategies/diloco.md before the move)."""
    import lightscale.fault_tolerance.diloco as home
    import lightscale.parallel.diloco as old

    with pytest.warns(DeprecationWarning, match="lightscale.fault_tolerance"):
        assert getattr(old, name) is getattr(home, name)


def test_old_lighthouse_command_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m lightscale.parallel.diloco.lighthouse --help`` (the FT docs' command before the move)."""
    import runpy

    monkeypatch.delitem(sys.modules, "lightscale.parallel.diloco.lighthouse", raising=False)
    monkeypatch.setattr(sys, "argv", ["lighthouse", "--help"])
    with pytest.raises(SystemExit) as done, pytest.warns(DeprecationWarning):
        runpy.run_module("lightscale.parallel.diloco.lighthouse", run_name="__main__")
    assert done.value.code == 0


def test_no_import_machinery() -> None:
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("lightscale")]
