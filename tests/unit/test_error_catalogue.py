"""The bad-input catalogue: every bad setting is refused before any work, naming the bad value and valid ones.

One table drives both the tests and docs/errors.md. Regenerate the page after changing the table or a message:
``LIGHTSCALE_UPDATE_ERRORS=1 pytest tests/unit/test_error_catalogue.py``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@dataclass(frozen=True)
class Bad:
    id: str
    description: str
    trigger: Callable[[], object]
    error: type[BaseException]
    match: str  # regex searched in the message: names the bad value and a valid alternative


def _checkpoint_location(path: object) -> object:
    from lightscale.storage.urls import checkpoint_location

    return checkpoint_location(path)


def _unmarked_remote_checkpoint() -> object:
    """DeepSpeed's directory in memory://, every file but the marker: loaders refuse it before downloading anything."""
    import fsspec

    from lightscale.checkpoint.lightning_format import lightning_checkpoint

    fsspec.filesystem("memory").pipe("/unmarked/last.ckpt/checkpoint/mp_rank_00_model_states.pt", b"half")
    return lightning_checkpoint("memory://unmarked/last.ckpt")


def _lightscale():
    import lightscale

    return lightscale


def _cfg(**kwargs):
    from lightscale.recipes.gpt import GPTConfig

    return GPTConfig(**kwargs)


def _ddp(**kwargs):
    from lightscale.strategies import BucketedDDPStrategy

    return BucketedDDPStrategy(**kwargs)


def _save_checkpoint_override():
    from lightscale.strategies import BucketedDDPStrategy

    class MyDDP(BucketedDDPStrategy):  # a user's subclass writing its own save
        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            super().save_checkpoint(checkpoint, filepath, storage_options)

    return MyDDP


def _p3d(**kwargs):
    from lightscale.strategies import Parallel3DStrategy

    return Parallel3DStrategy(**kwargs)


def _fsdp2(**kwargs):
    from lightscale.strategies import FSDP2Strategy

    return FSDP2Strategy(**kwargs)


def _dims(**kwargs):
    from lightscale.strategies import ParallelDims

    return ParallelDims(**kwargs)


def _zero(**kwargs):
    from lightscale.strategies.deepspeed.strategy import ZeroStrategy

    return ZeroStrategy(**kwargs)


def _ds_config(config):
    from lightscale.strategies.deepspeed.config import validate_user_config

    return validate_user_config(config)


def _gpt_parallel(config, tp, stages):
    from lightscale.recipes.gpt.parallelize import validate_gpt_parallel

    return validate_gpt_parallel(config, tp=tp, num_stages=stages)


def _tp_plan(plan):
    from lightscale.parallel.tensor_parallel import validate_tp_plan
    from lightscale.recipes.gpt import GPT

    with torch.device("meta"):
        model = GPT(_cfg())
    return validate_tp_plan(model, plan)


def _colwise():
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel()


def _too_many_devices():
    with mock.patch.dict(os.environ), mock.patch("torch.cuda.device_count", return_value=2):
        os.environ.pop("WORLD_SIZE", None)
        _lightscale().Trainer(strategy="bucketed_ddp", accelerator="cuda", devices=3)


def _unit_class(name):
    from lightscale.parallel.fsdp import check_unit_classes
    from lightscale.recipes.gpt import GPT

    with torch.device("meta"):
        model = GPT(_cfg(block_size=16, n_layer=2, n_head=2, n_embd=16))
    check_unit_classes(model, [name])


def _reducer():
    from lightscale.parallel import BucketedGradReducer

    BucketedGradReducer(torch.nn.Linear(2, 2), bucket_cap_mb=0)  # no process group exists: it never gets there


def _pinned_without_cuda():
    with mock.patch("torch.cuda.is_available", return_value=False):  # the same page on a machine with CUDA
        _fsdp2(offload=True, pin_memory=True)


def _cli(*args):
    from lightscale.cli import main

    main(["fit", "--config", "gpt/tiny_ddp.yaml", *args])


def _cli_bad_file():
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bad.yaml"
        config.write_text(
            "model:\n  class_path: lightscale.recipes.gpt.GPTModule\n  init_args:\n    learning_rat: 0.1\n"
        )
        _cli("--config", str(config))


def _resolve(name):
    from lightscale.cli import resolve_config

    resolve_config(name)


def _sampler(samples, batch_size, replicas):
    from lightscale.recipes.gpt.data import StreamSampler

    StreamSampler(list(range(samples)), batch_size=batch_size, num_replicas=replicas, rank=0)


def _windows(tokens, block_size):
    import numpy as np

    from lightscale.recipes.gpt.data import TokenWindows

    TokenWindows(np.arange(tokens, dtype=np.int64), block_size)


def _data(**kwargs):
    from lightscale.recipes.gpt.data import GPTDataModule

    GPTDataModule(**kwargs)


def _token_dir(header: tuple[int, int, int] | None = None, *, raw: bytes = b"", **kwargs):
    """GPTDataModule(data_dir=...).setup over a train.bin with llm.c ``header`` (+100 uint16 tokens) or ``raw``."""
    import numpy as np

    from lightscale.recipes.gpt.data import GPTDataModule
    from lightscale.recipes.gpt.token_files import write_token_file

    with tempfile.TemporaryDirectory() as tmp:
        if header is not None:
            ints = np.zeros(256, dtype="<i4")
            ints[:3] = header
            raw = ints.tobytes() + np.arange(100, dtype="<u2").tobytes()
        (Path(tmp) / "train.bin").write_bytes(raw)
        write_token_file(Path(tmp) / "val.bin", np.arange(100))
        GPTDataModule(data_dir=tmp if raw else str(Path(tmp) / "missing"), block_size=8, **kwargs).setup("fit")


def _without(module: str, call):
    """``call()`` as on a machine where the optional ``module`` is not installed."""
    import sys

    with mock.patch.dict(sys.modules, {module: None}):
        call()


def _vocab_past_model():
    import lightning.pytorch as pl

    from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule

    class BigVocab(GPTDataModule):  # as a tokenizer.json of 50257 tokens would declare
        def setup(self, stage: str) -> None:
            super().setup(stage)
            self.vocab_size = 50257

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False)
    with tempfile.TemporaryDirectory() as tmp:
        data = BigVocab(block_size=16, batch_size=2, cache_dir=tmp)
        trainer.fit(GPTModule(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)), data)


def _module(**kwargs):
    from lightscale.recipes.gpt import GPTModule

    GPTModule(**kwargs)


def _not_writable():
    from lightscale.strategies.deepspeed.config import writable_dir

    writable_dir(Path("/proc/lightscale_offload"))


def _export_wrong_prefix():
    from lightscale.checkpoint.convert import convert

    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"state_dict": {"net.weight": torch.zeros(1)}}, Path(tmp) / "a.ckpt")
        convert(Path(tmp) / "a.ckpt", Path(tmp) / "out.pt")


def _averaged_of_a_file():
    from lightscale.checkpoint.convert import read_model_state

    with tempfile.TemporaryDirectory() as tmp:
        torch.save({"weight": torch.zeros(1)}, Path(tmp) / "a.pt")
        read_model_state(Path(tmp) / "a.pt", averaged=True)


def _averaged_missing():
    from lightscale.checkpoint.convert import save_model_dcp
    from lightscale.checkpoint.portable import full_model_state_dict

    with tempfile.TemporaryDirectory() as tmp:
        save_model_dcp({"weight": torch.zeros(1)}, Path(tmp) / "c.ckpt")
        full_model_state_dict(Path(tmp) / "c.ckpt", prefix="", part="averaged")


def _hf_unknown_module():
    from lightscale.checkpoint.hf_export import choose_model

    choose_model([{"attribute": "model", "class": "LlamaForCausalLM"}], "net", Path("last.ckpt"))


def _hf_without_transformers():
    from lightscale.checkpoint.hf_export import _save_pretrained

    with mock.patch.dict("sys.modules", {"transformers": None}):
        _save_pretrained({"class": "LlamaForCausalLM"}, {}, Path("out"), "5GB")


def _consolidate_without_optimizer_state():
    from lightscale.checkpoint.convert import save_model_dcp
    from lightscale.commands.consolidate import consolidate

    with tempfile.TemporaryDirectory() as tmp:
        save_model_dcp({"weight": torch.zeros(2)}, Path(tmp) / "weights.ckpt")  # the layout's model part only
        consolidate(Path(tmp) / "weights.ckpt", Path(tmp) / "out.ckpt", with_optimizer=True)


def _fit_with_another_optimizer(missing=None):
    from lightscale.checkpoint.lightning_format import check_optimizers

    module = torch.nn.Linear(2, 2)
    saved = [{"class": "SGD", "groups": [["weight", "bias"]]}]
    checkpoint = {"lightscale": {"consolidated": {"optimizers": saved, "missing": missing}}}
    check_optimizers(checkpoint, module, [torch.optim.Adam(module.parameters())])


def _two_optimizers_under_zero():
    import lightning.pytorch as pl

    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def configure_optimizers(self):
            return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)

    module = TwoOptimizers()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    _zero(stage=2)._optimizer_and_scheduler(module)


def _swa_under_fsdp2():
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightscale.strategies.weight_averaging import refuse_stochastic_weight_averaging

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[StochasticWeightAveraging(0.05)])
    refuse_stochastic_weight_averaging(trainer, "FSDP2Strategy", runs_it=_fsdp2().runs_stochastic_weight_averaging)


class Shampoo(torch.optim.SGD):
    shape_dependent = True  # a user's own optimizer opts in to the rule (lightscale/optim/rule.py)


def _adafactor_under_zero():
    """ZeRO's own optimizer set-up (before DeepSpeed's engine is built), as for two optimizers."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)

        def configure_optimizers(self):
            return torch.optim.Adafactor(self.parameters())

    module = Module()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    _zero(stage=2)._optimizer_and_scheduler(module)


def _muon_on_zero3_partitioned():
    """torch's Muon built in configure_optimizers over ZeRO-3 parameters already partitioned (built in configure_model
    under deepspeed.zero.Init: shape (0,), the partition kept beside it), as ZeRO's set-up calls it."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(0))
            self.weight.ds_tensor = torch.zeros(8)  # what ZeRO-3 keeps (lightscale/strategies/deepspeed/partition.py)

        def configure_optimizers(self):
            return torch.optim.Muon(self.parameters())

    module = Module()
    module.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    _zero(stage=3)._optimizer_and_scheduler(module)


def _muon_on_bf16_optimizer():
    """The optimizer DeepSpeed hands lightscale for zero1 + bf16 with fp32 gradient accumulation (BF16_Optimizer,
    stood in by a class of that name: none of ZeRO's partition attributes), as FlatMuon's set-up reads it."""
    from lightscale.strategies.deepspeed.partition import flat_groups

    flat_groups(type("BF16_Optimizer", (), {})())


def _shape_dependent_under(name: str, optimizer: str):
    """An optimizer whose step reads a parameter's shape, under the strategy ``name`` with its defaults (at setup)."""
    from lightning.pytorch.strategies import StrategyRegistry

    params = [torch.nn.Parameter(torch.ones(4, 4))]
    if optimizer == "combined":
        from lightscale.optim import CombinedOptimizer

        vector = [torch.nn.Parameter(torch.ones(4))]
        built = CombinedOptimizer([torch.optim.AdamW(params), torch.optim.SGD(vector, lr=0.1)])
    else:
        built = {"adafactor": torch.optim.Adafactor, "muon": torch.optim.Muon}.get(optimizer, Shampoo)(params, lr=0.1)
    entry = StrategyRegistry[name]
    entry["strategy"](**entry["init_params"]).check_optimizers([built])


class GAN(torch.nn.Module):
    """A LightningModule's layout under manual optimization: two child networks (tied, or one own parameter)."""

    def __init__(self, *, tied: bool = False, own: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        if tied:
            self.discriminator.weight = self.generator.weight
        if own:
            self.scale = torch.nn.Parameter(torch.ones(1))


def _manual_roots(**layout):
    from lightscale.parallel.contract import data_parallel_roots

    return data_parallel_roots(GAN(**layout), strategy="FSDP2Strategy")


def _manual_roots_under_tp():
    strategy = _p3d(tp=2, dp=2)
    strategy._dims = strategy.parallel_dims(4)
    return strategy._data_parallel_roots(GAN())


def _forward_too_long():
    from lightscale.recipes.gpt import GPT

    GPT(_cfg(block_size=8, n_layer=1, n_head=2, n_embd=16))(torch.zeros(1, 9, dtype=torch.long))


def _batches_disagree():
    from lightscale.data.batch_agreement import batch_checksum, check_agreement

    dims = _dims(world_size=4, tp=2, pp=2)  # one data shard; each rank read its own batch, as by get_rank()
    batches = [torch.full((2, 8), float(rank)) for rank in range(4)]
    check_agreement(torch.stack([batch_checksum(batch) for batch in batches]), dims, step=0)


def _bad_data_shard_env():
    with mock.patch.dict(os.environ, LIGHTSCALE_DATA_SHARD_INDEX="4", LIGHTSCALE_DATA_SHARD_COUNT="4"):
        _lightscale().data_shard()


def _mb_split(batch, microbatches):
    from lightscale.parallel.pipeline import check_microbatch_split

    check_microbatch_split(batch, microbatches)


def _stages(n_layer, stages):
    from lightscale.recipes.gpt.parallelize import gpt_stage_modules

    gpt_stage_modules(_cfg(n_layer=n_layer, tie_weights=False), stages)


def _moe_layer(dim):
    from lightscale.layers.moe import MoE, MoEConfig

    return MoE(dim, MoEConfig(n_experts=2))


def _precision_section(name):
    from lightscale.strategies.deepspeed.config import precision_section

    precision_section(name)


def _plain_lightning_strategy(name):
    import lightning

    _lightscale().patch_lightning()  # lightscale's name check in plain lightning.Trainer (a strategy built does it too)
    lightning.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)


def _cp_model(module, *, cp, tp=1, mode="ring", sequence_length=None):
    from lightscale.strategies.parallel_3d.context_parallel_step import check_context_parallel_model

    check_context_parallel_model(module, cp=cp, tp=tp, mode=mode, sequence_length=sequence_length)


def _gpt_module(**config):
    from lightscale.recipes.gpt import GPTModule

    return GPTModule(_cfg(**config))


def _cp_moe(**moe):
    from lightscale.layers.moe import MoEConfig
    from lightscale.strategies.parallel_3d.context_parallel_step import check_context_parallel_moe

    module = _gpt_module(moe=MoEConfig(n_experts=4, top_k=2, **moe))
    with torch.device("meta"):
        module.configure_model()
    check_context_parallel_moe(module, cp=2)


def _cp_kernel_on_meta() -> object:
    from lightscale.parallel.context_parallel.kernels import choose_kernel

    q = torch.empty(1, 2, 8, 4, device="meta")
    return choose_kernel(q, q, q)


def _cp_masked_attention():
    from lightscale.parallel.context_parallel import ContextParallelAttention

    q = torch.zeros(1, 2, 8, 4)
    with ContextParallelAttention():  # refused before any communication: no process group needed
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))


def _cp_no_attention():
    from lightscale.strategies.parallel_3d.context_parallel_step import check_attention_calls

    check_attention_calls(0, module_name="MyModel", cp=2)  # what the first training step found, summed over ranks


def _cp_batch():
    from lightscale.parallel.contract import sequence_dims_of

    sequence_dims_of(torch.nn.Linear(2, 2), (torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long)))


def _zero_fit(**trainer_kwargs):
    from lightscale.recipes.gpt import GPTModule

    trainer = _lightscale().Trainer(
        strategy="zero2",
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(GPTModule(_cfg(block_size=8, n_layer=1, n_head=2, n_embd=16)))


def _other_shape_checkpoint():
    from lightscale.recipes.gpt import GPT
    from lightscale.storage.shape_check import check_shapes, tensor_shapes

    saved = GPT(_cfg(block_size=8, n_layer=1, n_head=2, n_embd=16)).state_dict()
    model = GPT(_cfg(block_size=8, n_layer=1, n_head=2, n_embd=32)).state_dict()
    check_shapes(tensor_shapes(saved), tensor_shapes(model), "last.ckpt")


def _diloco(world_size=None, **kwargs):
    from lightscale.strategies import DiLoCoStrategy

    strategy = DiLoCoStrategy(**kwargs)
    if world_size is not None:  # the layout is checked at setup, once the world size is known
        strategy.parallel_dims(world_size)


def _fault_tolerance(call=None, **kwargs):
    from lightscale.fault_tolerance import FaultTolerance

    with mock.patch.dict(os.environ, {"LIGHTSCALE_REPLICA_ID": ""}):
        ft = FaultTolerance(**kwargs)
        return getattr(ft, call)() if call else ft


def _ft_bucketed_ddp(compression="none", find_unused_parameters=False, **kwargs):
    from lightscale import FaultTolerance
    from lightscale.strategies import BucketedDDPStrategy

    with mock.patch.dict(os.environ, {"LIGHTSCALE_REPLICA_ID": "", "TORCHFT_LIGHTHOUSE": ""}):
        return BucketedDDPStrategy(
            fault_tolerant=FaultTolerance(**kwargs),
            compression=compression,
            find_unused_parameters=find_unused_parameters,
        )


def _ft_hsdp_replicated_inside():
    from lightscale import FaultTolerance
    from lightscale.strategies import FSDP2Strategy

    ft = FaultTolerance(replica_id="replica_0", lighthouse="http://127.0.0.1:1")
    return FSDP2Strategy(fault_tolerant=ft, dp_replicate=2)


def _ft_replica():
    from lightscale import FaultTolerance
    from lightscale.fault_tolerance.replica import FaultTolerantReplica

    return FaultTolerantReplica(FaultTolerance(replica_id="replica_0", lighthouse="http://127.0.0.1:1"))


def _ft_several_optimizers():
    """Manual optimization with two optimizers: refused at the first quorum, before the data is read."""
    from types import SimpleNamespace

    def sgd():
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    return _ft_replica().join(SimpleNamespace(optimizers=[sgd(), sgd()], callbacks=[]), loader=None)


def _ft_weight_averaging():
    """An EMA (Lightning's WeightAveraging) with per-step fault tolerance: refused at the first quorum."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import WeightAveraging

    trainer = SimpleNamespace(optimizers=[torch.optim.SGD([torch.zeros(1, requires_grad=True)])], callbacks=[])
    trainer.callbacks.append(WeightAveraging())
    return _ft_replica().join(trainer, loader=None)


def _ft_second_step_in_a_batch():
    """Manual optimization stepping twice in one batch: the second step finds the batch's quorum committed
    (tests/unit/test_fault_tolerant_commit.py runs it in a fit)."""
    from lightscale.fault_tolerance.step import FaultTolerantStep

    replica = _ft_replica()
    replica.step = FaultTolerantStep(replica.settings, state_dict=dict, load_state_dict=print, manager=object())
    return replica.optimizer_step(apply=None, closure=None)


def _diloco_over_ft_inner():
    from lightscale.strategies import DiLoCoStrategy

    inner = _ft_bucketed_ddp(replica_id="replica_0", lighthouse="http://127.0.0.1:1")
    return DiLoCoStrategy(inner=inner)


def _diloco_over_ft_fsdp2():
    from lightscale import FaultTolerance
    from lightscale.strategies import DiLoCoStrategy, FSDP2Strategy

    ft = FaultTolerance(replica_id="replica_0", lighthouse="http://127.0.0.1:1")
    return DiLoCoStrategy(inner=FSDP2Strategy(fault_tolerant=ft, dp_replicate=1))


def _without_torchft():
    import importlib.util

    real = importlib.util.find_spec
    with mock.patch.object(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a)):
        return _diloco(fault_tolerant=True)


def _error(name: str) -> type[BaseException]:
    from lightscale.errors import ConfigurationError

    return ConfigurationError if name == "conf" else {"value": ValueError, "exit": SystemExit}[name]


CE = "conf"  # resolved lazily so that collecting this file stays cheap
VE = "value"
SE = "exit"

# fmt: off
CATALOGUE: list[tuple] = [
    # id, description, trigger, error, match
    ("strategy-name", "unknown strategy name (closest match suggested)",
     lambda: _lightscale().Trainer(strategy="bucketd_ddp", accelerator="cpu", devices=1),
     VE, r"'bucketd_ddp'.*Did you mean 'bucketed_ddp'"),
    ("devices-too-many", "more GPUs than the machine has", _too_many_devices, VE, r"devices=3 .* 1\.\.2"),
    ("precision-name", "precision lightscale does not support",
     lambda: _lightscale().Trainer(accelerator="cpu", devices=1, precision="64-true"),
     VE, r"precision='64-true'.*choose one of"),
    ("bucket-zero", "bucket_cap_mb=0", lambda: _ddp(bucket_cap_mb=0), VE, r"bucket_cap_mb=0 .*positive number"),
    ("bucket-negative", "negative bucket_cap_mb", lambda: _ddp(bucket_cap_mb=-5), VE, r"bucket_cap_mb=-5 .*positive"),
    ("bucket-string", "bucket_cap_mb not a number", lambda: _ddp(bucket_cap_mb="big"), VE, r"'big' .*positive number"),
    ("bucket-nan", "bucket_cap_mb=nan", lambda: _ddp(bucket_cap_mb=float("nan")), VE, r"nan .*positive number"),
    ("compression", "unknown gradient compression", lambda: _ddp(compression="int8"), VE,
     r"compression='int8'.*'none', 'bf16', 'fp16'"),
    ("reducer-bucket", "BucketedGradReducer with bucket_cap_mb=0 (checked before any process group)",
     _reducer, VE, r"bucket_cap_mb=0"),
    ("timeout-zero", "collective timeout of 0 s", lambda: _ddp(timeout_s=0), CE, r"timeout_s=0 .*positive"),
    ("dims-product", "degrees multiply to a number other than the world size", lambda: _dims(world_size=8, tp=2, pp=3),
     CE, r"pp=3 x tp=2 multiply to 6, but the world size is 8.*\[1, 2, 4, 8\]"),
    ("dims-infer", "-1 degree cannot be inferred from a non-divisor",
     lambda: _dims(world_size=8, dp_replicate=-1, tp=3), CE, r"Cannot infer dp_replicate: world size 8 .*\(3\)"),
    ("dims-zero", "a degree of 0", lambda: _dims(world_size=4, tp=0), CE, r"tp=0 is not valid: use a positive degree"),
    ("dims-negative", "a degree of -2", lambda: _dims(world_size=4, dp_shard=-2), CE,
     r"dp_shard=-2 is not valid: .*or -1 \(infer\)"),
    ("dims-two-infer", "two degrees set to -1", lambda: _dims(world_size=4, dp_shard=-1, tp=-1), CE,
     r"Only one parallel degree may be -1.*dp_shard.*tp"),
    ("dims-world", "world size 0", lambda: _dims(world_size=0), CE, r"world_size must be >= 1, got 0"),
    ("p3d-product", "parallel_3d dp x tp x pp larger than the world", lambda: _p3d(dp=2, tp=2, pp=2).parallel_dims(4),
     CE, r"multiply to 8, but the world size is 4.*\[1, 2, 4\]"),
    ("p3d-heads", "tp does not divide the attention heads", lambda: _gpt_parallel(_cfg(n_head=2, n_embd=64), 4, 1),
     CE, r"tp=4 .*\{'n_head': 2\}. Valid tp.*\[1, 2\]"),
    ("p3d-kv-heads", "tp does not divide the key/value heads",
     lambda: _gpt_parallel(_cfg(n_head=4, n_kv_head=1, n_embd=64), 2, 1), CE, r"tp=2.*\{'n_kv_head': 1\}.*Valid tp"),
    ("p3d-vocab", "tp does not divide the vocabulary",
     lambda: _gpt_parallel(_cfg(vocab_size=255, n_head=2, n_embd=64), 2, 1), CE, r"\{'vocab_size': 255\}.*Valid tp"),
    ("p3d-layers", "layers do not divide into pipeline stages", lambda: _stages(3, 2), CE,
     r"3 layers do not divide into 2 pipeline stages.*\[1, 3\]"),
    ("p3d-layers-validate", "layers do not divide into stages (recipe validation)",
     lambda: _gpt_parallel(_cfg(n_layer=3, tie_weights=False), 1, 2), CE, r"3 layers do not divide into 2"),
    ("p3d-tied", "tied embeddings with a pipeline", lambda: _gpt_parallel(_cfg(n_layer=2), 1, 2), CE,
     r"tie_weights: false"),
    ("cp-degree", "a context-parallel degree of 0", lambda: _p3d(cp=0), CE, r"cp=0 is not valid: use a positive"),
    ("cp-mode", "unknown context-parallel attention mode", lambda: _p3d(cp=2, cp_mode="rings"), CE,
     r"Unknown cp_mode 'rings'; valid: \['ring', 'allgather', 'ulysses'\]"),
    ("cp-compile", "cp with torch.compile'd blocks", lambda: _p3d(cp=2, compile=True), CE,
     r"cp=2 with compile=True is not supported.*compile=False"),
    ("cp-sequence", "sequence not divisible by 2 x cp", lambda: _cp_model(None, cp=4, sequence_length=20), CE,
     r"Sequence length 20 is not divisible by 2 \* cp = 8 \(cp=4\).*\(e.g. 24\)"),
    ("cp-sequence-short", "sequence shorter than 2 x cp", lambda: _cp_model(None, cp=4, sequence_length=6), CE,
     r"Sequence length 6 is shorter than 2 \* cp = 8 \(cp=4\).*\(e.g. 8\)"),
    ("cp-ulysses-heads", "ulysses with attention heads not divisible by cp",
     lambda: _cp_model(_gpt_module(n_head=2, n_embd=64), cp=4, mode="ulysses"), CE,
     r"heads/tp = 2 .*do not divide by 4. Use cp_mode='ring' or 'allgather'"),
    ("cp-tp-heads", "ulysses with cp x tp larger than the heads", lambda: _cp_model(_gpt_module(n_head=4, n_embd=64),
     cp=4, tp=2, mode="ulysses"), CE, r"heads/tp = 2 and kv_heads/tp = 2 \(tp=2\) do not divide by 4"),
    ("cp-mask", "an attention mask tensor under cp", _cp_masked_attention, CE,
     r"is_causal=True or no mask.*attn_mask tensor of shape \(8, 8\) \(dtype torch.bool\)"),
    ("cp-device", "ring/allgather attention on a device with no fused log-sum-exp op", _cp_kernel_on_meta, CE,
     r"runs on CPU or CUDA tensors; got device meta.*mode='ulysses'"),
    ("cp-no-attention", "a model that never calls F.scaled_dot_product_attention under cp", _cp_no_attention, CE,
     r"MyModel called it nowhere during the first training step.*scaled_dot_product_attention"),
    ("cp-batch", "a batch without a sequence dimension under cp", _cp_batch, CE,
     r"not a \(tokens, targets\)-like batch.*shape \(4, 3, 32, 32\).*Linear.sequence_dims\(self, batch\)"),
    ("cp-moe-capacity", "MoE capacity-factor dropping under cp", lambda: _cp_moe(capacity_factor=1.0), CE,
     r"capacity_factor=1.0.*Use dropless routing \(capacity_factor: null\) with balance: bias"),
    ("cp-moe-aux", "MoE aux-loss balancing under cp", lambda: _cp_moe(balance="aux_loss"), CE,
     r"per-sequence statistics .*balance='aux_loss'.*balance: bias"),
    ("pp-microbatches", "fewer microbatches than stages under 1f1b",
     lambda: _p3d(pp=4, schedule="1f1b", microbatches=2), CE,
     r"'1f1b' needs at least as many microbatches as stages.*>= 4"),
    ("pp-schedule", "unknown pipeline schedule", lambda: _p3d(pp=2, schedule="1f1"), CE,
     r"Unknown pipeline schedule '1f1'. Did you mean '1f1b'"),
    ("pp-zbv", "zbv with 3 stages per rank", lambda: _p3d(pp=2, schedule="zbv", stages_per_rank=3), CE,
     r"'zbv' needs exactly 2 stages per rank"),
    ("pp-1f1b-stages", "1f1b with 2 stages per rank", lambda: _p3d(pp=2, schedule="1f1b", stages_per_rank=2), CE,
     r"'1f1b' runs one stage per rank"),
    ("pp-interleaved", "interleaved_1f1b microbatches not a multiple of pp",
     lambda: _p3d(pp=2, schedule="interleaved_1f1b", microbatches=5), CE,
     r"'interleaved_1f1b' cannot run pp=2, microbatches=5.*multiple"),
    ("pp-batch-split", "batch does not split into microbatches", lambda: _mb_split(6, 4), CE,
     r"6 samples does not split into 4 .* among \[1, 2, 3, 6\]"),
    ("p3d-dp-mode", "unknown dp_mode", lambda: _p3d(dp_mode="hybrid"), CE,
     r"dp_mode must be 'shard' or 'replicate'.*hybrid"),
    ("p3d-tp-zero", "tp=0", lambda: _p3d(tp=0), CE, r"tp=0 is not valid"),
    ("tp-plan-pattern", "TP plan pattern that matches no module",
     lambda: _tp_plan({"layers.*.attn.wq": _colwise()}), CE, r"'layers.\*.attn.wq' matches no module"),
    ("tp-plan-module", "ColwiseParallel on a LayerNorm", lambda: _tp_plan({"norm": _colwise()}), CE,
     r"ColwiseParallel on 'norm' \(LayerNorm\)"),
    ("tp-plan-style", "TP plan value that is not a ParallelStyle", lambda: _tp_plan({"norm": "colwise"}), CE,
     r"not a ParallelStyle"),
    ("hsdp-product", "HSDP replicate x shard not the world size",
     lambda: _fsdp2(dp_replicate=3, dp_shard=2).parallel_dims(4), CE, r"multiply to 6, but the world size is 4"),
    ("hsdp-infer", "HSDP shard degree cannot be inferred", lambda: _fsdp2(dp_replicate=4, dp_shard=-1).parallel_dims(6),
     CE, r"Cannot infer dp_shard"),
    ("fsdp-dp-shard-zero", "FSDP2 dp_shard=0 (refused at construction)", lambda: _fsdp2(dp_shard=0), CE,
     r"dp_shard=0 is not valid: use a positive degree or -1"),
    ("p3d-microbatches-zero", "microbatches=0", lambda: _p3d(pp=2, microbatches=0), CE,
     r"microbatches must be >= 1, got 0"),
    ("p3d-pp-infer", "pp=-1 (only dp may be inferred)", lambda: _p3d(pp=-1), CE,
     r"pp=-1 is not valid: use a positive degree \(dp may be -1\)"),
    ("fsdp-unit", "unknown FSDP unit class name", lambda: _unit_class("TransformerBlok"), CE,
     r"'TransformerBlok' does not occur in GPT\. Did you mean 'TransformerBlock'"),
    ("fsdp-ac-mode", "unknown activation checkpointing mode", lambda: _fsdp2(activation_checkpointing="some"), CE,
     r"activation_checkpointing='some' is not valid; choose one of"),
    ("zero-stage", "ZeRO stage 4", lambda: _zero(stage=4), CE, r"stage=4 is not valid; choose 1, 2 or 3"),
    ("zero-offload-params", "parameter offload below stage 3", lambda: _zero(stage=2, offload_params=True), CE,
     r"needs ZeRO stage 3.*stage 2.*zero3_offload"),
    ("zero-checkpoint-format", "an unknown ZeRO checkpoint format", lambda: _zero(checkpoint_format="universal"), CE,
     r"checkpoint_format='universal' is not available for ZeroStrategy; it writes \['dcp', 'deepspeed'\]"),
    ("zero-precision", "precision the ZeRO strategies do not support", lambda: _precision_section("64-true"), CE,
     r"precision='64-true' .*choose 32-true, bf16-mixed"),
    ("ds-owned-key", "DeepSpeed key lightscale sets itself",
     lambda: _ds_config({"train_micro_batch_size_per_gpu": 4}), CE,
     r"'train_micro_batch_size_per_gpu' is set by lightscale from the train dataloader's batch_size"),
    ("ds-misplaced-key", "ZeRO option at the top level", lambda: _ds_config({"overlap_comm": True}), CE,
     r"'overlap_comm' belongs under 'zero_optimization'"),
    ("ds-unknown-key", "unknown DeepSpeed key", lambda: _ds_config({"gradient_clippin": 1.0}), CE,
     r"Unknown DeepSpeed config key 'gradient_clippin'"),
    ("ds-zero-not-dict", "zero_optimization not a dict", lambda: _ds_config({"zero_optimization": 2}), CE,
     r"'zero_optimization' must be a dict of ZeRO options, got 2"),
    ("ds-zero-owned", "zero_optimization.stage set by hand", lambda: _ds_config({"zero_optimization": {"stage": 3}}),
     CE, r"zero_optimization.stage is set by the strategy name \(zero1, zero2, zero3"),
    ("ds-zero-top-level", "top-level key inside zero_optimization",
     lambda: _ds_config({"zero_optimization": {"gradient_clipping": 1.0}}), CE,
     r"'gradient_clipping' is a top-level key.*move it up"),
    ("ds-zero-unknown", "unknown zero_optimization option",
     lambda: _ds_config({"zero_optimization": {"overlap_com": True}}), CE,
     r"Unknown zero_optimization option 'overlap_com'.*overlap_comm"),
    ("ds-engine-key-via-strategy", "unknown DeepSpeed key given to the strategy",
     lambda: _zero(config={"fp17": {}}), CE, r"Unknown DeepSpeed config key 'fp17'"),
    ("offload-not-writable", "offload directory not writable", _not_writable, CE,
     r"/proc/lightscale_offload is not writable.*nvme_path"),
    ("gpt-layers", "n_layer=0", lambda: _cfg(n_layer=0), VE, r"GPTConfig.n_layer must be a positive int, got 0"),
    ("gpt-kv-heads", "n_kv_head=0", lambda: _cfg(n_kv_head=0), VE, r"n_kv_head must be None or a positive int, got 0"),
    ("gpt-embd-heads", "n_embd not divisible by n_head", lambda: _cfg(n_embd=30, n_head=4), VE,
     r"n_embd=30 is not divisible by n_head=4; valid n_head: \[1, 2, 3, 5"),
    ("gpt-gqa", "n_head not divisible by n_kv_head", lambda: _cfg(n_head=4, n_kv_head=3, n_embd=64), VE,
     r"n_head=4 is not divisible by n_kv_head=3; valid n_kv_head: \[1, 2, 4\]"),
    ("gpt-dropout", "dropout of 1", lambda: _cfg(dropout=1.0), VE, r"0 <= dropout < 1, got 1.0"),
    ("gpt-too-long", "sequence longer than block_size", _forward_too_long, VE,
     r"sequence length 9 exceeds block_size=8"),
    ("module-lr", "learning rate 0", lambda: _module(learning_rate=0.0), VE, r"need learning_rate > 0.*got 0.0"),
    ("module-min-lr", "min_lr_ratio outside [0, 1]", lambda: _module(min_lr_ratio=2.0), VE,
     r"min_lr_ratio must be in \[0, 1\], got 2.0"),
    ("data-batch", "batch_size=0", lambda: _data(batch_size=0), VE, r"must be positive, got 128 and 0"),
    ("data-val-fraction", "val_fraction outside (0, 1)", lambda: _data(val_fraction=1.5), VE,
     r"val_fraction must be in \(0, 1\), got 1.5"),
    ("data-workers", "negative num_workers", lambda: _data(num_workers=-1), VE, r"num_workers must be >= 0, got -1"),
    ("data-smaller-than-dp", "dataset smaller than one global batch (batch x data-parallel degree)",
     lambda: _sampler(6, 2, 4), VE, r"6 samples, fewer than one global batch of 8 \(batch_size=2 x num_replicas=4\)"),
    ("data-too-few-tokens", "fewer tokens than one window", lambda: _windows(5, 8), CE,
     r"5 tokens cannot fill one window of block_size=8"),
    ("cli-unknown-flag", "unknown trainer flag on the command line", lambda: _cli("--trainer.max_stepz", "3"), SE,
     r"max_stepz"),
    ("cli-unknown-yaml-key", "unknown key inside a YAML config", _cli_bad_file, SE, r"learning_rat"),
    ("cli-config-name", "unknown packaged config name", lambda: _resolve("gpt/tiny_dp.yaml"), SE,
     r"'gpt/tiny_dp\.yaml' is neither a file nor a packaged config\. Did you mean 'gpt/tiny_ddp\.yaml'"),
    ("cli-strategy-name", "unknown strategy in the CLI", lambda: _cli("--trainer.strategy", "bucketed_dp"), SE,
     r"Unknown strategy 'bucketed_dp'\. Did you mean 'bucketed_ddp'"),
    ("ckpt-wrong-model", "export from a checkpoint whose keys do not match the prefix", _export_wrong_prefix, CE,
     r"starts with 'model.'; keys: \['net.weight'\]"),
    ("ckpt-averaged-file", "export --averaged of a checkpoint format that keeps no average", _averaged_of_a_file, CE,
     r"--averaged reads the average .* is a torch checkpoint, which keeps none"),
    ("ckpt-averaged-missing", "export --averaged of a checkpoint saved without WeightAveraging", _averaged_missing,
     CE, r"holds no averaged weights: it was saved without a WeightAveraging callback.*Read the raw weights"),
    ("hf-module", "export --hf --module naming no model the checkpoint recorded", _hf_unknown_module, CE,
     r"--module 'net' is not an exportable model of last.ckpt; recorded: \['model'\]"),
    ("hf-extra", "export --hf of a transformers model without transformers installed", _hf_without_transformers, CE,
     r"transformers is not installed; install it with: pip install 'lightscale\[hf\]'"),
    ("fsdp-pin-memory", "offload with pinned memory on a machine without CUDA", _pinned_without_cuda, CE,
     r"offload=True with pin_memory=True needs CUDA.*pin_memory=False"),
    ("zero-fp16-cpu", "16-mixed under a ZeRO name on CPU (DeepSpeed has no CPU fp16)",
     lambda: _lightscale().Trainer(strategy="zero2", accelerator="cpu", devices=1, precision="16-mixed"), CE,
     r"precision='16-mixed' cannot run under the zero strategies on cpu.*Valid precisions there: 32-true, bf16-mixed"),
    ("float8-zero", "float8 under a ZeRO name",
     lambda: _lightscale().Trainer(strategy="zero2", accelerator="cpu", devices=1, precision="float8"), CE,
     r"precision='float8' cannot run under the zero strategies on cpu: DeepSpeed.*Valid precisions there: 32-true"),
    ("float8-cpu", "precision='float8' on CPU without torchao's emulation",
     lambda: _lightscale().Trainer(strategy="fsdp2", accelerator="cpu", devices=1, precision="float8"), CE,
     r"precision='float8' cannot run under the fsdp2 strategies on cpu.*emulate=True"),
    ("float8-strategy", "float8 under a strategy with no float8 path (Lightning's auto)",
     lambda: _lightscale().Trainer(accelerator="cpu", devices=1, precision="float8-rowwise"), CE,
     r"precision='float8-rowwise' runs under the fsdp2 and parallel_3d strategies.*strategy='auto'"),
    ("float8-name", "unknown Float8Precision name",
     lambda: _lightscale().Float8Precision("fp8"), CE,
     r"name='fp8' is not valid; choose one of float8, float8-rowwise"),
    ("moe-expert-width", "MoE widths grouped GEMM cannot take (not multiples of 8)",
     lambda: _moe_layer(20), ValueError, r"multiples of 8.*dim=20"),
    ("compression-bf16-true-fp16", "fp16 gradient compression of bf16-true gradients",
     lambda: _lightscale().Trainer(strategy=_fsdp2(compression="fp16"), accelerator="cpu", devices=1,
                                   precision="bf16-true"), CE,
     r"compression='fp16' with precision='bf16-true'.*'bf16'"),
    ("compression-fsdp2", "unknown compression under FSDP2", lambda: _fsdp2(compression="int8"), CE,
     r"compression='int8' is not valid; choose one of 'none', 'bf16', 'fp16'"),
    ("compression-zero", "unknown compression under ZeRO", lambda: _zero(compression="fp8"), CE,
     r"compression='fp8' is not valid; choose one of 'none', 'bf16', 'fp16'"),
    ("compression-p3d", "unknown compression under parallel_3d", lambda: _p3d(compression="bf32"), CE,
     r"compression='bf32' is not valid"),
    ("zeropp-weights", "unknown ZeRO++ weight wire", lambda: _fsdp2(quantized_weights="int4"), CE,
     r"quantized_weights='int4' is not a ZeRO\+\+ wire; choose one of 'none', 'int8'"),
    ("zeropp-gradients", "unknown ZeRO++ gradient wire", lambda: _fsdp2(quantized_gradients="fp8"), CE,
     r"quantized_gradients='fp8'.*'none', 'int8', 'int4'"),
    ("zeropp-secondary", "hpZ secondary shard group not dividing dp_shard",
     lambda: _fsdp2(secondary_shard=3).parallel_dims(4), CE, r"secondary_shard=3 must divide dp_shard=4.*\[2, 4\]"),
    ("zeropp-compression", "quantized gradients together with gradient compression",
     lambda: _fsdp2(quantized_gradients="int8", compression="bf16"), CE, r"both choose the gradient wire"),
    ("zeropp-zero-stage", "ZeRO++ options below ZeRO stage 3", lambda: _zero(stage=2, quantized_weights="int8"),
     CE, r"needs ZeRO stage 3, got stage 2"),
    ("zeropp-zero-cpu", "DeepSpeed's ZeRO++ on CPU (its quantizer is a CUDA kernel)",
     lambda: _lightscale().Trainer(strategy=_zero(stage=3, quantized_gradients="int4"), accelerator="cpu",
                                   devices=2), CE, r"no build for cpu.*fsdp2_zeropp"),
    ("powersgd-rank", "PowerSGD rank below 1", lambda: _ddp(compression="powersgd", powersgd_rank=0), CE,
     r"powersgd_rank=0 is not valid.*integer >= 1"),
    ("powersgd-warmup", "negative PowerSGD warm-up", lambda: _ddp(compression="powersgd", powersgd_warmup_steps=-1),
     CE, r"powersgd_warmup_steps=-1 is not valid.*>= 0"),
    ("powersgd-fsdp2", "compression='powersgd' under FSDP2 (valid only under bucketed_ddp)",
     lambda: _fsdp2(compression="powersgd"), CE, r"compression='powersgd' is valid only under the bucketed_ddp"),
    ("powersgd-zero", "compression='powersgd' under ZeRO", lambda: _zero(compression="powersgd"), CE,
     r"compression='powersgd' is valid only under the bucketed_ddp.*'none', 'bf16', 'fp16'"),
    ("powersgd-bf16-true", "PowerSGD of bf16-true gradients (a bf16 wire; the factors need fp32)",
     lambda: _lightscale().Trainer(strategy=_ddp(compression="powersgd"), accelerator="cpu", devices=1,
                                   precision="bf16-true"), CE,
     r"compression='powersgd' with precision='bf16-true' is not supported.*'32-true' or 'bf16-mixed'"),
    ("ds-comm-dtype", "DeepSpeed communication_data_type set by hand",
     lambda: _ds_config({"communication_data_type": "fp16"}), CE,
     r"'communication_data_type' is set by lightscale from the strategy's compression"),
    ("plain-lightning-strategy-name", "unknown strategy name in plain lightning.Trainer once lightscale patched it",
     lambda: _plain_lightning_strategy("zero3_ofload"), CE,
     r"Unknown strategy 'zero3_ofload'\. Did you mean 'zero3_offload'\?.*lightscale strategies: .*zero3_offload"),
    ("zero-nvme-not-writable", "ZeroStrategy nvme_path not writable (at construction)",
     lambda: _zero(stage=3, offload_optimizer=True, offload_params=True, nvme_path="/proc/lightscale_swap"), CE,
     r"Offload directory /proc/lightscale_swap is not writable"),
    ("zero-clip-value", "gradient_clip_algorithm='value' under ZeRO (before processes start)",
     lambda: _zero_fit(gradient_clip_val=1.0, gradient_clip_algorithm="value"), CE,
     r"gradient_clip_algorithm='value' is not valid.*use gradient_clip_algorithm='norm'"),
    ("zero-config-missing", "ZeroStrategy(config=) naming a file that does not exist",
     lambda: _zero(config="missing.json"), CE, r"config='missing\.json'\): no such file.*dict.*JSON file"),
    ("gpt-data-missing-file", "GPTDataModule text_files naming a missing file",
     lambda: _data(text_files=["missing_corpus.txt"]), CE,
     r"no such file \['missing_corpus\.txt'\].*text_files=None"),
    ("gpt-data-both", "GPTDataModule given both text_files and data_dir",
     lambda: _data(text_files=[], data_dir="data/gpt2"), CE,
     r"text_files=\[\] and data_dir='data/gpt2'; valid: one of them"),
    ("gpt-token-format", "GPTDataModule token_format not a known format", lambda: _data(token_format="llm.c"), CE,
     r"token_format='llm.c' is not valid; choose one of \['auto', 'nanogpt', 'llmc'\]"),
    ("gpt-data-dir-empty", "GPTDataModule data_dir without train/val token files (at setup)",
     lambda: _token_dir(), CE, r"holds no token data \(no such directory\).*train\.bin and val\.bin.*prepare"),
    ("gpt-token-magic", "token file read as llm.c with a wrong magic number (at setup)",
     lambda: _token_dir((20240519, 1, 100), token_format="llmc"), CE,
     r"has magic 20240519, not llm\.c's 20240520.*token_format='nanogpt'"),
    ("gpt-token-version", "llm.c token file of an unknown version/dtype (at setup)",
     lambda: _token_dir((20240520, 3, 100)), CE, r"llm\.c version 3; valid versions: 1 \(uint16 tokens\) and 2"),
    ("gpt-token-truncated", "llm.c header claiming more tokens than the file holds (at setup)",
     lambda: _token_dir((20240520, 1, 1000)), CE, r"claims 1000 uint16 tokens in its header but holds 100"),
    ("gpt-token-odd", "raw (nanoGPT) token file of an odd number of bytes (at setup)",
     lambda: _token_dir(raw=b"\0" * 201), CE, r"has 201 bytes, not a whole number of uint16 tokens"),
    ("gpt-token-short", "token file shorter than one window (at setup)", lambda: _token_dir(raw=b"\0" * 10), CE,
     r"train\.bin: 5 tokens cannot fill one window of block_size=8 \(\+1 target\)\. Valid: at least 9 tokens"),
    ("extra-litdata", "lightscale.streams.shard_litdata without litdata installed",
     lambda: _without("litdata.utilities.env", lambda: _lightscale().streams.shard_litdata(None)), ImportError,
     r"litdata\.utilities\.env is not installed; install it with: pip install 'lightscale\[litdata\]'"),
    ("extra-datasets", "lightscale.streams.shard_hf without Hugging Face datasets installed",
     lambda: _without("datasets.distributed", lambda: _lightscale().streams.shard_hf(None)), ImportError,
     r"datasets\.distributed is not installed; install it with: pip install 'lightscale\[data\]'"),
    ("extra-tokenizers", "GPTDataModule(tokenizer=...) without the tokenizers package",
     lambda: _without("tokenizers", lambda: _data(tokenizer="tokenizer.json")), ImportError,
     r"tokenizers is not installed; install it with: pip install 'lightscale\[data\]'"),
    ("gpt-vocab-past-model", "data vocabulary larger than the GPT's vocab_size (at setup)", _vocab_past_model, CE,
     r"vocabulary has 50257 tokens but the model's vocab_size is 256.*vocab_size >= 50257"),
    ("ckpt-other-shape", "resuming a checkpoint of a differently shaped model (keys and shapes named)",
     _other_shape_checkpoint, CE,
     r"last\.ckpt was saved from a differently shaped model: tok_embeddings\.weight: checkpoint \(256, 16\), "
     r"model \(256, 32\)"),
    ("ckpt-format-file-sharded", "checkpoint_format='file' on a strategy that shards parameters",
     lambda: _fsdp2(checkpoint_format="file"), CE,
     r"checkpoint_format='file' is not available for FSDP2Strategy.*needs whole parameters on every rank: "
     r"BucketedDDPStrategy, DiLoCoStrategy"),
    ("ckpt-format-file-diloco-fsdp2", "checkpoint_format='file' on DiLoCo with FSDP2 workers (a sharded global model)",
     lambda: _diloco(inner="fsdp2", checkpoint_format="file"), CE,
     r"checkpoint_format='file' needs the global model whole on every rank; inner='fsdp2' shards it.*"
     r"inner='bucketed_ddp'"),
    ("ckpt-format-file-async", "async_save with checkpoint_format='file'",
     lambda: _ddp(async_save=True, checkpoint_format="file"), CE,
     r"async_save=True writes the portable layout only; checkpoint_format='file'.*checkpoint_format='dcp'"),
    ("ckpt-async-save-override", "async_save with a strategy subclass that overrides save_checkpoint",
     lambda: _save_checkpoint_override()(async_save=True), CE,
     r"async_save=True is not supported with MyDDP\.save_checkpoint: it overrides.*`checkpoint_states`"),
    ("ckpt-url-missing-package", "a checkpoint URL whose fsspec filesystem is not installed (gs:// without gcsfs)",
     lambda: _checkpoint_location("gs://bucket/run/last.ckpt"), CE,
     r"'gs://bucket/run/last\.ckpt' needs the gcsfs package for gs:// URLs, which is not installed\. Install it"),
    ("ckpt-url-unknown-scheme", "a checkpoint URL of a scheme fsspec does not know",
     lambda: _checkpoint_location("s4://bucket/run"), CE,
     r"fsspec knows no filesystem for s4://\. Use a local path or an fsspec URL such as s3://, gs://"),
    ("ckpt-url-through-pathlib", "a checkpoint URL that went through pathlib.Path (s3:// became s3:/)",
     lambda: _checkpoint_location(Path("s3://bucket/run")), CE,
     r"'s3:/bucket/run' looks like a URL that lost one '/'.*pass the URL as a string"),
    ("ckpt-url-incomplete", "a checkpoint directory at a URL without its completion marker (its save did not finish)",
     lambda: _unmarked_remote_checkpoint(), CE,
     r"memory://unmarked/last\.ckpt is an incomplete checkpoint: its save did not finish.*Resume from an earlier"),
    ("consolidate-no-optimizer", "consolidate --with-optimizer of a checkpoint without optimizer state",
     _consolidate_without_optimizer_state, CE,
     r"holds no optimizer state in the portable layout; consolidate it without --with-optimizer"),
    ("lightning-fit-other-optimizer", "Lightning's fit(ckpt_path) of a lightscale checkpoint with another optimizer",
     _fit_with_another_optimizer, CE, r"optimizer 0 is SGD in the checkpoint and Adam in this run"),
    ("lightning-fit-no-optimizer-state", "Lightning's fit(ckpt_path) of a checkpoint without optimizer state in "
     "torch's terms (DiLoCo, DeepSpeed's own directory)",
     lambda: _fit_with_another_optimizer("d.ckpt (written by DiLoCoStrategy) holds no optimizer state"), CE,
     r"cannot restore the optimizers here\. Resume it under a lightscale strategy"),
    ("zero-two-optimizers", "two optimizers (e.g. manual optimization of a GAN) under a ZeRO name (at setup)",
     _two_optimizers_under_zero, CE,
     r"need exactly one optimizer.*returned 2 optimizer\(s\).*run under "
     r"BucketedDDPStrategy\(find_unused_parameters=True\)"),
    ("optimizer-shape-zero", "an optimizer whose step reads a parameter's shape (torch's Adafactor) under ZeRO, which "
     "would step it on flat partitions (at setup)", _adafactor_under_zero, CE,
     r"torch.optim.Adafactor cannot run under ZeroStrategy.*flat 1-D partitions.*runs exactly under: bucketed_ddp"),
    ("optimizer-shape-muon-zero", "torch's Muon under zero_infinity, whose partitions DeepSpeed swaps to NVMe files "
     "(it runs under zero1/2/3 and their offload names, as FlatMuon; at setup)",
     lambda: _shape_dependent_under("zero_infinity", "muon"), CE,
     r"torch.optim.Muon cannot run under ZeroStrategy.*swap to NVMe files.*runs exactly under: "
     r".*zero3_offload.*fsdp2"),
    ("optimizer-partitioned-shapes", "configure_optimizers failing under zero3 on parameters built in configure_model, "
     "which are partitioned (shape (0,)) while it runs: torch's Muon refuses them when built (at setup)",
     _muon_on_zero3_partitioned, CE,
     r"configure_optimizers failed under ZeRO-3 \(ValueError: Muon only supports 2D.*Build those layers in __init__"),
    ("optimizer-muon-bf16-optimizer", "Muon under zero1 with bf16 and `data_types.grad_accum_dtype=\"fp32\"`, for "
     "which DeepSpeed builds its BF16_Optimizer (at setup)", _muon_on_bf16_optimizer, CE,
     r"wrapped the optimizer in BF16_Optimizer.*grad_accum_dtype.*remove that setting, or use zero2"),
    ("optimizer-combined-zero", "a CombinedOptimizer (even of elementwise parts) under zero_infinity, which swaps "
     "the optimizer's state to NVMe files around each step (it runs under zero1/2/3 and their offload names; at "
     "setup)", lambda: _shape_dependent_under("zero_infinity", "combined"), CE,
     r"CombinedOptimizer of AdamW, SGD cannot run under ZeroStrategy.*NVMe.*one optimizer with a parameter group per "
     r"part.*zero3_offload"),
    ("optimizer-shape-user", "a user's optimizer declaring `shape_dependent = True` under fsdp2 (at setup)",
     lambda: _shape_dependent_under("fsdp2", "users"), CE,
     r"Shampoo cannot run under FSDP2Strategy.*runs exactly under: bucketed_ddp.*`shape_dependent = True`"),
    ("manual-own-parameter", "manual optimization under an FSDP2 name with a parameter on the LightningModule itself "
     "(at setup)", lambda: _manual_roots(own=True), CE,
     r"\['scale'\] belong to the LightningModule itself.*Move them into a child module.*"
     r"BucketedDDPStrategy\(find_unused_parameters=True\)"),
    ("manual-tied-children", "manual optimization under an FSDP2 name with two child networks sharing a parameter "
     "(at setup)", lambda: _manual_roots(tied=True), CE,
     r"children 'generator' and 'discriminator' share a parameter.*Put the tied modules under one child"),
    ("manual-networks-tp", "manual optimization of several child networks under parallel_3d with tp or ep > 1 "
     "(at setup)", _manual_roots_under_tp, CE,
     r"Parallel3DStrategy\(tp=2, ep=1\) with manual optimization.*Use tp=1 and ep=1"),
    ("diloco-sync-every", "DiLoCo sync_every below 1", lambda: _diloco(sync_every=0), CE,
     r"sync_every=0 is not valid; it must be an integer >= 1"),
    ("diloco-fragments", "DiLoCo fragments not dividing sync_every", lambda: _diloco(sync_every=10, fragments=3), CE,
     r"fragments=3 does not divide sync_every=10.*choose fragments from \[1, 2, 5, 10\]"),
    ("diloco-workers", "DiLoCo workers not dividing the world size (at setup)", lambda: _diloco(4, workers=3), CE,
     r"workers=3 does not divide the world size 4.*Choose workers from \[1, 2, 4\]"),
    ("diloco-inner", "DiLoCo inner strategy that cannot nest", lambda: _diloco(inner="zero2"), CE,
     r"inner='zero2' cannot run inside a DiLoCo worker; choose one of bucketed_ddp, fsdp2"),
    ("diloco-outer-lr", "DiLoCo outer_lr <= 0", lambda: _diloco(outer_lr=0.0), CE,
     r"outer_lr=0.0 is not valid; it must be > 0"),
    ("diloco-local-sgd-compression", "local_sgd with a compressed wire (it would round the parameters)",
     lambda: _diloco(mode="local_sgd", compression="int8"), CE,
     r"compression='int8' cannot serve mode='local_sgd'.*Use compression='none'"),
    ("diloco-synchronous-steps", "DiLoCo synchronous_steps below 0", lambda: _diloco(synchronous_steps=-1), CE,
     r"synchronous_steps=-1 is not valid; it must be an integer >= 0"),
    ("diloco-ft-synchronous", "fault-tolerant DiLoCo with a synchronous start (the workers are separate jobs)",
     lambda: _diloco(fault_tolerant=True, synchronous_steps=100), CE,
     r"synchronous_steps=100 needs every worker in one job.*Use synchronous_steps=0 with fault tolerance"),
    ("diloco-ft-workers", "fault-tolerant DiLoCo given a number of workers (each worker is a launch)",
     lambda: _diloco(workers=2, fault_tolerant=True), CE,
     r"workers=2 cannot be set with fault_tolerant.*Leave workers"),
    ("diloco-ft-wire", "fault-tolerant DiLoCo with a compressed or streaming outer wire",
     lambda: _diloco(fault_tolerant=True, compression="int8"), CE,
     r"needs fragments=1, overlap_steps=0 and compression='none', not .*compression='int8'"),
    ("diloco-ft-replica-id", "fault-tolerant DiLoCo worker without a name",
     lambda: _fault_tolerance("resolved_replica_id"), CE,
     r"needs a name.*FaultTolerance\(replica_id='worker_0'\) or set LIGHTSCALE_REPLICA_ID"),
    ("diloco-ft-min-replicas", "fault-tolerant DiLoCo with min_replicas=0", lambda: _fault_tolerance(min_replicas=0),
     CE, r"min_replicas=0 is not valid; use an integer >= 1"),
    ("diloco-ft-extra", "fault-tolerant DiLoCo without torchft installed (the ft extra)", _without_torchft, CE,
     r"runs on torchft, not installed: pip install 'lightscale\[ft\]'"),
    ("ft-step-no-lighthouse", "per-step fault tolerance (bucketed_ddp) without a lighthouse address",
     lambda: _ft_bucketed_ddp(replica_id="replica_0"), CE,
     r"lighthouse=None .* is not an address: pass FaultTolerance\(lighthouse='http://127.0.0.1:29510'\)"),
    ("ft-step-min-replicas", "per-step fault tolerance with min_replicas=0",
     lambda: _ft_bucketed_ddp(replica_id="replica_0", lighthouse="http://127.0.0.1:1", min_replicas=0), CE,
     r"min_replicas=0 is not valid; use an integer >= 1"),
    ("ft-step-powersgd", "per-step fault tolerance with PowerSGD (per-replica residuals)",
     lambda: _ft_bucketed_ddp(replica_id="replica_0", lighthouse="http://127.0.0.1:1", compression="powersgd"), CE,
     r"compression='powersgd' cannot run with fault_tolerant.*use compression='none' or 'bf16'"),
    ("ft-step-unused", "per-step fault tolerance with find_unused_parameters=True (replicas would drift)",
     lambda: _ft_bucketed_ddp(replica_id="replica_0", lighthouse="http://127.0.0.1:1", find_unused_parameters=True),
     CE, r"find_unused_parameters=True cannot run with fault_tolerant.*replicas drift apart"),
    ("ft-step-optimizers", "per-step fault tolerance with several optimizers (manual optimization)",
     _ft_several_optimizers, CE, r"runs one optimizer, stepped at most once per training batch.*returned 2"),
    ("ft-step-averaging", "per-step fault tolerance with a weight-averaging callback (a heal does not carry it)",
     _ft_weight_averaging, CE, r"does not carry weight averages when a replica heals.*\['WeightAveraging'\]"),
    ("ft-step-manual-steps", "per-step fault tolerance with a second optimizer.step() in one batch",
     _ft_second_step_in_a_batch, CE, r"one optimizer.step\(\) per training batch.*once per training_step"),
    ("ft-step-diloco-inner", "a fault-tolerant bucketed_ddp as DiLoCo's inner strategy (DiLoCo drives it)",
     _diloco_over_ft_inner, CE, r"as DiLoCo's inner strategy would not be fault tolerant.*DiLoCoStrategy instead"),
    ("ft-fsdp2-diloco-inner", "a fault-tolerant FSDP2 family strategy as DiLoCo's inner strategy (DiLoCo drives it)",
     _diloco_over_ft_fsdp2, CE,
     r"FSDP2Strategy\(fault_tolerant=...\) as DiLoCo's inner strategy would not be fault tolerant.*DiLoCoStrategy"),
    ("ft-hsdp-replicate", "fault_tolerant= on the FSDP2 family with dp_replicate other than 1 (hsdp's default 2)",
     _ft_hsdp_replicated_inside, CE,
     r"dp_replicate=2 cannot run with fault_tolerant: each launch is one replica.*use dp_replicate=1"),
    ("diloco-ft-data-part", "a replica_id without a part number below data_shards",
     lambda: _fault_tolerance("data_part", replica_id="alpha", data_shards=2), CE,
     r"replica_id='alpha' does not end with a part number below data_shards=2.*worker_0 \.\.\. worker_1"),
    ("batch-check-every", "check_batches_every below 1", lambda: _p3d(tp=2, check_batches_every=0), CE,
     r"check_batches_every=0 is not valid: use a positive number of training steps.*or None"),
    ("batches-disagree", "ranks of one data shard (tp, pp) given different batches (a dataset sharded by get_rank())",
     _batches_disagree, CE,
     r"ranks \[0, 1\] of a tensor-parallel group \(tp\).*ranks \[0, 2\] of a pipeline-parallel group \(pp\)"
     r".*lightscale\.data_shard\(\)"),
    ("data-shard-env", "LIGHTSCALE_DATA_SHARD_INDEX/COUNT set by hand to a non-shard", _bad_data_shard_env, CE,
     r"LIGHTSCALE_DATA_SHARD_INDEX='4' and LIGHTSCALE_DATA_SHARD_COUNT='4'.*0 <= index < count"),
    ("swa-sharded", "Lightning's StochasticWeightAveraging under a name that shards or runs an engine (fsdp2, "
     "parallel_3d, ZeRO)", _swa_under_fsdp2, CE,
     r"StochasticWeightAveraging callback does not run under FSDP2Strategy.*WeightAveraging instead.*bucketed_ddp"),
]
# fmt: on

ENTRIES = [Bad(i, d, t, e, m) for i, d, t, e, m in CATALOGUE]


def _message(entry: Bad) -> tuple[type[BaseException], str]:
    """The exception type and its message; for a bare ``SystemExit(2)`` the error lines printed to stderr."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            entry.trigger()
    except BaseException as error:  # SystemExit included
        message = str(error)
        if isinstance(error, SystemExit) and not message.strip("0123456789"):
            printed = err.getvalue()
            message = printed[printed.find("error:") :] if "error:" in printed else printed
        return type(error), re.sub(re.escape(tempfile.gettempdir()) + r"/[^/\s'\"]+", "<tmp>", message)
    raise AssertionError(f"{entry.id}: no error raised")


def _expected(entry: Bad) -> type[BaseException]:
    return _error(entry.error) if isinstance(entry.error, str) else entry.error


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def render() -> str:
    lines = [
        "# Bad input: what lightscale refuses, and the message it gives",
        "",
        "Every row is a test: `tests/unit/test_error_catalogue.py` triggers each bad setting in one process, before",
        "any work starts, and checks the exception type and that the message names the bad value and a valid one.",
        "This page is generated from that table; after changing an entry or a message, regenerate it with",
        "`LIGHTSCALE_UPDATE_ERRORS=1 pytest tests/unit/test_error_catalogue.py` (a test fails while it is stale).",
        "`ConfigurationError` is a `ValueError`.",
        "",
        f"{len(ENTRIES)} entries.",
        "",
        "| id | bad input | exception | message |",
        "|---|---|---|---|",
    ]
    for entry in ENTRIES:
        kind, message = _message(entry)
        lines.append(f"| `{entry.id}` | {_cell(entry.description)} | `{kind.__name__}` | {_cell(message)} |")
    return "\n".join(lines) + "\n"


def test_ids_are_unique_and_many() -> None:
    ids = [entry.id for entry in ENTRIES]
    assert len(ids) == len(set(ids)) and len(ids) >= 50


@pytest.mark.parametrize("entry", ENTRIES, ids=[entry.id for entry in ENTRIES])
def test_bad_input_is_refused(entry: Bad) -> None:
    kind, message = _message(entry)
    assert issubclass(kind, _expected(entry)), f"{entry.id}: {kind.__name__}: {message}"
    assert re.search(entry.match, message, re.S), f"{entry.id}: {message!r}"


def test_docs_are_up_to_date() -> None:
    text = render()
    if os.environ.get("LIGHTSCALE_UPDATE_ERRORS"):
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, "docs/errors.md is stale: rerun with LIGHTSCALE_UPDATE_ERRORS=1"
