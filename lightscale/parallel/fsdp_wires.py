"""ZeRO++ (Wang et al. 2023, arXiv:2306.10209) on FSDP2's own extension points: quantized weights (qwZ), quantized
gradients (qgZ) and secondary shards (hpZ).

========================  ==================================================================================
option                    what goes on the wire
========================  ==================================================================================
``weights="int8"``        each all-gather sends int8 values and one fp32 scale per 256 of a parameter (symmetric,
                          stochastic rounding: unbiased), dequantized into the compute dtype on arrival
                          (``set_custom_all_gather``)
``gradients="int8"``      each reduce-scatter becomes an all-to-all of int8 values + fp32 scales per 256; every
``gradients="int4"``      rank dequantizes what it received and sums in fp32 (``set_custom_reduce_scatter``);
                          int4 packs two values per byte
``secondary_shard=N``     after forward each unit keeps a 1/N shard inside its group of N neighbouring ranks (the
                          node), so backward's all-gather never leaves it (``reshard_after_forward=N``); that
                          gather carries the compute dtype, values already dequantized in forward
========================  ==================================================================================

Bytes per rank's shard of ``n`` values of one parameter: ``ceil(n * bits / 8) + 4 * ceil(n / 256)`` (blocks restart
at every parameter, as DeepSpeed quantizes per tensor; :func:`wire_bytes`), so int8 weights send
``(1 + 4/256) / 4 = 0.2539`` of fp32's bytes and ``(1 + 4/256) / 2 = 0.5078`` of bf16's. The sharded parameters,
gradients and optimizer state stay full precision: only the wire is quantized, and checkpoints hold the
full-precision shards.

Example:
    >>> fully_shard(block, mesh=mesh, reshard_after_forward=2)  # hpZ: secondary shards over 2 ranks
    >>> fully_shard(model, mesh=mesh)
    >>> apply_zeropp(model, mesh, ZeroPPOptions(weights="int8", gradients="int8"))
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from lightscale.errors import ConfigurationError

BLOCK = 256  # values per scale: ZeRO++'s and DeepSpeed's quantizer group size order
WeightWire = Literal["none", "int8"]
GradientWire = Literal["none", "int8", "int4"]
WEIGHT_WIRES: tuple[WeightWire, ...] = ("none", "int8")
GRADIENT_WIRES: tuple[GradientWire, ...] = ("none", "int8", "int4")
BITS = {"int8": 8, "int4": 4}
_SCALE_BYTES = 4  # fp32 scales


@dataclass(frozen=True)
class ZeroPPOptions:
    """Which ZeRO++ parts are on; validated at construction.

    Args:
        weights: ``"int8"`` all-gathers parameters blockwise quantized (qwZ); ``"none"`` sends the compute dtype.
        gradients: ``"int8"``/``"int4"`` reduce-scatters gradients blockwise quantized (qgZ).
        secondary_shard: ranks of a node (hpZ): backward gathers inside groups of that many neighbouring ranks;
            ``"node"``: the processes per node (where that does not divide ``dp_shard``, their greatest common divisor).
    """

    weights: WeightWire = "none"
    gradients: GradientWire = "none"
    secondary_shard: int | Literal["node"] | None = None

    def __post_init__(self) -> None:
        _check_choice("quantized_weights", self.weights, WEIGHT_WIRES)
        _check_choice("quantized_gradients", self.gradients, GRADIENT_WIRES)
        size = self.secondary_shard
        if size not in (None, "node") and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
            raise ConfigurationError(
                f"secondary_shard={size!r} is not a group size: give the ranks per node (an int >= 2 dividing "
                "dp_shard), 'node' (the processes per node), or None for no secondary shards."
            )

    @property
    def enabled(self) -> bool:
        return self.weights != "none" or self.gradients != "none" or self.secondary_shard is not None

    def secondary_group_size(self, *, dp_shard: int, per_node: int) -> int | None:
        """The hpZ group size for this layout (``None``: no secondary shards); refuses one not dividing ``dp_shard``."""
        size = self.secondary_shard
        if size == "node":
            return math.gcd(per_node, dp_shard)
        if size is not None and (size > dp_shard or dp_shard % size):
            divisors = [d for d in range(2, dp_shard + 1) if dp_shard % d == 0]
            raise ConfigurationError(
                f"secondary_shard={size} must divide dp_shard={dp_shard} (the ranks each parameter is sharded over); "
                f"valid here: {divisors or 'none (dp_shard < 2)'}."
            )
        return size

    def check_with(self, *, reshard_after_forward: bool, compression: str) -> None:
        """Refuse the FSDP2 options that choose the same wire another way."""
        if self.secondary_shard is not None and not reshard_after_forward:
            raise ConfigurationError(
                "secondary_shard (hpZ) reshards after forward to a node-local group; reshard_after_forward=False "
                "(fsdp2_grad_op) keeps the parameters gathered instead. Choose one."
            )
        if self.gradients != "none" and compression != "none":
            raise ConfigurationError(
                f"quantized_gradients={self.gradients!r} and compression={compression!r} both choose the gradient "
                "wire; give one of them (quantized gradients are summed in fp32 after dequantization)."
            )


def _check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ConfigurationError(f"{name}={value!r} is not a ZeRO++ wire; choose one of {', '.join(map(repr, valid))}.")


# ---- blockwise symmetric quantization ---------------------------------------------------------------------------
Segments = tuple[int, ...]  # lengths of a row's consecutive parts (one parameter's shard each): blocks restart at each


def wire_bytes(numel: int, bits: int, segments: Segments | None = None) -> int:
    """Bytes one row of ``numel`` values takes on the wire: packed values, then one fp32 scale per block."""
    return math.ceil(numel * bits / 8) + _SCALE_BYTES * _blocks(segments or (numel,))


def quantize_rows(rows: Tensor, bits: int, segments: Segments | None = None, *, salt: int = 0) -> Tensor:
    """Each row of a 2-D tensor as one uint8 wire row: values (int8, or int4 two per byte), then fp32 scales.

    Symmetric per block of 256, ``s = absmax / (2^(bits-1) - 1)``, rounded stochastically: ``q = floor(x / s + u)``
    with ``u`` uniform in [0, 1), so ``E[q s] = x`` and the error stays below one step. Round-to-nearest is biased for
    a value that keeps its place between two levels (a gradient entry below half a step is sent as 0 every step, a
    weight's small updates are invisible until they cross a level), and on the tiny GPT it learned 15 % worse than
    fsdp2 at 600 steps where stochastic rounding is within the spread of a bf16 wire (docs/strategies/fsdp2.md).
    ``u`` is a hash of each value's bits, its position, the row's bit sum and ``salt`` (the sending rank): the same
    shard rounds the same way in forward and in backward's re-gather (autograd's saved activations match the weights)
    and after a resume, and changes as soon as any value of the row does. With ``segments`` no block spans two of
    them: a norm's weights (~1) never set the step of a matrix's (~0.02)."""
    count, numel = rows.shape
    segments = segments or (numel,)
    blocks, where = _blocks(segments), _positions(segments, rows.device)
    padded = torch.zeros(count, blocks * BLOCK, dtype=torch.float32, device=rows.device)
    padded[:, where] = rows.to(torch.float32)
    padded = padded.view(count, blocks, BLOCK)
    qmax = 2 ** (bits - 1) - 1
    scales = padded.abs().amax(dim=-1, keepdim=True) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block quantizes to zeros
    scaled = padded / safe
    dither = _uniform_hash(scaled.view(count, -1), salt).view_as(scaled)
    values = torch.floor(scaled + dither).clamp_(-qmax, qmax).to(torch.int8).view(count, -1)[:, where]
    payload = _pack(values, bits)
    return torch.cat([payload, scales.view(count, blocks).view(torch.uint8)], dim=1)


_MASK31 = 0x7FFFFFFF


def _uniform_hash(values: Tensor, salt: int) -> Tensor:
    """Uniform [0, 1) noise, one per value, from a 31-bit integer hash of the value's fp32 bits, its index, its row's
    bit sum and ``salt``: deterministic (no generator state to checkpoint, no host sync) and independent of the level
    the value sits at. Products stay below 2^62, so int64 never overflows."""
    bits = values.contiguous().view(torch.int32).to(torch.int64) & _MASK31
    row_sum = bits.sum(dim=-1, keepdim=True) & _MASK31
    index = torch.arange(values.shape[-1], device=values.device, dtype=torch.int64)
    key = _mix(bits ^ _mix(index + (salt & 0xFFFF) * 0x10001) ^ _mix(row_sum))
    return (key & 0xFFFFFF).to(torch.float32) / float(1 << 24)


def _mix(x: Tensor) -> Tensor:
    """A 31-bit integer finalizer (xor-shift-multiply, after Wellons' lowbias32) on int64 tensors."""
    x = x & _MASK31
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK31
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
    return x ^ (x >> 16)


def dequantize_rows(wire: Tensor, numel: int, bits: int, segments: Segments | None = None) -> Tensor:
    """The fp32 values of wire rows made by :func:`quantize_rows` (``numel`` values each, the same ``segments``)."""
    count = wire.shape[0]
    segments = segments or (numel,)
    blocks, where = _blocks(segments), _positions(segments, wire.device)
    payload_bytes = math.ceil(numel * bits / 8)
    values = _unpack(wire[:, :payload_bytes], numel, bits).to(torch.float32)
    scales = wire[:, payload_bytes:].contiguous().view(torch.float32).view(count, blocks)
    padded = torch.zeros(count, blocks * BLOCK, dtype=torch.float32, device=wire.device)
    padded[:, where] = values
    return (padded.view(count, blocks, BLOCK) * scales.unsqueeze(-1)).view(count, -1)[:, where]


def _blocks(segments: Segments) -> int:
    return sum(math.ceil(length / BLOCK) for length in segments)


@functools.lru_cache(maxsize=256)
def _positions(segments: Segments, device: torch.device) -> Tensor:
    """Where each value of a row sits once every segment starts a new block."""
    starts = itertools.accumulate((math.ceil(length / BLOCK) * BLOCK for length in segments[:-1]), initial=0)
    spans = [torch.arange(start, start + length) for start, length in zip(starts, segments, strict=True)]
    return torch.cat(spans).to(device)


def _pack(values: Tensor, bits: int) -> Tensor:
    if bits == 8:
        return values.view(torch.uint8)
    if values.shape[1] % 2:  # an odd count: the last byte's high half is zero
        values = torch.nn.functional.pad(values, (0, 1))
    low, high = values[:, 0::2], values[:, 1::2]
    return ((low & 0x0F) | (high << 4)).view(torch.uint8)


def _unpack(payload: Tensor, numel: int, bits: int) -> Tensor:
    signed = payload.view(torch.int8)
    if bits == 8:
        return signed
    low = (signed << 4) >> 4  # arithmetic shifts sign-extend each 4-bit half
    high = signed >> 4
    return torch.stack([low, high], dim=-1).view(payload.shape[0], -1)[:, :numel]


# ---- FSDP2's communication hooks ------------------------------------------------------------------------------
class _Allocate:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Allocate, AllGather):
    """qwZ: the primary all-gather (over ``primary_group``) sends blockwise int8 values and scales; any other gather
    (hpZ's secondary one, inside a node) and a mixed-dtype group's byte buffer go as FSDP sends them. ``segments``:
    each parameter's shard length in FSDP's flat order (blocks restart at each; ignored if they do not add up)."""

    def __init__(self, primary_group: dist.ProcessGroup, bits: int = 8, segments: Segments | None = None) -> None:
        self.primary = primary_group.group_name
        self.bits = bits
        self.segments = segments

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if group.group_name != self.primary or not output_tensor.is_floating_point():
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        world, numel = group.size(), input_tensor.numel()
        segments = _matching(self.segments, numel)
        wire = quantize_rows(input_tensor.view(1, numel), self.bits, segments, salt=group.rank())
        gathered = torch.empty(world, wire.shape[1], dtype=torch.uint8, device=wire.device)
        dist.all_gather_single(gathered, wire, group=group)
        # Every rank's slice, its own too, is the dequantized one: all ranks compute with identical weights.
        output_tensor.view(world, numel).copy_(dequantize_rows(gathered, numel, self.bits, segments))
        return None  # done: FSDP waits on no work object


class QuantizedReduceScatter(_Allocate, ReduceScatter):
    """qgZ: each rank quantizes the chunk every other rank owns, one all-to-all swaps them, and the owner sums the
    dequantized chunks in fp32 (a quantized sum inside the collective would mix scales). ``segments`` as for
    :class:`QuantizedAllGather` (each rank's chunk holds its shard of every parameter, in the same order)."""

    def __init__(self, bits: int, segments: Segments | None = None) -> None:
        self.bits = bits
        self.segments = segments

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        world, numel = group.size(), output_tensor.numel()
        segments = _matching(self.segments, numel)
        wire = quantize_rows(input_tensor.view(world, numel), self.bits, segments, salt=group.rank())
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        total = dequantize_rows(received, numel, self.bits, segments).sum(dim=0)
        if op == dist.ReduceOp.AVG:
            total /= world
        elif op != dist.ReduceOp.SUM:
            raise ConfigurationError(
                f"quantized_gradients reduces with SUM or AVG; FSDP asked for {op} (a gradient divide factor). "
                "Leave set_gradient_divide_factor unset on these modules, or use quantized_gradients='none'."
            )
        output_tensor.copy_(total)
        return None


def _matching(segments: Segments | None, numel: int) -> Segments | None:
    return segments if segments is not None and sum(segments) == numel else None


def shard_segments(module: FSDPModule, shards: int) -> Segments:
    """Each parameter's padded shard length in the order FSDP lays out ``module``'s flat buffers: its own parameters
    (those of nested units and 0-dimensional ones, which FSDP ignores, excluded), dim 0 padded to a multiple of
    ``shards`` (``fully_shard``'s layout)."""
    nested = {
        id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule) for p in sub.parameters()
    }
    seen: set[int] = set()
    lengths = []
    for param in module.parameters():
        if id(param) in nested or id(param) in seen or param.ndim == 0:  # 0-dim: kept whole, outside FSDP
            continue
        seen.add(id(param))
        lengths.append(math.ceil(param.shape[0] / shards) * math.prod(param.shape[1:]))
    return tuple(lengths)


def apply_zeropp(model: nn.Module, mesh: DeviceMesh, options: ZeroPPOptions) -> None:
    """Install the quantized collectives on every FSDP unit of ``model`` (already ``fully_shard``-ed over ``mesh``,
    whose last axis is the shard axis; hpZ is ``fully_shard``'s own ``reshard_after_forward=N``)."""
    primary = mesh.get_group(mesh.ndim - 1)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        segments = shard_segments(module, primary.size())
        if options.weights != "none":
            module.set_custom_all_gather(QuantizedAllGather(primary, BITS[options.weights], segments))
        if options.gradients != "none":
            module.set_custom_reduce_scatter(QuantizedReduceScatter(BITS[options.gradients], segments))
