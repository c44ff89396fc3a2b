"""Writing whole tensors into a ZeRO engine's partitions, one parameter at a time: what
lightscale/strategies/deepspeed/load_portable.py calls to fill an engine from the portable layout (the save side:
lightscale/strategies/deepspeed/portable_save.py).

DeepSpeed's own helpers write a full fp32 weight or optimizer state into this rank's partition: ZeRO-1/2's
(``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``) find the parameter's fragment themselves; ZeRO-3's
are handed this rank's piece (``safe_set_local_*``, ``partition.own_piece``), because DeepSpeed's
full setters read past the end of a parameter the ranks do not divide (a 1-element bias on 2 ranks). A ZeRO-3 working
partition is rewritten from rank 0's copy inside ``GatheredParameters``; ZeRO-1/2 refresh their working copies from
the masters once at the end.

Example:
    >>> set_full_weight(param, torch.zeros(param.ds_shape), zero)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightscale.strategies.deepspeed.partition import (
    fp32_partitions,
    full_shape,
    is_partitioned,
    master_device,
    own_piece,
    set_full_shape,
)
from lightscale.strategies.deepspeed.portable_save import partition_group


def set_full_weight(param: nn.Parameter, value: Tensor, zero: Any | None) -> None:
    """Write the whole ``value`` into ``param``: its fp32 master (``zero``: the engine's optimizer, if any) and its
    working copy (ZeRO-1/2's are refreshed from the masters by :func:`refresh_working_copies`)."""
    if zero is not None and param.requires_grad:
        _set_master(param, value, None)
    if hasattr(param, "ds_id"):  # ZeRO-3: the working partition, rewritten from rank 0's copy
        import deepspeed

        with _gathered_as_vector(param), deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:  # DeepSpeed's engine always runs in a process group
                param.data.copy_(value.reshape(param.data.shape))
    elif zero is None or not param.requires_grad:
        with torch.no_grad():
            param.data.copy_(value)  # ZeRO-1/2 working copies are refreshed from the masters after all batches


@contextmanager
def _gathered_as_vector(param: nn.Parameter) -> Iterator[None]:
    """A 0-dim ZeRO-3 parameter gathered as shape [1] meanwhile: leaving the gather broadcasts rank 0's bytes
    (``p.data.view(torch.uint8)``), which a 0-dim tensor refuses (strategies/deepspeed/engine.py scalars_as_vectors)."""
    scalar = full_shape(param) == torch.Size([])
    if scalar:
        set_full_shape(param, torch.Size([1]))
    try:
        yield
    finally:
        if scalar:
            set_full_shape(param, torch.Size([]))


def set_full_state(param: nn.Parameter, state: dict[str, Tensor]) -> None:
    """Write whole per-element optimizer states (``exp_avg``...) into ``param``'s partition of them."""
    for key, value in state.items():
        _set_master(param, value, key)


def _set_master(param: nn.Parameter, value: Tensor, key: str | None) -> None:
    """Write the whole ``value`` into this rank's part of ``param``'s fp32 master (``key`` None) or of its optimizer
    state ``key``."""
    from deepspeed import utils  # DeepSpeed is an extra: imported where it is used

    value = value.to(master_device(param))
    if is_partitioned(param):  # ZeRO-3: this rank's piece, padded as the partition is
        piece = own_piece(param, value)
        if key is None:
            utils.safe_set_local_fp32_param(param, piece)
        else:
            utils.safe_set_local_optimizer_state(param, piece, key)
    elif key is None:
        utils.safe_set_full_fp32_param(param, value)
    else:
        utils.safe_set_full_optimizer_state(param, value, key)


def refresh_working_copies(zero: Any) -> None:
    """ZeRO-1/2: copy the masters into the bit16 partitions and all-gather them (ZeRO-3 wrote its own above)."""
    if hasattr(zero, "update_lp_params"):
        zero.update_lp_params()


def set_scalars(zero: Any, by_group: list[dict[str, Tensor]]) -> None:
    """Each scalar state of every flat partition (``by_group[g]`` for group ``g``'s), in the type the optimizer keeps
    it (tensor or Python number)."""
    inner = zero.optimizer
    for index, flat in enumerate(fp32_partitions(zero)):
        state = inner.state[flat]
        for key, value in by_group[partition_group(zero, index)].items():
            live = state[key]  # each partition its own tensor: optimizers count steps in place
            state[key] = (
                value.to(live.device, live.dtype).clone() if torch.is_tensor(live) else type(live)(value.item())
            )
