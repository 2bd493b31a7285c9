"""Re-attaching replays a job's history a batch at a time, with the figures that taking
its rows one by one gives.

A day of metrics is a million rows; the fold (:class:`~spotnb.protocol.events.fold.JobState`,
its steps: :mod:`spotnb.protocol.events.steps`), the view
(:class:`~spotnb.client.display.JobView`) and the dashboard's series
(:class:`~spotnb.widgets.series.DashboardData`) take a ``metrics`` batch in bulk. These
tests feed the same random runs (several attempts, redone steps, metrics only some rows
have, NaNs and ties, late rows of an ended attempt, times out of order, batches split
anywhere and merged by compaction) row by row and as batches, and compare everything a
display shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from typing import Any

import pytest

from spotnb.client import display
from spotnb.client.display import JobView
from spotnb.protocol.events import Event, expand, merge_metrics, metrics_data
from spotnb.protocol.events.fold import JobState, fold
from spotnb.protocol.events.steps import Steps

np = pytest.importorskip("numpy")
series = pytest.importorskip("spotnb.widgets.series")

T0 = 1_800_000_000.0
SEEDS = range(40)


def _value(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.08:
        return math.nan
    if roll < 0.1:
        return rng.choice([math.inf, -math.inf])
    return float(rng.randint(0, 6))  # few distinct values: ties in every bucket


def random_run(rng: random.Random) -> list[Event]:
    """A job's events with one ``metric`` event per row, as a row reader sees them."""
    events: list[Event] = []
    t = T0
    last_step = -1
    pending_late: list[Event] = []
    attempts = rng.randint(1, 4)
    for attempt in range(1, attempts + 1):
        t += rng.uniform(1, 30)
        events.append(Event("status", t, attempt, f"i-{attempt}",
                            {"state": "booting", "detail": f"attempt {attempt}",
                             "instance_type": "g4dn.xlarge"}))
        # A replacement resumes at or before the step its predecessor reached.
        step = 0 if last_step < 0 else max(0, last_step - rng.randint(0, 40))
        rows = []
        for _ in range(rng.randint(0, 300)):
            t += rng.choice([0.0, 0.5, 1.0, 7.0, 70.0]) if rng.random() > 0.01 else -5.0
            values = {}
            if rng.random() < 0.9:
                values["loss"] = _value(rng)
            if rng.random() < 0.3:
                values["acc"] = _value(rng)
            if rng.random() < 0.03:
                values["lr"] = _value(rng)
            rows.append(Event("metric", t, attempt, f"i-{attempt}",
                              {"step": step, "t": t, "values": values}))
            step += 1 if rng.random() > 0.02 else rng.choice([0, -3])
            if rng.random() < 0.05:
                events.append(Event("sys", t, attempt, f"i-{attempt}",
                                    {"kind": "cpu", "util": 50.0, "mem_used": 1,
                                     "mem_total": 4}))
        # Some of an ended attempt's last rows arrive after the next attempt's first.
        late = rng.randint(0, min(10, len(rows))) if attempt < attempts else 0
        cut = len(rows) - late
        first_rows = rows[:rng.randint(0, 5)] if pending_late else []
        events += first_rows + pending_late + rows[len(first_rows):cut]
        pending_late = rows[cut:]
        if rows:
            last_step = max(last_step, max(int(r.data["step"]) for r in rows))
        ending = rng.choice(["notice", "lost", "retry"]) if attempt < attempts else "done"
        if ending == "notice":
            events.append(Event("notice", t, attempt, f"i-{attempt}",
                                {"kind": "instance-action", "action": "terminate",
                                 "notice_time": "2027-01-15T08:00:00Z"}))
        elif ending == "retry":
            events.append(Event("error", t, attempt, f"i-{attempt}",
                                {"ename": "ValueError", "evalue": "x", "retrying": True}))
    events += pending_late
    events.append(Event("result", t + 1, attempts, f"i-{attempts}",
                        {"status": "completed", "reason": "the cell finished"}))
    return events


def as_batches(rng: random.Random, events: list[Event]) -> list[Event]:
    """Consecutive rows of one attempt as ``metrics`` batches split anywhere, some of
    them merged (as compaction rolls a segment's batches into one)."""
    out: list[Event] = []
    run: list[Event] = []
    n = 0

    def close() -> None:
        nonlocal n
        while run:
            size = rng.randint(1, len(run))
            part, run[:] = run[:size], run[size:]
            n += 1
            batch = Event("metrics", part[-1].time, part[0].attempt, part[0].instance,
                          metrics_data((r.data["step"], r.data["t"], r.data["values"])
                                       for r in part), n=n)
            if out and out[-1].type == "metrics" and out[-1].attempt == batch.attempt \
                    and rng.random() < 0.5:
                out[-1] = merge_metrics([out[-1], batch])
            else:
                out.append(batch)

    for e in events:
        if e.type == "metric" and run and run[-1].attempt != e.attempt:
            close()
        if e.type == "metric":
            run.append(e)
        else:
            close()
            out.append(e)
    close()
    return out


def runs() -> list[tuple[int, list[Event], list[Event]]]:
    """(seed, the run as rows, the same run as batches)."""
    out = []
    for seed in SEEDS:
        rng = random.Random(seed)
        batched = as_batches(rng, random_run(rng))
        rows = [row for e in batched for row in expand(e)]  # what a row reader gets
        out.append((seed, rows, batched))
    return out


def test_the_random_runs_have_what_the_tests_are_about() -> None:
    """The runs hold interruptions with redone steps, late rows, sparse metrics, NaNs,
    times out of order, and batches of many rows: a test that cannot fail is no test."""
    kinds: set[str] = set()
    for _seed, rows, batched in runs():
        if fold(rows).redone_steps():
            kinds.add("redone")
        metric_rows = [e for e in rows if e.type == "metric"]
        if any(a.attempt > b.attempt for a, b in itertools.pairwise(metric_rows)):
            kinds.add("late rows")
        if any(a.data["t"] > b.data["t"] for a, b in itertools.pairwise(metric_rows)
               if a.attempt == b.attempt):
            kinds.add("times out of order")
        if any("acc" in e.data["values"] and "loss" not in e.data["values"]
               for e in metric_rows):
            kinds.add("sparse")
        if any(math.isnan(v) for e in metric_rows for v in e.data["values"].values()):
            kinds.add("nan")
        if any(e.type == "metrics" and e.data["rows"] > 100 for e in batched):
            kinds.add("long batches")
        if any("merged" in e.data for e in batched if e.type == "metrics"):
            kinds.add("merged")
    assert kinds == {"redone", "late rows", "times out of order", "sparse", "nan",
                     "long batches", "merged"}


# -- the reduced series --------------------------------------------------------------

def _state(b: Any) -> tuple[Any, ...]:
    return b.width, b.count, b._nb, b._b[:, :b._nb].tobytes()


@pytest.mark.parametrize("seed", SEEDS)
def test_min_max_buckets_extend_keeps_what_add_keeps(seed: int) -> None:
    """Whole buckets at a time pick the points that adding them one by one picks: the
    first minimum and the first maximum, never a NaN over a number (a bucket of NaNs
    and infinities too), merging as buckets run out."""
    rng = random.Random(seed)
    buckets = rng.choice([2, 4, 8, 16])
    n = rng.randint(0, 600)
    y = [_value(rng) for _ in range(n)]
    if rng.random() < 0.3:  # runs of NaN and infinities, whole buckets of them
        for i in range(0, n, 7):
            y[i:i + rng.randint(1, 9)] = [rng.choice([math.nan, math.inf, -math.inf])] * 9
        y = y[:n]
    x = np.arange(n, dtype=float)
    t = x * 2 + 0.5
    one, bulk = series.MinMaxBuckets(buckets), series.MinMaxBuckets(buckets)
    for xi, yi, ti in zip(x.tolist(), y, t.tolist(), strict=True):
        one.add(xi, yi, ti)
    ys = np.array(y, dtype=float)
    i = 0
    while i < n:
        k = rng.randint(1, 80)
        bulk.extend(x[i:i + k], ys[i:i + k], t[i:i + k])
        i += k
    assert _state(bulk) == _state(one)
    for a, b in zip(bulk.points(), one.points(), strict=True):
        assert np.array_equal(a, b, equal_nan=True)


# -- the dashboard's data, the progress and the view -----------------------------------

def _points(s: Any) -> list[bytes]:
    full = s.curve.full
    redone = s.redone.full
    return [a.tobytes() for a in (*s.points(), *s.points(full=True), redone.x, redone.y,
                                  redone.t, *s.redone.view.points())] + [full.n]


def _dashboard(data: Any) -> dict[str, Any]:
    return {
        "names": data.metric_names(),
        "series": {name: (_points(s), s.gaps, s.starts, s.attempt, s.last_step)
                   for name, s in data.metrics.items()},
        "markers": [dataclasses.asdict(m) for m in data.markers],
        "times": (data.first_time, data.last_time),
        "version": data.version,
        "sys": data.util.full.x.tobytes(),
    }


@pytest.mark.parametrize(("seed", "rows", "batched"), runs(), ids=[f"seed{s}" for s in SEEDS])
def test_dashboard_data_takes_batches_as_their_rows(seed: int, rows: list[Event],
                                                    batched: list[Event]) -> None:
    by_rows, by_batches = series.DashboardData(max_buckets=8), series.DashboardData(8)
    for e in rows:
        by_rows.add([e])
    by_batches.add(batched)
    assert _dashboard(by_batches) == _dashboard(by_rows)


def _steps(steps: Steps) -> dict[str, Any]:
    return {"summary": steps.summary(), "rate": steps.rate(), "window": list(steps._window),
            "segments": [(s.attempt, s.first_step, s.first_time, s.last_step, s.last_time,
                          s.furthest, s.furthest_time, s.passed) for s in steps.segments]}


def _fold(state: JobState, now: float) -> dict[str, Any]:
    return {"steps": _steps(state.steps), "breaks": state.breaks(),
            "lost": (state.lost_windows(now), state.lost_usd(now)),
            "attempts": repr([dataclasses.asdict(a) for a in state.attempts.values()])}


@pytest.mark.parametrize(("seed", "rows", "batched"), runs(), ids=[f"seed{s}" for s in SEEDS])
def test_fold_and_view_take_batches_as_their_rows(seed: int, rows: list[Event],
                                                      batched: list[Event]) -> None:
    views = []
    for events in (rows, batched):
        view = JobView(job_id="job-1", name="replay", created=T0)
        for e in events:
            view.apply(e)
        views.append(view)
    by_rows, by_batches = views
    now = rows[-1].time + 10
    assert _fold(by_batches.folded, now) == _fold(by_rows.folded, now)
    assert by_batches.step == by_rows.step
    assert repr(list(by_batches.metrics.items())) == repr(list(by_rows.metrics.items()))
    for view in views:
        view.now = now
    assert display.status_lines(by_batches) == display.status_lines(by_rows)


@pytest.mark.parametrize("scan", [False, True])
def test_the_steps_take_rows_in_bulk_at_any_split(scan: bool) -> None:
    """A batch of rows leaves the fold's steps as its rows one by one do, wherever the
    run is split: the segments (and, a multi-node job's, where steps go back within an
    attempt), the pace's window, the redone steps, when the job caught up."""
    rng = random.Random(7)
    for _ in range(200):
        s_rows, s_bulk = Steps(scan), Steps(scan)
        for attempt in (1, 2, 3):
            steps = [rng.randint(0, 50) + i for i in range(rng.randint(0, 60))]
            times = [T0 + rng.uniform(0, 300) for _ in steps]
            if rng.random() < 0.7:  # as logged; else out of order (clocks, hand-made logs)
                times.sort()
            rows = [Event("metric", t, attempt, "i", {"step": st, "t": t, "values": {}})
                    for st, t in zip(steps, times, strict=True)]
            for row in rows:
                s_rows.add(row)
            i = 0
            while i < len(rows):
                k = rng.randint(1, 30)
                part = rows[i:i + k]
                s_bulk.add(Event("metrics", part[-1].time, attempt, "i", metrics_data(
                    (r.data["step"], r.data["t"], {}) for r in part)))
                i += k
        assert _steps(s_bulk) == _steps(s_rows)


def _batch(attempt: int, n: int, rows: list[tuple[int, dict[str, float]]]) -> Event:
    return Event("metrics", T0 + n, attempt, f"i-{attempt}",
                 metrics_data((step, T0 + n + i, values) for i, (step, values)
                              in enumerate(rows)), n=n)


def test_a_batch_whose_columns_are_not_in_row_order_adds_metrics_in_row_order() -> None:
    """A batch stores its columns in any order (a hand-made log): the view and the
    panels still list metrics in the order the rows name them."""
    batch = _batch(1, 1, [(0, {"acc": 0.5}), (1, {"loss": 2.0, "acc": 0.6})])
    batch.data["values"] = {"loss": batch.data["values"]["loss"],
                            "acc": batch.data["values"]["acc"]}
    rows = expand(batch)
    assert [list(r.data["values"]) for r in rows] == [["acc"], ["loss", "acc"]]
    view_rows, view_batch = (JobView(job_id="j", name="n", created=T0) for _ in range(2))
    data_rows, data_batch = series.DashboardData(), series.DashboardData()
    for e in rows:
        view_rows.apply(e)
        data_rows.add([e])
    view_batch.apply(batch)
    data_batch.add([batch])
    assert list(view_batch.metrics.items()) == list(view_rows.metrics.items()) \
        == [("acc", 0.6), ("loss", 2.0)]
    assert data_batch.metric_names() == data_rows.metric_names() == ["loss", "acc"]
    assert list(data_batch.metrics) == list(data_rows.metrics) == ["acc", "loss"]


def test_redone_steps_are_the_folds_from_the_first_row() -> None:
    """The replacement's first row tells how many steps were redone (the fold's rule:
    its step against the furthest before), whatever the points it moved off each
    metric's curve, as rows and as batches."""
    first = _batch(1, 1, [(0, {"loss": 1.0, "acc": 1.0}), (1, {"acc": 1.0}),
                          (1, {"acc": 1.0}), (1, {"acc": 1.0}), (1, {"loss": 1.0})])
    notice = Event("notice", T0 + 20, 1, "i-1", {"kind": "instance-action",
                                                 "action": "terminate"})
    boot = Event("status", T0 + 30, 2, "i-2", {"state": "booting"})
    second = _batch(2, 40, [(1, {"loss": 0.5}), (1, {"acc": 0.5}), (2, {"loss": 0.4})])
    events = [Event("status", T0, 1, "i-1", {"state": "booting"}), first, notice, boot,
              second]
    by_rows, by_batches = series.DashboardData(), series.DashboardData()
    by_rows.add([row for e in events for row in expand(e)])
    by_batches.add(events)
    assert [m.redone for m in by_batches.markers] == [m.redone for m in by_rows.markers] \
        == [1, None]
    assert _dashboard(by_batches) == _dashboard(by_rows)


@pytest.mark.parametrize(("seed", "rows", "batched"), runs(), ids=[f"seed{s}" for s in SEEDS])
def test_a_records_curves_are_those_of_the_rows(seed: int, rows: list[Event],
                                                batched: list[Event]) -> None:
    """A record's curves (each metric against step as it finally stands, NaN as None)
    from batches are those from the rows."""
    from spotnb.records.summary import Curves

    by_rows, by_batches = Curves(), Curves()
    by_rows.add(rows)
    by_batches.add(batched)
    assert repr(by_batches.thinned()) == repr(by_rows.thinned())


def test_a_damaged_batch_reads_as_its_rows() -> None:
    """A batch whose columns disagree in length (a hand-edited log) shows what its
    rows say, as before."""
    batch = _batch(1, 1, [(0, {"loss": 1.0}), (1, {"loss": 0.5}), (2, {"loss": 0.25})])
    batch.data["t"] = metrics_data([(0, T0, {}), (1, T0 + 1, {})])["t"]
    rows = expand(batch)
    assert len(rows) == 2
    views = [JobView(job_id="j", name="n", created=T0) for _ in range(2)]
    boards = [series.DashboardData(), series.DashboardData()]
    for e in rows:
        views[0].apply(e)
        boards[0].add([e])
    views[1].apply(batch)
    boards[1].add([batch])
    assert views[1].step == views[0].step == 1
    assert views[1].metrics == views[0].metrics == {"loss": 0.5}
    assert _dashboard(boards[1]) == _dashboard(boards[0])
    from spotnb.records.summary import Curves

    curves = []
    for events in ([batch], rows):
        curves.append(Curves())
        curves[-1].add(events)
    assert curves[0].thinned() == curves[1].thinned() == (
        {"loss": {"step": [0, 1], "value": [1.0, 0.5]}}, [])
