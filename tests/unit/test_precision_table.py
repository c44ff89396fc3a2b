"""The precision contract's table: docs/plugins/precision.md shows it, and Lightning's callbacks read our plugins.

Regenerate the page's table after changing the contract: ``LIGHTSCALE_UPDATE_ERRORS=1 pytest
tests/unit/test_precision_table.py`` (the same switch that regenerates docs/errors.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision

import lightscale
from lightscale.plugins.fsdp_precision import Float8Precision, MixedTensorGradScaler, fsdp2_precision_plugin, mp_policy
from lightscale.plugins.precision_contract import DTYPES, FLOAT8, PRECISIONS, meaning, render_table
from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy, Parallel3DStrategy, ZeroStrategy
from lightscale.strategies.registry import family_members

DOC = Path(__file__).resolve().parents[2] / "docs" / "plugins" / "precision.md"
BEGIN, END = "<!-- contract table: generated from precision_contract.py -->", "<!-- end of contract table -->"


def test_docs_table_is_the_code_table() -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    fresh = f"{head}{BEGIN}\n{render_table(family_members())}{END}{tail}"
    if os.environ.get("LIGHTSCALE_UPDATE_ERRORS"):
        DOC.write_text(fresh)
    assert DOC.read_text() == fresh, "docs/plugins/precision.md is stale: rerun with LIGHTSCALE_UPDATE_ERRORS=1"


def test_mixed_modes_reduce_in_fp32_unless_compression_asks() -> None:
    for rules in family_members():
        for precision in ("bf16-mixed", "16-mixed"):
            assert meaning(rules, precision).reduce == "fp32"
            assert meaning(rules, precision, compression="bf16").reduce == "bf16"
    assert mp_policy("bf16-mixed").reduce_dtype == torch.float32
    assert mp_policy("32-true", "bf16").reduce_dtype == torch.bfloat16  # the same option under FSDP
    assert mp_policy("bf16-mixed", "bf16", cast_params=False).param_dtype is None  # a pipeline stage: autocast


def _plugins(precision: str) -> dict[type, object]:
    """The plugin each family trains with (the factories the strategies call in setup), by strategy class."""
    trainer = lightscale.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=1, precision=precision)
    plugins = {
        BucketedDDPStrategy: trainer.strategy.precision_plugin,
        FSDP2Strategy: fsdp2_precision_plugin(precision, "cpu"),
    }
    plugins[ZeroStrategy] = DeepSpeedPrecision(precision)  # type: ignore[arg-type]
    if precision == "16-mixed":  # parallel_3d without FSDP (tensor parallel, pipelines)
        plugins[Parallel3DStrategy] = MixedPrecision("16-mixed", "cpu", scaler=MixedTensorGradScaler(device="cpu"))
    return plugins


@pytest.mark.parametrize("precision", [name for name in PRECISIONS if name not in FLOAT8])
def test_lightning_throughput_monitor_reads_our_plugins(precision: str) -> None:
    """ThroughputMonitor picks the peak FLOPs by this dtype; an unknown plugin would count as fp32."""
    for cls, plugin in _plugins(precision).items():
        assert _plugin_to_compute_dtype(plugin) == DTYPES[meaning(cls.precision_rules, precision).compute], (
            cls,
            plugin,
        )


def test_float8_plugin_reads_as_bf16_compute() -> None:
    """float8 runs under fsdp2 and parallel_3d only; its plugin is bf16-mixed to Lightning (bf16 peak FLOPs)."""
    for name in FLOAT8:
        assert _plugin_to_compute_dtype(Float8Precision(name, "cpu", emulate=True)) == torch.bfloat16
        assert meaning(FSDP2Strategy.precision_rules, name).compute == "bf16"
        assert meaning(Parallel3DStrategy.precision_rules, name).compute == "bf16"
