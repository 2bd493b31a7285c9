"""The single writer of one stream of the event log: chunks, segments, a live tap.

``emit`` only queues; a thread writes the queue as one chunk every :attr:`interval`
seconds (when there is something to write), at once after :meth:`flush_soon`, and on
:meth:`flush` / :meth:`close`. What it costs on S3, for a job's agent:

* one PUT per flush: :data:`IDLE_FLUSH_SECONDS` apart while nothing urgent happens
  (60/h = $0.0003/h), plus one per urgent event (a notice, a checkpoint, an error);
* compaction: every :data:`COMPACT_FANOUT` chunks become one segment (a PUT, and one
  DeleteObjects for the chunks), and every :data:`COMPACT_FANOUT` segments of a level
  one of the next level: a stream of any length keeps at most ``COMPACT_FANOUT - 1``
  objects per level, a few dozen in all.

Nothing emitted is lost to a failing store: a chunk leaves the queue only once its
write succeeded. A failed write is retried under the same key with backoff (up to
:data:`MAX_RETRY_SECONDS` apart), so a write that landed although the call failed is
recognised rather than written twice. ``may_write`` (the lease's standing, for an
agent) is asked before every write: UNCONFIRMED keeps the events queued, LOST fences
the writer off for good and drops them: they belong to a job another agent now runs.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from spotnb.protocol.backoff import Backoff
from spotnb.protocol.events import (
    EVENTS_PREFIX,
    GROUP_STREAM,
    Event,
    codec,
    merge_metrics,
    metrics_data,
    parse_chunk,
    stream_name,
)
from spotnb.protocol.lease import Standing
from spotnb.protocol.store import NotFound, Store

__all__ = ["COMPACT_FANOUT", "IDLE_FLUSH_SECONDS", "EventWriter", "StreamObject"]

log = logging.getLogger(__name__)

# A job's agent writes its log this often while nothing urgent happens (60 PUTs/h =
# $0.0003/h on S3). A follower watching live gets events through a queue instead.
IDLE_FLUSH_SECONDS = 60.0
# Urgent events wait this long for the ones that usually follow them (a result is
# followed by its status), so that they share one chunk.
URGENT_DELAY_SECONDS = 0.2
# A failing store is retried after RETRY_SECONDS, doubling up to MAX_RETRY_SECONDS.
RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0
# This many objects of one level become one object of the next level.
COMPACT_FANOUT = 16
# Compaction is skipped for a stream whose objects would make a segment larger than
# this: it would only be rewritten at the next level (a reader reads it either way).
MAX_SEGMENT_BYTES = 256 << 20

_NAME = re.compile(r"^(\d{8})(?:\.(\d{8})\.L(\d+))?\.jsonl(\.gz)?$")


@dataclasses.dataclass(frozen=True)
class StreamObject:
    """One object of a stream: a chunk (level 0) or a segment of chunks first..last."""

    key: str
    first: int
    last: int
    level: int

    @property
    def compressed(self) -> bool:
        return self.key.endswith(".gz")

    @classmethod
    def parse(cls, key: str) -> StreamObject | None:
        m = _NAME.match(key.rsplit("/", 1)[-1])
        if m is None:
            return None
        last = int(m.group(1))
        if m.group(2) is None:
            return cls(key, last, last, 0)
        return cls(key, int(m.group(2)), last, int(m.group(3)))


def _roll_metrics(body: bytes) -> bytes:
    """A segment's JSON lines with its ``metrics`` batches merged into one event
    (:func:`spotnb.protocol.events.merge_metrics`); other events unchanged, in order."""
    events = parse_chunk(body)
    batches = [e for e in events if codec.is_batch(e) and e.n is not None]
    if len(batches) < 2:
        return body
    others = [e for e in events if not (codec.is_batch(e) and e.n is not None)]
    rolled = sorted([*others, merge_metrics(batches)], key=lambda e: e.n or 0)
    return ("\n".join(e.to_json() for e in rolled) + "\n").encode()


def segment_key(prefix: str, first: int, last: int, level: int) -> str:
    return f"{prefix}{last:08d}.{first:08d}.L{level}.jsonl.gz"


def read_object(store: Store, obj: StreamObject) -> bytes:
    """The JSON lines of a chunk or a segment (decompressed)."""
    body = store.get(obj.key)
    return gzip.decompress(body) if obj.compressed else body


class EventWriter:
    """The single writer of one stream. See the module docstring."""

    def __init__(
        self,
        store: Store,
        attempt: int,
        instance: str | None = None,
        flush_seconds: float = IDLE_FLUSH_SECONDS,
        may_write: Callable[[], Standing] | None = None,
        compact: bool = True,
    ) -> None:
        self.store = store
        self.attempt = attempt
        self.instance = instance
        self.interval = flush_seconds
        self.may_write = may_write
        # Only an attempt's stream has one writer at a time (the lease): only there are
        # events numbered and chunks compacted. The group's stream is written by
        # several processes (the supervisor, instance agents, the notebook's capacity
        # watch) and stays a few chunks per instance.
        self.numbered = attempt != GROUP_STREAM
        self.compact = compact and self.numbered
        self._prefix = f"{EVENTS_PREFIX}{stream_name(attempt)}/"
        self._objects = self._existing()
        # A restarted writer of the same stream (the group after a crash) continues
        # its chunk numbers and its event numbers.
        self._seq = max((o.last for o in self._objects), default=-1) + 1
        self._n = self._next_n() if self.numbered else 0
        self._pending: list[str] = []
        self._recent: dict[str, bytes] = {}  # chunk bodies not compacted yet
        #: Events queued and events written since this writer started (a caller that
        #: notes ``emitted`` after queueing knows its events are durable once
        #: ``written`` reaches it).
        self.emitted = 0
        self.written = 0
        self._live: list[str] | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._urgent_at: float | None = None
        self._closed = False
        self._fenced = False
        #: When writes started failing (None while they succeed), for the job's state.
        self.failing_since: float | None = None
        self.last_error: BaseException | None = None
        self._retry_delay = 0.0  # while writes fail: the delay before the next try
        self._backoff = Backoff(RETRY_SECONDS, MAX_RETRY_SECONDS)
        self._thread = threading.Thread(target=self._run, name="spotnb-events", daemon=True)
        self._thread.start()

    # -- queueing ----------------------------------------------------------------

    @property
    def fenced(self) -> bool:
        """Whether this writer was fenced off: it writes nothing more."""
        return self._fenced

    def pending(self) -> int:
        """Events emitted and not yet written."""
        with self._lock:
            return len(self._pending)

    def unwritten(self, types: frozenset[str]) -> tuple[list[str], int]:
        """The lines emitted and not yet written whose event type is in ``types``, and
        the number the next event will get: what a checkpoint carries so that a later
        attempt can record what this writer dies with (``spotnb.train.runtime``)."""
        with self._lock:
            lines = list(self._pending)
            following = self._n
        return [line for line in lines if json.loads(line).get("type") in types], following

    def emit(self, type: str, **data: Any) -> Event:
        """Queue an event; it is durable after the next flush."""
        return self._queue(Event(type=type, time=time.time(), attempt=self.attempt,
                                 instance=self.instance, data=data))

    def emit_event(self, event: Event) -> Event:
        """Queue an already built event (its time and attempt are kept)."""
        return self._queue(event)

    def emit_metrics(self, rows: Iterable[tuple[Any, Any, dict[str, Any]]]) -> Event:
        """Queue one ``metrics`` event for ``rows`` of ``(step, t, {name: value})``."""
        return self.emit("metrics", **metrics_data(rows))

    def _queue(self, event: Event) -> Event:
        with self._lock:
            if self._fenced:
                return event
            if self.numbered:
                event = dataclasses.replace(event, n=self._n)
                self._n += 1
            line = event.to_json()
            self._pending.append(line)
            self.emitted += 1
            if self._live is not None:
                self._live.append(line)
        return event

    # -- the live tap --------------------------------------------------------------

    def start_live(self) -> list[str]:
        """Start keeping a copy of every emitted line for :meth:`take_live`; returns
        the lines emitted and not yet written (a follower that replayed the written
        log needs those first)."""
        with self._lock:
            if self._live is None:
                self._live = []
            return list(self._pending)

    def take_live(self) -> list[str]:
        """The lines emitted since the last call (while live is on)."""
        with self._lock:
            lines, self._live = (self._live or []), ([] if self._live is not None else None)
            return lines

    def stop_live(self) -> None:
        with self._lock:
            self._live = None

    # -- flushing ------------------------------------------------------------------

    def flush_soon(self) -> None:
        """Write what is queued within :data:`URGENT_DELAY_SECONDS`, on the writer's
        thread (does not wait): for events a reader must not wait for."""
        if self._urgent_at is None:
            self._urgent_at = time.monotonic() + URGENT_DELAY_SECONDS
        self._wake.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Write everything queued so far; whether the queue is empty at the end.

        Retries a failing store with backoff until ``timeout`` seconds (None: one
        try). False also when the writer is fenced with events dropped.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._flush_lock:
                done = self._write_once()
            if done or deadline is None or time.monotonic() >= deadline:
                return done and not self._fenced
            time.sleep(min(max(self._retry_delay, 0.05), max(0.0, deadline - time.monotonic())))

    def stop_writing(self) -> None:
        """Fence this writer: nothing more is written (the lease was lost)."""
        with self._lock:
            self._fenced = True
            self._pending.clear()
            self._live = None

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the background thread, then flush, retrying a failing store up to
        ``timeout`` seconds; whether every event was written."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        return self.flush(timeout=timeout)

    def _write_once(self) -> bool:
        """One attempt at writing the queue as one chunk (call with the flush lock);
        True when nothing is left to write."""
        self._urgent_at = None
        with self._lock:
            lines = list(self._pending)
        if self._fenced or not lines:
            return True
        if self.may_write is not None:
            standing = self.may_write()
            if standing is Standing.LOST:
                log.warning("the lease is lost: dropping %d unwritten event(s)", len(lines))
                self.stop_writing()
                return True
            if standing is Standing.UNCONFIRMED:
                self._retry_delay = self._backoff.next()
                return False
        body = ("\n".join(lines) + "\n").encode()
        try:
            key = self._put_chunk(body)
        except Exception as err:
            if self.failing_since is None:
                self.failing_since = time.time()
                log.warning("writing events failed (%s); keeping them and retrying", err)
            self.last_error = err
            self._retry_delay = self._backoff.next()
            return False
        if self.failing_since is not None:
            log.warning("writing events works again after %.0f s",
                        time.time() - self.failing_since)
        self.failing_since, self.last_error, self._retry_delay = None, None, 0.0
        self._backoff.reset()
        with self._lock:
            del self._pending[:len(lines)]
            self.written += len(lines)
            empty = not self._pending
        self._recent[key] = body
        if self.compact:
            try:
                self._compact()
            except Exception:
                log.warning("compacting the event log failed; will try again",
                            exc_info=True)
        return empty

    def _put_chunk(self, body: bytes) -> str:
        """Write ``body`` as the next chunk, exactly once (retried calls included)."""
        while True:
            key = f"{self._prefix}{self._seq:08d}.jsonl"
            if self.store.put_if_absent(key, body) is not None:
                break
            # The key exists: our own earlier try that landed although the call failed,
            # or (only if two writers share a stream, which the lease forbids) another
            # writer's chunk. Never overwrite; move on past it.
            try:
                ours = self.store.get(key) == body
            except NotFound:
                continue
            if ours:
                break
            log.warning("event chunk %s already exists; skipping ahead", key)
            self._objects.append(StreamObject(key, self._seq, self._seq, 0))
            self._seq += 1
        self._objects.append(StreamObject(key, self._seq, self._seq, 0))
        self._seq += 1
        return key

    # -- compaction ------------------------------------------------------------------

    def _compact(self) -> None:
        """Merge the newest COMPACT_FANOUT objects of a level into one of the next,
        level by level. The segment is written before the objects it covers are
        deleted: a reader sees one or the other, or both (it keeps every event once,
        by ``n``), never neither."""
        level = 0
        while True:
            run = self._trailing_run(level)
            if len(run) < COMPACT_FANOUT:
                return
            bodies = []
            for obj in run:
                body = self._recent.pop(obj.key, None)
                if body is None:
                    body = read_object(self.store, obj)
                bodies.append(body)
            merged = _roll_metrics(b"".join(bodies))
            if len(merged) > MAX_SEGMENT_BYTES:
                return
            if self.may_write is not None and self.may_write() is not Standing.HELD:
                return  # a writer that may not write now does not compact either
            segment = StreamObject(segment_key(self._prefix, run[0].first, run[-1].last,
                                               level + 1),
                                   run[0].first, run[-1].last, level + 1)
            if self.store.put_if_absent(segment.key, gzip.compress(merged, 6)) is None:
                log.warning("segment %s exists already; keeping it", segment.key)
            self.store.delete_many([o.key for o in run])
            covered = {o.key for o in run}
            self._objects = [o for o in self._objects if o.key not in covered] + [segment]
            self._objects.sort(key=lambda o: (o.last, o.first))
            level += 1

    def _trailing_run(self, level: int) -> list[StreamObject]:
        """The newest objects of ``level`` that follow the last object of a higher
        level, oldest first."""
        run: list[StreamObject] = []
        for obj in reversed(self._objects):
            if obj.level > level:
                break
            if obj.level == level:
                run.append(obj)
            else:
                break  # a lower-level object after them: they are not the newest
        return list(reversed(run))

    # -- start-up ----------------------------------------------------------------------

    def _existing(self) -> list[StreamObject]:
        """The stream's objects (after a restart), with leftovers of an interrupted
        compaction (objects a segment covers) deleted."""
        objects = [o for k in self.store.list_keys(self._prefix)
                   if (o := StreamObject.parse(k)) is not None]
        objects.sort(key=lambda o: (o.last, -o.first))
        kept: list[StreamObject] = []
        for obj in objects:
            if any(k.first <= obj.first and obj.last <= k.last and k.level > obj.level
                   for k in objects):
                try:
                    self.store.delete(obj.key)
                except Exception:
                    log.debug("could not delete %s", obj.key, exc_info=True)
                continue
            kept.append(obj)
        kept.sort(key=lambda o: (o.last, o.first))
        return kept

    def _next_n(self) -> int:
        """One past the last event number in the stream (0 for a new stream)."""
        for obj in reversed(self._objects):
            try:
                events = parse_chunk(read_object(self.store, obj))
            except (NotFound, OSError, ValueError):
                continue
            numbered = [e.n for e in events if e.n is not None]
            if numbered:
                return max(numbered) + 1
            if events:
                return 0  # a log of spotnb 0.1: its events have no numbers
        return 0

    def _run(self) -> None:
        last = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            if self._retry_delay:
                delay = self._retry_delay
            elif self._urgent_at is not None:
                delay = max(0.0, self._urgent_at - now)
            else:
                delay = max(0.0, last + self.interval - now)
            self._wake.wait(delay)
            self._wake.clear()
            if self._closed:
                return
            now = time.monotonic()
            due = (self._retry_delay or now >= last + self.interval
                   or (self._urgent_at is not None and now >= self._urgent_at))
            if not due:
                continue
            try:
                with self._flush_lock:
                    self._write_once()
            except Exception:  # keep flushing: nothing here may stop the job's logging
                log.exception("flushing events failed; will retry")
            last = time.monotonic()

