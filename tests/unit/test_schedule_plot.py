"""Schedule pictures come from torch's orders; their simulated bubble matches the textbook formula."""

from __future__ import annotations

import pytest

from lightscale.cli import main
from lightscale.commands.schedule_plot import idle_fractions, schedule_slots, theoretical_bubble


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 2), (4, 8), (4, 4)])
def test_single_stage_bubble_is_the_formula(name: str, pp: int, microbatches: int) -> None:
    idle = idle_fractions(schedule_slots(name, pp=pp, microbatches=microbatches), pp)
    assert idle == pytest.approx([theoretical_bubble(pp, microbatches)] * pp)


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zb", "zbv"])
def test_multi_stage_schedules_idle_less_than_1f1b(name: str) -> None:
    slots = schedule_slots(name, pp=4, microbatches=8)
    assert len(slots) == 4 * 2 * 8 * (3 if name != "interleaved_1f1b" else 2)  # F + (B | I + W) per stage and mb
    assert max(idle_fractions(slots, 4)) < theoretical_bubble(4, 8)


def test_cli_writes_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "zbv.png"
    main(["schedule", "zbv", "--pp", "2", "--microbatches", "4", "--out", str(out)])
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert "idle per rank" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="'1f1b' needs at least as many microbatches"):
        main(["schedule", "1f1b", "--pp", "4", "--microbatches", "2"])
