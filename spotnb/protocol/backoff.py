"""Delays between the tries of something that fails.

Standard library only: the instance agent, the local cloud's supervisor and the
notebook side all import it. Every retry loop of spotnb takes its delays from a
:class:`Backoff` (a store that fails, AWS calls botocore does not retry, the lease's
heartbeat, an event chunk that could not be written, a launch after an agent gave up
on the store); each loop keeps its own limit (a time, a number of tries, or none) and
its own first and longest delay, named where the loop is.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


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
