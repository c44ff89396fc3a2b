"""The wheels a GPU machine lacks (``make gpu-wheels``) and their install there (``make gpu-check``).

The project's GPU machines have Python 3.12, a CUDA build of torch, Lightning, transformers, timm and scikit-learn,
but no network and none of DeepSpeed, jsonargparse, and maybe not tensorboard, matplotlib or pytest. On a CPU machine
``pins`` prints the packages to download, pinned to the versions this (tested) environment holds; on the GPU machine
``install`` puts a wheel into SITE only when its distribution is missing there or too old for a requirement of
another shipped wheel, so the machine's own torch, numpy and friends are never shadowed.

Example:
    $ python benchmarks/gpu_wheels.py download gpu_wheels           # CPU machine: the wheels below, cp312
    $ python benchmarks/gpu_wheels.py install gpu_wheels /tmp/site  # GPU machine: writes /tmp/site/installed.json
"""

from __future__ import annotations

import email
import json
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

# Pure-python or binary dependencies downloaded as wheels (cp312 manylinux); torch, numpy, Lightning, PyYAML,
# packaging, tqdm, safetensors, scikit-learn and pillow are on the GPU machine and deliberately not shipped.
DOWNLOADED = (
    # jsonargparse[signatures] (LightningCLI, `lightscale fit`)
    "jsonargparse",
    "docstring-parser",
    "typeshed-client",
    "typing-extensions",
    # DeepSpeed's requirements (numpy, packaging, torch and tqdm are there; psutil may be, shipped anyway)
    "hjson",
    "py-cpuinfo",
    "msgpack",
    "ninja",
    "einops",
    "psutil",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    # tensorboard (lightscale's TensorBoardLogger default), without its server (grpcio, data server, werkzeug)
    "tensorboard",
    "protobuf",
    "absl-py",
    "markdown",
    # matplotlib (MemoryProfiler's memory.png)
    "matplotlib",
    "contourpy",
    "cycler",
    "fonttools",
    "kiwisolver",
    "pyparsing",
    "python-dateutil",
    "tzdata",
    # pytest for tests/gpu
    "pytest",
    "pluggy",
    "iniconfig",
    "pygments",
    "pytest-timeout",
)
# Extras whose requirements count when deciding what a shipped wheel needs.
EXTRAS = ("", "signatures", "deepspeed", "typing-extensions")


def pins(names: tuple[str, ...] = DOWNLOADED) -> list[str]:
    """``name==version`` of each package as installed here (raises if one is missing: build in the full venv)."""
    return [f"{name}=={metadata.version(name)}" for name in names]


def download(wheel_dir: Path, names: tuple[str, ...] = DOWNLOADED) -> list[str]:
    """Download each package's cp312 manylinux wheel at this environment's version, or at the newest the index
    has for Python 3.12 where that version has no such wheel; returns what was substituted."""
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir)]
    pip += ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64"]
    substituted = []
    for pinned in pins(names):
        if subprocess.call([*pip, pinned], stderr=subprocess.DEVNULL) != 0:
            subprocess.check_call([*pip, pinned.split("==")[0]])
            substituted.append(pinned)
    return substituted


def check_folder(wheel_dir: Path) -> list[str]:
    """Requirements between the folder's wheels that their versions do not meet (e.g. pydantic vs pydantic-core)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    info = [wheel_metadata(path) for path in sorted(wheel_dir.glob("*.whl"))]
    versions = {name: version for name, version, _ in info}
    unmet = []
    for name, _, requires in info:
        for req in map(Requirement, requires):
            have = versions.get(normalize(req.name))
            applies = req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in EXTRAS)
            if applies and have is not None and Version(have) not in req.specifier:
                unmet.append(f"{name} needs {req}, folder has {have}")
    return unmet


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(normalized name, version, Requires-Dist lines) read from a wheel's METADATA without installing it."""
    with zipfile.ZipFile(path) as wheel:
        member = next(n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        text = wheel.read(member).decode()
    message = email.message_from_string(text)
    return normalize(message["Name"]), message["Version"], message.get_all("Requires-Dist") or []


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def choose(wheels: list[Path], installed: dict[str, str | None]) -> dict[str, str]:
    """For each wheel, "install" or why not: a distribution already present at a version every shipped wheel
    accepts stays as it is; an absent one, or one too old for a shipped wheel's requirement, is installed."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    info = {path: wheel_metadata(path) for path in wheels}
    needs: dict[str, list[Requirement]] = {}
    for _, _, requires in info.values():
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in EXTRAS):
                needs.setdefault(normalize(req.name), []).append(req)
    decisions = {}
    for path, (name, _, _) in info.items():
        have = installed.get(name)
        unmet = [str(r) for r in needs.get(name, []) if have is not None and Version(have) not in r.specifier]
        if have is None:
            decisions[path.name] = "install (absent)"
        elif unmet:
            decisions[path.name] = f"install ({name} {have} fails {', '.join(unmet)})"
        else:
            decisions[path.name] = f"skip ({name} {have} present)"
    return decisions


def install(wheel_dir: Path, site: Path) -> dict[str, str]:
    """Install the chosen wheels of ``wheel_dir`` into ``site`` (pip --target, or unzip where pip is missing)."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"no wheels in {wheel_dir}: run `make gpu-wheels` on a CPU machine and carry the folder")
    decisions = choose(wheels, {wheel_metadata(p)[0]: installed_version(wheel_metadata(p)[0]) for p in wheels})
    chosen = [wheel_dir / name for name, what in decisions.items() if what.startswith("install")]
    site.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade", "--target"]
    if chosen and subprocess.call([*pip, str(site), *map(str, chosen)]) != 0:
        for path in chosen:  # no pip here: a wheel is a zip whose top level is the site-packages layout
            with zipfile.ZipFile(path) as wheel:
                wheel.extractall(site)
        decisions["(installer)"] = "pip failed or missing: wheels unzipped"
    (site / "installed.json").write_text(json.dumps(decisions, indent=1))
    return decisions


def main(argv: list[str]) -> int:
    if argv[:1] == ["pins"]:
        print("\n".join(pins()))
    elif argv[:1] == ["download"] and len(argv) == 2:
        for pinned in download(Path(argv[1])):
            print(f"{pinned}: no cp312 manylinux wheel at this version; took the newest that has one")
        unmet = check_folder(Path(argv[1]))
        print("\n".join(unmet) or "every requirement between the folder's wheels is met")
        return 1 if unmet else 0
    elif argv[:1] == ["install"] and len(argv) == 3:
        for name, what in install(Path(argv[1]), Path(argv[2])).items():
            print(f"{name}: {what}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
