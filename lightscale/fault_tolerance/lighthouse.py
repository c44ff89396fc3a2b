"""torchft's lighthouse, the one extra process fault tolerance needs: it forms each step's (per-step replicas) or
each round's (DiLoCo workers) quorum.

One command starts it on a loopback port and runs until SIGINT/SIGTERM; replicas find it through the
``TORCHFT_LIGHTHOUSE`` environment variable (or ``lighthouse=``), e.g. ``http://127.0.0.1:29510``. Tests and
benchmarks start it as a child process with :func:`lighthouse`: not in their own process, because torchft's server
leaves native threads behind after ``shutdown()``, and a later test that forks ranks from that process may fork them
holding a lock (a hang of every rank); the child ends with the block.

Example:
    $ python -m lightscale.fault_tolerance.lighthouse --min-replicas 2 --port 29510
    lighthouse: http://127.0.0.1:29510 (min_replicas=2)
    >>> with lighthouse(min_replicas=2) as address:  # a test's
    ...     ft = lightscale.FaultTolerance(replica_id="replica_0", lighthouse=address)
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightscale.runtime.launch import free_port


def start_lighthouse(
    *,
    min_replicas: int,
    port: int = 0,
    host: str = "127.0.0.1",
    join_timeout_ms: int = 2000,
    heartbeat_timeout_ms: int = 2000,
    quorum_tick_ms: int = 100,
) -> tuple[Any, str]:
    """Start torchft's ``LighthouseServer`` in this process; returns it (call ``.shutdown()``) and its address.

    ``join_timeout_ms``: how long a quorum waits for a member of the last one that still heartbeats;
    ``heartbeat_timeout_ms``: silence after which a worker counts as dead. torchft's defaults (60 s, 5 s) suit
    long rounds; these shorter ones let a small job move on within seconds of a failure.

    Example:
        >>> server, addr = start_lighthouse(min_replicas=2)
        >>> server.shutdown()
    """
    from torchft._torchft import LighthouseServer  # optional extra: pip install lightscale[ft]

    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    # The server advertises the host name; clients on this machine are given the loopback address instead.
    bound_port = int(server.address().rsplit(":", 1)[1])
    return server, f"http://{host}:{bound_port}"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="torchft lighthouse for fault-tolerant DiLoCo (loopback only).")
    parser.add_argument("--min-replicas", type=int, required=True, help="fewest live workers a round may have")
    parser.add_argument("--port", type=int, default=29510)
    parser.add_argument("--join-timeout-ms", type=int, default=2000)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    server, address = start_lighthouse(
        min_replicas=args.min_replicas,
        port=args.port,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        quorum_tick_ms=args.quorum_tick_ms,
    )
    print(f"lighthouse: {address} (min_replicas={args.min_replicas})", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


@contextlib.contextmanager
def lighthouse(
    min_replicas: int, *, join_timeout_ms: int = 2000, heartbeat_timeout_ms: int = 2000, start_timeout_s: float = 60
) -> Iterator[str]:
    """Start ``torchft_lighthouse`` on a free loopback port; yields its address once it accepts connections.

    The timeouts are ``start_lighthouse``'s (short ones, for small jobs).
    """
    command = Path(sys.executable).with_name("torchft_lighthouse")  # torchft's console script, beside this Python
    if not command.exists():
        raise RuntimeError(f"{command} not found: the lighthouse needs torchft (pip install 'lightscale[ft]')")
    port = free_port()
    args = [
        str(command),
        "--bind",
        f"127.0.0.1:{port}",
        "--min_replicas",
        str(min_replicas),
        "--join_timeout_ms",
        str(join_timeout_ms),
        "--heartbeat_timeout_ms",
        str(heartbeat_timeout_ms),
        "--quorum_tick_ms",
        "100",
    ]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(server, port, time.monotonic() + start_timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait(timeout=30)


def _wait_listening(server: subprocess.Popen[bytes], port: int, deadline: float) -> None:
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        if server.poll() is not None:
            raise RuntimeError(f"the lighthouse exited with {server.returncode} before listening on port {port}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the lighthouse did not listen on port {port} within its start timeout")
        time.sleep(0.1)


if __name__ == "__main__":
    main()
