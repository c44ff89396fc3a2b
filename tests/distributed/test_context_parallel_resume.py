"""A context-parallel run's checkpoint is the portable layout: it resumes at cp=1 and under fsdp2, and cp2 resumes
theirs (tests/checkpoint_matrix.py's legs: the state right after each load equals the saved one bitwise, the
checkpoint read offline equals the live state, and the losses after the load equal the uninterrupted run's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_matrix import Leg, LegResult, Member, check_loaded, check_saved, merge_ranks, run_legs
from helpers import relative_difference

from lightscale.strategies import FSDP2Strategy, Parallel3DStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative, per step: the same samples; cp changes only the order of the attention sums
FIRST, LEG, END = 3, 4, 8

CP2 = Member("cp2@2", 2, lambda: Parallel3DStrategy(cp=2))
FSDP2 = Member("fsdp2@2", 2, FSDP2Strategy)
CP1 = Member("parallel_3d@1", 1, Parallel3DStrategy)


def _plan(root: Path) -> list[list[Leg]]:
    """Launches in order (2, 1, then 2 ranks), each a list of legs; a leg loads an earlier one's checkpoint."""
    cp2 = Leg(CP2, None, str(root / "cp2"), END, END, save_at=FIRST)
    fsdp2 = Leg(FSDP2, None, str(root / "fsdp2"), END, END, save_at=FIRST)
    cp1 = Leg(CP1, None, str(root / "cp1"), END, END, save_at=FIRST)
    after = FIRST + LEG
    return [
        [cp2, fsdp2, Leg(FSDP2, cp2.save, str(root / "fsdp2_from_cp2"), after, END)],
        [cp1, Leg(CP1, cp2.save, str(root / "cp1_from_cp2"), after, END)],
        [
            Leg(CP2, fsdp2.save, str(root / "cp2_from_fsdp2"), after, END),
            Leg(CP2, cp1.save, str(root / "cp2_from_cp1"), after, END),
        ],
    ]


@pytest.fixture(scope="module")
def legs(corpus_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Leg, LegResult]]:
    done: dict[str, tuple[Leg, LegResult]] = {}
    for launch in _plan(tmp_path_factory.mktemp("cp_resume")):
        per_rank = run_distributed(run_legs, launch, corpus_cache, world_size=launch[0].member.world_size)
        for index, leg in enumerate(launch):
            results = [ranks[index] for ranks in per_rank]
            loaded = merge_ranks([result.loaded for result in results]) if leg.load else None
            saved = merge_ranks([result.saved for result in results])
            done[Path(leg.save).name] = (leg, LegResult(results[0].losses, loaded, saved, results[0].saved_step))
    return done


@pytest.mark.parametrize("name", ["fsdp2_from_cp2", "cp1_from_cp2", "cp2_from_fsdp2", "cp2_from_cp1"])
def test_a_checkpoint_moves_between_cp_degrees(name: str, legs: dict[str, tuple[Leg, LegResult]]) -> None:
    leg, result = legs[name]
    origin, saved = legs[Path(leg.load).name]  # type: ignore[arg-type]
    check_saved(origin.save, saved.saved, saved.saved_step, names=origin.workload.state_names())
    check_saved(leg.save, result.saved, result.saved_step, names=leg.workload.state_names())
    assert result.loaded is not None
    check_loaded(result.loaded, saved.saved)
    uninterrupted = saved.losses[FIRST : FIRST + LEG]
    assert relative_difference(result.losses, uninterrupted) <= TOLERANCE
