"""Cost of a dashboard update as a run grows: bytes per update and Python time.

Run by hand: ``python benchmarks/bench_dashboard.py [updates]``. For runs of 1k, 100k
and 1M logged steps (one metric, ``loss``, plus a CPU sample every 100 steps), the
dashboard is fed the whole history, then timed over ``updates`` live updates of 100
new steps each: ``Dashboard.events`` + ``Dashboard.flush`` (what the follow loop does
at most every ``FLUSH_SECONDS``), with the widgets talking to a recording comm (no
kernel) that weighs every message: JSON plus binary buffers.

The second table compares ways to reduce a series for display, per update, on the
same data: the incremental min/max buckets the dashboard uses (the work is per new
point), a numpy min/max per bucket recomputed over the whole series, and
``tsdownsample``'s MinMaxLTTB (Rust) recomputed over the whole series, when installed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import comm
import numpy as np

from spotnb.protocol.events import Event
from spotnb.widgets import plots
from spotnb.widgets.dashboard import Dashboard
from spotnb.widgets.series import DEFAULT_BUCKETS, MinMaxBuckets

SIZES = (1_000, 100_000, 1_000_000)
UPDATES = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 50
NEW_STEPS = 100
T0 = 1_800_000_000.0


class Recorder:
    """A comm that weighs what it sends."""

    kernel = "recording"
    sent: list[int] = []

    def __init__(self, **_kw: Any) -> None:
        self.comm_id = f"c{id(self):x}"

    def send(self, data: Any = None, buffers: Any = None, **_kw: Any) -> None:
        Recorder.sent.append(len(json.dumps(data, default=str))
                             + sum(memoryview(b).nbytes for b in buffers or ()))

    def on_msg(self, *_a: Any) -> None: ...
    def on_close(self, *_a: Any) -> None: ...
    def close(self, *_a: Any, **_k: Any) -> None: ...


def loss(step: int) -> float:
    """Falls at every step: each update changes the last bucket, so every update
    sends the curve (the worst case; a flat stretch sends nothing)."""
    return 1.0 / (1.0 + step) ** 0.5


def events(first: int, count: int) -> list[Event]:
    out = []
    for step in range(first, first + count):
        out.append(Event("metric", T0 + step * 0.1, 1, "i-1",
                         {"step": step, "values": {"loss": loss(step)}}))
        if step % 100 == 0:
            out.append(Event("sys", T0 + step * 0.1, 1, "i-1",
                             {"kind": "cpu", "util": 90.0, "mem_used": 1 << 30,
                              "mem_total": 8 << 30}))
    return out


def record_comms() -> None:
    """Make every widget talk to a :class:`Recorder` (no kernel)."""
    comm.create_comm = lambda **kw: Recorder(**kw)  # type: ignore[assignment]


def bench_dashboard(steps: int, updates: int = UPDATES) -> dict[str, float]:
    """Median bytes, messages and Python ms of ``updates`` live updates of a dashboard
    fed ``steps`` steps first (needs :func:`record_comms`)."""
    board = Dashboard(show=False, flush_seconds=0.0, static_copy=False)
    for first in range(0, steps, 50_000):
        board.data.add(events(first, min(50_000, steps - first)))
    board.stream("stdout", "".join(f"line {i}\n" for i in range(300)))
    board.flush()
    sizes, seconds, counts = [], [], []
    for u in range(updates):
        batch = events(steps + u * NEW_STEPS, NEW_STEPS)
        board.stream("stdout", f"step {steps + u * NEW_STEPS}\n")
        Recorder.sent = []
        started = time.perf_counter()
        board.events(batch)
        board.flush()
        seconds.append(time.perf_counter() - started)
        sizes.append(sum(Recorder.sent))
        counts.append(len(Recorder.sent))
    return {"bytes": statistics.median(sizes), "ms": 1000 * statistics.median(seconds),
            "messages": statistics.median(counts),
            "points": len(plots.values(board.figure.trace("loss"), "x"))}


def bench_reduction(steps: int) -> dict[str, float | None]:
    x = np.arange(steps, dtype=float)
    y = 1.0 / (1.0 + x) ** 0.5
    incremental = MinMaxBuckets()
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        incremental.add(xi, yi)
    new_x = np.arange(steps, steps + NEW_STEPS, dtype=float)

    def time_it(func: Any) -> float:
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            func()
            runs.append(time.perf_counter() - started)
        return 1000 * statistics.median(runs)

    def incremental_update() -> None:
        for xi in new_x.tolist():
            incremental.add(xi, 0.5)
        incremental.points()

    def numpy_full() -> None:
        n = len(y) // DEFAULT_BUCKETS * DEFAULT_BUCKETS
        if n == 0:
            return
        view = y[:n].reshape(DEFAULT_BUCKETS, -1)
        view.argmin(axis=1)
        view.argmax(axis=1)

    out: dict[str, float | None] = {"incremental": time_it(incremental_update),
                                    "numpy_full": time_it(numpy_full), "tsdownsample": None}
    try:
        from tsdownsample import MinMaxLTTBDownsampler
    except ImportError:
        return out
    sampler = MinMaxLTTBDownsampler()
    n_out = min(2 * DEFAULT_BUCKETS, steps)
    out["tsdownsample"] = time_it(lambda: sampler.downsample(x, y, n_out=n_out))
    return out


def main() -> None:
    record_comms()
    rows = [(steps, bench_dashboard(steps), bench_reduction(steps)) for steps in SIZES]
    print(f"dashboard update ({NEW_STEPS} new steps + flush), median of {UPDATES}; "
          f"'x 1k': against the {SIZES[0]:,}-step run, measured in the same run:")
    print(f"{'logged steps':>14} {'bytes/update':>13} {'x 1k':>6} {'messages':>9} "
          f"{'ms/update':>10} {'x 1k':>6} {'loss points sent':>17}")
    base = rows[0][1]
    for steps, d, _r in rows:
        print(f"{steps:>14,} {d['bytes']:>13,.0f} {d['bytes'] / base['bytes']:>6.2f} "
              f"{d['messages']:>9.0f} {d['ms']:>10.2f} {d['ms'] / base['ms']:>6.2f} "
              f"{d['points']:>17,.0f}")
    print("\nreducing the loss series for display (ms per update, median of 5):")
    print(f"{'logged steps':>14} {'incremental':>12} {'numpy full':>11} {'tsdownsample':>13}")
    for steps, _d, r in rows:
        ts = f"{r['tsdownsample']:.2f}" if r["tsdownsample"] is not None else "n/a"
        print(f"{steps:>14,} {r['incremental']:>12.3f} {r['numpy_full']:>11.3f} {ts:>13}")


if __name__ == "__main__":
    main()
