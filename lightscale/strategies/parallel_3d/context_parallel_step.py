"""``parallel_3d``'s context-parallel step: each sample's sequence sharded over the ``cp`` ranks of its data shard,
attention computed exactly across them, for any model that calls ``F.scaled_dot_product_attention``.

What happens around each step call (training, validation, test), without touching the model's code:

* the batch (the data shard's, the same on every cp rank) is cut to this rank's tokens along each tensor's sequence
  dimension (the model contract's ``sequence_dims``, default dimension 1 of ``(tokens, targets)``), zigzag order;
* a :class:`~lightscale.parallel.context_parallel.ContextParallelAttention` mode routes every SDPA call to
  context-parallel attention over the cp group (blocks recomputed in backward by activation checkpointing re-enter
  it); the model reads its tokens' global positions from ``context_parallel.positions`` (a Hugging Face model is
  given them as ``position_ids``: lightscale/parallel/context_parallel/hf_positions.py);
* the first training step checks that the model called SDPA at all (else its attention saw only local tokens);
* the module's loss is its mean over the local tokens: equal token counts make the mean over cp ranks the global
  mean, and FSDP2 over ``dp_shard x cp`` averages the cp ranks' gradients.

Where Lightning's call order forces a trick: the module logs its loss inside ``training_step`` with ``self.log``,
before the strategy sees it, and that value is this rank's local mean. For the duration of a step call, values
logged without ``sync_dist`` are reduced over the cp group by the strategy's ``reduce`` (their ``reduce_fx``, mean
by default): Lightning's result collection's ``log`` is wrapped (an instance attribute, deleted after the call).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import moe_layers
from lightscale.parallel.context_parallel import ContextParallelAttention, Mode, check_sequence_length, shard_batch
from lightscale.parallel.context_parallel.hf_positions import feed_global_positions
from lightscale.parallel.contract import has_hook, sequence_dims_of
from lightscale.patches.lightning import logged_values_synced

Reduce = Callable[..., Any]


class ContextParallelStep:
    """The cp group's attention mode and batch sharding for ``module``'s steps (see the module docstring)."""

    def __init__(self, module: LightningModule, group: ProcessGroup, *, mode: Mode) -> None:
        self.module = module
        self.name = type(module).__name__  # before FSDP2 renames the class
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.attention = ContextParallelAttention(group, mode=mode)
        self._checked_calls = False
        self._position_hooks: list[RemovableHandle] = []
        self.attach()

    def attach(self) -> None:
        """Hook the module's Hugging Face models to receive global positions (again for validate/test after fit)."""
        if not self._position_hooks:
            self._position_hooks = feed_global_positions(self.module)

    def detach(self) -> None:
        """At the strategy's teardown: the user's model leaves carrying no hook of ours."""
        for hook in self._position_hooks:
            hook.remove()
        self._position_hooks = []

    @contextmanager
    def serving(self, trainer: Trainer, reduce: Reduce) -> Iterator[None]:
        """Attention routed and logged values reduced over the cp group, for one step call (predict is refused
        before: Parallel3DStrategy.setup_environment)."""
        self.attention.calls = 0
        with ExitStack() as stack:
            stack.enter_context(self.attention)
            stack.enter_context(logged_values_synced(trainer, reduce, self.group))
            yield

    def shard(self, batch: Any) -> Any:
        """This rank's tokens of the data shard's ``batch`` (a length not divisible by 2 x cp is refused here)."""
        return shard_batch(batch, sequence_dims_of(self.module, batch, name=self.name), self.cp, self.rank)

    def check_attention_called(self) -> None:
        """After the first training step: some rank's model called SDPA (one all-reduce, once)."""
        if self._checked_calls:
            return
        self._checked_calls = True
        calls = torch.tensor([self.attention.calls], dtype=torch.int64)
        dist.all_reduce(calls)
        check_attention_calls(int(calls), module_name=self.name, cp=self.cp)


def check_context_parallel_model(
    module: LightningModule, *, cp: int, tp: int, mode: str, sequence_length: int | None
) -> None:
    """Refuse, before any work, what cp cannot run exactly: a sequence length not divisible by 2 x cp (when known
    before the first batch), ulysses with heads (per tp rank) not divisible by cp, sequence-level MoE statistics."""
    if sequence_length is not None:
        check_sequence_length(sequence_length, cp)
    if mode == "ulysses" and has_hook(module, "transformer_shape"):
        shape = module.transformer_shape()  # type: ignore[attr-defined]
        heads = {"heads": shape.heads // tp, "kv_heads": (shape.kv_heads or shape.heads) // tp}
        bad = {name: count for name, count in heads.items() if count % cp}
        if bad:
            raise ConfigurationError(
                f"cp_mode='ulysses' splits each tensor-parallel rank's attention heads over cp={cp} ranks, and "
                f"{' and '.join(f'{n}/tp = {c}' for n, c in bad.items())} (tp={tp}) do not divide by {cp}. Use "
                "cp_mode='ring' or 'allgather' (no head constraint), or a cp that divides them."
            )


def check_context_parallel_moe(module: LightningModule, *, cp: int) -> None:
    """MoE statistics taken per sequence (capacity per sequence, the aux loss's per-sequence fractions) would be
    taken over a rank's part of each sequence: refused, naming the settings that stay exact."""
    for layer in moe_layers(module):
        config = layer.config
        if config.capacity_factor is not None or config.balance == "aux_loss":
            raise ConfigurationError(
                f"Context parallelism (cp={cp}) gives each rank part of every sequence, but this MoE layer computes "
                f"per-sequence statistics (capacity_factor={config.capacity_factor}, balance={config.balance!r}): "
                "capacity and the aux loss's token fractions would be taken over a rank's part of each sequence and "
                "differ from one process. Use dropless routing (capacity_factor: null) with balance: bias (a z-loss "
                "is fine), or cp=1."
            )


def check_attention_calls(calls: int, *, module_name: str, cp: int) -> None:
    """Refuse a model that made no SDPA call in a training step (``calls`` summed over every rank)."""
    if calls == 0:
        raise ConfigurationError(
            f"Context parallelism (cp={cp}) routes F.scaled_dot_product_attention across ranks, but {module_name} "
            "called it nowhere during the first training step: its attention (if any) saw only this rank's tokens "
            "of each sequence and would silently train on a different model. Compute attention with "
            "torch.nn.functional.scaled_dot_product_attention (is_causal=True or no mask), or use cp=1."
        )


def predict_refusal(cp: int) -> str:
    return (
        f"predict under context parallelism (cp={cp}) is not supported: each rank would return its own shard of "
        "every sequence. Predict with cp=1 (the checkpoint loads at any degree)."
    )
