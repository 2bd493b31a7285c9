"""Helpers the test modules share (imported as ``from helpers import ...``: pytest puts
``tests/`` on ``sys.path``, as for ``conftest``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from spotnb.protocol.events import parse_chunk
from spotnb.protocol.events.writer import StreamObject, read_object
from spotnb.protocol.store import LocalStore

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout: float, message: str, *,
               interval: float = 0.1) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true,
    and return that; fail with ``message`` after ``timeout`` seconds. A wait on a
    condition, never on a duration: the bound is for a test that would otherwise hang,
    not a timing the test relies on."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(interval)


def replayed(store: LocalStore, key: str, attempt: int) -> bool:
    """Whether a chunk of ``attempt``'s stream holds only what a checkpoint carried and
    a later attempt (the lease's holder) appended for it (a restore writes what the
    saving attempt's log lacked into that attempt's own stream)."""
    events = parse_chunk(read_object(store, StreamObject.parse(key)))  # type: ignore[arg-type]
    return bool(events) and all(int(e.data.get("replayed_by") or 0) > attempt
                                for e in events)


class StartupHold:
    """Holds the next local-cloud instance a job starts at the first instruction of its
    first process (the reaper), for as long as a test needs: a process descheduled right
    after its launch, made exact (``tests/faults/startup_hold/sitecustomize.py``).

    Made before the jobs are launched (their processes inherit the search path and the
    gate); :meth:`arm` names the job, :meth:`held` waits until its next instance's
    reaper has stopped itself, :meth:`release` resumes it.
    """

    HOOK_DIR = Path(__file__).resolve().parent / "faults" / "startup_hold"

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = tmp / "startup-hold"
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            [str(self.HOOK_DIR), *([path] if path else [])]))
        monkeypatch.setenv("SPOTNB_TEST_HOLD", str(self.gate))
        self.proc: psutil.Process | None = None

    def arm(self, job_id: str) -> None:
        """Hold the next instance that ``job_id`` starts."""
        Path(f"{self.gate}.armed").write_text(job_id)

    def held(self, timeout: float = 120.0) -> psutil.Process:
        """The held reaper, once it has stopped itself."""
        pid_file = Path(f"{self.gate}.pid")
        pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout,
                             "an instance's first process to start and hold"))
        proc = psutil.Process(pid)
        wait_until(lambda: proc.status() == psutil.STATUS_STOPPED, timeout,
                   "the held process to stop")
        self.proc = proc
        return proc

    def release(self) -> None:
        """Let the held process go on."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
