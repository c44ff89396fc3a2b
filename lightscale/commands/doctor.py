"""``lightscale doctor``: is every rank there, does every collective work, how fast, and with which settings.

Run it where training would run: ``lightscale doctor --devices 2`` starts local ranks itself; under ``torchrun`` or
a scheduler each launched process is one rank. Ranks first check in through the key-value store with a deadline,
so a missing rank is named within ``--timeout`` seconds instead of a collective hanging; then each collective runs
on a buffer of ``--size`` bytes and reports bus bandwidth the way nccl-tests does (the bytes each rank's link
carries, comparable across world sizes).

Example:
    $ lightscale doctor --devices 2 --size 4MiB
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightscale.errors import ConfigurationError
from lightscale.runtime.collectives import all_gather_single, reduce_scatter_single
from lightscale.testing import free_port

ENV_THAT_MATTERS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class CollectiveResult:
    name: str
    bytes: int  # per rank, as handed to the collective
    seconds: float  # median over the timed iterations
    bus_gbps: float  # nccl-tests' bus bandwidth, GB/s


def parse_size(text: str) -> int:
    """``"4MiB"`` -> 4194304; plain integers are bytes."""
    number = text.rstrip("KMGiB")
    unit = text[len(number) :]
    if not number.isdigit() or unit not in _UNITS:
        raise ConfigurationError(f"--size {text!r} is not a size; write e.g. 1048576, 512KiB, 4MiB or 1GiB.")
    return int(number) * _UNITS[unit]


def check_in(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank announces itself; raises naming the missing ranks if not all arrive within ``timeout_s``.

    Rank 0 hosts the store and decides; it publishes its verdict and waits for the others to read it before it ends
    (its store ends with it).
    """
    store.set(f"doctor/rank_{rank}", "here")
    deadline = time.monotonic() + timeout_s
    while True:
        present = [r for r in range(world_size) if store.check([f"doctor/rank_{r}"])]
        if len(present) == world_size:
            return
        if rank != 0 and store.check(["doctor/verdict"]):
            store.add("doctor/read", 1)
            raise RuntimeError(store.get("doctor/verdict").decode())
        if rank == 0 and time.monotonic() > deadline:
            verdict = _missing_ranks_message(present, world_size, timeout_s)
            store.set("doctor/verdict", verdict)
            while store.add("doctor/read", 0) < len(present) - 1 and time.monotonic() < deadline + 5:
                time.sleep(0.05)
            raise RuntimeError(verdict)
        time.sleep(0.05)


def _missing_ranks_message(present: list[int], world_size: int, timeout_s: float) -> str:
    missing = sorted(set(range(world_size)) - set(present))
    address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return (
        f"lightscale doctor: only {len(present)} of {world_size} ranks checked in within {timeout_s:.0f} s; missing "
        f"rank(s) {missing}. Check that every node launched its processes and can reach {address}."
    )


def _bus_factor(name: str, world: int) -> float:
    if name == "all_reduce":
        return 2 * (world - 1) / world
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    return 1.0  # send/recv: every byte crosses one link


def _collectives(numel: int, world: int, device: torch.device) -> dict[str, Callable[[], None]]:
    rank = dist.get_rank()
    full, received = torch.ones(numel, device=device), torch.empty(numel, device=device)
    piece = torch.ones(numel // world, device=device)

    def send_recv() -> None:  # a ring; even ranks post their send first so no pair waits on each other
        ops = [dist.P2POp(dist.isend, full, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops if rank % 2 == 0 else ops[::-1]):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: all_gather_single(received, piece),
        "reduce_scatter": lambda: reduce_scatter_single(piece, full),
        "all_to_all": lambda: dist.all_to_all_single(received, full),
        "send_recv": send_recv,
    }


def measure_collectives(size_bytes: int, *, iterations: int = 5) -> list[CollectiveResult]:
    """Time each collective on this process group (every rank calls it); median of ``iterations`` after a warm-up."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    numel = max(world, size_bytes // 4 // world * world)  # fp32, divisible by the world size
    results = []
    for name, run in _collectives(numel, world, device).items():
        run()  # warm-up: connections and buffers
        times = []
        for _ in range(iterations):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        nbytes = numel * 4
        results.append(CollectiveResult(name, nbytes, seconds, nbytes * _bus_factor(name, world) / seconds / 1e9))
    return results


def report(results: list[CollectiveResult], world: int, backend: str) -> str:
    lines = [f"lightscale doctor: {world} ranks, backend {backend}, torch {torch.__version__}"]
    lines += [f"  {name}={os.environ[name]}" for name in ENV_THAT_MATTERS if name in os.environ]
    lines.append(f"  {'collective':<15}{'bytes/rank':>14}{'time (ms)':>12}{'bus GB/s':>10}")
    for result in results:
        lines.append(f"  {result.name:<15}{result.bytes:>14,}{result.seconds * 1e3:>12.3f}{result.bus_gbps:>10.3f}")
    return "\n".join(lines)


def run_rank(size_bytes: int, timeout_s: float, backend: str) -> str:
    """One rank of the check, in a process whose environment names its rank (torchrun, a scheduler, --devices)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    check_in(store, rank, world, timeout_s)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, store=dist.PrefixStore("doctor", store), rank=rank, world_size=world, timeout=timeout
    )
    try:
        return report(measure_collectives(size_bytes), world, backend)
    finally:
        dist.destroy_process_group()


def start_local_ranks(devices: int, argv: list[str]) -> int:
    """Run this command on ``devices`` local processes, one rank each; the worst exit code."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(devices)}
    command = [sys.executable, "-m", "lightscale.cli", "doctor", *argv]
    ranks = [
        subprocess.Popen(command, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(devices)
    ]
    return max(rank.wait() for rank in ranks)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightscale doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="local ranks to start (ignored when launched)")
    parser.add_argument("--size", default="4MiB", help="bytes per rank per collective (default 4MiB)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for every rank to check in")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ConfigurationError(f"--backend {backend!r} is not one of gloo, nccl.")
    if args.devices < 1:
        raise ConfigurationError(f"--devices {args.devices} must be at least 1.")
    if "RANK" not in os.environ:  # not launched: start the ranks here
        raise SystemExit(start_local_ranks(args.devices, argv))
    try:
        text = run_rank(size, args.timeout, backend)
    except RuntimeError as error:  # a missing rank, a failed collective: one clear line per rank, no traceback
        raise SystemExit(f"rank {os.environ['RANK']}: {error}") from None
    if int(os.environ["RANK"]) == 0:
        print(text)
