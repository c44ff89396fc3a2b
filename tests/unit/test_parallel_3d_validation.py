"""parallel_3d refuses bad meshes before any work, with messages that name the valid choices (one process)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

from lightscale.errors import ConfigurationError
from lightscale.parallel.pipeline import check_microbatch_split, even_stage_split, validate_schedule
from lightscale.parallel.tensor_parallel import matching_modules, validate_tp_plan
from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.recipes.gpt.parallelize import gpt_stage_modules, gpt_tp_plan, validate_gpt_parallel
from lightscale.strategies import Parallel3DStrategy


def test_degrees_must_multiply_to_the_world_size() -> None:
    with pytest.raises(ConfigurationError, match=r"multiply to 8, but the world size is 4.*\[1, 2, 4\]"):
        Parallel3DStrategy(dp=2, tp=2, pp=2).parallel_dims(4)
    assert Parallel3DStrategy(tp=2, pp=2).parallel_dims(8).dp_shard == 2  # dp=-1 is inferred
    assert Parallel3DStrategy(tp=2, dp_mode="replicate").parallel_dims(4).dp_replicate == 2


def test_heads_not_divisible_by_tp() -> None:
    with pytest.raises(ConfigurationError, match=r"tp=4 .* does not divide \{'n_head': 2\}. Valid tp.*\[1, 2\]"):
        validate_gpt_parallel(GPTConfig(n_head=2, n_embd=64), tp=4, num_stages=1)


def test_kv_heads_not_divisible_by_tp() -> None:
    with pytest.raises(ConfigurationError, match=r"does not divide \{'n_kv_head': 1\}"):
        validate_gpt_parallel(GPTConfig(n_head=4, n_kv_head=1, n_embd=64), tp=2, num_stages=1)


def test_hidden_and_vocab_not_divisible_by_tp() -> None:
    # With n_embd % n_head == 0 a tp dividing the heads divides the hidden size; the vocabulary can still fail.
    with pytest.raises(ConfigurationError, match=r"does not divide \{'vocab_size': 255\}"):
        validate_gpt_parallel(GPTConfig(vocab_size=255, n_head=2, n_embd=64), tp=2, num_stages=1)


def test_layers_not_divisible_into_stages() -> None:
    with pytest.raises(ConfigurationError, match=r"3 layers do not divide into 2 pipeline stages.*\[1, 3\]"):
        gpt_stage_modules(GPTConfig(n_layer=3, tie_weights=False), 2)
    with pytest.raises(ConfigurationError, match="3 layers do not divide into 2"):
        validate_gpt_parallel(GPTConfig(n_layer=3, tie_weights=False), tp=1, num_stages=2)


def test_tied_embeddings_with_pipeline() -> None:
    with pytest.raises(ConfigurationError, match="tie_weights: false"):
        validate_gpt_parallel(GPTConfig(n_layer=2), tp=1, num_stages=2)


def test_fewer_microbatches_than_stages() -> None:
    with pytest.raises(ConfigurationError, match=r"'1f1b' needs at least as many microbatches as stages.*>= 4"):
        Parallel3DStrategy(pp=4, schedule="1f1b", microbatches=2)
    validate_schedule("gpipe", pp=4, microbatches=2, stages_per_rank=1)  # legal, if idle-heavy


def test_schedule_shape_errors() -> None:
    with pytest.raises(ConfigurationError, match=r"Unknown pipeline schedule '1f1'. Did you mean '1f1b'\?"):
        Parallel3DStrategy(pp=2, schedule="1f1")
    with pytest.raises(ConfigurationError, match=r"'zbv' needs exactly 2 stages per rank"):
        Parallel3DStrategy(pp=2, schedule="zbv", stages_per_rank=3)
    with pytest.raises(ConfigurationError, match=r"'1f1b' runs one stage per rank"):
        Parallel3DStrategy(pp=2, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ConfigurationError, match=r"'interleaved_1f1b' cannot run pp=2, microbatches=5.*multiple"):
        Parallel3DStrategy(pp=2, schedule="interleaved_1f1b", microbatches=5)  # torch: a multiple of 5 // 2 rounds


def test_batch_not_divisible_into_microbatches() -> None:
    with pytest.raises(ConfigurationError, match=r"6 samples does not split into 4 .* among \[1, 2, 3, 6\]"):
        check_microbatch_split(6, 4)


def test_bad_degrees_and_modes() -> None:
    with pytest.raises(ConfigurationError, match="dp_mode must be 'shard' or 'replicate'"):
        Parallel3DStrategy(dp_mode="hybrid")
    with pytest.raises(ConfigurationError, match="tp=0 is not valid"):
        Parallel3DStrategy(tp=0)


def test_even_stage_split_places_embeddings_and_head() -> None:
    stages = even_stage_split(["l0", "l1", "l2", "l3"], 2, first=["emb"], last=["head"])
    assert stages == [["emb", "l0", "l1"], ["l2", "l3", "head"]]


def test_tp_plan_validation() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig())
    validate_tp_plan(model, gpt_tp_plan())
    assert matching_modules(model, "layers.*.attention.wq") == ["layers.0.attention.wq", "layers.1.attention.wq"]
    with pytest.raises(ConfigurationError, match=r"'layers.\*.attn.wq' matches no module"):
        validate_tp_plan(model, {"layers.*.attn.wq": ColwiseParallel()})
    with pytest.raises(ConfigurationError, match=r"ColwiseParallel on 'norm' \(LayerNorm\)"):
        validate_tp_plan(model, {"norm": ColwiseParallel()})
    with pytest.raises(ConfigurationError, match="not a ParallelStyle"):
        validate_tp_plan(model, {"norm": "colwise"})
