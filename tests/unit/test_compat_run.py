"""``make compat`` (tests/compat/run.py) on a machine whose pip configuration caps torch: the exit names the cap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("compat_run", Path(__file__).resolve().parents[1] / "compat" / "run.py")
compat = sys.modules["compat_run"] = importlib.util.module_from_spec(_SPEC)  # type: ignore[arg-type]
_SPEC.loader.exec_module(compat)  # type: ignore[union-attr]


def test_a_refused_torch_names_the_constraint_that_caps_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = tmp_path / "constraints.txt"
    cap.write_text("numpy<3\ntorch<=2.14.1\n")
    monkeypatch.setenv("PIP_CONSTRAINT", str(cap))  # as /etc/xdg/pip/pip.conf's `constraint =` on the dev machines
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # that file itself is not read: the cap is this test's alone
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip").symlink_to(Path(sys.executable).parent / "pip")

    message = compat.torch_refused(venv, "2.15.0")

    assert f"torch==2.15.0 into {venv} ({cap}: torch<=2.14.1)" in message
    assert "numpy" not in message and "docs/compat.md" in message


def test_without_a_cap_the_exit_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no pip configuration file is read
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "pip").symlink_to(Path(sys.executable).parent / "pip")

    assert "(no constraint on torch in pip's configuration)" in compat.torch_refused(venv, "2.15.0")
