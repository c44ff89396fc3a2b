"""A ZeRO checkpoint exported to one fp32 state dict loads into the plain GPT and gives the same eval loss."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, train_tiny_gpt
from safetensors.torch import load_file

from lightscale.cli import main as lightscale_main
from lightscale.recipes.gpt import GPT
from lightscale.recipes.gpt.data import ByteTokenizer, default_corpus
from lightscale.strategies import ZeroStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative; the same fp32 weights in a different process, so only summation order differs


def eval_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four windows of the corpus's last text (English prose), so a trained model scores visibly better."""
    ids = torch.from_numpy(ByteTokenizer().encode(default_corpus()[-4000:]).astype("int64"))
    windows = ids[: 4 * (TINY.block_size + 1)].view(4, TINY.block_size + 1)
    return windows[:, :-1], windows[:, 1:]


def eval_loss(model: torch.nn.Module) -> float:
    tokens, targets = eval_batch()
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).item()


class EvalLossAtEnd(pl.Callback):
    """The eval loss of the trained, still sharded model on :func:`eval_batch`."""

    def __init__(self) -> None:
        self.loss: float | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.eval()
        with torch.no_grad():
            self.loss = pl_module.loss(eval_batch()).item()


def _train_and_save(name: str, checkpoint: str, cache_dir: str) -> float:
    probe = EvalLossAtEnd()
    # Stops right after the checkpoint of step 5, so the saved weights are the ones evaluated at the end.
    train_tiny_gpt(
        ZeroStrategy(stage=2, checkpoint_format="deepspeed") if name == "zero2" else name,  # both formats
        devices=2,
        batch_size=4,
        cache_dir=cache_dir,
        max_steps=10,
        stop_after=5,
        save_checkpoint_to=checkpoint,
        extra_callbacks=[probe],
    )
    assert probe.loss is not None
    return probe.loss


@pytest.mark.parametrize("name", ["zero2", "zero3_offload"])
def test_exported_weights_give_the_same_eval_loss(name: str, corpus_cache: str, tmp_path: Path, capsys) -> None:
    checkpoint = tmp_path / "last.ckpt"
    sharded_losses = run_distributed(_train_and_save, name, str(checkpoint), corpus_cache, world_size=2)
    assert sharded_losses[0] == sharded_losses[1]

    lightscale_main(["export", str(checkpoint), str(tmp_path / "gpt.pt")])
    assert "wrote 20 tensors" in capsys.readouterr().out
    model = GPT(TINY)
    untrained = eval_loss(model)
    model.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True))  # strict: every key, right shapes
    loss = eval_loss(model)
    assert abs(loss - sharded_losses[0]) <= TOLERANCE * sharded_losses[0]
    assert loss < untrained - 0.3  # trained weights: the comparison is not between two fresh models
    # lightscale convert reads the same DeepSpeed directory into the same tensors, as safetensors
    lightscale_main(["convert", str(checkpoint), str(tmp_path / "gpt.safetensors")])
    converted = load_file(tmp_path / "gpt.safetensors")
    assert converted.keys() == model.state_dict().keys()
    assert all(torch.equal(tensor, converted[key]) for key, tensor in model.state_dict().items())


def test_export_of_a_directory_that_is_no_zero_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="is not a ZeRO checkpoint directory"):
        lightscale_main(["export-zero", str(tmp_path), str(tmp_path / "out.pt")])
    assert not (tmp_path / "out.pt").exists()
