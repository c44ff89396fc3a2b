"""Write one small checkpoint per family into this directory, and manifest.json describing them.

Run at the commit whose checkpoints are to be kept (these were written at 7ca1c58, before the reorganisation "the
house by concept"), from the repository root:

    OMP_NUM_THREADS=1 python tests/assets/old_checkpoints/make.py [FAMILY ...]

Per family (models.py ``FAMILIES``): 2 gloo ranks train models.py's model for ``STEPS`` steps, saving at ``SAVE_AT``
into ``<family>/checkpoint`` (kept) and at the end into a temporary directory (not kept). The manifest records, per
family, the strategy, the world size, the saved global step, every rank's losses of the steps after the save (a
resume must repeat them) and the model's tensors as ``load_from_checkpoint`` reads both saves (shape, dtype, sum,
sha256). Existing entries of families not named are kept.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: the module is imported as the test imports it

from assets.old_checkpoints.models import (  # noqa: E402
    FAMILIES,
    RANKS,
    SAVE_AT,
    STEPS,
    Family,
    Model,
    fingerprint,
    fit,
)

import lightscale  # noqa: E402, F401 - Lightning's load_from_checkpoint then opens checkpoint directories
from lightscale.testing import run_distributed  # noqa: E402

MANIFEST = HERE / "manifest.json"


def make(family: Family, scratch: Path) -> dict:
    kept, final = HERE / family.name / "checkpoint", scratch / family.name / "final"
    shutil.rmtree(kept.parent, ignore_errors=True)
    kept.parent.mkdir(parents=True)
    saves = {SAVE_AT: str(kept), STEPS: str(final)}
    started = time.monotonic()
    if family.lighthouse:
        from lightscale.testing.lighthouse import lighthouse

        with lighthouse(min_replicas=1, join_timeout_ms=30_000) as address:
            ranks = run_distributed(fit, family, saves=saves, lighthouse=address, world_size=RANKS, timeout_s=300)
    else:
        ranks = run_distributed(fit, family, saves=saves, world_size=RANKS, timeout_s=300)
    assert all(rank["global_step"] == STEPS for rank in ranks), ranks
    entry = {
        "strategy": family.strategy,
        "kwargs": family.kwargs,
        "world_size": RANKS,
        "global_step": SAVE_AT,
        "max_steps": STEPS,
        "layout": "directory" if kept.is_dir() else "file",
        "losses_after_save": [
            {str(step): loss for step, loss in rank["losses"].items() if step > SAVE_AT} for rank in ranks
        ],
        "saved": fingerprint(Model.load_from_checkpoint(kept).state_dict()),
        "final": fingerprint(Model.load_from_checkpoint(final).state_dict()),
    }
    print(f"{family.name}: {time.monotonic() - started:.1f} s", flush=True)
    return entry


def main(names: list[str]) -> None:
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names or list(FAMILIES):
            manifest[name] = make(FAMILIES[name], Path(scratch))
            MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
