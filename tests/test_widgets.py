"""The dashboard and the picker without a kernel: widgets talk to a recording comm.

As in ipywidgets' own tests (``DummyComm``), ``comm.create_comm`` is swapped for a fake
that records every message with its binary buffers, so a test can count the messages
an update sends, weigh them, and check the throttle, on a fake clock.
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import comm

from spotnb.events import Event
from spotnb.widgets import series
from spotnb.widgets.dashboard import Dashboard, DetachRequested
from spotnb.widgets.picker import (
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
                  {"step": step, "values": {"loss": 1.0 / (step + 1), **extra}})
            for step in range(first, first + count)]


def sys_sample(when: float, attempt: int = 1, kind: str = "cpu") -> Event:
    return Event("sys", T0 + when, attempt, f"i-{attempt}",
                 {"kind": kind, "util": 80.0, "mem_used": 2 << 30, "mem_total": 8 << 30})


def fake_handle(provider: str = "local", max_price: float | None = None) -> Any:
    calls: list[str] = []
    spec = types.SimpleNamespace(provider=provider, job_id="job-1", name="test",
                                 resources=types.SimpleNamespace(max_price=max_price))
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
    board.events([
        Event("instance", T0, 0, "i-1", {"action": "launched", "pool": "g4dn.xlarge@a",
                                         "price": 0.2, "ondemand": 0.5}),
        Event("price", T0 + 1, 0, "i-1", {"pool": "g4dn.xlarge@a", "price": 0.2}),
        Event("status", T0 + 1, 1, "i-1", {"state": "booting"}),
        *metrics(0, 50),
        Event("checkpoint", T0 + 50, 1, "i-1", {"phase": "durable", "step": 49,
                                                "bytes": 4096, "forced": False}),
        *metrics(50, 10),
        sys_sample(55),
        Event("notice", T0 + 60, 1, "i-1", {"kind": "instance-action"}),
        Event("status", T0 + 70, 2, "i-2", {"state": "booting"}),
        *[Event("metric", T0 + 80 + s, 2, "i-2", {"step": s, "values": {"loss": 0.5}})
          for s in range(50, 100)],
        sys_sample(120, attempt=2),
    ])


# -- the series --------------------------------------------------------------------------

def test_min_max_buckets_bound_the_points_and_keep_the_extremes() -> None:
    buckets = series.MinMaxBuckets(max_buckets=500)
    x = np.arange(1_000_000, dtype=float)
    y = np.sin(x / 5000.0)
    y[123_457] = 9.0  # a spike a stride would miss
    y[876_543] = -9.0
    for xi, yi in zip(x, y, strict=True):
        buckets.add(float(xi), float(yi))
    px, py = buckets.points()
    assert len(px) <= 1000
    assert np.all(np.diff(px) >= 0)  # in x order
    assert 9.0 in py and -9.0 in py
    assert px[np.argmax(py)] == 123_457


def test_a_resumed_attempt_moves_the_lost_steps_to_the_redone_series() -> None:
    s = series.MetricSeries("loss")
    for step in range(60):
        s.add(1, step, 1.0)
    for step in range(50, 70):
        s.add(2, step, 2.0)
    assert list(s.redone.full.x) == list(range(50, 60))
    assert list(s.curve.full.x) == list(range(70))
    assert list(s.curve.full.y[48:52]) == [1.0, 1.0, 2.0, 2.0]


# -- the dashboard: messages and their cost --------------------------------------------

def figure_comm(board: Dashboard) -> RecordingComm:
    return board.figure.comm  # type: ignore[no-any-return]


def test_an_update_is_four_figure_messages_with_numpy_buffers(recorder: Recorder) -> None:
    board = dashboard()
    board.events([*metrics(0, 1000), sys_sample(1)])
    mark = recorder.mark()
    board.events([*metrics(1000, 500), sys_sample(2)])
    board.flush()
    figure = [m for m in figure_comm(board).messages[mark[id(figure_comm(board))]:]]
    keys = [sorted(data["state"]) for data, _ in figure]
    assert keys == [["_last_trace_edit_id"], ["_last_layout_edit_id"], ["_py2js_update"],
                    ["_py2js_update"]], keys
    data, buffers = figure[2]
    assert buffers, "numpy arrays must travel as binary buffers, not JSON lists"
    assert len(json.dumps(data)) < 3000  # the numbers are in the buffers
    assert figure[3][0]["state"]["_py2js_update"] is None  # transient: reset at once


def test_updates_are_throttled_to_a_few_per_second(recorder: Recorder) -> None:
    clock = FakeClock()
    board = dashboard(clock)
    mark = recorder.mark()
    for i in range(200):  # 10 seconds of events, a batch every 50 ms
        clock.now += 0.05
        board.events([*metrics(i * 10, 10), sys_sample(i)])
        board.stream("stdout", f"line {i}\n")
    updates = [d for d, _ in recorder.since(mark)
               if d.get("state", {}).get("_py2js_update") is not None]
    assert 10 <= len(updates) <= 10 / 0.5 + 1, len(updates)
    assert board.flushes == len(updates)


def test_update_messages_and_time_stay_flat_as_the_run_grows(recorder: Recorder) -> None:
    board = dashboard()

    def one_update(step0: int) -> tuple[int, float]:
        board.events([*metrics(step0, 100), sys_sample(step0)])
        mark = recorder.mark()
        started = time.perf_counter()
        board.flush()
        seconds = time.perf_counter() - started
        return sum(size(m) for m in recorder.since(mark)), seconds

    board.events(metrics(0, 1000))
    small_bytes, small_seconds = one_update(1000)
    logged = 1100
    while logged < 200_000:  # grow the run to 200k steps (no widget traffic meanwhile)
        board.data.add(metrics(logged, 10_000))
        logged += 10_000
    big_bytes, big_seconds = one_update(logged)
    assert big_bytes < 2.5 * small_bytes + 50_000, (small_bytes, big_bytes)
    assert big_bytes < 200_000  # 2 * 1000 buckets * 8 bytes * (x, y) per metric, and a bit
    assert big_seconds < max(10 * small_seconds, 0.05), (small_seconds, big_seconds)


def test_the_output_panel_is_bounded_and_scrolls_itself(recorder: Recorder) -> None:
    board = dashboard()
    for i in range(5000):
        board.stream("stdout", f"output line {i}\n")
    board.stream("stderr", "a warning\n")
    mark = recorder.mark()
    board.flush()
    (panel,) = [d for d, _ in recorder.since(mark) if "value" in d.get("state", {})
                and "spotnb-log" in d["state"]["value"]]
    value = panel["state"]["value"]
    assert "output line 4999" in value and "output line 4000" not in value
    assert len(value) < 30_000
    assert "column-reverse" in value  # newest line stays in view


# -- interruptions, redone steps, final state ------------------------------------------

def test_interruptions_and_resumes_are_marked_on_all_three_plots() -> None:
    board = dashboard()
    interrupted_run(board)
    board.flush()
    fig = board.figure
    shapes = fig.layout.shapes
    assert {s.xref for s in shapes} == {"x", "x2", "x3"}
    assert len(shapes) == 6  # interruption and resume, on each plot
    assert {s.line.dash for s in shapes} == {"dash", "dot"}
    loss = next(t for t in fig.data if t.name == "loss")
    redone = next(t for t in fig.data if t.name == "loss, redone")
    assert len(loss.x) == 100 and list(redone.x) == list(range(50, 60))
    marker = next(t for t in fig.data if t.name == "interruption")
    assert list(marker.x) == [59.0]
    assert "last checkpoint: step 49" in board.checkpoint.value


def test_cpu_instances_are_labelled_cpu_and_ram() -> None:
    board = dashboard()
    board.events([sys_sample(1)])
    board.flush()
    names = {t.name for t in board.figure.data}
    assert {"CPU utilisation %", "RAM used %"} <= names
    board2 = dashboard()
    board2.events([sys_sample(1, kind="gpu")])
    board2.flush()
    assert {"GPU utilisation %", "GPU memory %"} <= {t.name for t in board2.figure.data}


def test_the_price_plot_has_the_max_price_and_on_demand_lines() -> None:
    board = Dashboard(clock=FakeClock(), show=False)
    board.start(fake_handle(max_price=0.35))
    interrupted_run(board)
    board.flush()
    by_name = {t.name: t for t in board.figure.data}
    assert list(by_name["max price"].y) == [0.35, 0.35]
    assert list(by_name["on-demand"].y) == [0.5, 0.5]
    # The step function lasts until the latest event.
    assert by_name["spot $/h"].x[-1] > by_name["spot $/h"].x[0]


def test_the_final_data_becomes_the_saved_state(recorder: Recorder) -> None:
    board = dashboard()
    interrupted_run(board)
    mark = recorder.mark()
    board.save_state()
    (state,) = [d["state"] for d, _ in figure_comm(board).messages[
        mark[id(figure_comm(board))]:]]
    assert {"_widget_data", "_widget_layout", "_py2js_update"} <= set(state)
    loss = next(t for t in state["_widget_data"] if t.get("name") == "loss")
    assert list(loss["x"]["shape"]) == [100]  # binary, all 100 steps
    assert len(state["_widget_layout"]["shapes"]) == 6
    # The last update stays set, with x and y of every trace: every buffer path an
    # update used has a home in the saved state.
    update = state["_py2js_update"]
    n = len(board.figure.data)
    assert update["style_traces"] == list(range(n))
    assert len(update["style_data"]["x"]) == n == len(update["style_data"]["y"])


# -- the buttons -----------------------------------------------------------------------

def test_detach_button_ends_the_follow_loop_as_an_interrupt_would() -> None:
    board = dashboard()
    board.buttons["detach"].click()
    with pytest.raises(DetachRequested) as caught:
        board.events([])
    assert isinstance(caught.value, KeyboardInterrupt)  # follow() returns Detached
    board.events([])  # once only


def test_stop_and_interrupt_buttons_act_on_the_job() -> None:
    board = Dashboard(clock=FakeClock(), show=False)
    handle = fake_handle()
    board.start(handle)
    assert board.buttons["interrupt"].layout.display is None  # shown on the local cloud
    board.buttons["interrupt"].click()
    board.buttons["stop"].click()
    deadline = time.monotonic() + 5
    while len(handle.calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(handle.calls) == ["interrupt", "stop %spot_stop button"]
    assert board.buttons["stop"].disabled


def test_interrupt_now_is_hidden_off_the_local_cloud() -> None:
    board = Dashboard(clock=FakeClock(), show=False)
    board.start(fake_handle(provider="aws"))
    assert board.buttons["interrupt"].layout.display == "none"


# -- the picker ------------------------------------------------------------------------

class FakeMagics:
    instance_types: list[str] = ["g4dn.xlarge"]
    region = "us-east-1"
    checkpoint_every = "10m"


def test_picker_filters_sorts_and_chosen_types_become_the_defaults() -> None:
    magics = FakeMagics()
    picker = InstancePicker(magics=magics)
    assert picker.shown == sorted(picker.shown, key=lambda r: r.spot_per_gpu_hour)
    picker.gpu_model.value = "A10G"
    assert picker.shown and {r.gpu_model for r in picker.shown} == {"A10G"}
    picker.gpu_count.value = 4
    assert {r.gpu_count for r in picker.shown} == {4}
    picker.gpu_count.value = 0  # any
    picker.max_spot.value = 1.0
    assert all(r.spot <= 1.0 for r in picker.shown)
    picker.sort_by.value, picker.descending.value = "memory_gib", True
    assert [r.memory_gib for r in picker.shown] == sorted(
        (r.memory_gib for r in picker.shown), reverse=True)
    picker.choose("g5.2xlarge", "g5.xlarge")
    assert magics.instance_types == ["g5.2xlarge", "g5.xlarge"]
    assert "%%spot_train -t g5.2xlarge,g5.xlarge" in picker.line.value
    assert "<b>1.</b> g5.2xlarge" in picker.table.value  # preference shown in the table
    picker.region.value = "eu-west-1"
    picker.choose("g5.xlarge")
    assert magics.region == "eu-west-1"
    assert "--region eu-west-1" in picker.line.value


def test_picker_shows_stale_prices_as_stale() -> None:
    picker = InstancePicker(magics=FakeMagics())
    assert all(r.stale() for r in picker.shown)  # the bundled snapshot is from 2025
    assert "stale</span>" in picker.table.value and "(stale)" in picker.text()


def test_the_estimate_adds_the_interruption_overhead_of_the_bucket() -> None:
    rows = {r.instance_type: r for r in picker_rows("us-east-1")}
    g5 = rows["g5.xlarge"]  # >20%: read as up to one interruption a month
    calm = next(r for r in rows.values() if r.interruption_max_pct == 5.0)
    for row in (g5, calm):
        est = estimate(row, gpu_hours=720.0, checkpoint_seconds=1200.0)
        wall = 720.0 / row.gpu_count
        rate = row.interruption_max_pct / 100 / 720  # type: ignore[operator]
        overhead = 600 / 3600 + 5 / 60
        assert est.billed_hours == pytest.approx(wall / (1 - rate * overhead))
        assert est.interruptions == pytest.approx(rate * est.billed_hours)
        assert est.spot_usd == pytest.approx(est.billed_hours * row.spot)
    busy = estimate(g5, 720.0, 1200.0)
    assert busy.billed_hours - 720.0 > estimate(calm, 720.0 * calm.gpu_count, 1200.0
                                                ).billed_hours - 720.0
    # A longer checkpoint interval costs more when interruptions come.
    assert estimate(g5, 720.0, 7200.0).spot_usd > busy.spot_usd


def test_train_line() -> None:
    assert train_line(["a", "b"], "us-east-1") == "%%spot_train -t a,b"
    assert train_line(["a"], "eu-west-1") == "%%spot_train -t a --region eu-west-1"


def test_picker_rows_are_gpu_types_with_spot_prices() -> None:
    rows = picker_rows("us-east-1")
    assert rows and all(isinstance(r, PickerRow) for r in rows)
    assert not any(r.gpu_model in ("Inferentia2", "Trainium") for r in rows)
    assert all(r.spot > 0 and r.pools >= 1 for r in rows)
