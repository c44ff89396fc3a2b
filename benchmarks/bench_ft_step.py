"""Per-step fault tolerance (``BucketedDDPStrategy(fault_tolerant=...)``) ÷ plain bucketed_ddp, and what a fault costs;
``--strategy hsdp``: ``FSDP2Strategy(fault_tolerant=...)`` ÷ plain hsdp, in the same launch shapes.

Every side trains the GPT recipe's model (its ``tiny_ddp.yaml`` sizes, or ``--config``'s) on 2 CPU data-parallel
ranks through ``lightscale.Trainer``: 2 fault-tolerant replicas of 1 rank (``ft``: two launches and a lighthouse);
plain ``bucketed_ddp`` as two launches of 1 rank (``nodes``: ``num_nodes=2, devices=1``, a node rank each, one
process group on loopback), the like-for-like pair; and plain ``bucketed_ddp`` at ``devices=2`` (``plain``: one
launch of 2 ranks). The sides alternate A B C C B A;
the ratios are of median step times (and, for the like-for-like pair, the median of each repeat's ratio: its
two runs are adjacent, so they share the machine's load). Then one fault: 2 replicas train, one is killed
with SIGKILL and a replacement (started beforehand, waiting) is released once the survivor has committed a step
alone; printed: seconds from the kill to the survivor's next committed step, from the release to the replacement's
first step, and the steps lost (dropped) by the survivor.

With ``--strategy hsdp`` the sides are the FSDP2 family's: 2 fault-tolerant replicas of 1 rank each
(``FSDP2Strategy(fault_tolerant=..., dp_replicate=1)``, each FSDP2 group's average across replicas started inside
backward) against the ``hsdp`` name's defaults (``dp_replicate=2``: 2 replicas x 1 shard) as two launches of 1 rank
and as one launch of 2 ranks.

    python benchmarks/bench_ft_step.py [--repeats 2] [--steps 30] [--config small_ddp --no-fault]
    python benchmarks/bench_ft_step.py --config tiny_ddp,n_layer=4,n_embd=192 --no-fault
    python benchmarks/bench_ft_step.py --strategy hsdp --config tiny_ddp,n_embd=128 --no-fault
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP = 5
FAULT_STEPS, KILL_AT = 10_000, 40  # the fault run is ended once the replacement has stepped


def _recipe(config: str) -> tuple[dict[str, int], dict[str, int]]:
    """The GPT recipe's model and data sizes from its YAML (``lightscale/recipes/gpt/configs/<name>.yaml``), then
    ``KEY=VALUE`` changes to the model's (``tiny_ddp,n_layer=4,n_embd=192``: a step between the two recipes')."""
    import yaml

    name, *changes = config.split(",")
    path = Path(__file__).parents[1] / "lightscale" / "recipes" / "gpt" / "configs" / f"{name}.yaml"
    recipe = yaml.safe_load(path.read_text())
    data, model = recipe["data"]["init_args"], recipe["model"]["init_args"]["config"]
    model.update({key: int(value) for key, value in (change.split("=") for change in changes)})
    return model, {"block_size": data["block_size"], "batch_size": data["batch_size"]}


def _replica(mode: str, replica: int, out: str, port: int, steps: int, config: str, family: str) -> None:
    """One launch of ``family`` (bucketed_ddp or hsdp): ``plain`` (2 ranks), ``nodes`` (node ``replica`` of 2, 1 rank
    each) or a fault-tolerant replica (``ft``, ``fault``, ``spare``)."""
    import lightning.pytorch as pl

    import lightscale
    from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
    from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy

    flags = Path(out)
    log = open(flags / f"{mode}.{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ft = getattr(trainer.strategy, "ft", None)
            record = {
                "t": time.monotonic(),
                "step": trainer.global_step,
                "s": time.perf_counter() - self.start,
                "replicas": ft.step.participants if ft else 2,
                "dropped": ft.dropped if ft else 0,
            }
            log.write(json.dumps(record) + "\n")

    while mode == "spare" and not (flags / "release").exists():  # started early: the rejoin is timed, not imports
        time.sleep(0.02)
    pl.seed_everything(0, verbose=False)
    if mode in ("plain", "nodes"):
        strategy = BucketedDDPStrategy() if family == "bucketed_ddp" else FSDP2Strategy(dp_replicate=2, dp_shard=-1)
    else:
        ft = lightscale.FaultTolerance(
            replica_id=f"replica_{replica}",
            lighthouse=f"http://127.0.0.1:{port}",
            min_replicas=1 if mode != "ft" else 2,
            data_shards=2,
            timeout_s=5,
        )
        if family == "bucketed_ddp":
            strategy = BucketedDDPStrategy(fault_tolerant=ft)
        else:  # each launch one replica sharding over its own rank: hsdp's replicate dimension is torchft's
            strategy = FSDP2Strategy(fault_tolerant=ft, dp_replicate=1)
    trainer = lightscale.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2 if mode == "plain" else 1,
        num_nodes=2 if mode == "nodes" else 1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Steps()],
    )
    model, data = _recipe(config)
    trainer.fit(GPTModule(GPTConfig(**model)), GPTDataModule(**data))


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _records(out: Path, mode: str) -> dict[int, list[dict[str, Any]]]:
    """Each process's records (pid -> list), complete lines only."""
    found = {}
    for path in out.glob(f"{mode}.*.jsonl"):
        lines = path.read_text().split("\n")[:-1]
        found[int(path.name.split(".")[1])] = [json.loads(line) for line in lines]
    return found


@contextlib.contextmanager
def _job(min_replicas: int, config: str = "tiny_ddp", family: str = "bucketed_ddp") -> Any:
    """A lighthouse, a scratch directory and ``start(mode, replica, steps)``; every process ends with the block."""
    from lightscale.fault_tolerance.lighthouse import start_lighthouse

    server, address = start_lighthouse(min_replicas=min_replicas)
    port = int(address.rsplit(":", 1)[1])
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as out:

        def start(mode: str, replica: int, steps: int, **extra: str) -> subprocess.Popen[bytes]:
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_port()),
                **extra,
            }
            cmd = [sys.executable, __file__, mode, str(replica), out, str(port), str(steps), config, family]
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
                )
            )
            return procs[-1]

        try:
            yield start, Path(out)
        finally:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            server.shutdown()


def _median_step(mode: str, steps: int, config: str, family: str) -> float:
    with _job(min_replicas=2, config=config, family=family) as (start, out):
        if mode == "plain":
            procs = [start("plain", 0, steps)]
        elif mode == "nodes":  # one process group over two launches: node k's rank is k
            port = str(_port())
            procs = [start("nodes", k, steps, MASTER_PORT=port, NODE_RANK=str(k)) for k in range(2)]
        else:
            procs = [start("ft", 0, steps), start("ft", 1, steps)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise RuntimeError(f"{mode} launch failed ({proc.returncode})")
        times = [r["s"] for records in _records(out, mode).values() for r in records if r["step"] > WARMUP]
    return statistics.median(times)


def _wait(predicate: Any, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _fault(family: str) -> dict[str, float]:
    with _job(min_replicas=1, family=family) as (start, out):
        survivor, victim = start("fault", 0, FAULT_STEPS), start("fault", 1, FAULT_STEPS)
        spare = start("spare", 1, FAULT_STEPS)
        steps = lambda pid: _records(out, "fault").get(pid, [])  # noqa: E731
        _wait(lambda: len(steps(victim.pid)) >= KILL_AT, "the victim's steps")
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait(lambda: any(r["t"] > killed and r["replicas"] == 1 for r in steps(survivor.pid)), "the survivor alone")
        alone = next(r for r in steps(survivor.pid) if r["t"] > killed and r["replicas"] == 1)
        first_after = next(r for r in steps(survivor.pid) if r["t"] > killed)
        (out / "release").touch()
        released = time.monotonic()
        _wait(lambda: bool(_records(out, "spare").get(spare.pid)), "the spare's first step")
        rejoined = _records(out, "spare")[spare.pid][0]
        dropped = steps(survivor.pid)[-1]["dropped"]
    return {
        "kill_to_survivor_step_s": first_after["t"] - killed,
        "kill_to_survivor_alone_s": alone["t"] - killed,
        "release_to_replacement_step_s": rejoined["t"] - released,
        "steps_lost_by_survivor": dropped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--config",
        default="tiny_ddp",
        help="the GPT recipe's model and batch (small_ddp: 6 layers), then model changes: "
        "tiny_ddp,n_layer=4,n_embd=192",
    )
    parser.add_argument("--no-fault", action="store_true", help="step times only")
    parser.add_argument("--strategy", choices=("bucketed_ddp", "hsdp"), default="bucketed_ddp", help="the family")
    args = parser.parse_args()
    modes = ("ft", "nodes", "plain")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    family = args.strategy
    print(f"{family}, the GPT recipe's model {args.config}; load average at the start: {os.getloadavg()}")
    for i in range(args.repeats):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            times[mode].append(_median_step(mode, WARMUP + args.steps, args.config, family))
    print(f"load average after the step times: {os.getloadavg()}")
    median = {mode: statistics.median(times[mode]) for mode in modes}
    print(
        f"median step: fault_tolerant {median['ft'] * 1e3:.1f} ms; {family} two launches of 1 rank "
        f"{median['nodes'] * 1e3:.1f} ms (ratio {median['ft'] / median['nodes']:.3f}, like for like); {family} "
        f"one launch of 2 ranks {median['plain'] * 1e3:.1f} ms (ratio {median['ft'] / median['plain']:.3f})"
    )
    print("  per repeat (ms):", {mode: [round(t * 1e3, 1) for t in times[mode]] for mode in modes})
    pairs = [ft / nodes for ft, nodes in zip(times["ft"], times["nodes"], strict=True)]  # adjacent runs: same load
    print(
        f"  fault_tolerant / two launches, per repeat: {[round(r, 3) for r in pairs]}, median "
        f"{statistics.median(pairs):.3f}"
    )
    if not args.no_fault:
        print("fault:", json.dumps({k: round(v, 2) for k, v in _fault(family).items()}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        mode, replica, out, port, steps, config, family = sys.argv[1:8]
        _replica(mode, int(replica), out, int(port), int(steps), config, family)
    else:
        main()
