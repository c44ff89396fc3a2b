"""DeepSpeed's meaning of each precision: the rows of the precision contract where its engine differs.

DeepSpeed's bf16 and fp16 engines convert the module (no autocast) and step an fp32 master copy of each rank's
partition; in fp32 its optimizer still steps a copy of its own. ``ZeroStrategy.precision_rules`` declares these rows
(lightscale/plugins/precision_contract.py warns at start-up where the values change); the engine config that
realises them is :func:`lightscale.strategies.deepspeed.config.precision_section`.

Example:
    >>> DEEPSPEED_MEANINGS["bf16-true"].master
    'fp32'
"""

from __future__ import annotations

from lightscale.plugins.precision_contract import Meaning

_BF16 = (
    "DeepSpeed's bf16 engine: the module's parameters are bf16 (every op computes in bf16, no autocast) and the "
    "optimizer steps an fp32 master copy with fp32 state"
)
_FP16 = "DeepSpeed's fp16 engine: fp16 parameters, an fp32 master copy and DeepSpeed's dynamic loss scaler"
DEEPSPEED_MEANINGS = {
    "32-true": Meaning(
        "fp32",
        "fp32",
        "fp32",
        "fp32",
        "fp32",
        False,
        "plain fp32",
        "DeepSpeed's optimizer steps its own fp32 copy of each rank's partition (4 more bytes per parameter / N); "
        "the values are the same",
        same_values=True,
    ),
    "bf16-mixed": Meaning(
        "bf16", "bf16", "fp32", "fp32", "fp32", False, "DeepSpeed bf16 + communication_data_type=fp32", _BF16
    ),
    "16-mixed": Meaning(
        "fp16",
        "fp16",
        "fp32",
        "fp32",
        "fp32",
        True,
        "DeepSpeed fp16 + communication_data_type=fp32 (CUDA only: not observed by the CPU test)",
        _FP16,
    ),
    "bf16-true": Meaning(
        "bf16", "bf16", "bf16", "fp32", "fp32", False, "DeepSpeed bf16", _BF16 + " (it has no pure-bf16 optimizer)"
    ),
}
# Why the engine cannot run a precision.
FP16_NEEDS_CUDA = "DeepSpeed's CPU accelerator has no fp16 support (its fp16 engine needs CUDA)"
NO_FLOAT8 = "DeepSpeed partitions its own flat bf16/fp16 buffers and has no float8 Linear; use fsdp2 or parallel_3d"
