"""NCCL's flight recorder on by default, so a collective timeout leaves a per-rank trace of the last collectives.

NCCL's watchdog notices a collective that never completes, but by default it records nothing about it: the
recorder's ring buffer is off (``TORCH_NCCL_TRACE_BUFFER_SIZE=0``). With a buffer, ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``
makes every rank write its last collectives (op, sizes, sequence number, state, stack) to
``TORCH_FR_DUMP_TEMP_FILE`` + rank when one times out; comparing the files shows which rank never entered which
collective (``python -m torch.distributed.flight_recorder.fr_trace <dir>``). lightscale sets these three before
the process group exists, only for the nccl backend and only where the user has not set them; the files go to
``<default_root_dir>/flight_recorder/rank_<R>`` instead of torch's ``/tmp/nccl_trace_rank_<R>``, which a node's
cleanup or a container's restart loses. gloo has no recorder: on CPU the stalled rank prints its own stack instead
(:mod:`lightscale.runtime.failure`).

Example:
    >>> maybe_enable_flight_recorder("nccl", Path("runs"))  # before init_process_group
    'runs/flight_recorder/rank_'
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

from lightscale.patches.process import set_environment

TRACE_BUFFER_SIZE = "2000"  # collectives kept per rank: the value torch's flight recorder tutorial uses
DUMP_FILE = "TORCH_FR_DUMP_TEMP_FILE"


def flight_recorder_defaults(backend: str, dump_dir: Path, environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables lightscale would set: those of the recorder the user left unset, only under nccl."""
    if backend != "nccl":
        return {}
    defaults = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": TRACE_BUFFER_SIZE,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        DUMP_FILE: str(dump_dir / "flight_recorder" / "rank_"),
    }
    return {name: value for name, value in defaults.items() if name not in environ}


def maybe_enable_flight_recorder(
    backend: str, dump_dir: Path, environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Set the recorder's defaults in ``environ`` (and create the dump directory); return the trace file prefix
    (the rank is appended) or None when no recorder runs (not nccl, or the user switched the buffer off)."""
    chosen = flight_recorder_defaults(backend, dump_dir, environ)
    set_environment(chosen, environ)
    if backend != "nccl" or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") == "0":
        return None
    prefix = environ.get(DUMP_FILE, "/tmp/nccl_trace_rank_")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)  # the recorder writes the file, not its directory
    return prefix
