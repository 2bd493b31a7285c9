"""The live dashboard of a job: a :class:`~spotnb.display.Renderer` made of widgets.

Layout, top to bottom: a status header (job, state, attempt, instance and pool, spot
price, elapsed, cost, on-demand equivalent, savings); one plotly ``FigureWidget`` with
three subplots (metrics against step; GPU utilisation and memory, or CPU and RAM,
against time; the pool's spot price against time with the max-price and on-demand
lines), interruptions and resumes marked on all three, the two time plots sharing
their x axis; the last lines of remote output in a fixed-height panel; the last
checkpoint; and the buttons Stop, Detach, Interrupt now (local cloud) and TensorBoard.

Cost is bounded however long the run (measured in ``benchmarks/bench_dashboard.py``):

* events only update :class:`~spotnb.widgets.series.DashboardData` (numpy, O(1) per
  point); the widgets are redrawn at most every :data:`FLUSH_SECONDS`, in one
  ``batch_update`` of the figure and one ``hold_sync`` per other widget;
* a trace carries at most ``2 * DEFAULT_BUCKETS`` points (min and max per bucket) as
  numpy arrays, which travel as binary buffers;
* the output panel is one ``HTML`` value of the last :data:`~spotnb.widgets.series.
  LOG_LINES` lines, not an ``Output`` widget that resends everything it ever held.

One figure per dashboard, not one per plot: a ``FigureWidget`` carries the plotly.js
bundle (about 5 MB) in its saved state. When the job ends, the figure's final data is
written into its saved state (the live updates go through a transient field that a
saved notebook would not keep) and a static copy of the figure is displayed as well
(plotly JSON, HTML, and a PNG when kaleido can render one), for readers where widgets
do not render.
"""

from __future__ import annotations

import copy
import html
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from spotnb import display
from spotnb.display import JobView
from spotnb.events import Event
from spotnb.widgets import static
from spotnb.widgets.series import DEFAULT_BUCKETS, DashboardData

if TYPE_CHECKING:
    import ipywidgets

    from spotnb.jobs import JobHandle, JobResult

__all__ = ["FLUSH_SECONDS", "Dashboard", "DetachRequested"]

log = logging.getLogger(__name__)

#: The widgets are redrawn at most this often: a few times a second is live enough,
#: and every redraw is a few messages to the browser (and to a saved notebook).
FLUSH_SECONDS = 0.5
# Trace indexes of the fixed traces; metric traces follow, two per metric.
_UTIL, _MEM, _PRICE, _MAXPRICE, _ONDEMAND, _INTERRUPTS = range(6)
_FIXED_TRACES = 6
# Metrics shown at first; later ones start hidden (a click on the legend shows them).
_VISIBLE_METRICS = 3
_FIGURE_HEIGHT = 700
_PANEL_HEIGHT = "11em"
_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_INTERRUPT_COLOUR = "#d62728"
_RESUME_COLOUR = "#2ca02c"
_STATE_COLOURS = {"completed": "#1a7f37", "failed": "#cf222e", "stopped": "#9a6700",
                  "interrupted": "#bc4c00", "waiting_for_capacity": "#9a6700"}


class DetachRequested(KeyboardInterrupt):
    """Raised inside :func:`spotnb.display.follow` when the Detach button was pressed:
    the follow loop treats it like the notebook's interrupt (the job keeps running)."""


class Dashboard:
    """The widget display of a job (see the module docstring).

    Where widgets do not render, its output reads as text: the status lines and the
    last lines of output (with the interruptions and resumes among them).

    Created without arguments by the magics (``SpotMagics.renderer_class``); the
    follow loop calls :meth:`start` with the job's handle, :meth:`events` with every
    batch of events, and the :class:`~spotnb.display.Renderer` methods. ``clock`` and
    ``flush_seconds`` are there for tests and the benchmark.
    """

    #: Add a PNG to the static figure at the end (kaleido and Chromium; ~3.5 s).
    static_png = False

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 flush_seconds: float = FLUSH_SECONDS,
                 max_buckets: int = DEFAULT_BUCKETS, show: bool = True) -> None:
        import ipywidgets as w

        self._clock = clock
        self.flush_seconds = flush_seconds
        self._show = show
        self.data = DashboardData(max_buckets=max_buckets)
        self.handle: JobHandle | None = None
        self.view: JobView | None = None
        self.flushes = 0
        self._flushed_at = -float("inf")
        self._flushed = (-1, -1, -1)  # data version, log version, header version
        self._header_version = 0
        self._markers_drawn = -1
        self._metric_traces: dict[str, int] = {}
        self._detach = threading.Event()
        self._output: Any = None  # the display handle of the dashboard's output
        self.figure = _new_figure()
        self.header = w.HTML(layout=w.Layout(width="100%"))
        self.panel = w.HTML(layout=w.Layout(width="100%"))
        self.checkpoint = w.HTML()
        self.buttons = {
            "stop": w.Button(description="Stop", icon="stop", button_style="danger",
                             tooltip="stop the job and delete its instance"),
            "detach": w.Button(description="Detach", icon="eject",
                               tooltip="stop following here; the job keeps running"),
            "interrupt": w.Button(description="Interrupt now", icon="bolt",
                                  button_style="warning",
                                  tooltip="local cloud: send the instance a spot "
                                          "interruption notice now"),
            "tensorboard": w.Button(description="TensorBoard", icon="line-chart",
                                    disabled=True,
                                    tooltip="open the job's TensorBoard logs "
                                            "(written with spot.tensorboard())"),
        }
        self.buttons["interrupt"].layout.display = "none"
        self.buttons["stop"].on_click(lambda _b: self._act("stop"))
        self.buttons["detach"].on_click(lambda _b: self._detach.set())
        self.buttons["interrupt"].on_click(lambda _b: self._act("interrupt"))
        self.buttons["tensorboard"].on_click(lambda _b: self._act("tensorboard"))
        self.message = w.HTML()
        # Where the TensorBoard button's %tensorboard shows (the click is no cell's).
        self.extra = w.Output()
        footer = w.HBox([self.checkpoint, *self.buttons.values(), self.message],
                        layout=w.Layout(align_items="center", flex_flow="row wrap"))
        self.widget = w.VBox([self.header, self.figure, self.panel, footer, self.extra],
                             layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-dashboard")
        self._draw_panel()

    def __repr__(self) -> str:
        job = self.handle.job_id if self.handle is not None else "?"
        return f"<spotnb Dashboard of job {job}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._bundle()

    def _bundle(self) -> dict[str, Any]:
        """The widget's view, and as text for readers without widgets: the status and
        the output panel's lines (updated when the job ends, for saved notebooks)."""
        data = dict(self.widget._repr_mimebundle_())
        lines = display.status_lines(self.view) if self.view is not None else ["spotnb"]
        log_lines = [text for _kind, text in self.data.log_lines()]
        data["text/plain"] = "\n".join([*lines, *(["", *log_lines] if log_lines else [])])
        return data

    # -- the follow loop's calls -------------------------------------------------

    def start(self, handle: JobHandle) -> None:
        """The job this dashboard follows (called once, before any event)."""
        from spotnb.widgets import kernel

        self.handle = handle
        if handle.spec.provider == "local":
            self.buttons["interrupt"].layout.display = None
        for button in self.buttons.values():
            kernel.serve_while_busy(button)
        if self._show and self._output is None:
            from IPython.display import display as show

            self._output = show(self._bundle(), raw=True, display_id=True)

    def events(self, batch: list[Event]) -> None:
        """A batch of events, as read (maybe empty); redraws if it is time."""
        if self._detach.is_set():
            self._detach.clear()
            raise DetachRequested
        self.data.add(batch)
        self._maybe_flush()

    def update(self, view: JobView) -> None:
        self.view = view
        self._header_version += 1
        self._maybe_flush()

    def stream(self, name: str, text: str) -> None:
        self.data.write(text, stderr=name == "stderr")

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        # Rich outputs of the remote cell go below the dashboard, as they would locally;
        # a remote clear_output must not clear the dashboard, so it is not passed on.
        if kind != "clear_output":
            display.TextRenderer().rich(kind, data, metadata, display_id)

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        self.view = view
        self.data.milestone(event.time, text)
        self._header_version += 1
        self._maybe_flush()

    def finished(self, view: JobView, result: JobResult) -> None:
        self.view = view
        self._header_version += 1
        self.flush()
        for name in ("stop", "detach", "interrupt"):
            self.buttons[name].disabled = True
        self.save_state()
        if self._output is not None:
            from IPython.display import display as show

            self._output.update(self._bundle(), raw=True)
            show(static.bundle(self.figure, title=_title(view), png=self.static_png),
                 raw=True)

    def detached(self, view: JobView) -> None:
        self.view = view
        self._header_version += 1
        self.flush()
        self.buttons["detach"].disabled = True  # Stop still works: it needs no loop
        self.save_state()
        if self._output is not None:
            self._output.update(self._bundle(), raw=True)
        sys.stderr.write(display.detach_text(view))
        sys.stderr.flush()

    # -- drawing -------------------------------------------------------------------

    def _maybe_flush(self) -> None:
        if self._clock() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Redraw what changed since the last redraw (now, whatever the throttle says)."""
        self._flushed_at = self._clock()
        data_v, log_v, head_v = self._flushed
        if self.data.version != data_v:
            self._draw_figure()
        if self.data.log_version != log_v:
            self._draw_panel()
        if self._header_version != head_v or self.data.version != data_v:
            self._draw_header()
        if (self.data.version, self.data.log_version, self._header_version) != self._flushed:
            self.flushes += 1
        self._flushed = (self.data.version, self.data.log_version, self._header_version)

    def _minutes(self, t: np.ndarray | float) -> Any:
        """Wall-clock seconds as minutes since the job's first event (the time axes)."""
        return (np.asarray(t, dtype=float) - (self.data.first_time or 0.0)) / 60.0

    def _draw_figure(self) -> None:
        d = self.data
        fig = self.figure
        new_metrics = [m for m in d.metric_names() if m not in self._metric_traces]
        for name in new_metrics:  # adding traces is its own message; it happens rarely
            self._add_metric_traces(name)
        with fig.batch_update():
            for name, index in self._metric_traces.items():
                series = d.metrics[name]
                x, y = series.curve.view.points()
                fig.data[index].x, fig.data[index].y = x, y
                rx, ry = series.redone.view.points()
                fig.data[index + 1].x, fig.data[index + 1].y = rx, ry
            if len(d.util):
                gpu = d.sys_kind == "gpu"
                fig.data[_UTIL].name = "GPU utilisation %" if gpu else "CPU utilisation %"
                fig.data[_MEM].name = "GPU memory %" if gpu else "RAM used %"
                x, y = d.util.view.points()
                fig.data[_UTIL].x, fig.data[_UTIL].y = self._minutes(x), y
                x, y = d.mem.view.points()
                fig.data[_MEM].x, fig.data[_MEM].y = self._minutes(x), y
                fig.layout.yaxis2.title.text = "GPU %" if gpu else "CPU / RAM % (no GPU)"
            if len(d.price):
                # A step function: the last price holds until the latest event.
                end = max(d.last_time, d.price.x[-1])
                px = np.append(d.price.x, end)
                py = np.append(d.price.y, d.price.y[-1])
                fig.data[_PRICE].x, fig.data[_PRICE].y = self._minutes(px), py
                span = self._minutes(np.array([px[0], px[-1]]))
                cap = self._max_price()
                if cap is not None:
                    fig.data[_MAXPRICE].x, fig.data[_MAXPRICE].y = span, np.array([cap, cap])
                    fig.data[_MAXPRICE].name = "max price" if self._capped() else \
                        "max price (= on-demand)"
                if d.ondemand is not None:
                    fig.data[_ONDEMAND].x, fig.data[_ONDEMAND].y = \
                        span, np.array([d.ondemand, d.ondemand])
            if len(d.markers) != self._markers_drawn:
                self._draw_markers()

    def _add_metric_traces(self, name: str) -> None:
        import plotly.graph_objects as go

        n = len(self._metric_traces)
        colour = _COLOURS[n % len(_COLOURS)]
        visible: bool | str = True if n < _VISIBLE_METRICS else "legendonly"
        self._metric_traces[name] = len(self.figure.data)
        self.figure.add_traces([
            go.Scatter(name=name, mode="lines", line={"color": colour, "width": 1.5},
                         legendgroup=name, visible=visible, x=[], y=[]),
            go.Scatter(name=f"{name}, redone", mode="markers",
                         marker={"color": "rgba(127,127,127,0.6)", "size": 4, "symbol": "x"},
                         legendgroup=name, visible=visible, x=[], y=[],
                         hovertemplate="step %{x}: %{y}<extra>lost with an interrupted "
                                       "instance, then redone</extra>"),
        ], rows=[1, 1], cols=[1, 1])

    def _draw_markers(self) -> None:
        d = self.data
        fig = self.figure
        shapes = []
        xs, ys, texts = [], [], []
        first = d.metric_names()[0] if d.metrics else None
        for marker in d.markers:
            colour = _INTERRUPT_COLOUR if marker.kind == "interrupted" else _RESUME_COLOUR
            dash = "dash" if marker.kind == "interrupted" else "dot"
            line = {"color": colour, "width": 1.5, "dash": dash}
            if marker.step is not None:
                shapes.append({"type": "line", "xref": "x", "yref": "y domain",
                               "x0": marker.step, "x1": marker.step, "y0": 0, "y1": 1,
                               "line": line})
            t = float(self._minutes(marker.time))
            for axis in ("2", "3"):
                shapes.append({"type": "line", "xref": f"x{axis}", "yref": f"y{axis} domain",
                               "x0": t, "x1": t, "y0": 0, "y1": 1, "line": line})
            if marker.kind == "interrupted" and marker.step is not None and first:
                curve = d.metrics[first].curve.full
                at = int(np.searchsorted(curve.x, marker.step, side="right")) - 1
                xs.append(marker.step)
                ys.append(float(curve.y[at]) if 0 <= at < len(curve) else np.nan)
                texts.append(marker.text)
        fig.layout.shapes = shapes
        fig.data[_INTERRUPTS].x = np.array(xs, dtype=float)
        fig.data[_INTERRUPTS].y = np.array(ys, dtype=float)
        fig.data[_INTERRUPTS].text = texts
        self._markers_drawn = len(d.markers)

    def _capped(self) -> bool:
        return self.handle is not None and self.handle.spec.resources.max_price is not None

    def _max_price(self) -> float | None:
        if self.handle is not None and self.handle.spec.resources.max_price is not None:
            return float(self.handle.spec.resources.max_price)
        return self.data.ondemand  # no cap given: the on-demand price is the cap

    def _draw_panel(self) -> None:
        styles = {"stdout": "", "stderr": "color:#b35900", "spotnb": "color:#0969da"}
        body = "\n".join(f'<span style="{styles[kind]}">{html.escape(text)}</span>'
                         if styles[kind] else html.escape(text)
                         for kind, text in self.data.log_lines())
        # column-reverse keeps the panel scrolled to its newest line.
        self.panel.value = (
            f'<div style="height:{_PANEL_HEIGHT};overflow:auto;display:flex;'
            'flex-direction:column-reverse;border:1px solid #d0d7de;border-radius:4px;'
            'background:#f6f8fa"><pre class="spotnb-log" style="margin:0;padding:4px 8px;'
            f'font-size:85%;line-height:1.3">{body or "(no output yet)"}</pre></div>')

    def _draw_header(self) -> None:
        self.header.value = header_html(self.view, self.data)
        ck = self.data.checkpoint
        if ck is None:
            self.checkpoint.value = "<span style='margin-right:1em'>no checkpoint yet</span>"
        else:
            age = max(0.0, time.time() - ck.time)
            forced = " (on the notice)" if ck.forced else ""
            self.checkpoint.value = (
                f"<span style='margin-right:1em'>last checkpoint: step {ck.step}, "
                f"{_size(ck.bytes)}, {_age(age)} ago{forced}</span>")
        if self.data.tensorboard_synced:
            self.buttons["tensorboard"].disabled = False

    def save_state(self) -> None:
        """Make the figure's current data and layout part of its saved widget state.

        Live updates travel in transient fields (``_py2js_update``) that a saved
        notebook does not replay; assigning the state fields sends them whole, once.

        A notebook executor (nbclient) keeps every binary buffer it saw, by path, even
        after the field holding it went back to None; a front end loading such a state
        fails on a buffer without a home. So the last update is sent again and left in
        place, with x and y of every trace as arrays: every path an update ever used
        (``_py2js_update.style_data.{x,y}.<i>``) then exists in the saved state.
        """
        fig = self.figure
        n = len(fig.data)
        arrays = {key: [np.asarray(getattr(t, key) if getattr(t, key) is not None else (),
                                   dtype=float) for t in fig.data] for key in ("x", "y")}
        with fig.hold_sync():
            fig._widget_data = copy.deepcopy(fig._data)
            fig._widget_layout = copy.deepcopy(fig._layout)
            fig._last_trace_edit_id += 1
            fig._last_layout_edit_id += 1
            fig._py2js_update = {
                "style_data": arrays, "layout_data": {}, "style_traces": list(range(n)),
                "trace_edit_id": fig._last_trace_edit_id,
                "layout_edit_id": fig._last_layout_edit_id, "source_view_id": None}

    # -- buttons -------------------------------------------------------------------

    def _act(self, action: str) -> None:
        """A button's action; runs wherever the kernel handles the click (see
        :mod:`spotnb.widgets.kernel`), so the slow ones get a thread of their own."""
        handle = self.handle
        if handle is None:
            return
        if action == "stop":
            self.buttons["stop"].disabled = True
            self._say(f"stopping job {handle.job_id}…")
            threading.Thread(target=self._run, args=(handle.stop, "%spot_stop button",
                                                     "stopped; its instance is deleted"),
                             daemon=True).start()
        elif action == "interrupt":
            self._say("sending a spot interruption notice…")
            threading.Thread(target=self._run, args=(handle.interrupt, None,
                                                     "interruption notice delivered"),
                             daemon=True).start()
        elif action == "tensorboard":
            from spotnb.widgets.kernel import open_tensorboard

            self._say("fetching the TensorBoard logs…")
            with self.extra:
                self._say(open_tensorboard(handle))

    def _run(self, func: Callable[..., Any], arg: str | None, done: str) -> None:
        try:
            func(arg) if arg is not None else func()
        except Exception as err:  # shown to the user; the dashboard carries on
            log.exception("dashboard action failed")
            self._say(f"failed: {err}")
        else:
            self._say(done)

    def _say(self, text: str) -> None:
        self.message.value = f"<span style='margin-left:1em'>{html.escape(text)}</span>"


def _new_figure() -> ipywidgets.DOMWidget:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3, cols=1, vertical_spacing=0.11, row_heights=[0.44, 0.28, 0.28],
        subplot_titles=("metrics against step (click a legend entry to hide or show it)",
                        "utilisation", "spot price of the instance's pool"))
    common = {"mode": "lines", "x": [], "y": []}
    # One legend per plot, beside it (plotly's multiple legends).
    sys_, price = {"legend": "legend2"}, {"legend": "legend3"}
    fig.add_trace(go.Scatter(name="utilisation %", line={"color": "#ff7f0e"}, **common,
                             **sys_), row=2, col=1)
    fig.add_trace(go.Scatter(name="memory %", line={"color": "#7f7f7f"}, **common, **sys_),
                  row=2, col=1)
    fig.add_trace(go.Scatter(name="spot $/h", line={"color": "#1f77b4", "shape": "hv"},
                             **common, **price), row=3, col=1)
    fig.add_trace(go.Scatter(name="max price", line={"color": _INTERRUPT_COLOUR,
                                                     "dash": "dash", "width": 1},
                             **common, **price), row=3, col=1)
    fig.add_trace(go.Scatter(name="on-demand", line={"color": "#6e7781", "dash": "dot",
                                                     "width": 1}, **common, **price),
                  row=3, col=1)
    fig.add_trace(go.Scatter(name="interruption", mode="markers", x=[], y=[],
                             marker={"color": _INTERRUPT_COLOUR, "size": 11,
                                     "symbol": "x-thin", "line": {"width": 2,
                                                                  "color": _INTERRUPT_COLOUR}},
                             hovertemplate="%{text}<extra></extra>"), row=1, col=1)
    domains = [fig.layout[f"yaxis{n}"].domain for n in ("", "2", "3")]
    legends = {name: {"x": 1.01, "xanchor": "left", "y": domain[1], "yanchor": "top"}
               for name, domain in zip(("legend", "legend2", "legend3"), domains,
                                       strict=True)}
    fig.update_layout(
        height=_FIGURE_HEIGHT, margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="plotly_white", hovermode="closest", uirevision="spotnb", **legends)
    fig.update_xaxes(title_text="step", title_standoff=4, row=1, col=1)
    fig.update_xaxes(row=2, col=1)
    fig.update_xaxes(matches="x2", title_text="minutes since the job started", row=3, col=1)
    fig.update_yaxes(title_text="value", row=1, col=1)
    fig.update_yaxes(title_text="%", range=[0, 105], row=2, col=1)
    fig.update_yaxes(title_text="USD / hour", rangemode="tozero", row=3, col=1)
    return go.FigureWidget(fig)


def header_html(view: JobView | None, data: DashboardData) -> str:
    """The status header as HTML (the same fields as the text display)."""
    if view is None:
        return "<b>spotnb</b>: starting…"
    colour = _STATE_COLOURS.get(view.state, "#0969da")
    state = view.state.replace("_", " ") + (" (detached)" if view.detached else "")
    cells = [("job", f"{html.escape(view.name)} <code>{view.job_id}</code>"),
             ("state", f"<b style='color:{colour}'>{html.escape(state)}</b>")]
    if view.attempt:
        cells.append(("attempt", str(view.attempt)))
    where = " ".join(p for p in (view.instance_type, view.az) if p)
    if where:
        cells.append(("instance", html.escape(where)))
    if view.spot_price is not None:
        cells.append(("spot now", f"${view.spot_price:.4f}/h"))
    cells += [("elapsed", display._clock(view.elapsed)),
              ("cost", f"${view.cost_usd:.4f}"),
              ("on-demand", f"${view.ondemand_cost_usd:.4f}")]
    if view.savings_pct is not None:
        cells.append(("saving", f"<b>{view.savings_pct:.0f}%</b>"))
    cells.append(("interruptions", str(view.interruptions)))
    if view.step is not None:
        cells.append(("step", str(view.step)))
    for key, value in list(view.metrics.items())[:3]:
        if isinstance(value, (int, float)):
            cells.append((html.escape(key), f"{value:.4g}"))
    items = "".join(
        f"<span style='margin-right:1.2em;white-space:nowrap'><span style='color:#57606a'>"
        f"{k}</span> {v}</span>" for k, v in cells)
    detail = view.reason if view.final else view.detail
    if view.final and view.outputs:
        detail += f"; outputs set in the notebook: {', '.join(view.outputs)}"
    tail = (f"<div style='color:#57606a;font-size:90%'>{html.escape(detail)}</div>"
            if detail else "")
    return (f"<div class='spotnb-header' style='border-left:4px solid {colour};"
            f"padding:4px 8px'><div style='display:flex;flex-wrap:wrap;row-gap:2px'>"
            f"{items}</div>{tail}</div>")


def _title(view: JobView | None) -> str:
    return f"spotnb job {view.job_id} ({view.name})" if view is not None else "spotnb job"


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
