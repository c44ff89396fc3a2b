"""The estimator's numbers as text: sizes parsed and printed, and the table ``lightscale estimate`` shows.

Example:
    >>> human(parse_bytes("80GiB"))
    '80.00 GiB'
"""

from __future__ import annotations

import argparse
import re

from lightscale.estimate.core import CATEGORIES, MemoryEstimate

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_bytes(text: str) -> float:
    """``"80GiB"`` -> 85899345920; decimal (GB) and binary (GiB) units, case-insensitive."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 80GiB, 40GB or 512MiB")
    return float(match.group(1)) * _UNITS[match.group(2).upper()]


def human(nbytes: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_estimate(est: MemoryEstimate, *, device_memory: float | None = None) -> str:
    lines = [
        f"lightscale estimate: {est.strategy} on {est.world_size} rank(s), precision {est.precision}, "
        f"micro-batch {est.micro_batch}, activation checkpointing {est.activation_checkpointing}",
        f"  model: {est.num_params:,} parameters; the most loaded rank holds {est.rank_params:,} before sharding",
        f"  activations: {est.activation_source}",
        f"  {'per rank':<12} {'device':>12} {'host':>12}",
    ]
    for category in CATEGORIES:
        placed = getattr(est, category)
        lines.append(f"  {category:<12} {human(placed.device):>12} {human(placed.host):>12}")
    lines.append(f"  {'total':<12} {human(est.device_total):>12} {human(est.host_total):>12}")
    if device_memory is not None:
        verdict = "fits" if est.device_total <= device_memory else "does NOT fit"
        lines.append(f"  {verdict} in {human(device_memory)} of device memory")
    return "\n".join(lines)
