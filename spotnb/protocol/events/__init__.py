"""The job's event log: append-only, per attempt, in the store; and its live channel.

Layout: ``events/<stream>/...`` where ``<stream>`` is the attempt number as six digits
(``000001`` ...) for agents and ``000000`` for the capacity group (the provider's
control plane). Each stream has exactly one writer at a time
(:class:`~spotnb.protocol.events.writer.EventWriter`), which writes *chunks* and rolls them
into *segments*:

``<seq>.jsonl``                     a chunk: the events of one flush, JSON lines
``<last>.<first>.L<level>.jsonl.gz`` a segment: chunks ``first..last``, merged,
                                    gzipped (level 1 merges chunks, level 2 merges
                                    level-1 segments, ...)

Every object is created once and never changed (``put_if_absent``); a segment is
complete before the objects it replaces are deleted, and every event carries its index
``n`` in its stream, so a reader in the middle of a compaction still sees every event
exactly once (:class:`~spotnb.protocol.events.reader.EventReader`). A job of any length keeps a
few dozen objects per stream: re-attaching costs a few dozen requests.

The log is the durable record and is written rarely (every
:data:`~spotnb.protocol.events.writer.IDLE_FLUSH_SECONDS`, and at once on notices, checkpoints,
errors and results: what a reader must not wait for). What a follower watching live
needs within a second travels through queues instead (:mod:`spotnb.protocol.events.live`).

Every event carries the schema version ``v``, the wall-clock ``time``, the ``attempt``
(0 for the group), the ``instance`` id, ``n`` (its index in its stream; absent in
logs of spotnb 0.1), a ``type`` and a ``data`` dict. The types and their data (the
vocabulary every reader may rely on):

``status``      ``state`` (one of :data:`STATES`), ``detail``; at boot also
                ``instance_type``, ``az``, ``region``; ``retrying`` (true: the
                same attempt boots its cell again after an error, max_restarts_on_error)
``metrics``     a batch of rows, by column (see :func:`metric_columns`): ``rows``,
                ``step`` (int64), ``t`` (float64: the time of each ``log`` call),
                ``values`` {name: float64 column, or {"i": int32 row indices, "v":
                float64} for a metric some rows lack}; each column a base64
                little-endian array (``enc`` "b64le")
``metric``      one row: ``step``, ``t``, ``values`` {name: float}; readers get a
                ``metrics`` batch as these unless they ask for batches
                (``replayed_by`` marks rows a checkpoint carried and a later attempt
                recorded for the attempt that logged them)
``progress``    ``total`` (steps in the run), ``source`` (``spot.progress`` or ``range``)
``stream``      ``name`` (stdout/stderr), ``text``
``display``     ``data`` (MIME bundle), ``metadata``, ``kind`` (display_data,
                execute_result, update_display_data), ``display_id``
``sys``         ``kind`` ("gpu" or "cpu"), ``util`` (%), ``mem_used``, ``mem_total``
                (bytes), for GPUs also ``gpus`` (per-device list)
``checkpoint``  ``phase`` (begin, durable, failed), ``id``, ``step``, ``bytes``,
                ``seconds`` (to durable), ``forced`` (by a notice) or ``join`` (saved
                before a node joins a distributed job); durable ones also ``stall`` (the
                seconds the training loop waited); a synced directory's snapshot has ``kind``
                "sync", ``name``, ``files``, ``bytes`` (and ``step``, ``forced``
                when taken at a framework's save point)
``params``      ``params`` {name: value} (hyperparameters), ``source`` (optional:
                "transformers", "lightning", ...)
``notice``      ``kind`` (instance-action, rebalance), ``action``, ``notice_time``
``price``       ``pool``, ``instance_type``, ``az``, ``price``, ``ondemand``
``instance``    ``action`` (launched, notice, terminated, capacity_error; the local
                cloud's frozen and rebalance), ``instance_id``, ``instance_type``,
                ``az``, ``region`` (a launch's), ``reason`` (a terminated one:
                spot-interruption, killed, region-move, job-finished, ...; a
                rebalance: the interruption it stands for, or false-alarm);
                AWS's ``boot-failed`` (the instance's bootstrap failed, and it
                powered off: ``reason`` the step and its exit code,
                ``step``, ``exit_code``, ``log`` the boot log's last lines,
                ``failures`` in a row of the job's ``limit``)
``region``      the group's region from now on (its stream only): ``region``,
                ``previous`` (None at the start), ``cause`` (``start``, or
                ``no-capacity``: a move after ``tries`` launch rounds found none),
                ``reason`` (in words), ``home`` (the store's region),
                ``estimate`` (the ranking's account of the region)
``transfer``    a checkpoint's bytes crossing regions (the group's stream): ``kind``
                (save, restore), ``bytes``, ``source``, ``destination``,
                ``usd_per_gb``, ``usd``, ``key`` (counted once), ``step``
``joined``      a distributed job's world re-formed with nodes that joined, from
                global rank 0's node: ``nodes`` (their slots), ``node_count``,
                ``world_size``, ``saved_step`` (the save before the join), ``step``
                (restored); the steps redone are the fold's (``JobState.join_redone``)
``usage``       ``requests`` {"service:operation": count} made so far by the
                ``process`` (job-agent, instance-agent, ...) that emits it
``warning``     ``kind`` (``notice-fit``: checkpoints take too long for the notice),
                ``text`` (what happens and what to do)
``error``       ``ename``, ``evalue``, ``traceback`` (list of str), ``retrying``
``result``      ``status`` (completed, failed, stopped), ``reason``
``pruned``      a sweep's pruner stopped the job early (the sweep's driver writes it
                in the group's stream before the stop): ``step``, ``metric``,
                ``value``, ``sweep`` (its id), ``trial`` (its number); the job's
                status then reads ``pruned`` (:meth:`~spotnb.protocol.events.fold.JobState.outcome`)
"""

from __future__ import annotations

import array
import base64
import dataclasses
import enum
import functools
import json
import sys
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
    "JobStatus",
    "expand",
    "is_terminal",
    "last_values",
    "log_state",
    "merge_metrics",
    "metric_columns",
    "metric_names",
    "metric_rows",
    "metrics_data",
    "parse_chunk",
    "rows_after",
    "step_span",
    "step_times",
    "stream_name",
]

SCHEMA_VERSION = 1
EVENTS_PREFIX = "events/"
GROUP_STREAM = 0

class JobStatus(str, enum.Enum):
    """A job's state: the one vocabulary of ``status`` events, ``result.json``, the fold
    (:attr:`~spotnb.protocol.events.fold.JobState.status`) and every view, in the order
    a healthy job moves through them (``paused``: the agent cannot confirm its lease,
    the store being out of reach; training waits; ``pruned``: stopped by a sweep's
    pruner, as its ``pruned`` event says; no agent writes it). Every caller asks a member
    (:attr:`is_terminal`), none keeps its own list of states."""

    SUBMITTED = "submitted"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    LAUNCHING = "launching"
    BOOTING = "booting"
    RESTORING = "restoring"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    PAUSED = "paused"
    INTERRUPTED = "interrupted"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    PRUNED = "pruned"

    def __str__(self) -> str:
        return self.value

    @property
    def is_terminal(self) -> bool:
        """Whether the job has ended (its result is written): nothing changes after."""
        return self in _TERMINAL

    @property
    def label(self) -> str:
        """The state in words (``waiting for capacity``)."""
        return self.value.replace("_", " ")

    @classmethod
    def parse(cls, value: Any, default: JobStatus | None = None) -> JobStatus | None:
        """``value`` as a member; ``default`` for anything else (a newer spotnb's
        state, a missing one)."""
        try:
            return cls(value)
        except ValueError:
            return default


_TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.STOPPED,
                       JobStatus.PRUNED})

#: The states' values, in :class:`JobStatus`' order, and those of an ended job (derived
#: from it: for readers that hold plain strings).
STATES = tuple(s.value for s in JobStatus)
FINAL_STATES = frozenset(s.value for s in _TERMINAL)


def is_terminal(status: Any) -> bool:
    """Whether ``status`` (a :class:`JobStatus` or its value; any other string: a
    newer spotnb's, said as it is) is that of an ended job."""
    parsed = JobStatus.parse(status)
    return parsed is not None and parsed.is_terminal


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

    @functools.cached_property
    def body(self) -> codec.Body:
        """The typed payload (:mod:`spotnb.protocol.events.codec`), decoded on first use, once."""
        return codec.decode(self)

    def to_json(self) -> str:
        raw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
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
#
# A ``metrics`` event holds its rows by column, each column a little-endian array
# (int64 steps, float64 times and values, int32 row indices of a sparse metric),
# base64-encoded: a reader decodes a column with one call instead of parsing every
# number (a day of metrics reads in a fraction of a second). Older logs hold plain
# JSON lists, which are read the same way.

_ENCODING = "b64le"


def _pack(typecode: str, values: Iterable[Any]) -> str:
    column = array.array(typecode, values)
    if sys.byteorder != "little":
        column.byteswap()
    return base64.b64encode(column.tobytes()).decode()


def _unpack(typecode: str, data: Any) -> array.array[Any]:
    if isinstance(data, list):  # a log of spotnb 0.1, or written by hand
        return array.array(typecode, data)
    column = array.array(typecode)
    column.frombytes(base64.b64decode(data))
    if sys.byteorder != "little":
        column.byteswap()
    return column


def _unpack_last(typecode: str, data: Any) -> Any:
    """The last item of a column of :func:`_pack`, decoding only its tail (a summary of
    a day's metrics reads a few bytes of each column, not all of them)."""
    if isinstance(data, list):
        return data[-1] if data else None
    size = array.array(typecode).itemsize
    padding = len(data) - len(data.rstrip("="))
    count = (len(data) // 4 * 3 - padding) // size
    if count == 0:
        return None
    first = (count - 1) * size      # the last item's first byte
    group = first // 3              # the base64 group (3 bytes, 4 characters) it is in
    raw = base64.b64decode(data[group * 4:])
    column = array.array(typecode)
    column.frombytes(raw[first - group * 3:first - group * 3 + size])
    if sys.byteorder != "little":
        column.byteswap()
    return column[0]


def step_span(event: Event) -> tuple[int, int] | None:
    """The first and the last step of a ``metric`` or ``metrics`` event (None without
    one), decoding a few bytes of a batch's step column, not all of it."""
    if codec.is_row(event):
        step = event.data.get("step")
        return None if step is None else (int(step), int(step))
    if not codec.is_batch(event):
        return None
    data = event.data.get("step")
    if not data:
        return None
    if isinstance(data, list):
        return int(data[0]), int(data[-1])
    head = array.array("q")
    head.frombytes(base64.b64decode(data[:12])[:8])  # 12 characters: 9 bytes
    if sys.byteorder != "little":
        head.byteswap()
    last = _unpack_last("q", data)
    return (int(head[0]), int(last)) if len(head) and last is not None else None


def step_times(event: Event) -> tuple[array.array[Any], array.array[Any]]:
    """The step and the time of each row of a ``metric`` or ``metrics`` event, as
    arrays (the values are not read)."""
    if codec.is_row(event):
        t = event.data.get("t")
        return (array.array("q", [int(event.data.get("step") or 0)]),
                array.array("d", [event.time if t is None else float(t)]))
    if not codec.is_batch(event):
        return array.array("q"), array.array("d")
    return _unpack("q", event.data.get("step") or []), _unpack("d", event.data.get("t") or [])


def metrics_data(rows: Iterable[tuple[Any, Any, dict[str, Any]]]) -> dict[str, Any]:
    """The ``data`` of a ``metrics`` event for rows ``(step, t, {name: value})``."""
    steps: list[int] = []
    times: list[float] = []
    columns: dict[str, tuple[list[int], list[float]]] = {}
    for i, (step, t, values) in enumerate(rows):
        steps.append(int(step))
        times.append(float(t))
        for name, value in values.items():
            idx, vals = columns.setdefault(name, ([], []))
            idx.append(i)
            vals.append(float(value))
    out: dict[str, Any] = {}
    for name, (idx, vals) in columns.items():
        out[name] = (_pack("d", vals) if len(idx) == len(steps)
                     else {"i": _pack("i", idx), "v": _pack("d", vals)})
    return {"enc": _ENCODING, "rows": len(steps), "step": _pack("q", steps),
            "t": _pack("d", times), "values": out}


Columns = tuple["array.array[Any]", "array.array[Any]",
                dict[str, tuple["array.array[Any] | None", "array.array[Any]"]]]


def metric_columns(event: Event) -> Columns:
    """A ``metrics`` event's columns: steps, times, and {name: (row indices or None when
    every row has the metric, values)}. For readers that take arrays (numpy's
    ``frombuffer`` reads them without a copy)."""
    data = event.data
    steps = _unpack("q", data.get("step") or [])
    times = _unpack("d", data.get("t") or [])
    values: dict[str, tuple[array.array[Any] | None, array.array[Any]]] = {}
    for name, column in (data.get("values") or {}).items():
        if isinstance(column, dict):
            values[name] = (_unpack("i", column.get("i", [])), _unpack("d", column.get("v", [])))
        else:
            values[name] = (None, _unpack("d", column))
    return steps, times, values


def metric_names(columns: dict[str, tuple[Any, Any]]) -> list[str]:
    """A batch's metric names (of :func:`metric_columns`) in the order its rows name
    them one by one: by the first row that has each, then as stored. A reader that
    takes a batch in bulk keeps the order a reader of its rows would (new names are
    added to a display in this order)."""
    def first_row(name: str) -> int:
        rows, values = columns[name]
        if not len(values):
            return sys.maxsize
        return 0 if rows is None else int(rows[0])
    return sorted(columns, key=first_row)


def metric_rows(event: Event) -> Iterator[tuple[int, float, dict[str, float]]]:
    """``(step, t, {name: value})`` for each row of a ``metric`` or ``metrics`` event."""
    data = event.data
    if codec.is_row(event):
        yield data["step"], data.get("t", event.time), data.get("values") or {}
        return
    if not codec.is_batch(event):
        return
    steps, times, columns = metric_columns(event)
    per_row: list[dict[str, float]] = [{} for _ in steps]
    for name, (idx, values) in columns.items():
        if idx is None:
            for row, value in zip(per_row, values, strict=False):
                row[name] = value
        else:
            for i, value in zip(idx, values, strict=False):
                per_row[i][name] = value
    yield from zip(steps, times, per_row, strict=False)


def last_values(event: Event) -> dict[str, float]:
    """The newest value of each metric in a ``metric`` or ``metrics`` event."""
    if codec.is_row(event):
        return dict(event.data.get("values") or {})
    if not codec.is_batch(event):
        return {}
    found: list[tuple[int, str, float]] = []
    for name, column in (event.data.get("values") or {}).items():
        values = column.get("v", []) if isinstance(column, dict) else column
        last = _unpack_last("d", values)
        if last is not None:
            first = _first_row(column.get("i", [])) if isinstance(column, dict) else 0
            found.append((first, name, last))
    # In the order the rows name them (a batch may store its columns in any order).
    found.sort(key=lambda item: item[0])
    return {name: last for _first, name, last in found}


def _first_row(indices: Any) -> int:
    """The first row index of a sparse column (its head: a few bytes decoded)."""
    if isinstance(indices, list):
        return int(indices[0]) if indices else sys.maxsize
    raw = base64.b64decode(indices[:8])[:4]
    if len(raw) < 4:
        return sys.maxsize
    column = array.array("i")
    column.frombytes(raw)
    if sys.byteorder != "little":
        column.byteswap()
    return int(column[0])


def merge_metrics(events: list[Event]) -> Event:
    """One ``metrics`` event holding the rows of several (compaction rolls a segment's
    batches into one: a day of metrics is then a few dozen events). Each row keeps the
    number of the event it came from (``src_n``), so a reader that had seen some of
    them takes only the rest (:func:`rows_after`)."""
    steps: list[int] = []
    times: list[float] = []
    sources: list[int] = []
    columns: dict[str, tuple[list[int], list[float]]] = {}
    for event in events:
        step_col, time_col, values = metric_columns(event)
        base = len(steps)
        steps.extend(step_col)
        times.extend(time_col)
        src = _unpack("q", event.data["src_n"]) if "src_n" in event.data else None
        sources.extend(src if src is not None else [event.n or 0] * len(step_col))
        for name, (rows_of, vals) in values.items():
            col_idx, col_vals = columns.setdefault(name, ([], []))
            col_idx.extend(base + i for i in (rows_of if rows_of is not None
                                              else range(len(vals))))
            col_vals.extend(vals)
    out: dict[str, Any] = {}
    for name, (col_idx, col_vals) in columns.items():
        out[name] = (_pack("d", col_vals) if len(col_idx) == len(steps)
                     else {"i": _pack("i", col_idx), "v": _pack("d", col_vals)})
    last = events[-1]
    return Event(type="metrics", time=max(times) if times else last.time,
                 attempt=last.attempt, instance=last.instance, v=last.v,
                 n=max(e.n or 0 for e in events),
                 data={"enc": _ENCODING, "rows": len(steps), "step": _pack("q", steps),
                       "t": _pack("d", times), "values": out,
                       "src_n": _pack("q", sources), "merged": len(events)})


def rows_after(event: Event, seen: int) -> Event | None:
    """A merged ``metrics`` event without the rows of events numbered ``seen`` or less
    (None if none is left); any other event as it is."""
    if "src_n" not in event.data:
        return event if event.n is None or event.n > seen else None
    sources = _unpack("q", event.data["src_n"])
    if sources and sources[0] > seen:
        return event
    keep = [i for i, n in enumerate(sources) if n > seen]
    if not keep:
        return None
    steps, times, values = metric_columns(event)
    rows = []
    for i in keep:
        row: dict[str, float] = {}
        rows.append((steps[i], times[i], row))
    wanted = {i: k for k, i in enumerate(keep)}
    for name, (idx, vals) in values.items():
        positions = idx if idx is not None else range(len(vals))
        for i, value in zip(positions, vals, strict=False):
            k = wanted.get(i)
            if k is not None:
                rows[k][2][name] = value
    return dataclasses.replace(event, data={**metrics_data(rows),
                                            "src_n": _pack("q", [sources[i] for i in keep])})


def expand(event: Event) -> list[Event]:
    """A ``metrics`` event as one ``metric`` event per row (others as they are)."""
    if not codec.is_batch(event):
        return [event]
    extra = {k: v for k, v in event.data.items()
             if k not in ("step", "t", "values", "enc", "rows", "src_n", "merged")}
    return [Event(type="metric", time=float(t), attempt=event.attempt,
                  instance=event.instance, v=event.v,
                  data={"step": step, "t": t, "values": values, **extra})
            for step, t, values in metric_rows(event)]


from spotnb.protocol.events import codec  # noqa: E402
from spotnb.protocol.events.reader import EventReader, log_state  # noqa: E402
from spotnb.protocol.events.writer import EventWriter  # noqa: E402
