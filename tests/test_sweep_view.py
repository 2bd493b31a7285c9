"""A sweep's view, analysis and static copy, over trials' jobs written as the agents and
the group leave them (``test_compare.fake_job``): no cloud, in seconds.

What is checked is what a person reads: parameters rounded, the objective and the
best logged value named apart, pruned and interrupted trials marked, Optuna's
importance (or why not), the cost that never decreases with refunds shown as such, a
trial's row opening its dashboard, the static picture for readers without widgets;
and the bits under them: which metrics a cell can log, the kernel's status kept busy.
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

pytest.importorskip("optuna", reason="optuna is not installed: pip install -e '.[dev]'")
pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from test_compare import fake_job

from spotnb.client.jobs import JobHandle
from spotnb.protocol import layout
from spotnb.protocol.events import EventWriter
from spotnb.protocol.store import open_store
from spotnb.sweep.analysis import axes, importance, table_columns, table_rows, trial_rows
from spotnb.sweep.budget import SweepCost
from spotnb.sweep.metric import cell_metrics, missing_metric
from spotnb.sweep.runner import Sweep
from spotnb.sweep.state import Trial, trial_label
from spotnb.sweep.trials import TrialRun, tell_job
from spotnb.sweep.view import header_lines


@pytest.fixture(autouse=True)
def _close_widgets() -> Iterator[None]:
    yield
    import ipywidgets

    ipywidgets.Widget.close_all()


def _job(home: Path, n: int, lr: float, **kw: Any) -> JobHandle:
    return fake_job(home, f"20250101-000000-{n:06d}", lr=lr, **kw)


def _sweep(home: Path, trials: list[tuple[dict[str, Any], str, JobHandle | None]],
           direction: str = "minimize") -> Sweep:
    """A sweep over these trials (parameters, state, job), as attach finds it."""
    definition = {"sweep_id": "sweep-20250101-000000-abcdef", "name": "fake",
                  "metric": "loss", "parallel": 2, "direction": direction,
                  "created": time.time() - 100, "budget_usd": None}
    made = Sweep(open_store(home / "store"), definition, [])
    for number, (params, state, handle) in enumerate(trials):
        trial = Trial(number, params, job_id=handle.job_id if handle else None, state=state)
        made.trials.append(trial)
        if handle is not None:
            tell_job(handle, "params", params=params, source="sweep")
            run = TrialRun(handle, trial, trial_label(trial))
            run.replay(follow=False)
            made.runs[number] = run
            if state == "completed":
                trial.value = run.facts.final.get("loss")
    made.status = "completed"
    return made


def _prune(handle: JobHandle, step: int, value: float) -> None:
    """The job as a sweep's pruner leaves it: its pruned event, then stopped."""
    tell_job(handle, "pruned", step=step, metric="loss", value=value,
             sweep="sweep-20250101-000000-abcdef", trial=3)
    handle.store.delete(layout.RESULT)
    handle.store.put(layout.RESULT, json.dumps(
        {"status": "stopped", "reason": "stop requested (pruned)"}).encode())


def test_rows_round_parameters_and_name_the_objective_and_the_best_apart(
        spotnb_home: Path) -> None:
    lrs = [0.03028525153605885, 0.1, 0.003, 0.5]
    handles = [_job(spotnb_home, n, lr=lr, steps=30) for n, lr in enumerate(lrs)]
    _prune(handles[3], 12, 0.4452)
    made = _sweep(spotnb_home, [({"lr": lrs[0], "hidden": 128}, "completed", handles[0]),
                                ({"lr": lrs[1], "hidden": 64}, "completed", handles[1]),
                                ({"lr": lrs[2], "hidden": 64}, "completed", handles[2]),
                                ({"lr": lrs[3], "hidden": 32}, "pruned", handles[3])])
    rows = trial_rows(made)
    columns, shown = table_columns(made, rows), table_rows(made, rows)
    labels = [c["label"] for c in columns]
    assert "loss (last: objective)" in labels and "lowest loss logged" in labels
    cells = {r["id"]: r["cells"] for r in shown}
    assert cells["t0"]["param:lr"] == "0.03029" and cells["t0"]["param:hidden"] == "128"
    assert trial_label(made.trials[0]) == "t0 lr=0.03029, hidden=128"
    # The pruned trial: its state, where and why, from its job's own pruned event.
    assert cells["t3"]["state"] == "pruned"
    assert cells["t3"]["note"] == "pruned at step 12 (loss 0.4452)"
    assert made.runs[3].facts.status == "pruned"
    # The header names the best objective with its trial; the lowest logged is the
    # table's, named so.
    lines = header_lines(made)
    best = min(range(3), key=lambda n: made.trials[n].value or 1e9)
    assert lines[1].startswith(f"best trial t{best}: loss ") and "the objective" in lines[1]
    assert "0.03029" in lines[1] or best != 0


def test_objective_and_lowest_logged_differ_where_the_curve_went_back_up(
        spotnb_home: Path) -> None:
    handle = _job(spotnb_home, 0, lr=0.1, steps=20)
    # Attempt 1 logs a last row higher than the rest: its last value is not its lowest.
    writer = EventWriter(handle.store, 1, "i-1")
    writer.emit("metric", step=25, t=time.time(), values={"loss": 5.0})
    writer.close()
    made = _sweep(spotnb_home, [({"lr": 0.1}, "completed", handle)])
    (row,) = trial_rows(made)
    assert row.objective == 5.0 and row.best_logged is not None and row.best_logged < 5.0


def test_importance_needs_enough_completed_trials_and_says_so(spotnb_home: Path) -> None:
    few = _sweep(spotnb_home, [({"lr": 0.1}, "completed", _job(spotnb_home, 0, lr=0.1)),
                               ({"lr": 0.2}, "completed", _job(spotnb_home, 1, lr=0.2))])
    found = importance(trial_rows(few), "minimize")
    assert not found.values and "needs 3 completed trials; 2 so far" in found.why
    lrs = [0.01, 0.03, 0.1, 0.2, 0.3]
    many = _sweep(spotnb_home, [({"lr": lr, "batch": 32 * (1 + n % 2)}, "completed",
                                 _job(spotnb_home, 10 + n, lr=lr))
                                for n, lr in enumerate(lrs)])
    found = importance(trial_rows(many), "minimize")
    assert set(found.values) == {"lr", "batch"} and not found.why
    assert found.values["lr"] > found.values["batch"]  # the loss follows lr alone
    assert abs(sum(found.values.values()) - 1.0) < 1e-6


def test_parallel_coordinates_mark_pruned_and_interrupted_trials(spotnb_home: Path) -> None:
    a = _job(spotnb_home, 0, lr=0.001)
    b = _job(spotnb_home, 1, lr=0.3, interrupt_after=24, resume_at=20)
    c = _job(spotnb_home, 2, lr=0.5, steps=10)
    _prune(c, 8, 0.1)
    made = _sweep(spotnb_home, [({"lr": 0.001}, "completed", a),
                                ({"lr": 0.3}, "completed", b), ({"lr": 0.5}, "pruned", c),
                                ({"lr": 0.05}, "waiting", None)])
    dims, drawn = axes(trial_rows(made), "loss")
    assert [d.name for d in dims] == ["lr", "state", "interruptions", "loss (objective)"]
    assert [r.number for r in drawn] == [0, 1, 2]  # the waiting trial has no value yet
    lr, state, interruptions, _objective = dims
    assert lr.log  # 0.001 .. 0.5: a log axis, ticked by decades
    assert [t for _v, t in state.ticks] == ["completed", "pruned"]
    assert state.values == (0.0, 0.0, 1.0)
    assert interruptions.values == (0.0, 1.0, 0.0)


def test_the_view_draws_the_analysis_and_a_row_opens_the_trial_s_dashboard(
        spotnb_home: Path) -> None:
    from spotnb.widgets.sweep import SweepView

    lrs = [0.01, 0.05, 0.1, 0.2]
    handles = [_job(spotnb_home, n, lr=lr, interrupt_after=20 if n == 1 else None)
               for n, lr in enumerate(lrs)]
    made = _sweep(spotnb_home, [({"lr": lr}, "completed", h) for lr, h in zip(lrs, handles,
                                                                             strict=True)])
    view = SweepView(made)
    kinds = [t["type"] for t in view.analysis.plot_data]
    assert kinds.count("parcoords") == 1 and "bar" in kinds  # 4 completed: importance
    parcoords = next(t for t in view.analysis.plot_data if t["type"] == "parcoords")
    # The losses span 500x: the objective's axis is logarithmic, and so its colours.
    objective = parcoords["dimensions"][-1]
    assert objective["label"] == "loss (objective) (log)"
    assert parcoords["line"]["color"] == pytest.approx(
        [math.log10(r.objective or 0) for r in trial_rows(made)])
    assert objective["values"] == parcoords["line"]["color"]
    scatters = [t for t in view.analysis.plot_data if t["type"] == "scatter"
                and t["xaxis"] == "x"]
    symbols = [s for t in scatters for s in t["marker"]["symbol"]]
    assert symbols.count("diamond") == 1  # the interrupted trial
    assert [r["id"] for r in view.table.rows] == ["t0", "t1", "t2", "t3"]
    # A click on a row (what the table's front end sets): that trial's own dashboard.
    view.table.chosen = ["t1"]
    board = view.dashboard
    assert board is not None and board.widget in view.slot.children
    wait_until(lambda: board.view is not None and board.view.state == "completed", 30,
               "the trial's dashboard to replay its job")
    assert board.handle is not None and board.handle.job_id == handles[1].job_id
    assert board.view.interruptions == 1 and "loss" in board.data.metric_names()
    # A second click closes it.
    view.table.chosen = []
    assert view.dashboard is None and view.slot.children == ()


def test_the_static_copy_is_a_picture_and_a_table_with_no_script(spotnb_home: Path) -> None:
    from spotnb.widgets.sweep import SweepView

    handles = [_job(spotnb_home, n, lr=lr) for n, lr in enumerate([0.01, 0.05, 0.1])]
    made = _sweep(spotnb_home, [({"lr": h.spec.name}, "completed", h) for h in handles])
    view = SweepView(made)
    copy_ = view.static_bundle()
    assert copy_ is not None
    data, meta = copy_
    assert meta["spotnb"]["figure"] == "sweep" and meta["spotnb"]["job_ids"] == \
        [h.job_id for h in handles]
    page = data["text/html"]
    assert "<script" not in page and "http" not in page
    encoded = page.split("data:image/png;base64,", 1)[1].split("'", 1)[0]
    assert base64.b64decode(encoded).startswith(b"\x89PNG")
    assert "spotnb-live-sweep-20250101-000000-abcdef" in page  # hidden by the live one
    assert "t2" in page and "lowest loss logged" in page
    assert data["text/plain"].startswith("spotnb sweep fake completed: 3 trials")
    # The view's own output reads as its header and table without widgets, too.
    bundle = view.bundle()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "lowest loss logged" in bundle["text/html"] and "<script" not in bundle["text/html"]


def test_refunds_are_shown_as_such_and_the_cost_never_drops(spotnb_home: Path) -> None:
    from spotnb.client.comparison import gather
    from spotnb.widgets.compare import table_rows as compare_rows

    # Attempt 1's instance was interrupted by EC2 in its first hour: refunded.
    handle = _job(spotnb_home, 0, lr=0.1, interrupt_after=24, resume_at=20)
    group = EventWriter(handle.store, 0)
    group.emit("instance", action="terminated", instance_id="i-1",
               reason="spot-interruption")
    group.close()
    (run,) = gather([handle.job_id], follow=False)
    facts = run.facts
    assert facts.refunded_instances == 1 and facts.refunded_usd > 0
    assert facts.gross_usd == pytest.approx(facts.cost_usd + facts.refunded_usd)
    _columns, rows = compare_rows([run])
    assert rows[0]["cells"]["refunded"] == f"{facts.refunded_usd:.4f}"
    assert rows[0]["values"]["cost"] == facts.gross_usd
    cost = SweepCost(0.0021, 0.0046, 0.0230, 3)
    assert cost.cost_usd == pytest.approx(0.0067)
    assert cost.text() == ("cost $0.0067; $0.0046 refunded: EC2 interrupted 3 instances "
                           "in their first hour; billed $0.0021, 91% under on-demand "
                           "($0.0230)")


def test_which_metrics_a_cell_can_log() -> None:
    closed = cell_metrics("for s in range(3):\n    spot.log(s, loss=1.0, val_acc=0.5)\n")
    assert closed.closed and closed.names == ("loss", "val_acc")
    assert missing_metric("val_accuracy", closed) == (
        "the cell never logs 'val_accuracy': its spot.log calls name loss, val_acc "
        "(did you mean val_acc?)")
    assert missing_metric("loss", closed) is None
    # What the cell cannot show closes nothing: none of these is refused.
    for code, inputs, why in [
            ("spot.log(0, **metrics)", {}, "**"),
            ("t = T(callbacks=[spot.callbacks.for_transformers()])", {}, "spot.callbacks"),
            ("train(spot)", {}, "hands the runtime"),
            ("spot.log(0, loss=1)\nevaluate(model)", {"evaluate": print.__call__}, ""),
            ("spot.log(0, loss=1)\nevaluate(model)", {"evaluate": lambda m: m},
             "other cells")]:
        found = cell_metrics(code, inputs)
        if why:
            assert not found.closed and why in found.why_open, (code, found)
            assert missing_metric("val_loss", found) is None


def test_the_kernel_stays_busy_after_a_control_request_while_a_cell_runs() -> None:
    from test_widgets import _RecordingKernel, _request

    from spotnb.widgets.kernel import _StatusKeeper

    kernel = _RecordingKernel()
    keeper = _StatusKeeper(kernel)
    cell, sub = _request("cell", "execute_request"), _request("sub", "create_subshell_request")
    kernel.parent = cell
    keeper("busy", "shell", cell)
    # JupyterLab asks for a subshell (the control channel) while the cell runs: its
    # idle is followed by busy on the cell's behalf.
    keeper("busy", "control", sub)
    keeper("idle", "control", sub)
    keeper("idle", "shell", cell)
    assert kernel.published == [("busy", "cell"), ("busy", "sub"), ("idle", "sub"),
                                ("busy", "cell"), ("idle", "cell")]
    keeper("busy", "control", sub)  # no cell runs: the idle stays the last word
    keeper("idle", "control", sub)
    assert kernel.published[-1] == ("idle", "sub")


def test_a_comparison_of_ended_runs_leaves_a_static_copy(spotnb_home: Path) -> None:
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output

    import spotnb

    start_ipython()  # a shell to display into
    a = _job(spotnb_home, 0, lr=0.1)
    b = _job(spotnb_home, 1, lr=0.05)
    # A sweep's trial: its parameters in its log (the cell logged lr itself).
    tell_job(a, "params", params={"wd": 0.030285251536}, source="sweep")
    comparison = spotnb.compare(a.job_id, b.job_id, follow=False)
    with capture_output() as shown:
        comparison.show()
    (view, static) = shown.outputs
    assert "application/vnd.jupyter.widget-view+json" in view.data
    assert static.metadata["spotnb"]["figure"] == "compare"
    page = static.data["text/html"]
    assert "data:image/png;base64," in page and "<script" not in page
    # The trials' parameters are columns, rounded (from the jobs' params events).
    assert ">wd<" in page and ">0.03029<" in page and ">lr<" in page
