"""A restored checkpoint's carry, recorded in the log of the attempt that saved it.

A checkpoint carries the events its attempt's log had not confirmed and the runtime's
unconfirmed metric rows (DESIGN invariant 8). When a later attempt restores it, the
runtime sends them back (the ``replay`` op) and :func:`record_carry` appends what that
attempt's log lacks, as if its agent had lived to write it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from spotnb.kernel_remote.leasing import Fenced, LeaseKeeper
from spotnb.kernel_remote.rows import row_time
from spotnb.protocol.events import (
    EVENTS_PREFIX,
    Event,
    codec,
    metric_rows,
    metrics_data,
    parse_chunk,
    stream_name,
)
from spotnb.protocol.events.writer import StreamObject, read_object
from spotnb.protocol.store import NotFound, Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)


def record_carry(store: Store, keeper: LeaseKeeper, source: int, rows: list[list[Any]],
                 lines: list[str], durable: dict[str, Any] | None,
                 saved: float | None) -> None:
    """Record what a restored checkpoint carried that the log of the attempt that
    saved it lacks (its agent died with it unwritten): metric rows, and events (the
    cell's output, earlier saves...). Rows are logged in time order, so those after
    the newest metric in that attempt's log are the missing ones; events are
    numbered, so those after the newest number in it.

    They are appended to that attempt's own stream as one chunk, under the numbers
    its agent gave them, as if it had written them: the log reads as if that agent
    had lived, and a later restore of the same checkpoint finds them there and
    records nothing twice. That agent writes nothing more (it lost the lease this
    agent holds), so the stream still has one writer at a time. The restored save's
    own ``checkpoint`` event (``durable``, saved at time ``saved``) is added when
    that log lacks it too (its agent died between the save and the next write of
    its log), and the rows as one batch: both unnumbered, since that agent may
    have given any later number to an event another checkpoint carries; a
    checkpoint event is recorded once by its id and phase (``durable``: None, or one
    with a string ``id``, and ``saved`` its time: :class:`spotnb.kernel_remote.channel.
    Replay` reads them so)."""
    held = keeper.held
    if held is None or source == held.epoch:
        return
    carried = []
    for line in lines:
        try:
            event = Event.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not an event: the carry is read from the store, not trusted
        if event.n is not None:
            carried.append(event)

    def append() -> tuple[int, int]:
        prefix = f"{EVENTS_PREFIX}{stream_name(source)}/"
        objs = [o for k in store.list_keys(prefix)
                if (o := StreamObject.parse(k)) is not None]
        since = min([float(saved or 0.0), *(e.time for e in carried)])
        newest_n, newest_t, recent = newest_logged(store, objs, since)
        saves: set[tuple[str | None, str]] = {(b.id, b.phase) for e in recent
                 if isinstance(b := e.body, codec.CheckpointEvent) and b.id}
        # Compared as logged: the log keeps each row's time to the millisecond.
        missing = [(step, row_time(t), values) for step, t, values in rows
                   if row_time(t) > newest_t]
        events = []
        for e in sorted(carried, key=lambda e: e.n or 0):
            kind = e.body
            save = (kind.id, kind.phase) if isinstance(kind, codec.CheckpointEvent) \
                else None
            if (e.n or 0) <= newest_n or (save is not None and save in saves):
                continue
            if save is not None:
                saves.add(save)
            events.append(dataclasses.replace(e, data={**e.data,
                                                       "replayed_by": held.epoch}))
        if durable is not None and saved is not None \
                and (durable["id"], "durable") not in saves:
            events.append(Event(type="checkpoint", time=saved, attempt=source,
                                instance=None, data={**durable, "replayed_by": held.epoch}))
        if missing:
            data = {**metrics_data(missing), "replayed_by": held.epoch}
            events.append(Event(type="metrics", time=missing[-1][1], attempt=source,
                                instance=None, data=data))
        if events:
            seq = max((o.last for o in objs), default=-1) + 1
            body = "".join(e.to_json() + "\n" for e in events).encode()
            if store.put_if_absent(f"{prefix}{seq:08d}.jsonl", body) is None:
                raise StoreError("the restored attempt's log changed meanwhile")
        return len(missing), len(events) - (1 if missing else 0)

    try:
        recorded = keeper.write(append, "the rows and events the restored checkpoint "
                                       "carried")
    except (StoreUnavailable, Fenced):
        return
    if any(recorded):
        log.info("recorded %d metric row(s) and %d event(s) of attempt %d that its log "
                 "lacked", *recorded, source)


def newest_logged(store: Store, objs: list[StreamObject], since: float
                   ) -> tuple[int, float, list[Event]]:
    """The newest event number and metric row time among a stream's objects (-1 and
    -inf without any), and its events from time ``since`` on: read from the last one
    back until one holds a metric and one an event older than ``since`` (the first
    read gives the newest number: objects are in event order)."""
    newest_n, newest_t = -1, None
    recent: list[Event] = []
    for obj in sorted(objs, key=lambda o: (o.last, o.first), reverse=True):
        try:
            events = parse_chunk(read_object(store, obj))
        except NotFound:
            continue
        newest_n = max([newest_n, *(e.n for e in events if e.n is not None)])
        recent += [e for e in events if e.time >= since]
        times = [float(t) for e in events for _, t, _ in metric_rows(e)]
        if times and newest_t is None:
            newest_t = max(times)
        if newest_t is not None and any(e.time < since for e in events):
            break
    return newest_n, float("-inf") if newest_t is None else newest_t, recent
