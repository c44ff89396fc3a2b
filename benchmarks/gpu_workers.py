"""The work of ``make gpu-check``'s checks, one function per child process (benchmarks/gpu_check.py runs them).

Every function takes and returns JSON-able values; torch and lightscale are imported inside them, so importing
this module (for the plan, or the CPU tests) costs nothing. ``LIGHTSCALE_GPU_CHECK_ACCELERATOR=cpu`` runs the
training functions on a CPU, to catch mistakes before a GPU machine's scarce minutes are spent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

SMALL = {"block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384}  # gpt/small_*.yaml, ~10.8M parameters
GPT2 = {"vocab_size": 50304, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}  # 124M
MFU_RUNS = [
    {"label": "fsdp2 + per-block compile", "strategy": "fsdp2", "compile": True, "micro_batch": 16},
    {"label": "bucketed_ddp", "strategy": "bucketed_ddp", "compile": False, "micro_batch": 16},
]
ESTIMATE_CONFIGS = [
    {"label": "bucketed_ddp 124M bf16 b8", "strategy": "bucketed_ddp", "precision": "bf16-mixed", "micro_batch": 8},
    {"label": "fsdp2 124M bf16 b8", "strategy": "fsdp2", "precision": "bf16-mixed", "micro_batch": 8},
    {"label": "zero2 124M bf16 b8", "strategy": "zero2", "precision": "bf16-mixed", "micro_batch": 8},
    {"label": "zero3 124M bf16 b8", "strategy": "zero3", "precision": "bf16-mixed", "micro_batch": 8},
    {"label": "bucketed_ddp 124M fp32 b4", "strategy": "bucketed_ddp", "precision": "32-true", "micro_batch": 4},
]
# The offload search: a wide GPT whose depth doubles; 2048 wide, 512 tokens: ~50M parameters a layer.
WIDE = {"vocab_size": 50304, "block_size": 512, "n_head": 16, "n_embd": 2048}
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
PACKAGES = (
    "torch",
    "lightning",
    "deepspeed",
    "jsonargparse",
    "lightscale",
    "numpy",
    "pydantic",
    "tensorboard",
    "matplotlib",
    "pytest",
    "transformers",
    "timm",
    "scikit-learn",
)


def accelerator() -> str:
    return os.environ.get("LIGHTSCALE_GPU_CHECK_ACCELERATOR", "gpu")


# ---- environment ---------------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Versions of the packages that matter, and every requirement of lightscale, DeepSpeed and jsonargparse that
    the installed versions do not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    versions = {name: version(name) or "absent" for name in PACKAGES}
    unmet = []
    for owner, extras in (("lightscale", {"deepspeed"}), ("deepspeed", set()), ("jsonargparse", {"signatures"})):
        for line in (metadata.requires(owner) or []) if version(owner) else [f"{owner}"]:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            have = version(req.name)
            if have is None or Version(have) not in req.specifier:
                unmet.append(f"{owner} needs {req}, found {have or 'nothing'}")
    notes = [f"nvcc: {shutil.which('nvcc') or 'not on PATH'} (DeepSpeed's CUDA ops need it; CPU Adam does not)"]
    notes.append(f"TORCH_EXTENSIONS_DIR: {os.environ.get('TORCH_EXTENSIONS_DIR', 'unset')}")
    return {"versions": versions, "unmet": unmet, "notes": notes}


def build_deepspeed_ops() -> list[str]:
    from lightscale.strategies.deepspeed.ops import build_cpu_ops

    return build_cpu_ops()


# ---- training helpers ----------------------------------------------------------------------------------------------
def _trainer(strategy: Any, *, steps: int, precision: str = "bf16-mixed", callbacks: list[Any] = (), **kw: Any) -> Any:
    import lightscale

    return lightscale.Trainer(
        strategy=strategy,
        accelerator=accelerator(),
        devices=1,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **kw,
    )


def _gpt(config: dict[str, Any], **kw: Any) -> Any:
    from lightscale.recipes.gpt import GPTConfig, GPTModule

    return GPTModule(GPTConfig(**config), learning_rate=kw.pop("learning_rate", 1e-3), warmup_steps=2, **kw)


def _random_tokens(config: dict[str, Any], micro_batch: int, steps: int) -> Any:
    """A loader of random tokens (MFU and memory do not depend on the text; this needs no corpus)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = torch.randint(0, config["vocab_size"], (micro_batch * steps, config["block_size"] + 1))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=micro_batch)


class _Record:
    """Losses of every step and the synchronized wall time of the steps after ``warmup``."""

    def __new__(cls, warmup: int) -> Any:
        import torch
        from lightning.pytorch import Callback

        class Record(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []
                self.start = self.end = 0.0
                self.timed = 0

            def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
                if batch_idx == warmup:
                    _sync(torch)
                    self.start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
                self.losses.append(float(outputs["loss"]))
                if batch_idx >= warmup:
                    _sync(torch)
                    self.end, self.timed = time.perf_counter(), batch_idx - warmup + 1

        return Record()


def _sync(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- (a) every strategy name -----------------------------------------------------------------------------------------
def strategy_names() -> list[tuple[str, str]]:
    """(name, why it is skipped or ""); also tokenizes the corpus once, before the parallel runs read it."""
    from lightning.pytorch.strategies import StrategyRegistry

    import lightscale
    from lightscale.recipes.gpt.data import ByteTokenizer, default_cache_dir, tokenize_to_memmap

    tokenize_to_memmap(None, default_cache_dir(), ByteTokenizer())
    names = []
    for name, _ in lightscale.strategy_table():
        try:
            strategy = StrategyRegistry.get(name)
        except Exception:  # construction errors (no DeepSpeed) show when it trains
            names.append((name, ""))
            continue
        try:
            strategy.parallel_dims(1)
            names.append((name, ""))
        except Exception as error:
            names.append((name, f"needs more than 1 rank ({type(error).__name__} at world size 1)"))
    return names


def train_small(name: str, steps: int = 20) -> dict[str, Any]:
    from lightscale.recipes.gpt import GPTDataModule

    record = _Record(warmup=0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(name, steps=steps, callbacks=[record], default_root_dir=tmp)
        trainer.fit(_gpt(SMALL), datamodule=GPTDataModule(block_size=SMALL["block_size"], batch_size=8))
    return {"losses": record.losses, "seconds": time.perf_counter() - start}


# ---- (b) MFU --------------------------------------------------------------------------------------------------------
def measure_mfu(run: dict[str, Any], steps: int = 30, warmup: int = 10) -> dict[str, Any]:
    import torch
    from lightning.pytorch.strategies import StrategyRegistry

    from lightscale.callbacks.flops import gpu_peak

    entry = StrategyRegistry[run["strategy"]]  # the registered class and arguments, plus per-block compile
    strategy = entry["strategy"](**{**entry["init_params"], **({"compile": True} if run["compile"] else {})})
    module = _gpt(GPT2, learning_rate=6e-4)
    record = _Record(warmup=warmup)
    start = time.perf_counter()
    _trainer(strategy, steps=steps, callbacks=[record]).fit(module, _random_tokens(GPT2, run["micro_batch"], steps))
    tokens = run["micro_batch"] * GPT2["block_size"] * record.timed
    seconds = record.end - record.start
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = gpu_peak(device, "bf16")
    flops = module.flops_per_token * tokens / seconds
    return {
        "run": run["label"],
        "micro_batch": run["micro_batch"],
        "tokens/s": round(tokens / seconds),
        "TFLOP/s": round(flops / 1e12, 1),
        "MFU": f"{flops / peak:.1%}" if peak else f"no peak known for {device}",
        "step ms": round(1000 * seconds / max(record.timed, 1), 1),
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0,
        "total s (incl. compile)": round(time.perf_counter() - start, 1),
    }


# ---- (c) estimate vs measured -------------------------------------------------------------------------------------
def estimate_vs_measured(config: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    import torch

    from lightscale.estimate import estimate_memory

    estimate = estimate_memory(
        _gpt(GPT2), config["strategy"], world_size=1, precision=config["precision"], micro_batch=config["micro_batch"]
    )
    trainer = _trainer(config["strategy"], steps=steps, precision=config["precision"])
    trainer.fit(_gpt(GPT2), _random_tokens(GPT2, config["micro_batch"], steps))
    measured = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else float("nan")
    return {
        "config": config["label"],
        "estimate GiB": round(estimate.device_total / 2**30, 2),
        "measured GiB": round(measured / 2**30, 2),
        "measured / estimate": round(measured / estimate.device_total, 3),
        "estimate params/grads/optim/act GiB": "/".join(
            f"{getattr(estimate, c).device / 2**30:.2f}"
            for c in ("parameters", "gradients", "optimizer", "activations")
        ),
    }


# ---- (d) offload -----------------------------------------------------------------------------------------------------
def fits(strategy: str, n_layer: int, steps: int = 2) -> dict[str, Any]:
    """Whether a WIDE GPT of ``n_layer`` layers trains ``steps`` steps (micro-batch 1) under ``strategy``."""
    import torch

    config = {**WIDE, "n_layer": n_layer}
    start = time.perf_counter()
    try:
        _trainer(strategy, steps=steps).fit(_gpt(config, learning_rate=1e-4), _random_tokens(config, 1, steps))
    except torch.OutOfMemoryError as error:
        return {"fits": False, "why": str(error).splitlines()[0][:120], "seconds": time.perf_counter() - start}
    return {"fits": True, "why": "", "seconds": time.perf_counter() - start}


def predicted_layers(strategy: str, *, device_bytes: float, host_bytes: float) -> int:
    """The deepest WIDE GPT whose estimate fits 90% of the device (and 70% of host memory)."""
    from lightscale.estimate import estimate_memory

    def ok(n_layer: int) -> bool:
        est = estimate_memory(_gpt({**WIDE, "n_layer": n_layer}), strategy, world_size=1, precision="bf16-mixed")
        return est.device_total <= 0.9 * device_bytes and est.host_total <= 0.7 * host_bytes

    n = 1
    while n < 4096 and ok(2 * n):
        n *= 2
    return n


def offload_ratio(seconds: float) -> dict[str, Any]:
    """Largest zero3_offload GPT / largest zero3 GPT (parameters): start at the estimate's prediction, then double
    while it trains (or halve while it does not), each probe in its own child process, within ``seconds``."""
    import torch
    from gpu_isolated import isolated

    from lightscale.recipes.gpt.model import GPT, GPTConfig

    end = time.monotonic() + seconds
    device = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 8 * 2**30
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    rows, largest, notes = [], {}, []
    for strategy in ("zero3", "zero3_offload"):
        n = predicted_layers(strategy, device_bytes=device, host_bytes=host)
        tried: dict[int, bool] = {}
        share = (end - time.monotonic()) / (2 if strategy == "zero3" else 1)
        stop = time.monotonic() + share
        while n not in tried and 1 <= n <= 4096 and stop - time.monotonic() > 10:
            found = isolated("gpu_workers:fits", strategy, n, timeout=stop - time.monotonic())
            tried[n] = bool(found.get("fits"))
            why = "" if tried[n] else (found.get("why") or found.get("error") or "?").splitlines()[0][:120]
            rows.append(
                {
                    "strategy": strategy,
                    "n_layer": n,
                    "params": _params(GPT, GPTConfig, n),
                    "fits": tried[n],
                    "note": why or f"{found.get('seconds', 0):.0f} s",
                }
            )
            n = n * 2 if tried[n] else n // 2
        passed = [k for k, v in tried.items() if v]
        largest[strategy] = max(passed) if passed else 0
        if passed and not any(k > max(passed) and not v for k, v in tried.items()):
            notes.append(f"{strategy}: time ran out before a depth failed; {max(passed)} layers is a lower bound")
    ratio = largest["zero3_offload"] / largest["zero3"] if largest.get("zero3") else None
    notes.insert(
        0,
        f"WIDE GPT (2048 wide, 16 heads, 512 tokens, micro-batch 1, bf16-mixed): ratio of parameters "
        f"= {ratio if ratio is None else round(ratio, 2)}",
    )
    return {"rows": rows, "notes": notes, "ratio": ratio}


def _params(gpt: Any, config: Any, n_layer: int) -> str:
    import torch

    with torch.device("meta"):
        return f"{gpt(config(**{**WIDE, 'n_layer': n_layer})).num_params() / 1e9:.2f}B"


# ---- (e) MemoryProfiler on CUDA ----------------------------------------------------------------------------------
def memory_profiler_cuda() -> dict[str, Any]:
    """A run with snapshots of step 1, then a run that runs out of memory on purpose: its OOM report."""
    import torch

    from lightscale.callbacks import MemoryProfiler
    from lightscale.recipes.gpt import GPTDataModule

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "memory"
        profiler = MemoryProfiler(every_n_steps=1, out_dir=out, snapshot_steps=[1])
        _trainer("bucketed_ddp", steps=3, callbacks=[profiler]).fit(
            _gpt(SMALL), datamodule=GPTDataModule(block_size=SMALL["block_size"], batch_size=8)
        )
        rows = [
            {k: (round(v / 2**20, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in profiler.records
        ]
        notes.append("figures in MiB, one row per step")
        snapshot = out / "snapshot_step1_rank0.pickle"
        notes.append(f"snapshot: {snapshot.stat().st_size if snapshot.exists() else 'MISSING'} bytes")
        notes.append(f"memory.png: {'written' if (out / 'memory.png').exists() else 'MISSING'}")
        huge = {**SMALL, "block_size": 8192}  # activations of 8192 tokens x 512 sequences: far beyond any GPU
        try:
            _trainer("bucketed_ddp", steps=1, callbacks=[MemoryProfiler(out_dir=out, plot=False)]).fit(
                _gpt({**huge, "vocab_size": 256}), _random_tokens({**huge, "vocab_size": 256}, 512, 1)
            )
            notes.append("OOM run: did NOT run out of memory")
        except torch.OutOfMemoryError:
            report = out / "oom_rank0.txt"
            notes.append(f"OOM report: {report.stat().st_size if report.exists() else 'MISSING'} bytes")
            if report.exists():
                notes.append("OOM report head: " + " / ".join(report.read_text().splitlines()[:3]))
    if any("MISSING" in note or "NOT" in note for note in notes):
        raise AssertionError("; ".join(notes))
    return {"rows": rows, "notes": notes}
