"""torchft's lighthouse, the one extra process fault-tolerant DiLoCo needs: it forms each round's quorum of workers.

One command starts it on a loopback port and runs until SIGINT/SIGTERM; workers find it through the
``TORCHFT_LIGHTHOUSE`` environment variable (or ``lighthouse_addr=``), e.g. ``http://127.0.0.1:29510``.

Example:
    $ python -m lightscale.parallel.diloco.lighthouse --min-replicas 2 --port 29510
    lighthouse: http://127.0.0.1:29510 (min_replicas=2)
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any


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


if __name__ == "__main__":
    main()
