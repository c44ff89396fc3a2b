"""FLOPs of a training step and the peak a device could deliver: what MFU divides.

* :func:`count_flops` runs a function under ``torch.utils.flop_counter.FlopCounterMode`` (with the CPU fused
  attention kernels added: torch counts only the GPU ones).
* :func:`peak_flops` looks the device up in a table of dense tensor-core peaks (NVIDIA data sheets, SXM parts;
  no sparsity) by the run's compute dtype, and on a CPU measures one matmul benchmark per process, once, so MFU
  is reported there too (as a fraction of what this process's matmuls reach, not of a data-sheet number).

Example:
    >>> peak_flops(torch.device("cuda"), "bf16-mixed")  # on an H100 SXM
    989000000000000.0
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

# Dense peak FLOP/s by GPU and compute dtype ("fp32" is plain FP32, "tf32" the tensor-core path).
GPU_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
}
_COMPUTE_DTYPE = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
_cpu_peak: float | None = None


def _cpu_sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of everything ``fn()`` runs (forward and, if it calls it, backward)."""
    with flop_counter() as counter:
        fn()
    return counter.get_total_flops()


def compute_dtype(precision: str) -> str:
    name = _COMPUTE_DTYPE.get(precision)
    if name is not None:
        return name
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def gpu_peak(device_name: str, dtype: str) -> float | None:
    """The table's peak for a device name such as ``"NVIDIA H100 80GB HBM3"`` (None if not in the table)."""
    for gpu, peaks in GPU_PEAKS.items():  # "H100 PCIe" is listed before "H100"
        if all(word in device_name for word in gpu.split()):
            return peaks.get(dtype)
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), compute_dtype(precision))
    return cpu_matmul_peak()


def cpu_matmul_peak(size: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of fp32 ``size``-square matmuls on this process's threads, measured once per process."""
    global _cpu_peak
    if _cpu_peak is None:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up: thread pool and caches
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            a @ b
            runs += 1
        _cpu_peak = 2 * size**3 * runs / elapsed
    return _cpu_peak
