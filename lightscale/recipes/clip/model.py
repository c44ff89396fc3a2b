"""A single-device CLIP (Radford et al. 2021): a ViT image tower, a causal byte-level text tower, projections and
a learnable temperature.

The text tower reads the GPT recipe's byte tokens (0 pads; a caption's features are read at its last byte, which
the causal attention lets see the whole caption). Both embeddings are L2-normalized; the logit scale is learned in
log space from ``log(1/0.07)`` and clamped at ``log(100)`` as CLIP does (in forward, so no optimizer hook is needed).
``logit_bias`` exists for the SigLIP loss only (``init_logit_bias``; the SigLIP module sets -10 as the paper).

Example:
    >>> model = CLIP(CLIPConfig())
    >>> image, text, scale, bias = model(torch.zeros(4, 1, 8, 8), torch.ones(4, 32, dtype=torch.long))
    >>> image.shape, text.shape
    (torch.Size([4, 32]), torch.Size([4, 32]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lightscale.recipes.gpt.model import Embedding, Linear
from lightscale.recipes.vit.model import Block, ViT, ViTConfig, flops_per_image


@dataclass
class TextConfig:
    """The text tower's shape: a causal transformer over bytes (``vocab_size`` 256)."""

    vocab_size: int = 256
    context_length: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"TextConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"text n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


@dataclass
class CLIPConfig:
    """Both towers, the shared embedding width and the temperature."""

    vision: ViTConfig = field(default_factory=lambda: ViTConfig(num_classes=0))
    text: TextConfig = field(default_factory=TextConfig)
    embed_dim: int = 32
    init_logit_scale: float = math.log(1 / 0.07)
    max_logit_scale: float = math.log(100.0)
    init_logit_bias: float | None = None  # SigLIP's learnable bias (its paper: -10); None: no bias parameter

    def __post_init__(self) -> None:
        if self.vision.num_classes:
            raise ValueError("the CLIP image tower has no classifier head: set vision.num_classes: 0")
        if self.embed_dim <= 0:
            raise ValueError(f"embed_dim must be positive, got {self.embed_dim}")


class TextTransformer(nn.Module):
    """``tokens[B, T]`` (0 = padding) -> features ``[B, D]`` read at each caption's last byte."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.n_embd)
        self.pos_embeddings = Embedding(config.context_length, config.n_embd)
        width, heads, depth = config.n_embd, config.n_head, config.n_layer
        self.layers = nn.ModuleDict({str(i): Block(width, heads, depth, causal=True) for i in range(depth)})
        self.norm = nn.LayerNorm(config.n_embd)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        last = (tokens != 0).sum(dim=1).clamp(min=1) - 1  # captions are left-aligned
        return h[torch.arange(len(tokens), device=tokens.device), last]


class CLIPOutput(NamedTuple):
    image: torch.Tensor | None  # [B, embed_dim], L2-normalized
    text: torch.Tensor | None
    logit_scale: torch.Tensor  # exp(clamped logit_scale), shape [1]
    logit_bias: torch.Tensor | None  # shape [1]; SigLIP only


class CLIP(nn.Module):
    """Two towers into one normalized space; ``forward`` embeds images, captions or both (the FSDP root's hooks
    run on every call, so zero-shot prompts go through ``forward`` too)."""

    def __init__(self, config: CLIPConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or CLIPConfig()
        # Shape [1], not a scalar: FSDP2 and ZeRO-3 shard along dim 0.
        self.logit_scale = nn.Parameter(torch.empty(1))
        # Only for the SigLIP loss: a parameter the loss never uses would get no gradient (an error under DDP).
        self.logit_bias = nn.Parameter(torch.empty(1)) if config.init_logit_bias is not None else None
        self.reset_parameters()
        self.vision = ViT(config.vision)
        self.text = TextTransformer(config.text)
        self.vision_proj = Linear(config.vision.n_embd, config.embed_dim, bias=False, std=config.vision.n_embd**-0.5)
        self.text_proj = Linear(config.text.n_embd, config.embed_dim, bias=False, std=config.text.n_embd**-0.5)

    def reset_parameters(self) -> None:
        """This module's own parameters only (the towers own theirs); constants, so no RNG draw."""
        nn.init.constant_(self.logit_scale, self.config.init_logit_scale)
        if self.logit_bias is not None:
            nn.init.constant_(self.logit_bias, self.config.init_logit_bias)

    def init_weights(self) -> None:
        for module in self.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def scale(self) -> torch.Tensor:
        """The temperature as a multiplier, ``exp(logit_scale)`` clamped at ``exp(max_logit_scale)``."""
        return self.logit_scale.clamp(max=self.config.max_logit_scale).exp()

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.vision_proj(self.vision(images)), dim=-1)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_proj(self.text(tokens)), dim=-1)

    def forward(self, images: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> CLIPOutput:
        """Embeddings of ``images`` and/or ``tokens``, and the temperature and bias as computed tensors: under
        ZeRO-3 a parameter is whole only inside its module's forward, so the loss reads them from here."""
        image = self.encode_image(images) if images is not None else None
        text = self.encode_text(tokens) if tokens is not None else None
        bias = self.logit_bias.clone() if self.logit_bias is not None else None
        return CLIPOutput(image, text, self.scale(), bias)


def flops_per_pair(config: CLIPConfig) -> int:
    """Training FLOPs per image-caption pair: the ViT's count plus the text tower's ``6N + 12 L d T`` per token."""
    with torch.device("meta"):
        text = TextTransformer(config.text)
    n = sum(p.numel() for p in text.parameters()) - text.tok_embeddings.weight.numel()
    t = config.text
    return flops_per_image(config.vision) + t.context_length * (6 * n + 12 * t.n_layer * t.n_embd * t.context_length)
