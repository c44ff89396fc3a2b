"""Hugging Face models under context parallelism get this rank's global positions (hf_positions.py): only inside a
cp step, never over positions or a cache the caller passed, with the arguments given positionally or by name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from lightscale.parallel.context_parallel import dispatch
from lightscale.parallel.context_parallel.hf_positions import feed_global_positions

transformers = pytest.importorskip("transformers")
OFFSET = 5  # the stand-in cp rank's tokens start here


class _SecondRank:
    """What the hook asks of the active cp mode: the global positions of this rank's tokens."""

    def positions(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.arange(OFFSET, OFFSET + local_len, device=device)


@contextmanager
def _in_cp_step() -> Iterator[None]:
    dispatch._ACTIVE.append(_SecondRank())  # type: ignore[arg-type]
    try:
        yield
    finally:
        dispatch._ACTIVE.pop()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=37, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config).eval()


TOKENS = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(0))
GLOBAL = torch.arange(OFFSET, OFFSET + 6).unsqueeze(0)
ONES = torch.ones_like(TOKENS)


@pytest.mark.parametrize("build", [_llama, _gpt2])
def test_a_cp_step_gives_global_positions_however_the_call_is_written(build) -> None:
    model = build()
    expected = model(TOKENS, attention_mask=ONES, position_ids=GLOBAL).logits
    local = model(TOKENS).logits
    assert feed_global_positions(model)
    assert torch.equal(model(TOKENS).logits, local)  # outside a cp step: untouched
    with _in_cp_step(), torch.no_grad():
        assert torch.equal(model(TOKENS).logits, expected)
        assert torch.equal(model(input_ids=TOKENS).logits, expected)
        assert torch.equal(model(TOKENS, None).logits, expected)  # second positional: a cache (GPT-2) or mask (Llama)
        mine = torch.arange(6).unsqueeze(0)
        assert torch.equal(model(TOKENS, position_ids=mine).logits, local)  # the caller's positions win


def test_a_cache_is_left_alone() -> None:
    model = _gpt2()
    feed_global_positions(model)
    with torch.no_grad():
        past = model(TOKENS[:, :4], use_cache=True).past_key_values
        plain = model(TOKENS[:, 4:], past_key_values=past).logits
        past = model(TOKENS[:, :4], use_cache=True).past_key_values
        with _in_cp_step():
            assert torch.equal(model(TOKENS[:, 4:], past_key_values=past).logits, plain)
