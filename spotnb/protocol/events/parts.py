"""The parts of a job's fold (:class:`~spotnb.protocol.events.fold.JobState`): its
instances and pools, its attempts and how each ended, its early ends (:class:`Break`),
its warm standbys, the nodes that joined a multi-node job's world, and the launch
under way. Plain records: the fold fills them, every view reads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.protocol import billing

if TYPE_CHECKING:
    from spotnb.protocol.events import Event

__all__ = ["AttemptState", "Break", "EndReason", "InstanceState", "Join", "Launching",
           "PoolState", "StandbyFigures", "StandbyState"]


class EndReason(str, enum.Enum):
    """How an attempt ended (``RUNNING`` while it runs)."""

    RUNNING = "running"
    INTERRUPTED = "interrupted"  # a spot interruption notice
    MOVED = "moved to its standby"  # the group ended it: its warm standby took over
    ERROR_RETRIED = "error (retried)"
    ERROR = "error"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"
    ENDED_WITH_JOB = "ended with the job"  # a multi-node job's node when the job ended
    LOST = "lost"  # the instance went away without a notice

    def __str__(self) -> str:
        return self.value

    @property
    def early(self) -> bool:
        """An end before the job's, after which another attempt goes on."""
        return self in (EndReason.INTERRUPTED, EndReason.MOVED, EndReason.ERROR_RETRIED,
                        EndReason.LOST)

    @property
    def interruption(self) -> bool:
        """The instance went away under the job: a notice, or lost without one (a move
        to a warm standby is none, nor an error in the cell)."""
        return self in (EndReason.INTERRUPTED, EndReason.LOST)


@dataclasses.dataclass
class InstanceState:
    """An instance the group launched (its stream's ``instance`` events)."""

    instance_id: str
    start: float
    pool: str = ""
    price: float | None = None
    ondemand: float | None = None
    instance_type: str | None = None
    az: str | None = None
    end: float | None = None
    end_reason: str | None = None
    time_scale: float = 1.0  # market seconds a real second (the local cloud's)
    region: str | None = None  # where it ran (its launch's)

    @property
    def free(self) -> bool:
        """Ended, and costs nothing: EC2 interrupted it in its first hour
        (:mod:`spotnb.protocol.billing`). A running instance is billed until then."""
        return self.end is not None and billing.free_of_charge(
            self.end_reason, (self.end - self.start) * self.time_scale)


@dataclasses.dataclass
class PoolState:
    """A pool's spot price while the job ran there (the one price source of the
    cost, the headers and the figures): a step function, ``series`` in time order
    (``JobState.prices[pool]``); its on-demand price; where the prices come from
    (``history``: the local cloud replays a stretch of real price history, AWS says
    live), and for a replay, the real moment shown at wall time ``replay_wall`` and
    how many real seconds pass per wall second."""

    pool: str
    series: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    ondemand: float | None = None
    history: str = ""
    replay_wall: float | None = None
    replay_from: float | None = None
    replay_scale: float = 1.0

    @property
    def times(self) -> list[float]:
        return [t for t, _ in self.series]

    @property
    def prices(self) -> list[float]:
        return [p for _, p in self.series]

    @property
    def price(self) -> float | None:
        """The newest spot price (USD/hour)."""
        return self.series[-1][1] if self.series else None

    def history_dates(self, end: float) -> str:
        """The span of real history replayed up to wall time ``end``, as
        ``2020-01-12 14:00-16:10 UTC`` ("" when the prices are live)."""
        if self.replay_from is None or self.replay_wall is None:
            return ""

        def utc(t: float) -> str:
            return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
                "%Y-%m-%d %H:%M")

        a = utc(self.replay_from)
        b = utc(self.replay_from + max(0.0, end - self.replay_wall) * self.replay_scale)
        if a[:10] == b[:10]:
            return f"{a}-{b[11:]} UTC" if a != b else f"{a} UTC"
        return f"{a} - {b} UTC"


@dataclasses.dataclass
class AttemptState:
    """One attempt: its stream's events, folded."""

    number: int
    node: int
    first_time: float
    last_time: float
    first_instance: str | None
    boot_time: float | None = None
    instance_id: str | None = None
    instance_type: str | None = None
    az: str | None = None
    region: str | None = None  # its instance's, as its boot said
    # How its events said it ended, in their order (the job's end decides the rest:
    # JobState.end_reason).
    reason: EndReason = EndReason.RUNNING
    result_status: str | None = None
    noticed: bool = False  # had a spot interruption notice
    notice_time: float | None = None  # when (the agent's notice event)
    notice_action: str | None = None  # what EC2 said it would do (terminate, stop, ...)
    error: dict[str, Any] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # The first step it logged, and its newest (None before any metric).
    first_step: int | None = None
    last_step: int | None = None

    @property
    def start(self) -> float:
        return self.boot_time if self.boot_time is not None else self.first_time

    @property
    def instance(self) -> str | None:
        """The instance it ran on (the one it booted on, else its first event's)."""
        return self.instance_id if self.boot_time is not None else self.first_instance


@dataclasses.dataclass(frozen=True)
class Break:
    """An attempt that ended early and was followed by another: how (``reason``), when
    (its last event), the last step it logged (None: none), the step the training went
    on from (``resumed_at``: the next segment's first, whichever attempt logged it), the
    steps redone (None while either is unknown), and the time it took: from
    ``lost_from`` (the last row at its furthest step, or, a single node's attempt that
    logged none, its start) until the job logged a step beyond it (``recovered``; None:
    not yet). A multi-node job's node that logged nothing has no time of its own: the
    training going back where it was lost is the segment's (its window)."""

    attempt: int
    reason: EndReason
    time: float
    step: int | None
    resumed_at: int | None
    redone: int | None
    lost_from: float | None = None
    recovered: float | None = None

    def window(self, now: float) -> tuple[float, float] | None:
        """The span it took (until ``now`` while the job has not caught up)."""
        if self.lost_from is None:
            return None
        end = self.recovered if self.recovered is not None else now
        return (self.lost_from, end) if end > self.lost_from else None


@dataclasses.dataclass
class Join:
    """Nodes joined a multi-node job's world (its ``joined`` event): who, the world, the
    step saved before re-forming and the one restored; the steps redone are the fold's
    (:meth:`~spotnb.protocol.events.fold.JobState.join_redone`)."""

    event: Event
    attempt: int
    nodes: tuple[int, ...]
    world_size: int
    saved_step: int | None
    step: int
    #: The fold's segments started and runs of rows taken before it (what came after
    #: it in the rows' stream, whatever their own times: a runtime logs its first rows
    #: after the restore before its agent writes this event).
    started: int = 0
    taken: int = 0


class StandbyFigures(Protocol):
    """What a standby's story reads of the fold (a
    :class:`~spotnb.protocol.events.fold.JobState`)."""

    def handover_seconds(self, sb: StandbyState) -> float | None: ...

    def instance_cost(self, instance_id: str, end: float | None = None) -> float: ...


@dataclasses.dataclass
class StandbyState:
    """A warm standby (spotnb.kernel_remote.standby): launched on a rebalance
    recommendation of ``standby_for``; ready once its kernel waited at the cell's
    restore point; then either given back (not ready in time) or the job's next attempt
    (``attempt``), whose training went on at ``restored``."""

    instance_id: str
    standby_for: str | None = None
    launched: float | None = None
    kernel_started: float | None = None
    ready: float | None = None
    given_back: float | None = None
    attempt: int | None = None
    lease_at: float | None = None
    restored: float | None = None
    read_bytes: int = 0

    def story(self, state: StandbyFigures) -> list[tuple[float, str]]:
        """What happened to it, in words, with the time of each (the dashboard's and
        the notifications' lines)."""
        out: list[tuple[float, str]] = []
        if self.launched is not None:
            out.append((self.launched, "rebalance recommendation: standby booting"))
        if self.ready is not None:
            out.append((self.ready, "standby ready"))
        handover = state.handover_seconds(self)
        if handover is not None and self.restored is not None:
            out.append((self.restored, f"handed over in {handover:.1f} s"))
        if self.given_back is not None:
            out.append((self.given_back, "standby given back (not ready in time): "
                        f"${state.instance_cost(self.instance_id):.3f}"))
        return out


@dataclasses.dataclass(frozen=True)
class Launching:
    """The group launching (or waiting for capacity for) an instance no attempt has
    booted on yet."""

    time: float
    waiting: bool
    instance_type: str | None
    az: str | None
