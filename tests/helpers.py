"""Helpers the test modules share (imported as ``from helpers import ...``: pytest puts
``tests/`` on ``sys.path``, as for ``conftest``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
