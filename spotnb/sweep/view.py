"""The sweep as text: its summary (the notification, the cell's end, the text form of
its view), read from the sweep and its trials' folds. The widget is
:mod:`spotnb.widgets.sweep`.

"Best" is always said with what it is: the best *objective* (the metric's last value
of a completed trial, what the study was told) names its trial; the lowest (or
highest) value any trial ever logged is the table's, named so there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from spotnb.sweep.budget import SweepCost
from spotnb.sweep.state import round_value

__all__ = ["Sweep", "header_lines", "stopped_text", "summary_text"]


class _Trial(Protocol):
    number: int
    params: dict[str, Any]
    job_id: str | None
    value: float | None
    state: str
    reason: str
    pruned_at: int | None


class Sweep(Protocol):
    """What a view reads of a sweep (:class:`spotnb.sweep.runner.Sweep`)."""

    definition: dict[str, Any]
    sweep_id: str
    name: str
    status: str
    reason: str
    warning: str
    ended_at: float | None

    @property
    def trials(self) -> Sequence[_Trial]: ...

    @property
    def runs(self) -> Mapping[int, Any]: ...

    @property
    def metric(self) -> str: ...

    @property
    def direction(self) -> str: ...

    @property
    def parallel(self) -> int: ...

    @property
    def budget_usd(self) -> float | None: ...

    @property
    def ended(self) -> bool: ...

    def counts(self) -> dict[str, int]: ...

    def cost(self) -> SweepCost: ...

    def best(self) -> _Trial | None: ...

    def listen(self, callback: Callable[[str, Any], None]) -> None: ...


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _status(made: Sweep) -> str:
    if made.status == "abandoned":
        return ("abandoned: its driver is gone (the kernel that ran it closed); "
                f"`%spot_attach {made.sweep_id} --resume` drives it on, "
                f"`spotnb stop {made.sweep_id}` ends it")
    return made.status


def header_lines(made: Sweep, markdown: bool = False) -> list[str]:
    """The sweep in a few lines: its status and trials; the best objective with its
    trial and parameters; the cost, refunds and saving, and the time; why it ended
    (or the warning of the moment). ``markdown``: Slack's ``*bold*``."""
    b = "*" if markdown else ""
    c = made.counts()
    done = ", ".join(f"{c[s]} {s}" for s in ("completed", "pruned", "failed", "stopped",
                                             "skipped", "running", "waiting") if c.get(s))
    icon = ":bar_chart: " if markdown else ""
    lines = [f"{icon}spotnb sweep {b}{made.name}{b} {_status(made)}: "
             f"{len(made.trials)} trials ({done or 'none yet'})"]
    best = made.best()
    word = "highest" if made.direction == "maximize" else "lowest"
    if best is not None and best.value is not None:
        params = ", ".join(f"{k}={round_value(v)}" for k, v in best.params.items())
        lines.append(f"best trial t{best.number}: {made.metric} {best.value:.4g} (its last "
                     f"value, the objective; {word} wins) with {b}{params}{b} "
                     f"(job {best.job_id})")
    else:
        lines.append(f"no trial has completed with a value of {made.metric} yet")
    money = made.cost().text()
    if made.budget_usd is not None:
        money += f"; budget ${made.budget_usd:g}"
    created = float(made.definition.get("created") or time.time())
    lines.append(f"{money} · ran {_clock((made.ended_at or time.time()) - created)}")
    if made.reason and made.status not in ("completed", "running"):
        lines.append(made.reason)
    elif made.warning and made.status == "running":
        lines.append(made.warning)
    return lines


def summary_text(made: Sweep, markdown: bool = False) -> str:
    """:func:`header_lines` as one text."""
    return "\n".join(header_lines(made, markdown))


def stopped_text(done: Any, attach: str) -> str:
    """What ``%spot_sweep_stop`` and ``spotnb stop SWEEP`` say they did."""
    if done.already_ended:
        return (f"sweep {done.sweep_id} ({done.name!r}) had already ended ({done.status}); "
                "nothing to stop.")
    jobs = (f"its running trials' jobs stopped ({', '.join(done.jobs_stopped)}), their "
            "instances deleted" if done.jobs_stopped else "no trial was running")
    return (f"sweep {done.sweep_id} ({done.name!r}) stopped for good: {jobs}; no trial "
            f"starts any more. Its trials stay in the store: `{attach} {done.sweep_id}`.")
