"""One checkpoint layout for every strategy: saved by any member, loaded by any other at any world size.

The rows below are the matrix (tests/checkpoint_matrix.py explains the legs). A canonical GPT run (fsdp2 on 2 ranks)
trains ``END`` steps and saves at ``FIRST``; the other members load it, train ``LEG`` steps and save; a chain of
true cross pairs carries one run fsdp2@2 -> zero3@1 -> parallel_3d tp2 x pp2@4 -> fsdp2@4 to ``END``. A MoE
GPT (expert parallelism) and a user's model have their own canonical run and chain. Launches go by world size
2 -> 1 -> 4, so each chain may only climb that order. All losses after a load must equal the uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from checkpoint_matrix import (
    CONFIG,
    GLOBAL_BATCH,
    GPTWorkload,
    Leg,
    LegResult,
    Member,
    Workload,
    check_loaded,
    check_saved,
    merge_ranks,
    run_legs,
    zero_member,
)
from helpers import StepLosses, quiet_trainer, relative_difference, train_tiny_gpt
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.checkpoint import SafeCheckpointIO
from lightscale.checkpoint.portable import TRAINER_STATE
from lightscale.layers.moe import MoEConfig
from lightscale.recipes.gpt import GPT
from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy, Parallel3DStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # relative, per step: the same samples per step, only the reduction order differs
FIRST, LEG, END = 3, 5, 18  # the canonical checkpoint's step; steps per leg; the chain ends at FIRST + 3 * LEG


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class UserModule(pl.LightningModule):
    """What a user brings: blocks in a ``ModuleList``, a parameter on the LightningModule itself (FSDP2 then shards
    the LightningModule as its root), AdamW with a step-wise schedule."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, classes)
        self.temperature = nn.Parameter(torch.tensor([1.5]))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h) * self.temperature, y)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class UserWorkload:
    """``UserModule`` on one fixed global batch: every step sees the same samples, so the data position cannot
    matter and any difference after a load is the checkpoint's."""

    def fit(self, strategy: object, *, devices: int, batch_size: int, callbacks: list, **kwargs: object) -> list[float]:
        pl.seed_everything(0, verbose=False)
        generator = torch.Generator().manual_seed(0)
        x, y = (
            torch.randn(GLOBAL_BATCH, 8, generator=generator),
            torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator),
        )
        losses = StepLosses()
        trainer = quiet_trainer(
            strategy, devices=devices, max_steps=kwargs["max_steps"], callbacks=[losses, *callbacks]
        )
        loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
        trainer.fit(UserModule(), loader, ckpt_path=kwargs["resume_from"])
        return losses.steps

    def state_names(self) -> set[str]:
        return set(UserModule().state_dict())


def _ddp() -> BucketedDDPStrategy:
    return BucketedDDPStrategy()


def _fsdp2() -> FSDP2Strategy:
    return FSDP2Strategy()


MEMBERS = {
    member.name: member
    for member in [
        Member("bucketed_ddp@1", 1, _ddp),
        Member("bucketed_ddp@2", 2, _ddp),
        Member("bucketed_ddp@4", 4, _ddp),
        Member("fsdp2@1", 1, _fsdp2),
        Member("fsdp2@2", 2, _fsdp2),
        Member("fsdp2@4", 4, _fsdp2),
        Member("hsdp@4", 4, lambda: FSDP2Strategy(dp_replicate=2)),
        Member("parallel_3d@1", 1, Parallel3DStrategy),
        Member("tp2@2", 2, lambda: Parallel3DStrategy(tp=2)),
        Member("tp2@4", 4, lambda: Parallel3DStrategy(tp=2)),
        Member("pp2@2", 2, lambda: Parallel3DStrategy(pp=2, microbatches=2)),
        Member("pp2@4", 4, lambda: Parallel3DStrategy(pp=2, microbatches=2)),
        Member("tp2_pp2@4", 4, lambda: Parallel3DStrategy(tp=2, pp=2, microbatches=2)),
        Member("ep2@2", 2, lambda: Parallel3DStrategy(ep=2)),
        Member("ep2@4", 4, lambda: Parallel3DStrategy(ep=2)),
        zero_member("zero1", 2, stage=1),
        zero_member("zero2", 1, stage=2),
        zero_member("zero3", 1, stage=3),
        zero_member("zero2", 2, stage=2),
        zero_member("zero3", 2, stage=3),
        zero_member("zero3", 4, stage=3),
        zero_member("zero3_offload", 2, stage=3, offload_optimizer=True, offload_params=True),
    ]
}
CANONICAL = "fsdp2@2"
CHAIN = ["zero3@1", "tp2_pp2@4", "fsdp2@4"]  # after the canonical saver
LOADERS = [  # load the canonical one
    *("bucketed_ddp@2", "tp2@2", "pp2@2"),
    *("zero1@2", "zero2@2", "zero3@2", "zero3_offload@2"),
    *("fsdp2@1", "parallel_3d@1", "bucketed_ddp@1", "zero2@1"),  # and zero3@1, the chain's first link
    *("bucketed_ddp@4", "hsdp@4", "tp2@4", "pp2@4", "zero3@4"),
]
# Expert parallelism needs a MoE model: its own canonical run and chain, experts split 2 -> whole -> 2 of 4 ranks.
MOE = dataclasses.replace(CONFIG, moe=MoEConfig(n_experts=4, top_k=2, balance="bias"))
MOE_CANONICAL, MOE_CHAIN = "ep2@2", ["fsdp2@1", "ep2@4"]


# A model lightscale did not write (below): data-parallel members only (it has no TP plan or pipeline split).
USER_CANONICAL, USER_CHAIN = "bucketed_ddp@2", ["zero2@2", "bucketed_ddp@1", "hsdp@4"]


def _canonical(root: Path, name: str, workload: Workload, tag: str) -> Leg:
    return Leg(MEMBERS[name], None, str(root / f"{tag}_{name}"), END, END, save_at=FIRST, workload=workload)


def _chain(root: Path, canonical: Leg, names: list[str]) -> list[Leg]:
    legs, previous = [], canonical
    for index, name in enumerate(names, start=1):
        path = f"{canonical.save}_chain{index}_{name}"
        previous = Leg(MEMBERS[name], previous.save, path, FIRST + index * LEG, END, workload=canonical.workload)
        legs.append(previous)
    return legs


def _plan(root: Path) -> list[Leg]:
    """Every leg, in an order where each loads a checkpoint written by an earlier launch or an earlier leg."""
    canonical = _canonical(root, CANONICAL, GPTWorkload(), "gpt")
    moe = _canonical(root, MOE_CANONICAL, GPTWorkload(MOE), "moe")
    user = _canonical(root, USER_CANONICAL, UserWorkload(), "user")
    legs = [canonical, moe, user]
    legs += [Leg(MEMBERS[name], canonical.save, str(root / name), FIRST + LEG, END) for name in LOADERS]
    return legs + _chain(root, canonical, CHAIN) + _chain(root, moe, MOE_CHAIN) + _chain(root, user, USER_CHAIN)


@pytest.fixture(scope="module")
def matrix(corpus_cache: str, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Leg, LegResult]]:
    legs = _plan(tmp_path_factory.mktemp("portable"))
    done: list[tuple[Leg, LegResult]] = []
    for world_size in (2, 1, 4):  # the canonical saver first; the chain goes 2 -> 1 -> 4
        mine = [leg for leg in legs if leg.member.world_size == world_size]
        per_rank = run_distributed(run_legs, mine, corpus_cache, world_size=world_size, timeout_s=600)
        for index, leg in enumerate(mine):
            results = [ranks[index] for ranks in per_rank]
            loaded = merge_ranks([result.loaded for result in results]) if leg.load else None
            saved = merge_ranks([result.saved for result in results])
            done.append((leg, LegResult(results[0].losses, loaded, saved, results[0].saved_step)))
    return done


def test_every_checkpoint_holds_the_live_state_bitwise(matrix: list[tuple[Leg, LegResult]]) -> None:
    for leg, result in matrix:  # under the LightningModule's own names: pipeline stages and expert shards included
        check_saved(leg.save, result.saved, result.saved_step, names=leg.workload.state_names())
        writer = SafeCheckpointIO().load_checkpoint(Path(leg.save) / TRAINER_STATE)["lightscale"]
        assert writer["world_size"] == leg.member.world_size and writer["format"] == 1, leg.member.name


def test_every_load_restores_the_saved_state_bitwise(matrix: list[tuple[Leg, LegResult]]) -> None:
    saved = {leg.save: result.saved for leg, result in matrix}
    for leg, result in matrix:
        if leg.load is not None:
            assert result.loaded is not None
            check_loaded(result.loaded, saved[leg.load])


def test_losses_after_every_load_equal_the_uninterrupted_run(matrix: list[tuple[Leg, LegResult]]) -> None:
    by_checkpoint = {leg.save: (leg, result) for leg, result in matrix}
    worst: dict[str, float] = {}
    for leg, result in matrix:
        root = leg
        while root.load is not None:  # the run this leg continues: the canonical one its chain started from
            root = by_checkpoint[root.load][0]
        uninterrupted = by_checkpoint[root.save][1].losses
        if leg is root:
            assert len(uninterrupted) == END
            continue
        start = leg.until - LEG
        worst[leg.save] = relative_difference(result.losses, uninterrupted[start : leg.until])
        assert worst[leg.save] <= TOLERANCE, leg.member.name
    print(f"{len(worst)} loads; largest relative loss difference {max(worst.values()):.2g}")  # docs/benchmarks.md


def _from_a_single_file(cache_dir: str, checkpoint: str) -> tuple[int, list[str]]:
    """Train 3 steps under Lightning's own single-device strategy (one ``.ckpt`` file, the format bucketed_ddp wrote
    before the layout), then resume under bucketed_ddp; return how many tensors were compared after the load and
    which differ from the file."""
    train_tiny_gpt(
        "auto",
        devices=1,
        batch_size=GLOBAL_BATCH,
        cache_dir=cache_dir,
        config=CONFIG,
        max_steps=FIRST,
        stop_after=FIRST,
        save_checkpoint_to=checkpoint,
    )
    saved = SafeCheckpointIO().load_checkpoint(checkpoint)
    differences: list[str] = []
    compared: list[int] = []

    class Compare(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            model = pl_module.state_dict()
            differences.extend(k for k, v in saved["state_dict"].items() if not torch.equal(model[k], v))
            optim = trainer.optimizers[0].state_dict()["state"]
            for index, state in saved["optimizer_states"][0]["state"].items():
                differences.extend(f"{index}.{k}" for k, v in state.items() if not torch.equal(optim[index][k], v))
            compared.append(len(model) + sum(len(state) for state in optim.values()))

    train_tiny_gpt(
        _ddp(),
        devices=1,
        batch_size=GLOBAL_BATCH,
        cache_dir=cache_dir,
        config=CONFIG,
        max_steps=FIRST + 1,
        resume_from=checkpoint,
        extra_callbacks=[Compare()],
    )
    return compared[0], differences


def test_bucketed_ddp_still_loads_a_single_file_checkpoint(corpus_cache: str, tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "single.ckpt")
    compared, differences = run_distributed(_from_a_single_file, corpus_cache, checkpoint, world_size=1)[0]
    assert Path(checkpoint).is_file() and differences == []
    assert compared >= 4 * len(list(GPT(CONFIG).parameters()))  # weights, both moments and step of each


def test_replicated_tensors_are_written_once(matrix: list[tuple[Leg, LegResult]]) -> None:
    """bucketed_ddp's ranks all hold every tensor; DCP writes each once: the same bytes as one rank's checkpoint."""
    sizes = {
        leg.save: sum(path.stat().st_size for path in Path(leg.save).glob("*.distcp"))
        for leg, _ in matrix
        if leg.member.name in ("bucketed_ddp@2", "bucketed_ddp@4", "fsdp2@1") and leg.load == matrix[0][0].save
    }
    assert len(sizes) == 3 and len(set(sizes.values())) == 1, sizes
