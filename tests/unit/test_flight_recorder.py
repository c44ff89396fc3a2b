"""NCCL's flight recorder defaults: set under nccl only, never over the user's values, named in the timeout message.

CUDA is absent here: these check the environment lightscale hands to torch, not a real NCCL timeout.
"""

from __future__ import annotations

from pathlib import Path

from lightscale.runtime.flight_recorder import maybe_enable_flight_recorder
from lightscale.strategies import BucketedDDPStrategy


def test_nccl_gets_a_trace_buffer_a_dump_on_timeout_and_a_run_local_file(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    prefix = maybe_enable_flight_recorder("nccl", tmp_path, environ)
    assert environ == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "rank_"),
    }
    assert prefix == environ["TORCH_FR_DUMP_TEMP_FILE"] and (tmp_path / "flight_recorder").is_dir()


def test_gloo_is_left_alone_and_user_values_win(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert maybe_enable_flight_recorder("gloo", tmp_path, environ) is None and environ == {}
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "mine" / "r")}
    environ = dict(mine)
    assert maybe_enable_flight_recorder("nccl", tmp_path, environ) == mine["TORCH_FR_DUMP_TEMP_FILE"]
    assert environ == {**mine, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}  # switched off on purpose: no recorder, no file named
    assert maybe_enable_flight_recorder("nccl", tmp_path, environ) is None


def test_a_timeout_message_names_the_timeout_and_where_the_traces_are() -> None:
    strategy = BucketedDDPStrategy(timeout_s=120)
    strategy._trace_prefix = "/runs/flight_recorder/rank_"
    where = strategy._failure_context(RuntimeError("Timed out waiting 120000ms for recv operation to complete"))
    assert "a collective timed out after 120 s" in where
    assert where.endswith("NCCL flight recorder traces of every rank: /runs/flight_recorder/rank_<rank>")
