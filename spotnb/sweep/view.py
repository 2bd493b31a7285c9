"""What a person sees of a sweep: a line of where it stands, then the comparison of
its trials (:class:`spotnb.widgets.compare.Comparison`), which follows them live.

The sweep's driver polls the trials' jobs (:mod:`spotnb.sweep.runner`); the view only
draws what the driver read, at most every
:data:`~spotnb.widgets.compare.FLUSH_SECONDS`. A pruned trial's row says ``pruned``.
:func:`summary_text` is the sweep's summary, for the notification and the cell's end.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from spotnb.protocol.events.fold import savings_pct

__all__ = ["Sweep", "SweepView", "summary_text"]


class _Trial(Protocol):
    number: int
    params: dict[str, Any]
    job_id: str | None
    value: float | None


class Sweep(Protocol):
    """What the view reads of a sweep (:class:`spotnb.sweep.runner.Sweep`, which shows
    itself through this view)."""

    definition: dict[str, Any]
    sweep_id: str
    name: str
    status: str
    reason: str
    ended_at: float | None

    @property
    def trials(self) -> Sequence[_Trial]: ...

    @property
    def metric(self) -> str: ...

    @property
    def parallel(self) -> int: ...

    @property
    def budget_usd(self) -> float | None: ...

    @property
    def ended(self) -> bool: ...

    def counts(self) -> dict[str, int]: ...

    def cost(self) -> tuple[float, float]: ...

    def best(self) -> _Trial | None: ...

    def listen(self, callback: Callable[[str, Any], None]) -> None: ...


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def summary_text(made: Sweep, markdown: bool = False) -> str:
    """The sweep in a few lines: trials completed, pruned and failed, the best
    parameters and value, the cost and the saving (``markdown``: Slack's ``*bold*``)."""
    b = "*" if markdown else ""
    c = made.counts()
    spent, ondemand = made.cost()
    done = ", ".join(f"{c[s]} {s}" for s in ("completed", "pruned", "failed", "stopped",
                                             "skipped", "running", "waiting") if c[s])
    icon = ":bar_chart: " if markdown else ""
    lines = [f"{icon}spotnb sweep {b}{made.name}{b} {made.status}: "
             f"{len(made.trials)} trials ({done})"]
    best = made.best()
    if best is not None:
        params = ", ".join(f"{k}={v}" for k, v in best.params.items())
        lines.append(f"best {made.metric} {best.value:.4g} with {b}{params}{b} "
                     f"(trial {best.number}, job {best.job_id})")
    else:
        lines.append(f"no trial completed with a value of {made.metric}")
    money = f"cost ${spent:.4f}"
    saving = savings_pct(spent, ondemand)
    if saving is not None:
        money += f" ({saving:.0f}% under on-demand ${ondemand:.4f})"
    if made.budget_usd is not None:
        money += f" of a ${made.budget_usd:g} budget"
    created = float(made.definition.get("created") or time.time())
    lines.append(f"{money} · ran {_clock((made.ended_at or time.time()) - created)}")
    if made.reason and made.status != "completed":
        lines.append(made.reason)
    return "\n".join(lines)


class SweepView:
    """The sweep's line over the comparison of its trials (module docstring)."""

    def __init__(self, made: Sweep) -> None:
        import ipywidgets as w

        from spotnb.widgets.compare import FLUSH_SECONDS, Comparison

        self.sweep = made
        self.flush_seconds = FLUSH_SECONDS
        self._lock = threading.RLock()
        self._drawn_at = -float("inf")
        self.header = w.HTML()
        self.comparison = Comparison([], follow=False)
        self.widget = w.VBox([self.header, self.comparison.widget],
                             layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-sweep")
        self._draw_header()
        if not made.ended:
            self.comparison.serve_while_busy()  # the cell waits for the sweep
        made.listen(self._on_sweep)

    def _on_sweep(self, what: str, obj: Any) -> None:
        with self._lock:
            if what == "run":
                if obj not in self.comparison.runs:
                    self.comparison.add(obj, follow=False)
                self._draw_header()
            elif what == "end" or time.monotonic() - self._drawn_at >= self.flush_seconds:
                self.draw()

    def draw(self) -> None:
        """Redraw the line and the comparison from what the driver read, now."""
        with self._lock:
            self._drawn_at = time.monotonic()
            self.comparison.draw()
            self._draw_header()

    def _draw_header(self) -> None:
        made = self.sweep
        c = made.counts()
        lines = summary_text(made).split("\n")
        k = made.parallel
        title = (f"<b>sweep {html.escape(made.name)}</b> ({html.escape(made.sweep_id)}): "
                 f"{html.escape(made.status)}, {c['running']} running (at most {k} at once)")
        rest = "<br>".join(html.escape(line) for line in lines[1:])
        self.header.value = f"<div class='spotnb-sweep-header'>{title}<br>{rest}</div>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        data = dict(self.widget._repr_mimebundle_())
        data["text/plain"] = summary_text(self.sweep) + "\n\n" + self.comparison.text()
        return data
