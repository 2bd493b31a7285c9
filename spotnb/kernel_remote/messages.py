"""What the agent does with each message of the runtime (:mod:`channel`'s ops).

:class:`RuntimeMessages` parses a message into its typed class
(:func:`channel.parse`) and hands it to the handler of its op (:attr:`RuntimeMessages.
table`: every op of :data:`channel.TO_AGENT`, none else); an op the agent does not know
is answered with an ``error`` message. Most ops become events in the attempt's log;
``fence``, ``unlogged`` and ``mark`` are questions the agent answers, ``parked`` and
``reform`` change the attempt.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.kernel_remote import channel
from spotnb.kernel_remote.replay import record_carry
from spotnb.protocol.events import EventWriter

if TYPE_CHECKING:
    from spotnb.kernel_remote.cells import CellRunner
    from spotnb.kernel_remote.channel_server import ChannelServer
    from spotnb.kernel_remote.leasing import LeaseKeeper
    from spotnb.kernel_remote.rows import RowRelay
    from spotnb.protocol.events.live import LiveSender
    from spotnb.protocol.lease import HeldLease
    from spotnb.protocol.notify import Notifier
    from spotnb.protocol.store import Store

log = logging.getLogger(__name__)

#: A handler of a message from the runtime: (the event writer, the message, the
#: connection it came on, for a reply).
Handler = Callable[[EventWriter, Any, "socket.socket | None"], object]

# A checkpoint carries the events of these types that the log has not confirmed (the
# cell's output, earlier saves, rows an earlier replay recorded...), so a later attempt
# records what this agent dies with (DESIGN invariant 8). Metric batches are carried
# by the runtime itself (its rows); GPU samples and statuses are not worth it.
CARRIED_TYPES = frozenset({"stream", "checkpoint", "metric", "params", "progress", "warning"})
# How long a checkpoint's question for those events waits for the runtime's mark on the
# kernel's output channel (everything printed before the save has arrived by then).
OUTPUT_MARK_SECONDS = 5.0


class Agent(Protocol):
    """What the handlers use of the agent (:class:`spotnb.kernel_remote.agent.Agent`)."""

    store: Store
    events: EventWriter | None
    lease: LeaseKeeper
    live: LiveSender | None
    node: Any
    notifier: Notifier
    parked: threading.Event
    rows: RowRelay
    server: ChannelServer
    cells: CellRunner
    warm: Any  # spotnb.kernel_remote.standby.Standby, while a standby's attempt restores

    @property
    def held(self) -> HeldLease | None: ...

    @property
    def notice(self) -> dict[str, Any] | None: ...

    def done_with_lease(self) -> None: ...

    def report_usage(self) -> None: ...


class RuntimeMessages:
    """The agent's table of op to handler (module docstring)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        #: The handler of each op the agent accepts.
        self.table: dict[str, Handler] = self._table()

    def handle(self, msg: dict[str, Any], conn: socket.socket | None = None) -> None:
        """A message from the runtime, handled through :attr:`table` (by its op); an
        op the agent does not know is answered with an ``error`` message (on ``conn``,
        or to every runtime)."""
        try:
            message = channel.parse(msg)
        except channel.UnknownOp as err:
            log.warning("unknown message from the runtime: %s", err.op)
            self.agent.server.reply(conn, channel.Error(about=err.op, error=(
                f"the spotnb agent does not know the op {err.op!r} (a runtime of another "
                "spotnb version?)")))
            return
        ev = self.agent.events
        if ev is None:
            return
        if not isinstance(message, channel.Metrics):
            # Anything else comes after the rows sent before it.
            self.agent.rows.emit()
        self.table[message.op](ev, message, conn)

    def _table(self) -> dict[str, Handler]:
        """The handler of each op of :data:`channel.TO_AGENT`."""
        return {
            channel.Hello.op: lambda ev, m, conn: None,
            channel.Metrics.op: self._on_metrics,
            channel.CheckpointPhase.op: self._on_checkpoint,
            channel.Restored.op: self._on_restored,
            channel.Sync.op: lambda ev, m, conn: ev.emit("checkpoint", **m.event_data()),
            channel.Usage.op: lambda ev, m, conn: ev.emit("usage", process="runtime",
                                                          requests=m.requests),
            channel.Replay.op: lambda ev, m, conn: record_carry(
                self.agent.store, self.agent.lease, m.attempt, m.rows, m.events,
                m.checkpoint, m.saved),
            channel.Unlogged.op: self._on_unlogged,
            channel.Fence.op: self._on_fence,
            channel.Mark.op: self._on_mark,
            channel.Parked.op: self._on_parked,
            channel.Reform.op: self._on_reform,
            channel.Caution.op: lambda ev, m, conn: ev.emit("warning", kind=m.kind,
                                                            text=m.text),
            channel.Params.op: lambda ev, m, conn: ev.emit("params", **m.event_data()),
            channel.Progress.op: self._on_progress,
        }

    def _on_metrics(self, ev: EventWriter, msg: channel.Metrics,
                    conn: socket.socket | None) -> None:
        # Rows are gathered into one `metrics` event a second (the live channel's
        # pace): a day of logging is ~86,000 events, whatever the rate of spot.log.
        full = self.agent.rows.add(msg.rows)
        self.agent.notifier.saw_metrics(msg.rows)
        if full:
            self.agent.rows.emit()

    def _on_checkpoint(self, ev: EventWriter, msg: channel.CheckpointPhase,
                       conn: socket.socket | None) -> None:
        ev.emit("checkpoint", **msg.event_data())
        if msg.phase == "begin":
            ev.emit("status", state="checkpointing",
                    detail=f"saving a checkpoint at step {msg.step}")
        else:
            if not self.agent.notice:
                ev.emit("status", state="running", detail="running the cell")
            if msg.phase == "failed" or msg.forced or msg.join:
                ev.flush_soon()  # a periodic save waits for the next flush

    def _on_restored(self, ev: EventWriter, msg: channel.Restored,
                     conn: socket.socket | None) -> None:
        ev.emit("status", state="running",
                detail=f"restored checkpoint of step {msg.step} "
                       f"in {msg.seconds or 0:.1f}s")
        if self.agent.node is not None and msg.step is not None:
            self.agent.node.on_restored(msg.step)
        warm, self.agent.warm = self.agent.warm, None
        if warm is not None:  # a standby's: the handover is done (said once: a
            # distributed node's every worker restores)
            ev.emit("standby", phase="restored", step=msg.step, seconds=msg.seconds)
            self.agent.notifier.handed_over(ev.attempt)
        ev.flush_soon()

    def _on_unlogged(self, ev: EventWriter, msg: channel.Unlogged,
                     conn: socket.socket | None) -> None:
        # A checkpoint being saved asks for the events the log has not confirmed
        # (after its mark on the kernel's output: every line printed before the
        # save is among them): it carries them.
        mark = msg.mark
        if mark and not self.agent.cells.wait_for_output(mark, OUTPUT_MARK_SECONDS):
            log.warning("the kernel's output mark did not arrive within %g s; "
                        "a checkpoint carries the output relayed so far",
                        OUTPUT_MARK_SECONDS)
        lines, following = ev.unwritten(CARRIED_TYPES)
        self.agent.server.reply(conn, channel.UnloggedReply(id=msg.id, events=lines,
                                                            next=following))

    def _on_fence(self, ev: EventWriter, msg: channel.Fence,
                  conn: socket.socket | None) -> None:
        # The runtime asks before it moves LATEST or writes the outputs.
        ok, unknown = self.agent.lease.standing()
        self.agent.server.reply(conn, channel.FenceReply(id=msg.id, ok=ok, unknown=unknown))

    def _on_mark(self, ev: EventWriter, msg: channel.Mark,
                 conn: socket.socket | None) -> None:
        self.agent.cells.saw_mark(msg.token)

    def _on_parked(self, ev: EventWriter, msg: channel.Parked,
                   conn: socket.socket | None) -> None:
        # The save forced by the notice is durable: steps after it would only be
        # redone. Let the replacement start now rather than after the lease's TTL.
        if self.agent.parked.is_set():
            return  # another local worker of this node said so first
        self.agent.parked.set()
        ev.emit("status", state="interrupted",
                detail=f"final checkpoint at step {msg.step} is durable; "
                       "waiting for the instance to be terminated")
        self.agent.report_usage()
        if self.agent.live is not None:
            self.agent.live.send_now()
        if self.agent.held is not None:
            self.agent.done_with_lease()
        if self.agent.node is not None:
            self.agent.node.on_parked()

    def _on_reform(self, ev: EventWriter, msg: channel.Reform,
                   conn: socket.socket | None) -> None:
        # A node of the world leaves after the coordinated checkpoint (or one waits
        # to join): re-form (torchelastic restarts this node's workers).
        if msg.join:
            saved = (f"the checkpoint of step {msg.step} is durable"
                     if msg.step is not None else
                     "no checkpoint to save (the cell has made none yet)")
            ev.emit("status", state="restoring", detail=(
                f"{saved}; re-forming the world with the node that waits to join"))
        else:
            ev.emit("status", state="restoring", detail=(
                f"a node leaves after the checkpoint of step {msg.step}; "
                "re-forming the world without it"))
        if self.agent.node is not None:
            self.agent.node.on_reform(msg.step, join=msg.join)

    def _on_progress(self, ev: EventWriter, msg: channel.Progress,
                     conn: socket.socket | None) -> None:
        ev.emit("progress", total=msg.total, source=msg.source)
        self.agent.notifier.saw_total(msg.total)
