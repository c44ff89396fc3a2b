"""A single-device mixture-of-experts feed-forward layer: fp32 router, stacked expert weights, optional shared expert.

The layer is parallelism-free: it routes tokens, sorts the kept token copies by expert and calls
``self.experts(tokens, counts)`` on them. Expert parallelism (lightscale/parallel/experts.py) hooks that one call
from outside (all-to-all dispatch before it, combine after it), so one forward serves one device and many.

Routing: scores are ``softmax`` or ``sigmoid`` of fp32 logits, the top-k experts are chosen (on scores plus the
balancing bias under ``balance="bias"``), and gate weights come from the unbiased scores (renormalized over the
k choices when k > 1).

Token dropping (``capacity_factor`` set; the default ``None`` is dropless): each expert takes at most
``ceil(capacity_factor * T * k / E)`` token copies of each sequence of T tokens. Within a sequence every
first choice comes before any second choice (GShard's priority), then earlier positions first; a dropped copy adds
nothing (the residual carries the token). Capacity per sequence keeps decisions independent of how the batch is
split over ranks, so data-parallel and expert-parallel runs drop exactly the tokens one process drops.

Balancing: ``aux_loss`` adds ``coef * E * sum_e f_e * P_e`` per sequence (Switch/GShard; f = fraction of copies
routed to e, P = mean routing probability of e), averaged over sequences; ``bias`` (DeepSeek-V3, no loss) moves a
per-expert bias by ``bias_update_rate`` against the sign of its load once per optimizer step
(:func:`update_router_biases`); ``none`` does neither. ``z_loss_coef`` adds the router z-loss.

Example:
    >>> moe = MoE(64, MoEConfig(n_experts=4, top_k=2))
    >>> moe(torch.randn(2, 8, 64)).shape
    torch.Size([2, 8, 64])
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightscale.layers.grouped_mm import check_expert_widths, grouped_mlp

BALANCE_MODES = ("aux_loss", "bias", "none")
_COUNTING = [True]  # False while a pipeline infers its shapes with an extra forward (not a training token)
SCORES = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """Options of the MoE feed-forward layers; validated at construction (a bad YAML fails before any tensor)."""

    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # every n-th transformer block is MoE (the last of each group of n)
    n_shared_experts: int = 0
    hidden: int | None = None  # expert MLP width; default 4 x the model width
    capacity_factor: float | None = None  # None: dropless
    balance: Literal["aux_loss", "bias", "none"] = "bias"
    score: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    bias_update_rate: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.n_shared_experts < 0 or (self.hidden is not None and self.hidden <= 0):
            raise ValueError(f"need n_shared_experts >= 0 and hidden > 0, got {self.n_shared_experts}, {self.hidden}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {self.capacity_factor}")
        if self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, got {self.balance!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if min(self.aux_loss_coef, self.z_loss_coef, self.bias_update_rate) < 0:
            raise ValueError("aux_loss_coef, z_loss_coef and bias_update_rate must be >= 0")

    def is_moe_layer(self, index: int) -> bool:
        return index % self.moe_every == self.moe_every - 1

    def capacity(self, seq_len: int) -> int:
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a parameter (expert parallelism makes the stacked weights DTensors sharded on experts)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Router(nn.Module):
    """fp32 scores and top-k choice; ``expert_bias`` is the aux-loss-free balancing bias (a buffer, checkpointed)."""

    def __init__(self, dim: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_experts, dim))
        self.register_buffer("expert_bias", torch.zeros(config.n_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def reset_buffers(self) -> None:
        """Zero bias (also after building on the meta device: FSDP2's materialization calls this)."""
        with torch.no_grad():
            self.expert_bias.zero_()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``x [N, D]`` -> (logits [N, E], probabilities [N, E], chosen experts [N, k], gate weights [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.config.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.config.balance == "bias" else scores
        experts = choice.topk(self.config.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.config.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        probs = scores if self.config.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return logits, probs, experts, weights


class GroupedExperts(nn.Module):
    """E GELU MLPs as stacked weights ``w1 [E, D, H]``, ``w2 [E, H, D]``, run by grouped GEMM
    (lightscale/layers/grouped_mm.py): one kernel per weight for all experts, on every device and dtype."""

    def __init__(self, n_experts: int, dim: int, hidden: int, *, out_std: float = 0.02) -> None:
        super().__init__()
        check_expert_widths(dim, hidden)
        self.out_std = out_std
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w1, mean=0.0, std=0.02)
        nn.init.normal_(self.w2, mean=0.0, std=self.out_std)

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        """``tokens`` sorted by expert, ``counts[e]`` of them for local expert e -> expert outputs, same order."""
        # In the tokens' dtype: under mixed precision FSDP casts the dense weights, but expert-parallel experts
        # outside FSDP stay fp32 (a no-op in fp32 training).
        w1, w2 = local(self.w1).to(tokens.dtype), local(self.w2).to(tokens.dtype)
        return grouped_mlp(tokens, counts, w1, w2)


def capacity_mask(experts: Tensor, n_experts: int, capacity: int) -> Tensor:
    """``experts [B, T, k]`` -> bool mask of the copies each expert admits (first choices first, then position)."""
    batch, seq, k = experts.shape
    slot_major = experts.transpose(1, 2).reshape(batch, k * seq)
    onehot = F.one_hot(slot_major, n_experts)
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # how many copies the expert took before this one
    return (position < capacity).view(batch, k, seq).transpose(1, 2)


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing a transformer block's MLP: ``x [B, T, D] -> [B, T, D]``.

    After each forward: ``aux_loss`` (a scalar to add to the training loss, zero unless ``aux_loss``/``z_loss``),
    ``counts`` (copies routed to each expert, before dropping) and ``dropped`` (copies dropped). ``load`` sums
    ``counts`` until the optimizer step that updates the bias.
    """

    def __init__(self, dim: int, config: MoEConfig, *, out_std: float = 0.02) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden or 4 * dim
        self.router = Router(dim, config)
        self.experts = GroupedExperts(config.n_experts, dim, hidden, out_std=out_std)
        self.shared_expert = None
        if config.n_shared_experts:
            self.shared_expert = GroupedExperts(1, dim, hidden * config.n_shared_experts, out_std=out_std)
        self.register_buffer("load", torch.zeros(config.n_experts), persistent=False)
        self.aux_loss = torch.zeros(())
        self.counts = torch.zeros(config.n_experts)
        self.dropped = 0

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.load.zero_()

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        k, n_experts = self.config.top_k, self.config.n_experts
        flat = x.reshape(-1, dim)
        logits, probs, experts, weights = self.router(flat)
        kept = torch.ones_like(experts, dtype=torch.bool)
        if self.config.capacity_factor is not None:
            kept = capacity_mask(experts.view(batch, seq, k), n_experts, self.config.capacity(seq)).reshape(-1, k)
        target = torch.where(kept, experts, n_experts).flatten()  # dropped copies sort last, past every expert
        order = torch.argsort(target, stable=True)
        counts = torch.bincount(target, minlength=n_experts + 1)[:n_experts]
        order = order[: int(counts.sum())]
        token = order // k
        routed = self.experts(flat[token], counts)
        gates = weights.flatten()[order].unsqueeze(1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed * gates)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat, torch.tensor([flat.shape[0]]))
        self._record(logits, probs, experts.view(batch, seq, k), int(kept.numel() - kept.sum()))
        return out.view(batch, seq, dim)

    def _record(self, logits: Tensor, probs: Tensor, experts: Tensor, dropped: int) -> None:
        n_experts = self.config.n_experts
        per_sequence = F.one_hot(experts, n_experts).sum((1, 2)).float()  # [B, E] copies routed per sequence
        counts = per_sequence.sum(0).detach()
        if torch.is_grad_enabled() and _COUNTING[0]:
            self.load += counts
        self.counts, self.dropped = counts, dropped
        aux = logits.new_zeros(())
        if self.config.balance == "aux_loss" and self.config.aux_loss_coef:
            f = per_sequence / per_sequence.sum(-1, keepdim=True)
            p = probs.view(*experts.shape[:2], n_experts).mean(1)
            aux = aux + self.config.aux_loss_coef * n_experts * (f * p).sum(-1).mean()
        if self.config.z_loss_coef:
            aux = aux + self.config.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()
        self.aux_loss = aux


@contextmanager
def load_not_counted() -> Iterator[None]:
    """Forwards in this context do not add to the balancing load (e.g. a pipeline stage's shape inference)."""
    _COUNTING[0] = False
    try:
        yield
    finally:
        _COUNTING[0] = True


def moe_layers(model: nn.Module) -> list[MoE]:
    return [module for module in model.modules() if isinstance(module, MoE)]


@torch.no_grad()
def update_router_biases(
    layers: Sequence[MoE | None], *, n_experts: int, group: dist.ProcessGroup | None = None
) -> None:
    """Move each ``bias``-balanced layer's expert bias against its load since the last update (sign rule,
    DeepSeek-V3), then reset the load. Call once per optimizer step on every rank with the same-length list
    (``None`` for a layer another pipeline stage holds): loads are summed over ``group`` (default all ranks), so
    every rank's bias stays the same."""
    loads = torch.stack([layer.load if layer is not None else torch.zeros(n_experts) for layer in layers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loads, group=group)
    for layer, load in zip(layers, loads, strict=True):
        if layer is not None and layer.config.balance == "bias":
            layer.router.expert_bias += layer.config.bias_update_rate * torch.sign(load.mean() - load)
            layer.load.zero_()


def load_imbalance(counts: Tensor) -> float:
    """max / mean tokens per expert (1.0 is perfectly balanced)."""
    return float(counts.max() / counts.mean().clamp_min(1e-9))
