"""Following a job live, at a fraction of what tailing the log would cost.

The agent writes its log rarely (a PUT a minute while nothing urgent happens). A
follower (a notebook cell, ``spotnb logs -f``) that wants the events within a second
registers with the agent through the job's control queue, and the agent sends it the
events of its attempt every :data:`LIVE_SECONDS` through the follower's own queue
(:mod:`spotnb.protocol.events.queues`), for as long as the registration lasts. The log stays
the record: the follower reads it at the start, again whenever the live events show a
gap, and every :data:`LOG_SECONDS_LIVE` for what only the log has (the capacity
group's events); it delivers every event exactly once, by stream and event number.

The watch protocol, on the job's control queue::

    follower -> agent  {"op": "watch", "queue": <uri>, "until": <epoch s>}
                       renewed every WATCH_RENEW_SECONDS; expires at "until"
    follower -> agent  {"op": "unwatch", "queue": <uri>}
    anyone   -> agent  {"op": "stop", ...}  (also written to control/stop.json, the
                       record; the message only makes the agent see it at once)
    agent -> follower  {"op": "events", "stream": "000003", "lines": [<event JSON>]}

A registration is also written to the store (``watchers/<queue>.json``, rewritten
with each renewal, deleted when the follower closes): the agent of a new attempt reads
them when it starts (one LIST), so the live events continue across an interruption
without the follower doing anything.

What following costs, per hour, on AWS (list prices, see :mod:`spotnb.protocol.usage`):
the agent's sends (3,600) and the follower's long polls (3,600) at $0.40 per million
SQS requests, $0.0029; the follower's log reads, one LIST a minute, $0.0003.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from spotnb.protocol.events import GROUP_STREAM, Event, codec, expand, stream_name
from spotnb.protocol.events.queues import (
    CONTROL_WAIT_SECONDS,
    MAX_MESSAGE_BYTES,
    Queue,
    open_queue,
    pack,
    queue_for,
)
from spotnb.protocol.events.reader import EventReader
from spotnb.protocol.events.writer import EventWriter
from spotnb.protocol.store import Store

__all__ = ["CONTROL_QUEUE", "Follower", "LiveSender", "request_stop"]

log = logging.getLogger(__name__)

CONTROL_QUEUE = "control"
WATCHERS_PREFIX = "watchers/"
# The agent sends what its attempt emitted this often to each follower through SQS (a
# request each time): with the runtime's 0.2 s batches, a metric reaches a follower
# within about 1.3 s (p95). Through the local cloud's free queues, 4 times as often.
LIVE_SECONDS = 1.0
# A registration lasts this long; the follower renews it well before.
WATCH_SECONDS = 180.0
WATCH_RENEW_SECONDS = 60.0
# The follower reads the log this often while live events flow (what only the log has:
# the capacity group's events), and this often while they do not (an attempt that has
# not seen its registration yet, an interruption, a job without a live channel).
LOG_SECONDS_LIVE = 60.0
LOG_SECONDS_QUIET = 2.0
# No live event for this long means the live channel is not flowing.
LIVE_QUIET_SECONDS = 5.0


def request_stop(store: Store, job_id: str, request: dict[str, Any]) -> bool:
    """Ask a job to stop: ``control/stop.json`` (the record, which a stop before the
    agent starts relies on) and a message the running agent sees at once. Returns
    whether this request is the one recorded (an earlier one wins)."""
    import json

    from spotnb.protocol.layout import STOP

    written = store.put_if_absent(STOP, json.dumps(request).encode()) is not None
    try:
        queue_for(store, job_id, CONTROL_QUEUE).send_message({"op": "stop", **request})
    except Exception as err:
        log.debug("no stop message for job %s (%s); its agent reads stop.json", job_id, err)
    return written


class LiveSender:
    """The agent's side: reads its control queue, sends its attempt's events to the
    followers registered there. ``on_stop`` is called with a stop message."""

    def __init__(self, control: Queue, on_stop: Callable[[dict[str, Any]], None],
                 store: Store | None = None,
                 before_send: Callable[[], None] | None = None) -> None:
        self.control = control
        self.on_stop = on_stop
        self.store = store
        # Called just before each send while someone watches: the agent turns the
        # metric rows it gathered into an event then, so a row waits for one send
        # interval, not for a gathering interval and then a send interval.
        self.before_send = before_send
        self.writer: EventWriter | None = None
        self._watchers: dict[str, tuple[Queue, float]] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._receive, name="spotnb-control",
                                          daemon=True),
                         threading.Thread(target=self._send_loop, name="spotnb-live",
                                          daemon=True)]

    def start(self) -> LiveSender:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def attach(self, writer: EventWriter | None) -> None:
        """Send the events of this writer from now on (a new attempt's), to the
        followers registered in the store and those that register from now on."""
        if writer is not None:
            self._load_registrations()
        with self._lock:
            self.writer = writer
            if writer is not None and self._watchers:
                backlog = writer.start_live()
                for queue, _ in self._watchers.values():
                    self._send(queue, writer, backlog)

    @property
    def watched(self) -> bool:
        return bool(self._watchers)

    def _load_registrations(self) -> None:
        if self.store is None:
            return
        import json

        try:
            keys = self.store.list_keys(WATCHERS_PREFIX)
        except Exception as err:
            log.debug("cannot list the followers (%s)", err)
            return
        now = time.time()
        for key in keys:
            try:
                reg = json.loads(self.store.get(key))
                if float(reg.get("until", 0)) > now:
                    with self._lock:
                        if str(reg["queue"]) not in self._watchers:
                            self._watchers[str(reg["queue"])] = (
                                open_queue(str(reg["queue"])), float(reg["until"]))
            except Exception:
                log.debug("ignoring the registration %s", key, exc_info=True)

    def _receive(self) -> None:
        delay = 1.0
        while not self._done.is_set():
            try:
                messages = self.control.receive_messages(CONTROL_WAIT_SECONDS)
                delay = 1.0
            except Exception as err:
                log.debug("reading the control queue failed (%s)", err)
                self._done.wait(delay)
                delay = min(delay * 2, 60.0)
                continue
            for msg in messages:
                try:
                    self._on_control(msg)
                except Exception:
                    log.exception("bad control message %r", msg)

    def _on_control(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "watch":
            uri, until = str(msg["queue"]), float(msg.get("until", 0))
            with self._lock:
                new = uri not in self._watchers
                queue = self._watchers[uri][0] if not new else open_queue(uri)
                self._watchers[uri] = (queue, until)
                writer = self.writer
                if new and writer is not None:
                    log.info("a follower is watching (%s)", uri)
                    self._send(queue, writer, writer.start_live())
        elif op == "unwatch":
            with self._lock:
                self._watchers.pop(str(msg.get("queue")), None)
                if not self._watchers and self.writer is not None:
                    self.writer.stop_live()
        elif op == "stop":
            self.on_stop(msg)

    def send_now(self) -> None:
        """Send what is waiting at once (before a result, or before parking)."""
        self._send_due()

    @property
    def cadence(self) -> float:
        """Seconds between two sends: LIVE_SECONDS through SQS, less through a local
        queue (free), see :attr:`Queue.live_seconds`."""
        return min(LIVE_SECONDS, self.control.live_seconds)

    def _send_loop(self) -> None:
        while not self._done.wait(self.cadence):
            self._send_due()

    def _send_due(self) -> None:
        if self.before_send is not None and self._watchers:
            try:
                self.before_send()
            except Exception:
                log.exception("preparing the live events failed; sending what there is")
        with self._lock:
            writer = self.writer
            now = time.time()
            for uri in [u for u, (_, until) in self._watchers.items() if until < now]:
                log.info("a follower's registration expired (%s)", uri)
                del self._watchers[uri]
            if writer is None:
                return
            if not self._watchers:
                writer.stop_live()
                return
            lines = writer.take_live()
            if not lines:
                return
            for uri, (queue, _) in list(self._watchers.items()):
                if not self._send(queue, writer, lines):
                    self._watchers.pop(uri, None)

    def _send(self, queue: Queue, writer: EventWriter, lines: list[str]) -> bool:
        """Send ``lines`` in as few messages as fit; False if the queue is gone."""
        stream = stream_name(writer.attempt)
        batch: list[str] = []
        size = 0
        try:
            for line in lines:
                if batch and size + len(line) > MAX_MESSAGE_BYTES * 3:
                    self._send_batch(queue, stream, batch)
                    batch, size = [], 0
                batch.append(line)
                size += len(line) + 3
            if batch:
                self._send_batch(queue, stream, batch)
        except Exception as err:
            log.info("cannot send to a follower's queue (%s); dropping it", err)
            return False
        return True

    def _send_batch(self, queue: Queue, stream: str, lines: list[str]) -> None:
        body = pack({"op": "events", "stream": stream, "lines": lines})
        if len(body) <= MAX_MESSAGE_BYTES:
            queue.send(body)
            return
        half = len(lines) // 2  # too big even compressed: split it
        if half == 0:
            log.warning("an event of %d bytes is too large for the live channel; the "
                        "log has it", len(body))
            return
        self._send_batch(queue, stream, lines[:half])
        self._send_batch(queue, stream, lines[half:])


class Follower:
    """The follower's side: every event of a job exactly once, the log's then the live
    ones, as soon as they come. See the module docstring.

    :meth:`poll` blocks up to ``wait`` seconds for new events. ``live=False`` (or a
    store whose queues cannot be reached) reads the log every ``quiet_log_seconds``
    (:data:`LOG_SECONDS_QUIET`), as it does whenever no live event comes. Close
    it (or use it as a context manager) to unregister and delete its queue.
    """

    def __init__(self, store: Store, job_id: str, live: bool = True,
                 batches: bool = False, quiet_log_seconds: float = LOG_SECONDS_QUIET) -> None:
        self.store = store
        self.job_id = job_id
        self.batches = batches
        self.quiet_log_seconds = quiet_log_seconds
        self.reader = EventReader(store, batches=True)
        self._queue: Queue | None = None
        self._control: Queue | None = None
        self._live = live
        self._started = False
        self._watched_at = -WATCH_RENEW_SECONDS
        self._log_read_at = -LOG_SECONDS_LIVE
        self._live_at = -LIVE_QUIET_SECONDS
        self._pending: dict[str, list[Event]] = {}  # live events waiting for a gap
        self.ended = False
        #: Requests this follower made of the queues and the registrations.
        self.receives = 0
        self.registrations = 0

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public ------------------------------------------------------------------------

    def poll(self, wait: float = 1.0) -> list[Event]:
        """New events (time order within what the log gave, arrival order live)."""
        out: list[Event] = []
        if not self._started:
            self._started = True
            out += self._read_log()
            if self._live and not self.ended:
                self._open_queue()
        now = time.monotonic()
        if self._queue is not None and not self.ended:
            if now - self._watched_at >= WATCH_RENEW_SECONDS:
                self._watch()
            self._receive(wait)
        elif not out:
            time.sleep(min(wait, self.quiet_log_seconds))
        out += self._release()
        now = time.monotonic()
        quiet = now - self._live_at > LIVE_QUIET_SECONDS
        # A gap in the live events (what is left after the release) is filled from the
        # log soon; else the log is read every LOG_SECONDS_LIVE while live flows.
        due = self.quiet_log_seconds if (quiet or self._pending) else LOG_SECONDS_LIVE
        if now - self._log_read_at >= due:
            out += self._read_log()
            out += self._release()
        return out if self.batches else [row for e in out for row in expand(e)]

    def read_log(self) -> list[Event]:
        """Read the log now, whatever the schedule, with the live events that waited
        for it: what only the log has (the capacity group's events) is then delivered
        up to this moment."""
        out = self._read_log()
        out += self._release()
        return out if self.batches else [row for e in out for row in expand(e)]

    def close(self) -> None:
        """Unregister and delete this follower's queue (idempotent); on AWS, report the
        requests following cost (a ``usage`` event in the group's stream)."""
        queue, self._queue = self._queue, None
        if queue is None:
            return
        self._report_usage(queue)
        try:
            self.store.delete(self._registration())
        except Exception:
            log.debug("could not delete the registration of %s", queue.uri, exc_info=True)
        try:
            if self._control is not None:
                self._control.send_message({"op": "unwatch", "queue": queue.uri})
        except Exception:
            log.debug("could not unregister %s", queue.uri, exc_info=True)
        try:
            queue.delete()
        except Exception:
            log.debug("could not delete %s", queue.uri, exc_info=True)

    # -- the log -------------------------------------------------------------------------

    def _read_log(self) -> list[Event]:
        self._log_read_at = time.monotonic()
        events = self.reader.poll()
        for e in events:
            self._note(e)
        return events

    def _note(self, event: Event) -> None:
        if isinstance(codec.peek(event), codec.Result):
            self.ended = True

    # -- live -----------------------------------------------------------------------------

    def _open_queue(self) -> None:
        try:
            self._control = queue_for(self.store, self.job_id, "control")
            queue = queue_for(self.store, self.job_id, f"w-{secrets.token_hex(4)}")
            queue.create()
            self._queue = queue
            self._watch()
        except Exception as err:
            log.info("no live channel for job %s (%s); reading its log every %g s",
                     self.job_id, err, LOG_SECONDS_QUIET)
            self._queue = None

    def _report_usage(self, queue: Queue) -> None:
        if not queue.billed:
            return  # the local cloud's requests cost nothing
        counts = {"s3:ListObjectsV2": self.reader.lists, "s3:GetObject": self.reader.gets,
                  "s3:PutObject": self.registrations,
                  "sqs:ReceiveMessage": self.receives, "sqs:SendMessage": self.registrations}
        try:
            writer = EventWriter(self.store, GROUP_STREAM, flush_seconds=3600)
            writer.emit("usage", process="follower", requests=counts)
            writer.close(timeout=10)
        except Exception:
            log.debug("could not report the follower's requests", exc_info=True)

    def _registration(self) -> str:
        assert self._queue is not None
        return f"{WATCHERS_PREFIX}{self._queue.uri.rstrip('/').rsplit('/', 1)[-1]}.json"

    def _watch(self) -> None:
        """Register (or renew): a message the running agent sees at once, and an
        object in the store that the next attempt's agent reads when it starts."""
        import json

        assert self._queue is not None and self._control is not None
        self._watched_at = time.monotonic()
        registration = {"op": "watch", "queue": self._queue.uri,
                        "until": time.time() + WATCH_SECONDS}
        try:
            self._control.send_message(registration)
        except Exception as err:
            log.debug("could not register with the job's agent (%s)", err)
        try:
            self.store.put(self._registration(), json.dumps(registration).encode())
            self.registrations += 1
        except Exception as err:
            log.debug("could not record the registration (%s)", err)

    def _receive(self, wait: float) -> None:
        assert self._queue is not None
        try:
            self.receives += 1
            messages = self._queue.receive_messages(wait)
        except Exception as err:
            log.debug("reading the live queue failed (%s)", err)
            time.sleep(min(wait, 1.0))
            return
        for msg in messages:
            if msg.get("op") != "events":
                continue
            stream = str(msg.get("stream"))
            for line in msg.get("lines", []):
                try:
                    event = _parse(line)
                except ValueError:
                    continue
                self._pending.setdefault(stream, []).append(event)
            self._live_at = time.monotonic()

    def _release(self) -> list[Event]:
        """Live events that follow what was delivered without a gap; the rest wait
        for the log (read soon: a gap makes the next read due at once)."""
        out: list[Event] = []
        for stream, waiting in list(self._pending.items()):
            waiting.sort(key=lambda e: e.n if e.n is not None else -1)
            keep = []
            for event in waiting:
                if self.reader.seen(stream, event.n):
                    continue
                if event.n is None or event.n == self.reader.last_n(stream) + 1:
                    self.reader.mark(stream, event.n)
                    self._note(event)
                    out.append(event)
                else:
                    keep.append(event)
            if keep:
                self._pending[stream] = keep
            else:
                del self._pending[stream]
        return out


def _parse(line: str) -> Event:
    import json

    return Event.from_dict(json.loads(line))
