"""Helpers the test modules share (imported as ``from helpers import ...``: pytest puts
``tests/`` on ``sys.path``, as for ``conftest``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
