"""Jobs and events as text: ``spotnb jobs``/``spotnb logs`` and ``%spot_jobs``/``%spot_logs``.

One place for the table of jobs and the line of each event, so the command line and
the magics say the same, without the magics importing the command line.
"""

from __future__ import annotations

import datetime
import html
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spotnb.protocol.events import Event, codec

if TYPE_CHECKING:
    from spotnb.client.results import JobInfo
    from spotnb.sweep.state import SweepInfo

__all__ = ["JOB_COLUMNS", "SWEEP_COLUMNS", "format_age", "format_event", "format_events",
           "jobs_table", "sweeps_table", "table_bundle"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def format_age(created: float, now: float) -> str:
    """How long ago ``created`` was, in one unit: ``42s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(0, int(now - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def format_event(event: Event) -> str | None:
    """A human line (or block) for an event, or None for events not worth a line."""
    when = datetime.datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
    where = f"[{when} a{event.attempt}]" if event.attempt else f"[{when} group]"
    b = codec.peek(event)
    if isinstance(b, codec.Stream):
        return b.text.rstrip("\n")
    if isinstance(b, codec.Status):
        return f"{where} {b.state}: {b.detail}".rstrip(": ")
    if isinstance(b, codec.Error):
        traceback = b.traceback if isinstance(b.traceback, list) else []
        tb = "\n".join(_ANSI.sub("", str(line)) for line in traceback)
        return f"{where} error: {b.ename}: {b.evalue}\n{tb}".rstrip()
    if isinstance(b, codec.Notice):
        return f"{where} notice: {b.kind} {b.action} at {b.notice_time}"
    if isinstance(b, codec.Instance):
        detail = " ".join(str(v) for v in (b.instance_id, b.instance_type, b.az, b.reason)
                          if v)
        line = f"{where} instance {b.action}: {detail}"
        if b.boot_failed:  # the step that failed, then the end of the instance's boot log
            if b.failures and b.limit:
                line += f" ({b.failures} of {b.limit} failed boots in a row)"
            line += "".join(f"\n    | {text}" for text in b.log)
        return line
    if isinstance(b, codec.Region):
        moved = f" (from {b.previous})" if b.previous else ""
        return f"{where} region {b.region}{moved}: {b.reason}".rstrip(": ")
    if isinstance(b, codec.Transfer):
        return (f"{where} transfer: the checkpoint's {b.kind} of {b.bytes / 1e9:.3f} GB "
                f"{b.source} -> {b.destination}, ${b.usd:.4f} (${b.usd_per_gb:g}/GB)")
    if isinstance(b, codec.CheckpointEvent) and b.durable:
        return f"{where} checkpoint at step {b.step} durable ({b.bytes:,} bytes)"
    if isinstance(b, codec.Warning):
        return f"{where} warning: {b.text}"
    if isinstance(b, codec.Pruned):
        trial = f", trial {b.trial}" if b.trial is not None else ""
        return f"{where} {b.text} by sweep {b.sweep or '?'}{trial}: the job is stopped"
    if isinstance(b, codec.Display):
        text = b.data.get("text/plain")
        return str(text) if text else None
    return None


#: The columns of ``spotnb jobs`` and ``%spot_jobs``.
JOB_COLUMNS = ("job", "name", "status", "instance", "duration", "cost $", "saving",
               "last metric", "attempts", "interruptions", "nodes", "age")


def jobs_table(rows: Sequence[JobInfo], now: float
               ) -> tuple[list[tuple[str, ...]], list[str]]:
    """The jobs newest first, one tuple of texts per job (:data:`JOB_COLUMNS`), and
    notes: which names several jobs share (a name then means the newest of them)."""
    table: list[tuple[str, ...]] = []
    for r in sorted(rows, key=lambda r: r.created, reverse=True):
        metric = f"{r.metric[0]} {r.metric[1]:.4g}" if r.metric else ""
        saving = f"{r.savings_pct:.0f}%" if r.savings_pct is not None else ""
        minutes, seconds = divmod(int(r.duration), 60)
        hours, minutes = divmod(minutes, 60)
        status = r.status_text or r.status.replace("_", " ")
        table.append((r.job_id, r.name, status, r.instance_type or "",
                      f"{hours}:{minutes:02d}:{seconds:02d}", f"{r.cost_usd:.4f}", saving,
                      metric, str(r.attempts), str(r.interruptions), r.nodes,
                      format_age(r.created, now)))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.name] = counts.get(r.name, 0) + 1
    shared = sorted(name for name, n in counts.items() if n > 1)
    notes = [f"{len(shared)} name(s) are shared by several jobs ({', '.join(shared)}): a "
             "name picks the newest of its jobs; give the job id for another"] if shared else []
    return table, notes


def format_events(events: Sequence[Event]) -> str:
    """The lines of :func:`format_event` for a batch of events, as one text."""
    return "\n".join(line for e in events if (line := format_event(e)) is not None)


#: The columns of ``spotnb sweeps``.
SWEEP_COLUMNS = ("sweep", "name", "status", "trials", "best objective", "cost $",
                 "refunded $", "age")


def sweeps_table(rows: Sequence[SweepInfo], now: float) -> list[tuple[str, ...]]:
    """The sweeps newest first, one tuple of texts per sweep (:data:`SWEEP_COLUMNS`)."""
    table: list[tuple[str, ...]] = []
    for r in sorted(rows, key=lambda r: r.created, reverse=True):
        counts = ", ".join(f"{n} {state}" for state, n in r.counts.items() if n)
        best = (f"t{r.best_trial} {r.metric} {r.best_value:.4g}"
                if r.best_value is not None else "-")
        table.append((r.sweep_id, r.name, r.status, counts or "none", best,
                      f"{r.cost_usd:.4f}", f"{r.refunded_usd:.4f}" if r.refunded_usd else "-",
                      format_age(r.created, now)))
    return table


def table_bundle(header: Sequence[str], rows: Sequence[Sequence[str]]) -> dict[str, str]:
    """A table as a MIME bundle: aligned text, and HTML."""

    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])
    cells = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>"
                                    for c in row) + "</tr>" for row in rows)
    return {"text/plain": text,
            "text/html": f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"}
