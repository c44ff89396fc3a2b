"""Streams by name: litdata and Hugging Face datasets read one data shard each under fsdp2 and tp2, and a run stopped
mid-epoch and resumed from its checkpoint reads every sample exactly once.

The data are written locally (a litdata-optimized directory, parquet files), sample ``i`` a token window whose first
token is ``i``; a callback records which samples each rank trains on. The loaders are litdata's StreamingDataLoader
and torchdata's StatefulDataLoader (over HF's streaming IterableDataset): Lightning saves their state, lightscale saves
every data shard's (data/loader_position.py) and gives each its own back.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import litdata
import torch
import torch.distributed as dist
from helpers import TINY, StopAfter, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

import lightscale
from lightscale.recipes.gpt import GPTModule
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

SAMPLES = 24  # fsdp2 on 2 ranks: 2 data shards x batch 2 -> 6 steps; tp2: 1 shard -> 12 steps
BATCH = 2
STOP = 3  # steps before the stop (ModelCheckpoint writes the checkpoint there, as before a kill)
KINDS = ("litdata", "hf", "map")
STRATEGIES = {"fsdp2": lambda: "fsdp2", "tp2": lambda: Parallel3DStrategy(tp=2)}


def window(i: int) -> list[int]:
    """Sample ``i``: block_size + 1 tokens starting with ``i``."""
    return [i] + [(i * 7 + k) % 200 + 1 for k in range(TINY.block_size)]


def write_data(root: Path) -> None:
    cache = litdata.streaming.Cache(str(root / "litdata"), chunk_size=5)  # 5 chunks: shards split by chunk
    for i in range(SAMPLES):
        cache[i] = torch.tensor(window(i))
    cache.done()
    cache.merge()
    # 4 files; of 2 data shards each streams 2 (files 0 + 2, 1 + 3): 12 samples each, but at the stop the shards
    # stand at different places (file 2, row 4; file 1, row 6), so a shard resumed from the other's state would err.
    bounds = [0, 2, 12, 22, SAMPLES]
    for part in range(4):
        rows = [window(i) for i in range(bounds[part], bounds[part + 1])]
        datasets.Dataset.from_dict({"tokens": rows}).to_parquet(str(root / f"part-{part}.parquet"))


def pair(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[..., :-1], tokens[..., 1:]


def collate_rows(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    return pair(torch.tensor([row["tokens"] for row in rows]))


class StreamData(pl.LightningDataModule):
    """The loader is built in ``train_dataloader``: after the strategy's setup, so the data shard is known."""

    def __init__(self, kind: str, root: str) -> None:
        super().__init__()
        self.kind, self.root = kind, Path(root)

    def train_dataloader(self) -> Any:
        if self.kind == "litdata":
            stream = litdata.StreamingDataset(str(self.root / "litdata"), shuffle=True, seed=5, transform=pair)
            return litdata.StreamingDataLoader(lightscale.streams.shard_litdata(stream), batch_size=BATCH)
        if self.kind == "map":  # a map-style dataset: lightscale's sampler shards it, the loader keeps its place
            windows = torch.tensor([window(i) for i in range(SAMPLES)])
            return StatefulDataLoader(list(zip(*pair(windows), strict=True)), batch_size=BATCH)
        files = sorted(str(p) for p in self.root.glob("*.parquet"))
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        stream = lightscale.streams.shard_hf(stream)
        return StatefulDataLoader(stream, batch_size=BATCH, collate_fn=collate_rows)


class RecordIds(pl.Callback):
    def __init__(self) -> None:
        self.ids: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.ids.extend(batch[0][:, 0].tolist())


def _fit(strategy: str, kind: str, root: str, *, stop: bool) -> list[int]:
    pl.seed_everything(7, verbose=False)
    recorder, name = RecordIds(), f"{strategy}-{kind}"
    saver = ModelCheckpoint(dirpath=root, filename=name, every_n_train_steps=STOP, save_top_k=-1)
    callbacks = [recorder, saver, StopAfter(STOP)] if stop else [recorder]
    trainer = quiet_trainer(
        STRATEGIES[strategy](), devices=2, max_steps=-1, max_epochs=1, callbacks=callbacks, enable_checkpointing=stop
    )
    ckpt = None if stop else f"{root}/{name}.ckpt"
    trainer.fit(GPTModule(TINY, learning_rate=1e-3, warmup_steps=1), StreamData(kind, root), ckpt_path=ckpt)
    return recorder.ids


def _stop_and_resume(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"shard": tuple(lightscale.data_shard())}
    for strategy in STRATEGIES:
        for kind in KINDS:
            first = _fit(strategy, kind, root, stop=True)
            out[strategy, kind] = (first, _fit(strategy, kind, root, stop=False), tuple(lightscale.data_shard()))
    out["torchvision"] = "torchvision" in sys.modules  # litdata requires it on paper; nothing here may import it
    dist.barrier()
    return out


def test_streams_resume_mid_epoch_reading_every_sample_once(tmp_path) -> None:
    write_data(tmp_path)
    ranks = run_distributed(_stop_and_resume, str(tmp_path), world_size=2, timeout_s=600)
    for strategy in STRATEGIES:
        for kind in KINDS:
            runs = [rank[strategy, kind] for rank in ranks]
            shards = {shard: first + second for first, second, shard in runs}
            for first, second, shard in runs:
                assert len(first) == STOP * BATCH and first + second == shards[shard], (strategy, kind, "tp ranks")
            seen = Counter(i for ids in shards.values() for i in ids)
            twice = sorted(i for i, n in seen.items() if n > 1)
            missing = sorted(set(range(SAMPLES)) - set(seen))
            assert not twice and not missing, (strategy, kind, f"read twice {twice}, never {missing}", runs)
            assert len(shards) == {"fsdp2": 2, "tp2": 1}[strategy]
    assert not any(rank["torchvision"] for rank in ranks)
