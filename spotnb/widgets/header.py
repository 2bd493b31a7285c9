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
from spotnb.client.status import state_colour
from spotnb.client.view import JobView
from spotnb.protocol.events import JobStatus
from spotnb.protocol.events.fold import PoolState
from spotnb.widgets.series import DashboardData

__all__ = ["header_html", "sparkline"]

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


def sparkline(pool: PoolState, end: float) -> str:
    """The pool's spot price over the job as a small inline SVG step line, scaled from
    zero to the on-demand price (or the highest price), so its height says how far
    below on-demand it is."""
    times, prices = pool.times, pool.prices
    if not prices:
        return ""
    start = times[0]
    span = max(end - start, 1e-9)
    top = max([*prices, pool.ondemand or 0.0]) or 1.0

    def xy(t: float, price: float) -> str:
        x = (t - start) / span * _SPARK_W
        y = _SPARK_H - price / top * (_SPARK_H - 2) - 1
        return f"{x:.1f},{y:.1f}"

    points = [xy(times[0], prices[0])]
    for t, price, before in zip(times[1:], prices[1:], prices, strict=False):
        points += [xy(t, before), xy(t, price)]
    points.append(xy(max(end, times[-1]), prices[-1]))
    return (f"<svg class='spotnb-sparkline' width='{_SPARK_W}' height='{_SPARK_H}' "
            f"style='vertical-align:middle;margin:0 4px;background:#f6f8fa'>"
            f"<polyline fill='none' stroke='#6f42c1' stroke-width='1.5' "
            f"points='{' '.join(points)}'/></svg>")


def _prices(view: JobView, data: DashboardData) -> list[str]:
    items = []
    end = max(data.last_time, view.now or 0.0)
    for name, pool in view.folded.pools.items():
        prices = pool.prices
        if not prices:
            continue
        lo, hi = min(prices), max(prices)
        now = prices[-1]
        span = f"${lo:.4f}-{hi:.4f}/h during the job" if lo != hi else "flat during the job"
        tip = f"spot price of {name}: {span}"
        if pool.ondemand:
            tip += f"; on-demand ${pool.ondemand:.4f}/h"
        label = "spot" if len(view.folded.pools) == 1 else f"spot {name}"
        text = f"{label} ${now:.4f}/h{sparkline(pool, end)}"
        if pool.ondemand:
            text += f"<span style='color:{_GREY}'>on-demand ${pool.ondemand:.4f}/h</span>"
        items.append(_item(text, tip))
    return items


def _sources(view: JobView, end: float) -> str:
    notes = []
    for name, pool in view.folded.pools.items():
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
    colour = state_colour(view.state)
    status = JobStatus.parse(view.state)
    state = (status.label if status is not None else view.state) + (
        " (detached)" if view.detached else "")
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
    sources = _sources(view, max(data.last_time, view.now or 0.0))
    if sources:
        small.append(_item(html.escape(sources)))
    rows = "".join(_row(r) for r in (first, progress, money, fourth)) + _row(small, True)
    return (f"<div class='spotnb-header' style='border-left:4px solid {colour};"
            f"padding:4px 8px;line-height:1.5'>{rows}</div>")
