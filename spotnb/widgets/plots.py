"""The dashboard's figure: a panel per metric, each with its own y axis, and the
instance's GPU or CPU use; interruptions and resumes marked on every panel.

As TensorBoard and W&B do: one panel per metric (or the panels a user groups them
into: metrics of the same name, ``train/loss`` with ``val/loss``, or all in one), a
smoothing control (TensorBoard's debiased moving average), a log scale, and x as the
step or the wall-clock time. A curve is broken where a replacement instance took over
(no line drawn across the gap), the steps that an interrupted instance logged after
its last checkpoint show as grey crosses, and each interruption and resume is a
vertical line with a legend entry whose hover text says what happened.

:class:`Plots` builds plotly's traces and layout as plain dicts for one
:class:`~spotnb.widgets.elements.LiveFigure`, which the front end draws with the
plotly.js of JupyterLab's plotly extension (no 5 MB bundle in the widget). The layout
is rebuilt only when the panels change (a new metric, another grouping or axis); a
redraw sends the traces with their reduced series (numpy arrays, as binary buffers) in
one message, and the layout only when it changed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import numpy as np

from spotnb.widgets.series import DashboardData, Marker

__all__ = ["COLOURS", "GROUPINGS", "INTERRUPT_COLOUR", "RESUME_COLOUR", "PlotOptions", "Plots",
           "ema", "panels", "values"]

#: Metric colours, in the order metrics appear. Red is the interruptions' and dark grey
#: the resumes': no metric uses either.
COLOURS = ("#1f77b4", "#9467bd", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#ff7f0e")
INTERRUPT_COLOUR = "#d62728"
RESUME_COLOUR = "#3d444d"
REDONE_COLOUR = "rgba(110,119,129,0.7)"
UTIL_COLOUR = "#fb8500"
MEM_COLOUR = "#8c959f"
WORLD_COLOUR = "#24292f"
#: How the metrics are grouped into panels: (key, label for the control).
GROUPINGS = (("metric", "one panel per metric"),
             ("name", "same name together (train/loss with val/loss)"),
             ("all", "all metrics in one panel"))

# Sizes in pixels: a panel tall enough to read a curve, two per row from two metrics on.
_PANEL_PX = 220
_SYS_PX = 130
_GAP_PX = 62  # between rows: the x axis's ticks and the next panel's title
_TOP_PX = 58  # the legend
_BOTTOM_PX = 40
_COLUMN_GAP = 0.07  # between the two columns, in fractions of the width
_MARK_LEVELS = 9  # points along each marker line: hovering anywhere on it finds one


@dataclasses.dataclass
class PlotOptions:
    """What the user chose: x as ``"step"`` or ``"time"``, the smoothing weight (0 to
    0.99), a log y scale for the metric panels, and the grouping (:data:`GROUPINGS`)."""

    x: str = "step"
    smoothing: float = 0.0
    log_y: bool = False
    grouping: str = "metric"


def panels(names: list[str], grouping: str) -> list[tuple[str, list[str]]]:
    """The metric panels: ``(title, metric names)``, in the order metrics appeared."""
    if grouping == "all":
        return [("metrics", list(names))] if names else []
    if grouping == "name":
        found: dict[str, list[str]] = {}
        for name in names:
            found.setdefault(name.rsplit("/", 1)[-1], []).append(name)
        return list(found.items())
    return [(name, [name]) for name in names]


def _axis(n: int) -> str:
    """Axis suffix of the n-th axis pair (0 -> ``""``, 1 -> ``"2"``)."""
    return "" if n == 0 else str(n + 1)


@dataclasses.dataclass
class _Panel:
    title: str
    metrics: list[str]
    axis: str  # "" or "2", "3", ...
    marks: tuple[int, int] = (-1, -1)  # trace indexes: interruptions, resumes


class Plots:
    """The figure and how it is drawn from :class:`DashboardData` (module docstring)."""

    def __init__(self) -> None:
        from spotnb.widgets.elements import LiveFigure

        self.options = PlotOptions()
        self.figure = LiveFigure()
        self.figure.plot_layout = _base_layout()
        self._structure: tuple[Any, ...] | None = None
        self._panels: list[_Panel] = []
        self._layout: dict[str, Any] = {}
        self._specs: list[dict[str, Any]] = []  # the traces, without their arrays
        self._traces: dict[str, tuple[int, int, int]] = {}  # raw, smoothed, redone
        self._sys: tuple[int, int] | None = None
        self._nodes: dict[int, int] = {}  # node slot -> its utilisation trace
        self._world: int | None = None  # the world size trace
        self._sys_axis = ""
        self._tz = 0.0

    # -- drawing -------------------------------------------------------------------

    def draw(self, data: DashboardData) -> None:
        """Bring the figure up to date with ``data`` and the options: one message with
        the traces (their arrays as binary buffers), and the layout when it changed."""
        names = data.metric_names()
        structure = (tuple((t, tuple(m)) for t, m in panels(names, self.options.grouping)),
                     len(data.util) > 0, data.sys_kind, self.options.x, self.options.log_y,
                     tuple(sorted(data.node_util)), bool(data.worlds))
        if structure != self._structure:
            self._rebuild(data, structure)
        traces = [dict(spec) for spec in self._specs]
        time_x = self.options.x == "time"
        smoothing = self.options.smoothing
        for name, (raw, smooth, redone) in self._traces.items():
            series = data.metrics[name]
            x, y, t = series.points()
            xs = self._ms(t) if time_x else x
            traces[raw].update(x=_buffer(xs), y=_buffer(y),
                               opacity=0.3 if smoothing > 0 else 1.0)
            traces[smooth]["visible"] = smoothing > 0
            if smoothing > 0:
                traces[smooth].update(x=_buffer(xs), y=_buffer(ema(y, smoothing)))
            rx, ry, rt = series.redone.view.points()
            traces[redone].update(x=_buffer(self._ms(rt) if time_x else rx), y=_buffer(ry))
        for slot, index in self._nodes.items():
            x, y = data.sys_points(data.node_util[slot], gaps=data.node_gaps[slot])
            traces[index].update(x=_buffer(self._ms(x)), y=_buffer(y))
        if self._world is not None:
            x, y, nodes = data.world_points()
            traces[self._world].update(x=_buffer(self._ms(x)), y=_buffer(y),
                                       customdata=_buffer(nodes))
        if self._sys is not None:
            gpu = data.sys_kind == "gpu"
            util, mem = self._sys
            x, y = data.sys_points(data.util)
            traces[util].update(name="GPU utilisation %" if gpu else "CPU utilisation %",
                                x=_buffer(self._ms(x)), y=_buffer(y))
            x, y = data.sys_points(data.mem)
            traces[mem].update(name="GPU memory %" if gpu else "RAM used %",
                               x=_buffer(self._ms(x)), y=_buffer(y))
        layout = dict(self._layout)
        layout["shapes"] = self._draw_marks(data, traces)
        with self.figure.hold_sync():
            self.figure.plot_data = traces  # unchanged values are not sent
            self.figure.plot_layout = layout

    def _ms(self, t: np.ndarray) -> np.ndarray:
        """Epoch seconds as the milliseconds of a plotly date axis, in local time."""
        return (np.asarray(t, dtype=float) + self._tz) * 1000.0

    def _rebuild(self, data: DashboardData, structure: tuple[Any, ...]) -> None:
        """New panels: the traces (their arrays are filled by each draw) and axes."""
        self._structure = structure
        if data.first_time is not None:
            self._tz = float(time.localtime(data.first_time).tm_gmtoff)
        groups = panels(data.metric_names(), self.options.grouping)
        has_sys = len(data.util) > 0 or bool(data.worlds)
        time_x = self.options.x == "time"
        specs: list[dict[str, Any]] = []
        self._panels, self._traces = [], {}
        order = {name: i for i, name in enumerate(data.metric_names())}
        for n, (title, members) in enumerate(groups):
            panel = _Panel(title, members, _axis(n))
            self._panels.append(panel)
            axes = {"xaxis": f"x{panel.axis}", "yaxis": f"y{panel.axis}"}
            several = len(members) > 1
            hover = ("%{fullData.name}: %{y:.4g} at %{x|%H:%M:%S}<extra></extra>" if time_x
                     else "%{fullData.name}: %{y:.4g} at step %{x}<extra></extra>")
            for name in members:
                colour = COLOURS[order[name] % len(COLOURS)]
                first = len(specs)
                specs += [
                    _scatter(name=name, mode="lines", legendgroup=name, showlegend=several,
                             line={"color": colour, "width": 1.6}, hovertemplate=hover,
                             **axes),
                    _scatter(name=f"{name} (smoothed)", mode="lines", legendgroup=name,
                             showlegend=False, visible=False,
                             line={"color": colour, "width": 2}, hovertemplate=hover,
                             **axes),
                    _scatter(name="redone steps", mode="markers", legendgroup="redone",
                             showlegend=not self._traces,
                             marker={"color": REDONE_COLOUR, "size": 5, "symbol": "x"},
                             hovertemplate=f"{_escape(name)} %{{y:.4g}}: logged by an "
                                           "interrupted instance after its last checkpoint, "
                                           "then redone<extra></extra>", **axes),
                ]
                self._traces[name] = (first, first + 1, first + 2)
            panel.marks = (len(specs), len(specs) + 1)
            specs += [_mark_trace("interruption", INTERRUPT_COLOUR, "dash", axes),
                      _mark_trace("resume on a replacement", RESUME_COLOUR, "dot", axes)]
        self._sys, self._nodes, self._world = None, {}, None
        self._sys_axis = _axis(len(groups))
        world_axis = _axis(len(groups) + 1)
        if data.multinode and has_sys:
            # One utilisation line per node (memory would double the lines), and the
            # world size as a step line on the right-hand axis.
            axes = {"xaxis": f"x{self._sys_axis}", "yaxis": f"y{self._sys_axis}"}
            kind = "GPU" if data.sys_kind == "gpu" else "CPU"
            for slot in sorted(data.node_util):
                self._nodes[slot] = len(specs)
                specs.append(_scatter(
                    name=f"node {slot} {kind} %", mode="lines", legendgroup="nodes",
                    line={"color": COLOURS[slot % len(COLOURS)], "width": 1.2},
                    hovertemplate="%{fullData.name}: %{y:.0f} at %{x|%H:%M:%S}"
                                  "<extra></extra>", **axes))
            if data.worlds:
                self._world = len(specs)
                specs.append(_scatter(
                    name="world size", mode="lines", line={"color": WORLD_COLOUR,
                                                           "width": 2, "shape": "hv"},
                    hovertemplate="world size %{y:.0f} (%{customdata:.0f} nodes) from "
                                  "%{x|%H:%M:%S}<extra></extra>",
                    xaxis=f"x{self._sys_axis}", yaxis=f"y{world_axis}"))
        elif has_sys:
            axes = {"xaxis": f"x{self._sys_axis}", "yaxis": f"y{self._sys_axis}"}
            hover = "%{fullData.name}: %{y:.0f} at %{x|%H:%M:%S}<extra></extra>"
            self._sys = (len(specs), len(specs) + 1)
            specs += [
                _scatter(name="utilisation %", mode="lines", line={"color": UTIL_COLOUR},
                         hovertemplate=hover, **axes),
                _scatter(name="memory %", mode="lines", line={"color": MEM_COLOUR},
                         hovertemplate=hover, **axes),
            ]
        self._specs = specs
        self._layout = _layout(self._panels, has_sys, self._sys_axis, data.sys_kind,
                               self.options)
        if self._nodes or self._world is not None:
            top = max((w[2] for w in data.worlds), default=1)
            self._layout[f"yaxis{world_axis}"] = {
                "overlaying": f"y{self._sys_axis}", "side": "right",
                "anchor": f"x{self._sys_axis}", "range": [0, top + 1], "dtick": 1,
                "showgrid": False, "title": {"text": "world size"}, "automargin": True}
            self._layout["annotations"][-1]["text"] = (
                f"<b>{'GPU' if data.sys_kind == 'gpu' else 'CPU'} utilisation per node "
                "and world size</b>")

    def _draw_marks(self, data: DashboardData, traces: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
        """The interruption and resume lines of every metric panel, spanning its data,
        and those of the system panel (shapes, against time)."""
        time_x = self.options.x == "time"
        legend = {0: False, 1: False}  # one legend entry each, on a trace with lines
        for panel in self._panels:
            ys = [data.metrics[m].curve.view.points()[1] for m in panel.metrics]
            lo, hi = _span(ys, self.options.log_y)
            for which, (index, kinds) in enumerate(zip(
                    panel.marks, (("interrupted", "lost", "retry"), ("resumed",)),
                    strict=True)):
                x, y, text = _mark_points([m for m in data.markers if m.kind in kinds],
                                          lo, hi, self.options.log_y, time_x, self._ms)
                traces[index].update(x=_buffer(x), y=_buffer(y), text=text,
                                     showlegend=bool(len(x)) and not legend[which])
                legend[which] = legend[which] or bool(len(x))
        # Marks at no known step (an attempt that logged nothing) are still on the system
        # panel: their legend entry must be somewhere.
        for which, kinds in enumerate((("interrupted", "lost", "retry"), ("resumed",))):
            if self._panels and not legend[which] and \
                    any(m.kind in kinds for m in data.markers):
                nan = np.array([np.nan])
                traces[self._panels[0].marks[which]].update(
                    x=_buffer(nan), y=_buffer(nan), text=[""], showlegend=True)
        shapes = []
        if self._sys is not None or self._nodes or self._world is not None:
            for marker in data.markers:
                colour, dash = ((INTERRUPT_COLOUR, "dash") if marker.ended
                                else (RESUME_COLOUR, "dot"))
                at = float(self._ms(np.array([marker.time]))[0])
                shapes.append({"type": "line", "xref": f"x{self._sys_axis}",
                               "yref": f"y{self._sys_axis} domain", "x0": at, "x1": at,
                               "y0": 0, "y1": 1,
                               "line": {"color": colour, "dash": dash, "width": 1.2}})
        return shapes


def _buffer(values: np.ndarray) -> memoryview:
    """An array as float64 bytes: it travels as a binary buffer, not as JSON numbers."""
    return memoryview(np.ascontiguousarray(values, dtype=np.float64).tobytes())


def values(trace: dict[str, Any], key: str) -> np.ndarray:
    """A trace's ``x`` or ``y`` back as an array (tests, the static copy)."""
    raw = trace.get(key)
    if raw is None:
        return np.empty(0)
    return np.frombuffer(bytes(raw), dtype=np.float64)


def _scatter(**props: Any) -> dict[str, Any]:
    return {"type": "scatter", "x": _buffer(np.empty(0)), "y": _buffer(np.empty(0)), **props}


def ema(y: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average with its start-up bias
    removed (``weight`` 0: none; 0.99: very smooth). NaN points stay NaN (gaps) and do
    not reset the average. Applied to the displayed (reduced) points, as TensorBoard
    and W&B do, so its cost is bounded like theirs."""
    if weight <= 0 or not len(y):
        return y
    out = np.empty_like(y)
    last = 0.0
    count = 0
    for i, value in enumerate(y.tolist()):
        if not math.isfinite(value):
            out[i] = value
            continue
        last = last * weight + (1 - weight) * value
        count += 1
        out[i] = last / (1 - weight ** count)
    return out


def _mark_trace(name: str, colour: str, dash: str, axes: dict[str, str]) -> dict[str, Any]:
    return _scatter(name=name, mode="lines", legendgroup=name, showlegend=False,
                    line={"color": colour, "dash": dash, "width": 1.5}, text=[],
                    hovertemplate="%{text}<extra></extra>", **axes)


def _span(ys: list[np.ndarray], log: bool) -> tuple[float, float]:
    """The range of the values a panel shows (positive ones on a log scale)."""
    values = np.concatenate(ys) if ys else np.empty(0)
    values = values[np.isfinite(values)]
    if log:
        values = values[values > 0]
    if not len(values):
        return (1.0, 10.0) if log else (0.0, 1.0)
    lo, hi = float(values.min()), float(values.max())
    if hi == lo:
        lo, hi = (lo / 2, hi * 2) if log else (lo - 0.5, hi + 0.5)
    return lo, hi


def _mark_points(markers: list[Marker], lo: float, hi: float, log: bool, time_x: bool,
                 to_ms: Any) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Vertical lines from ``lo`` to ``hi``, a few points each (hover finds a point
    anywhere along the line), separated by NaN."""
    levels = (np.geomspace(lo, hi, _MARK_LEVELS) if log
              else np.linspace(lo, hi, _MARK_LEVELS))
    xs: list[float] = []
    ys: list[float] = []
    texts: list[str] = []
    for marker in markers:
        if time_x:
            at = float(to_ms(np.array([marker.time]))[0])
        elif marker.step is not None:
            at = marker.step
        else:
            continue
        xs += [at] * _MARK_LEVELS + [math.nan]
        ys += [*levels.tolist(), math.nan]
        texts += [marker.text] * _MARK_LEVELS + [""]
    return np.array(xs, dtype=float), np.array(ys, dtype=float), texts


@functools.cache
def _template() -> dict[str, Any]:
    """plotly's "plotly_white" look, as a layout template (sent with each new layout)."""
    import plotly.io as pio

    return {"layout": pio.templates["plotly_white"].to_plotly_json()["layout"]}


def _base_layout() -> dict[str, Any]:
    return {"height": _TOP_PX + _PANEL_PX + _BOTTOM_PX, "template": _template(),
            "margin": {"l": 60, "r": 16, "t": _TOP_PX, "b": _BOTTOM_PX},
            "annotations": [{"text": "waiting for the first metric…", "showarrow": False,
                             "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5,
                             "font": {"color": "#57606a"}}],
            "xaxis": {"visible": False}, "yaxis": {"visible": False}}


def _layout(panels_: list[_Panel], has_sys: bool, sys_axis: str, sys_kind: str | None,
            options: PlotOptions) -> dict[str, Any]:
    """Axes, titles and sizes for the panels: a grid of two columns (one for a single
    metric), the system panel across the bottom."""
    cols = 1 if len(panels_) <= 1 else 2
    rows = math.ceil(len(panels_) / cols)
    plot_px = rows * _PANEL_PX + max(0, rows - 1) * _GAP_PX
    if has_sys:
        plot_px += (_GAP_PX if rows else 0) + _SYS_PX
    plot_px = max(plot_px, 1)
    layout: dict[str, Any] = {
        "height": plot_px + _TOP_PX + _BOTTOM_PX, "template": _template(),
        "hovermode": "closest",
        "margin": {"l": 60, "r": 16, "t": _TOP_PX, "b": _BOTTOM_PX},
        "legend": {"orientation": "h", "yref": "container", "y": 1.0, "yanchor": "top",
                   "x": 0.0, "xanchor": "left", "font": {"size": 11}},
        # The user's zoom and hidden traces survive updates, not a change of axes.
        "uirevision": f"{options.x}-{options.log_y}-{options.grouping}",
        "annotations": [], "shapes": [],
    }
    time_x = options.x == "time"
    width = (1.0 - _COLUMN_GAP * (cols - 1)) / cols
    for n, panel in enumerate(panels_):
        row, col = divmod(n, cols)
        top = row * (_PANEL_PX + _GAP_PX)
        y_domain = [1 - (top + _PANEL_PX) / plot_px, 1 - top / plot_px]
        x0 = col * (width + _COLUMN_GAP)
        layout[f"xaxis{panel.axis}"] = {
            "domain": [x0, x0 + width], "anchor": f"y{panel.axis}", "visible": True,
            "type": "date" if time_x else "linear",
            "title": {"text": "time" if time_x else "step", "standoff": 2,
                      "font": {"size": 11}}, "automargin": True}
        layout[f"yaxis{panel.axis}"] = {
            "domain": [max(0.0, y_domain[0]), min(1.0, y_domain[1])],
            "anchor": f"x{panel.axis}", "type": "log" if options.log_y else "linear",
            "visible": True,
            "automargin": True, "exponentformat": "power" if options.log_y else "none"}
        layout["annotations"].append({
            "text": f"<b>{_escape(panel.title)}</b>", "showarrow": False,
            "xref": f"x{panel.axis} domain", "yref": f"y{panel.axis} domain",
            "x": 0, "y": 1.0, "xanchor": "left", "yanchor": "bottom",
            "font": {"size": 12}})
    if has_sys:
        layout[f"xaxis{sys_axis}"] = {
            "domain": [0.0, 1.0], "anchor": f"y{sys_axis}", "type": "date",
            "title": {"text": "time", "standoff": 2, "font": {"size": 11}},
            "automargin": True}
        layout[f"yaxis{sys_axis}"] = {"domain": [0.0, _SYS_PX / plot_px],
                                      "anchor": f"x{sys_axis}", "range": [0, 105],
                                      "title": {"text": "%"}, "automargin": True}
        title = ("GPU utilisation and memory" if sys_kind == "gpu"
                 else "CPU and RAM (no GPU on this instance)")
        layout["annotations"].append({
            "text": f"<b>{title}</b>", "showarrow": False,
            "xref": f"x{sys_axis} domain", "yref": f"y{sys_axis} domain",
            "x": 0, "y": 1.0, "xanchor": "left", "yanchor": "bottom", "font": {"size": 12}})
    return layout


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
