"""Parallel degrees of a run, validated once, turned into a named torch DeviceMesh, and everything derived from it.

Every lightscale strategy describes its layout with one :class:`ParallelDims`, so the checks (the degrees
multiply to the world size, ``-1`` infers one degree), the axis names, the data-parallel rank of a global rank and
the derived meshes and groups (the data-parallel mesh FSDP shards over, the pipeline group) live in one place.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightscale.errors import ConfigurationError

# Outer to inner: pipeline stages talk least, tensor-parallel ranks talk most, so tp is the fastest-varying axis.
AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "tp")


@dataclass
class ParallelDims:
    """Degrees of each parallel dimension; ``-1`` means "whatever is left of the world size" (one axis at most).

    Example:
        >>> ParallelDims(dp_shard=-1, tp=2, world_size=8).dp_shard
        4
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigurationError(f"world_size must be >= 1, got {self.world_size}.")
        degrees = {name: getattr(self, name) for name in AXIS_ORDER}
        check_degrees(degrees)
        inferred = [name for name, d in degrees.items() if d == -1]
        if len(inferred) > 1:
            raise ConfigurationError(f"Only one parallel degree may be -1 (inferred), got -1 for {inferred}.")
        if inferred:
            self._infer(inferred[0], degrees)
        self._check_product()

    def _infer(self, name: str, degrees: dict[str, int]) -> None:
        known = _product(d for n, d in degrees.items() if n != name)
        if self.world_size % known:
            raise ConfigurationError(
                f"Cannot infer {name}: world size {self.world_size} is not divisible by the product of the other "
                f"degrees ({known}). Valid products divide {self.world_size}: {_divisors(self.world_size)}."
            )
        setattr(self, name, self.world_size // known)

    def _check_product(self) -> None:
        product = _product(getattr(self, name) for name in AXIS_ORDER)
        if product != self.world_size:
            shown = " x ".join(f"{name}={getattr(self, name)}" for name in AXIS_ORDER if getattr(self, name) > 1)
            raise ConfigurationError(
                f"Parallel degrees {shown or 'all 1'} multiply to {product}, but the world size is {self.world_size}. "
                f"Choose degrees whose product is {self.world_size} (each a divisor of it: "
                f"{_divisors(self.world_size)}), or set one degree to -1 to infer it."
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def data_shards(self) -> int:
        """Ranks with batches of their own: dp x ep (expert-parallel ranks are carved from data-parallel ones)."""
        return self.dp * self.ep

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the DeviceMesh with one named axis per degree (axes of size 1 included, so names are stable)."""
        shape = tuple(getattr(self, name) for name in AXIS_ORDER)
        return init_device_mesh(device_type, shape, mesh_dim_names=AXIS_ORDER)

    def data_rank(self, global_rank: int) -> int:
        """The index of ``global_rank``'s data shard among :attr:`data_shards`: ranks that share a batch (tensor or
        pipeline parallel) share it; expert-parallel ranks do not (they are data-parallel ranks exchanging tokens).
        The mesh is ``AXIS_ORDER``, tp fastest: the (dp, ep) index has stride tp."""
        return global_rank // self.tp % self.data_shards

    def sampler_kwargs(self, global_rank: int) -> dict[str, Any]:
        """``DistributedSampler`` arguments: one replica per data shard."""
        return {"num_replicas": self.data_shards, "rank": self.data_rank(global_rank)}


def check_degrees(degrees: dict[str, Any], *, inferable: Collection[str] | None = None) -> None:
    """Refuse a degree that is neither a positive integer nor ``-1`` where ``inferable`` (default: every name) allows
    inferring it. Strategies call this at construction, before any process starts; :class:`ParallelDims` again."""
    inferable = list(degrees) if inferable is None else list(inferable)
    bad = {name: d for name, d in degrees.items() if not _valid_degree(d, inferable=name in inferable)}
    if not bad:
        return
    name, degree = next(iter(bad.items()))
    hint = " or -1 (infer)" if name in inferable else f" ({' or '.join(inferable)} may be -1)"
    raise ConfigurationError(f"{name}={degree!r} is not valid: use a positive degree{hint}.")


def _valid_degree(degree: Any, *, inferable: bool) -> bool:
    return isinstance(degree, int) and (degree >= 1 or (inferable and degree == -1))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``dp_shard`` axis, or ``(dp_replicate, dp_shard)`` when replicas exist (HSDP; shard 1 = replication).

    With expert parallelism the dense part shards over ``dp_shard x ep`` (every rank with a batch of its own).
    """
    if mesh["ep"].size() > 1:
        assert mesh["dp_replicate"].size() == 1, "expert parallelism with replicated data parallelism is refused"
        return mesh["dp_shard", "ep"]._flatten("dp_shard_ep")
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def pipeline_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of the ``pp`` axis, or None without pipeline parallelism."""
    return mesh["pp"].get_group() if mesh["pp"].size() > 1 else None


def _product(values: Iterable[int]) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
