"""Shared fixtures: one tokenized copy of the default corpus per test session, one OpenMP thread per process."""

from __future__ import annotations

import os

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


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A cache dir holding the tokenized default corpus, so forked ranks never tokenize concurrently."""
    from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap

    cache = tmp_path_factory.mktemp("corpus")
    tokenize_to_memmap(None, cache, ByteTokenizer())
    return str(cache)
