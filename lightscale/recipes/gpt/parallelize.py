"""How the GPT recipe is parallelized: its tensor-parallel plan, its pipeline split and ``parallelize_gpt``.

This file is the worked example of writing a plan for your own model (docs/strategies/parallel_3d.md): the model
(model.py) knows nothing of parallelism; this file names its modules and says how each is sharded.

Tensor parallel (Megatron-LM, with sequence parallelism by default):
    * ``wq``/``wk``/``wv`` and ``w1`` column-wise, ``wo`` and ``w2`` row-wise: one collective per attention and
      one per MLP in forward, one each in backward;
    * token and position embeddings row-wise (vocabulary / position parallel);
    * the output head column-wise with logits left sharded over the vocabulary, for ``loss_parallel``;
    * with ``sequence_parallel`` the norms run on sequence shards (``SequenceParallel``) and the all-reduces
      become all-gather + reduce-scatter pairs.

Example:
    >>> parallelize_gpt(model, mesh)  # mesh: a DeviceMesh named like ParallelDims.build_mesh makes
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightscale.errors import ConfigurationError
from lightscale.parallel.parallelize import ParallelizeOptions, parallelize_model
from lightscale.parallel.pipeline import even_stage_split
from lightscale.parallel.tensor_parallel import TPPlan, validate_tp_plan
from lightscale.recipes.gpt.model import GPT, GPTConfig


def gpt_tp_plan(
    *, sequence_parallel: bool = True, loss_parallel: bool = True, config: GPTConfig | None = None
) -> TPPlan:
    """The GPT plan: module-name pattern -> ParallelStyle (see the module docstring). With ``config.moe`` the MoE
    layers get :func:`moe_tp_styles` and the dense MLPs are named one by one."""
    seq = Shard(1)  # activations between blocks: [batch, sequence, hidden], sharded on the sequence under SP
    between = seq if sequence_parallel else Replicate()
    positions = Shard(0) if sequence_parallel else Replicate()  # positions are [T] -> [T, D]: sequence is dim 0
    plan: TPPlan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=positions),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,  # loss_parallel's cross-entropy reads the vocab-sharded DTensor
        ),
    }
    # The attention and MLP take a replicated DTensor: their column-parallel projections then sum their input
    # gradients as one pending (Partial) DTensor, reduced once per module instead of once per wq/wk/wv (Megatron's
    # count). Under SP this is also where the sequence shards are gathered for the causal attention.
    gather = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_output=False)
    plan |= {"layers.*.attention": gather}
    moe = config.moe if config is not None else None
    if moe is None:
        plan |= _mlp_styles("layers.*.feed_forward", between, gather)
    else:
        for i in range(config.n_layer):
            name = f"layers.{i}.feed_forward"
            plan |= moe_tp_styles(name, between) if moe.is_moe_layer(i) else _mlp_styles(name, between, gather)
    if sequence_parallel:
        plan |= {
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "norm": SequenceParallel(),
        }
    return plan


def _mlp_styles(name: str, between: Placement, gather: PrepareModuleInput) -> TPPlan:
    return {
        f"{name}.w1": ColwiseParallel(),
        f"{name}.w2": RowwiseParallel(output_layouts=between),
        name: gather,
    }


def moe_tp_styles(name: str, between: Placement) -> TPPlan:
    """An MoE layer under tensor parallelism runs whole on every tp rank (its experts are not split over tp; they
    may be over ep): its input is gathered to the full sequence as a plain tensor, and its output, the same on
    every tp rank, is handed back as this rank's sequence shard. Its gradients are then the same on every tp rank:
    no reduction over tp is needed, as for any replicated weight."""
    return {
        name: PrepareModuleInputOutput(
            input_layouts=(between,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(between,),
            use_local_output=True,
        )
    }


def validate_gpt_parallel(config: GPTConfig, *, tp: int, num_stages: int) -> None:
    """Raise ConfigurationError if ``config`` cannot be split ``tp`` ways or into ``num_stages`` pipeline stages."""
    if tp > 1:
        sizes = {"n_head": config.n_head, "n_embd": config.n_embd}
        if config.n_kv_head is not None:  # grouped-query attention: the KV heads are split too
            sizes["n_kv_head"] = config.n_kv_head
        sizes |= {"vocab_size": config.vocab_size, "block_size": config.block_size}
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            valid = [d for d in range(1, 65) if all(size % d == 0 for size in sizes.values())]
            raise ConfigurationError(
                f"Tensor parallel degree tp={tp} must divide the attention heads, KV heads, hidden size, vocabulary "
                f"and block size; it does not divide {bad}. Valid tp for this model: {valid}."
            )
    if num_stages > 1 and config.tie_weights:
        raise ConfigurationError(
            "Pipeline parallelism puts the token embedding and the output head on different stages; this GPT ties "
            "them. Set model config `tie_weights: false` for pp > 1."
        )
    if num_stages > 1:
        gpt_stage_modules(config, num_stages)  # raises for layers that do not divide into stages


def validate_gpt_moe(config: GPTConfig, *, tp: int, num_stages: int) -> None:
    """MoE layers: losses the pipeline's loss_fn cannot see."""
    moe = config.moe
    if moe is None:
        return
    if num_stages > 1 and (moe.balance == "aux_loss" or moe.z_loss_coef):
        raise ConfigurationError(
            "Under pipeline parallelism the loss is computed from the last stage's output only, so the MoE "
            "auxiliary and z-losses of earlier stages would be lost: use balance: bias (no loss) with pp > 1."
        )


def validate_gpt_plan(config: GPTConfig, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Check the plan's patterns against the model's module names (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = GPT(config)
    plan = gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, config=config)
    validate_tp_plan(model, plan)


def gpt_stage_modules(config: GPTConfig, num_stages: int) -> list[list[str]]:
    """Module names of each pipeline stage: layers split evenly, embeddings first, final norm and head last."""
    layers = [f"layers.{i}" for i in range(config.n_layer)]
    return even_stage_split(layers, num_stages, first=["tok_embeddings", "pos_embeddings"], last=["norm", "output"])


def parallelize_gpt(
    model: GPT,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    options: ParallelizeOptions | None = None,
) -> GPT:
    """Parallelize a GPT (or a pipeline stage of it) by the one path: the GPT plan, then AC/compile, then FSDP2.

    For scripts and benchmarks outside Lightning; the strategies reach the same function through GPTModule's
    hooks. ``mesh`` has the axes of :meth:`ParallelDims.build_mesh`; axes of size 1 are skipped.
    """
    plan = gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, config=model.config)
    units = [layer for layer in model.layers.values() if layer is not None]
    return parallelize_model(model, mesh, units=units, options=options or ParallelizeOptions(), tp_plan=plan)
