"""Activation checkpointing and per-block ``torch.compile``, applied from outside a model, before sharding.

Both act on the same units FSDP shards (e.g. every ``TransformerBlock``) but do not depend on it: they use
torch's composable ``checkpoint`` (hooks, no wrapper module), so parameter names and state-dict keys do not
change, and any wrapping (FSDP, DDP, none) can be applied afterwards.

Modes:
    * ``"none"``: keep every activation;
    * ``"full"``: keep only each unit's input, recompute the whole unit in backward;
    * ``"selective"``: keep the outputs of matmuls and attention (expensive to recompute), recompute the
      cheap element-wise ops (norms, activations, residual adds) -- torch's selective checkpoint policy.

Example:
    >>> apply_activation_checkpointing(list(model.layers), mode="selective")
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightscale.errors import ConfigurationError
from lightscale.measure.saved_tensors import note_kept
from lightscale.parallel.context_parallel.dispatch import active_attention

ACMode = Literal["none", "full", "selective"]
AC_MODES = ("none", "full", "selective")

# Ops whose outputs selective checkpointing keeps: recomputing them costs as much as the forward did.
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def check_ac_mode(mode: str) -> None:
    if mode not in AC_MODES:
        raise ConfigurationError(
            f"activation_checkpointing={mode!r} is not valid; choose one of {', '.join(map(repr, AC_MODES))}."
        )


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    if op not in _SAVE:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not getattr(ctx, "is_recompute", True):
        note_kept(getattr(ctx, "op_output", None))  # kept in torch's cache, out of sight of saved-tensor hooks
    return CheckpointPolicy.MUST_SAVE


def apply_activation_checkpointing(units: Iterable[nn.Module], *, mode: ACMode) -> None:
    """Checkpoint every one of ``units`` (e.g. the transformer blocks) in place; ``mode="none"`` does nothing."""
    check_ac_mode(mode)
    if mode == "none":
        return
    for unit in units:
        checkpoint(unit, context_fn=partial(_contexts, selective=mode == "selective"))


def _contexts(*, selective: bool) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The forward and recompute contexts of one checkpointed call, taken when the forward starts. The recompute
    runs in backward, outside the step: it re-enters the context-parallel attention its forward ran under, so the
    unit routes attention and reads positions as it did (lightscale/parallel/context_parallel)."""
    forward, recompute = (
        create_selective_checkpoint_contexts(_selective_policy) if selective else (nullcontext(), nullcontext())
    )
    attention = active_attention()
    if attention is not None:
        recompute = _both(attention, recompute)
    return forward, recompute


@contextmanager
def _both(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def maybe_compile_units(units: Iterable[nn.Module], *, enabled: bool) -> None:
    """``torch.compile`` each unit's forward in place (per block: small graphs, shared across identical blocks)."""
    if enabled:
        for unit in units:
            unit.compile()
