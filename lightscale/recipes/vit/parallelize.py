"""How the ViT recipe is parallelized: its tensor-parallel plan and its pipeline split (see the GPT recipe's).

Tensor parallel, the GPT plan's styles:
    * ``wq``/``wk``/``wv`` and ``w1`` column-wise, ``wo`` and ``w2`` row-wise (one collective per attention and
      per MLP each way);
    * the embeddings (a small patch projection, position table, class token) and the head stay replicated;
    * with ``sequence_parallel`` the block norms run on sequence shards: the first block's input is split over
      the patch sequence and the final norm's input gathered back whole before pooling.

Example:
    >>> plan = vit_tp_plan(sequence_parallel=True)
    >>> apply_tp_plan(model, mesh["tp"], plan)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from lightscale.errors import ConfigurationError
from lightscale.parallel.pipeline import even_stage_split
from lightscale.parallel.tensor_parallel import TPPlan, validate_tp_plan
from lightscale.recipes.vit.model import ViT, ViTConfig


def block_tp_plan(prefix: str, *, sequence_parallel: bool) -> TPPlan:
    """Megatron attention + MLP styles for every block under ``prefix`` (``layers`` or ``text.layers``)."""
    between = Shard(1) if sequence_parallel else Replicate()
    gather = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_output=False)
    plan: TPPlan = {
        f"{prefix}.*.attention.wq": ColwiseParallel(),
        f"{prefix}.*.attention.wk": ColwiseParallel(),
        f"{prefix}.*.attention.wv": ColwiseParallel(),
        f"{prefix}.*.attention.wo": RowwiseParallel(output_layouts=between),
        f"{prefix}.*.feed_forward.w1": ColwiseParallel(),
        f"{prefix}.*.feed_forward.w2": RowwiseParallel(output_layouts=between),
        f"{prefix}.*.attention": gather,
        f"{prefix}.*.feed_forward": gather,
    }
    if sequence_parallel:
        plan |= {f"{prefix}.*.attention_norm": SequenceParallel(), f"{prefix}.*.ffn_norm": SequenceParallel()}
    return plan


def sequence_entry_exit(first: str, last: str) -> TPPlan:
    """Split the replicated sequence entering ``first`` and gather it back before ``last`` (sequence parallel)."""
    split = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
    whole = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    return {first: split, last: whole}


def vit_tp_plan(*, sequence_parallel: bool = True, loss_parallel: bool = False) -> TPPlan:
    """The ViT plan (``loss_parallel`` is accepted for the contract; ten classes are not worth sharding)."""
    plan = block_tp_plan("layers", sequence_parallel=sequence_parallel)
    return plan | (sequence_entry_exit("layers.0", "norm") if sequence_parallel else {})


def validate_vit_parallel(config: ViTConfig, *, tp: int, num_stages: int, sequence_parallel: bool) -> None:
    """Raise ConfigurationError if ``config`` cannot be split ``tp`` ways or into ``num_stages`` pipeline stages."""
    if tp > 1:
        sizes = {"n_head": config.n_head, "n_embd": config.n_embd}
        if sequence_parallel:
            sizes["sequence (patches + class token)"] = config.seq_len
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            raise ConfigurationError(
                f"Tensor parallel degree tp={tp} must divide {list(sizes)}; it does not divide {bad}. "
                "Use another tp, pool='mean' (no class token) or sequence_parallel=False."
            )
        with torch.device("meta"):
            validate_tp_plan(ViT(config), vit_tp_plan(sequence_parallel=sequence_parallel))
    if num_stages > 1:
        vit_stage_modules(config, num_stages)  # raises for layers that do not divide into stages


def vit_stage_modules(config: ViTConfig, num_stages: int) -> list[list[str]]:
    """Module names of each pipeline stage: blocks split evenly, embeddings first, norm and head last."""
    layers = [f"layers.{i}" for i in range(config.n_layer)]
    last = ["norm", "head"] if config.num_classes else ["norm"]
    return even_stage_split(layers, num_stages, first=["embed"], last=last)
