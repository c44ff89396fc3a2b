"""Bad input is a clear error before any work starts: names the bad value and what would be valid."""

from __future__ import annotations

import pytest

import lightscale
from lightscale.cli import main, resolve_config
from lightscale.parallel import BucketedGradReducer
from lightscale.strategies import BucketedDDPStrategy


def test_unknown_strategy_names_closest_match() -> None:
    with pytest.raises(
        ValueError, match=r"Unknown strategy 'bucketd_ddp'\. Did you mean 'bucketed_ddp'\?.*bucketed_ddp"
    ):
        lightscale.Trainer(strategy="bucketd_ddp", accelerator="cpu", devices=1)


def test_plain_lightning_trainer_knows_lightscale_names() -> None:
    import lightning

    trainer = lightning.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, BucketedDDPStrategy)


@pytest.mark.parametrize("cap", [0, -5, "big", float("nan")])
def test_bad_bucket_size(cap: object) -> None:
    with pytest.raises(ValueError, match=rf"bucket_cap_mb={cap!r} is not valid: .* positive number"):
        BucketedDDPStrategy(bucket_cap_mb=cap)


def test_bad_compression() -> None:
    with pytest.raises(ValueError, match=r"compression='int8' is not valid; choose one of 'none', 'bf16', 'fp16'"):
        BucketedDDPStrategy(compression="int8")


def test_reducer_validates_before_touching_the_network() -> None:
    import torch

    with pytest.raises(ValueError, match="bucket_cap_mb=0"):
        BucketedGradReducer(torch.nn.Linear(2, 2), bucket_cap_mb=0)  # no process group exists: it never got there


def test_more_gpus_than_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"devices=3 but this machine has 2 CUDA devices; valid values are 1\.\.2"):
        lightscale.Trainer(strategy="bucketed_ddp", accelerator="cuda", devices=3)


@pytest.mark.parametrize("devices", [3, "3"])  # "3": what --trainer.devices 3 gives under Lightning's type
def test_more_cpu_ranks_than_cores_warn_and_run(monkeypatch: pytest.MonkeyPatch, devices: int | str) -> None:
    """Lightning and torchrun run 4 CPU ranks on 2 cores; so does lightscale, naming the ranks and the cores (it
    refused before: the tiny GPT trains there, measured in the commit that made this a warning)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match=r"devices=3 starts 3 CPU ranks on this machine's 2 CPU cores"):
        trainer = lightscale.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=devices, logger=False)
    assert trainer.num_devices == 3


def test_unsupported_precision_name() -> None:
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported by lightscale; choose one of"):
        lightscale.Trainer(accelerator="cpu", devices=1, precision="64-true")


def test_fp16_on_cpu_is_not_silently_turned_into_bf16() -> None:
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    trainer = lightscale.Trainer(accelerator="cpu", devices=1, precision="16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed"
    assert isinstance(plugin.scaler, torch.amp.GradScaler)


def test_unknown_config_key_is_an_error_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", "gpt/tiny_ddp.yaml", "--trainer.max_stepz", "3"])
    assert "max_stepz" in capsys.readouterr().err


def test_unknown_key_inside_a_config_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("model:\n  class_path: lightscale.recipes.gpt.GPTModule\n  init_args:\n    learning_rat: 0.1\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", "gpt/tiny_ddp.yaml", "--config", str(config)])
    assert "learning_rat" in capsys.readouterr().err


def test_unknown_packaged_config_names_closest() -> None:
    with pytest.raises(
        SystemExit,
        match=r"'gpt/tiny_dp\.yaml' is neither a file nor a packaged config\. Did you mean 'gpt/tiny_ddp\.yaml'",
    ):
        resolve_config("gpt/tiny_dp.yaml")


def test_unknown_strategy_in_yaml_is_an_error_before_training(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match=r"error: Unknown strategy 'bucketed_dp'\. Did you mean 'bucketed_ddp'\?"):
        main(["fit", "--config", "gpt/tiny_ddp.yaml", "--trainer.strategy", "bucketed_dp"])
