"""One fold of a job's events into a :class:`JobState`.

Every reader of a job's story (its summary, the display's header and progress line, the
dashboard, records, notifications, the job listing, the providers' budget and deadline
checks) reads it from here, so they tell the same story: what the group launched and
ended, at which prices; which attempts booted on which instance, and how each ended;
the node slots and the world of a multi-node job; checkpoints, notices, the requests
spotnb made, and the job's status with its reason.

The fold is incremental: :meth:`JobState.apply` takes one event (in the order a reader
gets them: time order within a stream; a stream read late may bring older events) and
costs a few dict operations; a ``metrics`` batch costs the decoding of its columns'
last values only.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

from spotnb.protocol import billing, layout, usage
from spotnb.protocol.events import FINAL_STATES, GROUP_STREAM, Event, codec, last_values, step_span

__all__ = [
    "AttemptState",
    "Break",
    "EndReason",
    "InstanceState",
    "JobState",
    "JobStatus",
    "Launching",
    "RedoneSteps",
    "StandbyState",
    "fold",
    "replaced_attempt",
]


class JobStatus(str, enum.Enum):
    """A job's state (``spotnb.protocol.events.STATES``)."""

    SUBMITTED = "submitted"
    WAITING_FOR_CAPACITY = "waiting_for_capacity"
    LAUNCHING = "launching"
    BOOTING = "booting"
    RESTORING = "restoring"
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"
    PAUSED = "paused"
    INTERRUPTED = "interrupted"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    def __str__(self) -> str:
        return self.value

    @property
    def final(self) -> bool:
        return self.value in FINAL_STATES

    @classmethod
    def parse(cls, value: Any, default: JobStatus) -> JobStatus:
        try:
            return cls(value)
        except ValueError:
            return default


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

    @property
    def free(self) -> bool:
        """Ended, and costs nothing: EC2 interrupted it in its first hour
        (:mod:`spotnb.protocol.billing`). A running instance is billed until then."""
        return self.end is not None and billing.free_of_charge(
            self.end_reason, (self.end - self.start) * self.time_scale)


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
    # How its events said it ended, in their order (the job's end decides the rest:
    # JobState.end_reason).
    reason: EndReason = EndReason.RUNNING
    result_status: str | None = None
    noticed: bool = False  # had a spot interruption notice
    error: dict[str, Any] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # The first step it logged, and its newest (None before any metric).
    first_step: int | None = None
    last_step: int | None = None
    # When it logged its first step (None before any metric).
    first_step_time: float | None = None

    @property
    def start(self) -> float:
        return self.boot_time if self.boot_time is not None else self.first_time


@dataclasses.dataclass(frozen=True)
class Break:
    """An attempt that ended early and was followed by another: how (``reason``), when
    (its last event), the last step it logged, the step the next attempt of its node
    slot logged first, and the steps redone (None while either is unknown)."""

    attempt: int
    reason: EndReason
    time: float
    step: int | None
    resumed_at: int | None
    redone: int | None


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

    def story(self, state: JobState) -> list[tuple[float, str]]:
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


class JobState:
    """A job's events folded (module docstring). ``max_nodes``: a multi-node job's
    MAX nodes (which node slot an attempt is: ``layout.node_slot``)."""

    def __init__(self, max_nodes: int = 1) -> None:
        self.max_nodes = max(1, max_nodes)
        self.instances: dict[str, InstanceState] = {}
        # pool -> [(time, USD/hour)], in time order (launch prices and price events)
        self.prices: dict[str, list[tuple[float, float]]] = {}
        self.noticed_instances: set[str] = set()  # the group's notices
        self.terminated: set[str] = set()  # instances the group reported ended
        # The group's notices in order: (instance id, the reason it gives).
        self.group_notices: list[tuple[str, str]] = []
        # The group's rebalance recommendations in order: (time, instance id, reason).
        self.group_rebalances: list[tuple[float, str, str]] = []
        self.attempts: dict[int, AttemptState] = {}
        self.usage: dict[tuple[Any, int, str | None], dict[str, Any]] = {}
        self.worlds: list[tuple[float, int, int]] = []
        self.status = JobStatus.SUBMITTED
        self.detail = ""
        self.result: codec.Result | None = None
        self.checkpoints: list[codec.CheckpointEvent] = []  # durable ones, in order
        self.last_checkpoint: tuple[float, codec.CheckpointEvent] | None = None
        self.synced: dict[str, None] = {}  # synced directories' names, in order
        self.params: dict[str, Any] = {}  # hyperparameters, as the last attempt left them
        self.param_sources: dict[str, None] = {}
        self.notices: list[tuple[float, int, str | None]] = []  # (time, attempt, instance)
        self.launching: Launching | None = None
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.first_launch: float | None = None
        #: The job's warm standbys, by instance id, in launch order.
        self.standbys: dict[str, StandbyState] = {}
        #: A sweep's pruner stopped the job (one of its trials) early: where, and why.
        self.pruned: codec.Pruned | None = None
        #: instance id -> the time of the newest event that came from it
        self.heard: dict[str, float] = {}

    # -- input ---------------------------------------------------------------------

    def apply(self, e: Event) -> None:
        """Fold one event in."""
        t = e.time
        if self.first_time is None or t < self.first_time:
            self.first_time = t
        if self.last_time is None or t > self.last_time:
            self.last_time = t
        if e.instance is not None and t > self.heard.get(e.instance, 0.0):
            self.heard[e.instance] = t
        if codec.is_row(e):  # most of a log: no body built for each
            if e.attempt != GROUP_STREAM:
                a = self._attempt_of(e)
                a.last_time = t
                values = e.data.get("values")
                if values:
                    a.metrics.update(values)
                self._steps(a, e)
            return
        body = e.body
        if e.attempt == GROUP_STREAM:
            self._group(e, body)
        else:
            self._attempt(e, body)
        if isinstance(body, codec.Status) and not JobStatus.parse(
                body.state, JobStatus.SUBMITTED).final and body.state:
            self.status = JobStatus.parse(body.state, self.status)
            self.detail = body.detail
        elif isinstance(body, codec.Usage):
            self.usage[(body.process, e.attempt, e.instance)] = body.requests
        elif isinstance(body, codec.World):
            now = (body.nodes, body.world_size)
            self.max_nodes = max(self.max_nodes, body.max_nodes)
            # Each node reports every round: keep the changes, in time order.
            if not self.worlds or (self.worlds[-1][1:] != now and t >= self.worlds[-1][0]):
                self.worlds.append((t, *now))
        elif isinstance(body, codec.CheckpointEvent):
            if body.sync:
                if body.name:
                    self.synced[body.name] = None
            elif body.durable:
                self.checkpoints.append(body)
                self.last_checkpoint = (t, body)
        elif isinstance(body, codec.Params) and body.params is not None:
            self.params.update(body.params)
            if body.source:
                self.param_sources[body.source] = None
        elif isinstance(body, codec.Pruned):
            self.pruned = body

    def apply_all(self, events: Iterable[Event]) -> JobState:
        for e in events:
            self.apply(e)
        return self

    def _group(self, e: Event, body: codec.Body) -> None:
        if isinstance(body, codec.Instance):
            iid = body.instance_id or e.instance or ""
            if body.standby_for is not None or body.standby_ready:
                sb = self._standby(iid)
                sb.standby_for = body.standby_for or sb.standby_for
                if body.launched:
                    sb.launched = e.time
                elif body.standby_ready:
                    sb.ready, sb.kernel_started = e.time, body.kernel_started
                elif body.terminated and body.reason == "standby-given-back":
                    sb.given_back = e.time
            if body.launched and body.instance_id:
                self.instances[body.instance_id] = InstanceState(
                    instance_id=body.instance_id, start=e.time, pool=body.pool,
                    price=body.price, ondemand=body.ondemand,
                    instance_type=body.instance_type, az=body.az,
                    time_scale=body.time_scale)
                if self.first_launch is None or e.time < self.first_launch:
                    self.first_launch = e.time
                if body.price is not None:
                    self._price(body.pool, e.time, body.price)
            elif body.terminated:
                self.terminated.add(iid)
                if iid in self.instances:
                    self.instances[iid].end = e.time
                    self.instances[iid].end_reason = body.reason
            elif body.noticed:
                key = str(body.instance_id or e.instance)
                self.noticed_instances.add(key)
                self.group_notices.append((key, body.reason or ""))
            elif body.rebalance:
                self.group_rebalances.append((e.time, str(body.instance_id or e.instance),
                                              body.reason or ""))
        elif isinstance(body, codec.Price) and body.price is not None:
            self._price(body.pool, e.time, body.price)
        elif isinstance(body, codec.Status) and body.state in (
                "launching", "waiting_for_capacity") and self._room_for_launch(e.time):
            self.launching = Launching(e.time, body.state != "launching",
                                       body.instance_type, body.az)

    def _standby(self, instance_id: str) -> StandbyState:
        sb = self.standbys.get(instance_id)
        if sb is None:
            sb = self.standbys[instance_id] = StandbyState(instance_id)
        return sb

    def _price(self, pool: str, t: float, price: float) -> None:
        series = self.prices.setdefault(pool, [])
        if not series or t >= series[-1][0]:
            series.append((t, price))
        else:
            bisect.insort(series, (t, price))

    def _room_for_launch(self, t: float) -> bool:
        """Whether a launch the group reports at ``t`` is for an instance no attempt
        has booted on yet. Before any boot, no: the job's first launch is not a
        replacement (the job's status says it). A group's event older than the newest
        boot is no news either: the group's stream read after the attempts' (a follower
        gets those live), it tells of the launch that boot came from."""
        boots = [a.boot_time for a in self.attempts.values() if a.boot_time is not None]
        return bool(boots) and t >= max(boots)

    def _attempt_of(self, e: Event) -> AttemptState:
        a = self.attempts.get(e.attempt)
        if a is None:
            a = self.attempts[e.attempt] = AttemptState(
                number=e.attempt, node=layout.node_slot(e.attempt, self.max_nodes),
                first_time=e.time, last_time=e.time, first_instance=e.instance)
        return a

    def _attempt(self, e: Event, body: codec.Body) -> None:
        a = self._attempt_of(e)
        a.last_time = e.time
        if isinstance(body, codec.Metrics):
            a.metrics.update(last_values(e))
            self._steps(a, e)
        elif isinstance(body, codec.Status):
            if body.state == "booting" and a.boot_time is None:
                a.boot_time = e.time
                a.instance_id = e.instance
                a.instance_type = body.instance_type
                a.az = body.az
                self.launching = None
        elif isinstance(body, codec.Notice):
            if body.moved:  # not an interruption: the job left an at-risk instance
                a.reason = EndReason.MOVED
                a.noticed = True
            elif body.interruption:
                a.reason = EndReason.INTERRUPTED
                a.noticed = True
                self.notices.append((e.time, e.attempt, e.instance))
        elif isinstance(body, codec.Standby):
            sb = self._standby(str(e.instance))
            sb.attempt = e.attempt
            if body.phase == "took-over":
                sb.lease_at, sb.read_bytes = body.lease_at, body.read_bytes
                sb.kernel_started = sb.kernel_started or body.kernel_started
                sb.ready = sb.ready or body.ready
            elif body.phase == "restored":
                sb.restored = e.time
        elif isinstance(body, codec.Error):
            a.error = {"ename": body.ename, "evalue": body.evalue,
                       "traceback": body.traceback}
            a.reason = EndReason.ERROR_RETRIED if body.retrying else EndReason.ERROR
        elif isinstance(body, codec.Result):
            self.result = body
            if body.status is not None:
                # A status this version does not name is said as it is (end_reason).
                a.result_status = body.status
                a.reason = EndReason.__members__.get(body.status.upper(), EndReason.FAILED)

    @staticmethod
    def _steps(a: AttemptState, e: Event) -> None:
        span = step_span(e)
        if span is None:
            return
        if a.first_step is None:
            a.first_step = span[0]
            a.first_step_time = e.time
        a.last_step = span[1] if a.last_step is None else max(a.last_step, span[1])

    # -- figures -------------------------------------------------------------------

    def breaks(self, final: bool = False) -> list[Break]:
        """Each attempt that ended before the job did and was followed by another
        (interrupted, lost, or a user-code error retried), in attempt order: where it
        ended, where the next attempt that logged a step resumed, and the steps redone
        (:class:`RedoneSteps`' rule, fed with each attempt's first and furthest step in
        the order the attempts began to log: both from the same pairing). ``final``: the
        job has ended (an attempt with no word of its end is then lost)."""
        stride = self.max_nodes
        numbers = sorted(self.attempts)
        # The rule is fed the attempts in the order they began to log (those that
        # logged nothing last): in a multi-node job rank 0, the only one that logs, may
        # go from a later node slot's attempt to an earlier one's when the world
        # re-forms, so attempt numbers are not the order of the rows.
        order = sorted(numbers, key=lambda n: (self.attempts[n].first_step_time is None,
                                               self.attempts[n].first_step_time or 0.0, n))
        place = {n: i for i, n in enumerate(order)}
        redo = RedoneSteps()
        ended: list[tuple[AttemptState, EndReason]] = []
        for n in order:
            a = self.attempts[n]
            if a.first_step is not None and a.last_step is not None:
                redo.logged(place[n], a.first_step, a.last_step)
            slot = layout.node_slot(n, stride)
            later = [self.attempts[m] for m in numbers
                     if m > n and layout.node_slot(m, stride) == slot]
            reason = self.end_reason(n, final)
            if reason not in (EndReason.INTERRUPTED.value, EndReason.MOVED.value,
                              EndReason.ERROR_RETRIED.value, EndReason.LOST.value) \
                    or not later:
                continue
            redo.end(place[n])
            ended.append((a, EndReason(reason)))
        out = []
        for a, reason in sorted(ended, key=lambda pair: pair[0].number):
            count = redo.of(place[a.number])
            # Where the count was taken: in a multi-node job the next rows may come from
            # another node's attempt (the one hosting rank 0), not this slot's.
            resumed = redo.resumed_at(place[a.number])
            out.append(Break(attempt=a.number, reason=reason, time=a.last_time,
                             step=a.last_step,
                             resumed_at=None if resumed is None else int(resumed),
                             redone=None if count is None else int(count)))
        return out

    def redone_steps(self) -> int:
        """Steps logged again after the attempts that ended early (:meth:`breaks`)."""
        return sum(b.redone or 0 for b in self.breaks())

    def running_attempts(self) -> list[AttemptState]:
        """Attempts booted and not ended by their own events, their instance's end,
        or a later attempt of their node slot."""
        newest: dict[int, int] = {}
        for n in self.attempts:
            slot = layout.node_slot(n, self.max_nodes)
            newest[slot] = max(newest.get(slot, n), n)
        out = []
        for a in self.attempts.values():
            if a.boot_time is None or a.reason is not EndReason.RUNNING:
                continue
            if newest[layout.node_slot(a.number, self.max_nodes)] > a.number:
                continue
            inst = self.instances.get(a.instance_id or "")
            if inst is not None and inst.end is not None:
                continue
            out.append(a)
        return out

    def end_reason(self, number: int, final: bool, job_status: str | None = None) -> str:
        """How attempt ``number`` ended, in words: its own events' say, else, once the
        job ended or a later attempt took its node slot, "lost" (or, a multi-node job's
        node still in the world at the end, "ended with the job (STATUS)")."""
        a = self.attempts[number]
        if a.reason in (EndReason.COMPLETED, EndReason.FAILED, EndReason.STOPPED) and \
                a.result_status is not None:
            return a.result_status
        if a.reason is not EndReason.RUNNING:
            return a.reason.value
        stride = self.max_nodes
        slot = layout.node_slot(number, stride)
        replaced = any(n > number and layout.node_slot(n, stride) == slot
                       for n in self.attempts)
        if final and stride > 1 and not replaced:
            return f"{EndReason.ENDED_WITH_JOB.value} ({job_status})"
        if final or replaced:
            return EndReason.LOST.value
        return EndReason.RUNNING.value

    def metrics(self) -> dict[str, float]:
        """The newest value of each metric (a later attempt's over an earlier's)."""
        out: dict[str, float] = {}
        for n in sorted(self.attempts):
            out.update(self.attempts[n].metrics)
        return out

    def error(self) -> dict[str, Any] | None:
        """The newest attempt's error that has one."""
        out = None
        for n in sorted(self.attempts):
            if self.attempts[n].error is not None:
                out = self.attempts[n].error
        return out

    def interruptions(self) -> int:
        """Instances that had an interruption notice (the group's, or an agent's)."""
        noticed = set(self.noticed_instances)
        noticed.update(str(a.instance_id if a.boot_time is not None else a.first_instance)
                       for a in self.attempts.values() if a.reason is EndReason.INTERRUPTED)
        return len(noticed)

    def requests_usd(self) -> float:
        """spotnb's own requests at list price (the newest total of each process)."""
        return sum(usage.cost(counts) for counts in self.usage.values())

    def cost(self, end: float) -> tuple[float, float]:
        """What the instances billed until ``end`` (those still running): at the spot
        price of their pool as it changed, and at the on-demand price."""
        cost = ondemand = 0.0
        for inst in self.instances.values():
            start, stop = inst.start, inst.end or end
            cost += self.billed(inst, start, stop)
            ondemand += (inst.ondemand or 0.0) * max(0.0, stop - start) / 3600.0
        return cost, ondemand

    def cost_heard(self) -> tuple[float, float]:
        """:meth:`cost` with each running instance billed until the newest event heard
        from it, not until now: a figure that only grows as a job's events come in
        (``cost(now)`` bills a running instance to now, then gives back the time past
        its end once that end, read later, says it was earlier). Equal to ``cost`` once
        every instance has ended."""
        cost = ondemand = 0.0
        for inst in self.instances.values():
            stop = inst.end if inst.end is not None else \
                max(inst.start, self.heard.get(inst.instance_id, inst.start))
            cost += self.billed(inst, inst.start, stop)
            ondemand += (inst.ondemand or 0.0) * max(0.0, stop - inst.start) / 3600.0
        return cost, ondemand

    def billed(self, inst: InstanceState, start: float, stop: float) -> float:
        """What ``inst`` billed between ``start`` and ``stop``: its pool's spot price as
        it changed, nothing if EC2 interrupted it in its first hour."""
        if inst.free:
            return 0.0
        return integrate(self.prices.get(inst.pool, []), start, stop, inst.price or 0.0)

    def refunded(self) -> list[InstanceState]:
        """Instances EC2 interrupted in their first hour, which AWS does not charge."""
        return [i for i in self.instances.values() if i.free]

    def refunded_usd(self) -> float:
        """What the :meth:`refunded` instances ran, at their pools' spot prices: billed
        while they ran (:meth:`cost` counted it then), refunded once EC2 took them back.
        ``cost`` plus this never decreases as the job goes on."""
        return sum(integrate(self.prices.get(i.pool, []), i.start, i.end or i.start,
                             i.price or 0.0) for i in self.refunded())

    def outcome(self, status: str, reason: str) -> tuple[str, str]:
        """The job's status and reason as every view says them, given those of its
        result (or of its events): a job stopped after a sweep's pruner said so is
        ``pruned``, with the step and the metric's value (its ``pruned`` event)."""
        if status == JobStatus.STOPPED.value and self.pruned is not None:
            return "pruned", self.pruned.text
        return status, reason

    def cost_between(self, start: float, stop: float) -> float:
        """What the instances billed between ``start`` and ``stop``, at the spot price
        of their pool as it changed (the time an interruption cost, say)."""
        total = 0.0
        for inst in self.instances.values():
            lo, hi = max(start, inst.start), min(stop, inst.end or stop)
            total += self.billed(inst, lo, hi)
        return total

    def cost_usd(self, end: float) -> float:
        """What the job has cost until ``end``: its instances at the spot price, and
        spotnb's own requests (a :class:`~spotnb.client.jobs.JobResult`'s ``cost_usd``)."""
        return self.cost(end)[0] + self.requests_usd()

    def instance_cost(self, instance_id: str, end: float | None = None) -> float:
        """What one instance billed (until ``end`` while it runs), at its pool's price."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return 0.0
        stop = inst.end or end or self.last_time or inst.start
        return self.billed(inst, inst.start, stop)

    def handover_seconds(self, sb: StandbyState) -> float | None:
        """Training time a standby's takeover cost: from the last event of the attempt
        it took over from (its final save durable, the lease released) to its own
        restore done; None until both are known."""
        if sb.attempt is None or sb.restored is None:
            return None
        slot = layout.node_slot(sb.attempt, self.max_nodes)
        earlier = [n for n in self.attempts
                   if n < sb.attempt and layout.node_slot(n, self.max_nodes) == slot]
        if not earlier:
            return None
        return max(0.0, sb.restored - self.attempts[max(earlier)].last_time)

    def standbys_cost(self, end: float) -> float:
        """What the job's standbys billed while on hold: all of a standby given back,
        and of one that took over, its time before the lease was its (a standby that
        found the lease free at its start, never warming up, until its attempt's
        first event)."""
        total = 0.0
        for sb in self.standbys.values():
            inst = self.instances.get(sb.instance_id)
            if inst is None:
                continue
            ran = [a.first_time for a in self.attempts.values()
                   if a.instance_id == sb.instance_id]
            stop = sb.lease_at if sb.lease_at is not None else \
                min(ran) if ran else (inst.end or end)
            total += self.billed(inst, inst.start, stop)
        return total

    def running_instances(self) -> list[InstanceState]:
        return [i for i in self.instances.values() if i.end is None]

    def spot_price(self, inst: InstanceState) -> float:
        """The instance's spot price now (its pool's newest)."""
        series = self.prices.get(inst.pool)
        return series[-1][1] if series else (inst.price or 0.0)

    def status_now(self) -> tuple[str, str]:
        """The job's status and its reason as the events say (without result.json)."""
        return self.status.value, self.detail


def replaced_attempt(attempt: int, booted: Iterable[int], max_nodes: int) -> int | None:
    """The attempt that a boot of ``attempt`` replaces, among those ``booted`` before:
    a multi-node job's node slot's previous attempt (``max_nodes`` earlier; a node
    joining replaces none), else the newest earlier attempt that booted (None for the
    first boot)."""
    if max_nodes > 1:
        previous = attempt - max_nodes
        return previous if previous in set(booted) else None
    return max((a for a in booted if a < attempt), default=None)


class RedoneSteps:
    """The steps redone after each attempt that ended (a notice, a lost instance, an
    error retried in place): the rule, in one place, for every view that counts them.

    An ended attempt had logged up to step L; the next attempt that logs a step resumes
    at step F (the last checkpoint's): ``L - F + 1`` steps are redone, 0 when F > L.
    Rows of the ended attempt read late (a follower gets an ended attempt's last rows
    from the log after the next attempt's live ones) raise L, and the count with it.
    An attempt in between that logged nothing is passed over. A view may know more
    (``moved``: the points it moved aside as redone); the count is the larger.
    The views feed it on their hot path, so each call is a few dict operations."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}  # attempt -> the first step it logged
        self.last: dict[int, float] = {}  # attempt -> the furthest step it logged
        self._redone: dict[int, int | None] = {}  # ended attempts -> steps, once known

    def end(self, attempt: int) -> None:
        """``attempt`` ended: its steps past the next attempt's first are redone."""
        self._redone.setdefault(attempt, None)

    def of(self, attempt: int) -> int | None:
        """Steps redone after ``attempt`` (None until the next attempt logs)."""
        return self._redone.get(attempt)

    def total(self) -> int:
        return sum(n or 0 for n in self._redone.values())

    def resumed_at(self, attempt: int) -> float | None:
        """The first step of the attempt that the count after ``attempt`` is taken
        against: the next attempt that logged (None until one has)."""
        later = [b for b in self.first if b > attempt]
        return self.first[min(later)] if later else None

    def logged(self, attempt: int, first: float, furthest: float,
               moved: int = 0) -> int | None:
        """``attempt`` logged rows: ``first``, the first of them in log order, and
        ``furthest``, the largest step among them. Returns the ended attempt whose
        count this set or changed, if any (at most one)."""
        changed = None
        if attempt not in self.first:
            self.first[attempt] = first
            for earlier in sorted((a for a in self._redone if a < attempt), reverse=True):
                last = self.last.get(earlier)
                if self._redone[earlier] is None and last is not None:
                    self._redone[earlier] = max(moved, int(last - first + 1)
                                                if last >= first else 0)
                    changed = earlier
                    break
        last = self.last.get(attempt)
        self.last[attempt] = furthest if last is None else max(last, furthest)
        count = self._redone.get(attempt)
        if count is not None:  # late rows of an ended attempt
            later = [b for b in self.first if b > attempt]
            if later:
                self._redone[attempt] = max(
                    count, int(self.last[attempt] - self.first[min(later)] + 1))
                changed = attempt
        return changed


def fold(events: Iterable[Event], max_nodes: int = 1) -> JobState:
    """``events`` folded into a new :class:`JobState`."""
    return JobState(max_nodes).apply_all(events)


def integrate(series: list[tuple[float, float]], start: float, stop: float,
              initial: float) -> float:
    """USD for [start, stop] under a step function of USD/hour changes (time order)."""
    if stop <= start:
        return 0.0
    total, price, t = 0.0, initial, start
    for when, value in series:
        if when <= start:
            price = value
            continue
        if when >= stop:
            break
        total += price * (when - t)
        price, t = value, when
    total += price * (stop - t)
    return total / 3600.0
