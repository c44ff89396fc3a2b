"""What a worker puts on the wire for one fragment: the flat fp32 vector, bf16, or per-tensor absmax int8.

Compressed payloads are all-gathered, not all-reduced, so the sum over workers is taken in fp32 on every rank
(int8 sums would overflow; bf16 sums round at every addition). Every rank decodes the same bytes in the same
worker order, so every worker computes a bitwise identical mean. The payload is one ``uint8`` byte string per
worker (one collective per fragment): for int8, the per-tensor fp32 scales come first, then the int8 values.

Example:
    >>> codec = Codec("int8", sizes=[3, 2])
    >>> payload = codec.encode(torch.tensor([1.0, -2.0, 0.5, 4.0, 0.0]))
    >>> payload.numel() == codec.payload_bytes == 2 * 4 + 5
    True
    >>> codec.decode(payload)
    tensor([ 1.0079, -2.0000,  0.5039,  4.0000,  0.0000])
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightscale.errors import ConfigurationError

Compression = Literal["none", "bf16", "int8"]
COMPRESSIONS: tuple[str, ...] = ("none", "bf16", "int8")
_INT8_MAX = 127.0


def validate_compression(compression: str) -> None:
    if compression not in COMPRESSIONS:
        raise ConfigurationError(f"compression={compression!r} is not valid; choose one of {', '.join(COMPRESSIONS)}.")


class Codec:
    """Encodes one fragment's flat fp32 vector (made of tensors of ``sizes`` elements) into bytes and back."""

    def __init__(self, compression: Compression, sizes: list[int]) -> None:
        validate_compression(compression)
        self.compression = compression
        self.sizes = list(sizes)
        self.numel = sum(sizes)

    @property
    def payload_bytes(self) -> int:
        """Bytes one worker contributes per sync of this fragment: what ``OuterSync.bytes_sent`` adds up."""
        if self.compression == "none":
            return 4 * self.numel
        if self.compression == "bf16":
            return 2 * self.numel
        return 4 * len(self.sizes) + self.numel  # one fp32 scale per tensor, one byte per value

    def encode(self, flat: Tensor) -> Tensor:
        """The payload: fp32 itself for ``"none"`` (all-reduced), a ``uint8`` byte string otherwise."""
        if self.compression == "none":
            return flat
        if self.compression == "bf16":
            return flat.to(torch.bfloat16).view(torch.uint8)
        # A local shard may be empty (FSDP2 pads uneven shards): its scale is 0, then 1 below.
        scales = torch.stack([_absmax(chunk) / _INT8_MAX for chunk in flat.split(self.sizes)])
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero tensor stays zero
        per_value = torch.repeat_interleave(scales, torch.tensor(self.sizes, device=flat.device))
        values = torch.round(flat / per_value).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return torch.cat([scales.view(torch.uint8), values.view(torch.uint8)])

    def decode(self, payload: Tensor) -> Tensor:
        """The fp32 vector a payload stands for (what the other workers will reconstruct from it)."""
        if self.compression == "none":
            return payload
        if self.compression == "bf16":
            return payload.view(torch.bfloat16).float()
        head = 4 * len(self.sizes)
        scales = payload[:head].view(torch.float32)
        per_value = torch.repeat_interleave(scales, torch.tensor(self.sizes, device=payload.device))
        return payload[head:].view(torch.int8).float() * per_value


def _absmax(chunk: Tensor) -> Tensor:
    return chunk.abs().max() if chunk.numel() else chunk.new_zeros(())
