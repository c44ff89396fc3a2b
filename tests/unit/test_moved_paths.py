"""Moving a file never breaks a user: every module path of the table in lightscale/moved.py still imports, as the very
module object at its new home (one class, one isinstance), and a moved script still runs with ``python -m``."""

from __future__ import annotations

import importlib
import pickle
import sys

import pytest

from lightscale import moved
from lightscale.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_documented_imports_of_before_the_move() -> None:
    from lightscale.checkpoint.deepspeed_dir import consolidate_zero_checkpoint
    from lightscale.checkpoint.layout import full_model_state_dict
    from lightscale.parallel.moe import MoEConfig
    from lightscale.streams import shard_litdata
    from lightscale.zero.checkpoint_dir import consolidate_zero_checkpoint as moved

    assert consolidate_zero_checkpoint is moved
    assert callable(full_model_state_dict) and callable(shard_litdata)
    assert pickle.loads(pickle.dumps(MoEConfig)) is MoEConfig


def test_old_script_path_runs_the_new_file() -> None:
    """``python -m OLD`` asks the finder for the code to run (runpy, in a fresh process): it is the new file's."""
    finder = next(f for f in sys.meta_path if isinstance(f, moved._Alias))
    spec = finder.find_spec("lightscale.strategies.deepspeed_ops")
    assert spec is not None and spec.loader is not None
    code = spec.loader.get_code("lightscale.strategies.deepspeed_ops")  # type: ignore[attr-defined]
    assert code.co_filename.endswith("lightscale/zero/ops.py")
