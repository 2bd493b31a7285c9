"""The steps a job logged, folded: where its training went back, the steps it redid, the
time it stood still, its current step and its pace (part of the fold,
:attr:`spotnb.protocol.events.fold.JobState.steps`).

A *segment* is a run of one attempt's metric rows whose steps never go back. Each attempt
that logs starts one; in a job of several nodes (``scan``) an attempt starts another
wherever its steps go back within it (global rank 0's node restarted its workers from a
checkpoint: a peer was lost, or the world re-formed around a node that joined). The
segments, in the order they started, are the job's training as it went, and say, each
in one place for every view:

* the steps redone where one segment follows another (:attr:`Segment.redone`): the one
  before had logged up to step L, the next starts at step F (its checkpoint's next step):
  ``L - F + 1`` steps run again, 0 when F > L. Rows of the one before read late (a
  follower gets an ended attempt's last rows from the log after the next attempt's live
  ones) raise L, and the count with it. An attempt that logged nothing is passed over;
* the time a break took (:attr:`Segment.window`): from the last row at the furthest step
  of the segment before until a later segment logs a step beyond it (not yet: until now);
* the current step (:attr:`Steps.step`): the newest segment's last; a late row of an
  ended one leaves it as it is;
* the pace (:meth:`Steps.rate`): steps per second over the newest segment's last minute.

Cost per event: a row, a few comparisons; a batch, its step and time columns decoded and
read in C loops (its furthest step, whether its steps go back, whether its times grow:
a million rows in tens of milliseconds), and its rows of the last minute into the pace's
window; the one batch that passes a break's furthest step is read row by row to tell
when.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import operator
from collections.abc import Sequence
from itertools import islice, pairwise
from typing import Any

from spotnb.protocol.events import Event, codec, step_times

__all__ = ["RATE_WINDOW_SECONDS", "Segment", "Steps"]

#: The pace is measured over the last minute of logged steps: long enough to smooth out
#: a slow step, short enough to follow a change of pace.
RATE_WINDOW_SECONDS = 60.0


@dataclasses.dataclass(eq=False)
class Segment:
    """A run of one attempt's rows whose steps never go back (module docstring)."""

    attempt: int
    first_step: int
    first_time: float
    last_step: int  # its newest row's step
    last_time: float  # its newest row's time
    furthest: int
    furthest_time: float  # the time of its last row at its furthest step
    #: The segment that ran before it (None: the job's first).
    previous: Segment | None = None
    #: When it, or a later segment, first logged a step beyond the furthest of the one
    #: before (None: not yet, or the job's first).
    passed: float | None = None
    #: How many segments started before it, in the order the fold got their rows.
    serial: int = 0

    @property
    def redone(self) -> int | None:
        """Steps run again where it started (None: the job's first segment)."""
        if self.previous is None:
            return None
        return max(0, self.previous.furthest - self.first_step + 1)

    @property
    def went_back(self) -> bool:
        """Whether it started at or before the furthest step of the one before."""
        return self.previous is not None and self.first_step <= self.previous.furthest

    def window(self, now: float) -> tuple[float, float] | None:
        """The time the job made no new progress where it started: from the last row
        at the furthest step of the segment before, until a step beyond it (``now`` if
        none yet). None for the job's first segment."""
        if self.previous is None:
            return None
        start = self.previous.furthest_time
        end = self.passed if self.passed is not None else now
        return (start, end) if end > start else None


@dataclasses.dataclass(eq=False)
class _Piece:
    """Consecutive rows of one segment, in log order: rows ``lo``..``hi``-1 of an
    event's step and time columns."""

    steps: Sequence[int]
    times: Sequence[float]
    lo: int
    hi: int
    furthest: int
    furthest_time: float

    @property
    def first_step(self) -> int:
        return int(self.steps[self.lo])

    @property
    def first_time(self) -> float:
        return float(self.times[self.lo])

    @property
    def last_step(self) -> int:
        return int(self.steps[self.hi - 1])

    @property
    def last_time(self) -> float:
        return float(self.times[self.hi - 1])


def _piece(steps: Sequence[int], times: Sequence[float], lo: int, hi: int) -> _Piece:
    """Rows ``lo``..``hi``-1 as a piece: its furthest step and the time of its last row
    at that step (C loops: a batch of a million rows in milliseconds)."""
    part = steps[lo:hi]
    top = max(part)
    at = hi - 1 - part[::-1].index(top)
    return _Piece(steps, times, lo, hi, int(top), float(times[at]))


class Steps:
    """The job's metric rows, folded into segments (module docstring). ``scan``: the
    attempts' steps may go back within them (a job of several nodes)."""

    def __init__(self, scan: bool = False) -> None:
        self.scan = scan
        #: The segments, in the order they started (their first row's time).
        self.segments: list[Segment] = []
        self._starts: list[float] = []  # each segment's first time, for bisect
        self._open: dict[int, Segment] = {}  # attempt -> its newest segment
        self._pending: list[Segment] = []  # segments whose `passed` is not known yet
        # The newest segment's rows of its last minute: (time, step).
        self._window: collections.deque[tuple[float, float]] = collections.deque()
        #: The steps of the run (``spot.progress`` or the loop's ``range``) and where
        #: that came from.
        self.total: int | None = None
        self.total_source = ""
        #: Segments started and runs of rows taken so far, in the order the fold got
        #: them (what came after a given event, whatever the rows' own times).
        self.started = 0
        self.taken = 0

    # -- input ---------------------------------------------------------------------

    def add(self, event: Event) -> tuple[float, float] | None:
        """Fold a ``metric`` row or a ``metrics`` batch of an attempt's stream; the
        times of its earliest and its latest row (None: no row, or a damaged batch,
        whose columns disagree in length: its rows are to be added one by one)."""
        if codec.is_row(event):
            step = event.data.get("step")
            t = event.data.get("t")
            t = event.time if t is None else float(t)
            if step is not None:
                self._take(event.attempt, _Piece([int(step)], [t], 0, 1, int(step), t))
            return t, t
        steps, times = step_times(event)
        n = len(steps)
        if not n or n != len(times):
            return None
        cuts = [0]
        if self.scan and not all(map(operator.le, islice(steps, 0, n - 1),
                                     islice(steps, 1, n))):
            cuts += [i for i in range(1, n) if steps[i] < steps[i - 1]]
        cuts.append(n)
        for lo, hi in pairwise(cuts):
            self._take(event.attempt, _piece(steps, times, lo, hi))
        known = [t for t in (min(times), max(times)) if not math.isnan(t)]
        return (known[0], known[-1]) if known else (event.time, event.time)

    def _take(self, attempt: int, piece: _Piece) -> None:
        self.taken += 1
        seg = self._open.get(attempt)
        if seg is None or (self.scan and piece.first_step < seg.last_step):
            seg = self._start(attempt, piece)
        else:
            seg.last_step, seg.last_time = piece.last_step, piece.last_time
            if piece.furthest >= seg.furthest:
                seg.furthest, seg.furthest_time = piece.furthest, piece.furthest_time
        if seg is self.segments[-1]:
            self._paced(piece)
        if self._pending:
            self._recover(seg, piece)

    def _start(self, attempt: int, piece: _Piece) -> Segment:
        seg = Segment(attempt, piece.first_step, piece.first_time, piece.last_step,
                      piece.last_time, piece.furthest, piece.furthest_time,
                      serial=self.started)
        self.started += 1
        # In the order segments started (a stream read late may bring an older one).
        at = bisect.bisect_right(self._starts, piece.first_time)
        if at < len(self.segments):
            self.segments[at].previous = seg
        seg.previous = self.segments[at - 1] if at else None
        self.segments.insert(at, seg)
        self._starts.insert(at, piece.first_time)
        self._open[attempt] = seg  # its stream's rows go on in it
        if seg.previous is not None:
            self._pending.append(seg)
        if seg is self.segments[-1]:
            self._window.clear()
        return seg

    def _recover(self, seg: Segment, piece: _Piece) -> None:
        """Breaks whose furthest step ``piece`` (of ``seg``) passes: when it did."""
        for waiting in list(self._pending):
            before = waiting.previous
            if before is None:
                self._pending.remove(waiting)
                continue
            if seg.first_time < waiting.first_time or piece.furthest <= before.furthest:
                continue
            waiting.passed = next(
                (float(t) for s, t in zip(piece.steps[piece.lo:piece.hi],
                                          piece.times[piece.lo:piece.hi], strict=False)
                 if s > before.furthest), piece.last_time)
            self._pending.remove(waiting)

    def _paced(self, piece: _Piece) -> None:
        """The newest segment's rows into the pace's window: each row's time, then the
        rows older than a minute before it dropped (in bulk where times only grow)."""
        window = self._window
        steps, times, lo, hi = piece.steps, piece.times, piece.lo, piece.hi
        self._row(float(times[lo]), float(steps[lo]))
        lo += 1
        if lo >= hi:
            return
        t = times[lo:hi]
        if any(map(math.isnan, t)) or any(map(math.isnan, steps[lo:hi])) or \
                not all(map(operator.le, islice(t, 0, len(t) - 1), islice(t, 1, len(t)))):
            for i in range(lo, hi):  # times out of order: what is kept depends on it
                self._row(float(times[i]), float(steps[i]))
            return
        # Trimming once at the last row's time leaves what trimming at each row's
        # would (the times only grow), without queueing the rows it drops.
        start = float(t[-1]) - RATE_WINDOW_SECONDS
        while window and window[0][0] < start:
            window.popleft()
        keep = lo if window else bisect.bisect_left(times, start, lo, hi)
        window.extend(zip(map(float, times[keep:hi]), map(float, steps[keep:hi]),
                          strict=True))

    def _row(self, t: float, step: float) -> None:
        window = self._window
        window.append((t, step))
        while window and window[0][0] < t - RATE_WINDOW_SECONDS:
            window.popleft()

    # -- figures -------------------------------------------------------------------

    @property
    def current(self) -> Segment | None:
        """The newest segment (the training as it goes on)."""
        return self.segments[-1] if self.segments else None

    @property
    def step(self) -> int | None:
        """The current step: the newest segment's last."""
        return None if not self.segments else self.segments[-1].last_step

    @property
    def furthest(self) -> int | None:
        """The furthest step any attempt logged."""
        return max((s.furthest for s in self.segments), default=None)

    def last_segment(self, attempt: int) -> Segment | None:
        """The newest segment of ``attempt`` (None if it logged nothing)."""
        return self._open.get(attempt)

    def after(self, seg: Segment) -> Segment | None:
        """The segment that started next after ``seg``."""
        at = self.segments.index(seg) + 1
        return self.segments[at] if at < len(self.segments) else None

    def redone(self) -> int:
        """Steps run again, over the job."""
        return sum(s.redone or 0 for s in self.segments)

    def rate(self) -> float | None:
        """Steps per second over the newest segment's last minute of rows (None with
        fewer than two rows, or none forward)."""
        if len(self._window) < 2:
            return None
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return (s1 - s0) / (t1 - t0)

    def steps_left(self) -> float | None:
        """Steps still to run (the loop runs steps ``0 .. total - 1``)."""
        if self.total is None or self.step is None:
            return None
        return max(0.0, self.total - (self.step + 1))

    def seconds_left(self) -> float | None:
        """The time left at the current pace (None without a total or a pace)."""
        left, rate = self.steps_left(), self.rate()
        if left is None or rate is None:
            return None
        return left / rate

    def summary(self) -> dict[str, Any]:
        """The segments as plain data (tests, benchmarks)."""
        return {"step": self.step, "total": self.total, "redone": self.redone(),
                "segments": [(s.attempt, s.first_step, s.furthest, s.redone)
                             for s in self.segments]}
