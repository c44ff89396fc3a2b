"""Context parallelism for any model that calls ``F.scaled_dot_product_attention``, without touching its code.

While a :class:`ContextParallelAttention` mode is active, every call of ``F.scaled_dot_product_attention`` is routed
to :func:`~lightscale.parallel.context_parallel.attention.context_parallel_attention` over the cp group (a
``TorchFunctionMode``, as torch's experimental ``context_parallel`` does). The model sees its usual shapes with the
local sequence length; it must feed global positions (:func:`.layout.local_positions`) to its position embeddings
or RoPE, and labels must be shifted before sharding. Masks other than causal or none, and dropout, are refused.

Example:
    >>> with ContextParallelAttention(group, mode="ring") as cp_attention:
    ...     loss = model(shard_sequence(tokens, cp, rank), positions=local_positions(seq_len, cp, rank))
    >>> assert cp_attention.calls > 0, "the model never called F.scaled_dot_product_attention"
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel.attention import MODES, Mode, context_parallel_attention
from lightscale.parallel.context_parallel.layout import LAYOUTS, Layout, unshard_sequence


class ContextParallelAttention(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` to context-parallel attention while active.

    ``calls`` counts the attention calls seen, so a strategy can tell a model that never calls SDPA (its attention
    would silently see only the local tokens) after the first step.
    """

    def __init__(self, group: ProcessGroup | None = None, *, mode: Mode = "ring", layout: Layout = "zigzag") -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigurationError(f"Unknown context-parallel attention mode {mode!r}; valid: {list(MODES)}.")
        if layout not in LAYOUTS:
            raise ConfigurationError(f"Unknown context-parallel layout {layout!r}; valid: {list(LAYOUTS)}.")
        self.group = group if group is not None else dist.group.WORLD
        self.mode, self.layout = mode, layout
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        self.calls += 1
        return self._attention(*args, **kwargs)

    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if attn_mask is not None:
            raise ConfigurationError(
                f"Context parallelism supports is_causal=True or no mask; F.scaled_dot_product_attention got an "
                f"attn_mask tensor of shape {tuple(attn_mask.shape)} (dtype {attn_mask.dtype}). Express a causal "
                f"mask as is_causal=True; padding and document masks are not supported."
            )
        if dropout_p > 0:
            raise ConfigurationError(
                f"Context parallelism does not support attention dropout (dropout_p={dropout_p}): set it to 0."
            )
        return context_parallel_attention(
            query,
            key,
            value,
            self.group,
            mode=self.mode,
            layout=self.layout,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )


def gather_sequence(x: Tensor, group: ProcessGroup | None = None, *, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """Every rank's shard of ``x`` joined into the full sequence in global order (outputs, metrics; no autograd)."""
    group = group if group is not None else dist.group.WORLD
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim=dim, layout=layout)
