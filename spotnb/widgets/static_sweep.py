"""Static forms of a sweep's view and of a comparison, for readers where widgets do
not draw: a notebook reopened without its widget state (JupyterLab's default), its
``jupyter nbconvert --to html`` export read offline, a record, GitHub.

As for the dashboard (:mod:`spotnb.widgets.static`): one output whose ``text/html``
holds a PNG inline (drawn with matplotlib) beside a plain table, no script and no
network, and a style rule that hides it on a page where the live view has drawn its
figure (``body:has(.spotnb-live-KEY .spotnb-figure .js-plotly-plot)``), so a page with
widgets shows the view once. Its ``text/plain`` is the header and the table as text.
The view's own output carries the header and the table as HTML and text too
(:func:`view_html`, :func:`table_text`), updated at the end.
"""

from __future__ import annotations

import base64
import html
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from spotnb.client.comparison import Run
    from spotnb.sweep.analysis import Importance, TrialRow
    from spotnb.sweep.view import Sweep

__all__ = ["compare_bundle", "live_class", "runs_png", "sweep_bundle", "sweep_png",
           "table_html", "table_text", "view_html"]

log = logging.getLogger(__name__)

#: ``metadata.spotnb.figure`` of the static copies.
SWEEP_FIGURE = "sweep"
COMPARE_FIGURE = "compare"
_WIDTH_INCHES = 12.0


def live_class(key: str) -> str:
    """The CSS class of a live view (a sweep's id, a comparison's key): its static
    copy hides next to it."""
    return f"spotnb-live-{key}"


def table_text(columns: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    """A table of columns and rows (the widgets' :class:`~spotnb.widgets.elements.Table`
    form) as aligned text."""
    header = [c["label"] for c in columns]
    body = [[str(r["cells"].get(c["key"], "")) for c in columns] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
                     for line in [header, *body])


def table_html(columns: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
               css_class: str) -> str:
    """The same as an HTML table in a box that scrolls sideways when wider than the
    page (every cell escaped)."""
    head = "".join(f"<th style='text-align:left;padding:2px 6px;white-space:nowrap'>"
                   f"{html.escape(c['label'])}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(
            f"<td style='padding:2px 6px;white-space:nowrap;text-align:"
            f"{'right' if c.get('numeric') else 'left'}'>"
            f"{html.escape(str(r['cells'].get(c['key'], '')))}</td>" for c in columns)
        + "</tr>" for r in rows)
    return (f"<div style='max-width:100%;overflow-x:auto'><table class='{css_class}' "
            f"style='border-collapse:collapse;font-size:85%'><thead><tr>{head}</tr>"
            f"</thead><tbody>{body}</tbody></table></div>")


def view_html(made: Sweep, rows: Sequence[TrialRow]) -> str:
    """The sweep's header and trials table as HTML (its view's static form)."""
    from spotnb.sweep.analysis import table_columns, table_rows
    from spotnb.sweep.view import header_lines

    lines = header_lines(made)
    head = "<br>".join(html.escape(line) for line in lines)
    return (f"<div class='spotnb-static-sweep'><div>{head}</div>"
            + table_html(table_columns(made, list(rows)), table_rows(made, list(rows)),
                         "spotnb-static-table") + "</div>")


def _bundle(image: bytes | None, key: str, caption: str, extra_html: str, text: str,
            meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    static = f"spotnb-static-{key}"
    rule = (f"body:has(.{live_class(key)} .spotnb-figure .js-plotly-plot) .{static} "
            "{ display: none; }")
    img = ""
    if image is not None:
        encoded = base64.b64encode(image).decode()
        img = (f"<img src='data:image/png;base64,{encoded}' "
               f"alt='{html.escape(caption, quote=True)}' style='max-width:100%'>")
    page = f"<style>{rule}</style><div class='spotnb-static {static}'>{img}{extra_html}</div>"
    return {"text/html": page, "text/plain": text}, {"spotnb": meta}


def sweep_bundle(made: Sweep, rows: Sequence[TrialRow], found: Importance,
                 runs: Sequence[Run]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The sweep's final view as one output ``(data, metadata)`` (module docstring);
    None without matplotlib."""
    from spotnb.records import figures
    from spotnb.sweep.analysis import table_columns, table_rows
    from spotnb.sweep.view import header_lines

    if not figures.available():
        log.info("no static copy of the sweep: %s", figures.INSTALL_HINT)
        return None
    try:
        image = sweep_png(made, rows, found, runs)
    except Exception:  # the cell's outcome must not depend on a picture
        log.warning("drawing the static copy of sweep %s failed", made.sweep_id,
                    exc_info=True)
        return None
    columns, shown = table_columns(made, list(rows)), table_rows(made, list(rows))
    caption = (f"Final view of spotnb sweep {made.sweep_id} ({made.name}): parallel "
               "coordinates, objective against each parameter, parameter importance and "
               "the trials' curves")
    text = "\n".join(header_lines(made)) + "\n\n" + table_text(columns, shown)
    meta = {"figure": SWEEP_FIGURE, "sweep_id": made.sweep_id,
            "job_ids": [r.job_id for r in rows if r.job_id]}
    return _bundle(image, made.sweep_id, caption,
                   table_html(columns, shown, "spotnb-static-table"), text, meta)


def compare_bundle(key: str, runs: Sequence[Run], columns: Sequence[dict[str, Any]],
                   rows: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A comparison as one output ``(data, metadata)``: its curves as a PNG and its
    table; None without matplotlib."""
    from spotnb.records import figures

    if not figures.available():
        log.info("no static copy of the comparison: %s", figures.INSTALL_HINT)
        return None
    try:
        image = runs_png(runs)
    except Exception:
        log.warning("drawing the static copy of the comparison failed", exc_info=True)
        return None
    labels = ", ".join(run.label for run in runs)
    caption = f"Comparison of {len(runs)} runs ({labels}): their metrics overlaid"
    meta = {"figure": COMPARE_FIGURE, "job_ids": [r.job_id for r in runs if r.job_id]}
    return _bundle(image, key, caption, table_html(columns, rows, "spotnb-static-table"),
                   caption + "\n\n" + table_text(columns, rows), meta)


# -- the pictures ------------------------------------------------------------------------

def _style(ax: Axes) -> None:
    ax.grid(True, color="#eaeef2", lw=0.6)
    ax.tick_params(labelsize=7)


def _curves(fig: Any, area: Any, runs: Sequence[Run], names: Sequence[str],
            cols: int) -> None:
    """One panel per metric in ``area`` (a part of a figure's grid), every run a
    colour, its interruptions dashed in it; a wide positive range on a log scale (a
    diverged run beside the others)."""
    from spotnb.records.figures import RUN_COLOURS
    from spotnb.sweep.analysis import wide_range

    grid = area.subgridspec(-(-len(names) // cols), cols)
    for n, name in enumerate(names):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        seen: list[float] = []
        for k, run in enumerate(runs):
            colour = RUN_COLOURS[k % len(RUN_COLOURS)]
            x, y = run.points(name)
            if len(x):
                ax.plot(x, y, color=colour, lw=1.3, label=run.label)
                seen += [float(v) for v in y]
            for mark in run.marks:
                if mark.step is not None and len(x):
                    ax.axvline(mark.step, color=colour, ls=(0, (4, 3)), lw=1.1)
        if wide_range(seen):
            ax.set_yscale("log")
        ax.set_title(name, fontsize=9, loc="left", fontweight="bold")
        ax.set_xlabel("step", fontsize=8)
        _style(ax)
        if n == 0 and runs:
            ax.legend(fontsize=7, frameon=False, ncols=2)


def runs_png(runs: Sequence[Run], title: str = "") -> bytes:
    """Runs overlaid (the comparison's figure): a panel per metric, two per row."""
    from matplotlib.figure import Figure

    from spotnb.records.figures import _png

    names: list[str] = []
    for run in runs:
        names += [n for n in run.metric_names() if n not in names]
    names = names or ["(no metrics logged)"]
    cols = 1 if len(names) == 1 else 2
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(_WIDTH_INCHES, 0.6 + 2.8 * rows), layout="constrained")
    if title:
        fig.suptitle(title.replace("$", r"\$"), fontsize=9, x=0.01, ha="left")
    grid = fig.add_gridspec(1, 1)
    _curves(fig, grid[0, 0], runs, names, cols)
    return _png(fig)


def _parallel(ax: Axes, rows: Sequence[TrialRow], metric: str, direction: str) -> None:
    """Parallel coordinates: each axis scaled to [0, 1], a line per trial coloured by
    its objective; pruned trials dashed, interrupted ones with a diamond at each axis."""
    from matplotlib import colormaps

    from spotnb.sweep.analysis import axes

    dims, drawn = axes(rows, metric)
    if not dims:
        ax.text(0.5, 0.5, f"no trial has logged {metric} yet", ha="center", va="center",
                transform=ax.transAxes, color="#57606a")
        ax.set_axis_off()
        return
    cmap = colormaps["viridis_r" if direction == "minimize" else "viridis"]
    objective = np.array(dims[-1].values)  # as placed on its axis (log, if wide)
    lo, hi = float(objective.min()), float(objective.max())
    scaled = []
    for d in dims:
        v = np.array(d.values, dtype=float)
        a = min([*v, *(t for t, _ in d.ticks)])
        b = max([*v, *(t for t, _ in d.ticks)])
        scaled.append((v - a) / (b - a) if b > a else np.full_like(v, 0.5))
    xs = np.arange(len(dims))
    for k, r in enumerate(drawn):
        colour = cmap(0.5 if hi == lo else (objective[k] - lo) / (hi - lo))
        ys = [s[k] for s in scaled]
        ax.plot(xs, ys, color=colour, lw=1.6, ls="--" if r.state == "pruned" else "-",
                marker="D" if r.interrupted else None, ms=4, alpha=0.9)
    for n, d in enumerate(dims):
        ax.axvline(n, color="#8c959f", lw=0.8)
        a = min([*d.values, *(t for t, _ in d.ticks)])
        b = max([*d.values, *(t for t, _ in d.ticks)])
        if d.ticks:
            for t, label in d.ticks:
                y = (t - a) / (b - a) if b > a else 0.5
                ax.text(n + 0.03, y, label, fontsize=6.5, va="center", color="#24292f")
        else:
            for y, value in ((0.0, a), (1.0, b)):
                ax.text(n + 0.03, y, format(value, ".4g"), fontsize=6.5, va="center")
    ax.set_xticks(xs, [d.name + (" (log)" if d.log else "") for d in dims], fontsize=7.5)
    ax.set_yticks([])
    ax.set_xlim(-0.2, len(dims) - 0.5)
    ax.set_title(f"parallel coordinates, coloured by {metric} (dashed: pruned; "
                 "diamonds: interrupted)", fontsize=9, loc="left", fontweight="bold")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def sweep_png(made: Sweep, rows: Sequence[TrialRow], found: Importance,
              runs: Sequence[Run]) -> bytes:
    """The sweep's final view (module docstring of :mod:`spotnb.widgets.sweep`)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from spotnb.records.figures import _png
    from spotnb.sweep.analysis import STATE_COLOURS, axes, wide_range
    from spotnb.sweep.view import header_lines

    metric = made.metric
    params = list(dict.fromkeys(k for r in rows for k in r.params))
    panels = [*params, "importance"]
    cols = min(4, len(panels))
    scatter_rows = -(-len(panels) // cols)
    curve_names = [metric] if any(metric in run.metric_names() for run in runs) else []
    for run in runs:
        curve_names += [n for n in run.metric_names() if n not in curve_names]
    curve_names = curve_names[:4] or ["(no metrics logged)"]
    curve_cols = 1 if len(curve_names) == 1 else 2
    curve_rows = -(-len(curve_names) // curve_cols)
    lines = header_lines(made)
    heights = [3.0] + [2.4] * scatter_rows + [2.5] * curve_rows
    fig = Figure(figsize=(_WIDTH_INCHES, 0.9 + 0.17 * len(lines) + sum(heights)),
                 layout="constrained")
    fig.suptitle("\n".join(lines).replace("$", r"\$"), fontsize=9, x=0.01, ha="left")
    grid = fig.add_gridspec(len(heights), max(cols, curve_cols), height_ratios=heights)
    _parallel(fig.add_subplot(grid[0, :]), rows, metric, made.direction)
    _dims, drawn = axes(rows, metric)
    for n, name in enumerate(panels):
        ax = fig.add_subplot(grid[1 + n // cols, n % cols])
        _style(ax)
        if name == "importance":
            ax.set_title("parameter importance (Optuna)", fontsize=9, loc="left",
                         fontweight="bold")
            if found.values:
                names = list(found.values)[::-1]
                ax.barh(names, [found.values[k] for k in names], color="#1f77b4")
            else:
                ax.text(0.5, 0.5, found.why, ha="center", va="center", wrap=True,
                        transform=ax.transAxes, color="#57606a", fontsize=8)
                ax.set_axis_off()
            continue
        values = [r.params.get(name) for r in drawn]
        numbers = [float(v) for v in values if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        numeric = bool(values) and len(numbers) == len(values)
        for r in drawn:
            x: Any = r.params.get(name) if numeric else str(r.params.get(name))
            ax.scatter([x], [float(r.objective or 0.0)],
                       color=STATE_COLOURS.get(r.state, "#57606a"),
                       marker="D" if r.interrupted else "o", s=28, zorder=3)
        if numeric and wide_range(numbers):
            ax.set_xscale("log")
        if wide_range([float(r.objective or 0.0) for r in drawn]):
            ax.set_yscale("log")
        ax.set_xlabel(name, fontsize=8)
        ax.set_ylabel(f"{metric} (objective)", fontsize=8)
        ax.set_title(f"{metric} against {name}", fontsize=9, loc="left", fontweight="bold")
    _curves(fig, grid[1 + scatter_rows:, :], runs, curve_names, curve_cols)
    states = list(dict.fromkeys(r.state for r in drawn))
    handles = [Line2D([], [], ls="none", marker="o", color=STATE_COLOURS.get(s, "#57606a"),
                      label=s) for s in states]
    if any(r.interrupted for r in drawn):
        handles.append(Line2D([], [], ls="none", marker="D", color="#57606a",
                              label="interrupted"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", fontsize=8, frameon=False,
                   ncols=len(handles))
    return _png(fig)
