"""What a job has done, what is left, and what its interruptions cost it.

The figures a display's header answers at a glance, computed in the notebook from the
job's events alone (:class:`Progress` takes every event, O(1) each, and a batch of
metric rows in bulk), so a replay after a kernel restart shows the same numbers:

* the step reached, of how many (the total comes from the job's ``progress`` event:
  ``spot.progress(total=...)``, or the ``range`` of the loop that calls ``spot.log``),
  the rate in steps per second and the time left;
* for each interruption, the time it took (from the interrupted attempt's last logged
  step, or its start if it logged none, until a later attempt logs a step beyond it:
  the notice, the wait, the boot, the restore and the redone steps) and what the
  instances billed meanwhile;
* the steps redone (logged by an attempt after its last checkpoint, then logged again);
* the attempt being launched while a replacement boots.

On the instance, :func:`spotnb.train.looptotal.loop_total` is how ``spot.log`` finds the total
by itself.

Cost so far is the job's own accounting (:func:`spotnb.client.jobs.summarize`); the
projection adds the time left at the current spot price, and compares it with
on-demand for the same work: the useful instance-hours (without the time interruptions
took) at the on-demand price.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from spotnb.protocol.events import GROUP_STREAM, Event, codec, metric_columns
from spotnb.protocol.events.fold import JobState, RedoneSteps, replaced_attempt

__all__ = ["RATE_WINDOW_SECONDS", "Interruption", "Progress", "Projection"]

#: The rate is measured over the last minute of logged steps: long enough to smooth
#: out a slow step, short enough to follow a change of pace.
RATE_WINDOW_SECONDS = 60.0


@dataclasses.dataclass
class Interruption:
    """One attempt that ended before the job did: a spot notice, or an instance lost.

    ``last_step``/``last_progress``: the last step the attempt logged and when;
    ``recovered_at``: when a later attempt first logged a step beyond it (None while
    the job has not caught up); ``redone``: the steps logged again (None until the next
    attempt logs its first step).
    """

    attempt: int
    time: float
    noticed: bool
    last_step: float | None = None
    last_progress: float | None = None
    recovered_at: float | None = None
    redone: int | None = None

    def lost_window(self, now: float) -> tuple[float, float] | None:
        """The time this interruption took, as a ``(start, end)`` wall-clock span."""
        start = self.last_progress if self.last_progress is not None else self.time
        end = self.recovered_at if self.recovered_at is not None else now
        return (start, end) if end > start else None


@dataclasses.dataclass(frozen=True)
class Projection:
    """The cost at the end of the job, if it keeps its current pace and price."""

    seconds_left: float
    cost_usd: float
    ondemand_usd: float

    @property
    def savings_pct(self) -> float | None:
        if self.ondemand_usd <= 0:
            return None
        return 100.0 * (1.0 - self.cost_usd / self.ondemand_usd)


class Progress:
    """Steps, pace and interruption losses of one job, from its events (module doc).

    The job's instances, prices and launches are the fold's (``state``, a
    :class:`~spotnb.protocol.events.fold.JobState` this takes every event into); what this adds
    is what the steps say."""

    def __init__(self, state: JobState | None = None) -> None:
        self.state = state if state is not None else JobState()
        self.total: int | None = None
        self.total_source = ""
        self.step: float | None = None  # the last step logged, by the newest attempt
        self.furthest: float | None = None  # the furthest step any attempt logged
        self.attempt = 0  # the newest attempt that logged a step
        self.interruptions: list[Interruption] = []
        # A multi-node job's steps logged so far, and the rows that logged one again
        # (its rows come from whichever node holds global rank 0, which may change
        # within an attempt or move to another: counted by step, not by attempt).
        self._steps_seen: set[float] = set()
        self._relogged = 0
        self._window: collections.deque[tuple[float, float]] = collections.deque()
        self._booted: set[int] = set()
        self._last: dict[int, tuple[float, float]] = {}  # attempt -> (step, time)
        self._ended: dict[int, Interruption] = {}
        self.redo = RedoneSteps()  # the steps redone after each ended attempt

    @property
    def max_nodes(self) -> int:
        """A multi-node job's MAX nodes: a boot ends the attempt it replaces, which is
        its node slot's previous one (MAX attempts earlier), not the one before it."""
        return self.state.max_nodes

    @max_nodes.setter
    def max_nodes(self, value: int) -> None:
        self.state.max_nodes = max(1, value)

    @property
    def launching(self) -> str | None:
        """The replacement being launched, if any, in words."""
        pending = self.state.launching
        if pending is None:
            return None
        booted = [n for n, a in self.state.attempts.items() if a.boot_time is not None]
        where = " ".join(str(p) for p in (pending.instance_type, pending.az) if p)
        verb = "waiting for capacity" if pending.waiting else "launching"
        who = f"attempt {max(booted, default=0) + 1}"
        if self.max_nodes > 1:  # which attempt number a node gets is its slot's
            who = "a replacement node" if len(booted) >= self.max_nodes else "a node"
        return f"{who}: {verb}" + (f" {where}" if where else "")

    # -- input ---------------------------------------------------------------------

    def apply(self, e: Event) -> None:
        """Take one event (events come in time order; a ``metrics`` batch: its rows, in
        bulk), folding it into ``state``."""
        if codec.is_row(e):
            # The hot path (a display's live update, a replay of a day's rows): read as
            # it is, no body built, and not folded (what a row says is the steps here).
            d = e.data
            if d.get("step") is not None:
                self._metric(e.attempt, float(d["step"]), float(d.get("t") or e.time))
            return
        self.state.apply(e)
        if codec.is_batch(e):
            columns = metric_columns(e)
            self._metrics(e.attempt, columns[0], columns[1])
            return
        body = e.body
        if isinstance(body, codec.ProgressTotal):
            if body.total:
                self.total = body.total
                self.total_source = body.source
        elif e.attempt == GROUP_STREAM:
            return
        elif isinstance(body, codec.Notice):
            if body.interruption and e.attempt not in self._ended:
                self._end(Interruption(e.attempt, e.time, noticed=True))
        elif isinstance(body, codec.Status):
            if body.state == "booting" and e.attempt not in self._booted:
                previous = replaced_attempt(e.attempt, self._booted, self.max_nodes)
                if previous is not None and previous not in self._ended and \
                        not body.retrying:
                    self._end(Interruption(previous, e.time, noticed=False))
                self._booted.add(e.attempt)
        elif isinstance(body, codec.Error) and body.retrying and e.attempt not in self._ended:
            self._ended[e.attempt] = Interruption(e.attempt, e.time, noticed=False)
            self.redo.end(e.attempt)

    def _count_relogged(self, steps: Sequence[float]) -> None:
        if self.max_nodes > 1:
            seen = self._steps_seen
            for step in steps:
                if step in seen:
                    self._relogged += 1
                else:
                    seen.add(step)

    def _metric(self, attempt: int, step: float, t: float) -> None:
        self._count_relogged((step,))
        self._redone(self.redo.logged(attempt, step, step))
        if attempt > self.attempt:
            self.attempt = attempt
            self._window.clear()
        if attempt == self.attempt:
            self.step = step
            self._window.append((t, step))
            while self._window and self._window[0][0] < t - RATE_WINDOW_SECONDS:
                self._window.popleft()
        last = self._last.get(attempt)
        if last is None or step >= last[0]:
            self._last[attempt] = (step, t)
        self._close_ended(attempt)
        for gone in self.interruptions:
            # Caught up: a later attempt passes the step this one reached (or logs at
            # all, if this one had logged nothing).
            if gone.recovered_at is None and gone.attempt < attempt and \
                    (gone.last_step is None or step > gone.last_step):
                gone.recovered_at = t
        self.furthest = step if self.furthest is None else max(self.furthest, step)

    def _metrics(self, attempt: int, steps: Sequence[float], times: Sequence[float]) -> None:
        """Rows of one attempt in bulk: the same state as :meth:`_metric` for each in
        turn. The first row goes through :meth:`_metric` (an attempt's first step, a
        new newest attempt); the rest are taken whole (a day of rows in a few passes
        of C loops: the text display needs no numpy)."""
        n = min(len(steps), len(times))
        if not n:
            return
        self._metric(attempt, float(steps[0]), float(times[0]))
        s = list(map(float, steps[1:n]))
        t = list(map(float, times[1:n]))
        if not s:
            return
        if any(map(math.isnan, s)) or any(map(math.isnan, t)) or sorted(t) != t:
            # Times out of order: what the rate window keeps depends on it; row by row.
            for step, when in zip(s, t, strict=True):
                self._metric(attempt, step, when)
            return
        self._count_relogged(s)
        if attempt == self.attempt:
            self.step = s[-1]
            # Trimming once at the last row's time leaves what trimming at each row's
            # would (the times only grow), without queueing the rows it drops.
            start = t[-1] - RATE_WINDOW_SECONDS
            while self._window and self._window[0][0] < start:
                self._window.popleft()
            keep = 0 if self._window else bisect.bisect_left(t, start)
            self._window.extend(zip(t[keep:], s[keep:], strict=True))
        top = max(s)
        self._redone(self.redo.logged(attempt, s[0], top))
        if top >= self._last[attempt][0]:
            k = len(s) - 1 - s[::-1].index(top)  # the last row at the top
            self._last[attempt] = (s[k], t[k])
        self._close_ended(attempt)
        for gone in self.interruptions:
            if gone.recovered_at is None and gone.attempt < attempt:
                passed = gone.last_step
                if passed is None:
                    gone.recovered_at = t[0]
                elif top > passed:
                    gone.recovered_at = next(w for x, w in zip(s, t, strict=True) if x > passed)
        self.furthest = top if self.furthest is None else max(self.furthest, top)

    def _close_ended(self, attempt: int) -> None:
        """Steps an ended attempt logged after its notice (before its last save), and
        late rows of it (a follower reads an ended attempt's last rows from the log
        after the next attempt's live ones): its last step."""
        closing = self._ended.get(attempt)
        if closing is not None:
            closing.last_step, closing.last_progress = self._last[attempt]

    def _redone(self, attempt: int | None) -> None:
        """The ended ``attempt``'s count of redone steps changed (RedoneSteps)."""
        if attempt is not None and attempt in self._ended:
            self._ended[attempt].redone = self.redo.of(attempt)

    def _end(self, gone: Interruption) -> None:
        last = self._last.get(gone.attempt)
        if last is not None:
            gone.last_step, gone.last_progress = last
        elif (run := self.state.attempts.get(gone.attempt)) is not None:
            # It logged no step (set-up, a compile): its whole run is what was lost.
            gone.last_progress = min(run.start, gone.time)
        self._ended[gone.attempt] = gone
        self.redo.end(gone.attempt)
        self.interruptions.append(gone)

    # -- figures -------------------------------------------------------------------

    def rate(self) -> float | None:
        """Steps per second over the newest attempt's last minute of steps."""
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

    def redone_steps(self) -> int:
        """Steps logged again after an interruption, so far (a multi-node job: every
        row that logged a step again, whichever node's; rows a killed node had not sent
        yet are lost with it and not counted)."""
        if self.max_nodes > 1:
            return self._relogged
        return sum(i.redone or 0 for i in self.interruptions)

    def _windows(self, now: float) -> list[tuple[float, float]]:
        """The spans that interruptions took, merged where they overlap."""
        spans = sorted(w for i in self.interruptions if (w := i.lost_window(now)) is not None)
        merged: list[tuple[float, float]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def lost_seconds(self, now: float) -> float:
        """Wall-clock seconds the job made no new progress because of interruptions."""
        return sum(end - start for start, end in self._windows(now))

    def lost_usd(self, now: float) -> tuple[float, float]:
        """What the instances billed while interruptions took their time: at the spot
        price, and at the on-demand price."""
        spot = ondemand = 0.0
        for start, end in self._windows(now):
            for inst in self.state.instances.values():
                a, b = max(start, inst.start), min(end, inst.end or now)
                if b <= a:
                    continue
                spot += self.state.billed(inst, a, b)
                ondemand += (inst.ondemand or 0.0) * (b - a) / 3600.0
        return spot, ondemand

    def running_prices(self) -> tuple[float, float, int] | None:
        """The spot and on-demand USD/hour of every instance running now, summed (a
        multi-node job pays for each of its nodes), and how many there are; None
        while none runs."""
        running = self.state.running_instances()
        if not running:
            return None
        spot = sum(self.state.spot_price(inst) for inst in running)
        return spot, sum(i.ondemand or 0.0 for i in running), len(running)

    def projection(self, now: float, cost_usd: float, ondemand_cost_usd: float,
                   spot_price: float | None, ondemand_price: float | None
                   ) -> Projection | None:
        """The cost at the end at the current pace and spot price, against on-demand
        for the same work (the instance-hours without the time interruptions took,
        plus the time left, at the on-demand price). None without a total or a pace."""
        left = self.seconds_left()
        if left is None or spot_price is None or not ondemand_price:
            return None
        _lost_spot, lost_ondemand = self.lost_usd(now)
        useful_ondemand = max(0.0, ondemand_cost_usd - lost_ondemand)
        return Projection(seconds_left=left,
                          cost_usd=cost_usd + left / 3600.0 * spot_price,
                          ondemand_usd=useful_ondemand + left / 3600.0 * ondemand_price)

    def summary(self, now: float) -> dict[str, Any]:
        """The figures as a dict (tests, text displays)."""
        lost_spot, _ = self.lost_usd(now)
        return {"step": self.step, "total": self.total, "rate": self.rate(),
                "seconds_left": self.seconds_left(),
                "interruptions": len(self.interruptions),
                "lost_seconds": self.lost_seconds(now), "lost_usd": lost_spot,
                "redone": self.redone_steps(), "launching": self.launching}


# -- on the instance: the total of the loop around spot.log ---------------------------

# What a range's end may be made of to be evaluated again: names, attributes, numbers,
# arithmetic and these calls. The loop already evaluated it once; these have no effect.
