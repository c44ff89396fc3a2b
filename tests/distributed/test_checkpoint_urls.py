"""Checkpoints at fsspec URLs, against a real S3 server started here on loopback (moto; lightscale/testing/local_s3.py).

Per strategy (2 gloo ranks): train ``SAVED_AT`` steps saving to ``s3://``, resume with ``fit(ckpt_path="s3://...")``
to ``STEPS`` (ModelCheckpoint's ``save_top_k=1`` then removes the first checkpoint from the bucket), and compare every
loss and the final weights bit for bit with an uninterrupted run; load the result in a fresh process (Lightning's
``load_from_checkpoint``; ``torch.load`` through fsspec without lightscale for a single file). No local folder named
like the URL appears. ``memory://`` does the same in one process; a scheme whose package is missing is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import fsspec
import lightning.pytorch as pl
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from helpers import S3_BUCKET, TINY, StepLosses, quiet_trainer, train_tiny_gpt
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.checkpoint.lightning_format import lightning_checkpoint
from lightscale.checkpoint.resume import newest_checkpoint
from lightscale.cli import main as lightscale_main
from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPTConfig
from lightscale.storage.safe_io import SafeCheckpointIO
from lightscale.storage.urls import COMPLETE, checkpoint_location
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy, FSDP2Strategy, ZeroStrategy
from lightscale.strategies.registry import patch_lightning
from lightscale.testing import RankFailed, run_distributed

patch_lightning()  # this process reads what the ranks saved through Lightning's loaders, as a user's would

BUCKET = S3_BUCKET  # the `s3` fixture (tests/conftest.py) starts the server and creates it
STEPS, SAVED_AT = 6, 3
SAMPLES = 8  # one global batch: every step sees every sample, so only the checkpoint can change a resumed run
HERE = Path(__file__).parent


class Regressor(pl.LightningModule):
    """A tiny model trained with SGD and momentum (the momentum buffer is optimizer state the resume must restore)."""

    def __init__(self) -> None:
        super().__init__()
        # a 1-output head (a 1-element bias under ZeRO-3) is test_zero_small_parameters.py's case, s3:// included
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(ranks: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 2, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=SAMPLES // ranks)


def _strategy(name: str, checkpoint_format: str) -> Any:
    if name.startswith("zero"):  # zero2, zero3, zero2_offload; "deepspeed": DeepSpeed's own engine directory
        fmt = "deepspeed" if checkpoint_format == "deepspeed" else "dcp"
        return ZeroStrategy(stage=int(name[4]), offload_optimizer=name.endswith("_offload"), checkpoint_format=fmt)
    if name == "diloco":  # two workers of one rank each; the outer step at every saved step
        return DiLoCoStrategy(workers=2, sync_every=SAVED_AT)
    if name == "fsdp2":  # "async": async_save=True (DCP writes from a side thread, published behind the marker)
        return FSDP2Strategy(async_save=checkpoint_format == "async")
    return BucketedDDPStrategy(checkpoint_format=checkpoint_format)


def _full_weights(strategy: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors on every rank (FSDP2's shards gathered, collectively); none for ZeRO-3 (the engine holds them)
    and DiLoCo (each worker's replica differs from the checkpoint's global model): their checkpoint is compared with
    the uninterrupted run's own, saved to local disk."""
    if strategy in ("zero3", "diloco"):
        return {}
    state = module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def _fit(
    strategy: str,
    *,
    max_steps: int,
    dirpath: str | None = None,
    ckpt_path: str | None = None,
    fmt: str = "dcp",
    resume: str | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    ranks = dist.get_world_size()
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    callbacks: list[pl.Callback] = [losses]
    if dirpath is not None:
        # step=N.ckpt: new names (written in place); last.ckpt: saved over by the resumed run (staged, then copied)
        every = ModelCheckpoint(
            dirpath=dirpath,
            filename="{step}",
            every_n_train_steps=SAVED_AT,
            save_last=True,
            enable_version_counter=False,  # save over last.ckpt instead of writing last-v1.ckpt beside it
        )
        callbacks.append(every)
    trainer = quiet_trainer(
        _strategy(strategy, fmt),
        devices=ranks,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_checkpointing=dirpath is not None,
        resume=resume,
    )
    model = Regressor()
    trainer.fit(model, _loader(ranks), ckpt_path=ckpt_path)
    return losses.steps, _full_weights(strategy, model)


def _objects(prefix: str) -> list[str]:
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return sorted(key[len(prefix) + 1 :] for key in fs.find(prefix))


def _load_in_fresh_process(url: str, out: Path, *, with_lightscale: bool) -> dict[str, torch.Tensor]:
    """The weights a process that never trained (and, for a single file, never imported lightscale) reads."""
    if (
        with_lightscale
    ):  # a directory: Lightning's own classmethod, through the hook lightscale.patch_lightning() installs
        code = (
            f"import sys, torch; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; "
            "import lightscale; lightscale.patch_lightning(); "
            "from test_checkpoint_urls import Regressor; "
            f"torch.save(Regressor.load_from_checkpoint({url!r}).state_dict(), {str(out)!r})"
        )
    else:  # a single file: plain torch.load of the object, read through fsspec
        code = (
            "import fsspec, sys, torch; f = fsspec.open(" + repr(url) + ", 'rb').open(); "
            "state = torch.load(f, weights_only=True)['state_dict']; "
            "assert 'lightscale' not in sys.modules; "
            f"torch.save(state, {str(out)!r})"
        )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)
    return torch.load(out, weights_only=True)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


CASES = [
    ("bucketed_ddp", "dcp"),
    ("fsdp2", "dcp"),
    ("fsdp2", "async"),
    ("bucketed_ddp", "file"),
    ("zero3", "dcp"),
    # zero1/2/offload's portable layout reaches the bucket through zero3's writer and reader (tested above); this case
    # adds DeepSpeed's own directory, staged and uploaded, with the optimizer stepped on the host
    ("zero2_offload", "deepspeed"),
    ("diloco", "dcp"),
]


@pytest.mark.parametrize(("strategy", "fmt"), CASES)
def test_save_to_s3_resume_bitwise_and_load_in_a_plain_process(
    strategy: str, fmt: str, s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a URL mangled into a local path would appear
    prefix = f"{BUCKET}/{strategy}-{fmt}"
    url = f"s3://{prefix}"
    local = tmp_path / "local"  # the uninterrupted run saves the same checkpoints to local disk
    whole, final = run_distributed(
        _fit, strategy, max_steps=STEPS, dirpath=str(local), fmt=fmt, world_size=2, timeout_s=240
    )[0]
    first, _ = run_distributed(_fit, strategy, max_steps=SAVED_AT, dirpath=url, fmt=fmt, world_size=2)[0]
    saved = _objects(prefix)
    if fmt == "file":
        assert saved == ["last.ckpt", f"step={SAVED_AT}.ckpt"]
    elif fmt == "deepspeed":  # DeepSpeed's files, uploaded by each rank from its scratch directory, and the marker
        step = f"step={SAVED_AT}.ckpt"
        assert {f"{step}/{name}" for name in ("checkpoint/mp_rank_00_model_states.pt", COMPLETE)} <= set(saved)
        assert sum(name.startswith(f"{step}/checkpoint/zero_pp_rank_") for name in saved) == 2  # a file per rank
    else:
        assert {f"step={SAVED_AT}.ckpt/{name}" for name in (".metadata", "trainer_state.pt", COMPLETE)} <= set(saved)
        assert sum(name.startswith("step=") and name.endswith(".distcp") for name in saved) == 2  # a file per rank
    resume = f"{url}/step={SAVED_AT}.ckpt"
    second, resumed = run_distributed(
        _fit, strategy, max_steps=STEPS, dirpath=url, ckpt_path=resume, fmt=fmt, world_size=2, timeout_s=240
    )[0]
    assert first + second == whole  # bitwise: every loss of the resumed run equals the uninterrupted run's
    _assert_same(resumed, final)
    remaining = _objects(prefix)
    assert not any(name.startswith(f"step={SAVED_AT}.ckpt") for name in remaining)  # save_top_k=1 removed it
    assert not any(".tmp" in name for name in remaining)  # no staging prefix left behind
    assert fmt == "file" or f"last.ckpt/{COMPLETE}" in remaining
    loaded = _load_in_fresh_process(f"{url}/last.ckpt", tmp_path / "w.pt", with_lightscale=fmt != "file")
    _assert_same(loaded, SafeCheckpointIO().load_checkpoint(local / f"step={STEPS}.ckpt")["state_dict"])
    if final:
        _assert_same(loaded, final)
    assert sorted(tmp_path.iterdir()) == [local, tmp_path / "w.pt"]  # nothing else local: no folder named "s3:"
    if fmt == "deepspeed":
        _assert_unmarked_is_never_read(url)


def _assert_unmarked_is_never_read(url: str) -> None:
    """A DeepSpeed directory whose marker is missing (a save that died before it) is skipped by resume="auto" and
    refused by name, by the strategy's resume and by a plain load."""
    fs = fsspec.filesystem("s3")
    assert newest_checkpoint(url) == checkpoint_location(f"{url}/last.ckpt")
    fs.rm(f"{url}/last.ckpt/{COMPLETE}")
    assert newest_checkpoint(url) == checkpoint_location(f"{url}/step={STEPS}.ckpt")
    refused = r"last\.ckpt is an incomplete checkpoint: its save did not finish"
    with pytest.raises(RankFailed, match=refused):
        run_distributed(_fit, "zero2", max_steps=STEPS, ckpt_path=f"{url}/last.ckpt", fmt="deepspeed", world_size=1)
    with pytest.raises(ConfigurationError, match=refused):
        lightning_checkpoint(f"{url}/last.ckpt")


def test_resume_auto_finds_the_newest_complete_checkpoint_in_the_bucket(s3: str, tmp_path: Path) -> None:
    prefix = f"{BUCKET}/auto"
    url = f"s3://{prefix}"
    whole, _ = run_distributed(_fit, "bucketed_ddp", max_steps=STEPS, world_size=2)[0]
    fresh, _ = run_distributed(_fit, "bucketed_ddp", max_steps=SAVED_AT, dirpath=url, resume="auto", world_size=2)[0]
    assert fresh == whole[:SAVED_AT]  # an empty bucket prefix: started fresh
    killed = fsspec.filesystem("s3")  # a newer save killed before its marker: shards and metadata, never complete
    for name in (".metadata", "__0_0.distcp", "trainer_state.pt"):
        killed.pipe(f"{prefix}/step=5.ckpt/{name}", b"half")
    second, _ = run_distributed(_fit, "bucketed_ddp", max_steps=STEPS, dirpath=url, resume="auto", world_size=2)[0]
    assert fresh + second == whole  # resumed from the complete step-3 checkpoint, bitwise


def _cli(*args: str, cwd: Path) -> None:
    """``lightscale <args>`` run in ``cwd``, in this process: these subcommands launch no ranks, so the console
    script's function is the whole command (a fresh interpreter would add only its imports)."""
    with contextlib.chdir(cwd):
        lightscale_main(list(args))


def test_consolidate_export_and_convert_from_s3_to_s3(s3: str, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/consolidate"
    run_distributed(_fit, "fsdp2", max_steps=SAVED_AT, dirpath=url, world_size=2)
    source, output = f"{url}/step={SAVED_AT}.ckpt", f"{url}/model.ckpt"
    weights = SafeCheckpointIO().load_checkpoint(source)["state_dict"]
    _cli("consolidate", source, output, "--with-optimizer", cwd=tmp_path)
    loaded = _load_in_fresh_process(output, tmp_path / "w.pt", with_lightscale=False)  # torch.load, no lightscale
    _assert_same(loaded, weights)
    single = SafeCheckpointIO().load_checkpoint(output)
    assert single["global_step"] == SAVED_AT and len(single["optimizer_states"]) == 1
    _cli("export", source, f"{url}/model.safetensors", "--prefix", "", cwd=tmp_path)
    exported = fsspec.filesystem("s3").cat(f"{BUCKET}/consolidate/model.safetensors")
    _assert_same(safetensors.torch.load(exported), weights)
    _cli("convert", source, f"{url}/model-dcp.ckpt", "--to", "dcp", "--prefix", "", cwd=tmp_path)
    _assert_same(lightning_checkpoint(f"{url}/model-dcp.ckpt")["state_dict"], weights)  # the layout, in the bucket
    assert sorted(tmp_path.iterdir()) == [tmp_path / "w.pt"]


UNTIED = dataclasses.replace(TINY, tie_weights=False)  # pipeline stages cannot share the embedding and the head


@pytest.mark.parametrize(("strategy", "config"), [("tp2", TINY), ("pp2", UNTIED)], ids=["tp2", "pp2"])
def test_parallel_3d_layout_saves_to_s3_and_resumes_bitwise(
    strategy: str, config: GPTConfig, s3: str, corpus_cache: str
) -> None:
    """The tiny GPT under parallel_3d on 2 ranks, tensor parallel (tp2) or a 2-stage pipeline (pp2: each rank saves
    its stage's parameters): 3 steps saved to S3, 3 resumed from there."""
    url = f"s3://{BUCKET}/{strategy}/step3.ckpt"
    run = {"devices": 2, "batch_size": 8, "cache_dir": corpus_cache, "max_steps": 6, "config": config}
    ranks = {"world_size": 2, "timeout_s": 300}
    whole = run_distributed(train_tiny_gpt, strategy, **run, **ranks)[0]
    first = run_distributed(train_tiny_gpt, strategy, stop_after=3, save_checkpoint_to=url, **run, **ranks)[0]
    second = run_distributed(train_tiny_gpt, strategy, resume_from=url, **run, **ranks)[0]
    assert len(first) == len(second) == 3 and first + second == whole


def _fit_and_die_in_save(url: str, nth: int) -> None:
    """fsdp2 to ``STEPS`` saving to ``url``; rank 1 dies (as a kill would) where it would write its shards in its
    ``nth`` save: 1 and 2 are step=3.ckpt and last.ckpt, 3 step=6.ckpt (a new name: written in place), 4 last.ckpt
    again (saved over: staged)."""
    calls = itertools.count(1)
    write = FsspecWriter.write_data

    def write_or_die(self: FsspecWriter, *args: Any, **kwargs: Any) -> Any:
        if next(calls) == nth and dist.get_rank() == 1:
            os._exit(1)
        return write(self, *args, **kwargs)

    with mock.patch.object(FsspecWriter, "write_data", write_or_die):
        _fit("fsdp2", max_steps=STEPS, dirpath=url)


@pytest.mark.parametrize(("nth", "killed"), [(3, "step=6.ckpt"), (4, "last.ckpt.tmp")])
def test_a_rank_killed_mid_save_leaves_nothing_half_written_as_complete(
    nth: int, killed: str, s3: str, tmp_path: Path
) -> None:
    prefix = f"{BUCKET}/killed-{nth}"
    url = f"s3://{prefix}"
    whole, _ = run_distributed(_fit, "fsdp2", max_steps=STEPS, world_size=2)[0]
    with pytest.raises(RankFailed):
        run_distributed(_fit_and_die_in_save, url, nth, world_size=2, collective_timeout_s=20)
    saved = _objects(prefix)
    assert f"{killed}/__0_0.distcp" in saved and f"{killed}/{COMPLETE}" not in saved  # rank 0 wrote, rank 1 died
    assert f"last.ckpt/{COMPLETE}" in saved  # the checkpoint being saved over is whole ...
    assert SafeCheckpointIO().load_checkpoint(f"{url}/last.ckpt")["global_step"] == SAVED_AT  # ... and step 3's
    if nth == 3:
        with pytest.raises(RankFailed, match="incomplete checkpoint"):  # the half-written one is refused by name
            run_distributed(_fit, "fsdp2", max_steps=STEPS, ckpt_path=f"{url}/{killed}", world_size=2)
    second, _ = run_distributed(_fit, "fsdp2", max_steps=STEPS, ckpt_path=f"{url}/last.ckpt", world_size=2)[0]
    assert whole[:SAVED_AT] + second == whole  # resumed from the complete step-3 checkpoint, bitwise


def _memory_round_trip() -> tuple[list[float], list[float], list[float], list[str]]:
    whole, _ = _fit("bucketed_ddp", max_steps=STEPS)
    first, _ = _fit("bucketed_ddp", max_steps=SAVED_AT, dirpath="memory://ckpts/run")
    second, _ = _fit("bucketed_ddp", max_steps=STEPS, ckpt_path=f"memory://ckpts/run/step={SAVED_AT}.ckpt")
    saved = sorted(fsspec.filesystem("memory").find("/ckpts/run"))
    # Lightning's "last", answered by lightscale.Trainer for a bucket: last.ckpt (step 3), whose save finished last
    last, weights = _fit("bucketed_ddp", max_steps=STEPS, dirpath="memory://ckpts/run", ckpt_path="last")
    return whole, first + second, first + last, saved, _predicts_last(weights)


def _predicts_last(weights: dict[str, torch.Tensor]) -> bool:
    """predict(ckpt_path="last") under lightscale.Trainer reads the bucket's last.ckpt: the run's final weights."""
    saver = ModelCheckpoint(dirpath="memory://ckpts/run")
    trainer = quiet_trainer("bucketed_ddp", devices=1, max_steps=1, callbacks=[saver], enable_checkpointing=True)
    predicted = torch.cat(trainer.predict(Regressor(), _loader(1), ckpt_path="last"))
    final = Regressor()
    final.load_state_dict(weights)
    with torch.no_grad():
        return torch.equal(predicted, final.net(_loader(1).dataset.tensors[0]))


def test_memory_url_round_trip_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    whole, resumed, resumed_last, saved, predicted_last = run_distributed(_memory_round_trip, world_size=1)[0]
    assert resumed == whole and resumed_last == whole and predicted_last
    assert f"/ckpts/run/step={SAVED_AT}.ckpt/{COMPLETE}" in saved
    assert list(tmp_path.iterdir()) == []


def _save_to_memory_on_two_ranks() -> tuple[str, list[float]]:
    losses = StepLosses()
    saver = ModelCheckpoint(dirpath="memory://ckpts/shared", every_n_train_steps=1)
    trainer = quiet_trainer(
        _strategy("bucketed_ddp", "dcp"), devices=2, max_steps=2, callbacks=[losses, saver], enable_checkpointing=True
    )
    try:
        trainer.fit(Regressor(), _loader(2))
    except ConfigurationError as error:
        return str(error), losses.steps
    return "trained", losses.steps


def test_memory_url_is_refused_for_several_ranks_before_training() -> None:
    results = run_distributed(_save_to_memory_on_two_ranks, world_size=2)
    assert all("memory://" in m and "2 ranks cannot share it" in m and s == [] for m, s in results), results


def _resume_from_gs() -> tuple[str, list[float]]:
    losses = StepLosses()
    trainer = quiet_trainer(_strategy("bucketed_ddp", "dcp"), devices=1, max_steps=2, callbacks=[losses])
    try:
        trainer.fit(Regressor(), _loader(1), ckpt_path="gs://bucket/run/last.ckpt")
    except ConfigurationError as error:
        return str(error), losses.steps
    return "trained", losses.steps


def test_missing_filesystem_package_is_refused_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _installed("gcsfs"):
        pytest.skip("gcsfs is installed here")
    monkeypatch.chdir(tmp_path)
    message, steps = run_distributed(_resume_from_gs, world_size=1)[0]
    assert "gcsfs" in message and "gs://bucket/run/last.ckpt" in message and steps == []
    assert list(tmp_path.iterdir()) == []


def _installed(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return False
    return True
