"""torchft's lighthouse as its own process on loopback, for tests and benchmarks.

Not in the test's process: torchft's server leaves native threads behind after ``shutdown()``, and a later test that
forks ranks from that process may fork them holding a lock (a hang of every rank). Its own process ends with the block.

Example:
    >>> with lighthouse(min_replicas=2) as address:
    ...     ft = lightscale.FaultTolerance(replica_id="replica_0", lighthouse=address)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from lightscale.testing import free_port


@contextlib.contextmanager
def lighthouse(
    min_replicas: int, *, join_timeout_ms: int = 2000, heartbeat_timeout_ms: int = 2000, start_timeout_s: float = 60
) -> Iterator[str]:
    """Start ``torchft_lighthouse`` on a free loopback port; yields its address once it accepts connections.

    The timeouts are ``lightscale.parallel.diloco.lighthouse.start_lighthouse``'s (short ones, for small jobs).
    """
    command = Path(sys.executable).with_name("torchft_lighthouse")  # torchft's console script, beside this Python
    if not command.exists():
        raise RuntimeError(f"{command} not found: the lighthouse needs torchft (pip install 'lightscale[ft]')")
    port = free_port()
    args = [str(command), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
            "--quorum_tick_ms", "100"]  # fmt: skip
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
