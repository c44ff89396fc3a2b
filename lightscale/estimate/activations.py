"""Activation bytes: the Megatron formula for transformers, a one-sample forward for any other model.

Reference (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), bytes per
layer for sequence ``s``, micro-batch ``b``, hidden ``h``, heads ``a``, fp16 activations with dropout::

    no parallelism            s·b·h·(34 + 5·a·s/h)
    tensor parallel t         s·b·h·(10 + 24/t + 5·a·s/(h·t))
    + sequence parallel       s·b·h·(34 + 5·a·s/h) / t
    + selective recompute     s·b·h·34 / t
    full recompute            2·s·b·h

:func:`transformer_activation_bytes` counts the same terms for the model a recipe declares
(:class:`TransformerShape`), at the run's bytes per element: the 16 sbh elements the layer saves (norm inputs and
outputs, Q, K, V, the attention output, the MLP's two 4h tensors), dropout masks only when dropout is on, and for
fused (flash) attention its log-sum-exp instead of the 5·a·s/h softmax terms; plus the head's final norm and fp32
log-softmax over the vocabulary.

Context parallelism (``cp``) gives each rank ``s / cp`` tokens of every sequence: every term above is taken at the
local length, and what the attention mode keeps besides (:func:`context_parallel_extra_bytes`) is added per layer.

Example:
    >>> megatron_activation_bytes(s=2048, b=1, h=12288, a=96, layers=1)  # GPT-3 175B, one layer
    2868903936.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightscale.estimate.memory_layout import Layout
from lightscale.measure.saved_tensors import SavedTensors, checkpointed_modules, count_checkpoint_inputs
from lightscale.parallel.contract import TransformerShape

# Bytes of one activation element under a Trainer precision (autocast computes matmuls in half precision).
ACTIVATION_BYTES = {"32-true": 4, "32": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}


def megatron_activation_bytes(
    *,
    s: int,
    b: int,
    h: int,
    a: int,
    layers: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """The paper's per-layer formulas (fp16, dropout, unfused attention) times ``layers`` (see the module docstring)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh * layers
    if recompute == "selective":
        return sbh * 34 / tp * layers if sequence_parallel or tp == 1 else sbh * (10 + 24 / tp) * layers
    if sequence_parallel:
        return sbh * (34 + 5 * a * s / h) / tp * layers
    return sbh * (10 + 24 / tp + 5 * a * s / (h * tp)) * layers


def transformer_activation_bytes(
    shape: TransformerShape, *, micro_batch: int, precision: str, layout: Layout, layers: int | None = None
) -> dict[str, float]:
    """Bytes autograd saves for one micro-batch on one rank: ``layers`` (default all) blocks and the head."""
    e = ACTIVATION_BYTES[precision]
    s, b, h, t = shape.seq_len / layout.cp, micro_batch, shape.hidden, layout.tp  # s: this rank's tokens
    sp = t if layout.sequence_parallel else 1  # what sequence parallelism divides
    layers = shape.layers if layers is None else layers
    if layout.activation_checkpointing == "full":
        per_layer = s * b * h * e / sp  # each block's input, kept for its recompute
    elif layout.activation_checkpointing == "selective":
        per_layer = _selective_layer_bytes(shape, s=s, b=b, e=e, tp=t, sp=sp)
    else:
        per_layer = _layer_bytes(shape, s=s, b=b, e=e, tp=t, sp=sp) + context_parallel_extra_bytes(
            shape, layout, micro_batch=b, e=e
        )
    logits = 4 * s * b * shape.vocab_size / (t if layout.loss_parallel else 1)  # fp32 log-softmax output
    # Final norm: input (sequence-sharded under SP) and output (gathered for the head), its mean and rstd; the
    # token ids of the embedding and the targets of the loss (int64).
    head = s * b * h * e * (1 / sp + 1) + 8 * s * b / sp + logits + 16 * s * b
    return {"layers": per_layer * layers, "head": head}


def _layer_bytes(shape: TransformerShape, *, s: float, b: int, e: int, tp: int, sp: int) -> float:
    h, a = shape.hidden, shape.heads
    kv = shape.kv_heads or a
    # Norm inputs (sharded under SP) and outputs (the projections' inputs: gathered again under SP).
    replicated = 2 / sp + 2
    # Q, K, V, the attention output (the output projection's input), the MLP's up-projection and GELU output.
    sharded = (1 + 2 * kv / a) + 1 + 2 * shape.ffn / h
    elements = s * b * h * (replicated + sharded / tp)
    extra = 2 * 2 * 4 * s * b / sp  # two norms' mean and rstd, fp32
    if shape.dropout:
        extra += 2 * s * b * h / sp  # attention- and MLP-output dropout masks, 1 byte each
    if shape.flash_attention:
        extra += 4 * b * (a / tp) * s  # log-sum-exp per head and position, fp32
    else:
        extra += (a / tp) * s * s * b * (e + (1 + e if shape.dropout else 0))  # softmax (+ mask, dropout output)
    return elements * e + extra


def context_parallel_extra_bytes(shape: TransformerShape, layout: Layout, *, micro_batch: int, e: int) -> float:
    """Bytes per layer a cp attention mode keeps beyond this rank's share of the sequence (none at cp = 1).

    ``ring`` keeps only local tensors (its backward sends K/V around again). ``allgather`` keeps the gathered K/V of
    the whole sequence, ``(cp - 1) / cp`` of it beyond the local K/V. ``ulysses`` runs torch's attention on head
    shards of the whole sequence, which keeps its output in that layout while the output projection keeps its own
    copy in sequence shards (one local attention output), plus the two int64 permutations of the sequence.
    """
    cp, s, b = layout.cp, shape.seq_len, micro_batch
    if cp == 1:
        return 0.0
    width = shape.hidden / layout.tp  # of this rank's heads
    if layout.cp_mode == "allgather":
        kv = (shape.kv_heads or shape.heads) / shape.heads
        return 2 * b * s * (cp - 1) / cp * width * kv * e
    if layout.cp_mode == "ulysses":
        return b * s / cp * width * e + 2 * 8 * s
    return 0.0


def _selective_layer_bytes(shape: TransformerShape, *, s: float, b: int, e: int, tp: int, sp: int) -> float:
    """lightscale's selective policy (parallel/activation_checkpoint.py) keeps the block input and the outputs of
    matmuls and attention: Q, K, V, the attention output (+ log-sum-exp), the output projection's, the MLP's two.
    Row-parallel outputs are whole-size partial sums before their reduction, so TP does not divide them."""
    h, a = shape.hidden, shape.heads
    kv = shape.kv_heads or a
    sharded = (1 + 2 * kv / a) + 1 + shape.ffn / h
    elements = s * b * h * (1 / sp + sharded / tp + 2)
    return elements * e + 4 * b * (a / tp) * s


def pipeline_in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first pipeline stage holds at once (1F1B: pp; GPipe would be all)."""
    return min(layout.microbatches, layout.pp) if layout.pp > 1 else 1


def measure_activation_bytes(step: Callable[[], Any], *, module: nn.Module | None = None) -> int:
    """Peak bytes autograd saves while ``step()`` runs a forward (on meta tensors: no memory, any model size).

    Checkpointed units of ``module`` count their kept inputs (lightscale/measure/saved_tensors.py).
    """
    with SavedTensors() as saved:
        handles = count_checkpoint_inputs(checkpointed_modules(module), saved) if module is not None else []
        try:
            with torch.enable_grad():
                result = step()
            peak = saved.peak
        finally:
            for handle in handles:
                handle.remove()
    del result
    return peak
