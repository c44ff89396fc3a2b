"""`make compat`: the oldest and newest supported torch + Lightning (+ DeepSpeed where it builds), each in a venv of
its own, run through a smoke subset of the tests (a fit per strategy family, save/resume/load, the private-API pins).

pyproject.toml's bounds are what this runs: installing the repository with its extras into each venv under a
constraint ``torch==T, lightning==L`` fails when a bound excludes a combination, and the tests then run the working
tree's source (PYTHONPATH) against that venv's packages. Venvs are cached under ``--venvs`` (default
``.compat/``, git-ignored), keyed by the versions, so a second run only reinstalls lightscale. DeepSpeed builds
from source without its ops (``DS_BUILD_OPS=0``), as in the Makefile; a combination where it does not build
runs without the ZeRO rows (they skip). docs/compat.md holds the last table.

Example:
    python tests/compat/run.py                       # both combinations, the table on stdout
    python tests/compat/run.py --only newest --report runs/compat.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Combination:
    name: str
    torch: str
    lightning: str

    @property
    def folder(self) -> str:
        return f"torch{self.torch}-lightning{self.lightning}"


# The bounds of pyproject.toml: torch>=2.10,<2.16 and lightning>=2.6,<2.7 (DeepSpeed: the newest <0.20 that builds).
COMBINATIONS = [
    Combination("oldest", torch="2.10.0", lightning="2.6.0"),
    Combination("newest", torch="2.15.0", lightning="2.6.6"),
]
DEEPSPEED = "deepspeed>=0.16,<0.20"
DEEPSPEED_BUILD_DEPS = ["ninja", "py-cpuinfo", "psutil", "pydantic", "hjson", "msgpack", "packaging", "numpy"]
OPTIONAL = ["torchao>=0.18,<0.19"]  # float8 rows of the private-API pins (they skip where it does not install)
# litdata without its torchvision requirement (which would replace torch), then what it imports: as the Makefile.
LITDATA = ["litdata>=0.2.50,<0.3"], ["lightning-utilities", "filelock", "boto3", "requests", "tifffile", "obstore"]

_D = "tests/distributed/"
# (what it shows, pytest node id)
SMOKE = [
    *(
        (f"fit {name} = 1 process", f"{_D}test_parity.py::test_every_name_matches_single_process_sgd[{name}]")
        for name in ("bucketed_ddp", "fsdp2", "zero2", "tp2", "pp2")
    ),
    ("fit diloco (H=1 = DDP)", f"{_D}test_diloco.py::test_h1_equals_data_parallel_and_local_sgd_equals_averaging"),
    ("save/resume bucketed_ddp", f"{_D}test_resume.py::test_resume_equals_uninterrupted[bucketed_ddp]"),
    ("save/resume zero2", f"{_D}test_resume.py::test_resume_equals_uninterrupted[zero2]"),
    (
        "load_from_checkpoint",
        f"{_D}test_checkpoint_out.py::test_load_from_checkpoint_gives_hyperparameters_and_trained_weights",
    ),
    (
        "Lightning resumes lightscale's checkpoint",
        f"{_D}test_checkpoint_out.py::test_lightning_fit_resumes_with_the_optimizer_state",
    ),
    (
        "rank 1's traceback reaches the user",
        f"{_D}test_failure_traceback.py::test_the_failing_ranks_traceback_reaches_the_user[python-training_step]",
    ),
    ("private-API pins", "tests/unit/test_private_apis.py"),
]


def pip(venv: Path, *args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", *args], check=True, env=env)


def build(combo: Combination, venvs: Path) -> tuple[Path, dict[str, str]]:
    """The cached venv of ``combo`` (built on first use) with the working tree's lightscale installed; the versions."""
    venv = venvs / combo.folder
    constraints = venvs / f"{combo.folder}.constraints"
    stamp = venv / ".compat-built"
    if not stamp.exists():
        venvs.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        constraints.write_text(f"torch=={combo.torch}\nlightning=={combo.lightning}\n")
        pip(venv, "--upgrade", "pip", "setuptools", "wheel")
        _install_torch(venv, combo.torch)
        pip(venv, *DEEPSPEED_BUILD_DEPS)
        _try(lambda: pip(venv, "--no-build-isolation", "-c", str(constraints), DEEPSPEED, env=_ds_env()), DEEPSPEED)
        for requirement in OPTIONAL:
            _try(lambda r=requirement: pip(venv, "-c", str(constraints), r), requirement)
        _try(lambda: (pip(venv, "--no-deps", *LITDATA[0]), pip(venv, "-c", str(constraints), *LITDATA[1])), "litdata")
        stamp.touch()
    # Every run: pyproject's bounds must admit this combination (pip refuses otherwise), and its dependencies
    # follow the working tree's pyproject. A --torch candidate outside them still runs, to move a bound.
    try:
        pip(venv, "-c", str(constraints), f"{ROOT}[dev]")
        admitted = "yes"
    except subprocess.CalledProcessError:
        if combo.name != "candidate":
            raise
        pip(venv, "--no-deps", str(ROOT))
        pip(venv, "-c", str(constraints), *_requirements_but_torch())
        admitted = "no (run anyway)"
    # DeepSpeed's CPU ops once, as `make venv` does: compiled inside a test's ranks they outlast its timeout.
    _try(
        lambda: subprocess.run([str(venv / "bin" / "python"), "-m", "lightscale.strategies.deepspeed.ops"], check=True),
        "ops",
    )
    return venv, {**_versions(venv), "admitted": admitted}


def _install_torch(venv: Path, version: str) -> None:
    try:
        pip(venv, f"torch=={version}")
    except subprocess.CalledProcessError:
        sys.exit(torch_refused(venv, version))


def torch_refused(venv: Path, version: str) -> str:
    """Why ``pip install torch==version`` failed, as far as pip's configuration tells (its --quiet error does not
    name the constraint): the torch lines of each constraints file pip applies (pip.conf or PIP_CONSTRAINT)."""
    listed = subprocess.run([str(venv / "bin" / "pip"), "config", "list"], capture_output=True, text=True).stdout
    files = [
        name
        for key, _, value in (line.partition("=") for line in listed.splitlines())
        if key.endswith("constraint")
        for name in value.strip("'\"").split()
    ]
    caps = [
        f"{name}: {line.strip()}"
        for name in files
        if Path(name).is_file()
        for line in Path(name).read_text().splitlines()
        if line.strip().startswith("torch")
    ]
    where = "; ".join(caps) if caps else "no constraint on torch in pip's configuration"
    return f"compat: pip did not install torch=={version} into {venv} ({where}). docs/compat.md: lifting a cap."


def _requirements_but_torch() -> list[str]:
    import tomllib  # Python 3.11+, needed only for a candidate outside the bounds

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return [r for r in wanted if not r.startswith("torch")]  # the bound being moved


def _ds_env() -> dict[str, str]:
    return {**os.environ, "DS_BUILD_OPS": "0"}


def _try(step: object, what: str) -> None:
    try:
        step()  # type: ignore[operator]
    except subprocess.CalledProcessError:
        print(f"compat: {what} did not install; its tests skip", file=sys.stderr)


def _versions(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, platform\n"
        "out = {'python': platform.python_version()}\n"
        "for name in ('torch', 'lightning', 'deepspeed', 'torchao'):\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = '-'\n"
        "print(json.dumps(out))"
    )
    result = subprocess.run([str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True)
    return json.loads(result.stdout)


def smoke(venv: Path, report: Path) -> dict[str, str]:
    """Run the smoke subset in ``venv``; each row's outcome ("passed", "failed: ...", "skipped: ...")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    subprocess.run([*command, *(node for _, node in SMOKE)], cwd=ROOT, env=env, check=False)
    return _outcomes(ET.parse(report).getroot())


def _outcomes(junit: ET.Element) -> dict[str, str]:
    cases: dict[str, list[str]] = {}
    for case in junit.iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                message = (found.get("message") or "").splitlines()[0][:100] if found.get("message") else ""
                status = f"{'failed' if tag != 'skipped' else 'skipped'}: {message}"
        cases[node] = [*cases.get(node, []), status]
    return {label: _row(node, cases) for label, node in SMOKE}


def _row(node: str, cases: dict[str, list[str]]) -> str:
    matched = [status for case, statuses in cases.items() if case.startswith(node) for status in statuses]
    if not matched:
        return "not run"
    failed = [status for status in matched if status.startswith("failed")]
    if failed:
        return f"{len(failed)} of {len(matched)} failed ({failed[0]})"
    skipped = [status for status in matched if status.startswith("skipped")]
    passed = len(matched) - len(skipped)
    return f"passed ({passed})" + (f", {len(skipped)} skipped ({skipped[0][9:]})" if skipped else "")


def table(results: list[tuple[Combination, dict[str, str], dict[str, str], float]]) -> str:
    head = ["", *(f"{combo.name}: torch {v['torch']}, lightning {v['lightning']}" for combo, v, _, _ in results)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append(
        "| deepspeed / torchao / python | "
        + " | ".join(f"{v['deepspeed']} / {v['torchao']} / {v['python']}" for _, v, _, _ in results)
        + " |"
    )
    lines.append("| pyproject's bounds admit it | " + " | ".join(v["admitted"] for _, v, _, _ in results) + " |")
    for label, _ in SMOKE:
        lines.append(f"| {label} | " + " | ".join(rows[label] for _, _, rows, _ in results) + " |")
    lines.append("| minutes (build cached) | " + " | ".join(f"{s / 60:.1f}" for *_, s in results) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=[c.name for c in COMBINATIONS], help="one combination")
    parser.add_argument("--torch", help="run this torch version instead (with --lightning): to move a bound")
    parser.add_argument("--lightning", default=COMBINATIONS[0].lightning, help="Lightning version for --torch")
    parser.add_argument("--build-only", action="store_true", help="build (or refresh) the venvs, run nothing")
    parser.add_argument("--venvs", type=Path, default=ROOT / ".compat", help="where the venvs are cached")
    parser.add_argument("--report", type=Path, help="also write the markdown table here")
    args = parser.parse_args()
    results = []
    combos = [c for c in COMBINATIONS if args.only in (None, c.name)]
    if args.torch is not None:
        combos = [Combination("candidate", torch=args.torch, lightning=args.lightning)]
    for combo in combos:
        start = time.monotonic()
        venv, versions = build(combo, args.venvs.resolve())
        if args.build_only:
            continue
        rows = smoke(venv, args.venvs.resolve() / f"{combo.folder}.junit.xml")
        results.append((combo, versions, rows, time.monotonic() - start))
    if args.build_only:
        return
    text = table(results)
    print(text)
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text + "\n")
    if any(not row.startswith("passed") for _, _, rows, _ in results for row in rows.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
