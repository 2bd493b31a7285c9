"""Series of bounded size, for the dashboard's plots: every series is kept twice, in
full (:class:`Column`, growable numpy arrays of x, y and the wall-clock time of each
point, for the final figure and for recomputing a curve after an interruption) and
reduced for display (:class:`MinMaxBuckets`): an incremental min/max per bucket of
consecutive points, at most ``2 * max_buckets`` points however long the run. Adding a
point costs O(1) amortised and reading the reduced series O(max_buckets), so an update
of the plots costs the same at 1k and at 1M logged steps
(``benchmarks/bench_dashboard.py``). A ``metrics`` batch goes in a column at a time,
whole buckets at once in numpy: re-attaching to a day-long job replays its million
rows in a fraction of a second.

A metric's curve (:class:`MetricSeries`) is made of *segments*, one per attempt that
logged it: where the replacement instance took over, :meth:`MetricSeries.points` puts a
gap (NaN), so a line is never drawn across the time between two instances. What the
dashboard derives from a job's events is :mod:`spotnb.widgets.series`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DEFAULT_BUCKETS", "Column", "MetricSeries", "MinMaxBuckets", "Reduced"]

#: Points per displayed trace are at most twice this (a min and a max per bucket):
#: enough for a curve's shape on any screen, few enough for a fast update message.
DEFAULT_BUCKETS = 1000


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
