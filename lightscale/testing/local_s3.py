"""A real S3 server on loopback (moto's server mode), for the tests, the benchmark and the docs' example of
checkpoints in object storage; ``pip install 'lightscale[s3]'`` installs it with ``s3fs``.

The server is its own process (``python -m moto.server``) on a free port of 127.0.0.1. :func:`s3_environment` gives
the standard AWS variables that point every client at it (``AWS_ENDPOINT_URL``, dummy credentials): the caller sets
them (lightscale writes no environment), so ranks started from its process (forked, spawned, or Lightning's launcher)
write the same bucket. Leaving the block stops the server; objects live in its memory only.

For runs whose ranks a launcher starts by re-running the script (Lightning's ``devices=N``, torchrun), start the server
beside them instead: ``python -m lightscale.testing.local_s3 --port 9000 --bucket checkpoints`` serves until stopped
and prints the variables to export.

Example:
    >>> with local_s3_server(bucket="checkpoints") as endpoint:
    ...     os.environ.update(s3_environment(endpoint))
    ...     trainer = lightscale.Trainer(callbacks=[ModelCheckpoint(dirpath="s3://checkpoints/run")], ...)
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec

from lightscale.errors import import_extra

_REGION = "us-east-1"


def s3_environment(endpoint: str) -> dict[str, str]:
    """The variables that send S3 clients (s3fs, boto3) in this process and its children to ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": _REGION,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_listening(port: int, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the local S3 server exited with code {server.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the local S3 server did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def _clear_s3_clients() -> None:
    """fsspec caches filesystems by arguments, not by endpoint: a client of an earlier server must not be reused."""
    fsspec.get_filesystem_class("s3").clear_instance_cache()


@contextmanager
def local_s3_server(*, bucket: str = "checkpoints", port: int = 0, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Run an S3 server on loopback (``port``; 0: a free one) with ``bucket`` created; yields its endpoint URL (see
    the module docstring)."""
    import_extra("moto", "s3")
    import_extra("s3fs", "s3")
    port = port or _free_port()
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_listening(port, server, start_timeout_s)
        _clear_s3_clients()
        client = {"endpoint_url": endpoint}  # no region: s3fs would send it as a LocationConstraint (refused)
        s3 = fsspec.filesystem("s3", key="local", secret="local", client_kwargs=client, skip_instance_cache=True)
        s3.mkdir(bucket)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        _clear_s3_clients()


def main() -> None:
    parser = argparse.ArgumentParser(description="A local S3 server (moto) on 127.0.0.1 with one bucket.")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--bucket", default="checkpoints")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the server process too (the finally block)
    with local_s3_server(bucket=args.bucket, port=args.port) as endpoint:
        variables = " ".join(f"{name}={value}" for name, value in s3_environment(endpoint).items())
        print(f"S3 at {endpoint}, bucket s3://{args.bucket}; in the shell that trains:\nexport {variables}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
