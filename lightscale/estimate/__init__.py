"""Memory before a run: ``estimate_memory`` (Python) and ``lightscale estimate`` (CLI) give the same numbers."""

from lightscale.estimate.activations import megatron_activation_bytes
from lightscale.estimate.core import MemoryEstimate, estimate_memory
from lightscale.estimate.memory_layout import Layout, layout_of
from lightscale.estimate.model_states import PerParameter, bytes_per_parameter, zero_stage_bytes
from lightscale.parallel.contract import TransformerShape

__all__ = [
    "Layout",
    "MemoryEstimate",
    "PerParameter",
    "TransformerShape",
    "bytes_per_parameter",
    "estimate_memory",
    "layout_of",
    "megatron_activation_bytes",
    "zero_stage_bytes",
]
