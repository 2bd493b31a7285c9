"""The dashboard's header: what a job is doing and what it costs, at a glance.

Four short rows (the text display says the same in lines, :func:`spotnb.client.display.
status_lines`): the state, the attempt (or the one being launched), the instance and
the time; the step of the total with a bar, the pace and the time left, the last
metrics; the cost so far against on-demand, and the projection to the end; the
interruptions with the time and money they took and the steps redone, and the spot
price of each pool the job ran in, with a sparkline over the job, the on-demand price
and where the prices come from (the local cloud replays real history: its dates).
The spot price is folded in here rather than drawn as a plot of its own: on the time
scale of one job it is nearly always a flat line.
"""

from __future__ import annotations

import html

from spotnb.client import display
from spotnb.client.display import JobView
from spotnb.widgets.series import DashboardData, PoolPrices

__all__ = ["header_html", "sparkline"]

STATE_COLOURS = {"completed": "#1a7f37", "failed": "#cf222e", "stopped": "#9a6700",
                 "pruned": "#6e7781",
                 "interrupted": "#bc4c00", "waiting_for_capacity": "#9a6700"}
_GREY = "#57606a"
_SPARK_W, _SPARK_H = 90, 16


def _item(text: str, title: str = "") -> str:
    tip = f" title='{html.escape(title, quote=True)}'" if title else ""
    return (f"<span class='spotnb-h-item' style='margin-right:1.1em;white-space:nowrap'"
            f"{tip}>{text}</span>")


def _row(items: list[str], small: bool = False) -> str:
    style = "display:flex;flex-wrap:wrap;row-gap:2px;align-items:center"
    if small:
        style += f";color:{_GREY};font-size:88%"
    body = "".join(i for i in items if i)
    return f"<div style='{style}'>{body}</div>" if body else ""


def _bar(fraction: float) -> str:
    pct = max(0.0, min(1.0, fraction)) * 100
    return ("<span style='display:inline-block;width:110px;height:8px;margin-right:6px;"
            f"background:#eaeef2;border-radius:4px;vertical-align:middle'><span "
            f"style='display:block;width:{pct:.1f}%;height:100%;background:#0969da;"
            "border-radius:4px'></span></span>")


def sparkline(pool: PoolPrices, end: float) -> str:
    """The pool's spot price over the job as a small inline SVG step line, scaled from
    zero to the on-demand price (or the highest price), so its height says how far
    below on-demand it is."""
    if not pool.prices:
        return ""
    start = pool.times[0]
    span = max(end - start, 1e-9)
    top = max([*pool.prices, pool.ondemand or 0.0]) or 1.0

    def xy(t: float, price: float) -> str:
        x = (t - start) / span * _SPARK_W
        y = _SPARK_H - price / top * (_SPARK_H - 2) - 1
        return f"{x:.1f},{y:.1f}"

    points = [xy(pool.times[0], pool.prices[0])]
    for t, price, before in zip(pool.times[1:], pool.prices[1:], pool.prices, strict=False):
        points += [xy(t, before), xy(t, price)]
    points.append(xy(max(end, pool.times[-1]), pool.prices[-1]))
    return (f"<svg class='spotnb-sparkline' width='{_SPARK_W}' height='{_SPARK_H}' "
            f"style='vertical-align:middle;margin:0 4px;background:#f6f8fa'>"
            f"<polyline fill='none' stroke='#6f42c1' stroke-width='1.5' "
            f"points='{' '.join(points)}'/></svg>")


def _prices(view: JobView, data: DashboardData) -> list[str]:
    items = []
    end = max(data.last_time, view.now or 0.0)
    for name, pool in data.pools.items():
        if not pool.prices:
            continue
        lo, hi = min(pool.prices), max(pool.prices)
        now = pool.prices[-1]
        span = f"${lo:.4f}-{hi:.4f}/h during the job" if lo != hi else "flat during the job"
        tip = f"spot price of {name}: {span}"
        if pool.ondemand:
            tip += f"; on-demand ${pool.ondemand:.4f}/h"
        label = "spot" if len(data.pools) == 1 else f"spot {name}"
        text = f"{label} ${now:.4f}/h{sparkline(pool, end)}"
        if pool.ondemand:
            text += f"<span style='color:{_GREY}'>on-demand ${pool.ondemand:.4f}/h</span>"
        items.append(_item(text, tip))
    return items


def _sources(data: DashboardData, end: float) -> str:
    notes = []
    for name, pool in data.pools.items():
        dates = pool.history_dates(end)
        if dates:
            notes.append(f"{name}: real spot prices of {dates}, replayed by the local "
                         "cloud")
        elif pool.history and "live" in pool.history.lower():
            notes.append(f"{name}: live EC2 spot price")
    return "; ".join(notes)


def header_html(view: JobView | None, data: DashboardData) -> str:
    """The header as HTML (module docstring)."""
    if view is None:
        return "<div class='spotnb-header'><b>spotnb</b>: starting…</div>"
    h = display.header(view)
    colour = STATE_COLOURS.get(view.state, "#0969da")
    state = view.state.replace("_", " ") + (" (detached)" if view.detached else "")
    first = [
        _item(f"<b style='color:{colour}'>{html.escape(state)}</b>"),
        _item(f"{html.escape(view.name)} <code>{view.job_id}</code>"),
        _item(html.escape(h.attempt)) if h.attempt else "",
        _item(html.escape(h.where)) if h.where else "",
        _item(html.escape(h.world)) if h.world else "",
        _item(f"<span style='color:{_GREY}'>elapsed</span> {h.elapsed}"),
    ]
    progress = []
    if h.step:
        bar = _bar(h.fraction) if h.fraction is not None else ""
        progress.append(_item(bar + html.escape(h.step)))
    if h.pace:
        progress.append(_item(html.escape(h.pace)))
    if h.metrics:
        progress.append(_item(html.escape(h.metrics)))
    money = [_item(html.escape(h.cost), h.cost_note), _item(html.escape(h.ondemand)),
             _item(f"<b>{html.escape(h.saving)}</b>") if h.saving else "",
             _item(html.escape(h.projected)) if h.projected else ""]
    lost = f" ({html.escape(h.lost)})" if h.lost else ""
    fourth = [_item(html.escape(h.interruptions) + lost), *_prices(view, data)]
    detail = view.reason if view.final else view.detail
    if view.final and view.outputs:
        detail += f"; outputs set in the notebook: {', '.join(view.outputs)}"
    small = [_item(html.escape(detail))] if detail else []
    sources = _sources(data, max(data.last_time, view.now or 0.0))
    if sources:
        small.append(_item(html.escape(sources)))
    rows = "".join(_row(r) for r in (first, progress, money, fourth)) + _row(small, True)
    return (f"<div class='spotnb-header' style='border-left:4px solid {colour};"
            f"padding:4px 8px;line-height:1.5'>{rows}</div>")
