"""Runs overlaid: ``%spot_compare`` and ``spotnb.compare(...)``.

One panel per metric (the dashboard's layout, :mod:`spotnb.widgets.plots`), a colour
per run, each run's interruptions as dashed vertical lines in its colour (hover: the
attempt, the step, the steps redone); below it a table of the runs (parameters, final
and best value of each metric, duration, cost, saving, interruptions, steps redone)
that sorts by a click on a header. A click on a run's row, or on its legend entry,
hides it (again: shows it). As on the dashboard, the panels' x axes are linked (a
zoom on one zooms them all), each panel has its own log-scale checkbox, and the
smoothing slider draws each run's curve smoothed (the dashboard's :func:`ema`, weighted
by the step gap) over its faded raw curve. The x axis is the step: a record keeps its
curves against step only.

The runs come from :func:`spotnb.client.comparison.gather`. A live one is followed in a
thread of the comparison's own (:func:`spotnb.client.comparison.follow_until_ended`), so the
cell returns at once and the figure and the table keep up, redrawn at most every
:data:`FLUSH_SECONDS`; each draw sends every trace's bounded series in one message,
as the dashboard does.

Where widgets do not draw (a notebook reopened without its widget state, an HTML
export read offline, a record), :meth:`Comparison.show` leaves the comparison as a
picture of its curves and its table (:func:`spotnb.widgets.static_sweep.compare_bundle`),
hidden next to the live figure; a comparison of live runs gets it once they have ended.
"""

from __future__ import annotations

import html
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from spotnb.client.comparison import Run, follow_until_ended, higher_is_better
from spotnb.records.figures import RUN_COLOURS
from spotnb.widgets.plots import (
    SMOOTHING_SCALE,
    Panel,
    PlotOptions,
    binary,
    ema,
    figure_layout,
    mark_points,
    scatter,
    y_span,
)

__all__ = ["FLUSH_SECONDS", "RUN_COLOURS", "Comparison", "table_rows"]

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
_UIREVISION = "spotnb-compare"  # the user's zoom and legend clicks survive updates


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def table_rows(runs: Sequence[Run]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The table's columns and rows (each row with ``values``: what it sorts by)."""
    facts = [run.facts for run in runs]
    params = list(dict.fromkeys(k for f in facts for k in f.params))
    metrics = list(dict.fromkeys(k for f, run in zip(facts, runs, strict=True)
                                 for k in [*run.metric_names(), *f.final]))
    columns: list[dict[str, Any]] = [
        {"key": "run", "label": "run", "frozen": True, "title": "the job, or the record"},
        {"key": "status", "label": "status"}]
    columns += [{"key": f"param:{p}", "label": p, "title": f"parameter {p}"} for p in params]
    for m in metrics:
        better = "highest" if higher_is_better(m) else "lowest"
        columns += [{"key": f"final:{m}", "label": f"last {m}", "numeric": True,
                     "title": f"the last value of {m}"},
                    {"key": f"best:{m}", "label": f"{better} {m}", "numeric": True,
                     "descending_first": higher_is_better(m),
                     "title": f"the {better} value of {m} logged at any step"}]
    columns += [
        {"key": "duration", "label": "duration", "numeric": True},
        {"key": "cost", "label": "cost $", "numeric": True,
         "title": "instances at the spot price and spotnb's own requests, refunds "
                  "included (it never decreases)"},
        {"key": "refunded", "label": "refunded $", "numeric": True,
         "title": "what EC2 refunds: instances it interrupted in their first hour"},
        {"key": "saved", "label": "saved", "numeric": True, "descending_first": True,
         "title": "what is billed (cost less refunds) against the same instance time "
                  "on-demand"},
        {"key": "interruptions", "label": "interruptions", "numeric": True},
        {"key": "redone", "label": "redone steps", "numeric": True,
         "title": "steps logged again after an interruption"},
    ]
    rows = []
    for n, (run, f) in enumerate(zip(runs, facts, strict=True)):
        values: dict[str, Any] = {"run": run.label, "status": f.status,
                                  "duration": f.duration_s, "cost": f.gross_usd,
                                  "refunded": f.refunded_usd,
                                  "saved": f.savings_pct, "interruptions": f.interruptions,
                                  "redone": f.redone_steps}
        cells = {"run": run.label, "status": f.status + (" (live)" if run.live else ""),
                 "duration": _duration(f.duration_s), "cost": _fmt(f.gross_usd, ".4f"),
                 "refunded": _fmt(f.refunded_usd, ".4f") if f.refunded_usd else "-",
                 "saved": "-" if f.savings_pct is None else f"{f.savings_pct:.0f}%",
                 "interruptions": str(f.interruptions), "redone": str(f.redone_steps)}
        for p in params:
            values[f"param:{p}"] = f.params.get(p)
            cells[f"param:{p}"] = _fmt(f.params.get(p)) if p in f.params else "-"
        for m in metrics:
            values[f"final:{m}"], values[f"best:{m}"] = f.final.get(m), f.best.get(m)
            cells[f"final:{m}"], cells[f"best:{m}"] = _fmt(f.final.get(m)), _fmt(f.best.get(m))
        rows.append({"id": run.key, "cells": cells, "values": values,
                     "colour": RUN_COLOURS[n % len(RUN_COLOURS)],
                     "titles": {"run": f"{run.source} {run.job_id or ''}".strip(),
                                "status": f.reason}})
    return columns, rows


def _sorted(rows: list[dict[str, Any]], key: str, descending: bool) -> list[dict[str, Any]]:
    """Rows by one column's values; rows without one last, whatever the direction."""
    def value(row: dict[str, Any]) -> Any:
        v = row["values"].get(key)
        return None if isinstance(v, float) and v != v else v

    present = [r for r in rows if value(r) is not None]
    missing = [r for r in rows if value(r) is None]
    numeric = all(isinstance(value(r), (int, float)) for r in present)
    present.sort(key=(lambda r: value(r)) if numeric else (lambda r: str(value(r))),
                 reverse=descending)
    return present + missing


class Comparison:
    """The comparison of ``runs`` (module docstring). ``follow``: follow the live runs
    in a thread until they end (:meth:`close` stops it)."""

    def __init__(self, runs: Sequence[Run], *, follow: bool = True,
                 flush_seconds: float = FLUSH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import ipywidgets as w

        from spotnb.widgets.elements import LiveFigure, Table, plotly_loader
        from spotnb.widgets.static_sweep import live_class

        self.runs = list(runs)
        self.key = f"compare-{secrets.token_hex(4)}"  # its static copy's
        self._static_output: Any = None
        self.flush_seconds = flush_seconds
        self._clock = clock
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._drawn_at = -float("inf")
        self._structure: tuple[Any, ...] | None = None
        self._layout: dict[str, Any] = {}
        self.hidden: set[str] = set()
        self.colours = {run.key: RUN_COLOURS[n % len(RUN_COLOURS)]
                        for n, run in enumerate(self.runs)}
        self.draws = 0
        self.header = w.HTML()
        self.figure = LiveFigure(layout=w.Layout(width="100%"))
        self.table = Table(table_class="spotnb-compare-table", number_chosen=False,
                           row_title="click to hide (or show) the curves of",
                           layout=w.Layout(width="100%"))
        self.table.observe(self._on_table, names=["sort_key", "descending", "chosen"])
        self.options = PlotOptions()
        self.smoothing = w.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01,
                                       description="smoothing", readout_format=".2f",
                                       continuous_update=False,
                                       style={"description_width": "initial"},
                                       layout=w.Layout(width="19em"))
        self.smoothing.observe(self._on_control, names="value")
        self.log_boxes: dict[str, Any] = {}  # a log-scale checkbox per metric panel
        self.log_bar = w.HBox([w.Label("log scale:")],
                              layout=w.Layout(flex_flow="row wrap", align_items="center",
                                              grid_gap="0 8px"))
        toolbar = w.HBox([self.smoothing, self.log_bar],
                         layout=w.Layout(flex_flow="row wrap", align_items="center",
                                         grid_gap="4px 18px"))
        self.widget = w.VBox([self.header, toolbar, self.figure, plotly_loader(),
                              self.table], layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-compare")
        self.widget.add_class(live_class(self.key))
        self._thread: threading.Thread | None = None
        self._served = False  # the controls' messages go to a subshell
        self.draw()
        if follow:
            self._start_following()

    def serve_while_busy(self) -> None:
        """Take the controls' clicks while a cell runs (a cell that follows the runs,
        as ``%%spot_sweep`` does, or a thread of this comparison)."""
        from spotnb.widgets import kernel

        with self._lock:
            self._served = True
            for widget in (self.table, self.smoothing, *self.log_boxes.values()):
                kernel.serve_while_busy(widget)

    def _start_following(self) -> None:
        """Follow the live runs in a thread, unless one does already."""
        with self._lock:
            if self._thread is not None or self._stop.is_set() or \
                    not any(run.live for run in self.runs):
                return
            self.serve_while_busy()
            self._thread = threading.Thread(target=self._follow, daemon=True,
                                            name="spotnb-compare")
            self._thread.start()

    def add(self, *items: Any, store: str | None = None, follow: bool = True) -> list[Run]:
        """Add runs (what :func:`spotnb.compare` takes: jobs, records, or
        :class:`~spotnb.client.comparison.Run` objects) to the comparison, followed while
        they run (``follow=False``: someone else polls them, as a sweep's driver does,
        and redraws with :meth:`draw`); the runs added."""
        from spotnb.client.comparison import gather

        given = [item for item in items if isinstance(item, Run)]
        others = [item for item in items if not isinstance(item, Run)]
        with self._lock:
            taken = [run.key for run in self.runs]
        new = given + gather(others, store=store,
                             follow=follow and not self._stop.is_set(), taken=taken)
        with self._lock:
            for run in new:
                self.colours[run.key] = RUN_COLOURS[len(self.runs) % len(RUN_COLOURS)]
                self.runs.append(run)
            self.draw()
        if follow:
            self._start_following()
        return new

    def __repr__(self) -> str:
        return f"<spotnb Comparison of {len(self.runs)} runs>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from spotnb.widgets.static_sweep import table_html

        data = dict(self.widget._repr_mimebundle_())
        data["text/plain"] = self.text()
        columns, rows = table_rows(self.runs)
        data["text/html"] = table_html(columns, rows, "spotnb-static-table")
        return data

    def show(self) -> None:
        """Display the comparison, and below it its static copy (module docstring):
        now if every run has ended, else once they have (an update of that output)."""
        from IPython.display import display

        display(self, display_id=True)
        with self._lock:
            live = any(run.live for run in self.runs)
            copy_ = None if live else self.static_bundle()
            if copy_ is not None:
                display(copy_[0], metadata=copy_[1], raw=True)
            elif live:
                self._static_output = display(
                    {"text/plain": self.text()}, raw=True, display_id=True)

    def static_bundle(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The comparison as a picture and a table, one output ``(data, metadata)``
        (None without matplotlib)."""
        from spotnb.widgets.static_sweep import compare_bundle

        with self._lock:
            columns, rows = table_rows(self.runs)
            shown = [{k: v for k, v in row.items() if k != "values"} for row in rows]
            return compare_bundle(self.key, list(self.runs), columns, shown)

    def text(self) -> str:
        """The table of runs as text (for readers without widgets)."""
        columns, rows = table_rows(self.runs)
        header = [c["label"] for c in columns]
        body = [[r["cells"].get(c["key"], "") for c in columns] for r in rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
        return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)
                                   ).rstrip() for line in [header, *body])

    # -- following -------------------------------------------------------------------

    def _follow(self) -> None:
        try:
            while True:
                follow_until_ended(self.runs, on_change=self._maybe_draw,
                                   stop=self._stop.is_set)
                with self._lock:  # a run added meanwhile is followed by this thread
                    if self._stop.is_set() or not any(run.live for run in self.runs):
                        self._thread = None
                        break
        except Exception:
            log.exception("the comparison stopped following its runs")
            with self._lock:
                self._thread = None
        finally:
            self.draw()
            self._update_static()

    def _update_static(self) -> None:
        """The runs have ended: the static copy shown as text until now becomes the
        picture."""
        output, self._static_output = self._static_output, None
        if output is None or any(run.live for run in self.runs):
            return
        copy_ = self.static_bundle()
        if copy_ is not None:
            output.update(copy_[0], metadata=copy_[1], raw=True)

    def _maybe_draw(self) -> None:
        if self._clock() - self._drawn_at >= self.flush_seconds:
            self.draw()

    @property
    def following(self) -> bool:
        """Whether a thread still follows live runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every live run has ended (or ``timeout``); whether they have."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.following

    def close(self) -> None:
        """Stop following (the figure keeps what it shows)."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=10)
        for run in self.runs:
            close = getattr(run, "close", None)
            if close is not None:
                close()

    # -- drawing ---------------------------------------------------------------------

    def _on_table(self, _change: Any = None) -> None:
        with self._lock:
            self.hidden = set(self.table.chosen)
            self.draw()

    def _on_control(self, _change: Any = None) -> None:
        with self._lock:
            self.options.smoothing = float(self.smoothing.value)
            self.options.log_panels = frozenset(
                title for title, box in self.log_boxes.items() if box.value)
            self.draw()

    def _sync_log_boxes(self, names: list[str]) -> None:
        """A log-scale checkbox for each metric panel, in the panels' order."""
        import ipywidgets as w

        if tuple(box.description for box in self.log_bar.children[1:]) == tuple(names):
            return
        for name in names:
            if name not in self.log_boxes:
                box = w.Checkbox(value=False, description=name, indent=False,
                                 tooltip=f"a log y axis for {name}",
                                 style={"description_width": "initial"},
                                 layout=w.Layout(width="auto"))
                box.observe(self._on_control, names="value")
                if self._served:
                    from spotnb.widgets import kernel

                    kernel.serve_while_busy(box)
                self.log_boxes[name] = box
        self.log_bar.children = (self.log_bar.children[0],
                                 *(self.log_boxes[n] for n in names))

    def set_hidden(self, key: str, hidden: bool) -> None:
        """Hide or show a run's curves (what a click on its row does)."""
        chosen = [k for k in self.table.chosen if k != key] + ([key] if hidden else [])
        self.table.chosen = chosen

    def metric_names(self) -> list[str]:
        """Every run's metrics, ``loss`` first, then in the order the runs name them."""
        names: list[str] = []
        for run in self.runs:
            names += [n for n in run.metric_names() if n not in names]
        first = [n for n in names if n == "loss"] or [n for n in names if "loss" in n][:1]
        return first + [n for n in names if n not in first]

    def draw(self) -> None:
        """Redraw the figure, the table and the header from the runs, now."""
        with self._lock:
            self._drawn_at = self._clock()
            self.draws += 1
            self._draw_figure()
            self._draw_table()
            live = sum(1 for run in self.runs if run.live)
            following = f"; following {live} live" if live else ""
            self.header.value = (
                f"<b>{len(self.runs)} run{'s' if len(self.runs) != 1 else ''}</b>"
                f"{following}. <span style='color:#57606a'>Dashed lines: interruptions, "
                "in the run's colour. Click a row or a legend entry to hide (or show) a "
                "run; click a header to sort.</span>")

    def _draw_figure(self) -> None:
        names = self.metric_names()
        self._sync_log_boxes(names)
        panels = [Panel(name, [name], "" if n == 0 else str(n + 1),
                         log=name in self.options.log_panels)
                  for n, name in enumerate(names)]
        structure = (tuple(names), tuple(p.log for p in panels))
        if structure != self._structure or not self._layout:
            self._structure = structure
            self._layout = figure_layout(panels, False, "", None, self.options)
            self._layout["uirevision"] = _UIREVISION
            self._layout["legend"]["groupclick"] = "togglegroup"
        traces: list[dict[str, Any]] = []
        in_legend: set[str] = set()
        any_marks = False
        smoothing = self.options.smoothing
        every = {(panel.title, run.key): run.points(panel.title)
                 for panel in panels for run in self.runs}
        spans = [(x[np.isfinite(x)].min(), x[np.isfinite(x)].max())
                 for x, _y in every.values() if np.isfinite(x).any()]
        span = max(b for _a, b in spans) - min(a for a, _b in spans) if spans else 0.0
        unit = max(span / SMOOTHING_SCALE, 1.0)  # one scale for every curve, as drawn
        for panel in panels:
            axes = {"xaxis": f"x{panel.axis}", "yaxis": f"y{panel.axis}"}
            curves = {run.key: every[panel.title, run.key] for run in self.runs}
            lo, hi = y_span([y for _x, y in curves.values()], panel.log)
            for run in self.runs:
                x, y = curves[run.key]
                colour = self.colours[run.key]
                visible: bool | str = "legendonly" if run.key in self.hidden else True
                show = bool(len(x)) and run.key not in in_legend
                if show:
                    in_legend.add(run.key)
                if smoothing > 0:  # the raw curve, faded, under the smoothed one
                    traces.append(scatter(
                        name=f"{run.label} (raw)", mode="lines", legendgroup=run.key,
                        showlegend=False, visible=visible, opacity=0.3, hoverinfo="skip",
                        line={"color": colour, "width": 1.2}, x=binary(x), y=binary(y),
                        meta={"run": run.key, "raw": True}, **axes))
                    y = ema(y, smoothing, x, unit)
                traces.append(scatter(
                    name=run.label, mode="lines", legendgroup=run.key, showlegend=show,
                    visible=visible, line={"color": colour, "width": 1.6},
                    hovertemplate=f"{html.escape(run.label)}: %{{y:.4g}} at step %{{x}}"
                                  "<extra></extra>",
                    x=binary(x), y=binary(y), meta={"run": run.key}, **axes))
                # A Mark has what the dashboard's Marker gives mark_points: step, text.
                mx, my, text = mark_points(cast(Any, run.marks), lo, hi, panel.log, False,
                                            None)
                any_marks = any_marks or bool(len(mx))
                traces.append(scatter(
                    name=f"{run.label}: interruptions", mode="lines", legendgroup=run.key,
                    showlegend=False, visible=visible,
                    line={"color": colour, "dash": "dash", "width": 1.3},
                    text=text, hovertemplate=f"{html.escape(run.label)}: %{{text}}"
                                             "<extra></extra>",
                    x=binary(mx), y=binary(my), meta={"run": run.key, "marks": True},
                    **axes))
        if any_marks and panels:  # what a dashed line means, once, in the legend
            nan = np.array([np.nan])
            traces.append(scatter(
                name="interruption (dashed, in the run's colour)", mode="lines",
                legendgroup="spotnb-marks", showlegend=True, hoverinfo="skip",
                line={"color": "#57606a", "dash": "dash", "width": 1.3},
                x=binary(nan), y=binary(nan), xaxis="x", yaxis="y"))
        with self.figure.hold_sync():
            self.figure.plot_data = traces
            self.figure.plot_layout = dict(self._layout)

    def _draw_table(self) -> None:
        columns, rows = table_rows(self.runs)
        key = self.table.sort_key
        if key in {c["key"] for c in columns}:  # else in the order the runs were named
            rows = _sorted(rows, key, self.table.descending)
        shown = [{k: v for k, v in row.items() if k != "values"} for row in rows]
        with self.table.hold_sync():
            self.table.columns = columns
            self.table.rows = shown
