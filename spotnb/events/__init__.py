"""The job's event log: append-only, per attempt, in the store; and its live channel.

Layout: ``events/<stream>/...`` where ``<stream>`` is the attempt number as six digits
(``000001`` ...) for agents and ``000000`` for the capacity group (the provider's
control plane). Each stream has exactly one writer at a time
(:class:`~spotnb.events.writer.EventWriter`), which writes *chunks* and rolls them
into *segments*:

``<seq>.jsonl``                     a chunk: the events of one flush, JSON lines
``<last>.<first>.L<level>.jsonl.gz`` a segment: chunks ``first..last``, merged,
                                    gzipped (level 1 merges chunks, level 2 merges
                                    level-1 segments, ...)

Every object is created once and never changed (``put_if_absent``); a segment is
complete before the objects it replaces are deleted, and every event carries its index
``n`` in its stream, so a reader in the middle of a compaction still sees every event
exactly once (:class:`~spotnb.events.reader.EventReader`). A job of any length keeps a
few dozen objects per stream: re-attaching costs a few dozen requests.

The log is the durable record and is written rarely (every
:data:`~spotnb.events.writer.IDLE_FLUSH_SECONDS`, and at once on notices, checkpoints,
errors and results: what a reader must not wait for). What a follower watching live
needs within a second travels through queues instead (:mod:`spotnb.events.live`).

Every event carries the schema version ``v``, the wall-clock ``time``, the ``attempt``
(0 for the group), the ``instance`` id, ``n`` (its index in its stream; absent in
logs of spotnb 0.1), a ``type`` and a ``data`` dict. The types and their data (the
vocabulary every reader may rely on):

``status``      ``state`` (one of :data:`STATES`), ``detail``; at boot also
                ``instance_type``, ``az``
``metrics``     a batch of rows, by column: ``step`` [int], ``t`` [time of each
                ``log`` call], ``values`` {name: [float] (one per row) or
                {"i": [row index], "v": [float]} (a metric some rows lack)}
``metric``      one row: ``step``, ``t``, ``values`` {name: float}; readers get a
                ``metrics`` batch as these unless they ask for batches
                (``replayed_by`` marks rows a checkpoint carried and a later attempt
                recorded for the attempt that logged them)
``stream``      ``name`` (stdout/stderr), ``text``
``display``     ``data`` (MIME bundle), ``metadata``, ``kind`` (display_data,
                execute_result, update_display_data), ``display_id``
``sys``         ``kind`` ("gpu" or "cpu"), ``util`` (%), ``mem_used``, ``mem_total``
                (bytes), for GPUs also ``gpus`` (per-device list)
``checkpoint``  ``phase`` (begin, durable, failed), ``id``, ``step``, ``bytes``,
                ``seconds``, ``forced``; a synced directory's snapshot has ``kind``
                "sync", ``name``, ``files``, ``bytes`` (and ``step``, ``forced``
                when taken at a framework's save point)
``params``      ``params`` {name: value} (hyperparameters), ``source`` (optional:
                "transformers", "lightning", ...)
``notice``      ``kind`` (instance-action, rebalance), ``action``, ``notice_time``
``price``       ``pool``, ``instance_type``, ``az``, ``price``, ``ondemand``
``instance``    ``action`` (launched, terminated, capacity_error), ``instance_id``,
                ``instance_type``, ``az``, ``reason``
``usage``       ``requests`` {"service:operation": count} made so far by the
                ``process`` (job-agent, instance-agent, ...) that emits it
``error``       ``ename``, ``evalue``, ``traceback`` (list of str), ``retrying``
``result``      ``status`` (completed, failed, stopped), ``reason``
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "EVENTS_PREFIX",
    "FINAL_STATES",
    "GROUP_STREAM",
    "SCHEMA_VERSION",
    "STATES",
    "Event",
    "EventReader",
    "EventWriter",
    "expand",
    "last_values",
    "log_state",
    "metric_rows",
    "metrics_data",
    "parse_chunk",
    "stream_name",
]

SCHEMA_VERSION = 1
EVENTS_PREFIX = "events/"
GROUP_STREAM = 0

#: Job states, in the order a healthy job moves through them (``paused``: the agent
#: cannot confirm its lease, the store being out of reach; training waits).
STATES = (
    "submitted",
    "waiting_for_capacity",
    "launching",
    "booting",
    "restoring",
    "running",
    "checkpointing",
    "paused",
    "interrupted",
    "completed",
    "failed",
    "stopped",
)
FINAL_STATES = frozenset({"completed", "failed", "stopped"})


def stream_name(attempt: int) -> str:
    """The directory name of an attempt's stream (0 is the capacity group)."""
    return f"{attempt:06d}"


@dataclasses.dataclass(frozen=True)
class Event:
    """One event of a job's log (see the module docstring for the vocabulary)."""

    type: str
    time: float
    attempt: int
    instance: str | None
    data: dict[str, Any]
    v: int = SCHEMA_VERSION
    n: int | None = None

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        if self.n is None:
            del raw["n"]
        return json.dumps(raw, separators=(",", ":"), default=str)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Event:
        n = raw.get("n")
        return cls(
            type=raw["type"],
            time=float(raw["time"]),
            attempt=int(raw["attempt"]),
            instance=raw.get("instance"),
            data=raw.get("data") or {},
            v=int(raw.get("v", SCHEMA_VERSION)),
            n=None if n is None else int(n),
        )


def parse_chunk(body: bytes | str) -> list[Event]:
    """The events of one chunk (or decompressed segment) of the log."""
    text = body.decode() if isinstance(body, bytes) else body
    return [Event.from_dict(json.loads(line)) for line in text.splitlines() if line.strip()]


# -- metric batches ------------------------------------------------------------------


def metrics_data(rows: Iterable[tuple[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """The ``data`` of a ``metrics`` event for rows ``(step, t, {name: value})``."""
    steps: list[Any] = []
    times: list[Any] = []
    columns: dict[str, tuple[list[int], list[Any]]] = {}
    for i, (step, t, values) in enumerate(rows):
        steps.append(step)
        times.append(t)
        for name, value in values.items():
            idx, vals = columns.setdefault(name, ([], []))
            idx.append(i)
            vals.append(value)
    out: dict[str, Any] = {}
    for name, (idx, vals) in columns.items():
        out[name] = vals if len(idx) == len(steps) else {"i": idx, "v": vals}
    return {"step": steps, "t": times, "values": out}


def metric_rows(event: Event) -> Iterator[tuple[int, float, dict[str, float]]]:
    """``(step, t, {name: value})`` for each row of a ``metric`` or ``metrics`` event."""
    data = event.data
    if event.type == "metric":
        yield data["step"], data.get("t", event.time), data.get("values") or {}
        return
    if event.type != "metrics":
        return
    steps, times = data.get("step") or [], data.get("t") or []
    per_row: list[dict[str, float]] = [{} for _ in steps]
    for name, column in (data.get("values") or {}).items():
        if isinstance(column, dict):
            for i, value in zip(column.get("i", []), column.get("v", []), strict=False):
                per_row[i][name] = value
        else:
            for row, value in zip(per_row, column, strict=False):
                row[name] = value
    yield from zip(steps, times, per_row, strict=False)


def last_values(event: Event) -> dict[str, float]:
    """The newest value of each metric in a ``metric`` or ``metrics`` event."""
    if event.type == "metric":
        return dict(event.data.get("values") or {})
    if event.type != "metrics":
        return {}
    out = {}
    for name, column in (event.data.get("values") or {}).items():
        values = column.get("v", []) if isinstance(column, dict) else column
        if values:
            out[name] = values[-1]
    return out


def expand(event: Event) -> list[Event]:
    """A ``metrics`` event as one ``metric`` event per row (others as they are)."""
    if event.type != "metrics":
        return [event]
    extra = {k: v for k, v in event.data.items() if k not in ("step", "t", "values")}
    return [Event(type="metric", time=float(t), attempt=event.attempt,
                  instance=event.instance, v=event.v,
                  data={"step": step, "t": t, "values": values, **extra})
            for step, t, values in metric_rows(event)]


from spotnb.events.reader import EventReader, log_state  # noqa: E402
from spotnb.events.writer import EventWriter  # noqa: E402
