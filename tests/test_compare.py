"""Comparing runs: ``spotnb.compare``, ``%spot_compare`` and ``spotnb records compare``.

The jobs here are store prefixes written as the agents and the group leave them (as
in ``test_magics._fake_job``): a finished job without a cloud, in milliseconds. The
records are notebooks with ``metadata.spotnb``, as ``spotnb record`` writes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
from nbformat.v4 import new_code_cell, new_notebook

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

import spotnb
from spotnb.client import cli
from spotnb.client.comparison import JobRun, RecordRun, gather
from spotnb.client.jobs import JobHandle
from spotnb.protocol import layout
from spotnb.protocol.events import EventWriter, metrics_data
from spotnb.protocol.events.fold import fold
from spotnb.protocol.spec import JobSpec, Policy, Resources
from spotnb.protocol.store import open_store
from spotnb.widgets.compare import Comparison, table_rows
from spotnb.widgets.plots import values


@pytest.fixture(autouse=True)
def _close_widgets() -> Iterator[None]:
    """The views' widgets are closed after each test: left to the interpreter's exit,
    ipywidgets' ``__del__`` finds its registry gone and complains."""
    yield
    import ipywidgets

    ipywidgets.Widget.close_all()


def fake_job(home: Path, job_id: str, *, lr: float, steps: int = 40,
             interrupt_after: int | None = None, resume_at: int = 0,
             ended: bool = True) -> JobHandle:
    """A job that logged ``loss`` for ``steps`` steps at learning rate ``lr``; with
    ``interrupt_after``, attempt 1 got a notice after that step and attempt 2 resumed
    at ``resume_at`` on another instance."""
    store = open_store(home / "store").child(f"jobs/{job_id}")
    spec = JobSpec(job_id=job_id, name=f"lr{lr}", code="# %%spot_train\nx",
                   provider="local", resources=Resources(instance_types=("g4dn.xlarge",)),
                   policy=Policy(), store_uri=store.uri, created=time.time() - 100)
    store.put(layout.SPEC, spec.to_json().encode())
    t0 = time.time() - 90

    def loss(step: int) -> float:
        return float(2.0 * (1 - lr) ** step)

    def rows(first: int, last: int, at: float) -> dict[str, Any]:
        return metrics_data([(s, at + s * 0.1, {"loss": loss(s)})
                             for s in range(first, last)])

    group = EventWriter(store, 0)
    group.emit("instance", action="launched", instance_id="i-1", instance_type="g4dn.xlarge",
               az="use1-az1", pool="g4dn.xlarge@use1-az1", price=0.2, ondemand=0.526)
    group.close()
    first = EventWriter(store, 1, "i-1")
    first.emit("status", state="booting", instance_type="g4dn.xlarge", az="use1-az1")
    first.emit("params", params={"lr": lr, "batch": 32})
    end1 = steps if interrupt_after is None else interrupt_after + 1
    first.emit("metrics", **rows(0, end1, t0))
    last = 2
    if interrupt_after is not None:
        first.emit("notice", kind="instance-action", action="terminate")
        first.close()
        group = EventWriter(store, 0)
        group.emit("instance", action="notice", instance_id="i-1", reason="requested")
        group.emit("instance", action="terminated", instance_id="i-1")
        group.emit("instance", action="launched", instance_id="i-2",
                   instance_type="g4dn.xlarge", az="use1-az1", pool="g4dn.xlarge@use1-az1",
                   price=0.2, ondemand=0.526)
        group.close()
        second = EventWriter(store, 2, "i-2")
        second.emit("status", state="booting", instance_type="g4dn.xlarge", az="use1-az1")
        second.emit("params", params={"lr": lr, "batch": 32})
        second.emit("metrics", **rows(resume_at, steps, t0 + 30))
        writer = second
    else:
        writer, last = first, 1
    if ended:
        writer.emit("result", status="completed", reason="the cell finished")
    writer.close()
    if ended:
        group = EventWriter(store, 0)
        group.emit("instance", action="terminated", instance_id=f"i-{last}")
        group.close()
        store.put(layout.RESULT, json.dumps({"status": "completed",
                                             "reason": "the cell finished",
                                             "attempt": last}).encode())
    return JobHandle(store, spec)


def test_two_finished_jobs_give_runs_with_metrics_costs_and_interruptions(
        spotnb_home: Path) -> None:
    fake_job(spotnb_home, "20250101-000000-aaaaaa", lr=0.1, interrupt_after=24,
             resume_at=20)
    fake_job(spotnb_home, "20250101-000000-bbbbbb", lr=0.05)
    runs = gather(["aaaaaa", "bbbbbb"])
    assert [type(r) for r in runs] == [JobRun, JobRun]
    a, b = runs
    assert [r.label for r in runs] == ["lr0.1 aaaaaa", "lr0.05 bbbbbb"]
    assert not a.live and not b.live
    # The curve as it stands: steps 0-39 once (20-24 were redone), a gap at the resume.
    x, _y = a.points("loss")
    assert np.nanmax(x) == 39 and np.count_nonzero(~np.isnan(x)) == 40
    assert np.isnan(x).sum() == 1
    fa, fb = a.facts, b.facts
    assert fa.status == fb.status == "completed"
    assert fa.params == {"lr": 0.1, "batch": 32} and fb.params["lr"] == 0.05
    assert fa.interruptions == 1 and fb.interruptions == 0
    assert fa.redone_steps == 5 and fb.redone_steps == 0
    assert fa.final["loss"] == pytest.approx(2.0 * 0.9 ** 39)
    assert fa.best["loss"] == pytest.approx(2.0 * 0.9 ** 39)
    assert fb.final["loss"] == pytest.approx(2.0 * 0.95 ** 39)
    # The facts are the fold's: what the job's summary says.
    summary_a = a.handle.summary()
    assert fa.cost_usd == pytest.approx(summary_a.cost_usd)
    assert fa.savings_pct == pytest.approx(summary_a.savings_pct)
    assert fa.duration_s == pytest.approx(summary_a.duration)
    assert fa.cost_usd > 0 and fa.savings_pct == pytest.approx(100 * (1 - 0.2 / 0.526))
    (mark,) = a.marks
    assert (mark.attempt, mark.reason, mark.step, mark.redone) == (1, "interrupted", 24, 5)
    assert b.marks == []


def test_breaks_come_from_the_fold_of_rows_or_batches(spotnb_home: Path) -> None:
    handle = fake_job(spotnb_home, "20250101-000000-cccccc", lr=0.1, interrupt_after=9,
                      resume_at=5)
    from spotnb.protocol.events import EventReader, expand

    batches = EventReader(handle.store, batches=True).poll()
    rows = [r for e in batches for r in expand(e)]
    for events in (batches, rows):
        (brk,) = fold(events).breaks(final=True)
        assert (brk.attempt, brk.step, brk.resumed_at, brk.redone) == (1, 9, 5, 5)
        assert fold(events).redone_steps() == 5


def test_a_job_record_keeps_where_each_attempt_stopped(spotnb_home: Path) -> None:
    from spotnb.records import job_record

    handle = fake_job(spotnb_home, "20250101-000000-qqqqqq", lr=0.1, interrupt_after=24,
                      resume_at=20)
    record = job_record(handle)
    (brk,) = record["breaks"]
    assert brk["reason"] == "interrupted" and brk["time"].endswith("Z")
    assert (brk["attempt"], brk["step"], brk["resumed_at"], brk["redone"]) == (1, 24, 20, 5)
    assert record["redone_steps"] == 5
    # A record of it compares as the job does.
    path = write_record(spotnb_home / "q.record.ipynb", record, {})
    (run,) = gather([str(path)])
    assert run.marks[0].step == 24 and run.facts.redone_steps == 5


def test_comparing_reads_each_job_once_as_a_reattach_does(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for n, lr in enumerate((0.1, 0.05, 0.02)):
        fake_job(spotnb_home, f"20250101-00000{n}-dddd0{n}", lr=lr, interrupt_after=9,
                 resume_at=5)
    from spotnb.protocol.store import LocalStore

    reads: dict[str, int] = {"list": 0, "get": 0}
    real_list, real_get = LocalStore.list_keys, LocalStore.get

    def counted_list(self: Any, *a: Any, **k: Any) -> Any:
        reads["list"] += 1
        return real_list(self, *a, **k)

    def counted_get(self: Any, *a: Any, **k: Any) -> Any:
        reads["get"] += 1
        return real_get(self, *a, **k)

    monkeypatch.setattr(LocalStore, "list_keys", counted_list)
    monkeypatch.setattr(LocalStore, "get", counted_get)
    from spotnb.client import display
    from spotnb.client.display import TextRenderer

    # %spot_attach's reads: finding the job, then following it (its whole history).
    display.follow(spotnb.attach("dddd00"), TextRenderer())
    one = dict(reads)
    before = dict(reads)
    runs = gather(["dddd00", "dddd01", "dddd02"])
    three = {k: reads[k] - before[k] for k in reads}
    assert len(runs) == 3 and one["list"] >= 1
    assert three["list"] <= 3 * one["list"], (one, three)
    assert three["get"] <= 3 * one["get"], (one, three)


def test_the_view_overlays_runs_with_a_colour_each_and_marks_in_that_colour(
        spotnb_home: Path) -> None:
    fake_job(spotnb_home, "20250101-000000-eeeeee", lr=0.1, interrupt_after=24,
             resume_at=20)
    fake_job(spotnb_home, "20250101-000000-ffffff", lr=0.05)
    view = spotnb.compare("eeeeee", "ffffff")
    assert isinstance(view, Comparison) and not view.following
    lines = [t for t in view.figure.plot_data if t["mode"] == "lines"
             and not t.get("meta", {}).get("marks") and t.get("meta")]
    assert [t["name"] for t in lines] == ["lr0.1 eeeeee", "lr0.05 ffffff"]
    assert {t["yaxis"] for t in lines} == {"y"}  # one panel, both runs
    colours = [t["line"]["color"] for t in lines]
    assert len(set(colours)) == 2
    marks = [t for t in view.figure.plot_data if t.get("meta", {}).get("marks")]
    assert marks[0]["line"]["color"] == colours[0] and marks[0]["line"]["dash"] == "dash"
    assert set(values(marks[0], "x")[~np.isnan(values(marks[0], "x"))]) == {24.0}
    assert "attempt 1 interrupted at step 24; 5 steps redone" in marks[0]["text"]
    assert len(values(marks[1], "x")) == 0

    # The table: parameters, metrics, money, interruptions; sorted by any column.
    labels = [c["label"] for c in view.table.columns]
    assert len(labels) == len(set(labels)), labels
    # The best value logged named by what it is (for a loss, the lowest).
    for label in ("run", "status", "lr", "batch", "last loss", "lowest loss", "duration",
                  "cost $", "refunded $", "saved", "interruptions", "redone steps"):
        assert label in labels, labels
    view.table.sort_key = "param:lr"
    assert [r["id"] for r in view.table.rows] == ["lr0.05 ffffff", "lr0.1 eeeeee"]
    view.table.descending = True
    assert [r["id"] for r in view.table.rows] == ["lr0.1 eeeeee", "lr0.05 ffffff"]
    view.table.sort_key = "interruptions"
    view.table.descending = False
    assert [r["cells"]["interruptions"] for r in view.table.rows] == ["0", "1"]

    # A click on a row hides that run's curves and marks; another shows them again.
    view.table.chosen = ["lr0.1 eeeeee"]
    hidden = [t for t in view.figure.plot_data if t.get("meta", {}).get("run") == "lr0.1 eeeeee"]
    assert hidden and all(t["visible"] == "legendonly" for t in hidden)
    view.table.chosen = []
    assert all(t["visible"] is True for t in view.figure.plot_data if t.get("meta"))
    assert "lr0.1 eeeeee" in view.text() and "interruptions" in view.text()


def test_a_live_run_keeps_updating_until_it_ends(spotnb_home: Path) -> None:
    from helpers import wait_until

    handle = fake_job(spotnb_home, "20250101-000000-gggggg", lr=0.1, steps=10, ended=False)
    fake_job(spotnb_home, "20250101-000000-hhhhhh", lr=0.05)
    view = spotnb.compare("gggggg", "hhhhhh")
    try:
        live = view.runs[0]
        assert live.live and view.following
        assert "(live)" in view.table.rows[0]["cells"]["status"]
        writer = EventWriter(handle.store, 1, "i-1")
        writer.emit("metrics", **metrics_data([(s, time.time(), {"loss": 0.01})
                                               for s in range(10, 20)]))
        writer.emit("result", status="completed", reason="the cell finished")
        writer.close()
        handle.store.put(layout.RESULT, json.dumps({"status": "completed", "reason": "",
                                                    "attempt": 1}).encode())
        wait_until(lambda: not view.following, 30, "the comparison sees the job end")
        x, _y = live.points("loss")
        assert np.nanmax(x) == 19
        assert live.facts.status == "completed" and not live.live
        line = next(t for t in view.figure.plot_data if t["name"] == live.label)
        assert np.nanmax(values(line, "x")) == 19
    finally:
        view.close()


def test_runs_added_later_join_the_view_and_are_followed(spotnb_home: Path) -> None:
    from helpers import wait_until

    fake_job(spotnb_home, "20250101-000000-nnnnnn", lr=0.1)
    handle = fake_job(spotnb_home, "20250101-000000-pppppp", lr=0.05, steps=5, ended=False)
    view = spotnb.compare("nnnnnn")
    try:
        assert not view.following
        (added,) = view.add("pppppp", "nnnnnn")[:1]
        assert [r.label for r in view.runs] == ["lr0.1 nnnnnn", "lr0.05 pppppp",
                                                "lr0.1 nnnnnn (2)"]
        assert view.following and added.live
        colours = {t["line"]["color"] for t in view.figure.plot_data
                   if t.get("meta") and not t["meta"].get("marks")}
        assert len(colours) == 3
        writer = EventWriter(handle.store, 1, "i-1")
        writer.emit("result", status="completed", reason="the cell finished")
        writer.close()
        handle.store.put(layout.RESULT, json.dumps({"status": "completed", "reason": "",
                                                    "attempt": 1}).encode())
        wait_until(lambda: not view.following, 30, "the added run's end is seen")
        assert added.facts.status == "completed"
    finally:
        view.close()


# -- records --------------------------------------------------------------------------

def record_job(name: str, lr: float, interrupted: bool) -> dict[str, Any]:
    steps = list(range(0, 50, 2))
    return {
        "job_id": f"20250101-000000-{name}", "name": "train", "status": "completed",
        "params": {"lr": lr}, "duration_s": 61.0 + lr, "cost_usd": 0.01 * lr,
        "ondemand_cost_usd": 0.05, "savings_pct": 80.0, "interruptions": int(interrupted),
        "redone_steps": 4 if interrupted else 0,
        "breaks": ([{"attempt": 1, "reason": "interrupted", "time": "2025-01-01T00:00:30Z",
                     "step": 24, "resumed_at": 20, "redone": 5}] if interrupted else []),
        "attempts": [{"number": 1, "pool": "g4dn.xlarge@a"}],
        "final_metrics": {"loss": 2 * (1 - lr) ** 48, "accuracy": 0.9 + lr / 10},
        "curves": {"loss": {"step": steps, "value": [2 * (1 - lr) ** s for s in steps]},
                   "accuracy": {"step": steps, "value": [0.5 + s / 100 + lr / 10
                                                         for s in steps]}},
    }


def write_record(path: Path, job: dict[str, Any], parameters: dict[str, Any]) -> Path:
    nb = new_notebook(cells=[new_code_cell("%load_ext spotnb")])
    nb.metadata["spotnb"] = {"schema": 1, "run": {"notebook": "train.ipynb",
                                                  "status": "completed",
                                                  "parameters": parameters,
                                                  "duration_s": 70.0},
                             "jobs": [job], "totals": {}}
    nbformat.write(nb, path)
    return path


@pytest.fixture
def three_records(tmp_path: Path) -> list[Path]:
    return [write_record(tmp_path / f"run-{n}.record.ipynb",
                         record_job(f"00000{n}", lr, interrupted=n == 1), {"LR": lr})
            for n, lr in enumerate((0.1, 0.05, 0.2))]


def test_records_give_runs_with_their_curves_breaks_and_figures(
        three_records: list[Path]) -> None:
    runs = gather([str(p) for p in three_records])
    assert [type(r) for r in runs] == [RecordRun] * 3
    assert [r.label for r in runs] == ["run-0", "run-1", "run-2"]
    r = runs[1]
    x, y = r.points("loss")
    assert len(x) == 25 and y[0] == 2.0
    (mark,) = r.marks
    assert (mark.step, mark.redone, mark.reason) == (24, 5, "interrupted")
    f = r.facts
    assert f.params == {"LR": 0.05, "lr": 0.05} and f.interruptions == 1
    assert f.best["accuracy"] == pytest.approx(0.5 + 48 / 100 + 0.005)  # higher is better
    assert f.best["loss"] == pytest.approx(2 * 0.95 ** 48)  # lower is better
    _columns, rows = table_rows(runs)
    assert [row["cells"]["interruptions"] for row in rows] == ["0", "1", "0"]


def test_records_compare_takes_any_number_of_records(
        three_records: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figure = tmp_path / "three.png"
    assert cli.main(["records", "compare", *map(str, three_records), "-o", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "A: " in out and "B: " in out and "C: " in out
    import re

    assert re.search(r"^\* LR\s+0\.1\s+0\.05\s+0\.2$", out, re.M), out
    assert re.search(r"^\* interruptions\s+0\s+1\s+0$", out, re.M), out
    from PIL import Image

    with Image.open(figure) as image:
        rgb = np.asarray(image.convert("RGB"))
    assert rgb.shape[1] >= 800
    # Three runs, three colours, one of them dashed at the interruption: its colour
    # appears in a vertical run of pixels (the mark), not only along the curve.
    from spotnb.records.figures import RUN_COLOURS

    def hex_rgb(colour: str) -> np.ndarray:
        return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])

    def near(colour: str) -> np.ndarray:
        return np.abs(rgb - hex_rgb(colour)).sum(axis=2) < 60

    for colour in RUN_COLOURS[:3]:
        assert near(colour).sum() > 50, colour
    # Only B was interrupted: a column of its colour in each panel (dashed: about half).
    columns = [near(c).sum(axis=0).max() for c in RUN_COLOURS[:3]]
    assert columns[1] > 150 and columns[0] < 60 and columns[2] < 60, columns


# -- the magic, in a real kernel ---------------------------------------------------------

def test_spot_compare_in_a_kernel_shows_both_runs_and_refuses_an_unknown_one(
        spotnb_home: Path, tmp_path: Path, three_records: list[Path]) -> None:
    from jupyter_client.manager import start_new_kernel

    fake_job(spotnb_home, "20250101-000000-kkkkkk", lr=0.1, interrupt_after=24, resume_at=20)
    fake_job(spotnb_home, "20250101-000000-mmmmmm", lr=0.05)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        kc.execute_interactive("%load_ext spotnb", timeout=60)
        messages: list[dict[str, Any]] = []
        reply = kc.execute_interactive(f"%spot_compare kkkkkk mmmmmm {three_records[1]}",
                                       timeout=60, output_hook=messages.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        # The figure's widget opens with both jobs' curves and the record's in one panel.
        figures = [m["content"]["data"]["state"] for m in messages
                   if m["msg_type"] in ("comm_open", "comm_msg")
                   and "plot_data" in m["content"]["data"].get("state", {})]
        lines = [t for t in figures[-1]["plot_data"] if t.get("meta", {}).get("run")
                 and not t["meta"].get("marks") and t["yaxis"] == "y"]  # the loss panel
        assert [t["name"] for t in lines] == ["lr0.1 kkkkkk", "lr0.05 mmmmmm", "run-1"]
        assert len({t["line"]["color"] for t in lines}) == 3
        (result, static) = [m["content"] for m in messages if m["msg_type"] == "display_data"]
        assert "application/vnd.jupyter.widget-view+json" in result["data"]
        assert "lr0.1 kkkkkk" in result["data"]["text/plain"]
        assert "run-1" in result["data"]["text/plain"]
        # For readers without widgets (a notebook saved under JupyterLab's defaults, its
        # HTML export): the runs ended, so the picture of their curves and their table.
        assert static["metadata"]["spotnb"]["figure"] == "compare"
        assert "data:image/png;base64," in static["data"]["text/html"]
        assert "lr0.1 kkkkkk" in static["data"]["text/html"]

        errors: list[dict[str, Any]] = []
        kc.execute_interactive("%spot_compare kkkkkk no-such-job", timeout=60,
                               output_hook=errors.append)
        # IPython writes a UsageError to stderr, without a traceback.
        stderr = "".join(m["content"]["text"] for m in errors
                         if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
        assert "UsageError" in stderr and "no-such-job" in stderr, stderr
        errors.clear()
        kc.execute_interactive("%spot_compare kkkkkk missing.ipynb", timeout=60,
                               output_hook=errors.append)
        stderr = "".join(m["content"]["text"] for m in errors
                         if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
        assert "UsageError" in stderr and "missing.ipynb is not a notebook" in stderr, stderr
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
