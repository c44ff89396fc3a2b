"""The ZeRO strategies on DeepSpeed: CPU Adam parity, bad input, host-memory offload (SGD parity: test_parity.py)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
from helpers import relative_difference, train_tiny_gpt

import lightscale
from lightscale.errors import ConfigurationError
from lightscale.strategies import ZeroStrategy
from lightscale.testing import RankFailed, run_distributed

TOLERANCE = 1e-4  # relative, per step (the bound; measured ~2e-7 in fp32)
NAMES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero_infinity"]


@pytest.fixture(scope="module")
def single_process_losses(corpus_cache: str) -> list[float]:
    return run_distributed(
        train_tiny_gpt, "auto", devices=1, batch_size=8, max_steps=10, cache_dir=corpus_cache, world_size=1
    )[0]


def test_cpu_adam_matches_torch_adamw(single_process_losses: list[float], corpus_cache: str, tmp_path) -> None:
    # Optimizer offload swaps the user's AdamW for DeepSpeed's CPU Adam: same update rule, to fp32 rounding.
    # (Gradient scale is checked with SGD for every name in test_parity.py; Adam cannot see it.)
    per_rank = run_distributed(
        train_tiny_gpt,
        "zero3_offload",
        devices=2,
        batch_size=4,
        max_steps=10,
        cache_dir=corpus_cache,
        default_root_dir=str(tmp_path),
        world_size=2,
        timeout_s=900,
    )
    assert relative_difference(per_rank[0], single_process_losses) <= TOLERANCE


def test_lightning_trainer_knows_every_name() -> None:
    import lightning

    for name in NAMES:
        trainer = lightning.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert isinstance(trainer.strategy, ZeroStrategy)
    assert lightscale.Trainer(strategy="zero3_offload", accelerator="cpu", devices=2).strategy.options.offload_params


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"gradient_accumulation_steps": 4},
            r"'gradient_accumulation_steps' is set by lightscale from Trainer\(accumulate_grad_batches",
        ),
        ({"train_batch_size": 64}, r"'train_batch_size' is set by lightscale"),
        (
            {"optimizer": {"type": "Adam"}},
            r"'optimizer' is set by lightscale from LightningModule\.configure_optimizers",
        ),
        (
            {"zero_optimisation": {}},
            r"Unknown DeepSpeed config key 'zero_optimisation'\. Did you mean 'zero_optimization'\?",
        ),
        ({"overlap_comm": True}, r"'overlap_comm' belongs under 'zero_optimization'"),
        ({"zero_optimization": {"stage": 1}}, r"zero_optimization\.stage is set by the strategy name"),
        (
            {"zero_optimization": {"overlap_com": True}},
            r"Unknown zero_optimization option 'overlap_com'\. Did you mean 'overlap_comm'\?",
        ),
        ({"zero_optimization": {"steps_per_print": 5}}, r"'steps_per_print' is a top-level key"),
    ],
)
def test_bad_engine_config_is_refused_at_construction(config: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ZeroStrategy(stage=2, config=config)


def test_parameter_offload_needs_stage_3() -> None:
    with pytest.raises(ConfigurationError, match="Parameter offload needs ZeRO stage 3"):
        ZeroStrategy(stage=2, offload_params=True)


def _fit_with(strategy: ZeroStrategy, cache_dir: str, **trainer_kwargs: object) -> list[float]:
    return train_tiny_gpt(strategy, devices=2, batch_size=4, max_steps=2, cache_dir=cache_dir, **trainer_kwargs)


def test_offload_path_not_writable(corpus_cache: str, tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    strategy = ZeroStrategy(stage=3, offload_optimizer=True, offload_params=True, nvme_path=str(blocked / "swap"))
    with pytest.raises(RankFailed, match=r"Offload directory .*swap is not writable"):
        run_distributed(_fit_with, strategy, corpus_cache, world_size=2)


def test_fp16_on_cpu_is_refused_before_training(corpus_cache: str) -> None:
    with pytest.raises(RankFailed, match=r"precision='16-mixed' cannot run under the zero strategies on cpu"):
        run_distributed(_fit_with, ZeroStrategy(stage=3), corpus_cache, precision="16-mixed", world_size=2)


def test_gradient_clipping_by_value_is_refused(corpus_cache: str) -> None:
    with pytest.raises(RankFailed, match="DeepSpeed clips gradients by norm only"):
        run_distributed(
            _fit_with,
            ZeroStrategy(stage=2),
            corpus_cache,
            gradient_clip_val=1.0,
            gradient_clip_algorithm="value",
            world_size=2,
        )


class _Inspect:
    """Records where the engine keeps optimizer state and parameters after one step."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        outer = self
        self.seen: dict[str, object] = {}

        class Callback(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                engine = trainer.strategy.engine
                params = list(pl_module.parameters())
                outer.seen = {
                    "offload_optimizer": engine.zero_offload_optimizer(),
                    "offload_param": engine.zero_offload_param(),
                    "optimizer": type(engine.optimizer.optimizer).__name__,
                    "local_numel": sum(p.ds_tensor.numel() for p in params),
                    "full_numel": sum(p.ds_numel for p in params),
                }

        self.callback = Callback()


def _offload_state(cache_dir: str) -> dict[str, object]:
    inspect = _Inspect()
    train_tiny_gpt(
        "zero3_offload", devices=2, batch_size=4, max_steps=1, cache_dir=cache_dir, extra_callbacks=[inspect.callback]
    )
    return inspect.seen


def test_zero3_offload_keeps_state_in_host_buffers(corpus_cache: str) -> None:
    seen = run_distributed(_offload_state, corpus_cache, world_size=2)[0]
    assert seen["offload_optimizer"] and seen["offload_param"]
    assert seen["optimizer"] == "DeepSpeedCPUAdam"
    # Each rank keeps half of every parameter (rounded up per tensor for even partitions).
    assert seen["full_numel"] / 2 <= seen["local_numel"] <= seen["full_numel"] / 2 + 2 * 64


class _TraceModes(pl.Callback):
    """ZeRO-3's parameter-fetch trace after every step: COMPLETE means it prefetches along the recorded order."""

    def __init__(self) -> None:
        self.complete: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        coordinator = trainer.strategy.engine.optimizer.parameter_offload.get_param_coordinator()
        self.complete.append(coordinator.is_complete_trace())


def _trace_modes(cache_dir: str) -> list[bool]:
    modes = _TraceModes()
    train_tiny_gpt("zero3", devices=2, batch_size=4, max_steps=4, cache_dir=cache_dir, extra_callbacks=[modes])
    return modes.complete


def test_zero3_enters_the_module_once_per_step_so_prefetch_works(corpus_cache: str) -> None:
    # training_step calls self(x) inside the engine's forward; if the LightningModule were the engine's root it
    # would be entered twice, the trace would be invalidated every step and each parameter gathered on its own.
    complete = run_distributed(_trace_modes, corpus_cache, world_size=2)[0]
    assert complete == [False, True, True, True]  # step 1 records the trace, then it is reused


class _UserWarns(pl.Callback):
    def on_train_batch_end(self, *args: object) -> None:
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)


def _warnings_of_a_zero3_run(cache_dir: str, tmp_path: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_tiny_gpt(
            "zero3", devices=2, batch_size=4, max_steps=3, cache_dir=cache_dir, extra_callbacks=[_UserWarns()]
        )
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_deepspeed_deprecation_noise_is_filtered_but_user_warnings_show(corpus_cache: str, tmp_path) -> None:
    seen = run_distributed(_warnings_of_a_zero3_run, corpus_cache, str(tmp_path), world_size=2)[0]
    assert not [w for w in seen if "all_gather_into_tensor` is deprecated" in w]  # was ~30 per step
    assert seen.count("UserWarning: the user's own warning") == 3
