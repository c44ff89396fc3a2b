"""``DiLoCoStrategy(fault_tolerant=...)`` through Lightning: 3 workers, each its own launch, meeting at a lighthouse.

One worker is SIGKILLed mid-round and restarted, then another is frozen (SIGSTOP: alive, silent) mid-round. The
others never stop. Each worker logs, per round, the participants, its pseudo-gradient and the mean it applied; the
test checks every committed mean against exactly that round's workers and replays the outer optimizer over the
recorded rounds to the final global model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SYNC_EVERY, STEP_SLEEP_S, OUTER_LR, OUTER_MOMENTUM = 4, 0.06, 0.7, 0.9
KILLED, FROZEN = 2, 1
TIMEOUT_S = 4.0  # a frozen worker holds its round's collective this long at most
DEADLINE_S = 240
SAMPLES, BATCH = 8192, 16  # each worker reads every third batch of BATCH: its part of the data


def _worker(replica: int, lighthouse: str, log_path: str, wait_for: str | None) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightscale import Trainer
    from lightscale.parallel.diloco import FaultTolerance
    from lightscale.strategies import DiLoCoStrategy

    flags = Path(log_path).parent
    while wait_for is not None and not (flags / wait_for).exists():  # imported already: the test times the rejoin
        time.sleep(0.02)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one line per event, flushed at once

    def write(event: str, **fields: Any) -> None:
        log.write(json.dumps({"event": event, "replica": replica, "pid": os.getpid(), **fields}) + "\n")

    def flat(tensors: Any) -> list[float]:
        return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(100 + replica + 10 * os.getpid())  # different starts: the first quorum syncs them
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
            self.x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(0))  # split in 3 parts
            self.y = self.x.sum(-1, keepdim=True).sin()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            index, x, y = batch
            outer = self.trainer.strategy.outer
            if outer.step % SYNC_EVERY == 0:  # a round's first step: every worker of it holds the global model
                ft = self.trainer.strategy.ft
                write("round_start", round=ft.rounds_committed, step=outer.step, heals=ft.heals,
                      params=flat(self.parameters()), sample=int(index[0]))  # fmt: skip
            time.sleep(STEP_SLEEP_S)  # rounds long enough to be killed in the middle of one
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(torch.arange(SAMPLES), self.x, self.y), batch_size=BATCH)

    class Events(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: Any) -> None:
            def on_round(record: Any, payload: torch.Tensor, mean: torch.Tensor | None) -> None:
                write("round", **record.__dict__, payload=payload.tolist(),
                      applied=None if mean is None else mean.tolist())  # fmt: skip

            trainer.strategy.ft.on_round = on_round
            write("start")
            while wait_for is None and not (flags / "go").exists():  # the first round: all three
                time.sleep(0.02)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            stop = flags / "stop_at"
            if stop.exists() and trainer.strategy.ft.rounds_committed >= int(stop.read_text()):
                trainer.should_stop = True

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            write("done", step=trainer.strategy.outer.step,
                  globals=flat(t for _, t in trainer.strategy.outer.named_globals()))  # fmt: skip

    ft = FaultTolerance(replica_id=f"worker_{replica}", lighthouse=lighthouse, timeout_s=TIMEOUT_S, data_shards=3)
    strategy = DiLoCoStrategy(sync_every=SYNC_EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
                              fault_tolerant=ft)  # fmt: skip
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=10**6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Events()], limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(Net())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for(predicate: Any, what: str, deadline: float) -> None:
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _run_job(tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    port = _free_port()
    lighthouse_cmd = [sys.executable, "-m", "lightscale.parallel.diloco.lighthouse", "--min-replicas", "2",
                      "--port", str(port)]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    log = tmp_path / "events.jsonl"
    log.touch()

    def start(replica: int, *wait_for: str) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"worker{replica}.{len(procs)}.txt", "wb")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, __file__, str(replica), f"http://127.0.0.1:{port}", str(log), *wait_for]
        worker_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        procs.append(subprocess.Popen(cmd, env=worker_env, stdout=out, stderr=subprocess.STDOUT))
        return procs[-1]

    def rounds(**match: Any) -> list[dict[str, Any]]:
        return [e for e in _events(log) if e["event"] == "round" and all(e[k] == v for k, v in match.items())]

    def mid_round_after(replica: int, pid: int, round_: int) -> None:
        _wait_for(lambda: rounds(replica=replica, pid=pid, committed=True, round=round_), f"round {round_}", deadline)
        time.sleep(STEP_SLEEP_S * SYNC_EVERY / 2)

    try:
        procs.append(subprocess.Popen(lighthouse_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        workers = [start(r) for r in range(3)]
        restarted = start(KILLED, "restart")
        _wait_for(lambda: sum(e["event"] == "start" for e in _events(log)) == 3, "3 workers", deadline)
        (tmp_path / "go").touch()

        mid_round_after(KILLED, workers[KILLED].pid, 2)
        workers[KILLED].send_signal(signal.SIGKILL)
        workers[KILLED].wait()
        times = {"killed": time.monotonic()}
        _wait_for(lambda: rounds(committed=True, participants=2), "a round of the survivors alone", deadline)
        (tmp_path / "restart").touch()
        times["restarted"] = time.monotonic()
        _wait_for(lambda: rounds(replica=KILLED, pid=restarted.pid, committed=True), "the rejoin", deadline)
        times["rejoined"] = time.monotonic()
        rejoined_at = rounds(replica=KILLED, pid=restarted.pid, committed=True)[0]["round"]
        mid_round_after(FROZEN, workers[FROZEN].pid, rejoined_at + 1)
        workers[FROZEN].send_signal(signal.SIGSTOP)  # alive, holding its sockets, silent
        times["frozen"] = time.monotonic()
        last = max(e["round"] for e in rounds())
        _wait_for(lambda: rounds(committed=True, participants=2, round=last + 2), "the freeze dropped", deadline)
        times["dropped"] = time.monotonic()
        (tmp_path / "stop_at").write_text(str(last + 4))
        for proc in (workers[0], restarted):
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))

            assert proc.returncode == 0, (sorted(tmp_path.glob("worker*.txt")), proc.args)
        return _events(log), times
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _part(replica: int) -> list[int]:
    """The sample indices worker ``replica`` reads in epoch 0: its third of Lightning's shuffled training order."""
    from lightscale.strategies.sampler import ExactlyOnceSampler

    return list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=3, rank=replica, shuffle=True))


def _replay(start: list[float], rounds: list[list[list[float]]]) -> Any:
    """The global model after applying the outer Nesterov SGD to the mean of each committed round's payloads."""
    import torch

    globals_ = torch.tensor(start, dtype=torch.float32)
    outer = torch.optim.SGD([globals_], lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    for payloads in rounds:
        globals_.grad = torch.tensor(payloads, dtype=torch.float32).sum(0) / len(payloads)
        outer.step()
    return globals_


def test_workers_drop_out_and_rejoin_without_stopping_the_others(tmp_path: Path) -> None:
    import torch

    events, times = _run_job(tmp_path)
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["event"] == "round" and e["committed"]:
            by_round[e["round"]].append(e)
    rounds_run = int((tmp_path / "stop_at").read_text())
    assert sorted(by_round) == list(range(rounds_run))
    counts = []
    for number, members in sorted(by_round.items()):
        assert {e["participants"] for e in members} == {len(members)}, (number, members)
        assert len({e["replica"] for e in members}) == len(members)
        expected = torch.tensor([e["payload"] for e in members], dtype=torch.float64).mean(0)
        for e in members:  # the applied mean is the mean of exactly these workers' pseudo-gradients
            torch.testing.assert_close(torch.tensor(e["applied"], dtype=torch.float64), expected, rtol=1e-6, atol=1e-7)
        counts.append(len(members))

    first_pid = {r: next(e["pid"] for e in events if e["replica"] == r) for r in range(3)}
    assert {e["pid"] for e in events if e["replica"] == 0} == {first_pid[0]}  # never restarted
    assert all(any(e["replica"] == 0 for e in by_round[n]) for n in range(rounds_run))
    rejoined = [e for e in events if e["replica"] == KILLED and e["pid"] != first_pid[KILLED]]
    first_start = next(e for e in rejoined if e["event"] == "round_start")
    assert first_start["heals"] == 1  # healed from a live peer at its first round
    peers = [e for e in events if e["event"] == "round_start" and e["step"] == first_start["step"]]
    assert len(peers) >= 2 and {tuple(e["params"]) for e in peers} == {tuple(first_start["params"])}  # bitwise
    for e in (e for e in events if e["event"] == "round_start"):  # its own part, at its peers' step (healed too)
        assert e["sample"] == _part(e["replica"])[e["step"] * BATCH], e
    assert counts[0] == 3 and counts[-1] == 2 and 2 in counts[: first_start["round"]] and 3 in counts[1:-1]

    # The final global model equals a replay of the outer step over the recorded participation.
    start = next(e["params"] for e in events if e["event"] == "round_start" and e["round"] == 0 and e["replica"] == 0)
    replayed = _replay(start, [[e["payload"] for e in by_round[n]] for n in range(rounds_run)])
    for done in (e for e in events if e["event"] == "done"):
        torch.testing.assert_close(torch.tensor(done["globals"]), replayed, rtol=1e-5, atol=1e-6)
    print(f"participants per round: {counts}; rejoined at round {first_start['round']} "
          f"({times['rejoined'] - times['restarted']:.1f} s after its restart); the frozen worker was dropped "
          f"{times['dropped'] - times['frozen']:.1f} s after freezing")  # fmt: skip


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
