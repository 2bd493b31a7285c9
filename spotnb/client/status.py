"""What a followed job's header says: :func:`header` (its facts, as short texts) and
:func:`status_lines` / :func:`status_bundle` (the text display's header; the dashboard's
is :mod:`spotnb.widgets.header`, which lays out the same :class:`Header`). Every fact is
the job's fold's (:attr:`~spotnb.client.view.JobView.folded`).
"""

from __future__ import annotations

import dataclasses
import html
import time

from spotnb.client import progress
from spotnb.client.view import JobView
from spotnb.protocol.events import JobStatus
from spotnb.protocol.events.fold import Break, EndReason

__all__ = ["STATE_COLOURS", "Header", "header", "state_colour", "status_bundle",
           "status_lines"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _metric_text(view: JobView, limit: int = 4) -> str:
    parts = []
    for key, value in list(view.metrics.items())[:limit]:
        parts.append(f"{key} {value:.4g}" if isinstance(value, (int, float)) else f"{key} {value}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Header:
    """What a job's header says, as short texts that a display lays out (see
    :func:`header`); empty strings are facts not known (yet)."""

    attempt: str
    where: str
    price: str
    step: str
    fraction: float | None
    pace: str
    metrics: str
    elapsed: str
    cost: str
    ondemand: str
    saving: str
    projected: str
    cost_note: str
    interruptions: str
    lost: str
    #: A multi-node job's world: ``"2 nodes (--nodes 2:3), world size 4"``.
    world: str = ""


def header(view: JobView) -> Header:
    """The header's facts, every one the fold's (:mod:`spotnb.client.progress` says
    how each figure is computed)."""
    state = view.folded
    now = view.now or time.time()
    attempt = f"attempt {view.attempt}" if view.attempt else ""
    pending = progress.launching(state)
    if view.multinode:  # the nodes come and go on their own: the world says it
        attempt = (pending or "") if not view.final else ""
    elif pending and not view.final:
        attempt = pending if not attempt else f"{attempt} ended; {pending}"
    price = ""
    running = state.running_prices() if view.multinode and not view.final else None
    if running is not None:  # every node's instance bills
        spot_rate, ondemand_rate, count = running
        price = f"spot ${spot_rate:.4f}/h for {_plural(count, 'instance')}"
        if ondemand_rate:
            price += f" (on-demand ${ondemand_rate:.4f}/h)"
    elif view.spot_price is not None:
        price = f"spot ${view.spot_price:.4f}/h"
        if view.ondemand_price:
            price += f" (on-demand ${view.ondemand_price:.4f}/h)"
    step = fraction_text = ""
    fraction = None
    total = state.steps.total
    if view.step is not None:
        step = f"step {view.step}"
        if total:
            fraction = min(1.0, (view.step + 1) / total)
            step = f"step {view.step + 1} of {total}"
            fraction_text = f" ({100 * fraction:.0f}%)"
    pace = ""
    rate, left = state.steps.rate(), state.steps.seconds_left()
    if rate is not None and not view.final:
        pace = f"{rate:.3g} steps/s"
        if left is not None:
            pace += f", {_clock(left)} left"
    saving = f"saving {view.savings_pct:.0f}%" if view.savings_pct is not None else ""
    projected = ""
    if not view.final:
        rates = ((view.spot_price, view.ondemand_price) if running is None
                 else running[:2])  # a multi-node job: every node bills the time left
        proj = progress.projection(state, now, view.cost_usd, view.ondemand_cost_usd,
                                   *rates)
        if proj is not None:
            projected = (f"projected ${proj.cost_usd:.4f} at the end vs "
                         f"${proj.ondemand_usd:.4f} on-demand for the same work")
            if proj.savings_pct is not None:
                projected += f" (saving {proj.savings_pct:.0f}%)"
    note = view.cost_includes or ("instances billed per second from launch (boot "
                                  "included) to termination")
    breaks = state.breaks()
    lost = ""
    if breaks or any(s.went_back for s in state.steps.segments):
        lost_usd, _ = state.lost_usd(now)
        redone = state.redone_steps()
        lost = (f"took {_clock(state.lost_seconds(now))} and ${lost_usd:.4f}; "
                f"{redone} step{'s' if redone != 1 else ''} redone")
    return Header(
        attempt=attempt,
        where=" ".join(x for x in (view.instance_type, view.az) if x),
        price=price, step=step + fraction_text, fraction=fraction, pace=pace,
        metrics=_metric_text(view, limit=3), elapsed=_clock(view.elapsed),
        cost=f"cost ${view.cost_usd:.4f}",
        ondemand=f"on-demand ${view.ondemand_cost_usd:.4f} for the same instance-hours",
        saving=saving, projected=projected, cost_note=note,
        interruptions=_breaks_text(view.interruptions, breaks), lost=lost,
        world=_world_text(view))


def _breaks_text(interruptions: int, breaks: list[Break]) -> str:
    """``interruptions 1``, and the other breaks the figures beside it count: moves to
    a warm standby, errors retried (``interruptions 0, 1 move to a standby``)."""
    text = f"interruptions {interruptions}"
    moves = sum(1 for b in breaks if b.reason is EndReason.MOVED)
    retries = sum(1 for b in breaks if b.reason is EndReason.ERROR_RETRIED)
    if moves:
        text += f", {moves} move{'s' if moves != 1 else ''} to a standby"
    if retries:
        text += f", {retries} error{'s' if retries != 1 else ''} retried"
    return text


def _world_text(view: JobView) -> str:
    if not view.multinode:
        return ""
    nodes = f"{view.min_nodes}:{view.max_nodes}"
    if not view.world_nodes:
        return f"world not formed yet (--nodes {nodes})"
    return (f"{_plural(view.world_nodes, 'node')} (--nodes {nodes}), "
            f"world size {view.world_size}")


def status_lines(view: JobView) -> list[str]:
    """The status as a few text lines (the dashboard's header shows the same facts)."""
    h = header(view)
    status = JobStatus.parse(view.state)
    state = (status.label if status is not None else view.state) + (
        " (detached)" if view.detached else "")

    def line(*parts: str) -> str:
        return " · ".join(part for part in parts if part)

    lines = [line(f"spotnb job {view.job_id} {view.name!r}", state, h.attempt, h.where,
                  h.price)]
    if h.world:
        lines.append(h.world)
    if h.step or h.metrics:
        lines.append(line(h.step, h.pace, h.metrics))
    money = line(h.elapsed, h.cost, h.ondemand, h.saving)
    lines.append(line(money, h.interruptions + (f" ({h.lost})" if h.lost else "")))
    if h.projected:
        lines.append(h.projected)
    if view.final:
        tail = view.reason
        if view.outputs:
            tail += f"; outputs set in the notebook: {', '.join(view.outputs)}"
        lines.append(tail)
    elif view.detail:
        lines.append(view.detail)
    return lines


#: The colour of each job state in the text display's and the dashboard's headers
#: (:func:`state_colour`; any other state, running ones, is blue).
STATE_COLOURS = {"completed": "#1a7f37", "failed": "#cf222e", "stopped": "#9a6700",
                 "pruned": "#6e7781", "interrupted": "#bc4c00",
                 "waiting_for_capacity": "#9a6700"}
_RUNNING_COLOUR = "#0969da"


def state_colour(state: str) -> str:
    """The colour a header gives job state ``state`` (:data:`STATE_COLOURS`)."""
    return STATE_COLOURS.get(state, _RUNNING_COLOUR)


def status_bundle(view: JobView) -> dict[str, str]:
    """The status display as a MIME bundle (text and HTML)."""
    lines = status_lines(view)
    colour = state_colour(view.state)
    body = "<br>".join(html.escape(line) for line in lines)
    return {
        "text/plain": "\n".join(lines),
        "text/html": (f'<div style="border-left:4px solid {colour};padding:4px 8px;'
                      f'font-family:monospace;font-size:90%">{body}</div>'),
    }
