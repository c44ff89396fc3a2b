"""Golden losses: the tiny GPT's single-process numerics pinned between commits (as torchtitan pins its own).

A change that moves these (initialization, the loss, the data order, the optimizer) must be deliberate:
regenerate with ``LIGHTSCALE_UPDATE_GOLDEN=1 python -m pytest tests/recipes/test_golden_losses.py`` and commit the
JSON with the reason. The tolerance allows another x86 CPU's vector width to round sums differently (~1e-7 per
step here) and still catches any real change of numerics (a 2x gradient moves SGD's losses by ~0.1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import SGD_LR, TINY, relative_difference, train_tiny_gpt

from lightscale.testing import run_distributed

GOLDEN = Path(__file__).parents[1] / "assets" / "losses"
TOLERANCE = 1e-4
RUNS = {
    "gpt_tiny_sgd": {"sgd_lr": SGD_LR},  # the parity tests' reference run
    "gpt_tiny_adamw": {},  # the recipe's own AdamW with warmup + cosine
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_single_process_losses_match_the_golden_file(name: str, corpus_cache: str) -> None:
    losses = run_distributed(
        train_tiny_gpt,
        "auto",
        devices=1,
        batch_size=8,
        max_steps=10,
        config=TINY,
        cache_dir=corpus_cache,
        world_size=1,
        **RUNS[name],
    )[0]
    path = GOLDEN / f"{name}.json"
    if os.environ.get("LIGHTSCALE_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps({"config": "tests/helpers.py TINY, batch 8, 10 steps", "losses": losses}, indent=1))
    golden = json.loads(path.read_text())["losses"]
    assert relative_difference(losses, golden) <= TOLERANCE
