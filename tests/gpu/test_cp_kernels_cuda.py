"""The fused CUDA op ring and allgather attention choose for a block, and each op's block forward and backward against
plain fp32 attention (tests/attention_reference.py); skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_reference import block_attention, block_backward
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel.blocks import Partial, merge
from lightscale.parallel.context_parallel.kernels import block_backward as fused_backward
from lightscale.parallel.context_parallel.kernels import block_forward, choose_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SCALE = 0.125


def _inputs(dtype: torch.dtype, lq: int = 40, lk: int = 72, dim: int = 64) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(2, 4, length, dim, device="cuda", dtype=dtype) for length in (lq, lk, lk))


class _Ops(TorchDispatchMode):
    """The aten ops called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_op_choice_is_the_op_sdpa_itself_runs(dtype: torch.dtype) -> None:
    q, k, v = _inputs(dtype)
    with _Ops() as ops:
        F.scaled_dot_product_attention(q, k, v)
    assert f"_scaled_dot_product_{choose_kernel(q, k, v)}_attention" in ops.names, ops.names


def test_op_choice_by_dtype_and_enabled_backends() -> None:
    assert choose_kernel(*_inputs(torch.bfloat16)) in ("flash", "cudnn")  # torch's choice on this GPU
    assert choose_kernel(*_inputs(torch.float32)) == "efficient"  # flash has no fp32
    for backend, name in ((SDPBackend.EFFICIENT_ATTENTION, "efficient"), (SDPBackend.CUDNN_ATTENTION, "cudnn")):
        with sdpa_kernel([backend]):  # the user steers the choice as for SDPA itself
            q, k, v = _inputs(torch.bfloat16)
            params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
            if getattr(torch.backends.cuda, f"can_use_{name}_attention")(params):
                assert choose_kernel(q, k, v) == name
    with pytest.raises(ConfigurationError, match="float64"):
        choose_kernel(*_inputs(torch.float64))


@pytest.mark.parametrize(
    ("name", "dtype", "bound"),
    [
        ("flash", torch.bfloat16, 2e-2),
        ("efficient", torch.bfloat16, 2e-2),
        ("efficient", torch.float32, 1e-4),
        ("cudnn", torch.bfloat16, 2e-2),
    ],
)
def test_each_op_block_forward_and_backward(name: str, dtype: torch.dtype, bound: float) -> None:
    q, k, v = _inputs(dtype)
    grad = torch.randn_like(q)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    if not getattr(torch.backends.cuda, f"can_use_{name}_attention")(params):
        pytest.skip(f"{name} attention is not usable on this device")
    # Two key blocks (lengths not multiples of 32: the efficient op pads its log-sum-exp), the diagonal one causal.
    blocks = [(slice(0, 32), False), (slice(32, 72), True)]
    merged = None
    for keys, causal in blocks:
        out, lse = block_forward(name, q, k[..., keys, :], v[..., keys, :], causal=causal, scale=SCALE)
        ref_out, ref_lse = block_attention(q, k[..., keys, :], v[..., keys, :], scale=SCALE, causal=causal)
        assert (out.float() - ref_out).abs().max() / ref_out.abs().max() < bound
        assert (lse.float() - ref_lse).abs().max() / ref_lse.abs().max() < bound
        part = Partial(ref_out, ref_lse)
        merged = part if merged is None else merge(merged, part)
    assert merged is not None
    out = merged.out.to(dtype)
    for keys, causal in blocks:
        args = (grad, q, k[..., keys, :], v[..., keys, :], out, merged.lse)
        ours = fused_backward(name, *args, causal=causal, scale=SCALE)
        reference = block_backward(*args, causal=causal, scale=SCALE)
        for a, b in zip(ours, reference, strict=True):
            assert (a.float() - b).abs().max() / b.abs().max() < bound
