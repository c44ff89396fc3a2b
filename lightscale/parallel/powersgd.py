"""PowerSGD (Vogels et al., 2019): low-rank gradient all-reduce with error feedback, over the reducer's buckets.

Each gradient matrix M (a parameter with ndim >= 2, viewed as ``shape[0] x rest``) travels as two thin factors:
P = M Q (n x r) is all-reduced and orthonormalised, then Q = M^T P (m x r) is all-reduced, and every rank takes
P Q^T as the averaged gradient: 4(n + m)r bytes instead of 4nm in fp32. Vectors (biases, norms) are all-reduced
uncompressed in the same message as the Ps. Error feedback keeps what compression dropped on each rank and adds
it to the next step's gradient, so over steps nothing is lost; Q is warm-started from the previous step. The first
``warmup_steps`` reductions are plain all-reduces, as torch's ``start_powerSGD_iter``.

torch's ``powerSGD_hook`` is written against DDP's ``GradBucket`` (and numpy's RNG for Q); this module is the same
math over :class:`~lightscale.parallel.BucketedGradReducer`'s buckets, with its state (step, Qs, residuals) as
plain tensors for checkpoints.

Example:
    >>> reducer = BucketedGradReducer(model, compression="powersgd", powersgd_rank=4)
    >>> reducer.powersgd.state_dict()["step"]
    0
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightscale.errors import ConfigurationError

_SEED = 0  # the same on every rank: Q starts equal everywhere


class GradBucket(Protocol):
    """What PowerSGD reads of a reducer bucket."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: Tensor

    def slot(self, index: int) -> Tensor: ...


@dataclass
class _Plan:
    """One bucket's split: vectors sent as they are, matrices as P then Q."""

    vectors: list[int]
    matrices: list[int]
    shapes: list[tuple[int, int, int]]  # (n, m, r) per matrix
    first: Tensor  # [vectors | Ps], the first all-reduce
    second: Tensor  # [Qs], the second all-reduce
    handle: dist.Work | None = None


def validate_powersgd(rank: int, warmup_steps: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigurationError(
            f"powersgd_rank={rank!r} is not valid: the rank of PowerSGD's low-rank factors must be an integer >= 1 "
            "(small values, 1 to 4, are typical)."
        )
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ConfigurationError(
            f"powersgd_warmup_steps={warmup_steps!r} is not valid: a number of optimizer steps >= 0."
        )


class PowerSGD:
    """PowerSGD state and math for a list of buckets whose ``flat`` already holds ``grad / world_size``.

    Args:
        buckets: the reducer's buckets (fp32 or fp64 gradients).
        rank: rank r of the factors; a matrix n x m uses min(n, m, r).
        warmup_steps: reductions done uncompressed first.
        process_group: the data-parallel group.
    """

    def __init__(
        self, buckets: list[GradBucket], *, rank: int, warmup_steps: int, process_group: dist.ProcessGroup | None
    ) -> None:
        validate_powersgd(rank, warmup_steps)
        self.rank = rank
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.step = 0
        self.buckets = buckets
        self.plans = [_plan(bucket, rank) for bucket in buckets]
        generator = torch.Generator().manual_seed(_SEED)
        self.qs = [
            [
                _orthonormal(torch.randn(m, r, generator=generator, dtype=b.flat.dtype).to(b.flat.device))
                for _, m, r in plan.shapes
            ]
            for b, plan in zip(buckets, self.plans, strict=True)
        ]
        self.residuals = [
            [torch.zeros(n, m, dtype=b.flat.dtype, device=b.flat.device) for n, m, _ in plan.shapes]
            for b, plan in zip(buckets, self.plans, strict=True)
        ]

    @property
    def compressing(self) -> bool:
        return self.step >= self.warmup_steps

    def launch(self, index: int) -> None:
        """Add the residuals, form P = M Q and start the first all-reduce ([vectors | Ps]) of bucket ``index``."""
        bucket, plan = self.buckets[index], self.plans[index]
        chunks = [bucket.slot(i).reshape(-1) for i in plan.vectors]
        for j, i in enumerate(plan.matrices):
            matrix = self._matrix(bucket, i)
            matrix.add_(self.residuals[index][j])
            chunks.append(matrix @ self.qs[index][j])
        torch.cat([c.reshape(-1) for c in chunks], out=plan.first)
        plan.handle = dist.all_reduce(plan.first, group=self.process_group, async_op=True)

    def finish(self, launched: int) -> None:
        """Complete the first ``launched`` buckets: orthonormalise the Ps, all-reduce the Qs, decompress."""
        ps: list[list[Tensor]] = []
        for index in range(launched):
            ps.append(self._second_round(index))
        for index in range(launched):
            plan = self.plans[index]
            if plan.handle is not None:
                plan.handle.wait()
            self._decompress(index, ps[index])

    def _second_round(self, index: int) -> list[Tensor]:
        bucket, plan = self.buckets[index], self.plans[index]
        plan.handle.wait()
        sizes = [bucket.params[i].numel() for i in plan.vectors] + [n * r for n, _, r in plan.shapes]
        parts = plan.first.split(sizes)
        for i, part in zip(plan.vectors, parts, strict=False):
            bucket.slot(i).copy_(part.view_as(bucket.slot(i)))  # vectors: already the average
        ps = [
            _orthonormal(part.view(n, r))
            for part, (n, _, r) in zip(parts[len(plan.vectors) :], plan.shapes, strict=True)
        ]
        if not plan.matrices:
            plan.handle = None
            return ps
        qs = [self._matrix(bucket, i).T @ p for i, p in zip(plan.matrices, ps, strict=True)]
        torch.cat([q.reshape(-1) for q in qs], out=plan.second)
        plan.handle = dist.all_reduce(plan.second, group=self.process_group, async_op=True)
        return ps

    def _decompress(self, index: int, ps: list[Tensor]) -> None:
        bucket, plan = self.buckets[index], self.plans[index]
        world = dist.get_world_size(self.process_group)
        qs = plan.second.split([m * r for _, m, r in plan.shapes])
        for j, (i, p, q) in enumerate(zip(plan.matrices, ps, qs, strict=True)):
            _, m, r = plan.shapes[j]
            q = q.view(m, r)
            matrix = self._matrix(bucket, i)  # this rank's grad / world + residual
            average = p @ q.T
            # What the average left out of this rank's share, in the same 1/world units as the bucket.
            torch.sub(matrix, average, alpha=1.0 / world, out=self.residuals[index][j])
            matrix.copy_(average)
            self.qs[index][j] = _orthonormal(q.clone())  # warm start for the next step

    def _matrix(self, bucket: GradBucket, i: int) -> Tensor:
        start, param = bucket.offsets[i], bucket.params[i]
        return bucket.flat[start : start + param.numel()].view(param.shape[0], -1)

    def state_dict(self) -> dict[str, Any]:
        """Step count, Qs and this rank's residuals (residuals differ per rank; step and Qs do not)."""
        return {
            "step": self.step,
            "q": [q.detach().cpu().clone() for qs in self.qs for q in qs],
            "residual": [e.detach().cpu().clone() for es in self.residuals for e in es],
        }

    def load_state_dict(self, state: dict[str, Any], *, residuals: bool = True) -> None:
        """Restore :meth:`state_dict`; ``residuals=False`` keeps zeros (a checkpoint of another world size)."""
        mine = [q for qs in self.qs for q in qs]
        _check_shapes("q", state["q"], mine)
        self.step = int(state["step"])
        for target, saved in zip(mine, state["q"], strict=True):
            target.copy_(saved)
        if residuals:
            errors = [e for es in self.residuals for e in es]
            _check_shapes("residual", state["residual"], errors)
            for target, saved in zip(errors, state["residual"], strict=True):
                target.copy_(saved)


def compressed_bytes(params: Iterable[Tensor], rank: int) -> int:
    """Bytes PowerSGD all-reduces per step: (n + m)r elements per matrix (r clamped to min(n, m)), vectors whole."""
    total = 0
    for param in params:
        if param.ndim >= 2:
            n, m = param.shape[0], param.numel() // param.shape[0]
            total += param.element_size() * (n + m) * min(n, m, rank)
        else:
            total += param.element_size() * param.numel()
    return total


def _plan(bucket: GradBucket, rank: int) -> _Plan:
    dtype = bucket.flat.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ConfigurationError(
            f"compression='powersgd' needs fp32 gradients (its orthogonalisation is unstable in {dtype}); train with "
            "precision '32-true' or 'bf16-mixed', or use compression='bf16'."
        )
    vectors = [i for i, p in enumerate(bucket.params) if p.ndim < 2]
    matrices = [i for i, p in enumerate(bucket.params) if p.ndim >= 2]
    shapes = []
    for i in matrices:
        n = bucket.params[i].shape[0]
        m = bucket.params[i].numel() // n
        shapes.append((n, m, min(n, m, rank)))
    first = sum(bucket.params[i].numel() for i in vectors) + sum(n * r for n, _, r in shapes)
    second = sum(m * r for _, m, r in shapes)
    device = bucket.flat.device
    return _Plan(
        vectors,
        matrices,
        shapes,
        torch.zeros(first, dtype=dtype, device=device),
        torch.zeros(second, dtype=dtype, device=device),
    )


def _orthonormal(matrix: Tensor) -> Tensor:
    """Orthonormal columns spanning at least ``matrix``'s column space (Householder QR: also when rank-deficient)."""
    return torch.linalg.qr(matrix).Q


def _check_shapes(name: str, saved: list[Tensor], mine: list[Tensor]) -> None:
    if [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in mine]:
        raise ConfigurationError(
            f"The checkpoint's PowerSGD {name} tensors do not match this model's ({len(saved)} saved, {len(mine)} "
            "here, or other shapes): resume with the same model, buckets and powersgd_rank."
        )


class EveryRankState:
    """PowerSGD's state as a checkpoint holds it (a ``Stateful``): every rank's step, Qs and own error-feedback
    residuals, gathered on save (collective); on resume each rank takes its own back, or at another world size the
    step and Qs of rank 0 with residuals at zero (warned: the residuals belong to ranks that no longer exist)."""

    def __init__(self, powersgd: PowerSGD) -> None:
        self.powersgd = powersgd

    def state_dict(self) -> list[dict[str, Any]]:
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, self.powersgd.state_dict())
        return states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if not states:
            return
        world_size, rank = dist.get_world_size(), dist.get_rank()
        same_world = len(states) == world_size
        if not same_world and rank == 0:
            warnings.warn(
                f"The checkpoint holds PowerSGD residuals of {len(states)} ranks and this run has "
                f"{world_size}: step count and Qs are restored, the error-feedback residuals start at zero.",
                stacklevel=2,
            )
        self.powersgd.load_state_dict(states[rank if same_world else 0], residuals=same_world)
