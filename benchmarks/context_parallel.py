"""Context parallelism: (1) ring, allgather and ulysses attention against one process's fused attention, zigzag load
balance, peak memory; (2) cp2 in Lightning's loop vs a hand-written loop over the same attention function.

(1) One causal attention layer ``(1, 8, T, 64)``, fp32, forward and backward, at T = 4096 and 16384, on 2 forked gloo
ranks, every candidate interleaved ABBA in one run, the first round dropped, medians: "one process" is rank 0 alone
running torch's fused ``F.scaled_dot_product_attention`` over the whole sequence (rank 1 waits); each cp mode is
timed on both ranks (the slower one counts). The ratio printed is cp2 time per rank ÷ (one process ÷ 2): 1.0 is a
perfect split with free communication. Wall time waits for cores other jobs hold; CPU time of each rank's main
thread is printed beside it. Load balance: each rank's CPU time inside the block kernels (forward and backward),
max / min, zigzag and contiguous layouts. Peak memory: the rise of each process's resident set (``VmHWM`` after
resetting it) over one forward and backward including its inputs, ring per rank ÷ one process, at 16384 tokens, in
processes that run nothing else.

(2) The GPT recipe under ``Parallel3DStrategy(cp=2)`` (Lightning's loop: the batch cut along the sequence, SDPA
routed, FSDP2 over the 2 ranks, AdamW) vs a hand-written loop doing the same work: the same mesh and
``parallelize_model`` (FSDP2), ``shard_sequence`` on tokens and targets, forward under ``ContextParallelAttention``,
backward, AdamW step. Interleaved ABBA, medians of step times after warm-up; the losses show both did the same work.

    python benchmarks/context_parallel.py [--seqs 4096 16384] [--heads 8] [--repeats 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import lightning.pytorch as pl
from common import LossStepTimer, interleaved, median, timed_trainer

from lightscale.parallel.context_parallel import ContextParallelAttention, blocks, shard_sequence
from lightscale.parallel.contract import sharding_units
from lightscale.parallel.parallelize import ParallelizeOptions, parallelize_model
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import ByteTokenizer, default_cache_dir, tokenize_to_memmap
from lightscale.strategies import Parallel3DStrategy, ParallelDims
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=1024, n_layer=2, n_head=4, n_embd=128)
BATCH, WARMUP = 2, 2
ONE = "one process"
MODES = ["ring/zigzag", "allgather/zigzag", "ulysses/zigzag"]
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
SPENT = [0.0]  # CPU seconds inside the block kernels on this rank
_forward, _backward = blocks.block_forward, blocks.block_backward


def _timed(kernel: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        # CPU time of this thread (one OpenMP thread): not inflated when other processes hold the cores.
        start = time.thread_time()
        out = kernel(*args, **kwargs)
        SPENT[0] += time.thread_time() - start
        return out

    return timed


def _step(q: torch.Tensor, name: str) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, kernel CPU seconds) of one forward and backward on this rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    if name == ONE:
        tensors = [q.clone().requires_grad_() for _ in range(3)] if rank == 0 else []
    else:
        layout = name.split("/")[1]
        tensors = [shard_sequence(q, cp, rank, dim=2, layout=layout).requires_grad_() for _ in range(3)]
    dist.barrier()
    SPENT[0] = 0.0
    start, cpu = time.perf_counter(), time.thread_time()
    if name != ONE:
        mode, layout = name.split("/")
        with ContextParallelAttention(mode=mode, layout=layout):  # type: ignore[arg-type]
            F.scaled_dot_product_attention(*tensors, is_causal=True).sum().backward()
    elif tensors:
        F.scaled_dot_product_attention(*tensors, is_causal=True).sum().backward()
    result = time.perf_counter() - start, time.thread_time() - cpu, SPENT[0]
    dist.barrier()  # rank 1 idles while rank 0 runs the one-process reference
    return result


def _run(shape: tuple[int, ...], names: list[str], repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    blocks.block_forward, blocks.block_backward = _timed(_forward), _timed(_backward)  # looked up at call time
    torch.manual_seed(0)
    q = torch.randn(shape)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for i, name in enumerate(interleaved(names, repeats + 1)):
        result = _step(q, name)
        if i >= len(names):  # the first round warms up
            times[name].append(result)
    return times


def _status(field: str) -> int:
    """A ``VmRSS`` / ``VmHWM`` line of /proc/self/status, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def _peak_memory(shape: tuple[int, ...], mode: str | None) -> int:
    """Bytes the resident set rose by over one forward and backward, inputs included (``mode`` None: rank 0 runs
    the whole sequence alone)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    if mode is None and rank > 0:
        return 0
    # A fixed mmap threshold: every large tensor is its own mapping, returned when freed, so the resident set follows
    # the live tensors (glibc's adaptive threshold would keep freed 16 MiB blocks in the heap and count them).
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 16)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 16)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = _status("VmRSS")
    local = shape if mode is None else (*shape[:2], shape[2] // cp, shape[3])
    tensors = [torch.randn(local).requires_grad_() for _ in range(3)]
    if mode is None:
        F.scaled_dot_product_attention(*tensors, is_causal=True).sum().backward()
    else:
        with ContextParallelAttention(mode=mode):  # type: ignore[arg-type]
            F.scaled_dot_product_attention(*tensors, is_causal=True).sum().backward()
    return _status("VmHWM") - before


def _attention(seq: int, heads: int, repeats: int) -> None:
    shape = (1, heads, seq, 64)
    names = [ONE, *MODES] + (["ring/contiguous"] if seq <= 4096 else [])
    ranks = run_distributed(_run, shape, names, repeats, world_size=2, timeout_s=3600, collective_timeout_s=1200)
    wall, cpu = ({name: _slowest(ranks, name, i) for name in names} for i in (0, 1))
    print(f"causal attention {shape}, fp32, fwd+bwd, cp=2 (2 gloo ranks) vs one process; medians of {repeats}")
    print(f"  {ONE:<17} wall {wall[ONE] * 1e3:8.1f} ms, CPU {cpu[ONE] * 1e3:8.1f} ms (the whole sequence)")
    for name in names[1:]:
        print(
            f"  {name:<17} wall {wall[name] * 1e3:8.1f} ms, CPU {cpu[name] * 1e3:8.1f} ms per rank: "
            f"÷ (one process ÷ 2) = {2 * wall[name] / wall[ONE]:.2f} wall, {2 * cpu[name] / cpu[ONE]:.2f} CPU"
        )
    ring, ulysses = "ring/zigzag", "ulysses/zigzag"
    print(f"  ring ÷ ulysses: {wall[ring] / wall[ulysses]:.2f} wall, {cpu[ring] / cpu[ulysses]:.2f} CPU")
    for name in [n for n in names if n.startswith("ring/")]:
        compute = [median([t[2] for t in r[name]]) for r in ranks]
        shown = ", ".join(f"{c * 1e3:.1f}" for c in compute)
        print(f"  {name:<17} kernel CPU time per rank [{shown}] ms, max/min {max(compute) / min(compute):.2f}")


def _memory(seq: int, heads: int) -> None:
    shape = (1, heads, seq, 64)
    one = run_distributed(_peak_memory, shape, None, world_size=2, timeout_s=1800, collective_timeout_s=1200)[0]
    ring = max(run_distributed(_peak_memory, shape, "ring", world_size=2, timeout_s=1800, collective_timeout_s=1200))
    print(
        f"peak memory over one fwd+bwd, inputs included, {shape} fp32: one process {one / 2**20:.1f} MiB, "
        f"ring cp=2 per rank {ring / 2**20:.1f} MiB, ratio {ring / one:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-loop", action="store_true", help="only the attention figures")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores shared with other jobs)")
    _memory(max(args.seqs), args.heads)
    for seq in args.seqs:
        _attention(seq, args.heads, args.repeats)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if not args.skip_loop:
        _loop_ratio(args.steps, max(2, args.repeats // 2))


def _lightscale_cp(steps: int, cache_dir: str) -> tuple[float, list[float]]:
    pl.seed_everything(0, verbose=False)
    timer = LossStepTimer(WARMUP)
    trainer = timed_trainer(Parallel3DStrategy(cp=2), devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=BATCH, cache_dir=cache_dir, shuffle=False)
    trainer.fit(GPTModule(MODEL, warmup_steps=1), data)
    return median(timer.times), timer.losses


def _raw_cp(steps: int, cache_dir: str) -> tuple[float, list[float]]:
    """The same work by hand: FSDP2 over the cp ranks, the sequence cut zigzag, SDPA routed over the ring."""
    pl.seed_everything(0, verbose=False)
    cp, rank = dist.get_world_size(), dist.get_rank()
    module = GPTModule(MODEL, warmup_steps=1)
    module.configure_model()
    mesh = ParallelDims(world_size=cp, cp=cp).build_mesh("cpu")
    parallelize_model(module.model, mesh, units=sharding_units(module), options=ParallelizeOptions())
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=BATCH, cache_dir=cache_dir, shuffle=False)
    data.setup("fit")
    batches = iter(torch.utils.data.DataLoader(data.train_dataloader().dataset, batch_size=BATCH))
    attention = ContextParallelAttention(dist.group.WORLD, mode="ring")
    times, losses = [], []
    for _ in range(steps):
        tokens, targets = (shard_sequence(t, cp, rank) for t in next(batches))
        start = time.perf_counter()
        with attention:
            loss = GPTModule.loss_fn(module.model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return median(times[WARMUP:]), losses


def _loop_ratio(steps: int, repeats: int) -> None:
    cache = str(default_cache_dir())
    tokenize_to_memmap(None, default_cache_dir(), ByteTokenizer())
    times: dict[str, list[float]] = {"cp2": [], "hand_loop": []}
    losses: dict[str, list[float]] = {}
    for name in interleaved(list(times), repeats):
        fn = _lightscale_cp if name == "cp2" else _raw_cp
        step, losses[name] = run_distributed(fn, steps + WARMUP, cache, world_size=2, timeout_s=1800)[0]
        times[name].append(step)
    ours, raw = median(times["cp2"]), median(times["hand_loop"])
    print(
        f"GPT {MODEL.n_layer}x{MODEL.n_embd}, batch {BATCH}x{MODEL.block_size}, cp=2 ring, fp32, AdamW: cp2 in "
        f"Lightning's loop {ours * 1e3:.1f} ms/step, hand-written loop {raw * 1e3:.1f} ms/step, ratio {ours / raw:.3f}"
    )
    first = [round(losses[name][0], 4) for name in times]
    print(f"  first-step loss (rank 0's tokens) cp2 {first[0]}, hand loop {first[1]}: the same work")


def _slowest(ranks: list[dict[str, list[tuple[float, ...]]]], name: str, field: int) -> float:
    """Median over repeats of the slowest rank's value."""
    return median([max(r[name][i][field] for r in ranks) for i in range(len(ranks[0][name]))])


if __name__ == "__main__":
    main()
