"""Parallel degrees of a run, validated once, turned into a named torch DeviceMesh.

Every lightscale strategy describes its layout with one :class:`ParallelDims`, so the checks (the degrees
multiply to the world size, ``-1`` infers one degree) and the axis names live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
        bad = {name: d for name, d in degrees.items() if d != -1 and d < 1}
        if bad:
            raise ConfigurationError(f"Parallel degrees must be positive integers or -1 (infer), got {bad}.")
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

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))


def _product(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
