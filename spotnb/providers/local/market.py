"""The local cloud's spot market: a pool's price history replayed, time-compressed.

A :class:`Market` maps wall-clock time to *market time*: ``time_scale`` market seconds
pass per real second (default 60, so a day of history replays in 24 minutes). The
history is :func:`spotnb.providers.catalog.price_trace` of the pool; where in it a job starts is
chosen deterministically from a seed (the job id), so different jobs see different
stretches and the same job always sees the same one. At the end the trace loops.

Between two price-change events the price holds, as on EC2. After the last event the
price holds for one typical gap (the median time between changes) before the loop
starts over.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import statistics

from spotnb.providers import catalog
from spotnb.providers.catalog import Pool, PriceTrace

__all__ = ["Market"]

# A change time returned by next_change_after lies this far past the exact instant, so
# price_at() at that time already shows the new price despite float rounding.
_EPSILON = 1e-6


class Market:
    """The spot price of one pool over wall-clock time."""

    def __init__(self, pool: Pool, start_wall: float, time_scale: float, seed: str = "",
                 trace: PriceTrace | None = None) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, not {time_scale}")
        self.pool = pool
        self.start_wall = start_wall
        self.time_scale = time_scale
        self.trace = trace or catalog.price_trace(pool.instance_type, pool.region, pool.az)
        if not self.trace.points:
            raise ValueError(f"empty price trace for {pool.name}")

        # Keep only the points where the price changes; times relative to the first.
        t0 = self.trace.points[0][0]
        self._times: list[float] = []
        self._prices: list[float] = []
        for t, price in self.trace.points:
            if not self._prices or price != self._prices[-1]:
                self._times.append(t - t0)
                self._prices.append(price)
        gaps = [b - a for a, b in itertools.pairwise(self._times)]
        self.period = self._times[-1] + (statistics.median(gaps) if gaps else 1.0)
        # Integral of price over market seconds up to each change (for cost).
        self._cumulative = [0.0]
        for i in range(1, len(self._times)):
            span = self._times[i] - self._times[i - 1]
            self._cumulative.append(self._cumulative[-1] + self._prices[i - 1] * span)
        self._cycle_integral = (self._cumulative[-1]
                                + self._prices[-1] * (self.period - self._times[-1]))

        digest = hashlib.sha256(seed.encode()).digest()
        self.offset = int.from_bytes(digest[:8], "big") / 2**64 * self.period

    def __repr__(self) -> str:
        return f"Market({self.pool.name}, scale={self.time_scale:g}, offset={self.offset:.0f}s)"

    @property
    def source(self) -> str:
        return self.trace.source

    def market_time(self, wall_time: float) -> float:
        """Market seconds since the start of the trace's first cycle (not wrapped)."""
        return self.offset + (wall_time - self.start_wall) * self.time_scale

    def history_time(self, wall_time: float) -> float:
        """The moment of the real history that ``wall_time`` replays (epoch seconds)."""
        return self.trace.points[0][0] + self.market_time(wall_time) % self.period

    def _index(self, position: float) -> int:
        return max(bisect.bisect_right(self._times, position) - 1, 0)

    def price_at(self, wall_time: float) -> float:
        """The spot price (USD/hour) at ``wall_time``."""
        position = self.market_time(wall_time) % self.period
        return self._prices[self._index(position)]

    def next_change_after(self, wall_time: float) -> float | None:
        """The wall time of the next price change after ``wall_time``; None if constant."""
        if len(self._prices) == 1:
            return None
        m = self.market_time(wall_time)
        cycle, position = divmod(m, self.period)
        i = self._index(position) + 1
        if i < len(self._times):
            m_next = cycle * self.period + self._times[i]
        elif self._prices[0] != self._prices[-1]:
            m_next = (cycle + 1) * self.period
        else:  # the loop joins two equal prices: the next change is the second point
            m_next = (cycle + 1) * self.period + self._times[1]
        return self.start_wall + (m_next - self.offset) / self.time_scale + _EPSILON

    def next_above(self, wall_time: float, limit: float) -> float | None:
        """The wall time after ``wall_time`` at which the price first rises above
        ``limit`` (a price change), or None if it never does."""
        t = wall_time
        for _ in range(len(self._times) + 2):  # one cycle holds every price there is
            change = self.next_change_after(t)
            if change is None:
                return None
            if self.price_at(change) > limit:
                return change
            t = change
        return None

    def cost(self, start_wall: float, end_wall: float) -> float:
        """USD for one instance running from ``start_wall`` to ``end_wall`` (real seconds
        at the market's price per hour)."""
        if end_wall <= start_wall:
            return 0.0
        market_seconds = self._integral(self.market_time(end_wall)) - self._integral(
            self.market_time(start_wall))
        # price x market seconds / scale = price x real seconds; per hour -> / 3600.
        return market_seconds / self.time_scale / 3600.0

    def _integral(self, m: float) -> float:
        cycle, position = divmod(m, self.period)
        i = self._index(position)
        partial = self._cumulative[i] + self._prices[i] * (position - self._times[i])
        return cycle * self._cycle_integral + partial
