"""Static figures for records, drawn with matplotlib (Agg): no browser, no JavaScript.

:func:`render` draws the final state of a job's dashboard (the same series as the live
widget, :class:`spotnb.widgets.series.DashboardData`): a panel per metric against step
with the redone points, the interruptions and the resumes, CPU/GPU use against time,
and a headline with the cost and the spot prices. It is what a reader sees where
widgets do not render: GitHub's notebook viewer, an HTML export read offline, an image
viewer. :func:`dashboard_png` draws it from a job's events and record.
:func:`compare_png` overlays the metric curves of several records, with their
interruptions.

The figures never touch pyplot's global state, so drawing one inside a kernel does not
change the notebook's own matplotlib backend.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spotnb.protocol.events import Event

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from spotnb.widgets.series import DashboardData

__all__ = ["INSTALL_HINT", "LOSS_COLOUR", "RUN_COLOURS", "available", "compare_png",
           "dashboard_png", "price_lines", "render"]

INSTALL_HINT = "pip install 'spotnb[records]' (matplotlib)"
#: The first metric's colour (the dashboard's); nothing else in the figure uses it.
LOSS_COLOUR = "#1f77b4"
#: A colour per run of a comparison, in the order the runs are named (the dashboard's
#: metric colours, then red and grey: a comparison's interruptions take their run's).
RUN_COLOURS = ("#1f77b4", "#9467bd", "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
               "#ff7f0e", "#d62728", "#7f7f7f")
_SIZE_INCHES = (10.0, 7.6)
_DPI = 100


def available() -> bool:
    """Whether matplotlib is installed."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    # No timestamp or version in the file: the same record draws the same bytes.
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def _headline(record: Mapping[str, Any]) -> tuple[str, str]:
    title = f"{record.get('name')} · job {record.get('job_id')} · {record.get('status')}"
    money = f"cost ${record.get('cost_usd', 0):.4f} vs ${record.get('ondemand_cost_usd', 0):.4f}"
    if record.get("savings_pct") is not None:
        money += f" on-demand ({record['savings_pct']:.0f}% less)"
    minutes, seconds = divmod(int(record.get("duration_s") or 0), 60)
    parts = [f"{len(record.get('attempts') or [])} attempts",
             f"{record.get('interruptions', 0)} interruptions", money,
             f"{minutes}:{seconds:02d} min"]
    finals = [f"{k} {v:.4g}" for k, v in (record.get("final_metrics") or {}).items()
              if isinstance(v, (int, float))][:4]
    return title, " · ".join(parts + finals)


def dashboard_png(events: Sequence[Event], record: Mapping[str, Any]) -> bytes:
    """The job's final dashboard as a PNG: ``events`` is its whole event log and
    ``record`` its :func:`~spotnb.records.summary.job_record` (for the headline)."""
    from spotnb.widgets.series import DashboardData

    data = DashboardData(max_nodes=int((record.get("nodes") or {}).get("max") or 1))
    data.add(list(events))
    title, line = _headline(record)
    return render(data, title, [line, *price_lines(data)])


def price_lines(data: DashboardData) -> list[str]:
    """What the spot prices were, per pool the job ran in, and where they come from."""
    lines = []
    for pool in data.pools.values():
        if not pool.prices:
            continue
        lo, hi = min(pool.prices), max(pool.prices)
        span = f"${lo:.4f}/h" if lo == hi else f"${lo:.4f}-{hi:.4f}/h"
        text = f"spot {pool.pool}: {span}"
        if pool.ondemand:
            text += f" (on-demand ${pool.ondemand:.4f}/h)"
        dates = pool.history_dates(data.last_time)
        if dates:
            text += f"; the local cloud replayed real prices of {dates}"
        lines.append(text)
    return lines


def render(data: DashboardData, title: str, lines: Sequence[str]) -> bytes:
    """The dashboard's figure as a PNG (see the module docstring): a panel per metric,
    two per row, each with its own y axis; CPU/GPU use below; interruptions, resumes
    and redone steps marked as on the live dashboard."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from spotnb.widgets.plots import (
        COLOURS,
        INTERRUPT_COLOUR,
        MEM_COLOUR,
        RESUME_COLOUR,
        UTIL_COLOUR,
        WORLD_COLOUR,
    )

    names = data.metric_names()
    cols = 1 if len(names) <= 1 else 2
    rows = max(1, -(-len(names) // cols))
    has_sys = len(data.util) > 0 or bool(data.worlds)
    heights = [2.3] * rows + ([1.5] if has_sys else [])
    fig = Figure(figsize=(_SIZE_INCHES[0], 1.1 + 0.16 * len(lines) + sum(heights)),
                 layout="constrained")
    # A "$" starts mathtext in matplotlib: escape the prices.
    fig.suptitle("\n".join([title, *lines]).replace("$", r"\$"), fontsize=9, x=0.01,
                 ha="left")
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    origin = data.first_time or 0.0
    for n, name in enumerate(names or [""]):
        ax = fig.add_subplot(grid[n // cols, n % cols])
        if not name:
            ax.text(0.5, 0.5, "no metrics logged", ha="center", va="center",
                    transform=ax.transAxes, color="#57606a")
            continue
        series = data.metrics[name]
        x, y, _t = series.points(full=True)
        ax.plot(x, y, color=COLOURS[n % len(COLOURS)], lw=1.4)
        if len(series.redone):
            ax.plot(series.redone.full.x, series.redone.full.y, ls="none", marker="x", ms=3,
                    color="#6e7781", alpha=0.7)
        for marker in data.markers:
            if marker.step is not None:
                ax.axvline(marker.step, **_mark_style(marker.ended, INTERRUPT_COLOUR,
                                                      RESUME_COLOUR))
        ax.set_title(name, fontsize=9, loc="left", fontweight="bold")
        ax.set_xlabel("step", fontsize=8)
        _style(ax)
    if has_sys:
        ax = fig.add_subplot(grid[rows, :])
        gpu = data.sys_kind == "gpu"
        if data.multinode:  # a line per node, and the world size on the right
            for slot in sorted(data.node_util):
                x, y = data.sys_points(data.node_util[slot], full=True,
                                       gaps=data.node_gaps[slot])
                ax.plot((x - origin) / 60.0, y, color=COLOURS[slot % len(COLOURS)], lw=1,
                        label=f"node {slot} {'GPU' if gpu else 'CPU'} %")
            if data.worlds:
                t, size, _nodes = data.world_points()
                right = ax.twinx()
                right.step((t - origin) / 60.0, size, where="post", color=WORLD_COLOUR,
                           lw=1.6, label="world size")
                right.set_ylim(0, max(size) + 1)  # above the highest world: clear of 100% lines
                right.set_ylabel("world size", fontsize=8)
                right.tick_params(labelsize=7)
                right.legend(fontsize=7, loc="lower right", frameon=False)
        else:
            x, y = data.sys_points(data.util, full=True)
            ax.plot((x - origin) / 60.0, y, color=UTIL_COLOUR, lw=1,
                    label="GPU utilisation %" if gpu else "CPU utilisation %")
            x, y = data.sys_points(data.mem, full=True)
            ax.plot((x - origin) / 60.0, y, color=MEM_COLOUR, lw=1,
                    label="GPU memory %" if gpu else "RAM used %")
        for marker in data.markers:
            ax.axvline((marker.time - origin) / 60.0,
                       **_mark_style(marker.ended, INTERRUPT_COLOUR, RESUME_COLOUR))
        ax.set_ylim(0, 105)
        ax.set_ylabel("%", fontsize=8)
        ax.set_xlabel("minutes since the job started", fontsize=8)
        title = ("GPU utilisation and memory" if gpu
                 else "CPU and RAM (no GPU on this instance)")
        if data.multinode:
            title = f"{'GPU' if gpu else 'CPU'} utilisation per node and world size"
        ax.set_title(title, fontsize=9, loc="left", fontweight="bold")
        ax.legend(fontsize=7, loc="lower left", frameon=False, ncols=2)
        _style(ax)
    handles = []
    if any(m.ended for m in data.markers):
        handles.append(Line2D([], [], label="interruption",
                              **_mark_style(True, INTERRUPT_COLOUR, RESUME_COLOUR)))
    if any(not m.ended for m in data.markers):
        handles.append(Line2D([], [], label="resume on a replacement",
                              **_mark_style(False, INTERRUPT_COLOUR, RESUME_COLOUR)))
    if any(len(s.redone) for s in data.metrics.values()):
        handles.append(Line2D([], [], ls="none", marker="x", ms=4, color="#6e7781",
                              label="redone steps"))
    if handles:
        fig.legend(handles=handles, loc="outside upper right", fontsize=8, frameon=False,
                   ncols=len(handles))
    return _png(fig)


def _mark_style(ended: bool, interrupt: str, resume: str) -> dict[str, Any]:
    return {"color": interrupt if ended else resume, "ls": "--" if ended else ":",
            "lw": 1.2}


def _style(ax: Axes) -> None:
    ax.grid(True, color="#eaeef2", lw=0.6)
    ax.tick_params(labelsize=7)


def compare_png(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> bytes:
    """The metric curves of several records overlaid, one plot per metric: a colour
    per record (:data:`RUN_COLOURS`, as in ``%spot_compare``), a line style per job of
    a record, and each job's interruptions (its record's ``breaks``) as dashed
    vertical lines in its colour at the last step the interrupted attempt logged.

    ``runs`` is ``[(label, job records), ...]``; a record's curves come from its
    ``curves`` field, so a record compares without the store it came from.
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    names: list[str] = []
    for _label, jobs in runs:
        for job in jobs:
            names += [n for n in job.get("curves") or {} if n not in names]
    rows = max(1, len(names))
    fig = Figure(figsize=(10.0, 1.0 + 2.8 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    styles = ("-", "--", "-.", ":")
    marked = False
    for ax, name in zip(axes, names or ["(no metric curves)"], strict=False):
        for r, (label, jobs) in enumerate(runs):
            colour = RUN_COLOURS[r % len(RUN_COLOURS)]
            for j, job in enumerate(jobs):
                curve = (job.get("curves") or {}).get(name)
                if not curve:
                    continue
                tag = label if len(jobs) == 1 else f"{label}: {job.get('name')}"
                ax.plot(curve["step"], [float("nan") if v is None else v for v in curve["value"]],
                        color=colour, ls=styles[j % len(styles)], lw=1.4, label=tag)
                for brk in job.get("breaks") or []:
                    if isinstance(brk.get("step"), (int, float)):
                        ax.axvline(brk["step"], color=colour, ls=(0, (4, 3)), lw=1.5)
                        marked = True
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel("step")
        ax.grid(True, color="#eaeef2", lw=0.6)
        handles, _labels = ax.get_legend_handles_labels()
        if handles:
            if marked:
                handles.append(Line2D([], [], color="#57606a", ls=(0, (4, 3)), lw=1.2,
                                      label="interruption (in the run's colour)"))
            ax.legend(handles=handles, fontsize=8, frameon=False)
    fig.suptitle(" vs ".join(label for label, _ in runs), fontsize=10)
    return _png(fig)
