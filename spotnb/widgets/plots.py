"""The dashboard's figure: a panel per metric, each with its own y axis, and the
instance's GPU or CPU use; interruptions and resumes marked on every panel.

As TensorBoard and W&B do: one panel per metric (or the panels a user groups them
into: metrics of the same name, ``train/loss`` with ``val/loss``, or all in one), a
smoothing control (a debiased moving average weighted by the step gap between points:
:func:`ema`), a log scale per panel, and x as the step, the time since the job started
or the wall-clock time. Every panel's x axis is linked to the others (a zoom on one
zooms them all), the system panel's included: against step, its samples are placed at
the step the job was at when they were taken
(:meth:`~spotnb.widgets.series.DashboardData.time_to_step`). A curve is broken where a
replacement instance took over (no line drawn across the gap), the steps that an
interrupted instance logged after its last checkpoint show as grey crosses, and each
interruption and resume is a vertical line with a legend entry whose hover text says
what happened.

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

__all__ = ["COLOURS", "GROUPINGS", "INTERRUPT_COLOUR", "RESUME_COLOUR", "SMOOTHING_SCALE",
           "X_AXES", "Panel", "PlotOptions", "Plots", "binary", "ema", "figure_layout",
           "mark_points", "panels", "relative_unit", "scatter", "values", "y_span"]

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


#: The x axis choices: (key, label for the control, tooltip).
X_AXES = (("step", "step", "metrics and system use against step"),
          ("relative", "relative", "against the time since the job started"),
          ("time", "wall time", "against the clock"))
#: The smoothing window is a fraction of the run's steps: at weight ``w`` about
#: ``1 / (1 - w)`` of ``1 / SMOOTHING_SCALE`` of them (:func:`ema`).
SMOOTHING_SCALE = 1000.0


@dataclasses.dataclass
class PlotOptions:
    """What the user chose: x as ``"step"``, ``"relative"`` (time since the job's
    start) or ``"time"`` (wall clock), the smoothing weight (0 to 0.99), the metric
    panels (by title) drawn with a log y scale, and the grouping (:data:`GROUPINGS`)."""

    x: str = "step"
    smoothing: float = 0.0
    log_panels: frozenset[str] = frozenset()
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


def relative_unit(seconds: float) -> tuple[float, str]:
    """The unit of a relative-time axis spanning ``seconds``: (seconds per unit, name),
    so that its ticks read as a few seconds, minutes or hours."""
    if seconds < 180:
        return 1.0, "s"
    if seconds < 3 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def _axis(n: int) -> str:
    """Axis suffix of the n-th axis pair (0 -> ``""``, 1 -> ``"2"``)."""
    return "" if n == 0 else str(n + 1)


@dataclasses.dataclass
class Panel:
    title: str
    metrics: list[str]
    axis: str  # "" or "2", "3", ...
    marks: tuple[int, int] = (-1, -1)  # trace indexes: interruptions, resumes
    log: bool = False


class Plots:
    """The figure and how it is drawn from :class:`DashboardData` (module docstring)."""

    def __init__(self) -> None:
        from spotnb.widgets.elements import LiveFigure

        self.options = PlotOptions()
        self.figure = LiveFigure()
        self.figure.plot_layout = _base_layout()
        self._structure: tuple[Any, ...] | None = None
        self._panels: list[Panel] = []
        self._layout: dict[str, Any] = {}
        self._specs: list[dict[str, Any]] = []  # the traces, without their arrays
        self._traces: dict[str, tuple[int, int, int]] = {}  # raw, smoothed, redone
        self._sys: tuple[int, int] | None = None
        self._nodes: dict[int, int] = {}  # node slot -> its utilisation trace
        self._world: int | None = None  # the world size trace
        self._sys_axis = ""
        self._tz = 0.0
        self._start = 0.0  # the job's first event: relative time's zero
        self._sys_on = "step"  # the system panel's x: the metrics' or the wall clock
        self._unit = (1.0, "s")  # relative time's unit

    def panel_titles(self) -> tuple[str, ...]:
        """The metric panels' titles, in order, as last drawn."""
        return tuple(panel.title for panel in self._panels)

    # -- drawing -------------------------------------------------------------------

    def draw(self, data: DashboardData) -> None:
        """Bring the figure up to date with ``data`` and the options: one message with
        the traces (their arrays as binary buffers), and the layout when it changed."""
        names = data.metric_names()
        groups = panels(names, self.options.grouping)
        relative = self.options.x == "relative"
        if relative and data.first_time is not None:
            unit = relative_unit(data.last_time - data.first_time)
        else:
            unit = self._unit
        structure = (tuple((t, tuple(m)) for t, m in groups),
                     len(data.util) > 0, data.sys_kind, self.options.x,
                     tuple(t for t, _m in groups if t in self.options.log_panels),
                     tuple(sorted(data.node_util)), bool(data.worlds),
                     unit if relative else None, bool(data.metrics))
        if structure != self._structure:
            self._unit = unit
            # Against step, the system panel needs logged rows to place its samples:
            # until the first, it stays on the wall clock (its own, unlinked axis).
            self._sys_on = ("time" if self.options.x == "step" and not data.metrics
                            else self.options.x)
            self._rebuild(data, structure)
        traces = [dict(spec) for spec in self._specs]
        step_x = self.options.x == "step"
        smoothing = self.options.smoothing
        curves = {name: data.metrics[name].points() for name in self._traces}
        # One smoothing scale for every curve: the figure's span of steps.
        ends = np.array([c[0][[0, -1]] for c in curves.values() if len(c[0])]).ravel()
        ends = ends[np.isfinite(ends)]
        span = float(ends.max() - ends.min()) if len(ends) else 0.0
        step_unit = max(span / SMOOTHING_SCALE, 1.0)
        for name, (raw, smooth, redone) in self._traces.items():
            series = data.metrics[name]
            x, y, t = curves[name]
            xs = x if step_x else self._tx(t)
            traces[raw].update(x=binary(xs), y=binary(y),
                               opacity=0.3 if smoothing > 0 else 1.0)
            traces[smooth]["visible"] = smoothing > 0
            if smoothing > 0:
                traces[smooth].update(x=binary(xs),
                                      y=binary(ema(y, smoothing, x, step_unit)))
            rx, ry, rt = series.redone.view.points()
            traces[redone].update(x=binary(rx if step_x else self._tx(rt)), y=binary(ry))
        sys_x = functools.partial(self._sys_x, data)
        for slot, index in self._nodes.items():
            x, y = data.sys_points(data.node_util[slot], gaps=data.node_gaps[slot])
            traces[index].update(x=binary(sys_x(x)), y=binary(y))
        if self._world is not None:
            x, y, nodes = data.world_points()
            traces[self._world].update(x=binary(sys_x(x, held=True)), y=binary(y),
                                       customdata=binary(nodes))
        if self._sys is not None:
            gpu = data.sys_kind == "gpu"
            util, mem = self._sys
            x, y = data.sys_points(data.util)
            traces[util].update(name="GPU utilisation %" if gpu else "CPU utilisation %",
                                x=binary(sys_x(x)), y=binary(y))
            x, y = data.sys_points(data.mem)
            traces[mem].update(name="GPU memory %" if gpu else "RAM used %",
                               x=binary(sys_x(x)), y=binary(y))
        layout = dict(self._layout)
        layout["shapes"] = self._draw_marks(data, traces)
        with self.figure.hold_sync():
            self.figure.plot_data = traces  # unchanged values are not sent
            self.figure.plot_layout = layout

    def _ms(self, t: np.ndarray) -> np.ndarray:
        """Epoch seconds as the milliseconds of a plotly date axis, in local time."""
        return (np.asarray(t, dtype=float) + self._tz) * 1000.0

    def _tx(self, t: np.ndarray) -> np.ndarray:
        """Epoch seconds as x on a time axis: wall clock, or relative to the start."""
        if self.options.x == "relative":
            return (np.asarray(t, dtype=float) - self._start) / self._unit[0]
        return self._ms(t)

    def _sys_x(self, data: DashboardData, t: np.ndarray, held: bool = False
               ) -> np.ndarray:
        """Sample times as x: on the metrics' axis (against step, the step reached;
        ``held``: a step function's times, each at the nearest step)."""
        if self._sys_on == "step":
            return data.time_to_step(t, held=held)
        return self._tx(t)

    def _rebuild(self, data: DashboardData, structure: tuple[Any, ...]) -> None:
        """New panels: the traces (their arrays are filled by each draw) and axes."""
        self._structure = structure
        if data.first_time is not None:
            self._tz = float(time.localtime(data.first_time).tm_gmtoff)
            self._start = data.first_time
        groups = panels(data.metric_names(), self.options.grouping)
        has_sys = len(data.util) > 0 or bool(data.worlds)
        at = _x_hover(self.options.x, self._unit[1])
        sys_at = _x_hover(self._sys_on, self._unit[1])
        specs: list[dict[str, Any]] = []
        self._panels, self._traces = [], {}
        order = {name: i for i, name in enumerate(data.metric_names())}
        for n, (title, members) in enumerate(groups):
            panel = Panel(title, members, _axis(n), log=title in self.options.log_panels)
            self._panels.append(panel)
            axes = {"xaxis": f"x{panel.axis}", "yaxis": f"y{panel.axis}"}
            several = len(members) > 1
            hover = f"%{{fullData.name}}: %{{y:.4g}} {at}<extra></extra>"
            for name in members:
                colour = COLOURS[order[name] % len(COLOURS)]
                first = len(specs)
                specs += [
                    scatter(name=name, mode="lines", legendgroup=name, showlegend=several,
                             line={"color": colour, "width": 1.6}, hovertemplate=hover,
                             **axes),
                    scatter(name=f"{name} (smoothed)", mode="lines", legendgroup=name,
                             showlegend=False, visible=False,
                             line={"color": colour, "width": 2}, hovertemplate=hover,
                             **axes),
                    scatter(name="redone steps", mode="markers", legendgroup="redone",
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
                specs.append(scatter(
                    name=f"node {slot} {kind} %", mode="lines", legendgroup="nodes",
                    line={"color": COLOURS[slot % len(COLOURS)], "width": 1.2},
                    hovertemplate=f"%{{fullData.name}}: %{{y:.0f}} {sys_at}<extra></extra>",
                    **axes))
            if data.worlds:
                self._world = len(specs)
                specs.append(scatter(
                    name="world size", mode="lines", line={"color": WORLD_COLOUR,
                                                           "width": 2, "shape": "hv"},
                    hovertemplate="world size %{y:.0f} (%{customdata:.0f} nodes) "
                                  f"{sys_at}<extra></extra>",
                    xaxis=f"x{self._sys_axis}", yaxis=f"y{world_axis}"))
        elif has_sys:
            axes = {"xaxis": f"x{self._sys_axis}", "yaxis": f"y{self._sys_axis}"}
            hover = f"%{{fullData.name}}: %{{y:.0f}} {sys_at}<extra></extra>"
            self._sys = (len(specs), len(specs) + 1)
            specs += [
                scatter(name="utilisation %", mode="lines", line={"color": UTIL_COLOUR},
                         hovertemplate=hover, **axes),
                scatter(name="memory %", mode="lines", line={"color": MEM_COLOUR},
                         hovertemplate=hover, **axes),
            ]
        self._specs = specs
        self._layout = figure_layout(self._panels, has_sys, self._sys_axis, data.sys_kind,
                               self.options, self._unit[1], self._sys_on)
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
        time_x = self.options.x != "step"
        legend = {0: False, 1: False}  # one legend entry each, on a trace with lines
        for panel in self._panels:
            ys = [data.metrics[m].curve.view.points()[1] for m in panel.metrics]
            lo, hi = y_span(ys, panel.log)
            for which, (index, kinds) in enumerate(zip(
                    panel.marks, (("interrupted", "lost", "retry"), ("resumed",)),
                    strict=True)):
                x, y, text = mark_points([m for m in data.markers if m.kind in kinds],
                                          lo, hi, panel.log, time_x, self._tx)
                traces[index].update(x=binary(x), y=binary(y), text=text,
                                     showlegend=bool(len(x)) and not legend[which])
                legend[which] = legend[which] or bool(len(x))
        # Marks at no known step (an attempt that logged nothing) are still on the system
        # panel: their legend entry must be somewhere.
        for which, kinds in enumerate((("interrupted", "lost", "retry"), ("resumed",))):
            if self._panels and not legend[which] and \
                    any(m.kind in kinds for m in data.markers):
                nan = np.array([np.nan])
                traces[self._panels[0].marks[which]].update(
                    x=binary(nan), y=binary(nan), text=[""], showlegend=True)
        shapes = []
        if self._sys is not None or self._nodes or self._world is not None:
            for marker in data.markers:
                colour, dash = ((INTERRUPT_COLOUR, "dash") if marker.ended
                                else (RESUME_COLOUR, "dot"))
                if self._sys_on != "step":
                    at = float(self._tx(np.array([marker.time]))[0])
                elif marker.step is not None:
                    at = marker.step
                else:  # a node that logged no step (another rank logs): when it was
                    at = float(data.time_to_step(np.array([marker.time]), held=True)[0])
                if not math.isfinite(at):
                    continue
                shapes.append({"type": "line", "xref": f"x{self._sys_axis}",
                               "yref": f"y{self._sys_axis} domain", "x0": at, "x1": at,
                               "y0": 0, "y1": 1,
                               "line": {"color": colour, "dash": dash, "width": 1.2}})
        return shapes


def binary(values: np.ndarray) -> memoryview:
    """An array as float64 bytes: it travels as a binary buffer, not as JSON numbers."""
    return memoryview(np.ascontiguousarray(values, dtype=np.float64).tobytes())


def values(trace: dict[str, Any], key: str) -> np.ndarray:
    """A trace's ``x`` or ``y`` back as an array (tests, the static copy)."""
    raw = trace.get(key)
    if raw is None:
        return np.empty(0)
    return np.frombuffer(bytes(raw), dtype=np.float64)


def scatter(**props: Any) -> dict[str, Any]:
    return {"type": "scatter", "x": binary(np.empty(0)), "y": binary(np.empty(0)), **props}


def ema(y: np.ndarray, weight: float, x: np.ndarray | None = None,
        unit: float = 1.0) -> np.ndarray:
    """A debiased exponential moving average weighted by the step gap between points
    (``weight`` 0: none; 0.99: very smooth).

    Each point decays the average by ``weight ** (gap / unit)``, ``gap`` being its
    distance in ``x`` (steps) from the previous point, and the average is divided by
    the sum of the weights, which removes the start-up bias. With a gap of one
    ``unit`` everywhere (or no ``x``) it is TensorBoard's smoothing exactly; a metric
    logged every 25 steps is averaged over as many *steps* as one logged at every step,
    not over 25 times more (TensorBoard's per-point average lags it by hundreds of
    steps). The dashboard's ``unit`` is the figure's span of steps over
    :data:`SMOOTHING_SCALE` (one step at least), as W&B scales its time-weighted
    average by the chart's x range: the look of a curve then does not depend on how
    its points were reduced for display.

    The gap is counted in steps, not in time (W&B's default weighs by the x axis, time
    included): an interruption leaves hours between two rows but no step, so the
    resumed attempt's curve continues from the average at the resume step instead of
    starting again. NaN points (the breaks between attempts) stay NaN and neither
    reset the average nor count as a gap. Applied to the displayed (reduced) points, as
    TensorBoard and W&B do, so its cost is bounded like theirs."""
    if weight <= 0 or not len(y):
        return y
    # Without x, a point per unit (NaN breaks take no room).
    xs = (np.cumsum(np.isfinite(y), dtype=float) if x is None
          else np.asarray(x, dtype=float))
    out = np.empty_like(y)
    total = norm = 0.0
    previous = math.nan
    for i, (value, at) in enumerate(zip(y.tolist(), xs.tolist(), strict=True)):
        if not math.isfinite(value) or not math.isfinite(at):
            out[i] = math.nan
            continue
        gap = max(at - previous, 0.0) / unit if math.isfinite(previous) else 0.0
        decay = weight ** gap
        total = total * decay + value
        norm = norm * decay + 1.0
        out[i] = total / norm
        previous = at
    return out


def _mark_trace(name: str, colour: str, dash: str, axes: dict[str, str]) -> dict[str, Any]:
    return scatter(name=name, mode="lines", legendgroup=name, showlegend=False,
                    line={"color": colour, "dash": dash, "width": 1.5}, text=[],
                    hovertemplate="%{text}<extra></extra>", **axes)


def y_span(ys: list[np.ndarray], log: bool) -> tuple[float, float]:
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


def mark_points(markers: list[Marker], lo: float, hi: float, log: bool, time_x: bool,
                 to_x: Any) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Vertical lines from ``lo`` to ``hi``, a few points each (hover finds a point
    anywhere along the line), separated by NaN."""
    levels = (np.geomspace(lo, hi, _MARK_LEVELS) if log
              else np.linspace(lo, hi, _MARK_LEVELS))
    xs: list[float] = []
    ys: list[float] = []
    texts: list[str] = []
    for marker in markers:
        if time_x:
            at = float(to_x(np.array([marker.time]))[0])
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


def _x_hover(x: str, unit: str) -> str:
    """Where a point is, in a hover template, on the x axis ``x``."""
    if x == "time":
        return "at %{x|%H:%M:%S}"
    if x == "relative":
        return f"at %{{x:.3g}} {unit} since the start"
    return "at step %{x:.0f}"


def _x_axis(x: str, unit: str) -> dict[str, Any]:
    """An x axis's type and title for the x choice ``x`` (:data:`X_AXES`)."""
    kind, title = {"time": ("date", "time"),
                   "relative": ("linear", f"time since the start ({unit})")}.get(
                       x, ("linear", "step"))
    return {"type": kind, "title": {"text": title, "standoff": 2, "font": {"size": 11}}}


def figure_layout(panels_: list[Panel], has_sys: bool, sys_axis: str, sys_kind: str | None,
            options: PlotOptions, unit: str = "s", sys_x: str | None = None
            ) -> dict[str, Any]:
    """Axes, titles and sizes for the panels: a grid of two columns (one for a single
    metric), the system panel across the bottom. Every x axis matches the first one,
    so a zoom or a pan on any panel moves them all; each y axis is its panel's own,
    linear or log, and keeps its zoom until its own scale changes. ``sys_x``: the
    system panel's x choice, if not the metrics' (then its axis is its own)."""
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
        # The user's zoom and hidden traces survive updates, not a change of axes (a y
        # axis's own revision also names its scale: see below).
        "uirevision": f"{options.x}-{unit}-{options.grouping}",
        "annotations": [], "shapes": [],
    }
    x_axis = _x_axis(options.x, unit)
    width = (1.0 - _COLUMN_GAP * (cols - 1)) / cols
    for n, panel in enumerate(panels_):
        row, col = divmod(n, cols)
        top = row * (_PANEL_PX + _GAP_PX)
        y_domain = [1 - (top + _PANEL_PX) / plot_px, 1 - top / plot_px]
        x0 = col * (width + _COLUMN_GAP)
        layout[f"xaxis{panel.axis}"] = {
            "domain": [x0, x0 + width], "anchor": f"y{panel.axis}", "visible": True,
            **x_axis, "automargin": True, **_linked(panel.axis)}
        layout[f"yaxis{panel.axis}"] = {
            "domain": [max(0.0, y_domain[0]), min(1.0, y_domain[1])],
            "anchor": f"x{panel.axis}", "type": "log" if panel.log else "linear",
            "visible": True, "uirevision": f"{layout['uirevision']}-{panel.log}",
            "automargin": True, "exponentformat": "power" if panel.log else "none"}
        layout["annotations"].append({
            "text": f"<b>{_escape(panel.title)}</b>", "showarrow": False,
            "xref": f"x{panel.axis} domain", "yref": f"y{panel.axis} domain",
            "x": 0, "y": 1.0, "xanchor": "left", "yanchor": "bottom",
            "font": {"size": 12}})
    if has_sys:
        own = sys_x not in (None, options.x)
        layout[f"xaxis{sys_axis}"] = {
            "domain": [0.0, 1.0], "anchor": f"y{sys_axis}",
            **(_x_axis(str(sys_x), unit) if own else x_axis), "automargin": True,
            **({} if own else _linked(sys_axis))}
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


def _linked(axis: str) -> dict[str, Any]:
    """What links an x axis to the first panel's (``xaxis``): a zoom moves both."""
    return {"matches": "x"} if axis else {}


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
