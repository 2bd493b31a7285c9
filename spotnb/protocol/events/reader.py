"""Reading the event log: replay it, then tail it, every event exactly once.

A poll is one listing of the whole log (``events/``: a few dozen objects for a job of
any length, thanks to compaction, so one LIST request), then one GET for each object
not read yet. Objects are read in the order of the chunks they hold; the reader keeps,
for each stream, the last chunk it has read and the last event number ``n`` it has
delivered, so a segment that replaces chunks it has already read adds only what it had
not seen. A chunk that vanished between the listing and the GET was compacted: the
stream is listed again, and its segment read instead; so is a listing with a hole in an
attempt's chunk numbers (a LIST is no snapshot: it can miss both the compacted chunks
and their new segment).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Collection, Iterator

from spotnb.protocol.events import (
    EVENTS_PREFIX,
    GROUP_STREAM,
    Event,
    expand,
    parse_chunk,
    rows_after,
    stream_name,
)
from spotnb.protocol.events.writer import StreamObject, read_object
from spotnb.protocol.store import NotFound, Store

__all__ = ["EventReader", "log_state"]

log = logging.getLogger(__name__)

# A stream whose objects vanish under the reader this often in one poll is being
# compacted as fast as it is read; the next poll goes on.
_RELIST_TRIES = 3
# A hole in a stream's chunk numbers that this many polls in a row still list, for at
# least this long, is a chunk lost for good (not a compaction caught half-way): the
# reader reads past it. Both: a reader polling in a tight loop makes five polls in
# milliseconds, while a writer slowed by a loaded machine may take seconds to finish
# the compaction whose half it listed.
_HOLE_POLLS = 5
_HOLE_SECONDS = 30.0


def _objects(store: Store) -> dict[str, list[StreamObject]]:
    """Every object of the log by stream, in the order of the chunks they hold."""
    by_stream: dict[str, list[StreamObject]] = collections.defaultdict(list)
    for key in store.list_keys(EVENTS_PREFIX):
        stream = key[len(EVENTS_PREFIX):].split("/", 1)[0]
        obj = StreamObject.parse(key)
        if obj is not None:
            by_stream[stream].append(obj)
    for objs in by_stream.values():
        objs.sort(key=lambda o: (o.last, o.first))
    return dict(by_stream)


def log_state(store: Store) -> dict[str, str]:
    """The newest object of each stream: the whole state of the event log, since
    objects are written once and numbered in order. What is computed from the log
    stays valid as long as this is unchanged (one LIST request)."""
    return {stream: objs[-1].key for stream, objs in _objects(store).items() if objs}


class EventReader:
    """Tails a job's event log: each :meth:`poll` returns the events not seen yet.

    ``batches``: deliver ``metrics`` events as they are (one per batch of rows) rather
    than one ``metric`` event per row; for readers that handle both. ``attempts``: read
    only these streams (``GROUP_STREAM``'s: what the group said), not every attempt's;
    the LIST is the same, the GETs are theirs only.
    """

    def __init__(self, store: Store, batches: bool = False,
                 attempts: Collection[int] | None = None) -> None:
        self.store = store
        self.batches = batches
        self._streams = None if attempts is None else {stream_name(a) for a in attempts}
        self._last_chunk: dict[str, int] = {}
        self._last_n: dict[str, int] = {}
        self._read_keys: dict[str, set[str]] = collections.defaultdict(set)
        # stream -> ((last chunk read, first chunk listed after it), polls it stayed,
        # when it was first listed)
        self._holes: dict[str, tuple[tuple[int, int], int, float]] = {}
        #: Requests this reader made (LISTs and GETs), for the cost it reports.
        self.lists = 0
        self.gets = 0

    def seen(self, stream: str, n: int | None) -> bool:
        """Whether event ``n`` of ``stream`` was delivered already (by any path)."""
        return n is not None and n <= self._last_n.get(stream, -1)

    def mark(self, stream: str, n: int | None) -> None:
        """Record that event ``n`` of ``stream`` was delivered (by the live channel)."""
        if n is not None and n > self._last_n.get(stream, -1):
            self._last_n[stream] = n

    def last_n(self, stream: str) -> int:
        """The newest event number delivered from ``stream`` (-1 if none)."""
        return self._last_n.get(stream, -1)

    def poll(self) -> list[Event]:
        """New events since the last poll, in time order."""
        events: list[Event] = []
        self.lists += 1
        listing = _objects(self.store)
        for stream in sorted(listing):
            if self._streams is None or stream in self._streams:
                events += self._read_stream(stream, listing[stream])
        events.sort(key=lambda e: e.time)
        if self.batches:
            return events
        return [row for e in events for row in expand(e)]

    def _read_stream(self, stream: str, objs: list[StreamObject]) -> list[Event]:
        out: list[Event] = []
        for tries_left in reversed(range(_RELIST_TRIES)):
            vanished = False
            group = stream == stream_name(GROUP_STREAM)
            for obj in objs:
                # An attempt's stream has one writer: its chunks come in order, and a
                # segment may replace chunks already read. The group's stream has
                # several writers whose chunks may land out of order: read each key.
                if group:
                    if obj.key in self._read_keys[stream]:
                        continue
                elif obj.last <= self._last_chunk.get(stream, -1):
                    continue
                elif (hole := (self._last_chunk.get(stream, -1), obj.first))[1] > hole[0] + 1:
                    # A hole before this object: an attempt's chunks are numbered from 0
                    # without gaps, so the listing caught a compaction half-way (a LIST
                    # is no snapshot: the chunks already deleted, their segment not yet
                    # listed). Reading on would skip the hole's events for good: list
                    # again, and after that leave the stream to the next poll. Only a
                    # hole that stays over several polls (a chunk lost for good) is
                    # read past.
                    if tries_left:
                        vanished = True
                        break
                    now = time.monotonic()
                    seen_hole, polls, since = self._holes.get(stream, (hole, 0, now))
                    if seen_hole != hole:
                        polls, since = 0, now
                    self._holes[stream] = (hole, polls + 1, since)
                    if polls + 1 < _HOLE_POLLS or now - since < _HOLE_SECONDS:
                        return out
                    log.warning("events %s: chunks %d-%d are missing; reading on",
                                stream, hole[0] + 1, hole[1] - 1)
                try:
                    self.gets += 1
                    body = read_object(self.store, obj)
                except NotFound:
                    vanished = True  # compacted meanwhile: list the stream again
                    break
                except Exception:
                    log.exception("could not read event object %s", obj.key)
                    break
                # Every event numbered above what was delivered before this object is
                # new (an object holds consecutive events); a merged batch may be new
                # in part only.
                seen = self._last_n.get(stream, -1)
                newest = seen
                for event in parse_chunk(body):
                    if event.n is not None:
                        newest = max(newest, event.n)
                        kept = rows_after(event, seen)
                        if kept is None:
                            continue
                        event = kept
                    out.append(event)
                if newest > seen:
                    self._last_n[stream] = newest
                if group:
                    self._read_keys[stream].add(obj.key)
                else:
                    self._last_chunk[stream] = obj.last
            if not vanished:
                break
            self.lists += 1
            objs = _objects(self.store).get(stream, [])
        return out

    def replay(self) -> Iterator[Event]:
        """Every event so far, from the start (does not follow)."""
        yield from EventReader(self.store, batches=self.batches).poll()
