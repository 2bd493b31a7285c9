"""What the dashboard plots, derived from a job's events: numpy series of bounded size.

No widgets here: :class:`DashboardData` takes events (:meth:`DashboardData.add`) and
keeps, per metric, the curve as it now stands and the points that were *redone* (logged
by an attempt that was interrupted before its next checkpoint, then logged again by the
replacement), GPU or CPU samples, the last checkpoint and the last lines of output. The
job's facts (the spot price of each pool it ran in, its interruptions and resumes, the
steps redone, the world) are its fold's (:attr:`DashboardData.state`, shared with the
follow loop's view: one fold per followed job), which the markers read. A
multi-node job's utilisation is also kept per node slot (one line per node: a node's
replacement continues its line after a gap), with its world size as it changed.

Every series is kept twice: in full (:class:`Column`, growable numpy arrays of x, y and
the wall-clock time of each point, for the final figure and for recomputing a curve
after an interruption) and reduced for display (:class:`MinMaxBuckets`): an incremental
min/max per bucket of consecutive points, at most ``2 * max_buckets`` points however
long the run. Adding a point costs O(1) amortised and reading the reduced series
O(max_buckets), so an update of the plots costs the same at 1k and at 1M logged steps
(``benchmarks/bench_dashboard.py``). A ``metrics`` batch goes in a column at a time,
whole buckets at once in numpy: re-attaching to a day-long job replays its million
rows in a fraction of a second.

A metric's curve is made of *segments*, one per attempt that logged it: where the
replacement instance took over, :meth:`MetricSeries.points` puts a gap (NaN), so a line
is never drawn across the time between two instances.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, Event, codec, expand, metric_columns, metric_names
from spotnb.protocol.events.fold import EndReason, JobState, PoolState, replaced_attempt
from spotnb.train.tb import TB_SYNC_NAME

__all__ = ["Checkpoint", "Column", "DashboardData", "Marker", "MetricSeries", "MinMaxBuckets"]

#: Points per displayed trace are at most twice this (a min and a max per bucket):
#: enough for a curve's shape on any screen, few enough for a fast update message.
DEFAULT_BUCKETS = 1000
#: Lines of remote output the panel keeps: the first HEAD_LINES (the set-up, the first
#: evaluation) and the last LOG_LINES; between them it says how many it left out (the
#: full log stays in the store: ``%spot_logs``).
LOG_LINES = 200
HEAD_LINES = 50
_LINE_CHARS = 400


class Column:
    """Growable float64 arrays ``x``, ``y`` and ``t`` (time); appends are amortised O(1)."""

    def __init__(self, capacity: int = 256) -> None:
        self._a = np.empty((3, capacity))
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def append(self, x: float, y: float, t: float | None = None) -> None:
        if self.n == self._a.shape[1]:
            self._grow(self.n + 1)
        self._a[:, self.n] = (x, y, x if t is None else t)
        self.n += 1

    def extend(self, x: np.ndarray, y: np.ndarray, t: np.ndarray | None = None) -> None:
        """Append many points at once (``t`` defaults to ``x``, as in :meth:`append`)."""
        m = len(x)
        if self.n + m > self._a.shape[1]:
            self._grow(self.n + m)
        self._a[0, self.n:self.n + m] = x
        self._a[1, self.n:self.n + m] = y
        self._a[2, self.n:self.n + m] = x if t is None else t
        self.n += m

    def _grow(self, need: int) -> None:
        new = np.empty((3, max(need, 2 * self._a.shape[1])))
        new[:, :self.n] = self._a[:, :self.n]
        self._a = new

    @property
    def x(self) -> np.ndarray:
        return self._a[0, :self.n]

    @property
    def y(self) -> np.ndarray:
        return self._a[1, :self.n]

    @property
    def t(self) -> np.ndarray:
        return self._a[2, :self.n]

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def sort_by_x(self) -> None:
        """Put the points in x order (stable), once, if they are not."""
        x = self.x
        if np.any(x[1:] < x[:-1]):
            order = np.argsort(x, kind="stable")
            self._a[:, :self.n] = self._a[:, :self.n][:, order]


class MinMaxBuckets:
    """A series reduced incrementally to the min and max of each bucket of points.

    Buckets hold ``width`` consecutive points; when there are ``max_buckets`` of them,
    neighbours are merged pairwise and ``width`` doubles. :meth:`points` returns, per
    bucket, its min and its max in x order (one point while ``width`` is 1), so spikes
    survive the reduction, unlike with a plain stride. Each kept point keeps its time.
    NaN values never win a bucket over a number.
    """

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS) -> None:
        if max_buckets < 2 or max_buckets % 2:
            raise ValueError("max_buckets must be even and at least 2")
        self.max_buckets = max_buckets
        self.width = 1
        self.count = 0  # points added
        # Per bucket: x, y, t of its min, then x, y, t of its max.
        self._b = np.empty((6, max_buckets))
        self._nb = 0  # buckets in use (the last may be partial)

    def __len__(self) -> int:
        return self.count

    def add(self, x: float, y: float, t: float | None = None) -> None:
        t = x if t is None else t
        if self.count % self.width == 0:  # starts a new bucket
            if self._nb == self.max_buckets:
                self._merge()
            self._b[:, self._nb] = (x, y, t, x, y, t)
            self._nb += 1
        else:
            b = self._b
            i = self._nb - 1
            if y < b[1, i] or b[1, i] != b[1, i]:  # smaller, or replacing a NaN
                b[0, i], b[1, i], b[2, i] = x, y, t
            if y > b[4, i] or b[4, i] != b[4, i]:
                b[3, i], b[4, i], b[5, i] = x, y, t
        self.count += 1

    def extend(self, x: np.ndarray, y: np.ndarray, t: np.ndarray | None = None) -> None:
        """Add many points: the same buckets as :meth:`add` for each in turn, whole
        buckets at a time (a partial bucket's points one by one)."""
        x = np.asarray(x, dtype=float)
        y = np.asarray(y, dtype=float)
        ts = x if t is None else np.asarray(t, dtype=float)
        i, n = 0, len(x)
        while i < n:
            if self.count % self.width or n - i < self.width:
                # Fill the partial bucket (or start the last, partial one) point by point.
                for xi, yi, ti in zip(x[i:i + self.width].tolist(),
                                      y[i:i + self.width].tolist(),
                                      ts[i:i + self.width].tolist(), strict=True):
                    self.add(xi, yi, ti)
                    i += 1
                    if self.count % self.width == 0:
                        break
                continue
            if self._nb == self.max_buckets:
                self._merge()
            k = min(self.max_buckets - self._nb, (n - i) // self.width)
            self._fill(x[i:], y[i:], ts[i:], k)
            i += k * self.width

    def _fill(self, x: np.ndarray, y: np.ndarray, t: np.ndarray, k: int) -> None:
        """``k`` whole new buckets from the first ``k * width`` points."""
        w = self.width
        ys = y[:k * w].reshape(k, w)
        nan = np.isnan(ys)
        # The first minimum and the first maximum win, and NaN never wins over a number
        # (as in add): NaN is +inf for the min, -inf for the max. Where the winner is
        # then a NaN or may be a NaN's stand-in (a bucket of NaNs and infinities), the
        # bucket is scanned as add does.
        lo = np.argmin(np.where(nan, np.inf, ys), axis=1)
        hi = np.argmax(np.where(nan, -np.inf, ys), axis=1)
        rows = np.arange(k)
        odd = nan.any(axis=1) & (np.isinf(ys[rows, lo]) | np.isinf(ys[rows, hi])
                                 | nan[rows, lo] | nan[rows, hi])
        for r in np.flatnonzero(odd).tolist():
            lo[r], hi[r] = _scan(ys[r].tolist())
        first = rows * w
        b, nb = self._b, self._nb
        for row, column in enumerate((x, y, t)):
            b[row, nb:nb + k] = column[first + lo]
            b[row + 3, nb:nb + k] = column[first + hi]
        self._nb += k
        self.count += k * w

    def _merge(self) -> None:
        b = self._b
        lo = np.where(b[1, 1::2] < b[1, 0::2], 1, 0)  # which of each pair has the min
        hi = np.where(b[4, 1::2] > b[4, 0::2], 1, 0)
        half = self.max_buckets // 2
        idx = np.arange(half) * 2
        merged = np.empty_like(b)
        for row in range(3):
            merged[row, :half] = b[row, idx + lo]
            merged[row + 3, :half] = b[row + 3, idx + hi]
        self._b = merged
        self._nb = half
        self.width *= 2

    def points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reduced series ``(x, y, t)``, in x order, at most ``2 * max_buckets``
        points."""
        b = self._b[:, :self._nb]
        if self.width == 1:
            return b[0].copy(), b[1].copy(), b[2].copy()
        first_min = b[0] <= b[3]
        out = np.empty((3, 2 * self._nb))
        for row in range(3):
            out[row, 0::2] = np.where(first_min, b[row], b[row + 3])
            out[row, 1::2] = np.where(first_min, b[row + 3], b[row])
        return out[0], out[1], out[2]


def _scan(ys: list[float]) -> tuple[int, int]:
    """The positions of a bucket's min and max as :meth:`MinMaxBuckets.add` keeps them
    point by point (for buckets whose NaNs the vectorised pick cannot tell apart)."""
    lo = hi = 0
    for i, y in enumerate(ys[1:], 1):
        if y < ys[lo] or ys[lo] != ys[lo]:
            lo = i
        if y > ys[hi] or ys[hi] != ys[hi]:
            hi = i
    return lo, hi


class Reduced:
    """A series kept in full (:class:`Column`) and reduced (:class:`MinMaxBuckets`)."""

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS) -> None:
        self.full = Column()
        self._view = MinMaxBuckets(max_buckets)
        self._stale = False  # a point went in out of order: the view is rebuilt

    def __len__(self) -> int:
        return len(self.full)

    @property
    def view(self) -> MinMaxBuckets:
        """The reduced series (rebuilt here, O(n), after out-of-order inserts)."""
        if self._stale:
            self.full.sort_by_x()
            self._rebuild()
        return self._view

    def add(self, x: float, y: float, t: float | None = None) -> None:
        self.full.append(x, y, t)
        if not self._stale:
            self._view.add(x, y, t)

    def add_many(self, x: np.ndarray, y: np.ndarray, t: np.ndarray | None = None) -> None:
        """Add points in bulk (as :meth:`add` for each in turn)."""
        self.full.extend(x, y, t)
        if not self._stale:
            self._view.extend(x, y, t)

    def insert(self, x: float, y: float, t: float | None = None) -> None:
        """Add a point that may belong before others (the view is rebuilt when next
        read, once for a run of inserts)."""
        self.full.append(x, y, t)
        self._stale = True

    def keep_first(self, n: int) -> None:
        """Drop every point after the first ``n`` (rebuilds the reduced view: O(n))."""
        self.full.sort_by_x()
        if n >= len(self.full) and not self._stale:
            return
        self.full.truncate(n)
        self._rebuild()

    def _rebuild(self) -> None:
        self._view = MinMaxBuckets(self._view.max_buckets)
        self._view.extend(self.full.x, self.full.y, self.full.t)
        self._stale = False


class MetricSeries:
    """One metric against step: the curve as it stands, and the redone points.

    When an attempt logs a step that an earlier attempt already logged, the earlier
    attempt's points from that step on were lost with its instance (they came after its
    last checkpoint): they move to ``redone`` and the curve continues from the resume.
    ``gaps`` holds the step at which each later attempt's segment starts.
    """

    def __init__(self, name: str, max_buckets: int = DEFAULT_BUCKETS) -> None:
        self.name = name
        self.curve = Reduced(max_buckets)
        self.redone = Reduced(max_buckets)
        self.attempt = 0
        self.last_step = -np.inf
        self.gaps: list[float] = []
        self.starts: dict[int, float] = {}  # attempt -> the first step it logged here

    def add(self, attempt: int, step: float, value: float, t: float) -> int:
        """Add a point; how many earlier points it showed to be redone (moved)."""
        if attempt < self.attempt:
            # A late row of an earlier attempt (a follower reads an ended attempt's last
            # rows from the log after the next attempt's live ones). From a step that
            # the attempt after it logged again, it was lost with its instance (redone);
            # before that step, it belongs to the curve.
            later = [a for a in self.starts if a > attempt]
            if later and step >= self.starts[min(later)]:
                self.redone.insert(step, value, t)
            else:
                self.curve.insert(step, value, t)
            return 0
        if attempt not in self.starts:
            self.starts[attempt] = step
        moved = 0
        if attempt > self.attempt and len(self.curve):
            if step <= self.last_step:
                full = self.curve.full
                full.sort_by_x()
                keep = int(np.searchsorted(full.x, step, side="left"))
                for lost in zip(full.x[keep:].tolist(), full.y[keep:].tolist(),
                                full.t[keep:].tolist(), strict=True):
                    self.redone.add(*lost)
                moved = len(full) - keep
                self.curve.keep_first(keep)
                self.gaps = [g for g in self.gaps if g < step]
            if len(self.curve):
                self.gaps.append(step)
        self.attempt = max(self.attempt, attempt)
        self.curve.add(step, value, t)
        self.last_step = step
        return moved

    def add_many(self, attempt: int, steps: np.ndarray, values: np.ndarray,
                 times: np.ndarray) -> int:
        """Add points in bulk, as :meth:`add` for each in turn; how many earlier points
        the first one showed to be redone (the others show none)."""
        if not len(steps):
            return 0
        moved = self.add(attempt, float(steps[0]), float(values[0]), float(times[0]))
        if attempt == self.attempt:  # the rest continue the current attempt's curve
            self.curve.add_many(steps[1:], values[1:], times[1:])
            if len(steps) > 1:
                self.last_step = float(steps[-1])
        else:  # late rows of an earlier attempt, each to the curve or the redone
            for point in zip(steps[1:].tolist(), values[1:].tolist(), times[1:].tolist(),
                             strict=True):
                self.add(attempt, *point)
        return moved

    def points(self, full: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The reduced curve ``(step, value, time)`` (every point with ``full``) with a
        NaN row where each later attempt's segment starts, so no line joins two
        instances."""
        if full:
            self.curve.full.sort_by_x()
            c = self.curve.full
            x, y, t = c.x.copy(), c.y.copy(), c.t.copy()
        else:
            x, y, t = self.curve.view.points()
        if not self.gaps or not len(x):
            return x, y, t
        at = np.searchsorted(x, np.asarray(self.gaps), side="left")
        nan = np.full(len(at), np.nan)
        return np.insert(x, at, nan), np.insert(y, at, nan), np.insert(t, at, nan)


@dataclasses.dataclass
class Marker:
    """An interruption, a lost instance, a retry or a resume, as the plots mark it.

    ``kind``: ``"interrupted"`` (a spot notice), ``"lost"`` (the instance went away
    without one), ``"retry"`` (a user-code error rerun in place) or ``"resumed"``.
    ``time`` is the wall clock; ``attempt`` the attempt it ended or started; ``step``
    the last step that attempt logged (interruptions) or the first step it logged
    (resumes), None until known; ``redone`` the steps lost with an interrupted
    attempt, None until the next attempt logs. ``detail`` says why or where.
    """

    kind: str
    time: float
    attempt: int
    step: float | None = None
    redone: int | None = None
    detail: str = ""

    @property
    def ended(self) -> bool:
        """Whether it marks the end of an attempt (not the start of one)."""
        return self.kind != "resumed"

    @property
    def text(self) -> str:
        """The hover text: what happened, at which step, and what it cost."""
        at = f" at step {self.step:.0f}" if self.step is not None else ""
        if self.kind == "resumed":
            start = f" from step {self.step:.0f}" if self.step is not None else ""
            return f"attempt {self.attempt} resumed{start} {self.detail}".strip()
        verb = {"interrupted": "interrupted", "lost": "lost",
                "retry": "failed"}[self.kind]
        redone = ("steps redone: not known yet" if self.redone is None
                  else f"{self.redone} step{'s' if self.redone != 1 else ''} redone")
        return f"attempt {self.attempt} {verb}{at}: {self.detail}; {redone}"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The last durable checkpoint: step, bytes, when, and whether a notice forced it."""

    step: int
    bytes: int
    time: float
    forced: bool


_NOTICE_REASONS = {
    "requested": "interruption asked for (Interrupt now, %spot_interrupt)",
    "price": "the spot price rose above the max price",
    "scheduled": "simulated interruption (--simulate-interruptions)",
    "hazard": "spot capacity reclaimed (the pool's interruption rate)",
}


class DashboardData:
    """Everything the dashboard plots, from events (see the module docstring).

    ``state``: the job's fold, which the caller applies every event to (the follow
    loop's, a comparison's); without one, this keeps its own and folds what it is
    given. ``version`` increases whenever something visible changed, so a display can
    tell whether it has anything to send.
    """

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS, log_lines: int = LOG_LINES,
                 max_nodes: int = 1, state: JobState | None = None) -> None:
        self.max_buckets = max_buckets
        self.node_util: dict[int, Reduced] = {}  # node slot -> utilisation, percent
        self.node_gaps: dict[int, list[float]] = {}  # where a replacement's samples start
        self._node_attempt: dict[int, int] = {}
        # The job's story (spotnb.protocol.events.fold): prices, breaks, the world.
        self._folds = state is None
        self.state = JobState(max_nodes) if state is None else state
        self.state.max_nodes = max(self.state.max_nodes, max_nodes)
        self.metrics: dict[str, MetricSeries] = {}
        self.util = Reduced(max_buckets)  # percent
        self.mem = Reduced(max_buckets)  # percent of the total
        self.sys_kind: str | None = None  # "gpu" or "cpu"
        self.sys_gaps: list[float] = []  # where a new instance's samples start (time)
        self._sys_attempt = 0
        self.checkpoint: Checkpoint | None = None
        self.tensorboard_synced = False
        self.head: list[str] = []  # the first HEAD_LINES lines (fewer with a small log_lines)
        self.lines: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._head_lines = min(HEAD_LINES, log_lines)
        self.line_count = 0  # every line written, kept or not
        self._partial = ""
        self.version = 0
        self.log_version = 0
        self.first_time: float | None = None  # the time axes start here
        self.last_time = 0.0
        self._markers: tuple[int, list[Marker]] | None = None
        self._map: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None \
            = None

    def use(self, state: JobState) -> None:
        """Read ``state`` (the caller's fold of the same events) from now on, and fold
        nothing more here."""
        state.max_nodes = max(state.max_nodes, self.state.max_nodes)
        self.state, self._folds = state, False
        self._markers = self._map = None

    @property
    def max_nodes(self) -> int:
        """A multi-node job's MAX nodes (its ``world`` events say it too): which node
        slot an attempt's samples belong to (``layout.node_slot``)."""
        return self.state.max_nodes

    @max_nodes.setter
    def max_nodes(self, value: int) -> None:
        self.state.max_nodes = max(1, value)
        self.state.steps.scan = self.state.steps.scan or value > 1

    # -- input ---------------------------------------------------------------------

    def add(self, events: list[Event]) -> None:
        """Take a batch of events (in time order). Output (``stream``) events are
        left to :meth:`write`, which the display calls in order with milestones."""
        for event in events:
            if self._folds:
                self.state.apply(event)
            if codec.is_batch(event):  # a batch of rows (a reader with batches=True)
                self._metrics(event)
                continue
            if self.first_time is None:
                self.first_time = event.time
            self.last_time = max(self.last_time, event.time)
            self._add(event)

    @property
    def worlds(self) -> list[tuple[float, int, int]]:
        """The world as it changed: (time, nodes, processes)."""
        return self.state.worlds

    @property
    def pools(self) -> dict[str, PoolState]:
        """The spot price of each pool the job ran in (the fold's), in the order it
        used them."""
        return self.state.pools

    @property
    def redo(self) -> int:
        """Steps redone over the job (the fold's)."""
        return self.state.redone_steps()

    def _add(self, e: Event) -> None:
        if codec.is_row(e):  # the series' own: no body built
            self._metric(e)
            self.version += 1
            return
        body = e.body
        if isinstance(body, codec.Sys):
            self.sys_kind = body.kind or self.sys_kind or "cpu"
            t = e.time
            util = np.nan if body.util is None else body.util
            if e.attempt != self._sys_attempt and len(self.util) and not self.multinode:
                # Another instance: no line across the gap. (A multi-node job's nodes
                # take turns in this series: their lines are per node, node_util.)
                self.sys_gaps.append(t)
            self._sys_attempt = e.attempt
            self.util.add(t, util)
            if self.max_nodes > 1:
                self._node_sample(e.attempt, t, util)
            total, used = body.mem_total or 0, body.mem_used
            self.mem.add(t, 100.0 * used / total if total and used is not None else np.nan)
        elif isinstance(body, codec.Instance) and body.noticed:
            return
        elif isinstance(body, (codec.World, codec.Instance, codec.Price, codec.Notice)):
            pass  # the fold's: prices, the world, the markers
        elif isinstance(body, (codec.Status, codec.Error)) and e.attempt != GROUP_STREAM:
            pass  # the fold's: boots (resumes) and ends (markers)
        elif isinstance(body, codec.CheckpointEvent) and body.sync:
            if body.name == TB_SYNC_NAME and body.durable:
                self.tensorboard_synced = True
        elif isinstance(body, codec.CheckpointEvent) and body.durable:
            self.checkpoint = Checkpoint(body.step or 0, body.bytes, e.time, body.forced)
        else:
            return
        self.version += 1

    def _node_sample(self, attempt: int, t: float, util: float) -> None:
        slot = layout.node_slot(attempt, self.max_nodes)
        series = self.node_util.get(slot)
        if series is None:
            series = self.node_util[slot] = Reduced(self.max_buckets)
            self.node_gaps[slot] = []
        elif self._node_attempt.get(slot) != attempt:
            self.node_gaps[slot].append(t)  # the node's replacement: no line across
        self._node_attempt[slot] = attempt
        series.add(t, util)

    def _metric(self, e: Event) -> None:
        step = e.data.get("step")
        if step is None:
            return
        step = float(step)
        t = float(e.data.get("t") or e.time)
        for name, value in (e.data.get("values") or {}).items():
            if not isinstance(value, (int, float)):
                continue
            series = self.metrics.get(name)
            if series is None:
                series = self.metrics[name] = MetricSeries(name, self.max_buckets)
            series.add(e.attempt, step, float(value), t)

    def _metrics(self, e: Event) -> None:
        """A ``metrics`` batch in bulk, a column at a time: the same as its rows one by
        one (:meth:`_metric`), each series taking its points in order."""
        steps, times, columns = metric_columns(e)
        if len(steps) != len(times):  # a damaged batch: what its rows say, row by row
            for row in expand(e):
                self.first_time = row.time if self.first_time is None else self.first_time
                self.last_time = max(self.last_time, row.time)
                self._add(row)
            return
        if not len(steps):
            return
        step = np.frombuffer(steps, dtype=np.int64).astype(float)
        t = np.frombuffer(times, dtype=float)
        if self.first_time is None:
            self.first_time = float(t[0])
        known = t[~np.isnan(t)]
        if len(known):
            self.last_time = max(self.last_time, float(known.max()))
        for name in metric_names(columns):  # new series in the order the rows name them
            idx, vals = columns[name]
            n = min(len(vals), len(step) if idx is None else len(idx))
            if not n:
                continue
            series = self.metrics.get(name)
            if series is None:
                series = self.metrics[name] = MetricSeries(name, self.max_buckets)
            values = np.frombuffer(vals, dtype=float)[:n]
            rows = slice(0, n) if idx is None else np.frombuffer(idx, dtype=np.int32)[:n]
            series.add_many(e.attempt, step[rows], values, t[rows])
        self.version += len(step)

    # -- the markers: the fold's breaks and resumes ------------------------------------

    @property
    def markers(self) -> list[Marker]:
        """Interruptions, lost instances, retries and resumes, in time order, as the
        fold says them (its breaks: the last step, the steps redone; each resumed
        attempt's first step)."""
        if self._markers is None or self._markers[0] != self.state.changes:
            self._markers = (self.state.changes, _markers(self.state))
        return self._markers[1]

    def write(self, text: str, stderr: bool = False) -> None:
        """Remote output text (may hold partial lines)."""
        parts = (self._partial + text).split("\n")
        self._partial = parts.pop()
        for line in parts:
            self._keep(("\x00" if stderr else "") + _clip(line.split("\r")[-1]))
        self.log_version += 1

    def milestone(self, when: float, text: str) -> None:
        """A line of spotnb's own (interruptions, resumes) between the output lines."""
        import datetime

        clock = datetime.datetime.fromtimestamp(when).strftime("%H:%M:%S")
        self._keep(f"\x01[spotnb {clock}] {text}")
        self.log_version += 1

    def _keep(self, line: str) -> None:
        self.line_count += 1
        if len(self.head) < self._head_lines:
            self.head.append(line)
        else:
            self.lines.append(line)

    @property
    def left_out(self) -> int:
        """Lines written between the first and the last ones kept (none: 0)."""
        return self.line_count - len(self.head) - len(self.lines)

    # -- output --------------------------------------------------------------------

    def sys_points(self, which: Reduced, full: bool = False,
                   gaps: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Utilisation or memory against time, with a NaN where another instance's
        samples start (reduced for display, or every sample with ``full``); ``gaps``:
        where, if not the job's (a node's own series: :attr:`node_gaps`)."""
        gaps = self.sys_gaps if gaps is None else gaps
        if full:
            x, y = which.full.x.copy(), which.full.y.copy()
        else:
            x, y, _t = which.view.points()
        if not gaps or not len(x):
            return x, y
        at = np.searchsorted(x, np.asarray(gaps), side="left")
        nan = np.full(len(at), np.nan)
        return np.insert(x, at, nan), np.insert(y, at, nan)

    def time_to_step(self, times: np.ndarray, held: bool = False) -> np.ndarray:
        """The step the job was at at each of ``times``, for plotting system samples
        against step: interpolated between the logged rows (those of the metric logged
        most often, its redone rows included, so a sample taken while an interrupted
        instance worked on steps later redone maps to those steps). NaN outside the
        rows and between two rows that an instance change separates (an interruption,
        a resume, a new instance's first sample), where no step was being worked on;
        with ``held`` (the times of a step function, such as the world size), the
        nearest step there instead. O(``max_buckets``): it reads the reduced series."""
        times = np.asarray(times, dtype=float)
        out = np.full(len(times), np.nan)
        t, x, bridged = self._step_map()
        if not len(t) or not len(times):
            return out
        if held:
            return np.interp(times, t, x)
        inside = (times >= t[0]) & (times <= t[-1])
        i = np.clip(np.searchsorted(t, times, side="right") - 1, 0, max(len(t) - 2, 0))
        ok = inside & ((times == t[i]) | (times == t[-1]) | (bridged[i] if len(t) > 1
                                                              else True))
        out[ok] = np.interp(times[ok], t, x)
        return out

    def _step_map(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`time_to_step`'s rows ``(time, step)`` in time order, and whether each
        row is bridged to the next; computed once per :attr:`version`."""
        key = (self.version, self.state.changes)
        if self._map is not None and self._map[0] == key:
            return self._map[1]
        series = max(self.metrics.values(), default=None,
                     key=lambda s: len(s.curve) + len(s.redone))
        if series is None:
            empty = np.empty(0)
            return empty, empty, np.empty(0, dtype=bool)
        x, _y, t = series.curve.view.points()
        rx, _ry, rt = series.redone.view.points()
        t, x = np.concatenate([t, rt]), np.concatenate([x, rx])
        known = np.isfinite(t) & np.isfinite(x)
        order = np.argsort(t[known], kind="stable")
        t, x = t[known][order], x[known][order]
        breaks = np.sort(np.asarray([*self.sys_gaps, *(m.time for m in self.markers)],
                                    dtype=float))
        # Rows i and i + 1 are bridged unless a break falls in (t[i], t[i + 1]].
        bridged = np.diff(np.searchsorted(breaks, t, side="right")) == 0
        self._map = (key, (t, x, bridged))
        return t, x, bridged

    @property
    def multinode(self) -> bool:
        """Whether the job may run on several nodes (its utilisation is per node)."""
        return self.max_nodes > 1

    def world_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The world size (processes) against time as a step line's points, held to
        the last event; and the node count at each point."""
        if not self.worlds:
            empty = np.empty(0)
            return empty, empty, empty
        t = [w[0] for w in self.worlds] + [max(self.last_time, self.worlds[-1][0])]
        size = [w[2] for w in self.worlds] + [self.worlds[-1][2]]
        nodes = [w[1] for w in self.worlds] + [self.worlds[-1][1]]
        return np.asarray(t, float), np.asarray(size, float), np.asarray(nodes, float)

    def log_lines(self, gap: str | None = None) -> list[tuple[str, str]]:
        """The panel's lines as (kind, text): kind is stdout, stderr or spotnb.

        ``gap``: where lines were left out between the first and the last ones kept,
        a line of kind ``spotnb`` with this text (``{n}``: how many) is put there.
        """
        out = []
        between = [] if gap is None or not self.left_out else \
            ["\x01" + gap.format(n=f"{self.left_out:,}")]
        for line in [*self.head, *between, *self.lines,
                     *([self._partial] if self._partial else [])]:
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
            "nodes": {k: len(v) for k, v in self.node_util.items()},
            "worlds": len(self.worlds),
            "price": sum(len(p.series) for p in self.pools.values()),
            "markers": len(self.markers),
        }


def _markers(state: JobState) -> list[Marker]:
    """:attr:`DashboardData.markers` of ``state``."""
    out = []
    reasons = dict(state.group_notices)  # instance id -> the group's reason
    for b in state.breaks():
        a = state.attempts[b.attempt]
        if b.reason is EndReason.INTERRUPTED:
            reason = _NOTICE_REASONS.get(reasons.get(str(a.instance), ""),
                                         "spot interruption notice")
            detail = f"{reason} ({a.notice_action})" if a.notice_action else reason
            kind, when = "interrupted", a.notice_time or b.time
        elif b.reason is EndReason.MOVED:
            kind, when = "interrupted", a.notice_time or b.time
            detail = "its warm standby took over"
        elif b.reason is EndReason.ERROR_RETRIED:
            ename = (a.error or {}).get("ename")
            kind, when, detail = "retry", b.time, f"{ename}, retried in place"
        else:
            kind, when = "lost", b.time
            detail = "the instance went away without a notice"
        out.append(Marker(kind, when, b.attempt, step=b.step, redone=b.redone,
                          detail=detail))
    booted = [n for n, a in state.attempts.items() if a.boot_time is not None]
    for a in state.attempts.values():
        if a.boot_time is None or a.number <= (state.max_nodes if state.max_nodes > 1 else 1):
            continue
        where = " ".join(str(p) for p in (a.instance_type, a.az) if p)
        where += f" ({a.instance_id})" if a.instance_id else ""
        how = f"on {where.strip()}"
        before = replaced_attempt(a.number, booted, state.max_nodes)
        if before is not None and state.attempts[before].reason is EndReason.ERROR_RETRIED:
            how = f"retried in place {how}"  # after the error its marker names
        if state.max_nodes > 1:
            how = f"node {layout.node_slot(a.number, state.max_nodes)} replaced, {how}"
        out.append(Marker("resumed", a.boot_time, a.number, step=a.first_step, detail=how))
    return sorted(out, key=lambda m: m.time)


def _clip(line: str) -> str:
    return line if len(line) <= _LINE_CHARS else line[:_LINE_CHARS] + "…"
