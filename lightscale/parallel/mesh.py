"""Parallel degrees of a run, validated once, turned into a named torch DeviceMesh, and everything derived from it.

Every lightscale strategy describes its layout with one :class:`ParallelDims`, so the checks (the degrees
multiply to the world size, ``-1`` infers one degree), the axis names, the data-parallel rank of a global rank and
the derived meshes and groups (the data-parallel mesh FSDP shards over, the pipeline group) live in one place.

Context parallelism (``cp``) shards each sample's sequence over ranks that read the same samples: its ranks share a
data shard like tensor-parallel ones, and FSDP2 shards (and averages gradients) over ``dp_shard x cp`` as torchtitan
does (its ``dp_shard_cp``), since every cp rank computes gradients from its own tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightscale.errors import ConfigurationError

# Outer to inner: pipeline stages talk least, tensor-parallel ranks talk most, so tp is the fastest-varying axis;
# context-parallel ranks exchange K/V every attention layer, next to tp.
AXIS_ORDER = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
Role = Literal["tp", "ep", "pp", "cp", "dp_shard", "dp_replicate"]


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
    cp: int = 1

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
    def fsdp_size(self) -> int:
        """Ranks the dense parameters' gradients are averaged over: every rank with a batch of its own (dp x ep)
        times the cp ranks splitting each batch's sequences (FSDP2 shards over all of them but dp_replicate)."""
        return self.data_shards * self.cp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

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
        """The index of ``global_rank``'s data shard among :attr:`data_shards`: ranks that share a batch (tensor,
        context or pipeline parallel) share it; expert-parallel ranks do not (they are data-parallel ranks exchanging
        tokens). The mesh is ``AXIS_ORDER``, tp fastest then cp: the (dp, ep) index has stride cp x tp."""
        return global_rank // (self.cp * self.tp) % self.data_shards


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

    With expert parallelism the dense part shards over ``dp_shard x ep`` (every rank with a batch of its own), with
    context parallelism over ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``), with both over ``dp_shard x ep x cp``.
    """
    shard = _flattened(mesh, ["dp_shard", *(axis for axis in ("ep", "cp") if mesh[axis].size() > 1)])
    if mesh["ep"].size() > 1:
        assert mesh["dp_replicate"].size() == 1, "expert parallelism with replicated data parallelism is refused"
        return shard
    if mesh["dp_replicate"].size() > 1:
        return _replicas_by_shards(mesh, shard)
    return shard


def axis(mesh: DeviceMesh, role: Role) -> DeviceMesh:
    """The one-axis mesh of a role: ``"tp"`` (tensor parallel), ``"ep"`` (expert parallel), ``"pp"`` (pipeline),
    ``"dp_shard"`` (the ranks one model copy is sharded over; a DiLoCo worker's own ranks), ``"dp_replicate"`` (the
    model copies; DiLoCo's workers). The only place outside this module's own functions that indexes an axis."""
    return mesh[role]


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that read different batches, flattened: ``dp_replicate x dp_shard x ep`` (expert-parallel ranks have
    batches of their own; tp, cp and pp ranks share one). One rule for whatever spans the global batch: its size is
    :attr:`ParallelDims.data_shards` and this rank's place in it :meth:`ParallelDims.data_rank`, the shard the sampler
    and ``lightscale.data_shard()`` give (tests/unit/test_data_ranks.py); the contrastive gather runs over it
    (parallel/contrastive.py)."""
    axes = [axis for axis in ("dp_replicate", "dp_shard", "ep") if mesh[axis].size() > 1]
    return _flattened(mesh, axes or ["dp_shard"])


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding the same expert-parallel experts: ``dp_shard``, times ``cp`` under context parallelism
    (cp ranks route their own tokens to the same experts)."""
    return _flattened(mesh, ["dp_shard", "cp"] if mesh["cp"].size() > 1 else ["dp_shard"])


def context_parallel_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of the ``cp`` axis, or None without context parallelism."""
    return mesh["cp"].get_group() if mesh["cp"].size() > 1 else None


def _replicas_by_shards(mesh: DeviceMesh, shard: DeviceMesh) -> DeviceMesh:
    """The 2-D ``(dp_replicate, shard)`` mesh HSDP runs on; a flattened shard axis is joined by ``_concatenate``
    (slicing a flattened axis from the root mesh is deprecated from torch 2.11; older torch has only that)."""
    name = shard.mesh_dim_names[0]
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if name == "dp_shard" or concatenate is None:
        return mesh["dp_replicate", name]
    return concatenate([mesh["dp_replicate"], shard])


def _flattened(mesh: DeviceMesh, axes: list[str]) -> DeviceMesh:
    """One axis of ``mesh`` named ``axes`` joined by ``_`` (the axis itself if there is one)."""
    return mesh[axes[0]] if len(axes) == 1 else mesh[tuple(axes)]._flatten("_".join(axes))


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
