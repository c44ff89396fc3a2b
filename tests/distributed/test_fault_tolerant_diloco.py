"""Fault-tolerant DiLoCo: 3 workers on localhost, one SIGKILLed mid-round and restarted; the others never stop.

Real processes: a lighthouse (started by ``python -m lightscale.fault_tolerance.lighthouse``) and 3 workers running
this file as a script. Each worker logs, per round, the participants, its pseudo-gradient and the mean it applied;
the test checks that every committed mean is the mean of exactly the pseudo-gradients of that round's workers.
"""

from __future__ import annotations

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

SYNC_EVERY, STEP_SLEEP_S = 4, 0.08
KILLED, KILL_AFTER_ROUND = 2, 3
ROUNDS_AFTER_REJOIN = 3  # the test then writes the round to stop at into stop_at: every worker reads it in time
DEADLINE_S = 180  # about 60 s when the machine is not loaded


def _stop_at(log_path: str) -> int:
    path = Path(log_path).with_name("stop_at")
    return int(path.read_text()) if path.exists() else 10**6


def _worker(replica: int, lighthouse: str, log_path: str, wait_for: str | None) -> None:
    import torch
    from torch import nn

    from lightscale.fault_tolerance.diloco import FaultTolerantOuterSync

    # The replacement is started before the kill and imported, so that the test times the rejoin, not Python's
    # import on a loaded machine; it makes its torchft manager only once the file appears, after the kill.
    while wait_for is not None and not Path(log_path).with_name(wait_for).exists():
        time.sleep(0.02)

    torch.manual_seed(100 + replica + 10 * os.getpid())  # different starts: the first quorum makes them equal
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    write = event_writer(log_path, replica=replica)

    def on_round(record: Any, contribution: torch.Tensor, mean: torch.Tensor | None) -> None:
        write(
            "round", **record.__dict__, payload=contribution.tolist(), applied=None if mean is None else mean.tolist()
        )

    ft = FaultTolerantOuterSync(
        model.named_parameters(),
        sync_every=SYNC_EVERY,
        replica_id=f"worker_{replica}",
        lighthouse_addr=lighthouse,
        on_round=on_round,
    )
    write("start")
    while not Path(log_path).with_name("go").exists():  # the first round: all three (a restart never waits)
        time.sleep(0.02)
    data = torch.Generator().manual_seed(replica)
    try:
        while ft.rounds_committed < _stop_at(log_path):
            heals, step = ft.heals, ft.before_inner_step()
            if step % SYNC_EVERY == 1:  # a round starts: the global parameters every worker of it holds
                write(
                    "round_start",
                    round=ft.rounds_committed,
                    step=step - 1,
                    healed=ft.heals > heals,
                    params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
                )
            x = torch.randn(16, 6, generator=data)
            loss = (model(x).squeeze(-1) - x.sum(-1).sin()).pow(2).mean()
            loss.backward()
            inner.step()
            inner.zero_grad()
            time.sleep(STEP_SLEEP_S)  # rounds long enough to be killed in the middle of one
            ft.after_inner_step(step)
        write("done", rounds=ft.rounds_committed, step=ft.step)
    finally:
        ft.shutdown()


def _run_job(tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(map(str, TEST_PATHS))}
    port = free_port()
    lighthouse_cmd = [
        sys.executable,
        "-m",
        "lightscale.fault_tolerance.lighthouse",
        "--min-replicas",
        "2",
        "--port",
        str(port),
    ]
    procs: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    log = tmp_path / "events"
    log.mkdir()

    def start(replica: int, *wait_for: str) -> subprocess.Popen[bytes]:
        out = open(tmp_path / f"worker{replica}.{len(procs)}.txt", "wb")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, __file__, str(replica), f"http://127.0.0.1:{port}", str(log), *wait_for]
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        return procs[-1]

    def committed(replica: int, pid: int, at_least: int) -> bool:
        return any(
            e["event"] == "round"
            and e["replica"] == replica
            and e["pid"] == pid
            and e["committed"]
            and e["round"] >= at_least
            for e in read_events(log)
        )

    try:
        procs.append(subprocess.Popen(lighthouse_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        workers = [start(r) for r in range(3)]
        restarted = start(KILLED, "restart")
        wait_for(lambda: sum(e["event"] == "start" for e in read_events(log)) == 3, "3 workers", deadline)
        (tmp_path / "go").touch()
        wait_for(lambda: committed(KILLED, workers[KILLED].pid, KILL_AFTER_ROUND), "round to kill in", deadline)
        time.sleep(STEP_SLEEP_S * SYNC_EVERY / 2)  # mid-round
        workers[KILLED].send_signal(signal.SIGKILL)
        workers[KILLED].wait()
        times = {"killed": time.monotonic()}
        two = lambda: any(e["event"] == "round" and e["committed"] and e["participants"] == 2 for e in read_events(log))  # noqa: E731
        wait_for(two, "a round of the survivors alone", deadline)
        times["restarted"] = time.monotonic()
        (tmp_path / "restart").touch()
        wait_for(lambda: committed(KILLED, restarted.pid, 0), "the restarted worker's first round", deadline)
        times["rejoined"] = time.monotonic()
        last = max(e["round"] for e in read_events(log) if e["event"] == "round")
        (tmp_path / "stop_at").write_text(str(last + 1 + ROUNDS_AFTER_REJOIN))
        for proc in [workers[0], workers[1], restarted]:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, (tmp_path / "worker*.txt", proc.args)
        return read_events(log), times
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_killed_worker_rejoins_and_every_mean_counts_each_live_worker_once(tmp_path: Path) -> None:
    import torch

    events, times = _run_job(tmp_path)
    rounds = [e for e in events if e["event"] == "round"]
    by_round: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in rounds:
        if e["committed"]:
            by_round[e["round"]].append(e)
    rounds_run = int((tmp_path / "stop_at").read_text())
    assert sorted(by_round) == list(range(rounds_run))
    counts = []
    for number, members in sorted(by_round.items()):
        # every worker of a committed round saw the same participant count, and it is the number of them
        assert {e["participants"] for e in members} == {len(members)}, (number, members)
        assert len({e["replica"] for e in members}) == len(members)  # no worker twice
        expected = torch.tensor([e["payload"] for e in members], dtype=torch.float64).mean(0)
        for e in members:  # the applied mean is the mean of exactly these workers' pseudo-gradients
            torch.testing.assert_close(torch.tensor(e["applied"], dtype=torch.float64), expected, rtol=1e-6, atol=1e-7)
        counts.append(len(members))

    first_pid = {r: next(e["pid"] for e in events if e["replica"] == r) for r in range(3)}
    for r in (0, 1):  # the survivors: one process each, in every committed round, never stopped
        assert {e["pid"] for e in events if e["replica"] == r} == {first_pid[r]}
        assert all(any(e["replica"] == r for e in by_round[n]) for n in range(rounds_run))
    rejoined = [e for e in events if e["replica"] == KILLED and e["pid"] != first_pid[KILLED]]
    first_start = next(e for e in rejoined if e["event"] == "round_start")
    assert first_start["healed"]
    peers = [e for e in events if e["event"] == "round_start" and e["step"] == first_start["step"]]
    assert {tuple(e["params"]) for e in peers} == {tuple(first_start["params"])}  # bitwise, from the peer
    later = [n for n in by_round if n >= first_start["round"]]
    assert len(later) >= ROUNDS_AFTER_REJOIN
    assert all(len(by_round[n]) == 3 for n in later)  # counted again once back
    assert 2 in counts  # some rounds ran with the survivors only
    assert counts[0] == 3
    print(
        f"participants per round: {counts}; rejoined at round {first_start['round']}, "
        f"{times['restarted'] - times['killed']:.1f} s after the kill the survivors had committed alone; "
        f"{times['rejoined'] - times['restarted']:.1f} s from restart to its first committed round; dropped rounds: "
        f"{len({(e['round'], e['step']) for e in rounds if not e['committed']})}"
    )


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
