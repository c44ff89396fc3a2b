"""What ``FaultTolerance`` hands torchft, checked as pure functions in one process (no lighthouse, no Manager): the
backend across replicas (by the device, or as set), the timeouts as torchft takes them, the one reading of a
strategy's ``fault_tolerant=``, and the sampler's move after a heal that both modes share."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.replica import move_sampler
from lightscale.fault_tolerance.settings import FaultTolerance, choose_backend, fault_tolerance_of


@pytest.mark.parametrize(
    ("backend", "device", "chosen"),
    [
        (None, "cpu", "gloo"),
        (None, "cuda", "nccl"),
        (None, "cuda:1", "nccl"),
        (None, "meta", "gloo"),
        ("gloo", "cuda", "gloo"),
        ("nccl", "cpu", "nccl"),
    ],
)
def test_backend_follows_the_device_unless_set(backend: str | None, device: str, chosen: str) -> None:
    assert choose_backend(backend, torch.device(device)) == chosen
    assert FaultTolerance(backend=backend).backend_for(device) == chosen
    assert FaultTolerance(backend=backend).backend_for(torch.device(device)) == chosen


@pytest.mark.parametrize("backend", ["mpi", "NCCL", "", 1])
def test_an_unknown_backend_is_refused_up_front(backend: object) -> None:
    with pytest.raises(ConfigurationError, match=r"backend=.* is not valid; use None .*'gloo' or 'nccl'"):
        FaultTolerance(backend=backend)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="is not valid"):
        choose_backend(backend, torch.device("cpu"))  # type: ignore[arg-type]


def test_timeouts_as_torchft_takes_them() -> None:
    ft = FaultTolerance(timeout_s=2.5, quorum_timeout_s=90)
    assert ft.timeout == timedelta(seconds=2.5)
    assert ft.quorum_timeout == timedelta(seconds=90)


@pytest.mark.parametrize("off", [None, False])
def test_fault_tolerance_of_off(off: object) -> None:
    assert fault_tolerance_of(off, "feature") is None  # type: ignore[arg-type]


def test_fault_tolerance_of_on() -> None:
    given = FaultTolerance(replica_id="worker_0")
    assert fault_tolerance_of(given, "feature") is given
    assert fault_tolerance_of(True, "feature") == FaultTolerance()
    with pytest.raises(ConfigurationError, match=r"fault_tolerant='yes' is not valid; use True, False or"):
        fault_tolerance_of("yes", "feature")  # type: ignore[arg-type]


def test_fault_tolerance_of_without_torchft_names_the_feature() -> None:
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "torchft" else real(name, *a)  # noqa: E731
    refused = pytest.raises(ConfigurationError, match=r"my feature runs on torchft, not installed: pip install")
    with mock.patch.object(importlib.util, "find_spec", missing), refused:
        fault_tolerance_of(True, "my feature")


def test_move_sampler_moves_one_that_can_and_says_when_not() -> None:
    moved: list[tuple[int, int]] = []
    sampler = SimpleNamespace(resume_from=lambda epoch, batches: moved.append((epoch, batches)))
    assert move_sampler(SimpleNamespace(sampler=sampler), 2, 7)
    assert moved == [(2, 7)]
    assert not move_sampler(SimpleNamespace(sampler=object()), 2, 7)
    assert not move_sampler(object(), 0, 0)  # a loader without a sampler
