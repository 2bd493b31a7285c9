"""The job's event log: append-only, per attempt, chunked objects in the store.

Layout: ``events/<stream>/<seq>.jsonl`` where ``<stream>`` is the attempt number as
six digits (``000001`` ...) for agents and ``000000`` for the capacity group (the
provider's control plane). Each stream has exactly one writer; each chunk is created
with ``put_if_absent`` and never changed, so a reader can list new keys after the last
one it saw and replay them. Re-attaching is replaying from the start.

Every event carries the schema version ``v``, the wall-clock ``time``, the ``attempt``
(0 for the group), the ``instance`` id, a ``type`` and a ``data`` dict. The types and
their data (the vocabulary every reader may rely on):

``status``      ``state`` (one of :data:`STATES`), ``detail``; at boot also
                ``instance_type``, ``az``
``metric``      ``step``, ``t`` (time of the ``log`` call), ``values`` {name: float}
``stream``      ``name`` (stdout/stderr), ``text``
``display``     ``data`` (MIME bundle), ``metadata``, ``kind`` (display_data,
                execute_result, update_display_data), ``display_id``
``sys``         ``kind`` ("gpu" or "cpu"), ``util`` (%), ``mem_used``, ``mem_total``
                (bytes), for GPUs also ``gpus`` (per-device list)
``checkpoint``  ``phase`` (begin, durable, failed), ``id``, ``step``, ``bytes``,
                ``seconds`` (to durable), ``forced``; durable ones also ``stall`` (the
                seconds the training loop waited)
``notice``      ``kind`` (instance-action, rebalance), ``action``, ``notice_time``
``price``       ``pool``, ``instance_type``, ``az``, ``price``, ``ondemand``
``instance``    ``action`` (launched, terminated, capacity_error), ``instance_id``,
                ``instance_type``, ``az``, ``reason``
``error``       ``ename``, ``evalue``, ``traceback`` (list of str), ``retrying``
``warning``     ``kind`` (``notice-fit``: checkpoints take too long for the notice),
                ``text`` (what happens and what to do)
``result``      ``status`` (completed, failed, stopped), ``reason``
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from spotnb.lease import Standing
from spotnb.store import NotFound, Store

__all__ = ["SCHEMA_VERSION", "STATES", "Event", "EventReader", "EventWriter", "parse_chunk",
           "stream_name"]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
EVENTS_PREFIX = "events/"
GROUP_STREAM = 0

#: Job states, in the order a healthy job moves through them.
STATES = (
    "submitted",
    "waiting_for_capacity",
    "launching",
    "booting",
    "restoring",
    "running",
    "checkpointing",
    "interrupted",
    "completed",
    "failed",
    "stopped",
)
FINAL_STATES = frozenset({"completed", "failed", "stopped"})

# The notebook promises events within about a second: flush at least this often.
DEFAULT_FLUSH_SECONDS = 0.25
# A failing store is retried after RETRY_SECONDS, doubling up to MAX_RETRY_SECONDS.
RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0


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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"), default=str)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Event:
        return cls(
            type=raw["type"],
            time=float(raw["time"]),
            attempt=int(raw["attempt"]),
            instance=raw.get("instance"),
            data=raw.get("data") or {},
            v=int(raw.get("v", SCHEMA_VERSION)),
        )


class EventWriter:
    """The single writer of one stream. ``emit`` is cheap; a thread flushes chunks.

    Chunks are written every :attr:`interval` seconds when there is something to write,
    at once after :meth:`flush_soon` (notices, checkpoints, errors, results: what a
    reader must not wait for), and on :meth:`flush` / :meth:`close`.

    Nothing emitted is lost to a failing store: a chunk leaves the queue only once its
    write succeeded. A failed write is retried under the same key with backoff (up to
    :data:`MAX_RETRY_SECONDS` apart), so a write that did land although the call failed
    is recognised rather than written twice. ``may_write`` (the lease's standing, for an
    agent) is asked before every write: UNCONFIRMED keeps the events queued, LOST fences
    the writer off for good (as :meth:`stop_writing` does) and drops them: they belong
    to a job another agent now runs.
    """

    def __init__(
        self,
        store: Store,
        attempt: int,
        instance: str | None = None,
        flush_seconds: float = DEFAULT_FLUSH_SECONDS,
        may_write: Callable[[], Standing] | None = None,
    ) -> None:
        self.store = store
        self.attempt = attempt
        self.instance = instance
        self.interval = flush_seconds
        self.may_write = may_write
        self._prefix = f"{EVENTS_PREFIX}{stream_name(attempt)}/"
        existing = store.list_keys(self._prefix)
        # A restarted writer of the same stream (the group after a crash) continues.
        self._seq = _chunk_seq(existing[-1]) + 1 if existing else 0
        self._pending: list[str] = []
        #: Events queued and events written since this writer started (a caller that
        #: notes ``emitted`` after queueing knows its events are durable once
        #: ``written`` reaches it).
        self.emitted = 0
        self.written = 0
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._fenced = False
        #: When writes started failing (None while they succeed), for the job's state.
        self.failing_since: float | None = None
        self.last_error: BaseException | None = None
        self._retry_delay = 0.0
        self._thread = threading.Thread(target=self._run, name="spotnb-events", daemon=True)
        self._thread.start()

    @property
    def fenced(self) -> bool:
        """Whether this writer was fenced off: it writes nothing more."""
        return self._fenced

    def pending(self) -> int:
        """Events emitted and not yet written."""
        with self._lock:
            return len(self._pending)

    def emit(self, type: str, **data: Any) -> Event:
        """Queue an event; it is durable after the next flush."""
        event = Event(type=type, time=time.time(), attempt=self.attempt,
                      instance=self.instance, data=data)
        line = event.to_json()
        with self._lock:
            if not self._fenced:
                self._pending.append(line)
                self.emitted += 1
        return event

    def emit_event(self, event: Event) -> None:
        """Queue an already built event (its time is kept)."""
        line = event.to_json()
        with self._lock:
            if not self._fenced:
                self._pending.append(line)
                self.emitted += 1

    def flush_soon(self) -> None:
        """Write what is queued now, on the writer's thread (does not wait)."""
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

    def set_interval(self, seconds: float) -> None:
        """Flush every ``seconds`` from now on (watched jobs flush often)."""
        if seconds != self.interval:
            self.interval = seconds
            self._wake.set()

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
        with self._lock:
            lines = list(self._pending)
        if self._fenced:
            return True
        if not lines:
            return True
        if self.may_write is not None:
            standing = self.may_write()
            if standing is Standing.LOST:
                log.warning("the lease is lost: dropping %d unwritten event(s)", len(lines))
                self.stop_writing()
                return True
            if standing is Standing.UNCONFIRMED:
                self._retry_delay = min(max(self._retry_delay * 2, 0.5), MAX_RETRY_SECONDS)
                return False
        body = ("\n".join(lines) + "\n").encode()
        try:
            self._put_chunk(body)
        except Exception as err:
            if self.failing_since is None:
                self.failing_since = time.time()
                log.warning("writing events failed (%s); keeping them and retrying", err)
            self.last_error = err
            self._retry_delay = min(max(self._retry_delay * 2, RETRY_SECONDS),
                                    MAX_RETRY_SECONDS)
            return False
        if self.failing_since is not None:
            log.warning("writing events works again after %.0f s",
                        time.time() - self.failing_since)
        self.failing_since, self.last_error, self._retry_delay = None, None, 0.0
        with self._lock:
            del self._pending[:len(lines)]
            self.written += len(lines)
            return not self._pending

    def _put_chunk(self, body: bytes) -> None:
        """Write ``body`` as the next chunk, exactly once (retried calls included)."""
        while True:
            key = f"{self._prefix}{self._seq:08d}.jsonl"
            if self.store.put_if_absent(key, body) is not None:
                self._seq += 1
                return
            # The key exists: our own earlier try that landed although the call failed,
            # or (only if two writers share a stream, which the lease forbids) another
            # writer's chunk. Never overwrite; move on past it.
            try:
                ours = self.store.get(key) == body
            except NotFound:
                continue  # deleted meanwhile (compaction of another writer): try again
            self._seq += 1
            if ours:
                return
            log.warning("event chunk %s already exists; skipping ahead", key)

    def _run(self) -> None:
        while not self._closed:
            delay = self._retry_delay if self._retry_delay else self.interval
            self._wake.wait(delay)
            self._wake.clear()
            if self._closed:
                return
            try:
                with self._flush_lock:
                    self._write_once()
            except Exception:  # keep flushing: nothing here may stop the job's logging
                log.exception("flushing events failed; will retry")


def parse_chunk(body: bytes) -> list[Event]:
    """The events of one chunk of the log."""
    return [Event.from_dict(json.loads(line)) for line in body.decode().splitlines()
            if line.strip()]


def _chunk_seq(key: str) -> int:
    """The sequence number of a chunk key (``.../00000012.jsonl`` -> 12)."""
    return int(key.rsplit("/", 1)[1].split(".")[0].split("-")[0])


def log_state(store: Store) -> dict[str, str]:
    """The last chunk of each stream: the whole state of the event log, since chunks are
    written once and numbered in order. What is computed from the log stays valid as
    long as this is unchanged."""
    state = {}
    for stream in store.list_children(EVENTS_PREFIX):
        keys = store.list_keys(f"{EVENTS_PREFIX}{stream}/")
        if keys:
            state[stream] = keys[-1]
    return state


class EventReader:
    """Tails a job's event log: each :meth:`poll` returns the events not seen yet."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._last_key: dict[str, str] = {}

    def poll(self) -> list[Event]:
        """New events since the last poll, in time order."""
        events: list[Event] = []
        for key in self._new_keys():
            try:
                body = self.store.get(key).decode()
            except Exception:
                log.exception("could not read event chunk %s", key)
                continue
            for line in body.splitlines():
                if line.strip():
                    events.append(Event.from_dict(json.loads(line)))
        events.sort(key=lambda e: e.time)
        return events

    def _new_keys(self) -> list[str]:
        # One listing per stream, after the last key seen: cheap on S3 and locally.
        keys = []
        for stream in self.store.list_children(EVENTS_PREFIX):
            prefix = f"{EVENTS_PREFIX}{stream}/"
            new = self.store.list_keys(prefix, start_after=self._last_key.get(stream))
            if new:
                self._last_key[stream] = new[-1]
                keys.extend(new)
        return keys

    def replay(self) -> Iterator[Event]:
        """Every event so far, from the start (does not follow)."""
        yield from EventReader(self.store).poll()
