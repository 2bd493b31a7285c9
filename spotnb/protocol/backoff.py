"""Delays between the tries of something that fails.

Standard library only: the instance agent, the local cloud's supervisor and the
notebook side all import it. Every retry loop of spotnb takes its delays from a
:class:`Backoff` (a store that fails, AWS calls botocore does not retry, the lease's
heartbeat, an event chunk that could not be written, a launch after an agent gave up
on the store); each loop keeps its own limit (a time, a number of tries, or none) and
its own first and longest delay, named where the loop is.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["Backoff", "patiently"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Backoff:
    """Delays that start at ``first`` and double up to ``cap`` seconds.

    :meth:`next` gives the delay before the next try; :meth:`reset`, after a success,
    starts again from ``first``. With ``jitter`` (0 to 1) each delay is scaled by a
    random factor between ``1 - jitter`` and 1, so that many clients that failed
    together do not retry together.
    """

    def __init__(self, first: float, cap: float, *, jitter: float = 0.0) -> None:
        if not 0 < first <= cap or not 0 <= jitter <= 1:
            raise ValueError(f"Backoff({first}, {cap}, jitter={jitter}): need "
                             "0 < first <= cap and 0 <= jitter <= 1")
        self.first, self.cap, self.jitter = first, cap, jitter
        self._delay = first

    def __repr__(self) -> str:
        return f"Backoff({self.first:g}, {self.cap:g}, jitter={self.jitter:g})"

    def next(self) -> float:
        """The delay before the next try, in seconds; the one after is twice as long
        (at most ``cap``)."""
        delay = self._delay
        self._delay = min(delay * 2, self.cap)
        if self.jitter:
            delay *= 1 - self.jitter * random.random()
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self._delay = self.first


def patiently(what: str, fn: Callable[[], T], patience: float, *,
              give_up_on: tuple[type[BaseException], ...] = ()) -> T:
    """``fn()``, tried again whatever it raises (a store outage, throttling) with
    backoff from 1 s to 30 s, for ``patience`` seconds; an exception of ``give_up_on``
    (a missing object, say) is raised at once. For what a process cannot go on
    without."""
    delays = Backoff(1.0, 30.0, jitter=0.5)
    deadline = time.monotonic() + patience
    while True:
        try:
            return fn()
        except give_up_on:
            raise
        except Exception as err:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            delay = min(delays.next(), left)
            log.warning("%s failed (%s); trying again in %.0f s", what, err, delay)
            time.sleep(delay)
