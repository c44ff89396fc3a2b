"""``BucketedDDPStrategy(fault_tolerant=...)``: 2 replicas x 1 rank, each its own launch, a lighthouse on loopback.

While both live the run equals bucketed_ddp at world size 2 (SGD with momentum). Then one replica is SIGKILLed
mid-run: the survivor never restarts and commits steps alone; a restarted replica heals from it and both end at
``max_steps`` with bitwise equal parameters. ``min_replicas=2`` with one replica alive fails clearly after
``quorum_timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from event_log import event_writer, read_events, wait_for

from lightscale.testing import free_port

TEST_PATHS = (Path(__file__).parents[2], Path(__file__).parents[1])  # the project and tests/, for the replicas
pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SAMPLES, BATCH, LR, MOMENTUM = 4096, 8, 0.05, 0.9
KILL_AT, MAX_STEPS, STEP_SLEEP_S = 8, 60, 0.1  # the survivor trains alone long enough to see the rejoin
DEADLINE_S = 120


def _run(mode: str, replica: int, log: str, port: int, wait_for: str | None) -> None:
    """One launch: a replica of ``ft`` (6 steps, both alive) or of ``ft_kill`` (the run one replica is killed in)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightscale
    from lightscale.strategies import BucketedDDPStrategy

    write = event_writer(log, mode=mode, replica=replica, rank=int(os.environ.get("LOCAL_RANK", 0)))
    flags = Path(log).parent
    steps = MAX_STEPS if mode == "ft_kill" else 6

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)  # the same start everywhere: the reference starts like the replicas
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
            self.x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(1))
            self.y = self.x.sum(-1, keepdim=True).sin()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if mode == "ft_kill":
                time.sleep(STEP_SLEEP_S)  # a run long enough to be killed in the middle of
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=True)

    class Events(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: Any) -> None:
            write("ready")  # before the first quorum: the first launches start it together
            while mode == "ft_kill" and wait_for is None and not (flags / "go").exists():
                time.sleep(0.02)

        def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
            write("start", step=trainer.global_step)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ft = getattr(trainer.strategy, "ft", None)
            write(
                "step",
                step=trainer.global_step,
                participants=ft.step.participants if ft else 2,
                heals=ft.heals if ft else 0,
            )

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
            write("done", step=trainer.global_step, params=flat.tolist())

    if wait_for is not None:  # a replacement started early: the test times the rejoin, not Python's start-up
        while not (flags / wait_for).exists():
            time.sleep(0.02)
    ft = lightscale.FaultTolerance(
        replica_id=f"replica_{replica}",
        lighthouse=f"http://127.0.0.1:{port}",
        data_shards=2,
        min_replicas=1 if mode == "ft_kill" else 2,
        timeout_s=5,
        quorum_timeout_s=30,
    )
    strategy = BucketedDDPStrategy(fault_tolerant=ft)
    # Each replica saves the portable layout at the end of the short run (the torchft step count in it).
    saves = [ModelCheckpoint(dirpath=flags / f"checkpoints{replica}", every_n_train_steps=steps)] * (mode == "ft")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(saves),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Events(), *saves],
        limit_val_batches=0,
    )
    trainer.fit(Regression())


@contextlib.contextmanager
def _launches(tmp_path: Path, min_replicas: int, script: str = __file__) -> Any:
    """A lighthouse (its own process) and a ``start(mode, replica)`` for launches of ``script``; everything ends
    with the block."""
    from lightscale.fault_tolerance.lighthouse import lighthouse

    # A live replica is waited for up to 30 s (a loaded machine may hold it past the 2 s default); a killed one stops
    # heartbeating and is dropped after 2 s all the same.
    with lighthouse(min_replicas, join_timeout_ms=30_000) as address:
        port = int(address.rsplit(":", 1)[1])
        # Not an earlier test's seed_everything (PL_GLOBAL_SEED seeds Lightning's samplers; the references use 0).
        inherited = {k: v for k, v in os.environ.items() if k != "PL_GLOBAL_SEED"}
        env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, TEST_PATHS))}
        (tmp_path / "events").mkdir()
        procs: list[subprocess.Popen[bytes]] = []

        def start(mode: str, replica: int, wait_for: str = "") -> subprocess.Popen[bytes]:
            out = open(tmp_path / f"{mode}{replica}.{len(procs)}.txt", "wb")  # noqa: SIM115 - closed with the process
            cmd = [sys.executable, script, mode, str(replica), str(tmp_path / "events"), str(port), wait_for]
            launch_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            procs.append(
                subprocess.Popen(cmd, env=launch_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
            return procs[-1]

        try:
            yield start
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # every rank of the launch
                proc.wait()


def _finish(procs: list[subprocess.Popen[bytes]], tmp_path: Path, deadline: float) -> None:
    for proc in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        output = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.txt"))
        assert proc.returncode == 0, output


def _done(tmp_path: Path, **match: Any) -> list[dict[str, Any]]:
    events = read_events(tmp_path / "events")
    return [e for e in events if e["event"] == "done" and all(e[k] == v for k, v in match.items())]


def _bucketed_ddp_at_world_size_two(steps: int) -> Any:
    """What bucketed_ddp on 2 ranks computes (tests/distributed/test_bucketed_ddp_parity.py holds it to this): each
    step the mean of the two ranks' gradients, rank k reading shard k of the shuffled order; no process needed."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightscale.data.sampler import ExactlyOnceSampler

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(1))
    y = x.sum(-1, keepdim=True).sin()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
    shards = [
        list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=2, rank=k, shuffle=True))
        for k in range(2)
    ]
    for step in range(steps):
        optimizer.zero_grad()
        for shard in shards:
            index = shard[step * BATCH : (step + 1) * BATCH]
            (F.mse_loss(net(x[index]), y[index]) / 2).backward()
        optimizer.step()
        scheduler.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_two_replicas_equal_bucketed_ddp_at_world_size_two(tmp_path: Path) -> None:
    import torch

    deadline = time.monotonic() + DEADLINE_S
    with _launches(tmp_path, min_replicas=2) as start:
        _finish([start("ft", 0), start("ft", 1)], tmp_path, deadline)
    reference = _bucketed_ddp_at_world_size_two(6)
    replicas = [torch.tensor(e["params"]) for e in _done(tmp_path, mode="ft")]
    assert len(replicas) == 2 and torch.equal(replicas[0], replicas[1])
    torch.testing.assert_close(replicas[0], reference, rtol=1e-6, atol=1e-6)
    steps = [e for e in read_events(tmp_path / "events") if e["event"] == "step" and e["mode"] == "ft"]
    assert {e["participants"] for e in steps} == {2} and len(steps) == 2 * 6
    assert "lightscale-ft: step 6 committed, 2 replica(s)" in (tmp_path / "ft0.0.txt").read_text()
    for replica in range(2):  # each replica saved the portable layout, torchft's step count in it
        state = torch.load(tmp_path / f"checkpoints{replica}" / "epoch=0-step=6.ckpt" / "trainer_state.pt")
        expected = {"replica": f"replica_{replica}", "committed_steps": 6, "offset": [0, 0]}  # nobody healed
        assert state["lightscale"]["fault_tolerance"] == expected


MIN_REPLICAS_UNMET = """
import time
from lightscale import FaultTolerance
from lightscale.fault_tolerance.lighthouse import start_lighthouse
from lightscale.fault_tolerance.step import FaultTolerantStep, QuorumTimeoutError

server, address = start_lighthouse(min_replicas=2)
settings = FaultTolerance(replica_id="replica_0", lighthouse=address, min_replicas=2, quorum_timeout_s=2)
step = FaultTolerantStep(settings, state_dict=dict, load_state_dict=lambda state: None)
began = time.monotonic()
try:
    step.begin()
except QuorumTimeoutError as error:
    print(f"waited {time.monotonic() - began:.2f} s:", error)
finally:
    step.shutdown()
    server.shutdown()
"""


def test_min_replicas_not_met_fails_clearly_after_the_quorum_timeout() -> None:
    # The replica's first quorum (the error leaves fit as it leaves here), in its own process: torchft's threads
    # must not outlive it in the test process, whose later tests fork ranks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, TEST_PATHS))}
    done = subprocess.run(
        [sys.executable, "-c", MIN_REPLICAS_UNMET], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    waited = float(done.stdout.split("waited ")[1].split(" s:")[0])
    assert "fewer than min_replicas=2" in done.stdout and "within quorum_timeout_s=2 " in done.stdout, done.stdout
    assert 2 <= waited < 2 + 10  # waited for the others, then gave up: no hang


def test_a_killed_replica_rejoins_while_the_survivor_trains_on(tmp_path: Path) -> None:
    import torch

    deadline = time.monotonic() + DEADLINE_S
    events = tmp_path / "events"

    def steps(**match: Any) -> list[dict[str, Any]]:
        return [e for e in read_events(events) if e["event"] == "step" and all(e[k] == v for k, v in match.items())]

    with _launches(tmp_path, min_replicas=1) as start:
        survivor, killed, replacement = start("ft_kill", 0), start("ft_kill", 1), start("ft_kill", 1, "restart")
        ready = lambda: {e["pid"] for e in read_events(events) if e["event"] == "ready"}  # noqa: E731
        wait_for(lambda: {survivor.pid, killed.pid} <= ready(), "the first two replicas", deadline)
        (tmp_path / "go").touch()
        wait_for(lambda: steps(pid=killed.pid, step=KILL_AT), f"step {KILL_AT} of replica 1", deadline)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        killed_at = time.monotonic()
        alone_after_kill = lambda: [e for e in steps(pid=survivor.pid, participants=1) if e["step"] > KILL_AT]  # noqa: E731
        wait_for(alone_after_kill, "a step of the survivor alone", deadline)
        alone_at = time.monotonic()
        (tmp_path / "restart").touch()
        wait_for(lambda: steps(pid=replacement.pid), "the replacement's first step", deadline)
        rejoined_at = time.monotonic()
        _finish([survivor, replacement], tmp_path, deadline)

    done = {e["pid"]: e for e in _done(tmp_path)}
    assert set(done) == {survivor.pid, replacement.pid}  # the survivor never restarted
    assert {e["step"] for e in done.values()} == {MAX_STEPS}
    assert done[survivor.pid]["params"] == done[replacement.pid]["params"]  # bitwise: every step applied alike
    first, last = steps(pid=replacement.pid)[0], steps(pid=killed.pid)[-1]
    assert first["heals"] == 1 and first["participants"] == 2 and first["step"] > last["step"] >= KILL_AT
    # The first quorum may be one replica's (min_replicas=1: the first at the lighthouse may step before the other's
    # heartbeat; the other then heals): from their first step together, every step is of both until the kill.
    met = steps(pid=survivor.pid, participants=2)[0]["step"]
    assert {e["participants"] for e in steps(pid=survivor.pid) if met <= e["step"] <= KILL_AT} == {2}
    alone = [e["step"] for e in steps(pid=survivor.pid, participants=1) if e["step"] > met]
    assert alone and all(last["step"] < step < first["step"] for step in alone)
    assert {e["participants"] for e in steps(pid=survivor.pid) if e["step"] >= first["step"]} == {2}
    assert torch.isfinite(torch.tensor(done[survivor.pid]["params"])).all()
    log = (tmp_path / "ft_kill1.2.txt").read_text()
    assert "lightscale-ft: healed from replica_0 at step" in log
    assert "committed, 1 replica(s)" in (tmp_path / "ft_kill0.0.txt").read_text()
    print(
        f"survivor alone {alone_at - killed_at:.1f} s after the kill; the replacement's first step "
        f"{rejoined_at - alone_at:.1f} s after its release"
    )


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] or None)
