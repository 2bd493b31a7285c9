"""Which agent hosts the job's rendezvous store, for which generation.

torchelastic's c10d rendezvous keeps its state (participants, rounds, heartbeats) in a
``TCPStore`` on one machine; torchrun puts it in the agent of the node named by
``--rdzv-endpoint``, so losing that node kills its peers (pytorch issues 67742,
111646). spotnb hosts the store itself, in the agent of one node (the *host*), and
every node's elastic agent joins it as a client (``is_host=false``). Who hosts which
*generation* of the rendezvous is written in the job's store, ``rendezvous.json``::

    {"generation": 3, "run_id": "<job id>-g3", "endpoint": "10.0.1.7:41233",
     "host": "i-0abc", "host_slot": 1, "reason": "...", "time": 1700000000.0}

``endpoint`` and ``host`` are null while the generation is *vacant* (its host left).
The record only changes by compare-and-swap, so exactly one agent hosts a generation.
A new generation is a new ``run_id``: a fresh rendezvous that starts from nothing, so
nothing of the old store is needed.

Sequences (the node side is :mod:`spotnb.kernel_remote.multinode.node`)::

    first start      no record -> bind a TCPStore server, put_if_absent the record
                     (generation 1, host = me); the losers of the race join it
    host notice      the host's agent vacates its generation (g+1, host null) before
                     its runtime hears of the notice -> the coordinated checkpoint ->
                     the staying nodes restart their workers, see g+1 vacant, and the
                     first to compare-and-swap becomes its host -> all join g+1
    node leaves      (its notice, after the coordinated checkpoint) its elastic agent
                     leaves torchelastic's round at once (:func:`leave_round`): the
                     staying nodes re-form without it now, not once its heartbeat
                     stops (its process may live until EC2 ends the instance)
    host killed      the other nodes' elastic agents lose the store -> each reads the
                     record: same generation, its host gone (slot lease released or
                     expired, or the provider says the instance is terminated) ->
                     compare-and-swap g+1 with itself as host (one wins) -> all join

The store a host binds lives as long as its agent process; only the agents of the
job's own nodes connect to it (on AWS the security group opens the port to the job's
instances only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from spotnb.protocol import lease
from spotnb.protocol.layout import RENDEZVOUS
from spotnb.protocol.store import NotFound, Store

__all__ = ["HostedStore", "Record", "elect", "host_alive", "leave_round", "read", "vacate"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Record:
    """A snapshot of ``rendezvous.json``."""

    generation: int
    run_id: str
    endpoint: str | None
    host: str | None
    host_slot: int | None
    reason: str = ""
    time: float = 0.0

    @property
    def vacant(self) -> bool:
        """Whether the generation has no host yet (its previous host left)."""
        return self.endpoint is None

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Record:
        raw = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def run_id(job_id: str, generation: int) -> str:
    """The torchelastic run id of a generation: a fresh rendezvous each time."""
    return f"{job_id}-g{generation}"


def read(store: Store) -> tuple[Record, str] | None:
    """The current record and its ETag, or None before the first node wrote it."""
    try:
        data, etag = store.get_with_etag(RENDEZVOUS)
    except NotFound:
        return None
    return Record.decode(data), etag


class HostedStore:
    """The c10d ``TCPStore`` server of one generation, in this agent's process.

    Binds a free port on ``address`` at once (before the record names it, so that a
    node reading the record can connect at once). ``close`` stops it.
    """

    def __init__(self, address: str, timeout: float) -> None:
        from torch.distributed import TCPStore

        self.address = address
        # multi_tenant: several clients of this process (the node's own elastic agent)
        # share the server; wait_for_workers=False: clients come and go with the nodes.
        self._server: Any = TCPStore(address, 0, is_master=True, multi_tenant=True,
                                     wait_for_workers=False,
                                     timeout=timedelta(seconds=timeout))
        self.port = int(self._server.port)

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    def close(self) -> None:
        """Stop serving (the server stops when the last reference goes)."""
        self._server = None


def elect(store: Store, job_id: str, me: str, slot: int, address: str,
          current: tuple[Record, str] | None, reason: str,
          timeout: float) -> tuple[Record, HostedStore | None]:
    """Make this agent the host of the next generation (or of the first), if no other
    agent was faster. Returns the record now in force and, if it is ours, our store.

    Step 1  bind a store server (so the endpoint works the moment it is published).
    Step 2  compare-and-swap the record: ``put_if_absent`` the first time, else
            ``put_if_match`` on the ETag the caller read (``current``).
    Step 3  lost the race: close the server, return the winner's record.
    """
    hosted = HostedStore(address, timeout)
    if current is None:
        record = Record(1, run_id(job_id, 1), hosted.endpoint, me, slot, reason, time.time())
        won = store.put_if_absent(RENDEZVOUS, record.encode())
    else:
        old, etag = current
        generation = old.generation if old.vacant else old.generation + 1
        record = Record(generation, run_id(job_id, generation), hosted.endpoint, me, slot,
                        reason, time.time())
        won = store.put_if_match(RENDEZVOUS, record.encode(), etag)
    if won is not None:
        log.info("hosting the rendezvous of generation %d at %s (%s)", record.generation,
                 hosted.endpoint, reason)
        return record, hosted
    hosted.close()
    now = read(store)
    if now is None:  # nobody could have deleted it; a store that lies: try again later
        raise RuntimeError("rendezvous.json vanished while electing a host")
    return now[0], None


def vacate(store: Store, record: Record, reason: str) -> Record | None:
    """Give up hosting ``record``'s generation: the next one starts vacant, and the
    first node that needs it becomes its host (see the module docstring). None if the
    record changed meanwhile (someone else moved on already)."""
    current = read(store)
    if current is None or current[0] != record:
        return None
    new = Record(record.generation + 1, run_id(record.run_id.rsplit("-g", 1)[0],
                                               record.generation + 1),
                 None, None, None, reason, time.time())
    if store.put_if_match(RENDEZVOUS, new.encode(), current[1]) is None:
        return None
    log.info("vacated the rendezvous: generation %d has no host yet (%s)", new.generation,
             reason)
    return new


def host_alive(store: Store, record: Record,
               instance_gone: Callable[[str], bool] | None = None) -> bool:
    """Whether the host of ``record`` is still there: its slot's lease is held by the
    host's instance, not released, with a heartbeat younger than its TTL, and the
    provider does not know the instance to be terminated. A vacant record's host is
    never alive."""
    if record.vacant or record.host is None or record.host_slot is None:
        return False
    current = lease.read(store, record.host_slot)
    if current is None:
        return False
    held = current[0]
    if held.holder != record.host or held.expired(time.time()):
        return False
    if instance_gone is not None:
        try:
            if instance_gone(record.host):
                return False
        except Exception:
            log.debug("could not tell whether %s is gone", record.host, exc_info=True)
    return True


def leave_round(handler: Any, timeout: float) -> bool:
    """This node leaves the world for good (its final checkpoint is durable): take it
    out of torchelastic's current round now, and stop its rendezvous heartbeat.

    Without this, the round keeps the node as a participant for as long as its
    heartbeat runs, which is as long as its agent process lives (on AWS, up to the two
    minutes until EC2 ends the instance): the staying nodes, restarting their workers,
    wait in the round's wait list that long before they re-form without it, and a
    replacement that joins meanwhile makes the world re-form at full size, never at
    the smaller one. torchrun's nodes only leave by exiting (torchelastic's own
    ``shutdown`` closes the whole rendezvous, for every node), so this runs
    torchelastic's exit operation (what ``next_rendezvous`` runs first) under the
    heartbeat's lock, as its heartbeat does. That is not public API: if its shape
    changes, the node is left to drop out when its heartbeat stops (whether it left).
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    stop = getattr(handler, "_stop_heartbeats", None)
    executor = getattr(handler, "_op_executor", None)
    exit_op = getattr(dynamic_rendezvous, "_RendezvousExitOp", None)
    if stop is None or executor is None or exit_op is None:
        log.warning("torchelastic's rendezvous handler has no exit operation here: the "
                    "other nodes drop this one when its heartbeat stops")
        return False
    stop()
    lock = getattr(handler, "_heartbeat_lock", None) or contextlib.nullcontext()
    try:
        with lock:
            executor.run(exit_op(), time.monotonic() + timeout)
    except Exception as err:
        log.warning("could not leave the rendezvous round (%s: %s): the other nodes drop "
                    "this one when its heartbeat stops", type(err).__name__, err)
        return False
    log.info("left the rendezvous round: the other nodes re-form without this one")
    return True
