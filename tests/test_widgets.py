"""The dashboard and the picker without a kernel: widgets talk to a recording comm.

As in ipywidgets' own tests (``DummyComm``), ``comm.create_comm`` is swapped for a fake
that records every message with its binary buffers, so a test can count the messages
an update sends, weigh them, and check the throttle, on a fake clock.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import wait_until

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import comm

from spotnb.client import comparison, display
from spotnb.client.display import JobView
from spotnb.protocol.events import Event, merge_metrics, metrics_data
from spotnb.widgets import dashboard as dashboard_mod
from spotnb.widgets import plots, series, static
from spotnb.widgets.compare import Comparison
from spotnb.widgets.dashboard import Dashboard, DetachRequested
from spotnb.widgets.header import header_html
from spotnb.widgets.picker import (
    COLUMNS,
    DEFAULT_COLUMNS,
    InstancePicker,
    PickerRow,
    estimate,
    picker_rows,
    train_line,
)


class RecordingComm:
    """A comm that keeps what it is asked to send: ``(data, buffers)`` per message."""

    kernel = "a truthy kernel"  # ipywidgets sends only when the comm has a kernel

    def __init__(self, **kwargs: Any) -> None:
        self.comm_id = f"comm-{id(self):x}"
        self.opened = (kwargs.get("data"), kwargs.get("buffers") or [])
        self.messages: list[tuple[dict[str, Any], list[Any]]] = []

    def send(self, data: Any = None, buffers: Any = None, **_kw: Any) -> None:
        self.messages.append((data, list(buffers or [])))

    def on_msg(self, *_a: Any) -> None: ...
    def on_close(self, *_a: Any) -> None: ...
    def open(self, *_a: Any, **_k: Any) -> None: ...
    def close(self, *_a: Any, **_k: Any) -> None: ...


def display_view_mime(data: dict[str, Any]) -> bool:
    return "application/vnd.jupyter.widget-view+json" in data


def size(message: tuple[dict[str, Any], list[Any]]) -> int:
    """Bytes of a message: its JSON plus its binary buffers."""
    data, buffers = message
    return len(json.dumps(data, default=str)) + sum(memoryview(b).nbytes for b in buffers)


class Recorder:
    def __init__(self) -> None:
        self.comms: list[RecordingComm] = []

    def create(self, **kwargs: Any) -> RecordingComm:
        c = RecordingComm(**kwargs)
        self.comms.append(c)
        return c

    def mark(self) -> dict[int, int]:
        return {id(c): len(c.messages) for c in self.comms}

    def since(self, mark: dict[int, int]) -> list[tuple[dict[str, Any], list[Any]]]:
        return [m for c in self.comms for m in c.messages[mark.get(id(c), 0):]]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(comm, "create_comm", rec.create)
    yield rec


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


T0 = 1_800_000_000.0


def metrics(first: int, count: int, attempt: int = 1, **extra: float) -> list[Event]:
    return [Event("metric", T0 + step, attempt, f"i-{attempt}",
                  {"step": step, "t": T0 + step,
                   "values": {"loss": 1.0 / (step + 1), **extra}})
            for step in range(first, first + count)]


def sys_sample(when: float, attempt: int = 1, kind: str = "cpu") -> Event:
    return Event("sys", T0 + when, attempt, f"i-{attempt}",
                 {"kind": kind, "util": 80.0, "mem_used": 2 << 30, "mem_total": 8 << 30})


def fake_handle(provider: str = "local", max_price: float | None = None) -> Any:
    calls: list[str] = []
    spec = types.SimpleNamespace(provider=provider, job_id="job-1", name="test",
                                 resources=types.SimpleNamespace(
                                     max_price=max_price, min_nodes=1, max_nodes=1))
    return types.SimpleNamespace(
        spec=spec, job_id="job-1", calls=calls,
        stop=lambda reason: calls.append(f"stop {reason}"),
        interrupt=lambda: calls.append("interrupt"))


def dashboard(clock: FakeClock | None = None, **kwargs: Any) -> Dashboard:
    board = Dashboard(clock=clock or FakeClock(), show=False, **kwargs)
    board.start(fake_handle())
    return board


def interrupted_run(board: Dashboard) -> None:
    """Attempt 1 logs steps 0-59, checkpoints at 49, is interrupted; attempt 2 resumes
    at 50, so steps 50-59 were redone."""
    board.events(interrupted_events())


def as_batch(e: Event) -> Event:
    """A ``metric`` event as the one-row ``metrics`` batch an agent writes."""
    return Event("metrics", e.time, e.attempt, e.instance,
                 metrics_data([(e.data["step"], e.data["t"], e.data["values"])]), n=e.n)


def interrupted_events() -> list[Event]:
    """The events of :func:`interrupted_run`."""
    return [
        Event("instance", T0, 0, "i-1", {"action": "launched", "pool": "g4dn.xlarge@a",
                                         "instance_id": "i-1", "price": 0.2,
                                         "ondemand": 0.5}),
        Event("price", T0 + 1, 0, "i-1", {"pool": "g4dn.xlarge@a", "price": 0.2,
                                          "history_time": "2020-01-12T14:00:00+00:00",
                                          "history_scale": 60.0}),
        Event("status", T0 + 1, 1, "i-1", {"state": "booting"}),
        *metrics(0, 50),
        Event("checkpoint", T0 + 50, 1, "i-1", {"phase": "durable", "step": 49,
                                                "bytes": 4096, "forced": False}),
        *metrics(50, 10),
        sys_sample(55),
        Event("instance", T0 + 60, 0, "i-1", {"action": "notice", "instance_id": "i-1",
                                              "reason": "requested"}),
        Event("notice", T0 + 60, 1, "i-1", {"kind": "instance-action",
                                            "action": "terminate"}),
        Event("instance", T0 + 62, 0, "i-2", {"action": "launched", "instance_id": "i-2",
                                              "pool": "g4dn.xlarge@a", "price": 0.2,
                                              "ondemand": 0.5}),
        Event("status", T0 + 70, 2, "i-2", {"state": "booting",
                                            "instance_type": "g4dn.xlarge", "az": "a"}),
        *[Event("metric", T0 + 80 + s, 2, "i-2", {"step": s, "t": T0 + 80 + s,
                                                  "values": {"loss": 0.5}})
          for s in range(50, 100)],
        sys_sample(120, attempt=2),
    ]


# -- the series --------------------------------------------------------------------------

def test_min_max_buckets_bound_the_points_and_keep_the_extremes() -> None:
    buckets = series.MinMaxBuckets(max_buckets=500)
    x = np.arange(1_000_000, dtype=float)
    y = np.sin(x / 5000.0)
    y[123_457] = 9.0  # a spike a stride would miss
    y[876_543] = -9.0
    for xi, yi in zip(x, y, strict=True):
        buckets.add(float(xi), float(yi), float(xi) + 0.5)
    px, py, pt = buckets.points()
    assert len(px) <= 1000
    assert np.all(np.diff(px) >= 0)  # in x order
    assert 9.0 in py and -9.0 in py
    assert px[np.argmax(py)] == 123_457
    assert np.array_equal(pt, px + 0.5)  # each kept point keeps its own time


def test_a_resumed_attempt_moves_the_lost_steps_and_breaks_the_line() -> None:
    s = series.MetricSeries("loss")
    for step in range(60):
        s.add(1, step, 1.0, T0 + step)
    moved = 0
    for step in range(50, 70):
        moved = max(moved, s.add(2, step, 2.0, T0 + 100 + step))
    assert moved == 10
    assert list(s.redone.full.x) == list(range(50, 60))
    assert list(s.curve.full.x) == list(range(70))
    assert list(s.curve.full.y[48:52]) == [1.0, 1.0, 2.0, 2.0]
    x, y, t = s.points()
    gap = int(np.flatnonzero(np.isnan(y))[0])
    assert (x[gap - 1], x[gap + 1]) == (49, 50)  # no line from attempt 1 to attempt 2
    assert t[gap + 1] - t[gap - 1] > 100


def test_late_rows_of_an_ended_attempt_go_where_they_belong() -> None:
    """A follower may read an ended attempt's last rows from the log after the next
    attempt's live ones: those from the step the next attempt resumed at are redone,
    the others fill in the curve, and the interruption learns the steps redone."""
    data = series.DashboardData()
    data.add([*metrics(0, 52),
              Event("notice", T0 + 60, 1, "i-1", {"kind": "instance-action"}),
              Event("status", T0 + 70, 2, "i-2", {"state": "booting"}),
              *[Event("metric", T0 + 80 + s, 2, "i-2",
                      {"step": s, "t": T0 + 80 + s, "values": {"loss": 0.5}})
                for s in range(55, 100)],
              *metrics(52, 8)])  # attempt 1's steps 52-59, read late
    loss = data.metrics["loss"]
    assert list(loss.redone.view.points()[0]) == [55, 56, 57, 58, 59]
    x, y, _ = loss.points()
    assert list(x[np.isfinite(x)]) == list(range(100))
    assert list(y[np.isfinite(x)][52:56]) == [1 / 53, 1 / 54, 1 / 55, 0.5]
    (interrupted,) = [m for m in data.markers if m.kind == "interrupted"]
    assert (interrupted.step, interrupted.redone) == (59, 5)


def test_an_attempt_retried_in_place_after_an_error_is_marked_so() -> None:
    """The resume marker of an attempt that followed a user-code error retried in place
    says so (the fold's word: the attempt before ended with the error retried), and
    one after an interruption says where it runs."""
    data = series.DashboardData()
    data.add([Event("status", T0, 1, "i-1", {"state": "booting"}),
              *metrics(0, 10),
              Event("error", T0 + 20, 1, "i-1",
                    {"ename": "ValueError", "evalue": "x", "retrying": True}),
              Event("status", T0 + 21, 2, "i-1",
                    {"state": "booting", "instance_type": "g5.xlarge"}),
              Event("notice", T0 + 40, 2, "i-1", {"kind": "instance-action"}),
              Event("status", T0 + 60, 3, "i-2",
                    {"state": "booting", "instance_type": "g5.xlarge"})])
    resumed = {m.attempt: m.detail for m in data.markers if m.kind == "resumed"}
    assert resumed == {2: "retried in place on g5.xlarge (i-1)",
                       3: "on g5.xlarge (i-2)"}
    (retry,) = [m for m in data.markers if m.kind == "retry"]
    assert retry.detail == "ValueError, retried in place"


def test_smoothing_is_a_debiased_moving_average_that_keeps_gaps() -> None:
    flat = plots.ema(np.full(20, 3.0), 0.9)
    assert np.allclose(flat, 3.0)  # no start-up bias
    noisy = np.array([0.0, 10.0] * 50)
    smooth = plots.ema(noisy, 0.9)
    assert np.ptp(smooth[-20:]) < np.ptp(noisy[-20:]) / 5
    gapped = plots.ema(np.array([1.0, np.nan, 1.0]), 0.5)
    assert np.isnan(gapped[1]) and gapped[2] == pytest.approx(1.0)
    assert plots.ema(noisy, 0.0) is noisy


# -- the dashboard: messages and their cost --------------------------------------------

def figure_comm(board: Dashboard) -> RecordingComm:
    return board.figure.comm  # type: ignore[no-any-return]


def traces(board: Dashboard) -> list[dict[str, Any]]:
    return list(board.figure.plot_data)


def trace(board: Dashboard, name: str, axis: str | None = None) -> dict[str, Any]:
    return board.figure.trace(name, axis)


def xs(t: dict[str, Any]) -> np.ndarray:
    return plots.values(t, "x")


def ys(t: dict[str, Any]) -> np.ndarray:
    return plots.values(t, "y")


def test_an_update_is_one_figure_message_with_numpy_buffers(recorder: Recorder) -> None:
    board = dashboard()
    board.events([*metrics(0, 1000), sys_sample(1)])
    board.flush()
    comm_ = figure_comm(board)
    mark = len(comm_.messages)
    board.events([*metrics(1000, 500), sys_sample(2)])
    board.flush()
    (message,) = comm_.messages[mark:]
    data, buffers = message
    assert sorted(data["state"]) == ["plot_data"]  # the layout did not change
    assert buffers, "numpy arrays must travel as binary buffers, not JSON lists"
    assert len(json.dumps(data)) < 20_000  # the numbers are in the buffers
    assert len(ys(trace(board, "loss"))) == 1500


def test_the_figure_needs_no_plotly_bundle_of_its_own() -> None:
    # The front end draws with the plotly.js of JupyterLab's plotly extension: a widget
    # carrying its own 5 MB copy is given up by anywidget on a slow machine.
    board = dashboard()
    assert len(board.figure._esm) < 10_000
    assert "window.Plotly" in board.figure._esm and "Plotly.react" in board.figure._esm
    loader = next(c for c in board.widget.children if hasattr(c, "outputs"))
    assert "application/vnd.plotly.v1+json" in loader.outputs[0]["data"]


def test_updates_are_throttled_to_a_few_per_second(recorder: Recorder) -> None:
    clock = FakeClock()
    board = dashboard(clock)
    mark = recorder.mark()
    for i in range(200):  # 10 seconds of events, a batch every 50 ms
        clock.now += 0.05
        board.events([*metrics(i * 10, 10), sys_sample(i)])
        board.stream("stdout", f"line {i}\n")
    updates = [d for d, _ in recorder.since(mark) if "plot_data" in d.get("state", {})]
    assert 10 <= len(updates) <= 10 / 0.5 + 1, len(updates)
    assert board.flushes == len(updates)


def test_update_messages_stay_flat_as_the_run_grows(recorder: Recorder) -> None:
    # (How long an update takes as the run grows is benchmarks/bench_dashboard.py's.)
    board = dashboard()

    def one_update(step0: int) -> int:
        board.events([*metrics(step0, 100), sys_sample(step0)])
        mark = recorder.mark()
        board.flush()
        return sum(size(m) for m in recorder.since(mark))

    board.events(metrics(0, 1000))
    board.flush()
    small_bytes = one_update(1000)
    logged = 1100
    while logged < 200_000:  # grow the run to 200k steps (no widget traffic meanwhile)
        board.data.add(metrics(logged, 10_000))
        logged += 10_000
    big_bytes = one_update(logged)
    assert big_bytes < 2.5 * small_bytes + 50_000, (small_bytes, big_bytes)
    assert big_bytes < 200_000  # 2 * 1000 buckets * 8 bytes * (x, y) per metric, and a bit


def test_the_output_panel_is_bounded_and_ends_with_the_newest_line(
        recorder: Recorder) -> None:
    board = dashboard()
    for i in range(5000):
        board.stream("stdout", f"output line {i}\n")
    board.stream("stderr", "a warning\n")
    mark = recorder.mark()
    board.flush()
    (panel,) = [d for d, _ in recorder.since(mark) if "lines" in d.get("state", {})]
    lines = panel["state"]["lines"]
    assert lines[-1] == ["stderr", "a warning"] and lines[-2] == ["stdout", "output line 4999"]
    assert ["stdout", "output line 4000"] not in lines
    assert len(json.dumps(lines)) < 30_000
    assert "%spot_logs" in board.panel.caption  # where the rest is
    # The panel's own front-end code follows the newest line (tests/test_browser.py).
    assert "scrollHeight" in board.panel._esm


# -- panels, axes, interruptions --------------------------------------------------------

def test_each_metric_gets_its_own_panel_and_y_axis() -> None:
    board = dashboard()
    board.events([*metrics(0, 50, lr=0.1), sys_sample(1)])
    board.flush()
    loss, lr = trace(board, "loss"), trace(board, "lr")
    assert (loss["xaxis"], loss["yaxis"]) != (lr["xaxis"], lr["yaxis"])
    layout = board.figure.plot_layout
    titles = [a["text"] for a in layout["annotations"]]
    assert "<b>loss</b>" in titles and "<b>lr</b>" in titles
    y_loss, y_lr = (layout[f"yaxis{t['yaxis'][1:]}"] for t in (loss, lr))
    assert (y_loss["domain"], y_loss["anchor"]) != (y_lr["domain"], y_lr["anchor"])
    # The width is the cell's, set by the front end (it follows the cell).
    assert "width" not in layout and "getBoundingClientRect" in board.figure._esm
    # The system panel is its own too.
    cpu = trace(board, "CPU utilisation %")
    assert cpu["yaxis"] not in (loss["yaxis"], lr["yaxis"])


def test_grouping_log_scale_time_axis_and_smoothing_are_the_users_choice() -> None:
    board = dashboard()
    board.events([Event("metric", T0 + s, 1, "i-1",
                        {"step": s, "t": T0 + s, "values": {"train/loss": 2.0 / (s + 1),
                                                           "val/loss": 3.0 / (s + 1),
                                                           "lr": 0.1}})
                  for s in range(40)])
    board.flush()
    assert len({t["yaxis"] for t in traces(board)
                if t["name"] in ("train/loss", "val/loss", "lr")}) == 3
    board.controls["grouping"].value = "name"
    assert trace(board, "train/loss")["yaxis"] == trace(board, "val/loss")["yaxis"]
    assert trace(board, "lr")["yaxis"] != trace(board, "val/loss")["yaxis"]
    board.controls["grouping"].value = "all"
    assert len({t["yaxis"] for t in traces(board) if t["name"] != "redone steps"}) == 1

    board.log_boxes["metrics"].value = True
    assert board.figure.plot_layout["yaxis"]["type"] == "log"
    board.controls["x"].value = "time"
    assert board.figure.plot_layout["xaxis"]["type"] == "date"
    x = xs(trace(board, "val/loss"))
    assert x[0] == pytest.approx((T0 + board.plots._tz) * 1000)  # clock time, in ms
    board.controls["smoothing"].value = 0.9
    smooth = trace(board, "val/loss (smoothed)")
    assert smooth["visible"] and trace(board, "val/loss")["opacity"] < 1
    assert np.allclose(ys(smooth), plots.ema(ys(trace(board, "val/loss")), 0.9))


def test_log_scale_is_per_panel_and_x_zoom_is_linked() -> None:
    board = dashboard()
    board.events([*metrics(0, 40, lr=0.1, accuracy=0.5), sys_sample(1)])
    board.flush()
    assert [b.description for b in board.log_bar.children[1:]] == ["loss", "lr", "accuracy"]
    board.log_boxes["loss"].value = True
    layout = board.figure.plot_layout

    def y_axis(name: str) -> dict[str, Any]:
        return board.figure.plot_layout[f"yaxis{trace(board, name)['yaxis'][1:]}"]

    assert y_axis("loss")["type"] == "log"
    assert y_axis("lr")["type"] == y_axis("accuracy")["type"] == "linear"
    assert y_axis("CPU utilisation %").get("type", "linear") == "linear"
    # Only the panel whose scale changed forgets its zoom.
    assert y_axis("loss")["uirevision"] != y_axis("lr")["uirevision"]
    # Every x axis, the system panel's too, follows the first one's zoom.
    x_axes = sorted(k for k in layout if k.startswith("xaxis"))
    assert len(x_axes) == 4 and "matches" not in layout["xaxis"]
    assert all(layout[k]["matches"] == "x" for k in x_axes if k != "xaxis")
    board.log_boxes["loss"].value = False
    assert y_axis("loss")["type"] == "linear"


def test_x_as_time_since_the_start() -> None:
    assert plots.relative_unit(100) == (1.0, "s")
    assert plots.relative_unit(600) == (60.0, "min")
    assert plots.relative_unit(5 * 3600) == (3600.0, "h")
    board = dashboard()
    interrupted_run(board)
    board.controls["x"].value = "relative"
    layout = board.figure.plot_layout
    assert layout["xaxis"]["type"] == "linear"
    assert layout["xaxis"]["title"]["text"] == "time since the start (s)"
    loss = trace(board, "loss")
    x = xs(loss)
    assert x[0] == 0.0 and np.nanmax(x) == 179.0  # seconds since the first event
    assert "since the start" in loss["hovertemplate"]
    cpu = xs(trace(board, "CPU utilisation %"))
    assert set(cpu[np.isfinite(cpu)]) == {55.0, 120.0}
    assert {s["x0"] for s in layout["shapes"]} == {60.0, 70.0}  # notice, boot
    # A longer run counts in minutes.
    board.events([Event("metric", T0 + 600, 2, "i-2", {"step": 100, "t": T0 + 600,
                                                       "values": {"loss": 0.4}})])
    board.flush()
    assert board.figure.plot_layout["xaxis"]["title"]["text"] == \
        "time since the start (min)"
    assert np.nanmax(xs(trace(board, "loss"))) == pytest.approx(10.0)


def with_sys_samples() -> list[Event]:
    """:func:`interrupted_events` with CPU samples at steps 30 (attempt 1), 55 (later
    redone), between the attempts, 60 (attempt 2) and after the last row."""
    events = interrupted_events()
    at = next(i for i, e in enumerate(events) if e.type == "checkpoint")
    return [*events[:at], sys_sample(30), *events[at:],
            sys_sample(140, attempt=2), sys_sample(200, attempt=2)]


def test_system_samples_are_placed_at_the_step_reached() -> None:
    data = series.DashboardData()
    data.add(with_sys_samples())
    steps = data.time_to_step(np.array([T0 + 30, T0 + 55, T0 + 57.5, T0 + 120, T0 + 140,
                                        T0 + 200, T0 - 5]))
    assert list(steps[:3]) == [30.0, 55.0, 57.5] and steps[4] == 60.0
    # Between two attempts, after the last row and before the first: no step.
    assert np.isnan(steps[[3, 5, 6]]).all()
    # A step function's times (the world size) are held at the nearest step.
    assert list(data.time_to_step(np.array([T0 - 5, T0 + 200]), held=True)) == [0.0, 99.0]

    board = dashboard()
    board.events(with_sys_samples())
    board.flush()
    layout = board.figure.plot_layout
    cpu = trace(board, "CPU utilisation %")
    x = xs(cpu)
    assert list(x[np.isfinite(x)]) == [30.0, 55.0, 60.0]
    sys_axis = layout[f"xaxis{cpu['xaxis'][1:]}"]
    assert sys_axis["type"] == "linear" and sys_axis["title"]["text"] == "step"
    assert sys_axis["matches"] == "x"
    assert {s["x0"] for s in layout["shapes"]} == {59.0, 50.0}  # at the steps marked
    board.controls["x"].value = "time"
    x = xs(trace(board, "CPU utilisation %"))
    assert x[0] == pytest.approx((T0 + 30 + board.plots._tz) * 1000)


def test_before_the_first_row_the_system_panel_stays_on_the_clock() -> None:
    board = dashboard()
    board.events([sys_sample(1), sys_sample(2)])
    board.flush()
    layout = board.figure.plot_layout
    (axis,) = [k for k in layout if k.startswith("xaxis")]
    assert layout[axis]["type"] == "date" and "matches" not in layout[axis]
    assert xs(trace(board, "CPU utilisation %"))[0] == pytest.approx(
        (T0 + 1 + board.plots._tz) * 1000)
    board.events(metrics(0, 10))  # rows: the samples move to the steps of their times
    board.flush()
    assert list(xs(trace(board, "CPU utilisation %"))) == [1.0, 2.0]
    cpu_axis = board.figure.plot_layout[f"xaxis{trace(board, 'CPU utilisation %')['xaxis'][1:]}"]
    assert cpu_axis["type"] == "linear" and cpu_axis["matches"] == "x"


def test_smoothing_is_weighted_by_the_step_gap() -> None:
    y = np.random.default_rng(1).normal(size=200)
    # A point per step: TensorBoard's debiased average.
    per_point = plots.ema(y, 0.9)
    assert np.allclose(plots.ema(y, 0.9, np.arange(200.0)), per_point)
    tensorboard = np.empty_like(y)
    last = 0.0
    for i, v in enumerate(y):
        last = last * 0.9 + 0.1 * v
        tensorboard[i] = last / (1 - 0.9 ** (i + 1))
    assert np.allclose(per_point, tensorboard)
    # Points 10 steps apart: each decays the average as 10 steps do.
    assert np.allclose(plots.ema(y, 0.9, np.arange(200.0) * 10), plots.ema(y, 0.9 ** 10))
    assert np.allclose(plots.ema(y, 0.9, np.arange(200.0) * 10, unit=10.0), per_point)


def test_a_metric_logged_every_25_steps_does_not_lag() -> None:
    board = dashboard()

    def line(step: int) -> float:
        return 1.0 - step / 1000

    board.events([Event("metric", T0 + s, 1, "i-1", {
        "step": s, "t": T0 + s,
        "values": {"loss": line(s), **({"val": line(s)} if s % 25 == 0 else {})}})
        for s in range(1000)])
    board.controls["smoothing"].value = 0.9

    def lag(name: str) -> float:
        """How many steps the smoothed curve trails the raw one at its end."""
        raw, smooth = trace(board, name), trace(board, f"{name} (smoothed)")
        return float(ys(smooth)[-1] - ys(raw)[-1]) * 1000

    assert 8 < lag("loss") < 10  # the per-step metric: about w / (1 - w) steps
    assert lag("val") < 3  # not 9 points (225 steps) behind, as a per-point average is
    val = ys(trace(board, "val"))
    assert (plots.ema(val, 0.9)[-1] - val[-1]) * 1000 > 200


class StepRun(comparison.Run):
    """A run of a comparison with a ``loss`` curve given as arrays."""

    def __init__(self, key: str, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__(key, key, None, key)
        self.curve = (x, y)

    def metric_names(self) -> list[str]:
        return ["loss", "lr"]

    def points(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.curve if name == "loss" else (self.curve[0], np.full_like(self.curve[1], 0.1))

    @property
    def marks(self) -> list[comparison.Mark]:
        return [comparison.Mark(1, "interrupted", 10.0)]

    @property
    def facts(self) -> comparison.Facts:
        return comparison.Facts()


def test_the_comparison_has_the_dashboards_log_panels_linked_zoom_and_smoothing() -> None:
    x = np.arange(0.0, 1000.0, 25.0)
    view = Comparison([StepRun("a", x, 1.0 - x / 1000), StepRun("b", x, 2.0 - x / 1000)],
                      follow=False)
    assert [b.description for b in view.log_bar.children[1:]] == ["loss", "lr"]
    view.log_boxes["loss"].value = True
    layout = view.figure.plot_layout
    assert layout["yaxis"]["type"] == "log" and layout["yaxis2"]["type"] == "linear"
    assert layout["xaxis2"]["matches"] == "x"
    marks = next(t for t in view.figure.plot_data if t.get("meta", {}).get("marks"))
    assert np.nanmin(ys(marks)) > 0  # the marks span the values on the log axis
    view.smoothing.value = 0.9
    (a,) = [t for t in view.figure.plot_data if t["name"] == "a" and t["yaxis"] == "y"]
    (raw,) = [t for t in view.figure.plot_data if t["name"] == "a (raw)" and t["yaxis"] == "y"]
    assert raw["opacity"] < 1 and np.allclose(ys(raw), 1.0 - x / 1000)
    # Smoothed by the step gap: 25 steps apart, it trails by about 2 steps, not 225.
    assert np.allclose(ys(a), plots.ema(ys(raw), 0.9, x))
    assert (ys(a)[-1] - ys(raw)[-1]) * 1000 < 3
    view.close()


def test_smoothing_continues_across_an_interruption() -> None:
    board = dashboard()
    interrupted_run(board)
    board.controls["smoothing"].value = 0.9
    raw, smooth = trace(board, "loss"), trace(board, "loss (smoothed)")
    x, y, s = xs(raw), ys(raw), ys(smooth)
    gap = int(np.flatnonzero(np.isnan(y))[0])
    assert np.isnan(s[gap]) and x[gap - 1] == 49 and x[gap + 1] == 50
    # The resumed attempt's curve goes on from the average at step 49, as if the run
    # had never stopped: not from its own first value.
    keep = ~np.isnan(y)
    assert np.allclose(s[keep], plots.ema(y[keep], 0.9, x[keep]))
    assert s[gap + 1] < y[gap + 1] - 0.3  # the average was near 0.1; the new value is 0.5


def test_interruptions_and_resumes_are_marked_with_a_legend_and_hover_text() -> None:
    board = dashboard()
    interrupted_run(board)
    board.flush()
    cuts = [t for t in traces(board) if t["name"] == "interruption"]
    resumes = [t for t in traces(board) if t["name"] == "resume on a replacement"]
    assert cuts and resumes and len(cuts) == len(resumes)  # one of each per metric panel
    assert [t["showlegend"] for t in cuts].count(True) == 1  # one legend entry for all
    assert {t["line"]["color"] for t in cuts}.isdisjoint(
        {t["line"]["color"] for t in traces(board) if t["name"] in ("loss", "lr")})
    assert cuts[0]["line"]["color"] != resumes[0]["line"]["color"]
    texts = {text for text in cuts[0]["text"] if text}
    assert texts == {"attempt 1 interrupted at step 59: interruption asked for (Interrupt "
                     "now, %spot_interrupt) (terminate); 10 steps redone"}
    cut_x = xs(cuts[0])
    assert set(cut_x[~np.isnan(cut_x)]) == {59.0}
    assert {t for t in resumes[0]["text"] if t} == {
        "attempt 2 resumed from step 50 on g4dn.xlarge a (i-2)"}
    loss = trace(board, "loss")
    redone = trace(board, "redone steps", loss["yaxis"])
    assert np.isnan(ys(loss)).sum() == 1 and len(xs(loss)) == 101  # 100 steps, the gap
    assert list(xs(redone)) == list(range(50, 60))
    # Against time, on the system panel: lines too.
    assert len(board.figure.plot_layout["shapes"]) == 2
    assert "last checkpoint: step 49" in board.checkpoint.value


def test_cpu_instances_are_labelled_cpu_and_ram() -> None:
    board = dashboard()
    board.events([sys_sample(1)])
    board.flush()
    names = {t["name"] for t in traces(board)}
    assert {"CPU utilisation %", "RAM used %"} <= names
    board2 = dashboard()
    board2.events([sys_sample(1, kind="gpu")])
    board2.flush()
    assert {"GPU utilisation %", "GPU memory %"} <= {t["name"] for t in traces(board2)}


def test_the_figure_is_its_widget_state(recorder: Recorder) -> None:
    # A notebook saved with its widgets (or a view drawn late) shows the whole figure:
    # its data and layout are the widget's state, not a stream of updates.
    board = dashboard()
    interrupted_run(board)
    board.flush()
    state = figure_comm(board).opened[0]["state"]  # what a new view starts from...
    assert state["plot_data"] == []
    last = [d["state"] for d, _ in figure_comm(board).messages if "plot_data" in d["state"]]
    assert last and len(last[-1]["plot_data"]) == len(traces(board))  # ... then this
    loss = trace(board, "loss")
    assert len(xs(loss)) == 101 and board.figure.plot_layout["shapes"]


# -- the header ----------------------------------------------------------------------------

def _view(events: list[Event], now: float, **account: Any) -> JobView:
    view = JobView(job_id="job-1", name="test", created=T0)
    for event in events:
        view.apply(event)
    view.cost_usd = account.get("cost", 0.01)
    view.ondemand_cost_usd = account.get("ondemand", 0.03)
    view.elapsed = now - T0
    view.now = now
    return view


def test_the_header_answers_progress_cost_and_interruptions_at_a_glance() -> None:
    board = dashboard()
    events = [*_progress_run(), Event("progress", T0 + 2, 1, "i-1", {"total": 400})]
    events.sort(key=lambda e: e.time)
    board.events(events)
    view = _view(events, now=T0 + 200)
    text = "\n".join(display.status_lines(view))
    assert "step 100 of 400 (25%)" in text
    assert "1 steps/s, 0:05:00 left" in text
    # Lost: from step 59 (at 59 s) until step 60 (at 90 s), while i-1 (until 65 s) and
    # i-2 (from 62 s) were billed: 6 + 28 instance-seconds at $0.2/h.
    assert "interruptions 1 (took 0:00:31 and $0.0019; 10 steps redone)" in text
    assert "projected $" in text and "on-demand for the same work" in text
    assert "saving 67%" in text
    page = header_html(view, board.data)
    for part in ("step 100 of 400 (25%)", "interruptions 1", "saving 67%", "<svg",
                 "2020-01-12 14:00", "replayed by the local cloud"):
        assert part in page, part


@pytest.mark.parametrize("state", ["waiting_for_capacity", "running", "completed",
                                   "stopped"])
def test_the_text_and_the_widget_header_colour_a_state_alike(state: str) -> None:
    board = dashboard()
    events = [Event("status", T0, 1, "i-1", {"state": "booting"}),
              Event("status", T0 + 1, 1, "i-1", {"state": state})]
    board.events(events)
    view = _view(events, now=T0 + 5)
    border = re.compile(r"border-left:4px solid (#[0-9a-f]{6})")
    text = border.search(display.status_bundle(view)["text/html"])
    widget = border.search(header_html(view, board.data))
    assert text is not None and widget is not None
    assert text.group(1) == widget.group(1)


def test_metric_batches_read_as_their_rows() -> None:
    """A reader with ``batches=True`` hands over ``metrics`` events (binary columns,
    merged by compaction): the plots, the header and the progress read them as rows."""
    rows = interrupted_events()
    batched: list[Event] = []
    for e in rows:
        if e.type == "metric" and batched and batched[-1].type == "metrics" and \
                batched[-1].attempt == e.attempt:
            batched[-1] = merge_metrics([batched[-1], as_batch(e)])
        else:
            batched.append(as_batch(e) if e.type == "metric" else e)
    assert sum(e.type == "metrics" for e in batched) == 3  # between other events
    by_rows, by_batches = dashboard(), dashboard()
    by_rows.events(rows)
    by_batches.events(batched)
    for board in (by_rows, by_batches):
        board.flush()
    for name in ("loss", "interruption"):
        a, b = trace(by_rows, name), trace(by_batches, name)
        assert np.array_equal(xs(a), xs(b), equal_nan=True), name
        assert np.array_equal(ys(a), ys(b), equal_nan=True), name
    views = [_view(events, now=T0 + 200) for events in (rows, batched)]
    assert views[0].step == views[1].step == 99
    assert display.status_lines(views[0]) == display.status_lines(views[1])


def test_the_cost_note_says_what_the_summary_includes() -> None:
    from spotnb.client.jobs import JobResult

    view = JobView(job_id="job-1", name="test", created=T0)
    result = JobResult(job_id="job-1", name="test", status="completed", reason="",
                       attempts=(), interruptions=0, cost_usd=0.0125,
                       ondemand_cost_usd=0.05, metrics={}, duration=60.0,
                       requests_usd=0.0005)
    view.account(result)
    assert display.header(view).cost_note == result.cost_includes
    assert "$0.0005" in display.header(view).cost_note


def test_during_a_relaunch_the_header_names_the_attempt_being_launched() -> None:
    events = [*_progress_run()[:62],
              Event("status", T0 + 65, 0, None, {"state": "launching",
                                                 "instance_type": "g5.xlarge",
                                                 "az": "use1-az2"})]
    view = _view(events, now=T0 + 66)
    assert display.header(view).attempt == \
        "attempt 1 ended; attempt 2: launching g5.xlarge use1-az2"


def test_a_launch_read_after_the_boot_it_led_to_names_no_next_attempt() -> None:
    from spotnb.client import progress

    # A follower gets the attempts' events live and the group's from the log, later:
    # the replacement's "launching" (T0 + 62) comes after attempt 2's boot (T0 + 70).
    # The header once said "attempt 2 ended; attempt 3: launching g5.xlarge", of a job
    # whose log has no attempt 3.
    run = _progress_run()
    launching = Event("status", T0 + 62, 0, None, {"state": "launching",
                                                   "instance_type": "g5.xlarge",
                                                   "az": "use1-az2"})
    booted = next(i for i, e in enumerate(run) if e.attempt == 2)
    events = [*run[:booted + 20], launching, *run[booted + 20:]]
    view = _view(events, now=T0 + 120)
    attempt = display.header(view).attempt
    assert attempt.startswith("attempt 2"), attempt
    assert "attempt 3" not in attempt and "launching" not in attempt, attempt
    assert progress.launching(view.folded) is None
    assert not any("attempt 3" in line for line in display.status_lines(view))
    # In time order, the same events tell the same story.
    in_order = _view(sorted(events, key=lambda e: e.time), now=T0 + 120)
    assert display.header(in_order).attempt == attempt


def _progress_run() -> list[Event]:
    """One step a second; attempt 1 logs 0-59, is interrupted at 60 s and had saved
    step 49; attempt 2 boots at 70 s and logs 50-99 from 80 s: 10 steps redone, and no
    progress from 59 s until step 60 at 90 s."""
    launched = {"action": "launched", "pool": "p@a", "price": 0.2, "ondemand": 0.6,
                "instance_id": "i-1"}
    out = [Event("instance", T0, 0, "i-1", launched),
           Event("status", T0 + 1, 1, "i-1", {"state": "booting"})]
    out += [Event("metric", T0 + s, 1, "i-1", {"step": s, "t": T0 + s,
                                               "values": {"loss": 1.0}})
            for s in range(60)]
    out += [Event("notice", T0 + 60, 1, "i-1", {"kind": "instance-action"}),
            Event("instance", T0 + 62, 0, "i-2", {**launched, "instance_id": "i-2"}),
            Event("instance", T0 + 65, 0, "i-1", {"action": "terminated",
                                                  "instance_id": "i-1"}),
            Event("status", T0 + 70, 2, "i-2", {"state": "booting"})]
    out += [Event("metric", T0 + 30 + s, 2, "i-2", {"step": s, "t": T0 + 30 + s,
                                                    "values": {"loss": 0.5}})
            for s in range(50, 100)]
    out.append(Event("price", T0 + 1, 0, "i-1", {"pool": "p@a", "price": 0.2,
                                                 "history_time": "2020-01-12T14:00:00Z",
                                                 "history_scale": 60}))
    return sorted(out, key=lambda e: e.time)


def test_one_log_line_per_interruption_and_per_resume() -> None:
    view = JobView(job_id="j", name="n", created=T0)
    events = [
        Event("status", T0, 1, "i-1", {"state": "booting", "instance_type": "g4dn.xlarge",
                                       "az": "a"}),
        Event("notice", T0 + 10, 1, "i-1", {"kind": "instance-action",
                                            "action": "terminate",
                                            "notice_time": "2026-01-01T00:00:00Z"}),
        Event("notice", T0 + 10, 1, "i-1", {"kind": "rebalance"}),
        Event("status", T0 + 10, 1, "i-1", {"state": "interrupted",
                                            "detail": "spot interruption notice: x"}),
        Event("checkpoint", T0 + 11, 1, "i-1", {"phase": "durable", "step": 5, "id": "c5",
                                                "bytes": 10, "forced": True}),
        Event("status", T0 + 11, 1, "i-1", {"state": "interrupted",
                                            "detail": "final checkpoint at step 5 is "
                                                      "durable; waiting"}),
        # The agent, still running when its instance goes (a slow start), says so too.
        Event("status", T0 + 12, 1, "i-1", {"state": "interrupted",
                                            "detail": "the instance was terminated"}),
        Event("status", T0 + 20, 2, "i-2", {"state": "booting"}),
        Event("status", T0 + 25, 2, "i-2", {"state": "running",
                                            "detail": "restored checkpoint of step 5"}),
        # An instance gone without a notice: that line is the only one.
        Event("status", T0 + 30, 2, "i-2", {"state": "interrupted",
                                            "detail": "the instance was terminated"}),
    ]
    lines = []
    for event in events:
        view.apply(event)
        text = display.milestone(event, view)
        if text is not None:
            lines.append(text)
    assert len(lines) == 4, lines
    assert lines[1].startswith("attempt 1: spot interruption notice for i-1")
    assert lines[2].startswith("attempt 2: resuming on a replacement instance")
    assert lines[3] == "attempt 2: the instance was terminated"


# -- the buttons -----------------------------------------------------------------------

def test_detach_button_ends_the_follow_loop_as_an_interrupt_would() -> None:
    board = dashboard()
    board.buttons["detach"].click()
    with pytest.raises(DetachRequested) as caught:
        board.events([])
    assert isinstance(caught.value, KeyboardInterrupt)  # follow() returns Detached
    board.events([])  # once only


def test_stop_asks_for_confirmation_and_interrupt_acts() -> None:
    clock = FakeClock()
    board = Dashboard(clock=clock, show=False)
    handle = fake_handle()
    board.start(handle)
    assert board.buttons["interrupt"].layout.display is None  # shown on the local cloud
    board.buttons["interrupt"].click()
    wait_until(lambda: "interrupt" in handle.calls, 10, "the button's thread")
    board.buttons["stop"].click()
    assert "stop" not in " ".join(handle.calls)  # the first click only asks
    assert board.buttons["stop"].description == "Confirm stop"
    assert "will not resume" in board.message.value
    board.buttons["cancel"].click()
    assert board.buttons["stop"].description == "Stop job…" and not board.message.value
    board.buttons["stop"].click()
    clock.now += dashboard_mod.STOP_CONFIRM_SECONDS + 1
    board.events([])  # the question goes stale
    assert board.buttons["stop"].description == "Stop job…"
    board.buttons["stop"].click()
    board.buttons["stop"].click()
    wait_until(lambda: len(handle.calls) == 2, 10, "the button's thread")
    assert sorted(handle.calls) == ["interrupt", "stop %spot_stop button"]
    assert board.buttons["stop"].disabled


def test_messages_expire() -> None:
    clock = FakeClock()
    board = Dashboard(clock=clock, show=False)
    handle = fake_handle()
    board.start(handle)
    board.buttons["interrupt"].click()
    wait_until(lambda: "delivered" in board.message.value, 10, "the button's thread")
    clock.now += dashboard_mod.MESSAGE_SECONDS - 1
    board.events([])
    assert "delivered" in board.message.value
    clock.now += 2
    board.events([])
    assert board.message.value == ""


def test_interrupt_now_is_hidden_off_the_local_cloud() -> None:
    board = Dashboard(clock=FakeClock(), show=False)
    board.start(fake_handle(provider="aws"))
    assert board.buttons["interrupt"].layout.display == "none"


def test_the_static_copy_is_a_png_hidden_next_to_its_live_dashboard() -> None:
    pytest.importorskip("matplotlib")
    from spotnb.records.document import figure_png

    board = dashboard()
    interrupted_run(board)
    board.view = _view([], now=T0 + 200)
    data, meta = board.static_bundle()  # type: ignore[misc]
    assert meta == {"spotnb": {"figure": "dashboard", "job_id": "job-1"}}
    assert data["text/plain"].startswith("Final dashboard of spotnb job job-1")
    # The PNG is stored once: inline in the HTML, no image/png copy beside it.
    assert sorted(data) == ["text/html", "text/plain"]
    png = figure_png({"data": data})
    assert png is not None and png.startswith(b"\x89PNG")
    assert data["text/html"].count("base64,") == 1
    live = static.live_class("job-1")
    assert live in board.widget._dom_classes
    assert (f"body:has(.{live} .spotnb-figure .js-plotly-plot) .spotnb-static-job-1"
            in data["text/html"])
    page = re.sub(r"base64,[A-Za-z0-9+/=]+", "", data["text/html"])
    assert "<script" not in page and "http" not in page  # nothing to load: reads offline


def test_the_dashboard_reads_without_widgets_as_its_header_and_output_panel() -> None:
    board = dashboard()
    interrupted_run(board)
    for i in range(3):
        board.stream("stdout", f"epoch {i} <done>\n")
    board.stream("stderr", "a warning\n")
    board.view = _view([], now=T0 + 200)
    data = board._repr_mimebundle_()
    assert display_view_mime(data)
    page = data["text/html"]
    # What the output panel holds, escaped, stderr coloured as in the live panel.
    assert "epoch 2 &lt;done&gt;" in page and "<done>" not in page
    assert "<span style='color:#b35900'>a warning</span>" in page
    assert "job-1" in page  # the header
    assert "<script" not in page and "http" not in page
    assert "epoch 2 <done>" in data["text/plain"]


# -- the picker ------------------------------------------------------------------------

class FakeMagics:
    instance_types: list[str] = ["g4dn.xlarge"]
    region = "us-east-1"
    checkpoint_every = "10m"
    gpu_reference = ""


def test_picker_ranks_by_expected_cost_counting_gpu_speed() -> None:
    magics = FakeMagics()
    picker = InstancePicker(magics=magics)
    assert picker.reference.value == "T4"  # the default type's GPU
    costs = [estimate(r, 100.0, 600.0, "T4").spot_usd for r in picker.shown]  # type: ignore[union-attr]
    assert costs == sorted(costs)
    rows = {r.instance_type: r for r in picker.shown}
    t4, h100 = rows["g4dn.xlarge"], rows["p5.48xlarge"]
    assert h100.speed("T4") > 10 * t4.speed("T4")  # type: ignore[operator]
    t4_job = estimate(t4, 100.0, 600.0, "T4")
    h100_job = estimate(h100, 100.0, 600.0, "T4", all_gpus=True)
    assert t4_job is not None and h100_job is not None
    assert h100_job.wall_hours < t4_job.wall_hours / 80  # 8 H100s against one T4
    assert picker.table.rows[0]["id"] == picker.shown[0].instance_type
    assert "job $ spot" in [c["label"] for c in picker.table.columns]


def test_picker_shows_nvidia_on_x86_by_default_and_warns_of_a_hidden_choice() -> None:
    magics = FakeMagics()
    picker = InstancePicker(magics=magics)
    assert picker.shown and all(r.cuda for r in picker.shown)
    assert not any(r.instance_type.startswith(("g4ad", "g5g")) for r in picker.shown)
    picker.chosen.value = ["g5g.xlarge"]  # as typing it would
    assert "g5g.xlarge is chosen but hidden" in picker.warning.value
    assert "ARM (Graviton)" in picker.warning.value
    picker.cuda_only.value = False
    assert any(r.instance_type.startswith("g4ad") for r in picker.shown)
    assert picker.warning.value == ""


def test_picker_sorts_by_header_and_chooses_by_row_click() -> None:
    magics = FakeMagics()
    picker = InstancePicker(magics=magics)
    # What the table's front end does on a click on the "RAM GiB" header, twice.
    picker.table.sort_key = "memory_gib"
    assert [r.memory_gib for r in picker.shown] == sorted(r.memory_gib for r in picker.shown)
    picker.table.descending = True
    assert [r.memory_gib for r in picker.shown] == sorted(
        (r.memory_gib for r in picker.shown), reverse=True)
    # ... and on clicks on two rows.
    picker.table.chosen = ["g5.2xlarge"]
    picker.table.chosen = ["g5.2xlarge", "g5.xlarge"]
    assert list(picker.chosen.value) == ["g5.2xlarge", "g5.xlarge"]
    assert magics.instance_types == ["g5.2xlarge", "g5.xlarge"]
    assert "%%spot_train -t g5.2xlarge,g5.xlarge" in picker.line.value
    picker.gpu_model.value = "A10G"
    assert picker.shown and {r.gpu_model for r in picker.shown} == {"A10G"}
    picker.regions.value = ["eu-west-1"]
    picker.chosen.value = ["g5.xlarge"]
    assert magics.region == "eu-west-1" and picker.table.chosen == ["g5.xlarge"]
    assert "--region eu-west-1" in picker.line.value


def test_picker_shows_price_staleness_once() -> None:
    picker = InstancePicker(magics=FakeMagics())
    assert all(r.stale() for r in picker.shown)  # the bundled snapshot is from 2025
    assert picker.note.value.count("days old") == 1 and "spotnb-stale" in picker.note.value
    assert not any("stale" in str(cell) for row in picker.table.rows
                   for cell in row["cells"].values())
    assert "days old" in picker.text()


def test_the_estimate_adds_the_interruption_overhead_of_the_bucket() -> None:
    rows = {r.instance_type: r for r in picker_rows("us-east-1")}
    g5 = rows["g5.xlarge"]  # >20%: read as up to one interruption a month
    calm = next(r for r in rows.values() if r.interruption_max_pct == 5.0)
    for row in (g5, calm):
        est = estimate(row, 720.0, 1200.0, all_gpus=True)
        assert est is not None
        wall = 720.0 / row.gpu_count
        rate = row.interruption_max_pct / 100 / 720  # type: ignore[operator]
        overhead = 600 / 3600 + 5 / 60
        assert est.billed_hours == pytest.approx(wall / (1 - rate * overhead))
        assert est.interruptions == pytest.approx(rate * est.billed_hours)
        assert est.spot_usd == pytest.approx(est.billed_hours * row.spot)
    busy = estimate(g5, 720.0, 1200.0)
    quiet = estimate(calm, 720.0, 1200.0)
    assert busy is not None and quiet is not None
    assert busy.billed_hours - 720.0 > quiet.billed_hours - 720.0
    # A longer checkpoint interval costs more when interruptions come.
    assert estimate(g5, 720.0, 7200.0).spot_usd > busy.spot_usd  # type: ignore[union-attr]


def test_train_line() -> None:
    assert train_line(["a", "b"], "us-east-1") == "%%spot_train -t a,b"
    assert train_line(["a"], "eu-west-1") == "%%spot_train -t a --region eu-west-1"


def test_picker_rows_are_gpu_types_with_spot_prices_and_speed_figures() -> None:
    rows = picker_rows("us-east-1")
    assert rows and all(isinstance(r, PickerRow) for r in rows)
    assert not any(r.gpu_model in ("Inferentia2", "Trainium") for r in rows)
    assert all(r.spot > 0 and r.pools >= 1 for r in rows)
    assert all(r.gpu_speed for r in rows if r.cuda)  # every CUDA GPU has its figure


def test_picker_ranks_by_training_speed_not_peak_tflops() -> None:
    rows = {r.instance_type: r for r in picker_rows("us-east-1")}
    a10g, l40s, v100 = rows["g5.xlarge"], rows["g6e.xlarge"], rows["p3.2xlarge"]
    # Peak FP16 TFLOPS made an L40S 5.6 T4s, an A10G 0.58 of an L4 and a V100 about an
    # L4; memory-bound training is not like that.
    assert 2.0 < l40s.speed("T4") < 4.0  # type: ignore[operator]
    assert a10g.speed("L4") > 1.2  # type: ignore[operator]
    assert v100.speed("L4") > 1.8  # type: ignore[operator]
    picker = InstancePicker(magics=FakeMagics())
    cells = {r["id"]: r for r in picker.table.rows}
    assert cells["p3.2xlarge"]["cells"]["speed"] == f"{v100.speed('T4'):.2f}"  # measured
    assert cells["g6.xlarge"]["cells"]["speed"].endswith("*")  # derived, and says so
    assert "derived" in cells["g6.xlarge"]["titles"]["speed"]


def test_picker_keeps_its_reference_gpu_when_choices_change_the_default_type() -> None:
    magics = FakeMagics()
    first = InstancePicker(magics=magics)
    assert first.reference.value == "T4" and magics.gpu_reference == "T4"
    cost = {r["id"]: r["cells"]["est_spot_usd"] for r in first.table.rows}
    first.chosen.value = ["p5.48xlarge"]
    assert magics.instance_types == ["p5.48xlarge"]
    # The cell run again: the same reference, so the same costs, and it says which.
    again = InstancePicker(magics=magics)
    assert again.reference.value == "T4"
    assert {r["id"]: r["cells"]["est_spot_usd"] for r in again.table.rows} == cost
    assert "100 hours of training on one T4" in again.note.value
    assert "(x T4)" in again.text()
    # A reference changed by hand is the one kept.
    again.reference.value = "A10G"
    assert InstancePicker(magics=magics).reference.value == "A10G"


def test_picker_shows_the_default_columns_until_all_are_asked_for() -> None:
    picker = InstancePicker(magics=FakeMagics())
    assert [c["key"] for c in picker.table.columns] == list(DEFAULT_COLUMNS)
    assert "ondemand" in picker.table.rows[0]["cells"]  # kept for readers of the state
    picker.all_columns.value = True
    assert [c["key"] for c in picker.table.columns] == list(COLUMNS)


def test_picker_reads_without_widgets_as_an_html_table() -> None:
    picker = InstancePicker(magics=FakeMagics())
    picker.chosen.value = ["g5.xlarge"]
    data = picker._repr_mimebundle_()
    assert display_view_mime(data)
    page = data["text/html"]
    # The table's header and first rows, as the widget's table shows them.
    labels = [c["label"] for c in picker.table.columns]
    assert all(f">{label}</th>" in page for label in labels), labels
    first = picker.table.rows[0]["cells"]
    assert f"<td style='padding:2px 8px'>{first['instance_type']}</td>" in page
    assert page.count("<tr>") == 1 + min(20, len(picker.shown))
    assert "%%spot_train -t g5.xlarge" in page and "reference GPU" in page
    assert "<script" not in page and "http" not in page


class _RecordingKernel:
    """Stands in for ipykernel's Kernel where _StatusKeeper touches it: the status it
    publishes, and the parent of the request the main shell handles."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str | None]] = []
        self.parent: dict[str, Any] = {}

    def _publish_status(self, status: str, channel: str, parent: Any = None) -> None:
        self.published.append((status, (parent or self.parent)["header"]["msg_id"]))

    def get_parent(self, channel: str) -> dict[str, Any]:
        return self.parent


def _request(msg_id: str, msg_type: str) -> dict[str, Any]:
    return {"header": {"msg_id": msg_id, "msg_type": msg_type}}


def test_a_request_handled_nested_in_the_running_cell_leaves_the_kernel_busy() -> None:
    # A cell that polls the kernel's messages itself (as ui-poll helpers do) handles
    # a click on the main thread, inside its own request: after the click's idle, the
    # cell is reported busy again; the cell's own idle ends it.
    from spotnb.widgets.kernel import _StatusKeeper

    kernel = _RecordingKernel()
    keeper = _StatusKeeper(kernel)
    cell, click = _request("cell", "execute_request"), _request("click", "comm_msg")
    for status, parent in (("busy", cell), ("busy", click), ("idle", click),
                           ("idle", cell)):
        kernel.parent = parent
        keeper(status, "shell", parent)
    assert kernel.published == [("busy", "cell"), ("busy", "click"), ("idle", "click"),
                                ("busy", "cell"), ("idle", "cell")]
    kernel.parent = click  # a click while no cell runs: no busy on anyone's behalf
    keeper("busy", "shell", click)
    keeper("idle", "shell", click)
    assert kernel.published[-2:] == [("busy", "click"), ("idle", "click")]
