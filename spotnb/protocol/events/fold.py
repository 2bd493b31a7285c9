"""One fold of a job's events into a :class:`JobState`.

Every reader of a job's story (its summary, the display's header and progress line, the
dashboard and its markers, records, comparisons, sweeps, notifications, the job listing,
the providers' budget and deadline checks) reads it from here, so they tell the same
story: what the group launched and ended, at which prices (the one price source) and in
which region (the group's region choices: where it started, each move, and the
checkpoint's transfers between regions, in the cost); which
attempts booted on which instance, and how each ended (:class:`EndReason`); where the
job broke off and what that cost (:class:`Break`: steps redone, time and money); the
current step, the total and the pace (:mod:`spotnb.protocol.events.steps`); the node
slots and the world of a multi-node job, and the nodes that joined it; checkpoints,
notices, the requests spotnb made; and the job's status with its reason
(:class:`~spotnb.protocol.events.JobStatus`), which is final once the job's result is.
A view keeps no ledger of its own: it asks the fold.

The fold is incremental: :meth:`JobState.apply` takes one event (in the order a reader
gets them: time order within a stream; a stream read late may bring older events) and
costs a few dict operations; a ``metrics`` batch costs the decoding of its columns'
first and last values only (:mod:`~spotnb.protocol.events.steps` says when more).
"""

from __future__ import annotations

import bisect
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, Event, JobStatus, codec, expand, last_values
from spotnb.protocol.events.attempts import Attempts, replaced_attempt
from spotnb.protocol.events.money import Money, integrate, savings_pct
from spotnb.protocol.events.parts import (
    AttemptState,
    Break,
    EndReason,
    InstanceState,
    Join,
    Launching,
    PoolState,
    StandbyState,
)
from spotnb.protocol.events.steps import Steps

__all__ = [
    "AttemptState",
    "Break",
    "EndReason",
    "InstanceState",
    "JobState",
    "JobStatus",
    "Join",
    "Launching",
    "PoolState",
    "StandbyState",
    "fold",
    "integrate",
    "replaced_attempt",
    "savings_pct",
]


class JobState(Attempts, Money):
    """A job's events folded (module docstring). ``max_nodes``: a multi-node job's
    MAX nodes (which node slot an attempt is: ``layout.node_slot``). What it says of
    its attempts and their ends is :class:`Attempts`'; of its money, :class:`Money`'s."""

    def __init__(self, max_nodes: int = 1) -> None:
        self.max_nodes = max(1, max_nodes)
        self.instances: dict[str, InstanceState] = {}
        #: Each pool's spot price as it changed, with its on-demand price and where the
        #: prices come from; ``prices[pool]`` is ``pools[pool].series``.
        self.pools: dict[str, PoolState] = {}
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
        self._world_reports: list[tuple[float, int, int]] = []
        #: Nodes that joined a multi-node job's world, in order.
        self.joins: list[Join] = []
        #: The job's status and its reason: final (``is_terminal``) once its result is.
        self.status = JobStatus.SUBMITTED
        self.detail = ""
        self._status_attempt = 0  # the newest attempt whose status the job's is
        self.result: codec.Result | None = None  # the first result: the job's end
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
        #: The metric rows' steps: segments, redone steps, current step, total, pace.
        self.steps = Steps(scan=self.max_nodes > 1)
        #: A sweep's pruner stopped the job (one of its trials) early: where, and why.
        self.pruned: codec.Pruned | None = None
        #: instance id -> the time of the newest event that came from it
        self.heard: dict[str, float] = {}
        #: The group's region choices in time order: where it launched from then on,
        #: and why (the start's choice, each move to another region).
        self.regions: list[tuple[float, codec.Region]] = []
        #: Checkpoint bytes that crossed regions, by key (each counted once).
        self.transfers: dict[str, codec.Transfer] = {}
        #: Events applied so far: a view that caches what it computes from the fold
        #: keys its cache on this.
        self.changes = 0

    # -- input ---------------------------------------------------------------------

    def apply(self, e: Event) -> None:
        """Fold one event in."""
        self.changes += 1
        t = t_last = e.time
        row = codec.is_row(e)
        if (row or codec.is_batch(e)) and e.attempt != GROUP_STREAM:
            span = self.steps.add(e)  # the rows' own times (a batch's: its earliest, latest)
            if span is None and not row:  # a damaged batch: what its rows say
                for each in expand(e):
                    self.apply(each)
                return
            t, t_last = span or (t, t)
        if self.first_time is None or t < self.first_time:
            self.first_time = t
        if self.last_time is None or t_last > self.last_time:
            self.last_time = t_last
        if e.instance is not None and t_last > self.heard.get(e.instance, 0.0):
            self.heard[e.instance] = t_last
        if row or codec.is_batch(e):  # most of a log: no body built for a row
            if e.attempt != GROUP_STREAM:
                a = self._attempt_of(e)
                a.last_time = max(a.last_time, t_last)
                values = e.data.get("values") if row else last_values(e)
                if values:
                    a.metrics.update(values)
                seg = self.steps.last_segment(e.attempt)
                if seg is not None:
                    if a.first_step is None:
                        a.first_step = seg.first_step
                    a.last_step = seg.furthest if a.last_step is None else \
                        max(a.last_step, seg.furthest)
            return
        body = e.body
        if e.attempt == GROUP_STREAM:
            self._group(e, body)
        else:
            self._attempt(e, body)
        if isinstance(body, codec.Status):
            self._status(e, body)
        elif isinstance(body, codec.Result):
            if self.result is None:  # the first result is the job's (result.json's)
                self.result = body
                self.status = JobStatus.parse(body.status, JobStatus.FAILED) or \
                    JobStatus.FAILED
                self.detail = body.reason
                self._pruned()
        elif isinstance(body, codec.ProgressTotal):
            if body.total:
                self.steps.total, self.steps.total_source = body.total, body.source
        elif isinstance(body, codec.Usage):
            self.usage[(body.process, e.attempt, e.instance)] = body.requests
        elif isinstance(body, codec.World):
            now = (body.nodes, body.world_size)
            self.max_nodes = max(self.max_nodes, body.max_nodes)
            self.steps.scan = self.steps.scan or self.max_nodes > 1
            self._world_reported(t, now)
        elif isinstance(body, codec.Joined):
            self.joins.append(Join(e, e.attempt, body.nodes, body.world_size,
                                   body.saved_step, body.step, self.steps.started,
                                   self.steps.taken))
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
            self._pruned()

    def apply_all(self, events: Iterable[Event]) -> JobState:
        for e in events:
            self.apply(e)
        return self

    def _status(self, e: Event, body: codec.Status) -> None:
        """The job's status: the newest attempt's say; the group's own (waiting for
        capacity, launching a replacement) before any attempt's or after an
        interruption; final from the result (or the ending attempt's closing status),
        and then never again changed."""
        state = JobStatus.parse(body.state)
        if state is None or self.status.is_terminal:
            return
        if e.attempt == GROUP_STREAM:
            if state.is_terminal:
                return  # the group stopping the job: its result says the end
            if self._status_attempt and self.status is not JobStatus.INTERRUPTED:
                return
        elif e.attempt < self._status_attempt:
            return
        else:
            self._status_attempt = e.attempt
        self.status, self.detail = state, body.detail
        self._pruned()

    def _world_reported(self, t: float, now: tuple[int, int]) -> None:
        """Each node reports every round, and a node's stream may be read after a newer
        round's report from another (a live follower reads them as they come): every
        report kept in time order, the worlds are its changes."""
        report = (t, *now)
        if self._world_reports and t >= self._world_reports[-1][0]:
            self._world_reports.append(report)  # the usual order: in time
            if self.worlds[-1][1:] != now:
                self.worlds.append(report)
            return
        bisect.insort(self._world_reports, report)
        self.worlds = [r for i, r in enumerate(self._world_reports)
                       if not i or self._world_reports[i - 1][1:] != r[1:]]

    def _pruned(self) -> None:
        """A job stopped after a sweep's pruner said so (its ``pruned`` event, read
        before or after the stop) is ``pruned``, with the step and the metric's value."""
        if self.status is JobStatus.STOPPED and self.pruned is not None:
            self.status, self.detail = JobStatus.PRUNED, self.pruned.text

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
                    time_scale=body.time_scale, region=body.region)
                if self.first_launch is None or e.time < self.first_launch:
                    self.first_launch = e.time
                self._price(body.pool, e.time, body.price, body.ondemand)
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
        elif isinstance(body, codec.Price):
            pool = self._price(body.pool, e.time, body.price, body.ondemand)
            if pool is not None:
                self._price_source(pool, e.time, body)
        elif isinstance(body, codec.Region) and body.region:
            bisect.insort(self.regions, (e.time, body), key=lambda item: item[0])
        elif isinstance(body, codec.Transfer) and body.key:
            self.transfers[body.key] = body
        elif isinstance(body, codec.Status) and body.state in (
                "launching", "waiting_for_capacity") and self._room_for_launch(e.time):
            self.launching = Launching(e.time, body.state != "launching",
                                       body.instance_type, body.az)

    def _standby(self, instance_id: str) -> StandbyState:
        sb = self.standbys.get(instance_id)
        if sb is None:
            sb = self.standbys[instance_id] = StandbyState(instance_id)
        return sb

    def _price(self, name: str, t: float, price: float | None,
               ondemand: float | None) -> PoolState | None:
        if not name:
            return None
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = PoolState(name)
            self.prices[name] = pool.series
        if ondemand:
            pool.ondemand = ondemand
        if price is not None:
            series = pool.series
            if not series or t >= series[-1][0]:
                series.append((t, price))
            else:
                bisect.insort(series, (t, price))
        return pool

    @staticmethod
    def _price_source(pool: PoolState, t: float, body: codec.Price) -> None:
        if body.source:
            pool.history = body.source
        if body.history_time and pool.replay_from is None:
            try:
                replayed = datetime.datetime.fromisoformat(body.history_time)
            except ValueError:
                return
            pool.replay_wall, pool.replay_from = t, replayed.timestamp()
            pool.replay_scale = body.history_scale or 1.0

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
        a.last_time = max(a.last_time, e.time)
        if isinstance(body, codec.Status):
            if body.state == "booting" and a.boot_time is None:
                a.boot_time = e.time
                a.instance_id = e.instance
                a.instance_type = body.instance_type
                a.az = body.az
                inst = self.instances.get(e.instance or "")
                a.region = body.region or (inst.region if inst is not None else None)
                self.launching = None
        elif isinstance(body, codec.Notice) and body.interruption:
            # A move is not an interruption: the job left an at-risk instance.
            a.reason = EndReason.MOVED if body.moved else EndReason.INTERRUPTED
            if not a.noticed:
                a.noticed, a.notice_time, a.notice_action = True, e.time, body.action
            if not body.moved:
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
        elif isinstance(body, codec.Result) and body.status is not None:
            # A status this version does not name is said as it is (end_reason).
            a.result_status = body.status
            a.reason = EndReason.__members__.get(body.status.upper(), EndReason.FAILED)

    # -- the job's status ------------------------------------------------------------

    @property
    def final(self) -> bool:
        """Whether the job has ended (its result is in the log)."""
        return self.status.is_terminal

    @staticmethod
    def outcome_reads_log(result: Mapping[str, Any] | None) -> bool:
        """Whether :meth:`outcome` of ``result`` (``result.json``) needs the log folded:
        there is no result yet, or it says ``stopped``, which a sweep's ``pruned`` event
        makes ``pruned``. Any other result says the outcome on its own (an empty
        :class:`JobState` gives it), which spares a reader the log."""
        return result is None or not result.get("status") or \
            str(result["status"]) == JobStatus.STOPPED.value

    def outcome(self, result: Mapping[str, Any] | None = None) -> tuple[str, str]:
        """The job's status and reason as every view says them: ``result.json``'s
        (``result``: the job's own word, written first) where there is one, else the
        log's (a result the log holds, else the newest status). A status this version
        does not name is said as it is. A job stopped after a sweep's pruner said so
        (its ``pruned`` event) is ``pruned``, with the step and the metric's value."""
        if result is not None and result.get("status"):
            status, reason = str(result["status"]), str(result.get("reason", ""))
        elif self.result is not None and self.result.status:
            status, reason = self.result.status, self.result.reason
        else:
            return self.status.value, self.detail
        if status == JobStatus.STOPPED.value and self.pruned is not None:
            return JobStatus.PRUNED.value, self.pruned.text
        return status, reason

    def current_attempt(self) -> AttemptState | None:
        """The newest attempt that booted (the job runs, or last ran, on it)."""
        booted = [n for n, a in self.attempts.items() if a.boot_time is not None]
        return self.attempts[max(booted)] if booted else None

    # -- regions ---------------------------------------------------------------------

    def region_choice(self, number: int) -> codec.Region | None:
        """Why attempt ``number`` runs in its region: the group's newest region choice
        (the start's, or a move) after the attempt it follows (its node slot's
        previous one) booted and before it booted itself; None when there was none
        (it runs where that one ran)."""
        a = self.attempts.get(number)
        if a is None or a.boot_time is None:
            return None
        booted = [m.boot_time for m in self.attempts.values() if m.number < number
                  and m.node == a.node and m.boot_time is not None]
        after = max(booted, default=float("-inf"))
        found = [body for t, body in self.regions if after < t <= a.boot_time]
        return found[-1] if found else None


def fold(events: Iterable[Event], max_nodes: int = 1) -> JobState:
    """``events`` folded into a new :class:`JobState`."""
    return JobState(max_nodes).apply_all(events)
