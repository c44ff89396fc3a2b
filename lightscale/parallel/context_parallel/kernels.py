"""The fused SDPA op that computes one (query chunk, key chunk) block of ring and allgather attention, per device.

A block needs an op that returns the log-sum-exp of its scores (to merge blocks exactly) and a backward op that takes
the *merged* output and log-sum-exp (so each block's gradient is its share of the whole softmax): torch's private
SDPA ops do both, fused (no score matrix in memory). Which one runs:

- CPU: ``_scaled_dot_product_flash_attention_for_cpu`` (every float dtype; the only CPU op with a log-sum-exp).
- CUDA: the op ``F.scaled_dot_product_attention`` itself would dispatch to (``torch._fused_sdp_choice``: dtype, head
  size, GPU generation and the backends left enabled by ``torch.nn.attention.sdpa_kernel``), which is also what torch's
  own ``context_parallel`` intercepts; when that choice is the math path (no log-sum-exp), the first of flash,
  memory-efficient and cuDNN that accepts the inputs (``torch.backends.cuda.can_use_*``); none: refused.

Example:
    >>> name = choose_kernel(q, k, v)  # "flash_cpu" on CPU; "flash" for bf16 on an H100; "efficient" for fp32
    >>> out, lse = block_forward(name, q, k, v, causal=True, scale=0.125)
    >>> dq, dk, dv = block_backward(name, grad, q, k, v, merged_out, merged_lse, causal=True, scale=0.125)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from lightscale.errors import ConfigurationError

aten = torch.ops.aten
_BY_BACKEND = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.CUDNN_ATTENTION: "cudnn",
}


def choose_kernel(q: Tensor, k: Tensor, v: Tensor) -> str:
    """The name of the fused op for blocks of these tensors (one per attention call: every block shares dtype,
    head size and device)."""
    if q.device.type == "cpu":
        return "flash_cpu"
    if q.device.type != "cuda":
        raise ConfigurationError(
            f"Context-parallel ring/allgather attention runs on CPU or CUDA tensors; got device {q.device}. "
            f"Use mode='ulysses' (torch's own attention on the device)."
        )
    backend = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, False))
    if backend in _BY_BACKEND:
        return _BY_BACKEND[backend]
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    for name, usable in (
        ("flash", torch.backends.cuda.can_use_flash_attention),
        ("efficient", torch.backends.cuda.can_use_efficient_attention),
        ("cudnn", torch.backends.cuda.can_use_cudnn_attention),
    ):
        if usable(params):
            return name
    raise ConfigurationError(
        f"No fused CUDA attention op accepts dtype {q.dtype}, head size {q.shape[-1]} on "
        f"{torch.cuda.get_device_name(q.device)} (with the SDPA backends enabled now): ring and allgather attention "
        f"need flash, memory-efficient or cuDNN attention (float16/bfloat16 for flash, float32 too for "
        f"memory-efficient; head sizes up to 256). Use mode='ulysses', or another dtype."
    )


def block_forward(name: str, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``q`` over ``k``/``v``: ``out`` in q's dtype, ``lse`` ``(B, H, Lq)`` in fp32 (fp64 for fp64
    inputs on CPU). ``causal``: q and k are the same tokens (top-left mask)."""
    return _FORWARD[name](q, k, v, causal, scale)


def block_backward(
    name: str, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this block given the merged attention's ``out``, its gradient and its ``lse``."""
    return _BACKWARD[name](grad, q, k, v, out, lse.contiguous(), causal, scale)


def _flash_cpu(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _efficient(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]]  # the kernel pads its lse rows to a multiple of 32


def _cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(lse.shape[:3])  # (B, H, L, 1) from cuDNN


def _flash_cpu_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal, scale=scale)


def _no_dropout_state(q: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The random-number state the backward ops take: unread without dropout (what their forward returns then)."""
    return torch.empty(shape, dtype=dtype, device=q.device)


def _flash_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _no_dropout_state(q, (2,), torch.uint64), _no_dropout_state(q, (), torch.uint64)
    lengths = (q.shape[-2], k.shape[-2])
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse.float(), None, None, *lengths, 0.0, causal, seed, offset, scale=scale
    )


def _efficient_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    padded = -(-q.shape[-2] // 32) * 32  # the row padding of the forward's lse
    lse = torch.nn.functional.pad(lse.float(), (0, padded - q.shape[-2]))
    seed = offset = _no_dropout_state(q, (), torch.int64)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


def _cudnn_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    seed = offset = _no_dropout_state(q, (), torch.int64)
    lengths = (q.shape[-2], k.shape[-2])
    # cuDNN wants the gradient laid out like the output.
    grad, lse = torch.empty_like(out).copy_(grad), lse.float().unsqueeze(-1)
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, offset, None, None, None, *lengths, 0.0, causal, scale=scale
    )


_FORWARD: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "flash_cpu": _flash_cpu,
    "flash": _flash,
    "efficient": _efficient,
    "cudnn": _cudnn,
}
_BACKWARD: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {
    "flash_cpu": _flash_cpu_backward,
    "flash": _flash_backward,
    "efficient": _efficient_backward,
    "cudnn": _cudnn_backward,
}
