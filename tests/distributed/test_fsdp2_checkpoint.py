"""FSDP2 checkpoints (DCP directories): exact resume, resume on fewer ranks (resharding), full export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, relative_difference, train_tiny_gpt

from lightscale.checkpoint import SafeCheckpointIO
from lightscale.checkpoint.convert import convert
from lightscale.checkpoint.portable import TRAINER_STATE
from lightscale.cli import main
from lightscale.recipes.gpt import GPT
from lightscale.testing import run_distributed

TOLERANCE = 1e-5
GLOBAL_BATCH = 8


def _first_half(strategy: str, cache_dir: str, checkpoint: str) -> list[float]:
    ranks = dist.get_world_size()
    return train_tiny_gpt(
        strategy,
        devices=ranks,
        batch_size=GLOBAL_BATCH // ranks,
        stop_after=10,
        cache_dir=cache_dir,
        save_checkpoint_to=checkpoint,
    )


def _second_half(strategy: str, cache_dir: str, checkpoint: str) -> list[float]:
    ranks = dist.get_world_size()
    return train_tiny_gpt(
        strategy, devices=ranks, batch_size=GLOBAL_BATCH // ranks, cache_dir=cache_dir, resume_from=checkpoint
    )


@pytest.fixture(scope="module")
def uninterrupted(corpus_cache: str) -> list[float]:
    return run_distributed(
        train_tiny_gpt, "auto", devices=1, batch_size=GLOBAL_BATCH, cache_dir=corpus_cache, world_size=1
    )[0]


@pytest.fixture(scope="module")
def saved_on_4_ranks(corpus_cache: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    checkpoint = str(tmp_path_factory.mktemp("fsdp2_ckpt") / "step10.ckpt")
    first = run_distributed(_first_half, "fsdp2", corpus_cache, checkpoint, world_size=4, timeout_s=300)[0]
    return checkpoint, first


def test_checkpoint_is_a_complete_dcp_directory(saved_on_4_ranks: tuple[str, list[float]]) -> None:
    path = Path(saved_on_4_ranks[0])
    assert path.is_dir() and (path / ".metadata").is_file() and (path / TRAINER_STATE).is_file()
    assert len(list(path.glob("*.distcp"))) == 4  # one shard file per rank
    assert not path.with_name(path.name + ".tmp").exists()  # the atomic save left no temporary directory
    state = SafeCheckpointIO().load_checkpoint(path / TRAINER_STATE)  # weights_only=True: safe to load
    assert state["global_step"] == 10 and "state_dict" not in state


@pytest.mark.parametrize("ranks", [4, 2, 1])
def test_resume_on_any_number_of_ranks_continues_exactly(
    ranks: int, saved_on_4_ranks: tuple[str, list[float]], uninterrupted: list[float], corpus_cache: str
) -> None:
    checkpoint, first = saved_on_4_ranks
    second = run_distributed(_second_half, "fsdp2", corpus_cache, checkpoint, world_size=ranks, timeout_s=300)[0]
    assert len(first) == 10 and len(second) == 10
    assert relative_difference(first + second, uninterrupted) <= TOLERANCE


def _gathered_model(checkpoint: str, cache_dir: str) -> dict[str, torch.Tensor]:
    """The full weights of the model the checkpoint was taken from (gathered collectively)."""
    import lightning.pytorch as pl
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict[str, torch.Tensor] = {}

    class Gather(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            full.update(get_model_state_dict(pl_module.model, options=options))

    train_tiny_gpt(
        "fsdp2",
        devices=2,
        batch_size=4,
        stop_after=3,
        cache_dir=cache_dir,
        save_checkpoint_to=checkpoint,
        extra_callbacks=[Gather()],
    )
    return full


def test_export_loads_into_the_single_device_model(corpus_cache: str, tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "step3.ckpt")
    gathered = run_distributed(_gathered_model, checkpoint, corpus_cache, world_size=2, timeout_s=300)[0]
    assert convert(checkpoint, tmp_path / "gpt.pt") == "torch"
    main(["export-fsdp2", checkpoint, str(tmp_path / "cli.pt")])  # the CLI subcommand writes the same file
    exported = torch.load(tmp_path / "gpt.pt", weights_only=True)
    keys = sorted(exported)
    assert torch.load(tmp_path / "cli.pt", weights_only=True).keys() == set(keys)
    model = GPT(TINY)
    model.load_state_dict(exported)  # strict: every key of the single-device model, nothing else
    assert keys == sorted(model.state_dict()) == sorted(gathered)
    for name, tensor in gathered.items():
        assert torch.equal(exported[name], tensor), name


def test_export_of_a_non_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"is not a sharded checkpoint directory saved by a lightscale strategy"):
        main(["export-fsdp2", str(tmp_path), str(tmp_path / "out.pt")])
