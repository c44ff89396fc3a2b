"""DeepSpeed's CPU Adam vs torch's fused AdamW on the CPU: optimizer steps per second for a ~10M-param GPT.

The offloading ZeRO strategies (zero2_offload, zero3_offload, zero_infinity) step AdamW on the host as
DeepSpeed's CPU Adam (``cpu_adam_from``); this checks that it is the faster host optimizer. The parameters are
shaped like the small GPT's (a few dozen fp32 tensors), gradients are random and fixed, and every candidate
starts from the same values, so after the run their parameters must agree (printed as a check). Candidates
run interleaved ABBA, several repeats, warm-up steps dropped; the ratio is of median step times.

    python benchmarks/bench_cpu_adam.py [--repeats 4] [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# DeepSpeed JIT-builds CPU Adam once per virtual environment; reuse that build (as ZeroStrategy does).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, median

from lightscale.recipes.gpt import GPT, GPTConfig

SMALL = GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=384)  # the recipe's small GPT, ~10.8M params
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
WARMUP = 2


def gpt_shaped_params(seed: int = 0) -> list[torch.Tensor]:
    """Fresh fp32 tensors with the small GPT's parameter shapes, each with a fixed random gradient."""
    with torch.device("meta"):
        shapes = [p.shape for p in GPT(SMALL).parameters()]
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = torch.randn(shape, generator=generator).mul_(0.02).requires_grad_()
        param.grad = torch.randn(shape, generator=generator)
        params.append(param)
    return params


def optimizers(params: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    """One optimizer per candidate, each on its own copy of ``params`` (same values, same gradients)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def copy() -> list[torch.Tensor]:
        clones = [p.detach().clone().requires_grad_() for p in params]
        for clone, param in zip(clones, params, strict=True):
            clone.grad = param.grad.clone()
        return clones

    return {
        "cpu_adam": DeepSpeedCPUAdam(copy(), adamw_mode=True, **HYPER),
        "fused": torch.optim.AdamW(copy(), fused=True, **HYPER),
        "foreach": torch.optim.AdamW(copy(), foreach=True, **HYPER),
    }


def time_steps(step: Callable[[], object], steps: int) -> list[float]:
    times = []
    for i in range(WARMUP + steps):
        start = time.perf_counter()
        step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def max_gap(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> float:
    pairs = zip(a.param_groups[0]["params"], b.param_groups[0]["params"], strict=True)
    return max((x - y).abs().max().item() for x, y in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = gpt_shaped_params()
    candidates = optimizers(params)
    print(
        f"bench_cpu_adam: {sum(p.numel() for p in params):,} fp32 params in {len(params)} tensors (small GPT "
        f"shapes), torch.set_num_threads({args.threads}) (CPU Adam links torch's libgomp: same OpenMP pool)"
    )
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for name in interleaved(list(candidates), args.repeats):
        times[name].extend(time_steps(candidates[name].step, args.steps))
    rate = {name: 1.0 / median(values) for name, values in times.items()}
    for name, label in (("cpu_adam", "DeepSpeedCPUAdam(adamw_mode=True)"), ("fused", "AdamW(fused=True)")):
        print(f"  {label}: {rate[name]:.1f} steps/s ({median(times[name]) * 1e3:.1f} ms/step)")
    print(f"  AdamW(foreach=True), for reference: {rate['foreach']:.1f} steps/s")
    ratio = rate["cpu_adam"] / rate["fused"]
    print(f"  steps/s CPU-Adam / fused AdamW = {ratio:.3f} ({len(times['fused'])} steps each, medians)")
    winner = "DeepSpeed's CPU Adam (as now)" if ratio >= 1.0 else "torch's fused AdamW"
    print(f"  the zero offload strategies should step with {winner}")
    gaps = {name: max_gap(candidates[name], candidates["fused"]) for name in ("cpu_adam", "foreach")}
    print(f"  same update: max |param - fused's| cpu_adam {gaps['cpu_adam']:.1e}, foreach {gaps['foreach']:.1e}")


if __name__ == "__main__":
    main()
