"""``FSDP2Strategy(fault_tolerant=...)`` (hsdp through torchft): 2 replicas x 2 ranks, each replica a launch of
Lightning's launcher sharding over its own 2 ranks, a lighthouse on loopback.

One run: both replicas train together, then replica 1 is SIGKILLed mid-run. The survivor never restarts and
commits steps alone; a restarted replica 1 heals rank by rank from the survivor (rank ``r``'s shards from rank
``r``) and both end at ``max_steps`` with bitwise equal shards. The run is replayed in this process step by step
with plain SGD + momentum, each step the mean over the 2 ranks of each replica that committed it (read from their
``committed, K replica(s)`` lines), no step where none did: the parameters equal the replay within 1e-6. So every
step both lived equals FSDP2 at world size 4, and no step was applied with a partial sum (the one in flight at the
kill included).
"""

from __future__ import annotations

import csv
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from event_log import event_writer, read_events, wait_for
from test_fault_tolerant_step import _done, _finish, _launches

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SAMPLES, BATCH, LR, MOMENTUM, RANKS = 2048, 8, 0.05, 0.9, 2  # 64 steps an epoch: the run stays in its first
KILL_AT, ALONE, MAX_STEPS, STEP_SLEEP_S = 4, 2, 36, 0.2  # the survivor waits after ALONE steps alone (bounded)
DEADLINE_S = 240  # six processes start on a shared CPU: most of the time is imports (about 12 s of CPU each)
COMMITTED = re.compile(r"lightscale-ft: step (\d+) committed, (\d+) replica\(s\)")
DROPPED = re.compile(r"lightscale-ft: step (\d+) dropped")


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


def _run(mode: str, replica: int, log: str, port: int, wait_for: str | None) -> None:
    """One replica: a launch of ``RANKS`` ranks (Lightning's launcher re-runs this file for its other rank)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    import lightscale
    from lightscale.strategies import FSDP2Strategy

    rank = int(os.environ.get("LOCAL_RANK", 0))
    launch = os.getpid() if rank == 0 else os.getppid()  # the launcher's rank 0 started this rank
    write = event_writer(log, mode=mode, replica=replica, rank=rank, launch=launch)
    flags = Path(log).parent

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _network()
            self.x, self.y = _data()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(STEP_SLEEP_S)  # a run long enough to be killed in the middle of
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            optimizer, scheduler = _optimizer(self.parameters())
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> Any:
            write("loading")  # the first quorum follows: the survivor may stop waiting for this replica
            return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=True)

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
            write("done", step=trainer.global_step, shard=shard.tolist(), params=full.tolist())

    ft = lightscale.FaultTolerance(
        replica_id=f"replica_{replica}", lighthouse=f"http://127.0.0.1:{port}", data_shards=2,
        min_replicas=1, timeout_s=5, quorum_timeout_s=30,
    )  # fmt: skip
    logger = CSVLogger(flags / f"logs{launch}", name="", version="")  # ft/replicas, rank 0
    trainer = pl.Trainer(strategy=FSDP2Strategy(fault_tolerant=ft, meta_init=False), accelerator="cpu",
                         devices=RANKS, max_steps=MAX_STEPS, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Events()],
                         limit_val_batches=0, log_every_n_steps=1)  # fmt: skip
    trainer.fit(Regression())


def _replay(parts_of_step: dict[int, tuple[int, ...]]) -> Any:
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
    shards = [list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=world, rank=k, shuffle=True))
              for k in range(world)]  # fmt: skip
    for step in range(1, MAX_STEPS + 1):
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


def test_a_killed_hsdp_replica_heals_rank_by_rank_while_the_survivor_trains_on(tmp_path: Path) -> None:
    import torch

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

    done = _done(tmp_path)
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
    print(f"margin {(end - replayed).abs().max():.1e}; survivor alone {alone_at - killed_at:.1f} s after the "
          f"kill; the replacement's first step {rejoined_at - alone_at:.1f} s after its release")  # fmt: skip


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] or None)
