"""Shared fixtures: one tokenized copy of the default corpus per test session, one OpenMP thread per process, a real
S3 server on loopback per module that asks for one, each test's ``os.environ`` put back after it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment() -> Iterator[None]:
    """``os.environ`` as it was before the test: what a test's run writes (``seed_everything``'s ``PL_GLOBAL_SEED``,
    Lightning's ``LOCAL_RANK``/``WORLD_SIZE``) would reach later tests and the processes they start."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache dir holding the tokenized default corpus, so forked ranks never tokenize concurrently."""
    from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap

    cache = tmp_path_factory.mktemp("corpus")
    tokenize_to_memmap(None, cache, ByteTokenizer())
    return str(cache)


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A local S3 server (moto; lightscale/testing/local_s3.py) with bucket ``helpers.S3_BUCKET``, and the variables
    that send this process's and the ranks' S3 clients to it; yields its endpoint."""
    from helpers import S3_BUCKET

    from lightscale.testing.local_s3 import local_s3_server, s3_environment

    with local_s3_server(bucket=S3_BUCKET) as endpoint, pytest.MonkeyPatch.context() as patch:
        for name, value in s3_environment(endpoint).items():
            patch.setenv(name, value)
        yield endpoint
