"""``lightscale export CKPT DIR --hf``: a tiny Llama (config built here, nothing downloaded) trained under fsdp2 and
tp2 comes back from ``AutoModelForCausalLM.from_pretrained`` in a process that cannot import lightscale, with the
logits the trained model gave; the GPT recipe exports to safetensors + its config the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
from helpers import S3_BUCKET
from lightning.pytorch.callbacks import WeightAveraging
from safetensors.torch import load_file
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Subset, TensorDataset

import lightscale
from lightscale.cli import main as cli
from lightscale.testing import run_distributed

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-6  # absolute, fp32 logits (measured: fsdp2 0, tp2 3e-7: its all-reduce sums in another order)
STEPS = 4
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
TOKENS = torch.arange(24).reshape(2, 12) % 64


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


class LlamaLM(pl.LightningModule):
    """A user's LightningModule holding a Hugging Face model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(_config())

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        # transformers' own plan for Llama (names relative to LlamaModel), as torch styles on LlamaForCausalLM
        return {f"model.{name}": STYLES[style]() for name, style in self.model.config.base_model_tp_plan.items()}

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _fit(strategy: str, dp: int, checkpoint: str) -> list[list[float]]:
    rank = torch.distributed.get_rank()
    pl.seed_everything(7, verbose=False)
    data = TensorDataset(torch.randint(0, 64, (STEPS * 4, 12), generator=torch.Generator().manual_seed(0)))
    trainer = lightscale.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        # tp2 with an EMA: after fit the model holds the average (Lightning's on_train_end), and so must --averaged
        callbacks=[WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.5))] if strategy == "tp2" else [],
    )
    module = LlamaLM()
    trainer.fit(module, DataLoader(Subset(data, range(rank % dp, len(data), dp)), batch_size=4 // dp))
    trainer.save_checkpoint(checkpoint)
    with torch.no_grad():  # the trained model's logits, computed by the strategy's own (sharded) model
        return module.model(input_ids=TOKENS).logits.tolist()


LOAD = """
import sys, json, torch
sys.modules["lightscale"] = None  # this process cannot import lightscale
from transformers import AutoModelForCausalLM
out = []
for directory in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        out.append(model(input_ids=torch.tensor(json.loads(sys.argv[1]))).logits.tolist())
print(json.dumps(out))
"""


def _from_pretrained(*directories: Path) -> torch.Tensor:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    args = [sys.executable, "-c", LOAD, json.dumps(TOKENS.tolist()), *map(str, directories)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=True)
    return torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))


def test_llama_trained_under_fsdp2_and_tp2_round_trips_through_from_pretrained(tmp_path: Path) -> None:
    trained = []
    for strategy, dp in (("fsdp2", 2), ("tp2", 1)):
        checkpoint = tmp_path / f"{strategy}.ckpt"
        trained.append(run_distributed(_fit, strategy, dp, str(checkpoint), world_size=2, timeout_s=300)[0])
        cli(["export", str(checkpoint), str(tmp_path / strategy), "--hf", "--max-shard-size", "20KB"])
        files = sorted(path.name for path in (tmp_path / strategy).iterdir())
        assert "config.json" in files and "model.safetensors.index.json" in files  # sharded above the size
        assert sum(name.endswith(".safetensors") for name in files) > 1
    cli(["export", str(tmp_path / "tp2.ckpt"), str(tmp_path / "tp2_averaged"), "--hf", "--averaged"])
    trained.append(trained[-1])
    loaded = _from_pretrained(tmp_path / "fsdp2", tmp_path / "tp2", tmp_path / "tp2_averaged")
    assert (loaded - torch.tensor(trained)).abs().max() <= TOLERANCE
    with pytest.raises(SystemExit, match=r"--module 'net' is not an exportable model of .*recorded: \['model'\]"):
        cli(["export", str(tmp_path / "tp2.ckpt"), str(tmp_path / "other"), "--hf", "--module", "net"])


def test_export_from_s3_to_s3_loads_with_from_pretrained(s3: str, tmp_path: Path) -> None:
    """A checkpoint in the bucket exported into the bucket (sharded, then again over it unsharded): the folder,
    downloaded, loads with from_pretrained in a process without lightscale and gives the trained logits."""
    url = f"s3://{S3_BUCKET}/hf"
    trained = run_distributed(_fit, "fsdp2", 2, f"{url}/fsdp2.ckpt", world_size=2, timeout_s=300)[0]
    fs = fsspec.filesystem("s3")
    folders, listings = [], []
    for shard in ("20KB", "5GB"):  # the second export, unsharded, replaces the first in the same folder
        cli(["export", f"{url}/fsdp2.ckpt", f"{url}/out", "--hf", "--max-shard-size", shard])
        fs.invalidate_cache()
        listings.append(sorted(key.rsplit("/", 1)[-1] for key in fs.find(f"{S3_BUCKET}/hf/out")))
        folders.append(tmp_path / shard)
        fs.get(f"{S3_BUCKET}/hf/out/", str(folders[-1]), recursive=True)
    sharded, single = listings
    assert "config.json" in sharded and "model.safetensors.index.json" in sharded
    assert sum(name.endswith(".safetensors") for name in sharded) > 1
    assert "config.json" in single and [name for name in single if "safetensors" in name] == ["model.safetensors"]
    loaded = _from_pretrained(*folders)
    assert (loaded - torch.tensor([trained, trained])).abs().max() <= TOLERANCE


def test_gpt_recipe_exports_safetensors_and_its_config(tmp_path: Path, corpus_cache: str) -> None:
    from helpers import TINY, train_tiny_gpt

    from lightscale.recipes.gpt import GPT, GPTConfig

    checkpoint = tmp_path / "last.ckpt"
    run_distributed(
        train_tiny_gpt,
        "fsdp2",
        devices=2,
        batch_size=4,
        max_steps=2,
        stop_after=2,
        cache_dir=corpus_cache,
        save_checkpoint_to=str(checkpoint),
        world_size=2,
        timeout_s=300,
    )
    cli(["export", str(checkpoint), str(tmp_path / "gpt"), "--hf"])
    config = json.loads((tmp_path / "gpt" / "config.json").read_text())
    assert config.pop("architectures") == ["lightscale.recipes.gpt.model.GPT"]
    assert GPTConfig(**config) == TINY
    model = GPT(GPTConfig(**config))
    model.load_state_dict(load_file(tmp_path / "gpt" / "model.safetensors"))
    exported = lightscale.checkpoint.convert.read_model_state(checkpoint)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
