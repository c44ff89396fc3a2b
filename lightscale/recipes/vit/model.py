"""A single-device Vision Transformer (Dosovitskiy et al. 2020): patches -> pre-norm blocks -> pooled head.

Parallelism is applied from outside (parallelize.py). Module names follow the GPT recipe (``layers.<i>.attention.wq``,
``feed_forward.w1``, ...) so the same tensor-parallel styles apply, and the attention derives its head count from
the *local* projection width. The patch embedding is a ``Linear`` over flattened patches (a strided convolution
written as a matmul), so nothing in the model is a convolution a plan cannot shard.

Example:
    >>> model = ViT(ViTConfig.named("tiny"))
    >>> model(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lightscale.recipes.gpt.model import Linear

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"image_size": 8, "patch_size": 2, "n_layer": 2, "n_head": 2, "n_embd": 32},
    "small": {"image_size": 8, "patch_size": 2, "n_layer": 4, "n_head": 4, "n_embd": 128},
    "B-16": {
        "image_size": 224,
        "patch_size": 16,
        "channels": 3,
        "num_classes": 1000,
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
    },
}


@dataclass
class ViTConfig:
    """Model shape; validated at construction so a bad YAML fails before any tensor is allocated.

    ``num_classes=0`` drops the head: the model returns pooled features (the CLIP image tower).
    """

    image_size: int = 8
    patch_size: int = 2
    channels: int = 1
    num_classes: int = 10
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    mlp_ratio: int = 4
    pool: Literal["cls", "mean"] = "mean"
    pos_emb: Literal["learned", "sincos"] = "learned"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {value!r}")
        if self.num_classes < 0:
            raise ValueError(f"ViTConfig.num_classes must be >= 0 (0: no head), got {self.num_classes}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.pool not in ("cls", "mean") or self.pos_emb not in ("learned", "sincos"):
            raise ValueError(f"pool must be 'cls'|'mean', pos_emb 'learned'|'sincos'; got {self.pool}, {self.pos_emb}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must satisfy 0 <= dropout < 1, got {self.dropout}")

    @classmethod
    def named(cls, size: str, **overrides: object) -> ViTConfig:
        """A named size (``tiny`` for tests, ``small`` for the digits demo, ``B-16`` = ViT-B/16) with overrides."""
        if size not in SIZES:
            raise ValueError(f"unknown ViT size {size!r}; choose one of {list(SIZES)}")
        return cls(**{**SIZES[size], **overrides})  # type: ignore[arg-type]

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        return self.num_patches + (self.pool == "cls")


def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine position embeddings ``[grid*grid, dim]`` (MAE / "Better plain ViT baselines")."""
    if dim % 4:
        raise ValueError(f"sin-cos position embeddings need n_embd divisible by 4, got {dim}")
    ys, xs = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4) / (dim // 4 - 1 or 1))
    ys, xs = ys.flatten()[:, None] * omega, xs.flatten()[:, None] * omega
    return torch.cat([xs.sin(), xs.cos(), ys.sin(), ys.cos()], dim=1)


class Embeddings(nn.Module):
    """Images ``[B, C, H, W]`` -> tokens ``[B, T, D]``: patch projection, optional class token, positions."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.n_embd)) if config.pool == "cls" else None
        if config.pos_emb == "learned":
            self.pos = nn.Parameter(torch.empty(1, config.seq_len, config.n_embd))
        else:
            self.register_buffer("pos", self._sincos(), persistent=False)
        self.reset_parameters()
        # Built after this module's own draws: meta-device materialization re-draws in modules() order (parent first).
        self.proj = Linear(config.channels * config.patch_size**2, config.n_embd, bias=True)

    def _sincos(self) -> torch.Tensor:
        patches = sincos_2d(self.config.image_size // self.config.patch_size, self.config.n_embd)
        if self.config.pool == "cls":
            patches = torch.cat([torch.zeros(1, self.config.n_embd), patches])
        return patches[None]

    def reset_parameters(self) -> None:
        if isinstance(self.pos, nn.Parameter):
            nn.init.normal_(self.pos, std=0.02)
        else:
            self.pos.copy_(self._sincos())  # also re-made after to_empty() from the meta device
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.config.patch_size
        # [B, C, H, W] -> [B, H/p * W/p, C*p*p]: non-overlapping patches, row-major like a stride-p convolution.
        patches = F.unfold(images, kernel_size=p, stride=p).transpose(1, 2)
        h = self.proj(patches)
        if self.cls_token is not None:
            h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        return h + self.pos


class Attention(nn.Module):
    """Bidirectional multi-head self-attention; heads from the local width (column-sharded under TP)."""

    def __init__(self, dim: int, n_head: int, n_layer: int, dropout: float, *, causal: bool = False) -> None:
        super().__init__()
        self.head_dim = dim // n_head
        self.causal = causal
        residual = 0.02 / math.sqrt(2 * n_layer)
        self.wq, self.wv = Linear(dim, dim, bias=True), Linear(dim, dim, bias=True)
        # No key bias: it adds q.b to every score of a query, which softmax cancels (its gradient is exactly 0).
        self.wk = Linear(dim, dim, bias=False)
        self.wo = Linear(dim, dim, bias=True, std=residual)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, n_layer: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=True)
        self.w2 = Linear(hidden, dim, bias=True, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm transformer block; shared with the CLIP text tower (which is ``causal``)."""

    def __init__(
        self, dim: int, n_head: int, n_layer: int, *, mlp_ratio: int = 4, dropout: float = 0.0, causal: bool = False
    ) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_head, n_layer, dropout, causal=causal)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, mlp_ratio * dim, n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ViT(nn.Module):
    """``images[B, C, H, W] -> logits[B, num_classes]`` (or pooled features ``[B, n_embd]`` with no head)."""

    def __init__(self, config: ViTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ViTConfig()
        self.embed = Embeddings(config)
        # A ModuleDict keyed "0", "1", ... lets pipeline stages delete layers and keep the original FQNs.
        blocks = {
            str(i): Block(
                config.n_embd, config.n_head, config.n_layer, mlp_ratio=config.mlp_ratio, dropout=config.dropout
            )
            for i in range(config.n_layer)
        }
        self.layers = nn.ModuleDict(blocks)
        self.norm = nn.LayerNorm(config.n_embd)
        self.head = Linear(config.n_embd, config.num_classes, bias=True) if config.num_classes else None

    def init_weights(self) -> None:
        """Re-draw every weight (after ``to_empty`` from the meta device); each module owns its init."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (or hidden states ``[B, T, D]`` on a pipeline stage without the embeddings)."""
        # Pipeline stages set embed, norm or head to None; one forward then serves every stage.
        h = self.embed(images) if self.embed is not None else images
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is None:
            return h
        h = self.norm(h)
        pooled = h[:, 0] if self.config.pool == "cls" else h.mean(dim=1)
        return self.head(pooled) if self.head is not None else pooled

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def flops_per_image(config: ViTConfig) -> int:
    """Training FLOPs per image: ``T * (6N + 12 L d T)`` over ``T`` tokens (the GPT recipe's count, per token)."""
    with torch.device("meta"):
        model = ViT(config)
    n = model.num_params() - model.embed.pos.numel()
    return config.seq_len * (6 * n + 12 * config.n_layer * config.n_embd * config.seq_len)
