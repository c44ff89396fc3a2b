"""ParallelDims: degrees multiply to the world size, -1 infers one degree, errors name valid choices."""

import pytest

from lightscale.strategies import ParallelDims


def test_infers_the_missing_degree() -> None:
    dims = ParallelDims(world_size=8, dp_shard=-1, tp=2)
    assert (dims.dp_shard, dims.tp, dims.dp) == (4, 2, 4)
    assert dims.dp_enabled and dims.tp_enabled and not dims.pp_enabled


def test_product_must_equal_world_size() -> None:
    with pytest.raises(ValueError, match=r"pp=3 x tp=2 multiply to 6, but the world size is 8.*\[1, 2, 4, 8\]"):
        ParallelDims(world_size=8, tp=2, pp=3)


def test_cannot_infer_from_a_non_divisor() -> None:
    with pytest.raises(ValueError, match=r"Cannot infer dp_replicate: world size 8 is not divisible by .*\(3\)"):
        ParallelDims(world_size=8, dp_replicate=-1, tp=3)


@pytest.mark.parametrize("bad", [{"tp": 0}, {"dp_shard": -2}, {"dp_shard": -1, "tp": -1}])
def test_rejects_bad_degrees(bad: dict) -> None:
    with pytest.raises(ValueError, match="degree"):
        ParallelDims(world_size=4, **bad)


def test_context_parallel_ranks_share_their_data_shard() -> None:
    # Mesh (pp, dp_replicate, dp_shard, ep, cp, tp), tp fastest then cp: the cp ranks of a batch read the same samples,
    # and FSDP2 averages gradients over every rank computing them (dp x ep x cp).
    dims = ParallelDims(world_size=16, dp_shard=2, ep=2, cp=2, tp=2)
    assert (dims.data_shards, dims.fsdp_size, dims.cp_enabled) == (4, 8, True)
    assert [dims.data_rank(rank) for rank in range(16)] == [r // 4 for r in range(16)]
    assert (dims.data_shards, dims.data_rank(13)) == (4, 3)
    assert ParallelDims(world_size=4, dp_shard=-1, cp=2).dp_shard == 2
