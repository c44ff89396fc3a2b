"""Local copies of remote directories, for writers and readers that know only local paths (DeepSpeed's engine
directories, transformers' ``save_pretrained``).

Such a writer writes into a local scratch directory (:func:`scratch_directory`, under ``TMPDIR``), then
:func:`upload_directory` puts each file under the URL, object by object, in the order given; the caller makes the
result complete (the checkpoint's completion marker, lightscale/storage/urls.py, written last by ``publish``). Such a
reader reads :func:`local_directory`: a local path as it is, a remote one downloaded to scratch after its completion
marker is checked (a half-written directory is refused, never copied), optionally only the files a rank needs.

Example:
    >>> with scratch_directory() as local:
    ...     engine.save_checkpoint(str(local), tag="checkpoint")
    ...     upload_directory(local, RemotePath("s3://bucket/run/last.ckpt.tmp"))
    >>> with local_directory(checkpoint_location("s3://bucket/run/last.ckpt")) as local:
    ...     engine.load_checkpoint(str(local), tag="checkpoint")
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from lightscale.storage.urls import COMPLETE, Location, RemotePath, refuse_incomplete


@contextmanager
def scratch_directory() -> Iterator[Path]:
    """An empty local directory of this process, deleted when the block ends (set ``TMPDIR`` to a disk that holds a
    checkpoint's share of this rank)."""
    with tempfile.TemporaryDirectory(prefix="lightscale-") as directory:
        yield Path(directory)


def upload_directory(local: Path, remote: RemotePath, *, last: tuple[str, ...] = ()) -> list[str]:
    """Put every file under ``local`` at the same relative name under ``remote``; the names in ``last`` (relative
    paths) go after all others, in that order. Returns the relative names uploaded."""
    names = sorted(str(path.relative_to(local)) for path in local.rglob("*") if path.is_file())
    first, then = [name for name in names if name not in last], [name for name in last if name in names]
    if first:  # one call: fsspec's async filesystems (s3fs, gcsfs, adlfs) upload the files concurrently
        remote.fs.put([str(local / name) for name in first], [f"{remote.key}/{name}" for name in first])
    for name in then:
        remote.fs.put_file(str(local / name), f"{remote.key}/{name}")
    return first + then


def download_directory(remote: RemotePath, local: Path, *, keep: Callable[[str], bool] = lambda name: True) -> None:
    """Get every object under ``remote`` whose relative name ``keep`` accepts (never the completion marker)."""
    keys = {key: key[len(remote.key) :].lstrip("/") for key in remote.files()}
    wanted = {key: local / name for key, name in keys.items() if name != COMPLETE and keep(name)}
    for target in wanted.values():
        target.parent.mkdir(parents=True, exist_ok=True)
    if wanted:  # one call: concurrent downloads on fsspec's async filesystems
        remote.fs.get(list(wanted), [str(target) for target in wanted.values()])


@contextmanager
def local_directory(location: Location, *, keep: Callable[[str], bool] = lambda name: True) -> Iterator[Path]:
    """``location`` as a local directory: itself when local; else a complete remote directory's files (those
    ``keep`` accepts) downloaded to scratch for the block. An incomplete remote directory is refused."""
    if isinstance(location, Path):
        yield location
        return
    if not location.is_dir():
        raise FileNotFoundError(f"{location} is not a directory (no object under that prefix).")
    refuse_incomplete(location)
    with scratch_directory() as local:
        download_directory(location, local, keep=keep)
        yield local
