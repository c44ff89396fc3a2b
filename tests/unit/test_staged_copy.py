"""Local copies of remote directories (lightscale/storage/staged_copy.py) on fsspec's memory filesystem: uploads in
the order asked, downloads only what is kept and never the marker, and a directory without its completion marker is
refused before anything is copied; which files of a DeepSpeed directory each rank downloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from lightscale.errors import ConfigurationError
from lightscale.storage.staged_copy import local_directory, scratch_directory, upload_directory
from lightscale.storage.urls import COMPLETE, checkpoint_location
from lightscale.strategies.deepspeed.checkpoint import read_by_rank

ROOT = "memory://staged"


@pytest.fixture
def memory() -> Iterator[fsspec.AbstractFileSystem]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/staged"):
        fs.rm("/staged", recursive=True)


def _tree(root: Path, names: list[str]) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)


def test_upload_puts_every_file_with_the_last_ones_last(memory: fsspec.AbstractFileSystem, tmp_path: Path) -> None:
    _tree(tmp_path, ["config.json", "b/model.safetensors", "a.json"])
    order = upload_directory(tmp_path, checkpoint_location(f"{ROOT}/out"), last=("config.json",))
    assert order == ["a.json", "b/model.safetensors", "config.json"]
    assert memory.cat("/staged/out/b/model.safetensors") == b"b/model.safetensors"


def test_local_directory_downloads_what_is_kept_and_refuses_an_unmarked_one(
    memory: fsspec.AbstractFileSystem, tmp_path: Path
) -> None:
    _tree(tmp_path, ["checkpoint/keep.pt", "checkpoint/skip.pt", COMPLETE])
    remote = checkpoint_location(f"{ROOT}/ckpt")
    upload_directory(tmp_path, remote)
    with local_directory(remote, keep=lambda name: "skip" not in name) as local:
        assert sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()) == ["checkpoint/keep.pt"]
        scratch = local
    assert not scratch.exists()  # deleted with the block
    memory.rm(f"/staged/ckpt/{COMPLETE}")
    with pytest.raises(ConfigurationError, match="incomplete checkpoint"), local_directory(remote):
        pass
    with local_directory(tmp_path) as local:  # a local path is read where it is
        assert local == tmp_path


def test_scratch_is_removed_when_the_block_fails() -> None:
    with pytest.raises(RuntimeError), scratch_directory() as local:
        (local / "x").write_text("x")
        raise RuntimeError
    assert not local.exists()


def test_each_rank_downloads_the_shared_files_and_its_own_partitions() -> None:
    names = [
        "latest",
        "zero_to_fp32.py",
        "checkpoint/mp_rank_00_model_states.pt",
        "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "checkpoint/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "checkpoint/zero_pp_rank_10_mp_rank_00_model_states.pt",
        "checkpoint/offloaded_tensors/rank01/state.swp",
    ]
    kept = {rank: [name for name in names if read_by_rank(rank, elastic=False)(name)] for rank in (0, 1, 10)}
    shared = names[:3]
    assert kept[0] == [*shared, names[3]]
    assert kept[1] == [*shared, names[4], names[6]]
    assert kept[10] == [*shared, names[5]]
    assert [name for name in names if read_by_rank(1, elastic=True)(name)] == names
