"""What the dashboard plots, derived from a job's events: numpy series of bounded size.

No widgets here: :class:`DashboardData` takes events (:meth:`DashboardData.add`) and
keeps, per metric, the curve as it now stands and the points that were *redone* (logged
by an attempt that was interrupted before its next checkpoint, then logged again by the
replacement), GPU or CPU samples, the spot price, interruptions and resumes, the last
checkpoint and the last lines of output.

Every series is kept twice: in full (:class:`Column`, growable numpy arrays, for the
final figure and for recomputing a curve after an interruption) and reduced for display
(:class:`MinMaxBuckets`): an incremental min/max per bucket of consecutive points, at
most ``2 * max_buckets`` points however long the run. Adding a point costs O(1)
amortised and reading the reduced series O(max_buckets), so an update of the plots
costs the same at 1k and at 1M logged steps (``benchmarks/bench_dashboard.py``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from spotnb.events import GROUP_STREAM, Event
from spotnb.tb import TB_SYNC_NAME

__all__ = ["Checkpoint", "Column", "DashboardData", "Marker", "MetricSeries", "MinMaxBuckets"]

#: Points per displayed trace are at most twice this (a min and a max per bucket):
#: enough for a curve's shape on any screen, few enough for a fast update message.
DEFAULT_BUCKETS = 1000
#: Lines of remote output the panel keeps (the full log stays in the store).
LOG_LINES = 200
_LINE_CHARS = 400


class Column:
    """A growable pair of float64 arrays ``(x, y)``; appends are amortised O(1)."""

    def __init__(self, capacity: int = 256) -> None:
        self._x = np.empty(capacity)
        self._y = np.empty(capacity)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, x: float, y: float) -> None:
        if self.n == len(self._x):
            self._grow(self.n + 1)
        self._x[self.n] = x
        self._y[self.n] = y
        self.n += 1

    def extend(self, x: np.ndarray, y: np.ndarray) -> None:
        end = self.n + len(x)
        if end > len(self._x):
            self._grow(end)
        self._x[self.n:end] = x
        self._y[self.n:end] = y
        self.n = end

    def _grow(self, need: int) -> None:
        size = max(need, 2 * len(self._x))
        for name in ("_x", "_y"):
            old = getattr(self, name)
            new = np.empty(size)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    @property
    def x(self) -> np.ndarray:
        return self._x[:self.n]

    @property
    def y(self) -> np.ndarray:
        return self._y[:self.n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)


class MinMaxBuckets:
    """A series reduced incrementally to the min and max of each bucket of points.

    Buckets hold ``width`` consecutive points; when there are ``max_buckets`` of them,
    neighbours are merged pairwise and ``width`` doubles. :meth:`points` returns, per
    bucket, its min and its max in x order (one point while ``width`` is 1), so spikes
    survive the reduction, unlike with a plain stride. NaN values are kept as gaps.
    """

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS) -> None:
        if max_buckets < 2 or max_buckets % 2:
            raise ValueError("max_buckets must be even and at least 2")
        self.max_buckets = max_buckets
        self.width = 1
        self.count = 0  # points added
        # Per bucket: x and y of its min, x and y of its max.
        self._b = np.empty((4, max_buckets))
        self._nb = 0  # buckets in use (the last may be partial)

    def __len__(self) -> int:
        return self.count

    def add(self, x: float, y: float) -> None:
        if self.count % self.width == 0:  # starts a new bucket
            if self._nb == self.max_buckets:
                self._merge()
            self._b[:, self._nb] = (x, y, x, y)
            self._nb += 1
        else:
            b = self._b
            i = self._nb - 1
            if y < b[1, i] or b[1, i] != b[1, i]:  # smaller, or replacing a NaN
                b[0, i], b[1, i] = x, y
            if y > b[3, i] or b[3, i] != b[3, i]:
                b[2, i], b[3, i] = x, y
        self.count += 1

    def extend(self, x: np.ndarray, y: np.ndarray) -> None:
        for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
            self.add(xi, yi)

    def _merge(self) -> None:
        b = self._b
        lo = np.where(b[1, 1::2] < b[1, 0::2], 1, 0)  # which of each pair has the min
        hi = np.where(b[3, 1::2] > b[3, 0::2], 1, 0)
        half = self.max_buckets // 2
        idx = np.arange(half) * 2
        merged = np.empty_like(b)
        merged[0, :half] = b[0, idx + lo]
        merged[1, :half] = b[1, idx + lo]
        merged[2, :half] = b[2, idx + hi]
        merged[3, :half] = b[3, idx + hi]
        self._b = merged
        self._nb = half
        self.width *= 2

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The reduced series ``(x, y)``, in x order, at most ``2 * max_buckets`` points."""
        b = self._b[:, :self._nb]
        if self.width == 1:
            return b[0].copy(), b[1].copy()
        first_min = b[0] <= b[2]
        xs = np.empty(2 * self._nb)
        ys = np.empty(2 * self._nb)
        xs[0::2] = np.where(first_min, b[0], b[2])
        ys[0::2] = np.where(first_min, b[1], b[3])
        xs[1::2] = np.where(first_min, b[2], b[0])
        ys[1::2] = np.where(first_min, b[3], b[1])
        return xs, ys


class Reduced:
    """A series kept in full (:class:`Column`) and reduced (:class:`MinMaxBuckets`)."""

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS) -> None:
        self.full = Column()
        self.view = MinMaxBuckets(max_buckets)

    def __len__(self) -> int:
        return len(self.full)

    def add(self, x: float, y: float) -> None:
        self.full.append(x, y)
        self.view.add(x, y)

    def keep_first(self, n: int) -> None:
        """Drop every point after the first ``n`` (rebuilds the reduced view: O(n))."""
        if n >= len(self.full):
            return
        self.full.truncate(n)
        self.view = MinMaxBuckets(self.view.max_buckets)
        self.view.extend(self.full.x, self.full.y)


class MetricSeries:
    """One metric against step: the curve as it stands, and the redone points.

    When an attempt logs a step that an earlier attempt already logged, the earlier
    attempt's points from that step on were lost with its instance (they came after its
    last checkpoint): they move to ``redone`` and the curve continues from the resume.
    """

    def __init__(self, name: str, max_buckets: int = DEFAULT_BUCKETS) -> None:
        self.name = name
        self.curve = Reduced(max_buckets)
        self.redone = Reduced(max_buckets)
        self.attempt = 0
        self.last_step = -np.inf

    def add(self, attempt: int, step: float, value: float) -> None:
        if attempt > self.attempt and step <= self.last_step and len(self.curve):
            x, y = self.curve.full.x, self.curve.full.y
            if np.any(x[1:] < x[:-1]):  # logged out of order: sort once, by step
                order = np.argsort(x, kind="stable")
                x[:], y[:] = x[order], y[order]
            keep = int(np.searchsorted(x, step, side="left"))
            for lost_x, lost_y in zip(x[keep:].tolist(), y[keep:].tolist(), strict=True):
                self.redone.add(lost_x, lost_y)
            self.curve.keep_first(keep)
        self.attempt = max(self.attempt, attempt)
        self.curve.add(step, value)
        self.last_step = step


@dataclasses.dataclass(frozen=True)
class Marker:
    """An interruption (``kind="interrupted"``) or a resume (``"resumed"``).

    ``time`` is the wall clock; ``step`` the last step logged before it (None before
    any); ``attempt`` the attempt it ended or started.
    """

    kind: str
    time: float
    attempt: int
    step: float | None
    text: str


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The last durable checkpoint: step, bytes, when, and whether a notice forced it."""

    step: int
    bytes: int
    time: float
    forced: bool


class DashboardData:
    """Everything the dashboard plots, from events (see the module docstring).

    ``version`` increases whenever something visible changed, so a display can tell
    whether it has anything to send.
    """

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS, log_lines: int = LOG_LINES) -> None:
        self.max_buckets = max_buckets
        self.metrics: dict[str, MetricSeries] = {}
        self.util = Reduced(max_buckets)  # percent
        self.mem = Reduced(max_buckets)  # percent of the total
        self.sys_kind: str | None = None  # "gpu" or "cpu"
        self.price = Column()  # step function of the pool's spot price, USD/hour
        self.ondemand: float | None = None
        self.pool: str | None = None
        self.markers: list[Marker] = []
        self.checkpoint: Checkpoint | None = None
        self.tensorboard_synced = False
        self.lines: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._partial = ""
        self.version = 0
        self.log_version = 0
        self.first_time: float | None = None  # the time axes start here
        self.last_time = 0.0
        self._step: float | None = None
        self._attempt = 0
        self._interrupted: set[int] = set()

    # -- input ---------------------------------------------------------------------

    def add(self, events: list[Event]) -> None:
        """Take a batch of events (in time order). Output (``stream``) events are
        left to :meth:`write`, which the display calls in order with milestones."""
        for event in events:
            if self.first_time is None:
                self.first_time = event.time
            self.last_time = max(self.last_time, event.time)
            self._add(event)

    def _add(self, e: Event) -> None:
        d = e.data
        if e.type == "metric":
            step = d.get("step")
            if step is None:
                return
            for name, value in (d.get("values") or {}).items():
                if not isinstance(value, (int, float)):
                    continue
                series = self.metrics.get(name)
                if series is None:
                    series = self.metrics[name] = MetricSeries(name, self.max_buckets)
                series.add(e.attempt, float(step), float(value))
            self._step = float(step)
        elif e.type == "sys":
            self.sys_kind = str(d.get("kind") or self.sys_kind or "cpu")
            t = e.time
            self.util.add(t, float(d.get("util", np.nan)))
            total = d.get("mem_total") or 0
            used = d.get("mem_used")
            self.mem.add(t, 100.0 * used / total if total and used is not None else np.nan)
        elif e.type == "instance" and d.get("action") == "launched":
            self.pool = d.get("pool") or self.pool
            self._price(e.time, d)
        elif e.type == "price" and d.get("pool") in (None, self.pool):
            self._price(e.time, d)
        elif e.type == "notice" and d.get("kind") == "instance-action" and \
                e.attempt not in self._interrupted:
            self._interrupted.add(e.attempt)
            self.markers.append(Marker("interrupted", e.time, e.attempt, self._step,
                                       f"attempt {e.attempt} interrupted (spot notice)"))
        elif e.type == "status" and e.attempt != GROUP_STREAM and \
                d.get("state") == "booting" and e.attempt > max(self._attempt, 1):
            self.markers.append(Marker("resumed", e.time, e.attempt, self._step,
                                       f"attempt {e.attempt} started on {e.instance}"))
        elif e.type == "checkpoint" and d.get("kind") == "sync":
            if d.get("name") == TB_SYNC_NAME and d.get("phase") == "durable":
                self.tensorboard_synced = True
        elif e.type == "checkpoint" and d.get("phase") == "durable":
            self.checkpoint = Checkpoint(int(d.get("step", 0)), int(d.get("bytes", 0)),
                                         e.time, bool(d.get("forced")))
        else:
            return
        if e.attempt != GROUP_STREAM:
            self._attempt = max(self._attempt, e.attempt)
        self.version += 1

    def _price(self, when: float, d: dict[str, Any]) -> None:
        if d.get("price") is not None:
            self.price.append(when, float(d["price"]))
        if d.get("ondemand"):
            self.ondemand = float(d["ondemand"])

    def write(self, text: str, stderr: bool = False) -> None:
        """Remote output text (may hold partial lines)."""
        parts = (self._partial + text).split("\n")
        self._partial = parts.pop()
        for line in parts:
            self.lines.append(("\x00" if stderr else "") + _clip(line.split("\r")[-1]))
        self.log_version += 1

    def milestone(self, when: float, text: str) -> None:
        """A line of spotnb's own (interruptions, resumes) between the output lines."""
        import datetime

        clock = datetime.datetime.fromtimestamp(when).strftime("%H:%M:%S")
        self.lines.append(f"\x01[spotnb {clock}] {text}")
        self.log_version += 1

    # -- output --------------------------------------------------------------------

    def log_lines(self) -> list[tuple[str, str]]:
        """The panel's lines as (kind, text): kind is stdout, stderr or spotnb."""
        out = []
        for line in [*self.lines, *([self._partial] if self._partial else [])]:
            if line.startswith("\x00"):
                out.append(("stderr", line[1:]))
            elif line.startswith("\x01"):
                out.append(("spotnb", line[1:]))
            else:
                out.append(("stdout", line))
        return out

    def metric_names(self) -> list[str]:
        """Metric names, ``loss`` (or the first name containing it) first."""
        names = list(self.metrics)
        first = [n for n in names if n == "loss"] or [n for n in names if "loss" in n][:1]
        return first + [n for n in names if n not in first]

    def summary(self) -> dict[str, Any]:
        """Sizes, for tests and the benchmark."""
        return {
            "metrics": {k: (len(s.curve), len(s.redone)) for k, s in self.metrics.items()},
            "sys": len(self.util),
            "price": len(self.price),
            "markers": len(self.markers),
        }


def _clip(line: str) -> str:
    return line if len(line) <= _LINE_CHARS else line[:_LINE_CHARS] + "…"
