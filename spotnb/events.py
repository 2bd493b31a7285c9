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
                ``seconds``, ``forced``
``notice``      ``kind`` (instance-action, rebalance), ``action``, ``notice_time``
``price``       ``pool``, ``instance_type``, ``az``, ``price``, ``ondemand``
``instance``    ``action`` (launched, terminated, capacity_error), ``instance_id``,
                ``instance_type``, ``az``, ``reason``
``error``       ``ename``, ``evalue``, ``traceback`` (list of str), ``retrying``
``result``      ``status`` (completed, failed, stopped), ``reason``
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from spotnb.store import Store

__all__ = ["SCHEMA_VERSION", "STATES", "Event", "EventReader", "EventWriter", "stream_name"]

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

    Chunks are flushed every ``flush_seconds`` when there is something to write, and
    on :meth:`flush` / :meth:`close`. A writer that was fenced off (``stop_writing``)
    drops everything after that point.
    """

    def __init__(
        self,
        store: Store,
        attempt: int,
        instance: str | None = None,
        flush_seconds: float = DEFAULT_FLUSH_SECONDS,
    ) -> None:
        self.store = store
        self.attempt = attempt
        self.instance = instance
        self.flush_seconds = flush_seconds
        self._prefix = f"{EVENTS_PREFIX}{stream_name(attempt)}/"
        existing = store.list_keys(self._prefix)
        # A restarted writer of the same stream (the group after a crash) continues.
        self._seq = int(existing[-1].rsplit("/", 1)[1].split(".")[0]) + 1 if existing else 0
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._closed = threading.Event()
        self._fenced = False
        self._thread = threading.Thread(target=self._run, name="spotnb-events", daemon=True)
        self._thread.start()

    def emit(self, type: str, **data: Any) -> Event:
        """Queue an event; it is durable after the next flush."""
        event = Event(type=type, time=time.time(), attempt=self.attempt,
                      instance=self.instance, data=data)
        line = event.to_json()
        with self._lock:
            self._pending.append(line)
        return event

    def emit_event(self, event: Event) -> None:
        """Queue an already built event (its time is kept)."""
        with self._lock:
            self._pending.append(event.to_json())

    def flush(self) -> None:
        """Write everything queued so far as one chunk."""
        with self._flush_lock:
            with self._lock:
                lines, self._pending = self._pending, []
            if not lines or self._fenced:
                return
            body = ("\n".join(lines) + "\n").encode()
            while True:
                key = f"{self._prefix}{self._seq:08d}.jsonl"
                self._seq += 1
                if self.store.put_if_absent(key, body) is not None:
                    return
                # Someone wrote this sequence number: only possible if two writers share
                # a stream, which the lease forbids. Never overwrite; move on.
                log.warning("event chunk %s already exists; skipping ahead", key)

    def stop_writing(self) -> None:
        """Fence this writer: nothing more is written (the lease was lost)."""
        self._fenced = True
        with self._lock:
            self._pending.clear()

    def close(self) -> None:
        """Flush and stop the background thread."""
        self._closed.set()
        self._thread.join(timeout=10)
        self.flush()

    def _run(self) -> None:
        while not self._closed.wait(self.flush_seconds):
            try:
                self.flush()
            except Exception:  # keep flushing: a transient store error must not stop logging
                log.exception("flushing events failed; will retry")


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
