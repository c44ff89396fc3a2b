"""The FSDP2 family on ``torch.distributed.fsdp.fully_shard``: fsdp2, fsdp2_grad_op, hsdp, fsdp2_offload.

=================  =================================================================  ==================
name               what is sharded                                                    ZeRO equivalent
=================  =================================================================  ==================
``fsdp2``          parameters, gradients, optimizer state; re-gathered in backward   ZeRO-3
``fsdp2_grad_op``  the same, but parameters stay gathered from forward to backward   ZeRO-2 (+ params)
``hsdp``           sharded within groups of ``dp_shard`` ranks, replicated across    ZeRO-3 x DDP
``fsdp2_offload``  as ``fsdp2``, shards, gradients and optimizer step on the CPU     ZeRO-3 offload
``fsdp2_zeropp``   as ``fsdp2``, weights and gradients sent as blockwise int8,        ZeRO++
                   secondary shards inside each node (lightscale/parallel/fsdp_wires.py)
=================  =================================================================  ==================

The model is built on the meta device in ``configure_model`` and materialized shard by shard after
sharding (values equal single-device init with the same seed); then activation checkpointing, optional
per-block compile and ``fully_shard`` are applied from outside (lightscale/parallel/). Checkpoints are
DCP directories (lightscale/checkpoint/portable.py) that load on any number of ranks.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.fault_tolerance.replica import replica_fault_tolerance
from lightscale.fault_tolerance.settings import FaultTolerance
from lightscale.fault_tolerance.sharded_replica import (
    ShardedFaultTolerantReplica,
    check_replicate_under_ft,
)
from lightscale.parallel.activation_checkpoint import ACMode, check_ac_mode
from lightscale.parallel.contract import data_parallel_roots, manual_optimization, sharding_units
from lightscale.parallel.fsdp import (
    no_gradient_sync,
)
from lightscale.parallel.fsdp_wires import GradientWire, WeightWire, ZeroPPOptions
from lightscale.parallel.mesh import ParallelDims, check_degrees
from lightscale.parallel.parallelize import ParallelizeOptions, apply_to_roots, built_on_meta, parallelize_model
from lightscale.plugins.fsdp_precision import float8_options, fsdp2_precision_plugin, mp_policy, precision_name
from lightscale.plugins.precision_contract import (
    FLOAT8,
    FLOAT8_CPU,
    Compression,
    PrecisionRules,
    check_compression,
    enforce_contract,
    float8_refused,
)
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.class_info import init_arguments


class FSDP2Strategy(LightscaleStrategy):
    """Fully sharded data parallelism with FSDP2: each unit (transformer block) one all-gather/reduce-scatter group.

    Args:
        unit_classes: class names of the modules sharded as one unit each (e.g. ``["TransformerBlock"]``);
            default: the LightningModule's ``sharding_units()`` hook, else the repeated blocks found in the model
            (lightscale/parallel/contract.py).
        reshard_after_forward: free gathered parameters after forward and re-gather in backward (ZeRO-3);
            ``False`` keeps them to backward (ZeRO-2-like: less communication, more memory).
        dp_replicate: replica groups (HSDP: gradients all-reduced across them); ``-1`` infers it.
        dp_shard: ranks each parameter is sharded over; ``-1`` (default) infers it from the world size.
        offload: keep shards, gradients and the optimizer step on the CPU (``CPUOffloadPolicy``).
        pin_memory: pin the offloaded shards (needs CUDA; default: on when CUDA is available).
        activation_checkpointing: ``"none"``, ``"full"`` (per unit) or ``"selective"`` (keep matmul outputs).
        compile: ``torch.compile`` each unit.
        meta_init: build the model on the meta device and materialize only local shards.
        compression: ``"bf16"``/``"fp16"`` reduce gradients in that dtype instead of fp32 (``reduce_dtype``), the
            same option as ``bucketed_ddp``'s (docs/plugins/precision.md).
        quantized_weights: ``"int8"`` all-gathers parameters as blockwise int8 + fp32 scales (ZeRO++ qwZ).
        quantized_gradients: ``"int8"``/``"int4"`` reduce-scatters gradients blockwise quantized, summed in fp32
            (ZeRO++ qgZ).
        secondary_shard: hpZ: after forward keep shards over groups of this many neighbouring ranks (``"node"``: the
            processes per node), so backward's all-gather stays inside a node (docs/strategies/fsdp2.md, ZeRO++).
        fault_tolerant: a :class:`~lightscale.FaultTolerance`: this launch is one replica sharding over its own ranks
            (``dp_replicate=1``; another value is refused); rank ``r`` averages its gradient shards with rank ``r`` of
            the other replicas through torchft each step (docs/fault_tolerance.md, hsdp).
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.

    Example:
        >>> Trainer(strategy=FSDP2Strategy(dp_replicate=2, activation_checkpointing="full"), devices=8)
    """

    # The standard meanings, realised by FSDP's MixedPrecisionPolicy; float8 on CUDA (torchao's emulation on CPU).
    precision_rules = PrecisionRules(
        "fsdp2",
        how={
            "bf16-mixed": "FSDP MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
            "16-mixed": "FSDP MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32) + ShardedGradScaler",
        },
        refused=float8_refused(FLOAT8_CPU, devices=("cpu",)),
    )
    aliases = {
        "fsdp2": ("FSDP2 full shard: params, grads, optimizer state sharded; reshard after forward (ZeRO-3)", {}),
        "fsdp2_grad_op": (
            "FSDP2 without resharding after forward: params kept gathered until backward (ZeRO-2-like)",
            {"reshard_after_forward": False},
        ),
        "hsdp": (
            "FSDP2 hybrid: shard within groups, replicate across dp_replicate groups (default 2)",
            {"dp_replicate": 2, "dp_shard": -1},
        ),
        "fsdp2_offload": ("FSDP2 full shard with shards, grads and optimizer step on the CPU", {"offload": True}),
        "fsdp2_zeropp": (
            "FSDP2 with ZeRO++: weights and gradients sent as blockwise int8, backward gathers inside each node",
            {"quantized_weights": "int8", "quantized_gradients": "int8", "secondary_shard": "node"},
        ),
    }
    plannable = (
        Plannable("fsdp2", "3Ψ", "+ parameters sharded, re-gathered in backward"),
        Plannable(
            "fsdp2", "3Ψ", "+ activations recomputed per block (a second forward)", activation_checkpointing="full"
        ),
        Plannable(
            "fsdp2_offload",
            "3Ψ + host",
            "+ states in host memory (the optimizer steps on the CPU)",
            activation_checkpointing="full",
        ),
    )
    memory_alternatives = (("fsdp2", None), ("fsdp2", "full"), ("fsdp2_offload", "full"))

    @override
    def memory_layout(self, world_size: int) -> Layout:
        """Every state sharded over ``dp_shard`` ranks (replicated over ``dp_replicate`` groups), offload to host."""
        dims = self.parallel_dims(world_size)
        return _fsdp2_layout(
            type(self).__name__, dims, self.offload, self.activation_checkpointing, self._secondary_size(dims.dp_shard)
        )

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """As ``memory_layout`` answers, from the parameters (without a Trainer: one node)."""
        p = init_arguments(cls, init_params)
        dims = ParallelDims(world_size=world_size, dp_replicate=p["dp_replicate"], dp_shard=p["dp_shard"])
        zeropp = ZeroPPOptions(p["quantized_weights"], p["quantized_gradients"], p["secondary_shard"])
        secondary = _secondary_size(zeropp, dims.dp_shard, per_node=0)  # 0: no devices known, as an instance
        return _fsdp2_layout(cls.__name__, dims, p["offload"], p["activation_checkpointing"], secondary)

    reads_single_files = False
    parameter_view = "dtensor"  # the optimizer steps DTensor shards (lightscale/optim/rule.py)

    def __init__(
        self,
        *,
        unit_classes: Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        offload: bool = False,
        pin_memory: bool | None = None,
        activation_checkpointing: ACMode = "none",
        compile: bool = False,
        meta_init: bool = True,
        compression: Compression = "none",
        quantized_weights: WeightWire = "none",
        quantized_gradients: GradientWire = "none",
        secondary_shard: int | Literal["node"] | None = None,
        fault_tolerant: FaultTolerance | bool = False,
        **kwargs: Any,
    ) -> None:
        ft = replica_fault_tolerance(fault_tolerant, compression=compression)
        super().__init__(**kwargs)
        check_replicate_under_ft(ft, dp_replicate)
        self.ft = ShardedFaultTolerantReplica(ft) if ft is not None else None
        check_compression(compression, self.precision_rules)
        self.zeropp = ZeroPPOptions(quantized_weights, quantized_gradients, secondary_shard)
        self.zeropp.check_with(reshard_after_forward=reshard_after_forward, compression=compression)
        check_ac_mode(activation_checkpointing)
        _check_offload(offload, pin_memory)
        check_degrees({"dp_replicate": dp_replicate, "dp_shard": dp_shard})  # at construction, not at setup
        self.unit_classes = tuple(unit_classes) if unit_classes is not None else None
        self.reshard_after_forward = reshard_after_forward
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.offload = offload
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.meta_init = meta_init
        self.compression = compression
        self._rng_state: dict[str, torch.Tensor] | None = None

    @property
    @override
    def per_step_replica(self) -> ShardedFaultTolerantReplica | None:
        return self.ft  # with fault_tolerant=: this launch, one replica sharding over its own ranks

    # ---- layout -------------------------------------------------------------------------------------------
    @override
    def parallel_dims(self, world_size: int) -> ParallelDims:
        dims = ParallelDims(world_size=world_size, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)
        self.zeropp.secondary_group_size(dp_shard=dims.dp_shard, per_node=self.num_processes)  # refused before work
        return dims

    # ---- the model -----------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:  # type: ignore[override]
        """Modules built in ``configure_model`` land on the meta device: no rank allocates the full model.

        Not under float8: materializing a converted Float8Linear would re-draw its weight with ``nn.Linear``'s
        init, not the model's, so the model is built on every rank as with ``meta_init=False``."""
        if not self.meta_init or float8_options(self.precision_plugin) is not None:
            yield
            return
        with built_on_meta() as self._rng_state:  # materialization replays init from here
            yield

    @override
    def configure_precision(self, plugin: Precision) -> Precision:
        name = precision_name(plugin)
        emulate = bool(float8 := float8_options(plugin)) and float8.emulate
        device, compression = self.root_device.type, self.compression
        enforce_contract(self.precision_rules, name, device_type=device, compression=compression, emulate=emulate)
        self._refuse_float8_with_zeropp(name)
        return fsdp2_precision_plugin(name, self.root_device.type, given=plugin)

    @override
    def check_before_launch(self, trainer: Trainer) -> None:
        self._refuse_float8_with_zeropp(precision_name(self.precision_plugin))

    def _refuse_float8_with_zeropp(self, precision: str) -> None:
        if precision in FLOAT8 and self.zeropp.enabled:
            raise ConfigurationError(
                f"precision={precision!r} already all-gathers float8 weights through torchao; ZeRO++'s quantized "
                "wires and secondary shards are not combined with it. Use precision='bf16-mixed' with ZeRO++, or drop "
                "quantized_weights, quantized_gradients and secondary_shard."
            )

    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        """Shard the network child, or the whole LightningModule when it holds parameters of its own (its steps
        then run through its ``__call__``, Lightning's forward redirection, so the root's hooks gather them); under
        manual optimization each child network instead (lightscale/parallel/contract.py data_parallel_roots)."""
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return module  # already sharded by an earlier fit/validate on this module
        self._roots = data_parallel_roots(module, strategy=type(self).__name__)  # refused before any work
        options = ParallelizeOptions(
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            mp_policy=mp_policy(precision_name(self.precision_plugin), self.compression),
            float8=float8_options(self.precision_plugin),
            offload_policy=CPUOffloadPolicy(pin_memory=self.pin_memory) if self.offload else None,
            reshard_after_forward=self._reshard_after_forward(),
            root_reshard_after_forward=manual_optimization(module),
            always_shard=True,
            zeropp=self.zeropp if self.zeropp.enabled else None,
        )
        apply_to_roots(
            module,
            self._roots,
            sharding_units(module, unit_classes=self.unit_classes),
            lambda root, units: parallelize_model(root, self.device_mesh, units=units, options=options),
            device=torch.device("cpu") if self.offload else self.root_device,
            rng_state=lambda: self.broadcast(self._rng_state),
        )
        return module

    def _reshard_after_forward(self) -> bool | int:
        """hpZ: reshard the units to the secondary group size after forward (FSDP2's ``reshard_after_forward=N``)."""
        return self._secondary_size(self.dims.dp_shard) or self.reshard_after_forward

    def _secondary_size(self, dp_shard: int) -> int | None:
        return _secondary_size(self.zeropp, dp_shard, per_node=self.num_processes)

    @override
    def model_to_device(self) -> None:
        pass  # apply_parallelism places (or materializes) the shards

    @override
    def gradient_sync_context(self) -> AbstractContextManager:
        return no_gradient_sync(self.model)

    # ---- checkpoints -------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are saved by save_checkpoint through DCP; nothing is gathered

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and "://" in str(filepath):  # an fsspec URL: its completion marker goes first
            self.checkpoint_io.remove_checkpoint(filepath)
        elif self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)


def _check_offload(offload: bool, pin_memory: bool | None) -> None:
    if offload and pin_memory and not torch.cuda.is_available():
        raise ConfigurationError(
            "offload=True with pin_memory=True needs CUDA: pinned host memory only exists for an accelerator. "
            "Use pin_memory=False (or leave it unset) on a CPU-only machine."
        )


def _secondary_size(zeropp: ZeroPPOptions, dp_shard: int, *, per_node: int) -> int | None:
    """The hpZ group size, or None where there is none (not asked, one rank per node, or one node: the primary
    shards already are the secondary ones). ``"node"`` without a Trainer (the estimator) counts as one node."""
    size = zeropp.secondary_group_size(dp_shard=dp_shard, per_node=per_node)
    return size if size is not None and 1 < size < dp_shard else None


def _fsdp2_layout(
    name: str, dims: ParallelDims, offload: bool, activation_checkpointing: ACMode, secondary: int | None
) -> Layout:
    return Layout(
        name,
        dims.world_size,
        shard_optimizer=True,
        shard_gradients=True,
        shard_parameters=True,
        dp_shard=dims.dp_shard,
        dp_replicate=dims.dp_replicate,
        offload_optimizer=offload,
        offload_parameters=offload,
        activation_checkpointing=activation_checkpointing,
        secondary_shard=secondary or 1,
    )
