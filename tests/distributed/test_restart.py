"""A job killed three times restarts by itself and ends with the weights of an uninterrupted run (bitwise, fp32).

One job per strategy under torchrun's elastic agent with ``--max-restarts 3`` runs ``lightscale fit ... --resume
auto`` with a checkpoint every 2 steps and dies once per attempt: rank 1 SIGKILLed after step 3 (attempt 0),
a rank SIGKILLed *while the checkpoint of step 6 is being written* (attempt 1: it resumes from step 4, the
previous complete one), rank 1 after step 9 (attempt 2); attempt 3 finishes. The final checkpoint, read through
``lightscale export``, must equal the one of the same command run once without faults.

Workers are forked by torchrun's agent (``lightscale.testing.torchrun_fork``), not started as new interpreters:
the agent, rendezvous and restarts are torchrun's own, and four attempts cost seconds instead of a minute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightscale.cli import main as lightscale_main
from lightscale.testing import torchrun_fork

pytestmark = pytest.mark.slow  # real processes under torchrun's elastic agent
STEPS, EVERY, KILLS, IN_SAVE = 12, 2, [3, 6, 9], 6
CONFIG = """
seed_everything: 1234
trainer:
  accelerator: cpu
  devices: 2
  strategy: {strategy}
  max_steps: {steps}
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  limit_val_batches: 0
  num_sanity_val_steps: 0
  default_root_dir: {workdir}
  callbacks:
    - class_path: lightscale.callbacks.PeriodicCheckpoint
      init_args: {{dirpath: {workdir}/ckpts, every_n_steps: {every}, keep: 2}}
    - class_path: lightscale.testing.KillAt
      init_args: {{steps: {kills}, in_save: [{in_save}], report_dir: {workdir}}}
model:
  class_path: lightscale.recipes.gpt.GPTModule
  init_args:
    config: {{block_size: 32, n_layer: 2, n_head: 2, n_embd: 32}}
    learning_rate: 3.0e-3
    warmup_steps: 3
data:
  class_path: lightscale.recipes.gpt.GPTDataModule
  init_args: {{block_size: 32, batch_size: 4, cache_dir: {cache}}}
"""


def _final_weights(strategy: str, kills: list[int], workdir: Path, cache: str) -> dict[str, torch.Tensor]:
    workdir.mkdir()
    config = CONFIG.format(
        strategy=strategy, steps=STEPS, workdir=workdir, every=EVERY, kills=kills, in_save=IN_SAVE, cache=cache
    )
    (workdir / "run.yaml").write_text(config)
    command = ["fit", "--config", str(workdir / "run.yaml"), "--resume", "auto"]
    torchrun_fork(lightscale_main, command, nproc=2, max_restarts=len(kills))
    reports = sorted(workdir.glob("kill_*.json"))
    assert [path.name for path in reports] == (["kill_1.json"] if kills else [])
    if kills:  # the kill in the save hit while the checkpoint of step 6 was being written beside the complete ones
        entries = json.loads(reports[0].read_text())["entries"]
        assert "step=4.ckpt" in entries and any(entry.startswith("step=6.ckpt.") for entry in entries), entries
    final = workdir / "ckpts" / f"step={STEPS}.ckpt"
    lightscale_main(["export", str(final), str(workdir / "final.pt")])
    return torch.load(workdir / "final.pt", weights_only=True)


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero2", "fsdp2", "tp2"])
def test_a_job_killed_three_times_restarts_itself_and_ends_as_if_never_killed(
    strategy: str, tmp_path: Path, corpus_cache: str
) -> None:
    restarted = _final_weights(strategy, KILLS, tmp_path / "killed", corpus_cache)
    uninterrupted = _final_weights(strategy, [], tmp_path / "clean", corpus_cache)
    assert restarted.keys() == uninterrupted.keys()
    for name, tensor in restarted.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, uninterrupted[name]), name
