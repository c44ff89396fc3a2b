"""The routed experts' MLPs by grouped GEMM: one ``torch._grouped_mm`` per weight for all experts of a layer.

The tokens arrive sorted by expert (``counts[e]`` rows for expert e); ``_grouped_mm`` multiplies row group e by
``w[e]`` in one kernel, so 64 experts cost two kernel launches forward instead of 128 small matmuls and a Python
loop. On CUDA each group is padded to :data:`CUDA_GROUP_ROWS` rows (torchtitan's alignment for 16-bit grouped
GEMM: the kernel tiles M by it) into a buffer of a size known without reading ``counts`` on the host, and
un-padded after; on CPU the kernel takes any group sizes, so nothing is padded. The kernel's own constraint on
both devices: row strides of 16 bytes, so the model width and the expert hidden width must be multiples of
:data:`WIDTH_MULTIPLE` (checked when the layer is built).

Under ``torch.compile`` only bf16 goes into the graph (torch's shape function for ``_grouped_mm`` accepts bf16
alone); other dtypes run the same kernel eagerly, behind a graph break.

Example:
    >>> out = grouped_mlp(tokens, torch.tensor([3, 0, 5]), w1, w2)  # tokens [8, D], w1 [3, D, H], w2 [3, H, D]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CUDA_GROUP_ROWS = 8
WIDTH_MULTIPLE = 8  # 16-byte rows in bf16 (and in fp32: 4 would do, but one rule for both dtypes)


def check_expert_widths(dim: int, hidden: int) -> None:
    """Raise ValueError unless grouped GEMM can take these widths (16-byte rows in bf16)."""
    bad = {name: value for name, value in (("dim", dim), ("hidden", hidden)) if value % WIDTH_MULTIPLE}
    if bad:
        raise ValueError(
            f"MoE experts need widths that are multiples of {WIDTH_MULTIPLE} (torch._grouped_mm reads 16-byte rows); "
            f"got {', '.join(f'{name}={value}' for name, value in bad.items())}."
        )


def group_rows(device: torch.device) -> int:
    """Rows each expert's group is padded to a multiple of on ``device`` (1: no padding)."""
    return CUDA_GROUP_ROWS if device.type == "cuda" else 1


def grouped_mlp(tokens: Tensor, counts: Tensor, w1: Tensor, w2: Tensor, *, align: int | None = None) -> Tensor:
    """``gelu(tokens_e @ w1[e]) @ w2[e]`` for each expert e's ``counts[e]`` rows of ``tokens`` (sorted by expert).

    ``align`` (default: :func:`group_rows` of the tokens' device) pads each group to a multiple of that many rows.
    """
    align = group_rows(tokens.device) if align is None else align
    counts = counts.to(tokens.device)
    padded, rows = (tokens, None) if align == 1 else _pad_groups(tokens, counts, align)
    group_sizes = counts if rows is None else _round_up(counts, align)
    offsets = group_sizes.cumsum(0).to(torch.int32)
    out = _mm(F.gelu(_mm(padded, w1, offsets)), w2, offsets)
    return out if rows is None else out[rows]


def _pad_groups(tokens: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor]:
    """``tokens`` laid out with each group starting at a multiple of ``align`` (zero rows between), and the row of
    each original token in that layout. The buffer holds the worst case, so its size needs no host sync."""
    starts = counts.cumsum(0) - counts
    padded_starts = _round_up(counts, align).cumsum(0) - _round_up(counts, align)
    shift = torch.repeat_interleave(padded_starts - starts, counts, output_size=tokens.shape[0])
    rows = torch.arange(tokens.shape[0], device=tokens.device) + shift
    capacity = tokens.shape[0] + counts.numel() * (align - 1)
    return tokens.new_zeros(capacity, tokens.shape[1]).index_copy(0, rows, tokens), rows


def _round_up(counts: Tensor, align: int) -> Tensor:
    return (counts + align - 1) // align * align


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a gradient with real strides: ``_grouped_mm``'s backward refuses the
    broadcast (stride-0) gradients autograd makes of e.g. ``out.sum()``, and empty ones with zero strides."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous() if grad.numel() else torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)


def _grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return _DenseGrad.apply(torch._grouped_mm(x, w, offs=offsets))


_grouped_mm_eager = torch.compiler.disable(_grouped_mm)


def _mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return (_grouped_mm if x.dtype == torch.bfloat16 else _grouped_mm_eager)(x, w, offsets)
