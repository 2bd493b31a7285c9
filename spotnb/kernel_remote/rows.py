"""The runtime's metric rows on their way to the log.

:class:`RowRelay` gathers the rows the runtime sends into one ``metrics`` event a
second (the live channel's pace) or every :data:`ROWS_PER_EVENT` rows, and says up to
which time the rows are durable in the log (the runtime then forgets them; a
checkpoint carries the rest).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from spotnb.protocol.events import EventWriter

# Metric rows become one `metrics` event this often (or at the live channel's pace, if
# faster), or at once when this many have gathered.
ROWS_SECONDS = 1.0
ROWS_PER_EVENT = 5000


def row_time(t: Any) -> float:
    """A metric row's time as the log keeps it: to the millisecond (a smaller column;
    replays compare carried rows with logged ones in this form)."""
    return round(float(t), 3)


class RowRelay:
    """Metric rows from the runtime, not yet an event; those not yet durable.

    ``events``: the attempt's log (None before it).
    """

    def __init__(self, events: Callable[[], EventWriter | None]) -> None:
        self._events = events
        self._rows: list[list[Any]] = []
        self._at = time.monotonic()
        self._lock = threading.Lock()
        # (events emitted once a metric batch was queued, its newest row's time): once
        # the writer has written that many events, the runtime may forget those rows.
        self._marks: collections.deque[tuple[int, float]] = collections.deque()
        self._marks_lock = threading.Lock()

    def add(self, rows: list[Any]) -> bool:
        """Gather ``rows``; whether enough have gathered to be an event now."""
        with self._lock:
            self._rows.extend(rows)
            return len(self._rows) >= ROWS_PER_EVENT

    def due(self, pace: float) -> bool:
        """Whether the last event of rows is ``pace`` seconds old."""
        return time.monotonic() - self._at >= pace

    def emit(self) -> None:
        """The metric rows gathered so far, as one ``metrics`` event."""
        ev = self._events()
        with self._lock:
            rows, self._rows = self._rows, []
            self._at = time.monotonic()
            if ev is None or not rows:
                return
            ev.emit_metrics((step, row_time(t), values) for step, t, values in rows)
            with self._marks_lock:
                self._marks.append((ev.emitted, float(rows[-1][1])))

    def durable(self) -> float | None:
        """The time of the newest row that became durable since last asked, if any."""
        ev = self._events()
        if ev is None:
            return None
        newest = None
        with self._marks_lock:
            while self._marks and self._marks[0][0] <= ev.written:
                newest = self._marks.popleft()[1]
        return newest
