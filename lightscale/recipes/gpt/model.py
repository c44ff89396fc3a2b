"""A single-device, pre-LN, decoder-only transformer (nanoGPT-sized).

Parallelism is applied from outside, so module names follow torchtitan's llama (``layers.<i>.attention.wq``,
``feed_forward.w1``, ...) and the attention derives its head count from the *local* projection width: a
tensor-parallel plan can shard ``wq``/``wk``/``wv`` column-wise without changing this file. Attention is
``F.scaled_dot_product_attention`` and positions come from ``context_parallel.positions``, so context parallelism
(sequences sharded over ranks) needs no change either.

Example:
    >>> model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64))
    >>> model(torch.zeros(1, 8, dtype=torch.long)).shape
    torch.Size([1, 8, 256])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightscale.layers.moe import MoE, MoEConfig
from lightscale.parallel.context_parallel import positions


@dataclass
class GPTConfig:
    """Model shape; validated at construction so a bad YAML fails before any tensor is allocated."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 2
    n_kv_head: int | None = None
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False
    tie_weights: bool = True
    moe: MoEConfig | None = None  # mixture-of-experts feed-forward layers (lightscale/layers/moe.py)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_kv_head is not None and (not isinstance(self.n_kv_head, int) or self.n_kv_head <= 0):
            raise ValueError(f"GPTConfig.n_kv_head must be None or a positive int, got {self.n_kv_head!r}")
        if self.n_embd % self.n_head != 0:
            valid = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; valid n_head: {valid}")
        if self.n_head % self.kv_heads != 0:
            valid = [h for h in range(1, self.n_head + 1) if self.n_head % h == 0]
            raise ValueError(
                f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}; valid n_kv_head: {valid}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must satisfy 0 <= dropout < 1, got {self.dropout}")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Linear(nn.Linear):
    """``nn.Linear`` drawn from N(0, std) with zero bias (GPT-2 init).

    The init lives in ``reset_parameters``, which runs inside the constructor: under ``deepspeed.zero.Init`` the
    weights are drawn before they are partitioned, and a meta-device model re-draws them module by module.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float = 0.02) -> None:
        self.std = std  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    @override
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` drawn from N(0, 0.02) (GPT-2 init), in ``reset_parameters`` like :class:`Linear`."""

    @override
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def residual_std(config: GPTConfig) -> float:
    """GPT-2 scales the init of projections that write into the residual stream by 1/sqrt(2 * n_layer)."""
    return 0.02 / math.sqrt(2 * config.n_layer)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_width = config.kv_heads * config.head_dim
        self.wq = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.wk = Linear(config.n_embd, kv_width, bias=config.bias)
        self.wv = Linear(config.n_embd, kv_width, bias=config.bias)
        self.wo = Linear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)
        self.attn_dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Head counts come from the local widths so a column-sharded wq/wk/wv (tensor parallel) just works.
        n_q, n_kv = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = q.view(batch, seq, n_q, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, n_kv, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, n_kv, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=True,
            enable_gqa=n_q != n_kv,
        )
        y = y.transpose(1, 2).reshape(batch, seq, n_q * self.head_dim)
        return self.dropout(self.wo(y))


class FeedForward(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.w2 = Linear(4 * config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig, index: int = 0) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        moe = config.moe is not None and config.moe.is_moe_layer(index)
        self.feed_forward: nn.Module = (
            MoE(config.n_embd, config.moe, out_std=residual_std(config)) if moe else FeedForward(config)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer: ``tokens[B, T] -> logits[B, T, vocab_size]``."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_embeddings = Embedding(config.vocab_size, config.n_embd)
        self.pos_embeddings = Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        # A ModuleDict keyed "0", "1", ... lets pipeline stages delete layers and keep the original FQNs.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layer)})
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.output = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self) -> None:
        """Re-draw every weight (after ``to_empty`` from the meta device); each module owns its init."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` are ids ``[B, T]`` (or hidden states ``[B, T, D]`` on a pipeline stage without embeddings)."""
        seq = tokens.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size={self.config.block_size}")
        # Pipeline stages may set embeddings, norm or output to None; one forward then serves every stage.
        if self.tok_embeddings is not None:
            # Global positions of these tokens: arange(seq) on one device, this rank's tokens under context parallelism.
            h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(positions(seq, device=tokens.device)))
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def num_params(self, *, exclude_embeddings: bool = False) -> int:
        """Parameter count with tied weights counted once; ``exclude_embeddings`` drops token and position tables."""
        total = sum(p.numel() for p in self.parameters())  # parameters() already de-duplicates tied tensors
        if exclude_embeddings:
            total -= self.tok_embeddings.weight.numel() + self.pos_embeddings.weight.numel()
        return total


def flops_per_token(config: GPTConfig) -> int:
    """Training FLOPs per token: 6N + 12 * L * d * T (forward + backward; PaLM paper, appendix B).

    N is the non-embedding parameter count of the parameters a token uses, plus the output head, tied or not (it
    is a matmul per token); of each MoE layer's routed experts only top_k of n_experts count.
    """
    with torch.device("meta"):  # counts shapes only, so even a 100B config allocates nothing
        model = GPT(config)
    n = model.num_params(exclude_embeddings=True)
    if config.tie_weights:
        n += config.vocab_size * config.n_embd  # the head shares the token table, which was just excluded
    for module in model.modules():
        if isinstance(module, MoE):
            idle = 1 - module.config.top_k / module.config.n_experts
            n -= round(idle * sum(p.numel() for p in module.experts.parameters()))
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size
