"""The atomic commit of a checkpoint directory at an fsspec URL (object stores have no rename), crash by crash, on
``memory://``: a directory without its completion marker is never read as a checkpoint; a crash at any point of a
publish leaves the previous or the new checkpoint complete. Also: which URLs are refused, and why."""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightscale.checkpoint.portable import TRAINER_STATE, check_checkpoint_dir
from lightscale.checkpoint.resume import newest_checkpoint, resolve_last
from lightscale.errors import ConfigurationError
from lightscale.storage.atomic_dir import complete_checkpoint, publish, staging_path, start_staging
from lightscale.storage.urls import COMPLETE, RemotePath, checkpoint_location


def _write(directory: RemotePath, version: str) -> None:
    for name in (".metadata", TRAINER_STATE, "__0_0.distcp"):
        (directory / name).write_bytes(version.encode())


def _version(directory: RemotePath) -> str:
    return (directory / TRAINER_STATE).read_bytes().getvalue().decode()


def _save(target: RemotePath, version: str) -> None:
    where = start_staging(target)
    assert isinstance(where, RemotePath)
    _write(where, version)
    publish(where, target)


@pytest.fixture
def target() -> RemotePath:
    location = checkpoint_location(f"memory://ckpts-{uuid.uuid4().hex[:8]}/last.ckpt")
    assert isinstance(location, RemotePath)
    return location


def test_publish_leaves_one_marked_directory(target: RemotePath) -> None:
    _save(target, "v1")
    _save(target, "v2")
    assert complete_checkpoint(target) == target and _version(target) == "v2"
    assert sorted(key.rsplit("/", 1)[1] for key in target.files()) == sorted(
        (".metadata", TRAINER_STATE, "__0_0.distcp", COMPLETE)
    )
    assert not staging_path(target).exists()
    check_checkpoint_dir(target)


def test_a_new_name_is_written_in_place_and_complete_only_with_its_marker(target: RemotePath) -> None:
    where = start_staging(target)
    assert where == target  # nothing to keep: no staging prefix, no copy at publish
    _write(target, "v1 half")  # every shard, but the save died before rank 0 published
    with pytest.raises(ConfigurationError, match="incomplete checkpoint"):
        check_checkpoint_dir(complete_checkpoint(target))
    _save(target, "v1")  # the next save clears the left-overs and writes in place again
    assert not staging_path(target).exists() and _version(target) == "v1"
    check_checkpoint_dir(target)


def test_a_single_file_is_kept_until_the_directory_replacing_it_is_published(target: RemotePath) -> None:
    target.write_bytes(b"a checkpoint_format='file' checkpoint")
    staging = start_staging(target)
    assert staging == staging_path(target) and target.is_file()
    _write(staging, "v2")
    publish(staging, target)
    assert _version(target) == "v2" and (target / COMPLETE).is_file()


def test_crash_before_publish_keeps_the_previous_checkpoint(target: RemotePath) -> None:
    _save(target, "v1")
    staging = start_staging(target)
    _write(staging, "v2 half")  # every shard, but the save died before rank 0 published
    assert complete_checkpoint(target) == target and _version(target) == "v1"


def test_crash_mid_copy_reads_the_staged_copy(target: RemotePath, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(target, "v1")
    staging = start_staging(target)
    assert isinstance(staging, RemotePath)
    _write(staging, "v2")

    def copy_one_then_die(self: fsspec.AbstractFileSystem, sources: list[str], destinations: list[str]) -> None:
        self.cp_file(sources[0], destinations[0])
        raise KeyboardInterrupt("killed mid-copy")

    monkeypatch.setattr(type(staging.fs), "copy", copy_one_then_die)
    with pytest.raises(KeyboardInterrupt):
        publish(staging, target)
    monkeypatch.undo()
    assert not (target / COMPLETE).exists()  # the half-copied directory is not complete ...
    with pytest.raises(ConfigurationError, match="incomplete checkpoint"):
        check_checkpoint_dir(target)
    found = complete_checkpoint(target)  # ... so loaders read the complete staged copy
    assert found == staging and _version(found) == "v2"
    _save(target, "v3")  # the next save cleans up
    assert complete_checkpoint(target) == target and _version(target) == "v3"


def test_unmarked_directory_is_refused(target: RemotePath) -> None:
    _write(target, "never published")
    with pytest.raises(ConfigurationError, match="no completion marker"):
        check_checkpoint_dir(complete_checkpoint(target))


def test_remove_deletes_the_marker_first(target: RemotePath, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(target, "v1")
    removed: list[str] = []
    original = type(target.fs).rm

    def recording_rm(self: fsspec.AbstractFileSystem, path: str, recursive: bool = False, **kw: object) -> None:
        removed.append(path)
        original(self, path, recursive=recursive, **kw)

    monkeypatch.setattr(type(target.fs), "rm", recording_rm)
    target.remove()
    assert removed[0].endswith(COMPLETE) and not target.exists()


def test_file_url_is_the_local_path(tmp_path: Path) -> None:
    assert checkpoint_location(f"file://{tmp_path}/last.ckpt") == tmp_path / "last.ckpt"


def test_url_mangled_by_pathlib_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="lost one '/'"):
        checkpoint_location(Path("s3://bucket/run"))
    with pytest.raises(ConfigurationError, match="lost one '/'"):
        start_staging(Path("s3:/bucket/run/last.ckpt"))
    assert list(tmp_path.iterdir()) == []


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(ConfigurationError, match=r"no filesystem for nosuch://.*s3://, gs://"):
        checkpoint_location("nosuch://bucket/run")


def test_remote_path_cannot_become_a_local_file() -> None:
    location = checkpoint_location("memory://bucket/run")
    with pytest.raises(TypeError), open(location, "wb"):  # type: ignore[call-overload]
        pass


@pytest.fixture
def write_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that ticks per write: memory:// stamps objects to the microsecond only."""
    written: dict[str, float] = {}
    write = RemotePath.write_bytes

    def stamped_write(self: RemotePath, data: bytes) -> None:
        write(self, data)
        written[str(self)] = float(len(written))

    monkeypatch.setattr(RemotePath, "write_bytes", stamped_write)
    monkeypatch.setattr(RemotePath, "modified", lambda self: written[str(self)])


@pytest.mark.usefixtures("write_clock")
def test_resume_auto_finds_the_newest_complete_checkpoint_in_object_storage() -> None:
    directory = checkpoint_location(f"memory://run-{uuid.uuid4().hex[:8]}")
    assert isinstance(directory, RemotePath)
    assert newest_checkpoint(directory) is None  # nothing there yet: start fresh
    _save(directory / "step=3.ckpt", "3")
    (directory / "step=4.ckpt").write_bytes(b"a single-file checkpoint")
    assert newest_checkpoint(directory) == directory / "step=4.ckpt"
    _save(directory / "step=5.ckpt", "5")
    _write(directory / "step=9.ckpt", "killed before its marker")  # newer, never complete
    _write(directory / "step=9.ckpt.tmp", "never published either")
    assert newest_checkpoint(directory) == directory / "step=5.ckpt"
    last = directory / "last.ckpt"
    _save(last, "6")
    staging = start_staging(last)
    _write(staging, "7")
    (staging / COMPLETE).write_bytes(b"")
    last.remove()  # a publish killed after unmarking and deleting last.ckpt: its staged copy is complete
    assert newest_checkpoint(directory) == last
    assert _version(complete_checkpoint(last)) == "7"


@pytest.mark.usefixtures("write_clock")
def test_lightnings_last_is_answered_in_object_storage(tmp_path: Path) -> None:
    """fit(ckpt_path="last") under lightscale.Trainer: the newest complete last*.ckpt of the ModelCheckpoint's bucket
    (Lightning lists it without the scheme and finds nothing); local directories keep Lightning's own answer."""
    directory = checkpoint_location(f"memory://last-{uuid.uuid4().hex[:8]}")
    assert isinstance(directory, RemotePath)
    callbacks = [ModelCheckpoint(dirpath=str(directory))]
    with pytest.warns(UserWarning, match="no complete last checkpoint"):
        assert resolve_last("last", callbacks) is None  # an empty bucket prefix: start fresh, as Lightning does
    _save(directory / "last.ckpt", "3")
    _save(directory / "step=5.ckpt", "5")  # newer, but not a last checkpoint
    _save(directory / "last-v1.ckpt", "4")
    _write(directory / "last-v2.ckpt", "killed before its marker")  # newest, never complete
    assert resolve_last("last", callbacks) == str(directory / "last-v1.ckpt")
    assert resolve_last("best", callbacks) == "best" and resolve_last(None, callbacks) is None
    assert resolve_last("last", [ModelCheckpoint(dirpath=tmp_path)]) == "last"  # local: Lightning lists it
