"""``make gpu-check``: every GPU figure of lightscale in one call of at most 9 minutes, as one markdown report.

Each check runs its work in child processes, each with its own time limit, so a CUDA error, a hang or an OOM in one
is recorded as that check's failure (with the traceback tail) and the next check still runs. The report
(``$OUT/gpu_report.md`` when ``$OUT`` is set, else ``gpu_report.md``) lists the device, torch version, date, every
figure and every failure; the exit status is 0 even when checks fail. Without CUDA it prints the plan and exits 0.
docs/gpu.md says how to run it on the project's GPU machines and what each check measures.

Example:
    $ make gpu-check                   # on the GPU machine, with gpu_wheels/ carried along
    $ python benchmarks/gpu_check.py   # on a CPU machine: prints the plan
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_isolated import ROOT, isolated, run_killable, tail

__all__ = ["Check", "Result", "isolated", "report", "run_checks"]

TOTAL_S = 540.0  # the run tool allows 600 s a command; the wheel install takes the rest


# ---- results and the report (isolation: gpu_isolated.py) -------------------------------------------------------------
@dataclass
class Result:
    """One check's outcome: ``status`` is pass, fail or skip; ``rows`` its figures (one dict per measurement)."""

    name: str
    status: str
    seconds: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "what: traceback tail", one per failure


@dataclass
class Check:
    name: str
    measures: str
    budget_s: float
    run: Callable[[float], Result]  # gets its deadline (time.monotonic()), returns its result


def run_checks(
    checks: list[Check], *, total_s: float = TOTAL_S, after_each: Callable[[list[Result]], None] = lambda r: None
) -> list[Result]:
    """Each check within min(its budget, what is left of ``total_s``); one raising is a failure, the next runs.
    ``after_each`` gets the results so far (the report is rewritten after every check, so a killed run keeps it)."""
    end = time.monotonic() + total_s
    results = []
    for check in checks:
        start = time.monotonic()
        left = end - start
        if left < 5:
            results.append(Result(check.name, "skip", notes=["no time left in the 9-minute budget"]))
            continue
        print(f"[gpu-check] {check.name} (at most {min(check.budget_s, left):.0f} s)", flush=True)
        try:
            result = check.run(start + min(check.budget_s, left))
        except Exception:
            result = Result(check.name, "fail", errors=[f"{check.name}: {tail(traceback.format_exc())}"])
        result.seconds = time.monotonic() - start
        print(f"[gpu-check] {check.name}: {result.status} in {result.seconds:.0f} s", flush=True)
        results.append(result)
        after_each(results)
    return results


def table(rows: list[dict[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return lines


def _cell(value: Any) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def report(results: list[Result], header: dict[str, Any]) -> str:
    """The markdown report: header facts, a summary table, then each check's figures, notes and failures."""
    lines = ["# lightscale GPU check", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += ["", "## Summary", ""]
    lines += table([{"check": r.name, "status": r.status, "seconds": f"{r.seconds:.1f}"} for r in results])
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", ""]
        lines += [f"- {note}" for note in r.notes]
        if r.rows:
            lines += ["", *table(r.rows)] if r.notes else table(r.rows)
        for error in r.errors:
            what, _, trace = error.partition(": ")
            lines += ["", f"Failure in {what}:", "", "```", trace, "```"]
    return "\n".join(lines) + "\n"


def report_path() -> Path:
    return Path(os.environ["OUT"]) / "gpu_report.md" if os.environ.get("OUT") else Path("gpu_report.md")


# ---- the checks ----------------------------------------------------------------------------------------------------
from gpu_moe_float8 import EXPERTS  # noqa: E402
from gpu_workers import (  # noqa: E402 - the workers import torch; this file stays light for the plan and tests
    ESTIMATE_CONFIGS,
    MFU_RUNS,
)

W = "gpu_workers"


def check_environment(deadline: float) -> Result:
    found = isolated(f"{W}:environment", timeout=deadline - time.monotonic())
    if "error" in found:
        return Result("environment", "fail", errors=[f"environment: {found['error']}"])
    rows = [{"package": name, "version": version} for name, version in found["versions"].items()]
    notes = [f"unmet requirement: {line}" for line in found["unmet"]] + found.get("notes", [])
    return Result("environment", "fail" if found["unmet"] else "pass", rows=rows, notes=notes)


def check_deepspeed_ops(deadline: float) -> Result:
    found = isolated(f"{W}:build_deepspeed_ops", timeout=deadline - time.monotonic())
    if "error" in found:
        return Result("deepspeed_ops", "fail", errors=[f"deepspeed_ops: {found['error']}"])
    return Result("deepspeed_ops", "pass", notes=[f"built: {', '.join(found['value']) or 'none compatible'}"])


def check_strategies(deadline: float) -> Result:
    names = isolated(f"{W}:strategy_names", timeout=60)
    if "error" in names:
        return Result("strategies", "fail", errors=[f"strategy_names: {names['error']}"])
    result = Result("strategies", "pass")
    runnable = [name for name, reason in names["value"] if not reason]
    rows = {name: {"strategy": name, "status": "skip", "note": reason} for name, reason in names["value"] if reason}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # one small model each: 4 share the GPU easily
        futures = {
            name: pool.submit(lambda n: isolated(f"{W}:train_small", n, timeout=deadline - time.monotonic()), name)
            for name in runnable
        }
        for name, future in futures.items():
            found = future.result()
            if found.get("not_started"):
                rows[name] = {"strategy": name, "status": "skip", "note": "not started: no time left"}
                continue
            if "error" in found:
                rows[name] = {"strategy": name, "status": "fail", "note": found["error"].splitlines()[0]}
                result.errors.append(f"{name}: {found['error']}")
                continue
            losses = found["losses"]
            falls = len(losses) >= 2 and losses[-1] < losses[0]
            rows[name] = {
                "strategy": name,
                "status": "pass" if falls else "fail",
                "note": f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps, {found['seconds']:.1f} s",
            }
    result.rows = [rows[name] for name, _ in names["value"]]
    result.status = "fail" if any(row["status"] == "fail" for row in result.rows) else "pass"
    return result


def _rows_check(name: str, note: str, worker: str, runs: list[dict], deadline: float) -> Result:
    """One isolated worker call per run, a row each; a run that fails is an error of the check, the rest still run."""
    result = Result(name, "pass", notes=[note])
    for run in runs:
        found = isolated(f"{W}:{worker}", run, timeout=deadline - time.monotonic())
        if "error" in found:
            result.status = "fail"
            result.errors.append(f"{run['label']}: {found['error']}")
        else:
            result.rows.append(found)
    return result


def check_mfu(deadline: float) -> Result:
    note = "GPT-2 124M (vocab 50304, 1024 tokens), bf16-mixed, world size 1"
    return _rows_check("mfu", note, "measure_mfu", MFU_RUNS, deadline)


def check_grouped_gemm(deadline: float) -> Result:
    found = isolated("gpu_moe_float8:grouped_vs_loop", *EXPERTS.values(), timeout=deadline - time.monotonic())
    if "error" in found:
        return Result("grouped_gemm", "fail", errors=[f"grouped_vs_loop: {found['error']}"])
    return Result("grouped_gemm", "pass", rows=[found], notes=["MoE experts' FFN, fwd + bwd, uneven groups (top 2)"])


def check_float8(deadline: float) -> Result:
    found = isolated("gpu_moe_float8:float8_vs_bf16", timeout=deadline - time.monotonic())
    if "error" in found:
        return Result("float8", "fail", errors=[f"float8_vs_bf16: {found['error']}"])
    return Result("float8", "pass", rows=found["rows"], notes=found["notes"])


def check_estimate(deadline: float) -> Result:
    note = "measured: torch.cuda.max_memory_allocated over 3 training steps"
    return _rows_check("estimate", note, "estimate_vs_measured", ESTIMATE_CONFIGS, deadline)


def check_offload(deadline: float) -> Result:
    seconds = deadline - time.monotonic()
    found = isolated(f"{W}:offload_ratio", seconds - 10, timeout=seconds)
    if "error" in found:
        return Result("offload", "fail", errors=[f"offload_ratio: {found['error']}"])
    return Result("offload", "pass" if found["ratio"] else "fail", rows=found["rows"], notes=found["notes"])


def check_memory_profiler(deadline: float) -> Result:
    found = isolated(f"{W}:memory_profiler_cuda", timeout=(deadline - time.monotonic()) / 2)
    result = Result("memory_profiler", "pass")
    if "error" in found:
        result.status = "fail"
        result.errors.append(f"MemoryProfiler: {found['error']}")
    else:
        result.rows, result.notes = found["rows"], found["notes"]
    left = deadline - time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")]
    try:
        returncode, stdout, stderr = run_killable(command, timeout=left, cwd=ROOT)
        result.notes.append(f"pytest tests/gpu: {tail(stdout, 1)}")
        if returncode != 0:
            result.status = "fail"
            result.errors.append(f"pytest tests/gpu: {tail(stdout + stderr, 30)}")
    except subprocess.TimeoutExpired:
        result.status = "fail"
        result.errors.append(f"pytest tests/gpu: timed out after {left:.0f} s")
    return result


def check_cp_kernels(deadline: float) -> Result:
    found = isolated("gpu_cp_kernels:cp_block_kernels", timeout=deadline - time.monotonic())
    if "error" in found:
        return Result("cp_kernels", "fail", errors=[f"cp_block_kernels: {found['error']}"])
    return Result("cp_kernels", "pass", rows=found["rows"], notes=found["notes"])


CHECKS = [  # most valuable first (/work/shared/GPU.md): a later check gets what is left of the 9 minutes
    Check("environment", "package versions; requirements the machine does not meet", 20, check_environment),
    Check("deepspeed_ops", "JIT-build DeepSpeed's CPU Adam once, before any offload run", 90, check_deepspeed_ops),
    Check("strategies", "each name at world size 1: small GPT, 20 steps, bf16, loss falls", 110, check_strategies),
    Check(
        "memory_profiler",
        "MemoryProfiler on CUDA (peak, snapshot, OOM report); pytest tests/gpu",
        70,
        check_memory_profiler,
    ),
    Check("mfu", "GPT-2 124M tokens/s and MFU: fsdp2 + per-block compile, bucketed_ddp", 110, check_mfu),
    Check(
        "grouped_gemm",
        "MoE experts' FFN at 64 experts: grouped GEMM ÷ the per-expert loop, bf16",
        30,
        check_grouped_gemm,
    ),
    Check("cp_kernels", "a CP block fwd+bwd by each fused CUDA op ÷ SDPA over the block", 30, check_cp_kernels),
    Check("float8", "GPT-2 124M tokens/s, float8 ÷ bf16-mixed, fsdp2 + per-block compile", 100, check_float8),
    Check("offload", "largest GPT under zero3_offload / under zero3 (time-bounded search)", 80, check_offload),
    Check("estimate", "lightscale.estimate vs torch.cuda.max_memory_allocated, 5 configurations", 60, check_estimate),
]


def plan() -> str:
    lines = [f"lightscale gpu-check plan (at most {TOTAL_S:.0f} s; each check isolated in child processes):"]
    lines += [f"  {c.name:<16} <= {c.budget_s:>3.0f} s  {c.measures}" for c in CHECKS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", help="where `make gpu-check` installed the wheels (its installed.json is reported)")
    args = parser.parse_args(argv)
    import torch

    print(plan(), flush=True)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing run (see docs/gpu.md for the GPU machine)")
        return 0
    header = {
        "device": torch.cuda.get_device_name(0),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "python": sys.version.split()[0],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if args.site and (Path(args.site) / "installed.json").exists():
        installed = json.loads((Path(args.site) / "installed.json").read_text())
        header["wheels installed"] = ", ".join(n.split("-")[0] for n, w in installed.items() if w.startswith("install"))
    os.environ.setdefault("LIGHTSCALE_CACHE", str(Path(tempfile.gettempdir()) / "lightscale_gpu_check_cache"))
    path = report_path()
    run_checks(CHECKS, after_each=lambda results: path.write_text(report(results, header)))
    print(f"[gpu-check] report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
