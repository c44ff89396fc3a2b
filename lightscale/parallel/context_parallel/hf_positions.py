"""Global positions for Hugging Face models under context parallelism, without touching the user's model.

A Hugging Face decoder (GPT-2, Llama, Mistral, Qwen, ...) makes its positions from the sequence it is given,
``arange(T)``: under cp each rank holds ``T / cp`` tokens of every sequence (zigzag order), so every rank but the
first would read the wrong position embeddings or rotary angles and train another model. While a context-parallel
step runs, :func:`feed_global_positions`'s forward pre-hook passes this rank's global positions as ``position_ids``
to each Hugging Face model that takes them and was called without. It also passes an all-ones ``attention_mask``
where none was given: given zigzag positions without a mask, transformers reads the jumps as packed sequences and
builds a block mask; with the all-ones mask it keeps plain causal attention, which cp computes exactly. Outside a
cp step (validation on one device, generation with a cache) the hook does nothing.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightscale.parallel.context_parallel.dispatch import active_attention


def feed_global_positions(module: nn.Module) -> list[RemovableHandle]:
    """Hook every Hugging Face model in ``module`` whose ``forward`` takes ``position_ids`` (none if transformers
    was never imported: the user's model holds no Hugging Face module then)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return []
    return [
        sub.register_forward_pre_hook(_global_positions, with_kwargs=True)
        for sub in module.modules()
        if isinstance(sub, transformers.PreTrainedModel) and _takes(sub, "position_ids", "attention_mask")
    ]


def _takes(module: nn.Module, *names: str) -> bool:
    parameters = inspect.signature(module.forward).parameters
    return all(name in parameters for name in names)


def _global_positions(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    attention = active_attention()
    if attention is None:
        return None
    given = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments  # positional ones too
    if given.get("position_ids") is not None or given.get("past_key_values") is not None:
        return None
    tokens = given.get("input_ids")
    if tokens is None:
        tokens = given.get("inputs_embeds")
    if tokens is None:
        return None
    batch, local_len = tokens.shape[:2]
    positions = attention.positions(local_len, tokens.device).unsqueeze(0)
    args, kwargs = _set(module, args, kwargs, given, "position_ids", positions)
    if given.get("attention_mask") is None:
        mask = torch.ones(batch, local_len, dtype=torch.long, device=tokens.device)
        args, kwargs = _set(module, args, kwargs, given, "attention_mask", mask)
    return args, kwargs


def _set(
    module: nn.Module, args: tuple, kwargs: dict[str, Any], given: dict[str, Any], name: str, value: Any
) -> tuple[tuple, dict[str, Any]]:
    """``name`` set to ``value`` where the caller put it: in ``args`` if passed there (as None), else in ``kwargs``."""
    if name in given and name not in kwargs:
        index = list(inspect.signature(module.forward).parameters).index(name)
        return (*args[:index], value, *args[index + 1 :]), kwargs
    return args, {**kwargs, name: value}
