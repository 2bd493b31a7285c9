"""Static figures for records, drawn with matplotlib (Agg): no browser, no JavaScript.

:func:`dashboard_png` draws the final state of a job's dashboard from its events (the
same series as the live widget, via :class:`spotnb.widgets.series.DashboardData`):
metrics against step with the redone points and the interruptions, CPU/GPU use and
the spot price against time. It is what a reader sees where widgets and plotly do not
render: GitHub's notebook viewer, an HTML export read offline, an image viewer.
:func:`compare_png` overlays the metric curves of several records.

The figures never touch pyplot's global state, so drawing one inside a kernel does not
change the notebook's own matplotlib backend.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spotnb.events import Event

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["INSTALL_HINT", "LOSS_COLOUR", "available", "compare_png", "dashboard_png"]

INSTALL_HINT = "pip install 'spotnb[records]' (matplotlib)"
#: The first metric's colour (the dashboard's); nothing else in the figure uses it.
LOSS_COLOUR = "#1f77b4"
_METRIC_COLOURS = (LOSS_COLOUR, "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
_INTERRUPT_COLOUR = "#d62728"
_RESUME_COLOUR = "#2ca02c"
_PRICE_COLOUR = "#6f42c1"
_METRICS_SHOWN = 3
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
    import numpy as np
    from matplotlib.figure import Figure

    from spotnb.widgets.series import DashboardData

    data = DashboardData()
    data.add(list(events))
    origin = data.first_time or 0.0
    fig = Figure(figsize=_SIZE_INCHES, layout="constrained")
    title, line = _headline(record)
    # A "$" starts mathtext in matplotlib: escape the prices.
    fig.suptitle(f"{title}\n{line}".replace("$", r"\$"), fontsize=10, x=0.01, ha="left")
    metrics, sys_, price = fig.subplots(3, 1, height_ratios=[0.44, 0.28, 0.28])

    names = data.metric_names()[:_METRICS_SHOWN]
    for n, name in enumerate(names):
        series = data.metrics[name]
        colour = _METRIC_COLOURS[n % len(_METRIC_COLOURS)]
        metrics.plot(series.curve.full.x, series.curve.full.y, color=colour, lw=1.4,
                     label=name)
        if len(series.redone):
            metrics.plot(series.redone.full.x, series.redone.full.y, ls="none", marker="x",
                         ms=3, color="#7f7f7f", alpha=0.6, label=f"{name}, redone")
    if not names:
        metrics.text(0.5, 0.5, "no metrics logged", ha="center", va="center",
                     transform=metrics.transAxes, color="#57606a")
    for marker in data.markers:
        interrupted = marker.kind == "interrupted"
        style = {"color": _INTERRUPT_COLOUR if interrupted else _RESUME_COLOUR,
                 "ls": "--" if interrupted else ":", "lw": 1.2}
        if marker.step is not None:
            metrics.axvline(marker.step, **style)
        t = (marker.time - origin) / 60.0
        sys_.axvline(t, **style)
        price.axvline(t, **style)
    kinds = {m.kind for m in data.markers}
    _legend(metrics, extra=[(label, colour, style) for kind, label, colour, style in (
        ("interrupted", "interruption", _INTERRUPT_COLOUR, "--"),
        ("resumed", "resume", _RESUME_COLOUR, ":")) if kind in kinds])
    metrics.set_xlabel("step", fontsize=9)
    metrics.set_title("metrics against step", fontsize=9, loc="left")

    gpu = data.sys_kind == "gpu"
    if len(data.util):
        sys_.plot((data.util.full.x - origin) / 60.0, data.util.full.y, color="#ff7f0e",
                  lw=1, label="GPU utilisation %" if gpu else "CPU utilisation %")
        sys_.plot((data.mem.full.x - origin) / 60.0, data.mem.full.y, color="#7f7f7f",
                  lw=1, label="GPU memory %" if gpu else "RAM used %")
        _legend(sys_)
    sys_.set_ylim(0, 105)
    sys_.set_ylabel("%", fontsize=9)
    sys_.set_title("utilisation" + ("" if gpu else " (no GPU)"), fontsize=9, loc="left")

    if len(data.price):
        end = max(data.last_time, float(data.price.x[-1]))
        px = (np.append(data.price.x, end) - origin) / 60.0
        py = np.append(data.price.y, data.price.y[-1])
        price.step(px, py, where="post", color=_PRICE_COLOUR, lw=1.4, label="spot $/h")
        cap = (record.get("options") or {}).get("max_price")
        if cap is not None:
            price.axhline(float(cap), color=_INTERRUPT_COLOUR, ls="--", lw=1, label="max price")
        if data.ondemand is not None:
            price.axhline(data.ondemand, color="#6e7781", ls=":", lw=1, label="on-demand")
        price.set_ylim(bottom=0)
        _legend(price)
    price.set_ylabel("USD / hour", fontsize=9)
    price.set_xlabel("minutes since the job started", fontsize=9)
    price.set_title("spot price of the instance's pool", fontsize=9, loc="left")
    for ax in (metrics, sys_, price):
        ax.grid(True, color="#eaeef2", lw=0.6)
        ax.tick_params(labelsize=8)
    return _png(fig)


def _legend(ax: Axes, extra: Sequence[tuple[str, str, str]] = ()) -> None:
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    for label, colour, style in extra:
        handles.append(Line2D([], [], color=colour, ls=style, lw=1.2))
        labels.append(label)
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  frameon=False)


def compare_png(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> bytes:
    """The metric curves of several records overlaid, one plot per metric.

    ``runs`` is ``[(label, job records), ...]``; a record's curves come from its
    ``curves`` field, so a record compares without the store it came from.
    """
    from matplotlib.figure import Figure

    names: list[str] = []
    for _label, jobs in runs:
        for job in jobs:
            names += [n for n in job.get("curves") or {} if n not in names]
    rows = max(1, len(names))
    fig = Figure(figsize=(10.0, 1.0 + 2.8 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    styles = ("-", "--", "-.", ":")
    for ax, name in zip(axes, names or ["(no metric curves)"], strict=False):
        for r, (label, jobs) in enumerate(runs):
            for j, job in enumerate(jobs):
                curve = (job.get("curves") or {}).get(name)
                if not curve:
                    continue
                tag = label if len(jobs) == 1 else f"{label}: {job.get('name')}"
                ax.plot(curve["step"], [float("nan") if v is None else v for v in curve["value"]],
                        color=_METRIC_COLOURS[r % len(_METRIC_COLOURS)],
                        ls=styles[j % len(styles)], lw=1.4, label=tag)
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel("step")
        ax.grid(True, color="#eaeef2", lw=0.6)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, frameon=False)
    fig.suptitle(" vs ".join(label for label, _ in runs), fontsize=10)
    return _png(fig)
