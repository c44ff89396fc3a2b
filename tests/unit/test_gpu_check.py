"""``make gpu-check`` on a CPU machine: the plan and exit 0 without CUDA, the report's markdown, every check bounded
and isolated (one raising or hanging is a failure and the next still runs), and the wheel installer's choices."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402
from gpu_check import Check, Result, isolated, report, run_checks  # noqa: E402


def test_without_cuda_prints_the_plan_and_exits_0(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main([]) == 0
    printed = capsys.readouterr().out
    for check in gpu_check.CHECKS:
        assert check.name in printed
    assert "no CUDA device here" in printed
    assert not (tmp_path / "gpu_report.md").exists()


def test_report_markdown_from_fake_results() -> None:
    results = [
        Result("mfu", "pass", 12.34, rows=[{"run": "bucketed_ddp", "MFU": "41.0%", "tokens/s": 512000}]),
        Result("estimate", "fail", 3.0, notes=["one note"], errors=["zero3 b8: Traceback\nOutOfMemoryError: boom"]),
        Result("offload", "skip", notes=["no time left in the 9-minute budget"]),
    ]
    text = report(results, {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"})
    assert text.startswith("# lightscale GPU check\n\n- device: NVIDIA H100 80GB HBM3\n- torch: 2.11.0\n")
    assert "| check | status | seconds |\n|---|---|---|\n| mfu | pass | 12.3 |\n| estimate | fail | 3.0 |" in text
    assert "## mfu: pass\n\n| run | MFU | tokens/s |\n|---|---|---|\n| bucketed_ddp | 41.0% | 512000 |" in text
    failure = "Failure in zero3 b8:\n\n```\nTraceback\nOutOfMemoryError: boom\n```"
    assert f"## estimate: fail\n\n- one note\n\n{failure}" in text
    assert "## offload: skip\n\n- no time left in the 9-minute budget" in text


def test_checks_are_isolated_and_bounded() -> None:
    def raises(deadline: float) -> Result:
        raise RuntimeError("CUDA error: an illegal memory access")

    def hangs(deadline: float) -> Result:  # a child that would sleep 60 s is killed at the check's deadline
        found = isolated("time:sleep", 60, timeout=deadline - time.monotonic())
        return Result("hangs", "fail" if "error" in found else "pass", errors=[f"sleep: {found.get('error')}"])

    def child_raises(deadline: float) -> Result:
        found = isolated("math:sqrt", -1, timeout=deadline - time.monotonic())
        return Result("child_raises", "fail", errors=[f"sqrt: {found['error']}"])

    def passes(deadline: float) -> Result:
        return Result("passes", "pass", rows=[isolated("math:sqrt", 4, timeout=30)])

    checks = [Check("raises", "", 5, raises), Check("hangs", "", 3, hangs)]
    checks += [Check("child_raises", "", 30, child_raises), Check("passes", "", 30, passes)]
    start = time.monotonic()
    results = run_checks(checks)
    assert time.monotonic() - start < 15
    assert [r.status for r in results] == ["fail", "fail", "fail", "pass"]
    assert "RuntimeError: CUDA error: an illegal memory access" in results[0].errors[0]
    assert "timed out after 3 s" in results[1].errors[0] and results[1].seconds < 6
    assert "ValueError: math domain error" in results[2].errors[0]
    assert results[3].rows == [{"value": 2.0}]


def test_no_time_left_skips_the_rest() -> None:
    results = run_checks([Check("a", "", 60, lambda d: Result("a", "pass"))], total_s=1)
    assert results[0].status == "skip" and "no time left" in results[0].notes[0]


def test_installer_keeps_present_packages_and_replaces_too_old_ones(tmp_path: Path) -> None:
    def wheel(name: str, version: str, *requires: str) -> Path:
        import zipfile

        path = tmp_path / f"{name}-{version}-py3-none-any.whl"
        lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
        return path

    wheels = [
        wheel("deepspeed", "0.19.8", "pydantic>=2", "msgpack"),
        wheel("pydantic", "2.14.3", "typing-extensions>=4.16"),
        wheel("typing_extensions", "4.16.0"),
        wheel("msgpack", "1.2.4"),
        wheel("pytest", "9.2.0", 'colorama; sys_platform == "win32"'),
    ]
    present = {"deepspeed": None, "pydantic": "1.10.0", "typing-extensions": "4.12.2", "msgpack": "1.0.0"}
    decisions = gpu_wheels.choose(wheels, {**present, "pytest": "8.0.0"})
    assert decisions["deepspeed-0.19.8-py3-none-any.whl"] == "install (absent)"
    assert decisions["pydantic-2.14.3-py3-none-any.whl"].startswith("install (pydantic 1.10.0 fails pydantic>=2")
    assert decisions["typing_extensions-4.16.0-py3-none-any.whl"].startswith("install (typing-extensions 4.12.2")
    assert decisions["msgpack-1.2.4-py3-none-any.whl"] == "skip (msgpack 1.0.0 present)"
    assert decisions["pytest-9.2.0-py3-none-any.whl"] == "skip (pytest 8.0.0 present)"
    assert gpu_wheels.check_folder(tmp_path) == []


def test_moe_and_float8_rows_are_planned_and_the_grouped_row_runs_on_cpu() -> None:
    names = [check.name for check in gpu_check.CHECKS]
    assert names.index("mfu") < names.index("grouped_gemm") < names.index("float8")
    import gpu_moe_float8

    row = gpu_moe_float8.grouped_vs_loop(experts=4, width=16, tokens=32, repeats=1)
    assert row["token copies"] == 64 and row["experts"] == 4 and row["grouped / loop"] > 0
