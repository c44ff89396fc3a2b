"""Single-device GPT: shapes, tying, validation, causality, grouped-query attention."""

import math

import pytest
import torch

from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.recipes.gpt.model import flops_per_token


def tiny(**overrides) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, **overrides})


def test_forward_shape_and_block_size_limit():
    torch.manual_seed(0)
    model = GPT(tiny())
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_module_names_are_addressable_for_parallel_plans():
    names = {name for name, _ in GPT(tiny(n_layer=2)).named_modules()}
    for expected in (
        "tok_embeddings",
        "pos_embeddings",
        "layers.1.attention.wq",
        "layers.0.attention.wo",
        "layers.0.feed_forward.w1",
        "layers.0.feed_forward.w2",
        "layers.0.attention_norm",
        "layers.0.ffn_norm",
        "norm",
        "output",
    ):
        assert expected in names


def test_tied_weights_share_storage_and_count_once():
    config = tiny()
    tied, untied = GPT(config), GPT(tiny(tie_weights=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    d, v, t, layers = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    per_layer = 4 * d * d + 8 * d * d + 2 * d  # attention, MLP, two LayerNorm gains (bias=False)
    expected = v * d + t * d + layers * per_layer + d
    assert tied.num_params() == expected
    assert untied.num_params() == expected + v * d
    assert tied.num_params(exclude_embeddings=True) == layers * per_layer + d
    assert flops_per_token(config) == 6 * (layers * per_layer + d + v * d) + 12 * layers * d * t  # head: tied


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=128))
    std_q = model.layers["0"].attention.wq.weight.std().item()
    std_o = model.layers["0"].attention.wo.weight.std().item()
    assert std_q == pytest.approx(0.02, rel=0.05)
    assert std_o == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(128))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd=30 is not divisible by n_head=4"),
        ({"n_head": 4, "n_kv_head": 3}, "n_head=4 is not divisible by n_kv_head=3; valid n_kv_head: \\[1, 2, 4\\]"),
        ({"n_layer": 0}, "n_layer must be a positive int, got 0"),
        ({"vocab_size": -1}, "vocab_size must be a positive int"),
        ({"dropout": 1.0}, "0 <= dropout < 1, got 1.0"),
        ({"n_kv_head": 0}, "n_kv_head must be None or a positive int"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
def test_causal_future_tokens_do_not_change_past_logits(n_kv_head):
    torch.manual_seed(0)
    model = GPT(tiny(n_kv_head=n_kv_head)).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_grouped_query_attention_shrinks_kv_and_matches_repeated_heads():
    torch.manual_seed(0)
    gqa = GPT(tiny(n_kv_head=2)).eval()
    attn = gqa.layers["0"].attention
    assert attn.wk.weight.shape == (2 * 8, 32)
    assert gqa.num_params() < GPT(tiny()).num_params()
    # Same model as MHA whose k/v heads are repeated per group: GQA must share, not slice, its kv heads.
    mha = GPT(tiny()).eval()
    with torch.no_grad():
        for name, block in gqa.layers.items():
            target = mha.layers[name]
            for sub in ("attention_norm", "ffn_norm", "feed_forward"):
                getattr(target, sub).load_state_dict(getattr(block, sub).state_dict())
            target.attention.wq.weight.copy_(block.attention.wq.weight)
            target.attention.wo.weight.copy_(block.attention.wo.weight)
            for proj in ("wk", "wv"):
                weight = getattr(block.attention, proj).weight.view(2, 8, 32)
                getattr(target.attention, proj).weight.copy_(weight.repeat_interleave(2, dim=0).reshape(32, 32))
        for name in ("tok_embeddings", "pos_embeddings", "norm"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.5))
    tokens = torch.randint(0, 256, (1, 16))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens))
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))
