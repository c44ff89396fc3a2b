"""``make bench``: every benchmark, one after another, each printing its side-by-side ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = [
    "bench_ddp.py",
    "bench_powersgd.py",
    "bench_zero.py",
    "bench_cpu_adam.py",
    "bench_fsdp2.py",
    "bench_muon.py",
    "bench_3d.py",
    "bench_moe.py",
    "bench_experts.py",
    "context_parallel.py",
    "bench_clip.py",
    "bench_memory.py",
    "bench_async_save.py",
    "s3_save.py",
    "bench_diloco.py",
    "bench_slow_link.py",
    "bench_ft_step.py",
    "bench_consolidate.py",
]


def main() -> int:
    here = Path(__file__).parent
    failed = [name for name in BENCHMARKS if subprocess.call([sys.executable, str(here / name)]) != 0]
    if failed:
        print(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
