"""``DiLoCoStrategy(fault_tolerant=...)`` through Lightning: 3 workers, each its own launch, meeting at a lighthouse.

One worker is SIGKILLed mid-round and restarted, then another is frozen (SIGSTOP: alive, silent) mid-round. The
others never stop. Each worker logs, per round, the participants, its pseudo-gradient and the mean it applied; the
test checks every committed mean against exactly that round's workers and replays the outer optimizer over the
recorded rounds to the final global model.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from event_log import event_writer, read_events, wait_for

from lightscale.testing import free_port

TEST_PATHS = (Path(__file__).parents[2], Path(__file__).parents[1])  # the project and tests/, for the workers
pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SYNC_EVERY, STEP_SLEEP_S, OUTER_LR, OUTER_MOMENTUM = 4, 0.06, 0.7, 0.9
FROZEN = 1  # with 3 workers; the last worker is the one killed and restarted
TIMEOUT_S = 4.0  # a frozen worker holds its round's collective this long at most
DEADLINE_S = 240
SAMPLES, BATCH = 1 << 16, 16  # every worker reads its part of the data (one epoch: no test runs past it)


def _worker(replica: int, workers: int, ranks: int, lighthouse: str, log_path: str, wait_for: str | None) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightscale import Trainer
    from lightscale.fault_tolerance import FaultTolerance
    from lightscale.strategies import DiLoCoStrategy

    flags = Path(log_path).parent
    rank = int(os.environ.get("LOCAL_RANK", 0))  # Lightning's launcher starts rank 1 with it
    write = event_writer(log_path, replica=replica, rank=rank)

    def flat(tensors: Any) -> list[float]:
        return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(100 + replica + 10 * os.getpid())  # different starts: the first quorum syncs them
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(0))  # split in parts
            self.y = self.x.sum(-1, keepdim=True).sin()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            index, x, y = batch
            outer = self.trainer.strategy.outer
            if outer.step % SYNC_EVERY == 0:  # a round's first step: every worker of it holds the global model
                ft = self.trainer.strategy.ft
                write(
                    "round_start",
                    round=ft.rounds_committed,
                    step=outer.step,
                    heals=ft.heals,
                    params=flat(self.parameters()),
                    sample=int(index[0]),
                )
            time.sleep(STEP_SLEEP_S)  # rounds long enough to be killed in the middle of one
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.arange(SAMPLES), self.x, self.y), batch_size=BATCH)

    class Events(pl.Callback):
        def setup(self, trainer: pl.Trainer, module: Any, stage: str) -> None:
            # A replacement waits here: started, its ranks launched and connected, but no torchft manager yet (the
            # strategy makes it next), so that the test times the rejoin, not Python's start-up.
            while wait_for is not None and not (flags / wait_for).exists():
                time.sleep(0.02)

        def on_fit_start(self, trainer: pl.Trainer, module: Any) -> None:
            def on_round(record: Any, payload: torch.Tensor, mean: torch.Tensor | None) -> None:
                write(
                    "round",
                    **record.__dict__,
                    payload=payload.tolist(),
                    applied=None if mean is None else mean.tolist(),
                )

            trainer.strategy.ft.on_round = on_round
            write("start")
            while wait_for is None and not (flags / "go").exists():  # the first round: all workers
                time.sleep(0.02)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            stop = flags / "stop_at"
            if stop.exists() and trainer.strategy.ft.rounds_committed >= int(stop.read_text()):
                trainer.should_stop = True

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            write(
                "done",
                step=trainer.strategy.outer.step,
                globals=flat(t for _, t in trainer.strategy.outer.named_globals()),
            )

    ft = FaultTolerance(
        replica_id=f"worker_{replica}",
        lighthouse=lighthouse,
        timeout_s=TIMEOUT_S,
        min_replicas=workers - 1,
        data_shards=workers,
    )
    strategy = DiLoCoStrategy(
        sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, fault_tolerant=ft
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=ranks,
        max_steps=10**6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Events()],
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(Net())


def _run_job(tmp_path: Path, workers: int, ranks: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Start a lighthouse and the workers; kill the last worker mid-round and restart it; with 3 workers, then
    freeze worker FROZEN mid-round; stop the live ones a few rounds later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, TEST_PATHS))}
    killed, port = workers - 1, free_port()
    lighthouse_cmd = [
        sys.executable,
        "-m",
        "lightscale.fault_tolerance.lighthouse",
        "--min-replicas",
        str(workers - 1),
        "--port",
        str(port),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    log = tmp_path / "events"
    log.mkdir()

    def start(replica: int, *wait_for: str) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"worker{replica}.{len(procs)}.txt", "wb")  # noqa: SIM115 - closed with the process
        cmd = [
            sys.executable,
            __file__,
            str(replica),
            str(workers),
            str(ranks),
            f"http://127.0.0.1:{port}",
            str(log),
            *wait_for,
        ]
        worker_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        # A session of its own: the signals reach every rank of the worker (Lightning's launcher starts rank 1).
        procs.append(
            subprocess.Popen(cmd, env=worker_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
        return procs[-1]

    def rounds(**match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(log) if e["event"] == "round" and all(e[k] == v for k, v in match.items())]

    def mid_round_after(replica: int, pid: int, round_: int) -> None:
        wait_for(lambda: rounds(replica=replica, pid=pid, committed=True, round=round_), f"round {round_}", deadline)
        time.sleep(STEP_SLEEP_S * SYNC_EVERY / 2)

    try:
        procs.append(subprocess.Popen(lighthouse_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        launched = [start(r) for r in range(workers)]
        restarted = start(killed, "restart")
        started = workers * ranks
        wait_for(lambda: sum(e["event"] == "start" for e in read_events(log)) == started, "the workers", deadline)
        (tmp_path / "go").touch()

        mid_round_after(killed, launched[killed].pid, 2)
        os.killpg(launched[killed].pid, signal.SIGKILL)
        launched[killed].wait()
        times = {"killed": time.monotonic()}
        fewer = workers - 1
        wait_for(lambda: rounds(committed=True, participants=fewer), "a round of the survivors alone", deadline)
        (tmp_path / "restart").touch()
        times["restarted"] = time.monotonic()
        wait_for(lambda: rounds(replica=killed, pid=restarted.pid, committed=True), "the rejoin", deadline)
        times["rejoined"] = time.monotonic()
        last = rounds(replica=killed, pid=restarted.pid, committed=True)[0]["round"]
        live = [launched[0], restarted]
        if workers == 3:
            mid_round_after(FROZEN, launched[FROZEN].pid, last + 1)
            os.killpg(launched[FROZEN].pid, signal.SIGSTOP)  # alive, holding its sockets, silent
            times["frozen"] = time.monotonic()
            last = max(e["round"] for e in rounds())
            wait_for(lambda: rounds(committed=True, participants=2, round=last + 2), "the freeze dropped", deadline)
            times["dropped"] = time.monotonic()
        (tmp_path / "stop_at").write_text(str(last + 4))
        for proc in live:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, (sorted(tmp_path.glob("worker*.txt")), proc.args)
        return read_events(log), times
    finally:
        for proc in procs:
            if proc is not procs[0]:  # a worker: all its ranks
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@functools.cache
def _part(replica: int, rank: int, workers: int, ranks: int) -> list[int]:
    """The sample indices a rank of worker ``replica`` reads in epoch 0: Lightning's shuffled training order split
    over the workers' parts, then over the worker's ranks."""
    from lightscale.data.sampler import ExactlyOnceSampler

    shard, shards = replica * ranks + rank, workers * ranks
    return list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=shards, rank=shard, shuffle=True))


def _replay(start: list[float], rounds: list[list[list[float]]]) -> Any:
    """The global model after applying the outer Nesterov SGD to the mean of each committed round's payloads."""
    import torch

    globals_ = torch.tensor(start, dtype=torch.float32)
    outer = torch.optim.SGD([globals_], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for payloads in rounds:
        globals_.grad = torch.tensor(payloads, dtype=torch.float32).sum(0) / len(payloads)
        outer.step()
    return globals_


@pytest.mark.parametrize(("workers", "ranks"), [(3, 1), (2, 2)], ids=["3x1", "2x2"])
def test_workers_drop_out_and_rejoin_without_stopping_the_others(tmp_path: Path, workers: int, ranks: int) -> None:
    import torch

    events, times = _run_job(tmp_path, workers, ranks)
    killed = workers - 1
    rounds_run = int((tmp_path / "stop_at").read_text())
    counts = []
    for rank in range(ranks):  # rank r of every worker averages with rank r of the others
        by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in events:
            if e["event"] == "round" and e["committed"] and e["rank"] == rank:
                by_round[e["round"]].append(e)
        assert sorted(by_round) == list(range(rounds_run))
        for number, members in sorted(by_round.items()):
            assert {e["participants"] for e in members} == {len(members)}, (number, members)
            assert len({e["replica"] for e in members}) == len(members)
            expected = torch.tensor([e["payload"] for e in members], dtype=torch.float64).mean(0)
            for e in members:  # the applied mean is the mean of exactly these workers' pseudo-gradients
                torch.testing.assert_close(
                    torch.tensor(e["applied"], dtype=torch.float64), expected, rtol=1e-6, atol=1e-7
                )
        # The final global model equals a replay of the outer step over the recorded participation.
        start = next(e["params"] for e in events if e["event"] == "round_start" and e["round"] == 0)
        replayed = _replay(start, [[e["payload"] for e in by_round[n]] for n in range(rounds_run)])
        for done in (e for e in events if e["event"] == "done" and e["rank"] == rank):
            torch.testing.assert_close(torch.tensor(done["globals"]), replayed, rtol=1e-5, atol=1e-6)
        counts = counts or [len(by_round[n]) for n in range(rounds_run)]

    first_pid = {(e["replica"], e["rank"]): e["pid"] for e in reversed(events)}  # each rank's first process
    for rank in range(ranks):
        assert {e["pid"] for e in events if (e["replica"], e["rank"]) == (0, rank)} == {first_pid[0, rank]}
    rejoined = [e for e in events if e["replica"] == killed and e["pid"] != first_pid[killed, e["rank"]]]
    first_start = next(e for e in rejoined if e["event"] == "round_start")
    for e in (e for e in rejoined if e["event"] == "round_start" and e["step"] == first_start["step"]):
        assert e["heals"] == 1  # healed from a live peer before its first round, every rank of it
        peers = [p for p in events if p["event"] == "round_start" and (p["step"], p["rank"]) == (e["step"], e["rank"])]
        assert len(peers) >= 2 and {tuple(p["params"]) for p in peers} == {tuple(e["params"])}  # bitwise
    for e in (e for e in events if e["event"] == "round_start"):  # its own part, at its peers' step (healed too)
        assert e["sample"] == _part(e["replica"], e["rank"], workers, ranks)[e["step"] * BATCH], e
    fewer = workers - 1
    assert (
        counts[0] == workers and fewer in counts[: first_start["round"]] and workers in counts[first_start["round"] :]
    )
    message = f"participants per round: {counts}; rejoined at round {first_start['round']}, "
    message += f"{times['rejoined'] - times['restarted']:.1f} s after its restart"
    if "frozen" in times:
        assert counts[-1] == 2
        message += f"; the frozen worker was dropped {times['dropped'] - times['frozen']:.1f} s after freezing"
    print(message)


if __name__ == "__main__":
    _worker(*map(int, sys.argv[1:4]), sys.argv[4], sys.argv[5], sys.argv[6] if len(sys.argv) > 6 else None)
