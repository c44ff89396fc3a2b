"""Context parallelism for any model that calls ``F.scaled_dot_product_attention``, without touching its code.

While a :class:`ContextParallelAttention` mode is active, every call of ``F.scaled_dot_product_attention`` is routed
to :func:`~lightscale.parallel.context_parallel.attention.context_parallel_attention` over the cp group (a
``TorchFunctionMode``, as torch's experimental ``context_parallel`` does). The model sees its usual shapes with the
local sequence length; it must feed global positions to its position embeddings or RoPE (:func:`positions` reads
them from the active mode, and is ``arange`` on one device), and labels must be shifted before sharding. Masks
other than causal or none, and dropout, are refused. Meta and fake tensors (shape inference, the estimator) pass
through to the ordinary attention: no communication, the local shapes.

Example:
    >>> with ContextParallelAttention(group, mode="ring") as cp_attention:
    ...     loss = model(shard_sequence(tokens, cp, rank))  # the model calls positions(T_local) for its embeddings
    >>> assert cp_attention.calls > 0, "the model never called F.scaled_dot_product_attention"
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel.attention import MODES, Mode, context_parallel_attention
from lightscale.parallel.context_parallel.token_split import LAYOUTS, Layout, local_positions, unshard_sequence

_ACTIVE: list[ContextParallelAttention] = []  # the modes entered and not yet left, innermost last


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

    def __enter__(self) -> ContextParallelAttention:
        super().__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or _symbolic(args[0] if args else kwargs["query"]):
            return func(*args, **kwargs)
        self.calls += 1
        return self._attention(*args, **kwargs)

    def positions(self, local_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions of this rank's ``local_len`` tokens of a sequence sharded over the group."""
        cp = dist.get_world_size(self.group)
        return local_positions(local_len * cp, cp, dist.get_rank(self.group), self.layout).to(device)

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


def positions(local_len: int, *, device: torch.device | str | None = None) -> Tensor:
    """Global positions of the ``local_len`` tokens a model sees: what learned position embeddings and RoPE read.

    Inside a :class:`ContextParallelAttention` mode (a context-parallel strategy's step) these are this rank's
    tokens of the whole sequence; elsewhere ``torch.arange(local_len)``, so a model calling it stays single-device.

    Example:
        >>> h = self.tok_embeddings(tokens) + self.pos_embeddings(positions(tokens.shape[1], device=tokens.device))
    """
    if _ACTIVE:
        return _ACTIVE[-1].positions(local_len, device)
    return torch.arange(local_len, device=device)


def active_attention() -> ContextParallelAttention | None:
    """The innermost active mode, or None: activation checkpointing re-enters it to recompute a block in backward
    (lightscale/parallel/activation_checkpoint.py), where the step's mode is no longer active."""
    return _ACTIVE[-1] if _ACTIVE else None


def _symbolic(tensor: Any) -> bool:
    """Meta or fake tensors: shapes only (pipeline shape inference, the estimator), nothing to communicate."""
    return isinstance(tensor, Tensor) and (tensor.is_meta or isinstance(tensor, FakeTensor))


def gather_sequence(x: Tensor, group: ProcessGroup | None = None, *, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """Every rank's shard of ``x`` joined into the full sequence in global order (outputs, metrics; no autograd)."""
    group = group if group is not None else dist.group.WORLD
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_sequence(shards, dim=dim, layout=layout)
