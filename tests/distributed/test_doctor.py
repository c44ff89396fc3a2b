"""``lightscale doctor``: every collective runs and is reported; a missing rank is named by every rank in time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightscale.commands.doctor import parse_size
from lightscale.errors import ConfigurationError
from lightscale.testing import free_port

pytestmark = pytest.mark.slow
DOCTOR = [sys.executable, "-m", "lightscale.cli", "doctor"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_every_collective_is_checked_on_local_ranks(tmp_path: Path) -> None:
    result = subprocess.run(
        [*DOCTOR, "--devices", "2", "--size", "64KiB"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lightscale doctor: 2 ranks, backend gloo" in result.stdout
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert f"  {collective} " in result.stdout
    assert "65,536" in result.stdout  # bytes per rank as asked


def test_a_missing_rank_is_named_by_every_rank_within_the_timeout(tmp_path: Path) -> None:
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3")
    start = time.monotonic()
    ranks = [
        subprocess.Popen(
            [*DOCTOR, "--timeout", "5"],
            cwd=tmp_path,
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)  # rank 2 never comes
    ]
    outputs = [rank.communicate(timeout=180) for rank in ranks]
    for rank, (_, stderr) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 1
        assert "only 2 of 3 ranks checked in within 5 s; missing rank(s) [2]" in stderr, stderr[-2000:]
    assert time.monotonic() - start < 120  # start-up plus the 5 s check-in, never a collective timeout


@pytest.mark.parametrize(("text", "expected"), [("1048576", 2**20), ("512KiB", 2**19), ("4MiB", 2**22)])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_a_bad_size_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="'4MB' is not a size"):
        parse_size("4MB")
