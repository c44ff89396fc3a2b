"""``FSDP2Strategy(fault_tolerant=...)`` (hsdp through torchft): 2 replicas x 2 ranks, each replica a launch of
Lightning's launcher sharding over its own 2 ranks, a lighthouse on loopback.

One run: both replicas train together, then replica 1 is SIGKILLed mid-run. The survivor never restarts and
commits steps alone; a restarted replica 1 heals rank by rank from the survivor (rank ``r``'s shards from rank
``r``) and both end at ``max_steps`` with bitwise equal shards. The run is replayed in this process step by step
with plain SGD + momentum, each step the mean over the 2 ranks of each replica that committed it (read from their
``committed, K replica(s)`` lines), no step where none did: the parameters equal the replay within 1e-6. So every
step both lived equals FSDP2 at world size 4, and no step was applied with a partial sum (the one in flight at the
kill included). ``RunSummary`` on each replica reports its steps with fewer replicas, dropped steps and heals as its
log lines count them.

Then the whole job is lost and restarted from its saves (``resume="auto"``): each replica saved the portable layout
(replica 0 at the last step, replica 1 earlier), which Lightning's ``load_from_checkpoint`` opens; relaunched, each
resumes its own save with its torchft count, the replica with the newest save is the source at the first quorum (the
other heals from it, reading on from the source's position), both end bitwise equal with torchft's count gone on, and
the resumed steps equal the replay continued.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.nn.functional as F
from event_log import event_writer, read_events, wait_for
from test_fault_tolerant_step import _done, _finish, _launches

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SAMPLES, BATCH, LR, MOMENTUM, RANKS = 2048, 8, 0.05, 0.9, 2  # 64 steps an epoch: the run stays in its first
KILL_AT, ALONE, MAX_STEPS, STEP_SLEEP_S = 4, 2, 36, 0.2  # the survivor waits after ALONE steps alone (bounded)
SAVE_AT, RESUMED_STEPS = {0: MAX_STEPS, 1: 30}, 4  # replica 1's newest save is older: replica 0 is the source
DEADLINE_S = 240  # six processes start on a shared CPU: most of the time is imports (about 12 s of CPU each)
COMMITTED = re.compile(r"lightscale-ft: step (\d+) committed, (\d+) replica\(s\)")
DROPPED = re.compile(r"lightscale-ft: step (\d+) dropped")
SUMMARY = re.compile(r"fault tolerance: (\d+) step\(s\) committed with fewer than 2 .*, (\d+) dropped .*, (\d+) heal")


def _network() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> Any:
    import torch

    x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(1))
    return x, x.sum(-1, keepdim=True).sin().expand(-1, 4).contiguous()


def _optimizer(params: Any) -> Any:
    import torch

    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)


class Regression(pl.LightningModule):
    """The user's model (``load_from_checkpoint`` opens the replicas' saves with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _network()
        self.x, self.y = _data()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(STEP_SLEEP_S)  # a run long enough to be killed in the middle of
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        optimizer, scheduler = _optimizer(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=True)


def _run(mode: str, replica: int, log: str, port: int, wait_for: str | None) -> None:
    """One replica: a launch of ``RANKS`` ranks (Lightning's launcher re-runs this file for its other rank); ``ft``
    the run one replica is killed in, ``resume`` the whole job restarted from the saves."""
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    import lightscale
    from lightscale.callbacks import RunSummary
    from lightscale.strategies import FSDP2Strategy

    rank = int(os.environ.get("LOCAL_RANK", 0))
    launch = os.getpid() if rank == 0 else os.getppid()  # the launcher's rank 0 started this rank
    write = event_writer(log, mode=mode, replica=replica, rank=rank, launch=launch)
    flags = Path(log).parent

    class Traced(Regression):
        def train_dataloader(self) -> Any:
            write("loading")  # the first quorum follows: the survivor may stop waiting for this replica
            return super().train_dataloader()

    class Events(pl.Callback):
        met, alone = False, 0

        def on_fit_start(self, trainer: pl.Trainer, module: Any) -> None:
            # Set up, before the first quorum: the first launches start it together, and a replacement started
            # early waits for its turn (the test times the rejoin, not Python's start-up; the docs' walk has that).
            write("ready")
            while not (flags / (wait_for or "go")).exists():
                time.sleep(0.02)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ft = trainer.strategy.ft
            participants = ft.step.participants
            write("step", step=trainer.global_step, participants=participants, heals=ft.heals)
            self.met |= participants == 2
            self.alone += self.met and participants == 1
            if self.alone == ALONE and participants == 1:  # the survivor waits for the restarted replica's start-up
                until = time.monotonic() + 60  # (bounded: the test fails on its own deadline, nothing hangs)
                while not (flags / "rejoin").exists() and time.monotonic() < until:
                    time.sleep(0.02)

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            shard = torch.cat([p.to_local().detach().reshape(-1) for p in module.parameters()])
            full = torch.cat([p.full_tensor().detach().reshape(-1) for p in module.parameters()])
            committed = trainer.strategy.ft.step.committed_steps  # torchft's count, saved in the layout
            write("done", step=trainer.global_step, shard=shard.tolist(), params=full.tolist(), committed=committed)

    ft = lightscale.FaultTolerance(
        replica_id=f"replica_{replica}",
        lighthouse=f"http://127.0.0.1:{port}",
        data_shards=2,
        min_replicas=1,
        timeout_s=5,
        quorum_timeout_s=30,
    )
    logger = CSVLogger(flags / f"logs{launch}", name="", version="")  # ft/replicas, rank 0
    save = ModelCheckpoint(dirpath=flags / f"checkpoints{replica}", every_n_train_steps=SAVE_AT[replica])
    trainer = lightscale.Trainer(
        strategy=FSDP2Strategy(fault_tolerant=ft, meta_init=False),
        accelerator="cpu",
        devices=RANKS,
        max_steps=MAX_STEPS + RESUMED_STEPS * (mode == "resume"),
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Events(), RunSummary(), save],
        limit_val_batches=0,
        log_every_n_steps=1,
        resume="auto",
    )
    trainer.fit(Traced())


def _replay(parts_of_step: dict[int, tuple[int, ...]], steps: int = MAX_STEPS) -> Any:
    """Plain SGD + momentum in one process: step ``n`` averages batch ``n`` of each data part (replica) that
    committed it, 2 ranks each (rank ``r`` of part ``p`` reads shard ``2p + r`` of 4: FSDP2 at world size 4 where both
    take part); a step no replica committed is applied by none (its LR-schedule step is taken, as Lightning does)."""
    import torch
    import torch.nn.functional as F

    from lightscale.data.sampler import ExactlyOnceSampler

    net = _network()
    x, y = _data()
    optimizer, scheduler = _optimizer(net.parameters())
    world = 2 * RANKS
    shards = [
        list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=world, rank=k, shuffle=True))
        for k in range(world)
    ]
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        parts = parts_of_step.get(step, ())
        for shard in [shards[part * RANKS + rank] for part in parts for rank in range(RANKS)]:
            index = shard[(step - 1) * BATCH : step * BATCH]
            (F.mse_loss(net(x[index]), y[index]) / (RANKS * len(parts))).backward()
        if parts:
            optimizer.step()
        scheduler.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _steps_in(log: str) -> dict[int, int]:
    """Step -> the replicas it was committed with (0: dropped), from rank 0's log lines."""
    return {int(step): int(count) for step, count in COMMITTED.findall(log)} | {
        int(step): 0 for step in DROPPED.findall(log)
    }


def _parts_of_step(finished: dict[int, str], killed: str) -> dict[int, tuple[int, ...]]:
    """The replicas (data parts) each step was committed by: the finished launches' logs (replica -> log), then the
    killed launch's for steps they did not train (a step it committed as it died may have been dropped by the
    survivor: the killed replica's state is gone, nobody applied it)."""
    seen: dict[int, set[tuple[int, int]]] = {}
    for replica, log in finished.items():
        for step, count in _steps_in(log).items():
            seen.setdefault(step, set()).add((replica, count))
    for step, count in _steps_in(killed).items():
        seen.setdefault(step, {(1, count)})
    parts = {}
    for step, commits in seen.items():
        counts = {count for _, count in commits}
        assert len(counts) == 1, f"step {step} committed by replicas apart: {commits}"  # never two quorums at once
        count = counts.pop()
        parts[step] = (0, 1) if count == 2 else tuple(sorted(replica for replica, _ in commits)) if count else ()
        assert len(parts[step]) == count, commits
    return parts


def test_a_killed_hsdp_replica_heals_rank_by_rank_and_the_lost_job_resumes_from_the_saves(tmp_path: Path) -> None:
    import torch

    import lightscale  # noqa: F401 - Lightning's load_from_checkpoint reads its checkpoint directories

    deadline = time.monotonic() + DEADLINE_S
    events = tmp_path / "events"

    def steps(**match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(events) if e["event"] == "step" and all(e[k] == v for k, v in match.items())]

    def seen(event: str, launch: int) -> bool:
        return any(e["event"] == event and e["launch"] == launch for e in read_events(events))

    with _launches(tmp_path, min_replicas=1, script=__file__) as start:
        survivor, killed, replacement = start("ft", 0), start("ft", 1), start("ft", 1, "restart")
        wait_for(lambda: seen("ready", survivor.pid) and seen("ready", killed.pid), "both replicas", deadline)
        (tmp_path / "go").touch()
        wait_for(lambda: steps(launch=killed.pid, rank=0, step=KILL_AT), f"step {KILL_AT} of replica 1", deadline)
        os.killpg(killed.pid, signal.SIGKILL)  # both ranks of the launch
        killed.wait()
        killed_at = time.monotonic()
        alone_after_kill = lambda: [e for e in steps(launch=survivor.pid, participants=1) if e["step"] > KILL_AT]  # noqa: E731
        wait_for(alone_after_kill, "a step of the survivor alone", deadline)
        alone_at = time.monotonic()
        (tmp_path / "restart").touch()
        wait_for(lambda: seen("loading", replacement.pid), "the replacement's start-up", deadline)
        (tmp_path / "rejoin").touch()
        wait_for(lambda: steps(launch=replacement.pid), "the replacement's first step", deadline)
        rejoined_at = time.monotonic()
        _finish([survivor, replacement], tmp_path, deadline)

    done = _done(tmp_path, mode="ft")
    assert sorted((e["launch"], e["rank"]) for e in done) == sorted(
        (launch, rank) for launch in (survivor.pid, replacement.pid) for rank in range(RANKS)
    )  # the survivor never restarted
    assert {e["step"] for e in done} == {MAX_STEPS}
    by = {(e["launch"], e["rank"]): e for e in done}
    for rank in range(RANKS):  # bitwise: rank r healed from rank r, then every step applied alike
        assert by[survivor.pid, rank]["shard"] == by[replacement.pid, rank]["shard"]
    assert all(e["params"] == done[0]["params"] for e in done)

    first, last = steps(launch=replacement.pid, rank=0)[0], steps(launch=killed.pid, rank=0)[-1]
    assert first["heals"] == 1 and first["participants"] == 2 and first["step"] > last["step"] >= KILL_AT
    met = steps(launch=survivor.pid, rank=0, participants=2)[0]["step"]  # the first quorum may be one replica's
    alone = [e["step"] for e in steps(launch=survivor.pid, rank=0, participants=1) if e["step"] > met]
    assert alone and all(last["step"] < step < first["step"] for step in alone)
    assert {e["participants"] for e in steps(launch=survivor.pid) if e["step"] >= first["step"]} == {2}

    logs = {path: path.read_text() for path in tmp_path.glob("ft*.txt")}
    parts = _parts_of_step(
        {0: logs[tmp_path / "ft0.0.txt"], 1: logs[tmp_path / "ft1.2.txt"]}, logs[tmp_path / "ft1.1.txt"]
    )
    assert parts[KILL_AT] == (0, 1) and parts[first["step"]] == (0, 1) and parts[alone[-1]] == (0,)
    end, replayed = torch.tensor(done[0]["params"]), _replay(parts)
    torch.testing.assert_close(end, replayed, rtol=1e-6, atol=1e-6)
    planted = {step: (0, 1) for step in parts}  # the survivor's steps alone taken as steps of both: caught
    assert not torch.allclose(end, _replay(planted), rtol=1e-6, atol=1e-6)
    assert "lightscale-ft: healed from replica_0 at step" in logs[tmp_path / "ft1.2.txt"]
    with open(tmp_path / f"logs{survivor.pid}" / "metrics.csv") as metrics:
        assert {float(row["ft/replicas"]) for row in csv.DictReader(metrics) if row["ft/replicas"]} >= {1.0, 2.0}
    # RunSummary counts what the log lines show: the survivor's steps alone after both met, the steps dropped, heals.
    # (The survivor may heal too, at the very first quorum: every replica at step 0, torchft picks a source.)
    summaries = {}
    for replica, log in ((0, logs[tmp_path / "ft0.0.txt"]), (1, logs[tmp_path / "ft1.2.txt"])):
        counts = [count for step, count in _steps_in(log).items() if step > met]
        expected = (sum(count == 1 for count in counts), counts.count(0), log.count("lightscale-ft: healed from"))
        summaries[replica] = [tuple(map(int, found)) for found in SUMMARY.findall(log)]
        assert summaries[replica] == [expected], log[-3000:]
    assert summaries[0][0][0] >= 1 and summaries[1][0][2] == 1  # steps alone, the replacement's heal: not vacuous

    # The saves open as a Lightning user opens them; torchft's count is in the layout.
    committed = by[survivor.pid, 0]["committed"]  # ... at MAX_STEPS, the same on the healed replica
    at_save = {0: committed, 1: committed - sum(bool(parts[step]) for step in range(SAVE_AT[1] + 1, MAX_STEPS + 1))}
    # The replacement's sampler is ahead of Lightning's batch count by the heal's jump (one batch a step, epoch 0).
    # The survivor's too, where it healed at its first quorum (the other replica had stepped alone before it met).
    healed_at = int(re.search(r"healed from replica_0 at step (\d+)", logs[tmp_path / "ft1.2.txt"]).group(1))
    first_heal = re.search(r"healed from replica_1 at step (\d+)", logs[tmp_path / "ft0.0.txt"])
    offset = {0: [0, int(first_heal.group(1)) if first_heal else 0], 1: [0, healed_at]}
    for replica in (0, 1):
        saved = tmp_path / f"checkpoints{replica}" / f"epoch=0-step={SAVE_AT[replica]}.ckpt"
        state = torch.load(saved / "trainer_state.pt", weights_only=False)["lightscale"]["fault_tolerance"]
        expected = {"replica": f"replica_{replica}", "committed_steps": at_save[replica], "offset": offset[replica]}
        assert state == expected
        weights = torch.cat([p.detach().reshape(-1) for p in Regression.load_from_checkpoint(saved).parameters()])
        torch.testing.assert_close(weights, _replay(parts, SAVE_AT[replica]), rtol=1e-6, atol=1e-6)
        assert replica == 1 or torch.equal(weights, end)  # replica 0 saved at the end

    # Every replica lost: the job restarts from the saves (their directories go with it), resume="auto".
    again = tmp_path / "again"
    again.mkdir()
    for replica in (0, 1):
        shutil.move(tmp_path / f"checkpoints{replica}", again / f"checkpoints{replica}")
    (again / "go").touch()
    deadline = time.monotonic() + DEADLINE_S
    with _launches(again, min_replicas=2, script=__file__) as start:  # both at the first quorum
        _finish([start("resume", 0), start("resume", 1)], again, deadline)
    resumed = _done(again)
    assert len(resumed) == 2 * RANKS and {e["step"] for e in resumed} == {MAX_STEPS + RESUMED_STEPS}
    assert all(e["params"] == resumed[0]["params"] for e in resumed)
    logs = {path.name: path.read_text() for path in again.glob("resume*.txt")}
    assert f"lightscale-ft: healed from replica_0 at step {MAX_STEPS}" in logs["resume1.1.txt"]  # the newest save
    assert "healed from" not in logs["resume0.0.txt"]
    more = range(MAX_STEPS + 1, MAX_STEPS + RESUMED_STEPS + 1)
    assert {step: count for step, count in _steps_in(logs["resume0.0.txt"]).items()} == dict.fromkeys(more, 2)
    assert {e["committed"] for e in resumed} == {committed + RESUMED_STEPS}  # torchft's count went on
    # The resumed steps are the run continued: replica 1 healed to replica 0's save and read on from its position
    # (a heal that sent the start of the epoch, as before, re-read part 1 from batch 0: 1.2e-2 off).
    continued = _replay(parts | dict.fromkeys(more, (0, 1)), MAX_STEPS + RESUMED_STEPS)
    torch.testing.assert_close(torch.tensor(resumed[0]["params"]), continued, rtol=1e-6, atol=1e-6)
    resumed_margin = (torch.tensor(resumed[0]["params"]) - continued).abs().max()
    print(
        f"margin {(end - replayed).abs().max():.1e}, resumed {resumed_margin:.1e}; survivor alone "
        f"{alone_at - killed_at:.1f} s after the kill; the replacement's first step {rejoined_at - alone_at:.1f} s "
        f"after its release"
    )


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] or None)
