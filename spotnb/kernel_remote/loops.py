"""The agent's two loops, alongside the attempt (:mod:`spotnb.kernel_remote.agent`).

The *instance loop* (every :data:`IMDS_POLL_SECONDS`, no remote call but IMDS) watches
IMDS for ``spot/instance-action`` and the rebalance recommendation
(:func:`~spotnb.kernel_remote.watch.relay_notices`), pings the runtime (a kernel whose
agent stops answering stops itself), tells the runtime which metric rows are durable
in the log, and keeps the kernel running only while the lease is confirmed: an
unconfirmed lease (a frozen agent, a store out of reach) pauses it, a lost one kills
it. The *store loop* renews the lease every :func:`lease.heartbeat_seconds`, looks for
a stop request and reports the requests the agent made; store errors there are retried
with backoff, never fatal.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.kernel_remote import channel, watch
from spotnb.kernel_remote.rows import ROWS_SECONDS
from spotnb.protocol import layout
from spotnb.protocol.lease import Standing

if TYPE_CHECKING:
    from spotnb.kernel_remote.leasing import LeaseKeeper
    from spotnb.kernel_remote.rows import RowRelay
    from spotnb.protocol.events.live import LiveSender
    from spotnb.protocol.store import Store

__all__ = ["IMDS_POLL_SECONDS", "STOP_POLL_SECONDS", "USAGE_SECONDS", "instance_loop",
           "store_loop"]

log = logging.getLogger(__name__)

# How often the instance loop looks at IMDS, pings the runtime and checks the lease's
# standing. IMDS is on the instance: free. EC2 gives two minutes of notice; half a
# second leaves the runtime the most time.
IMDS_POLL_SECONDS = 0.5
# How often the store loop reads control/stop.json (a GET: 60/h = $0.000024/h). A stop
# also arrives at once as a message on the job's control queue; the object is the
# record, read here in case the message was lost. A distributed job's agents also look
# for a result another node wrote (one more request each time).
STOP_POLL_SECONDS = 60.0
# How often the agent reports the requests it made (a `usage` event; the cost a job
# shows includes them).
USAGE_SECONDS = 300.0


class Agent(watch.Agent, Protocol):
    """What the loops use of the agent (:class:`spotnb.kernel_remote.agent.Agent`):
    what :func:`~spotnb.kernel_remote.watch.relay_notices` uses, and more."""

    store: Store
    live: LiveSender | None
    lease: LeaseKeeper
    rows: RowRelay
    notices: watch.NoticeWatcher
    stops: watch.StopWatcher
    parked: threading.Event
    done: threading.Event

    @property
    def fenced(self) -> threading.Event: ...

    @property
    def stop_requested(self) -> dict[str, Any] | None: ...

    def report_usage(self) -> None: ...

    def on_stop(self, request: dict[str, Any]) -> None: ...


# -- the instance loop: IMDS, pings, rows, the kernel's pause ---------------------------

def instance_loop(agent: Agent) -> None:
    """IMDS, pings, durable-row acknowledgements, and the kernel's pause/resume:
    everything that needs no store request, every IMDS_POLL_SECONDS."""
    pace = IMDS_POLL_SECONDS if agent.live is None else min(IMDS_POLL_SECONDS,
                                                            agent.live.cadence)
    while not agent.done.wait(pace):
        try:
            watch.relay_notices(agent, *agent.notices.poll())
            _ping(agent)
            pace = ROWS_SECONDS if agent.live is None else agent.live.cadence
            if agent.rows.due(pace):
                agent.rows.emit()
            _acknowledge_rows(agent)
            _mind_kernel(agent)
        except Exception:
            log.exception("the instance loop failed; going on")


def _ping(agent: Agent) -> None:
    """Tell the kernels this agent is alive, and until when (on the host's
    :func:`spotnb.protocol.lease.clock`) its lease counts as held if no renewal lands: a
    kernel whose agent falls silent stops itself by then, before another agent may
    take the job over whatever the TTL (the session's watchdog)."""
    agent.send(channel.Ping(until=agent.lease.held_until()))


def _acknowledge_rows(agent: Agent) -> None:
    """Tell the runtime up to which time its metric rows are durable in the log, so
    it keeps only the rest (a checkpoint carries those: spotnb.train.runtime)."""
    newest = agent.rows.durable()
    if newest is not None:
        agent.send(channel.Durable(t=newest))


def _mind_kernel(agent: Agent) -> None:
    """Keep the kernel running only while the lease is confirmed.

    UNCONFIRMED (no successful renewal for the TTL less the safety margin: the store
    is out of reach, or this agent was frozen): pause the kernel, so nothing trains
    that no agent can record. HELD again: resume it (also a kernel that stopped
    itself when this agent stopped answering). LOST: fence off.
    """
    held, kernels = agent.held, agent.kernels.all()
    if held is None or not kernels or agent.parked.is_set():
        return
    standing = held.status()
    if standing is Standing.LOST:
        if not agent.fenced.is_set():
            agent.lease.fence_off()
    elif standing is Standing.UNCONFIRMED:
        if agent.paused_since is None:
            agent.paused_since = time.time()
            for kernel in kernels:
                kernel.pause()
            log.warning("the lease was not confirmed for %.0f s: the kernel is paused "
                        "until it is", held.confirmed_age())
            agent.emit("status", state="paused", detail=(
                "paused: the job's lease could not be confirmed in the store (store "
                "unavailable?); training resumes when it is"))
            agent.flush_soon()
    else:
        if agent.paused_since is not None:
            paused = time.time() - agent.paused_since
            agent.paused_since = None
            agent.emit("status", state="running",
                       detail=f"the lease is confirmed again; resumed after {paused:.0f} s")
        for kernel in kernels:
            if kernel.stopped:
                log.warning("the kernel was stopped (its agent did not answer); "
                            "resuming it")
                kernel.resume()


# -- the store loop: the heartbeat, the stop request, usage -----------------------------

def store_loop(agent: Agent) -> None:
    """The lease's heartbeat and the stop request: the agent's store requests that
    repeat. A failure is retried sooner, with backoff, and never ends the loop."""
    heartbeat = agent.lease.heartbeat()
    next_stop = time.monotonic() + STOP_POLL_SECONDS
    next_usage = time.monotonic() + USAGE_SECONDS
    while not agent.done.wait(
            max(0.05, min(heartbeat.due, next_stop, next_usage) - time.monotonic())):
        now = time.monotonic()
        if not heartbeat.beat(now):
            return
        if now >= next_stop and agent.stop_requested is None:
            next_stop = now + STOP_POLL_SECONDS
            _watch_stop(agent)
        if now >= next_usage:
            next_usage = now + USAGE_SECONDS
            agent.report_usage()


def _watch_stop(agent: Agent) -> None:
    """The stop request in the store; in a distributed job, a result another node
    wrote."""
    node = agent.node
    if node is not None and not node.ended.is_set():
        try:
            if agent.store.exists(layout.RESULT):
                node.on_job_ended()  # another node wrote it (a failure, the end)
        except Exception:
            log.debug("looking for the result failed", exc_info=True)
    request = agent.stops.read()
    if request is not None:
        agent.on_stop(request)
