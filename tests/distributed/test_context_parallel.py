"""Context parallelism in ``parallel_3d`` reproduces one process step by step (fp32, plain SGD), alone and composed.

The single-process run trains on the whole global batch; under ``cp`` every rank of a data shard reads the same
samples and trains on its zigzag half of each sequence, attention computed across the ranks. Each rank's own loss is
its mean over its tokens (equal token counts: the mean over ranks is the global loss), and the loss the module logs is
reduced over cp (dp = 1: the global loss itself). Two models: the GPT recipe and a language model written here (RoPE
fed by ``context_parallel.positions``, grouped K/V heads), whose gradients are compared too.
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import SGD_LR, TINY, SGDGPTModule, StepLosses, quiet_trainer, relative_difference, train_tiny_gpt
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.callbacks import MemoryProfiler
from lightscale.estimate.activations import context_parallel_extra_bytes
from lightscale.layers.moe import MoEConfig
from lightscale.parallel.context_parallel import positions
from lightscale.recipes.gpt import GPTDataModule
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import RankFailed, run_distributed

TOLERANCE = 1e-5  # relative, per step (measured ~1e-7 in fp32)
STEPS = 8
GLOBAL_BATCH = 8
PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
MOE = dataclasses.replace(TINY, moe=MoEConfig(n_experts=4, top_k=2, balance="bias", z_loss_coef=1e-3))
CONFIGS = {"tiny": TINY, "pipelined": PIPELINED, "moe": MOE}


class LoggedLoss(pl.Callback):
    """What the module logged as ``train/loss`` at every step (the value a user sees)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


def _gpt(
    strategy: Any, config: str, cache_dir: str, *, data_shards: int, accumulate: int = 1, clip: float | None = None
) -> dict[str, Any]:
    logged = LoggedLoss()
    losses = train_tiny_gpt(
        strategy,
        devices=dist.get_world_size(),
        batch_size=GLOBAL_BATCH // data_shards // accumulate,
        accumulate=accumulate,
        max_steps=STEPS,
        config=CONFIGS[config],
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        local_losses=True,
        extra_callbacks=[logged],
        gradient_clip_val=clip,
    )
    return {"losses": losses, "logged": logged.values}


@cache
def _gpt_reference(config: str, cache_dir: str, clip: float | None = None) -> dict[str, Any]:
    return run_distributed(_gpt, "auto", config, cache_dir, data_shards=1, clip=clip, world_size=1)[0]


def _fit_gpt(strategy: Any, ranks: int, cache_dir: str, *, config: str = "tiny", data_shards: int = 1, **kwargs: Any):
    runs = run_distributed(
        _gpt, strategy, config, cache_dir, data_shards=data_shards, world_size=ranks, timeout_s=600, **kwargs
    )
    losses = [sum(step) / ranks for step in zip(*(run["losses"] for run in runs), strict=True)]
    return losses, runs[0]["logged"]


@pytest.mark.parametrize("mode", ["ring", "allgather", "ulysses"])
def test_cp2_matches_one_process(mode: str, corpus_cache: str) -> None:
    reference = _gpt_reference("tiny", corpus_cache)
    losses, logged = _fit_gpt(Parallel3DStrategy(cp=2, cp_mode=mode), 2, corpus_cache)
    assert relative_difference(losses, reference["losses"]) <= TOLERANCE
    # The loss the module logs (each rank's local mean) is reduced over cp: the user sees the global loss.
    assert relative_difference(logged, reference["losses"]) <= TOLERANCE
    assert reference["losses"][-1] < reference["losses"][0] - 1.0  # it learned: the comparison is not vacuous


@pytest.mark.parametrize(
    ("strategy", "config", "data_shards"),
    [
        (Parallel3DStrategy(cp=2, dp=2), "tiny", 2),  # FSDP2 over dp_shard x cp = 4 ranks
        (Parallel3DStrategy(cp=2, dp=2, dp_mode="replicate"), "tiny", 2),  # HSDP: (dp_replicate, cp)
        (Parallel3DStrategy(cp=2, tp=2), "tiny", 1),  # sequence + loss parallel inside each cp rank
        (Parallel3DStrategy(cp=2, pp=2), "pipelined", 1),  # 1f1b, 2 microbatches of sequence shards
        (Parallel3DStrategy(cp=2, pp=2, schedule="zbv"), "pipelined", 1),  # zero bubble: backward split in two
        # Blocks recomputed inside the schedule's backward, the step's cp attention still active: re-entered.
        (Parallel3DStrategy(cp=2, pp=2, activation_checkpointing="full"), "pipelined", 1),
        (Parallel3DStrategy(cp=2, ep=2), "moe", 2),  # experts over ep, FSDP2 over dp_shard x cp for them
    ],
    ids=["cp2_dp2", "cp2_dp2_replicate", "cp2_tp2", "cp2_pp2", "cp2_pp2_zbv", "cp2_pp2_full_ac", "cp2_ep2_moe"],
)
def test_cp2_composes_on_four_ranks(strategy: Any, config: str, data_shards: int, corpus_cache: str) -> None:
    reference = _gpt_reference(config, corpus_cache)
    losses, _ = _fit_gpt(strategy, 4, corpus_cache, config=config, data_shards=data_shards)
    assert relative_difference(losses, reference["losses"]) <= TOLERANCE


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_cp2_with_accumulation_and_activation_checkpointing(checkpointing: str, corpus_cache: str) -> None:
    # Checkpointed blocks are recomputed in backward, outside the step: they re-enter the cp attention.
    strategy = Parallel3DStrategy(cp=2, cp_mode="allgather", activation_checkpointing=checkpointing)
    losses, _ = _fit_gpt(strategy, 2, corpus_cache, accumulate=2)
    assert relative_difference(losses, _gpt_reference("tiny", corpus_cache)["losses"]) <= TOLERANCE


def test_cp2_tp2_clipping_uses_the_global_norm(corpus_cache: str) -> None:
    # With SGD a clipped step is a shorter step: a norm over one cp (or tp) rank's shards would clip differently.
    clipped = _gpt_reference("tiny", corpus_cache, clip=0.5)["losses"]
    assert relative_difference(clipped, _gpt_reference("tiny", corpus_cache)["losses"]) > 100 * TOLERANCE
    losses, _ = _fit_gpt(Parallel3DStrategy(cp=2, tp=2), 4, corpus_cache, clip=0.5)
    assert relative_difference(losses, clipped) <= TOLERANCE


class PlantedPermutation(Parallel3DStrategy):
    """cp2 whose attention believes the tokens are in contiguous order while the batch is cut zigzag: the
    permutation is never undone."""

    def apply_parallelism(self, module: Any) -> Any:
        parallelized = super().apply_parallelism(module)
        assert self.context_parallel is not None
        self.context_parallel.attention.layout = "contiguous"
        return parallelized


def test_a_planted_permutation_error_fails(corpus_cache: str) -> None:
    reference = _gpt_reference("tiny", corpus_cache)
    losses, _ = _fit_gpt(PlantedPermutation(cp=2), 2, corpus_cache)
    assert relative_difference(losses, reference["losses"]) > 100 * TOLERANCE


# ---- a language model written here: RoPE from context_parallel.positions, grouped K/V heads ------------------------
ROPE_BASE = 100.0
VOCAB, SEQ, SAMPLES = 64, 32, GLOBAL_BATCH  # one global batch: every step trains on it, whatever the sample order


def rope(x: Tensor, pos: Tensor) -> Tensor:
    """Rotary position embedding of ``x [B, H, T, D]`` at positions ``pos [T]``."""
    half = x.shape[-1] // 2
    angle = pos.float()[:, None] * torch.pow(ROPE_BASE, -torch.arange(half, device=x.device) / half)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, attention: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim, self.attention = heads, kv_heads, width // heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * kv_heads * self.dim)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        for projection in (self.q, self.kv):  # sharp attention from the start: positions matter at once
            nn.init.normal_(projection.weight, std=0.3)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        h = self.norm1(x)
        q = self.q(h).view(batch, seq, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(h).view(batch, seq, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        pos = torch.arange(seq) if self.attention == "local_positions" else positions(seq, device=x.device)
        q, k = rope(q, pos), rope(k, pos)
        y = self._attend(q, k, v)
        x = x + self.out(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.norm2(x))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.attention == "manual":  # attention by hand: context parallelism cannot see it
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.dim)
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        if self.attention == "masked":  # a padding-style boolean mask instead of is_causal
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class TinyLM(pl.LightningModule):
    """No lightscale hook: sharding units inferred, (tokens, targets) batches sharded along dimension 1."""

    def __init__(self, attention: str = "sdpa", width: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv_heads, attention) for _ in range(2))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Gradients(pl.Callback):
    """Every parameter's whole gradient at every optimizer step (sharded ones gathered)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = {name: p.grad for name, p in pl_module.named_parameters()}
        self.steps.append({n: g.full_tensor() if isinstance(g, DTensor) else g.clone() for n, g in grads.items()})


def _tiny_lm(strategy: Any, *, data_shards: int, attention: str = "sdpa", seq: int = SEQ) -> dict[str, Any]:
    pl.seed_everything(3, verbose=False)
    tokens = torch.randint(0, VOCAB, (SAMPLES, seq + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // data_shards)
    losses, gradients = StepLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices=dist.get_world_size(), max_steps=4, callbacks=[losses, gradients])
    trainer.fit(TinyLM(attention), loader)
    return {"losses": losses.local, "gradients": gradients.steps, "logged": float(trainer.callback_metrics["loss"])}


@cache
def _tiny_lm_reference() -> dict[str, Any]:
    return run_distributed(_tiny_lm, "auto", data_shards=1, world_size=1)[0]


def _gradient_error(a: list[dict[str, Tensor]], b: list[dict[str, Tensor]]) -> float:
    return max(float((x[n] - y[n]).abs().max() / y[n].abs().max()) for x, y in zip(a, b, strict=True) for n in y)


@pytest.mark.parametrize(
    ("strategy", "ranks", "data_shards"),
    [(Parallel3DStrategy(cp=2), 2, 1), (Parallel3DStrategy(cp=2, cp_mode="ulysses", dp=2), 4, 2)],
    ids=["cp2_ring", "cp2_ulysses_dp2"],
)
def test_a_users_model_matches_losses_and_gradients(strategy: Any, ranks: int, data_shards: int) -> None:
    reference = _tiny_lm_reference()
    runs = run_distributed(_tiny_lm, strategy, data_shards=data_shards, world_size=ranks, timeout_s=600)
    losses = [sum(step) / ranks for step in zip(*(run["losses"] for run in runs), strict=True)]
    assert relative_difference(losses, reference["losses"]) <= TOLERANCE
    assert _gradient_error(runs[0]["gradients"], reference["gradients"]) <= TOLERANCE
    if data_shards == 1:
        assert runs[0]["logged"] == pytest.approx(reference["logged"], rel=TOLERANCE)


def test_a_model_ignoring_global_positions_fails_by_far() -> None:
    # RoPE fed arange(local length): every rank's tokens rotated as if they began the sequence.
    reference = _tiny_lm_reference()
    runs = run_distributed(_tiny_lm, Parallel3DStrategy(cp=2), data_shards=1, attention="local_positions", world_size=2)
    losses = [sum(step) / 2 for step in zip(*(run["losses"] for run in runs), strict=True)]
    assert relative_difference(losses, reference["losses"]) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("attention", "seq", "match"),
    [
        ("manual", SEQ, r"called it nowhere during the first training step"),
        ("masked", SEQ, r"attn_mask tensor of shape \(16, 16\) \(dtype torch.bool\)"),
        ("sdpa", 30, r"Sequence length 30 is not divisible by 2 \* cp = 4 \(cp=2\).*\(e.g. 32\)"),  # first batch
    ],
    ids=["no_sdpa_call", "mask", "sequence_length"],
)
def test_what_cp_cannot_run_is_refused(attention: str, seq: int, match: str) -> None:
    with pytest.raises(RankFailed, match=match):
        run_distributed(_tiny_lm, Parallel3DStrategy(cp=2), data_shards=1, attention=attention, seq=seq, world_size=2)


def _predict(cache_dir: str) -> None:
    trainer = quiet_trainer(Parallel3DStrategy(cp=2), devices=2, max_steps=1)
    trainer.predict(SGDGPTModule(TINY), GPTDataModule(block_size=32, batch_size=2, cache_dir=cache_dir))


def test_predict_is_refused(corpus_cache: str) -> None:
    with pytest.raises(RankFailed, match=r"predict under context parallelism \(cp=2\) is not supported"):
        run_distributed(_predict, corpus_cache, world_size=2)


def _gpt_with_block_size(block_size: int, cache_dir: str) -> None:
    trainer = quiet_trainer(Parallel3DStrategy(cp=2), devices=2, max_steps=1)
    data = GPTDataModule(block_size=block_size, batch_size=2, cache_dir=cache_dir)
    trainer.fit(SGDGPTModule(TINY), data)


def test_a_datamodules_block_size_is_checked_before_training(corpus_cache: str) -> None:
    with pytest.raises(RankFailed, match=r"Sequence length 30 is not divisible by 2 \* cp = 4") as error:
        run_distributed(_gpt_with_block_size, 30, corpus_cache, world_size=2)
    assert "setup_environment" in str(error.value)  # at start-up, before the model is built


# ---- memory: what each rank saves for backward -------------------------------------------------------------------
def _saved_activations(strategy: Any, cache_dir: str, out_dir: str) -> tuple[float, float]:
    profiler = MemoryProfiler(every_n_steps=1, out_dir=out_dir, plot=False)
    train_tiny_gpt(
        strategy,
        devices=dist.get_world_size(),
        batch_size=2,
        max_steps=2,
        config=TINY,
        cache_dir=cache_dir,
        extra_callbacks=[profiler],
    )
    assert profiler.estimate is not None
    return profiler.records[-1]["activations"], profiler.estimate.activations.total


def test_saved_activations_per_rank_at_cp2(corpus_cache: str, tmp_path: Any) -> None:
    """Ring: exactly half of one process's (every saved tensor is per token; backward sends K/V around again).
    Allgather keeps the gathered K/V of the whole sequence; ulysses a second copy of each attention output (torch's
    attention keeps it in head shards, the output projection in sequence shards) and the sequence permutation."""
    whole, _ = run_distributed(_saved_activations, Parallel3DStrategy(), corpus_cache, str(tmp_path), world_size=1)[0]
    shape = SGDGPTModule(TINY).transformer_shape()
    ratios = {}
    for mode in ("ring", "allgather", "ulysses"):
        strategy = Parallel3DStrategy(cp=2, cp_mode=mode)
        extra = TINY.n_layer * context_parallel_extra_bytes(shape, strategy.memory_layout(2), micro_batch=2, e=4)
        per_rank = run_distributed(_saved_activations, strategy, corpus_cache, str(tmp_path), world_size=2)
        for measured, estimate in per_rank:
            # Up to the token ids' storage (a window of seq + 1 tokens at cp = 1) and the loss scalar.
            assert abs(measured - whole / 2 - extra) <= 64, (mode, measured, whole)
            assert measured == pytest.approx(estimate, rel=1e-3)
        ratios[mode] = measured / whole
    assert ratios == pytest.approx({"ring": 0.5, "allgather": 0.547, "ulysses": 0.526}, abs=1e-3)  # docs' figures
