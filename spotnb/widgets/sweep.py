"""What a person sees of a sweep: its line, the table of its trials, its analysis and
the curves of its trials overlaid, live while it runs and after its end.

Top to bottom:

* the header (:func:`spotnb.sweep.view.header_lines`): status and trials, the best
  objective with its trial, the cost with the refunds apart (it never decreases), the
  time, and why it ended (or a warning);
* the table of the trials (:func:`spotnb.sweep.analysis.trial_rows`): parameters to
  four significant digits, state, where and why a pruned one stopped, the objective
  (the metric's last value) and the lowest (or highest) value logged, named apart,
  interruptions, steps redone, cost, refund, saving; sorted by a click on a header,
  wider than the cell it scrolls sideways; a click on a row opens that trial's own
  dashboard (:class:`spotnb.widgets.dashboard.Dashboard`, replayed and followed while
  it runs) below the table, a second click closes it;
* the analysis, one plotly figure: the parallel coordinates of the trials (each
  parameter, the state, the interruptions and the objective, coloured by the
  objective: pruned and interrupted trials stand apart on their axes), the objective
  against each parameter (a marker per trial, its colour its state, a diamond where it
  was interrupted), and Optuna's parameter importance (or why there is none yet);
* the curves of every trial overlaid (:class:`spotnb.widgets.compare.Comparison`,
  whose legend hides a trial's curves), interruptions dashed.

The sweep's driver polls the trials (:mod:`spotnb.sweep.runner`); the view draws what
it read, at most every :data:`~spotnb.widgets.compare.FLUSH_SECONDS`. Drawn in the
figures of JupyterLab's plotly.js; where widgets do not draw (a notebook reopened
without its widget state, an HTML export read offline, a record) the view's output
reads as its header and table, and :meth:`SweepView.static_bundle` is the final view
as a picture (:mod:`spotnb.widgets.static_sweep`), hidden next to the live figure.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from spotnb.sweep.analysis import (
    STATE_COLOURS,
    TrialRow,
    axes,
    importance,
    table_columns,
    table_rows,
    trial_rows,
    wide_range,
)
from spotnb.sweep.state import round_value
from spotnb.sweep.view import Sweep, header_lines
from spotnb.widgets import static_sweep
from spotnb.widgets.dashboard import Dashboard

if TYPE_CHECKING:
    from spotnb.client.display import JobView

__all__ = ["SweepView", "TrialDashboard", "analysis_figure"]

log = logging.getLogger(__name__)

_ANALYSIS_ROW_PX = 260
_UIREVISION = "spotnb-sweep"


class TrialDashboard(Dashboard):
    """A trial's own dashboard inside the sweep's view: displayed there, not as an
    output of its own, and closed without a word (the sweep's view goes on)."""

    def __init__(self) -> None:
        super().__init__(show=False, static_copy=False)

    def detached(self, view: JobView) -> None:
        self.view = view
        with self._lock:
            self.flush()

    def close(self) -> None:
        """Stop following (at its next batch of events)."""
        self._detach.set()


class SweepView:
    """The sweep's view (module docstring)."""

    def __init__(self, made: Sweep) -> None:
        import ipywidgets as w

        from spotnb.widgets.compare import FLUSH_SECONDS, Comparison
        from spotnb.widgets.elements import LiveFigure, Table

        self.sweep = made
        self.flush_seconds = FLUSH_SECONDS
        self._lock = threading.RLock()
        self._drawn_at = -float("inf")
        self._importance_key: tuple[Any, ...] | None = None
        self._importance = importance([], made.direction)
        self.header = w.HTML()
        self.table = Table(table_class="spotnb-sweep-table", number_chosen=False,
                           row_title="click to open (or close) the dashboard of",
                           layout=w.Layout(width="100%"))
        self.table.observe(self._on_table, names=["sort_key", "descending", "chosen"])
        self.slot = w.VBox([], layout=w.Layout(width="100%"))
        self.dashboard: TrialDashboard | None = None
        self._dashboard_thread: threading.Thread | None = None
        self.analysis = LiveFigure(layout=w.Layout(width="100%"))
        self.analysis.add_class("spotnb-sweep-analysis")
        self.comparison = Comparison([], follow=False)
        self.comparison.header.layout.display = "none"
        self.comparison.table.layout.display = "none"  # the trials table says it all
        self.curves_note = w.HTML(
            "<b>The trials' curves</b> <span style='color:#57606a'>(dashed: "
            "interruptions, in the trial's colour; click a legend entry to hide a "
            "trial)</span>")
        self.widget = w.VBox([self.header, self.table, self.slot, self.analysis,
                              self.curves_note, self.comparison.widget],
                             layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-sweep")
        self.widget.add_class(static_sweep.live_class(made.sweep_id))
        self._output: Any = None
        self.draw()
        if not made.ended:
            self.serve_while_busy()
        made.listen(self._on_sweep)

    def serve_while_busy(self) -> None:
        """Take the table's clicks while a cell follows the sweep (a kernel subshell)."""
        from spotnb.widgets import kernel

        kernel.serve_while_busy(self.table)
        self.comparison.serve_while_busy()

    # -- following ----------------------------------------------------------------------

    def _on_sweep(self, what: str, obj: Any) -> None:
        with self._lock:
            if what == "run":
                if obj not in self.comparison.runs:
                    self.comparison.add(obj, follow=False)
                self.draw()
            elif what == "end" or time.monotonic() - self._drawn_at >= self.flush_seconds:
                self.draw()

    def draw(self) -> None:
        """Redraw everything from what the driver read, now."""
        with self._lock:
            self._drawn_at = time.monotonic()
            rows = trial_rows(self.sweep)
            self._draw_header()
            self._draw_table(rows)
            self._draw_analysis(rows)
            self.comparison.draw()

    def _draw_header(self) -> None:
        made = self.sweep
        lines = header_lines(made)
        status = lines[0].removeprefix(f"spotnb sweep {made.name} ")
        title = (f"<b>sweep {html.escape(made.name)}</b> ({html.escape(made.sweep_id)}) "
                 f"{html.escape(status)}; at most {made.parallel} at once")
        rest = "<br>".join(html.escape(line) for line in lines[1:])
        self.header.value = f"<div class='spotnb-sweep-header'>{title}<br>{rest}</div>"

    def _draw_table(self, rows: list[TrialRow]) -> None:
        columns = table_columns(self.sweep, rows)
        shown = table_rows(self.sweep, rows)
        key = self.table.sort_key
        if key in {c["key"] for c in columns}:
            from spotnb.widgets.compare import _sorted

            shown = _sorted(shown, key, self.table.descending)
        with self.table.hold_sync():
            self.table.columns = columns
            self.table.rows = [{k: v for k, v in r.items() if k != "values"} for r in shown]

    def importance(self, rows: list[TrialRow]) -> Any:
        """Optuna's parameter importance, computed again only when the completed
        trials changed."""
        key = tuple((r.number, r.objective) for r in rows if r.state == "completed")
        if key != self._importance_key:
            self._importance_key = key
            self._importance = importance(rows, self.sweep.direction)
        return self._importance

    def _draw_analysis(self, rows: list[TrialRow]) -> None:
        from spotnb.widgets.plots import _template

        made = self.sweep
        found = self.importance(rows)
        data, layout = analysis_figure(made.metric, made.direction, rows, found)
        layout["template"] = _template()
        layout["uirevision"] = _UIREVISION
        with self.analysis.hold_sync():
            self.analysis.plot_data = data
            self.analysis.plot_layout = layout

    # -- a trial's dashboard ------------------------------------------------------------

    def _on_table(self, change: Any = None) -> None:
        if change is not None and change["name"] == "chosen":
            chosen = list(self.table.chosen)
            if len(chosen) > 1:  # one dashboard at a time: the newest click
                self.table.chosen = chosen[-1:]
                return
            self.open(chosen[0] if chosen else None)
            return
        with self._lock:
            self._draw_table(trial_rows(self.sweep))

    def open(self, label: str | None) -> None:
        """Show the dashboard of the trial ``label`` (``t3``) below the table (None:
        close the one shown). Runs where the click is handled: quick, the replay in a
        thread."""
        import ipywidgets as w

        old, self.dashboard = self.dashboard, None
        if old is not None:
            old.close()
        self.slot.children = ()
        if label is None:
            return
        number = int(label.lstrip("t"))
        run = self.sweep.runs.get(number) if hasattr(self.sweep, "runs") else None
        if run is None:
            self.slot.children = (w.HTML(f"<i>trial {html.escape(label)} has not started: "
                                         "no dashboard yet</i>"),)
            return
        board = TrialDashboard()
        self.dashboard = board
        title = w.HTML(f"<b>{html.escape(run.label)}</b>: job {html.escape(run.job_id or '')} "
                       "<span style='color:#57606a'>(its own dashboard; click its row "
                       "again to close it)</span>")
        self.slot.children = (title, board.widget)
        thread = threading.Thread(target=_follow, args=(run.handle, board), daemon=True,
                                  name=f"spotnb-trial-{run.job_id}")
        self._dashboard_thread = thread
        thread.start()

    # -- output -------------------------------------------------------------------------

    def bundle(self) -> dict[str, Any]:
        """The view's output: the widget, and for readers without widgets its header
        and table as HTML and as text (updated at the end: :meth:`show`)."""
        data = dict(self.widget._repr_mimebundle_())
        rows = trial_rows(self.sweep)
        data["text/plain"] = "\n".join(header_lines(self.sweep)) + "\n\n" + \
            static_sweep.table_text(table_columns(self.sweep, rows),
                                    table_rows(self.sweep, rows))
        data["text/html"] = static_sweep.view_html(self.sweep, rows)
        return data

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.bundle()

    def show(self) -> None:
        """Display the view as an output that :meth:`finish` updates."""
        from IPython.display import display

        self._output = display(self.bundle(), raw=True, display_id=True)

    def finish(self) -> None:
        """The sweep ended (or is followed no more): the output's text forms updated,
        and the final view as a picture below it (see the module docstring)."""
        from IPython.display import display

        self.draw()
        if self._output is not None:
            self._output.update(self.bundle(), raw=True)
        made = self.sweep
        if made.ended or made.status == "abandoned":
            copy_ = self.static_bundle()
            if copy_ is not None:
                display(copy_[0], metadata=copy_[1], raw=True)

    def static_bundle(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The final view as an output ``(data, metadata)``: a PNG of the analysis and
        the curves, with the header and the table (None without matplotlib)."""
        rows = trial_rows(self.sweep)
        return static_sweep.sweep_bundle(self.sweep, rows, self.importance(rows),
                                         list(self.comparison.runs))


def _follow(handle: Any, board: TrialDashboard) -> None:
    from spotnb.client import display

    try:
        display.follow(handle, board)
    except Exception:  # the sweep's view goes on without this trial's dashboard
        log.exception("the dashboard of job %s stopped", handle.job_id)


def analysis_figure(metric: str, direction: str, rows: list[TrialRow],
                    found: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The analysis as plotly traces and layout (module docstring)."""
    dims, drawn = axes(rows, metric)
    params = list(dict.fromkeys(k for r in rows for k in r.params))
    panels = [*params, "importance"]
    per_row = min(4, len(panels))
    scatter_rows = -(-len(panels) // per_row)
    height = _ANALYSIS_ROW_PX * (1 + scatter_rows) + 60
    top = 1.0 - 40 / height
    split = 1.0 - (_ANALYSIS_ROW_PX + 40) / height
    reverse = direction == "minimize"  # the better objective: the brighter colour
    data: list[dict[str, Any]] = []
    layout: dict[str, Any] = {"height": height, "showlegend": True,
                              "margin": {"l": 60, "r": 30, "t": 40, "b": 30},
                              "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom",
                                         "x": 0.0},
                              "annotations": []}
    if dims:
        objective = dims[-1]  # coloured as placed: a log axis's colours are too
        ticks = ({"tickvals": [t for t, _ in objective.ticks],
                  "ticktext": [s for _, s in objective.ticks]} if objective.ticks else {})
        data.append({
            "type": "parcoords", "name": "trials", "domain": {"x": [0.0, 0.94],
                                                              "y": [split + 0.06, top]},
            "line": {"color": list(objective.values), "colorscale": "Viridis",
                     "reversescale": reverse, "showscale": True,
                     "colorbar": {"title": {"text": metric}, "len": (top - split) * 0.9,
                                  "y": (top + split) / 2, "thickness": 12, **ticks}},
            "dimensions": [{"label": d.name + (" (log)" if d.log else ""),
                            "values": list(d.values),
                            **({"tickvals": [t for t, _ in d.ticks],
                                "ticktext": [s for _, s in d.ticks]} if d.ticks else {})}
                           for d in dims]})
    else:
        layout["annotations"].append(
            {"text": f"no trial has logged {html.escape(metric)} yet", "showarrow": False,
             "xref": "paper", "yref": "paper", "x": 0.5, "y": (top + split) / 2,
             "font": {"color": "#57606a"}})
    width = 1.0 / per_row
    for n, name in enumerate(panels):
        row, col = divmod(n, per_row)
        ax = "" if n == 0 else str(n + 1)
        y_hi = split - row * (_ANALYSIS_ROW_PX / height)
        y_lo = y_hi - (_ANALYSIS_ROW_PX - 70) / height
        x_lo, x_hi = col * width + 0.05, (col + 1) * width - 0.02
        layout[f"xaxis{ax}"] = {"domain": [x_lo, x_hi], "anchor": f"y{ax}",
                                "title": {"text": name if name != "importance" else
                                          "importance (Optuna)"}}
        layout[f"yaxis{ax}"] = {"domain": [max(0.0, y_lo), y_hi], "anchor": f"x{ax}",
                                "title": {"text": metric if name != "importance" else ""}}
        if name != "importance" and wide_range([float(r.objective or 0.0) for r in drawn]):
            layout[f"yaxis{ax}"]["type"] = "log"
        if name == "importance":
            if found.values:
                names = list(found.values)[::-1]
                data.append({"type": "bar", "orientation": "h", "name": "importance",
                             "x": [found.values[k] for k in names], "y": names,
                             "xaxis": f"x{ax}", "yaxis": f"y{ax}", "showlegend": False,
                             "marker": {"color": "#1f77b4"},
                             "hovertemplate": "%{y}: %{x:.2f}<extra></extra>"})
            else:
                layout["annotations"].append(
                    {"text": html.escape(found.why), "showarrow": False,
                     "xref": f"x{ax} domain", "yref": f"y{ax} domain", "x": 0.5, "y": 0.5,
                     "font": {"color": "#57606a", "size": 11}})
                layout[f"xaxis{ax}"]["visible"] = False
                layout[f"yaxis{ax}"]["visible"] = False
            continue
        values = [r.params.get(name) for r in drawn]
        numbers = [float(v) for v in values if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        numeric = len(numbers) == len(values)
        if numeric and wide_range(numbers):
            layout[f"xaxis{ax}"]["type"] = "log"
        for state in dict.fromkeys(r.state for r in drawn):
            mine = [r for r in drawn if r.state == state]
            data.append({
                "type": "scatter", "mode": "markers", "name": state,
                "legendgroup": state, "showlegend": n == 0,
                "x": [r.params.get(name) if numeric else round_value(r.params.get(name))
                      for r in mine],
                "y": [r.objective for r in mine],
                "text": [f"{r.label} {state}" + (f", {r.interruptions} interruption(s)"
                                                  if r.interrupted else "") for r in mine],
                "marker": {"color": STATE_COLOURS.get(state, "#57606a"), "size": 9,
                           "symbol": ["diamond" if r.interrupted else "circle"
                                      for r in mine],
                           "line": {"width": 1, "color": "#ffffff"}},
                "hovertemplate": "%{text}<br>" + html.escape(name) + " %{x}<br>"
                                 + html.escape(metric) + " %{y:.4g}<extra></extra>",
                "xaxis": f"x{ax}", "yaxis": f"y{ax}"})
    if any(r.interrupted for r in drawn) and drawn:
        data.append({"type": "scatter", "mode": "markers", "name": "interrupted (diamond)",
                     "x": [None], "y": [None], "xaxis": "x", "yaxis": "y",
                     "marker": {"symbol": "diamond", "color": "#57606a", "size": 9},
                     "hoverinfo": "skip"})
    return data, layout
