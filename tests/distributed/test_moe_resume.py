"""MoE checkpoints reshard: saved with experts split over ep=2 ranks, resumed at another ep degree.

torch.distributed.checkpoint stores each stacked expert weight (and its AdamW moments) as one global tensor
``[n_experts, ...]`` written in ep shards, so a run with another split reads the rows it now holds.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TINY, relative_difference, train_tiny_gpt

from lightscale.layers.moe import MoEConfig
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

CONFIG = dataclasses.replace(TINY, moe=MoEConfig(n_experts=4, top_k=2, balance="bias"))
STEPS, STOP = 6, 3
GLOBAL_BATCH = 8
TOLERANCE = 1e-5  # another split of the same arithmetic: fp32 reassociation only


def _fit(ep: int, ranks: int, cache_dir: str, **kwargs: object) -> list[float]:
    strategy = Parallel3DStrategy(ep=ep, dp=ranks // ep)
    return train_tiny_gpt(
        strategy, devices=ranks, batch_size=GLOBAL_BATCH // ranks, config=CONFIG, cache_dir=cache_dir, **kwargs
    )


@pytest.fixture(scope="module")
def saved_at_ep2(corpus_cache: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """A checkpoint after STOP steps at ep=2, and the losses of the same run uninterrupted."""
    checkpoint = str(tmp_path_factory.mktemp("moe") / "ep2.ckpt")
    saved = run_distributed(
        _fit, 2, 2, corpus_cache, max_steps=STEPS, stop_after=STOP, save_checkpoint_to=checkpoint, world_size=2
    )[0]
    uninterrupted = run_distributed(_fit, 2, 2, corpus_cache, max_steps=STEPS, world_size=2)[0]
    assert saved == uninterrupted[:STOP]
    return checkpoint, uninterrupted


@pytest.mark.parametrize(("ep", "ranks"), [(1, 2), (4, 4)], ids=["ep2-to-ep1", "ep2-to-ep4"])
def test_resume_at_another_ep_degree(
    ep: int, ranks: int, saved_at_ep2: tuple[str, list[float]], corpus_cache: str
) -> None:
    checkpoint, uninterrupted = saved_at_ep2
    resumed = run_distributed(
        _fit, ep, ranks, corpus_cache, max_steps=STEPS, resume_from=checkpoint, world_size=ranks, timeout_s=600
    )[0]
    assert relative_difference(resumed, uninterrupted[STOP:]) <= TOLERANCE
