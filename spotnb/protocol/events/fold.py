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
from spotnb.protocol.events.steps import Segment, Steps

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


class JobState(Money):
    """A job's events folded (module docstring). ``max_nodes``: a multi-node job's
    MAX nodes (which node slot an attempt is: ``layout.node_slot``)."""

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

    # -- attempts and their ends -----------------------------------------------------

    def end_reason(self, number: int, final: bool | None = None,
                   job_status: str | None = None) -> str:
        """How attempt ``number`` ended, in words: its own events' say, else, once the
        job ended (``final``; default: the fold's status) or a later attempt took its
        node slot, "lost" (or, a multi-node job's node still in the world at the end,
        "ended with the job (STATUS)")."""
        final = self.final if final is None else final
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
            status = job_status or self.outcome()[0]
            return f"{EndReason.ENDED_WITH_JOB.value} ({status})"
        if final or replaced:
            return EndReason.LOST.value
        return EndReason.RUNNING.value

    def breaks(self, final: bool | None = None) -> list[Break]:
        """Each attempt that ended before the job did and was followed by another of
        its node slot (interrupted, lost, moved to its standby, or a user-code error
        retried), in attempt order: how and when it ended, the last step it logged, the
        step the training went on from and the steps redone (where the segment after
        its last began: :mod:`~spotnb.protocol.events.steps`), and the time it took.
        ``final``: the job has ended (default: the fold's status; an attempt with no
        word of its end is then lost)."""
        stride = self.max_nodes
        out = []
        for n in sorted(self.attempts):
            said = self.end_reason(n, final)
            reason = next((r for r in EndReason if r.value == said), None)
            if reason is None or not reason.early:
                continue
            slot = layout.node_slot(n, stride)
            if not any(m > n and layout.node_slot(m, stride) == slot for m in self.attempts):
                continue
            a = self.attempts[n]
            seg = self.steps.last_segment(n)
            after = self.steps.after(seg) if seg is not None else None
            lost_from, recovered = self._lost(a, seg, after)
            out.append(Break(attempt=n, reason=reason, time=a.last_time,
                             step=None if seg is None else seg.furthest,
                             resumed_at=None if after is None else after.first_step,
                             redone=None if after is None else after.redone,
                             lost_from=lost_from, recovered=recovered))
        return out

    def _lost(self, a: AttemptState, seg: Segment | None, after: Segment | None
              ) -> tuple[float | None, float | None]:
        """When the training stopped making progress at ``a``'s end, and when it passed
        where it had been (:class:`Break`)."""
        if seg is not None:
            return seg.furthest_time, None if after is None else after.passed
        if self.max_nodes > 1:
            # A node that never logged (only global rank 0 does): what losing it cost
            # is where the training went back (the segment after, its own window).
            return None, None
        segments = self.steps.segments
        if any(s.first_time <= a.last_time and s.last_time >= a.start for s in segments):
            return None, None  # others logged meanwhile (a peer node): no time of its own
        later = next((s for s in segments if s.first_time > a.start), None)
        return a.start, None if later is None else later.first_time

    def redone_steps(self) -> int:
        """Steps run again over the job: after every break, and wherever a multi-node
        job's training went back within an attempt (a peer lost, a node joined)."""
        return self.steps.redone()

    def interruptions(self, final: bool | None = None) -> int:
        """Instances the job was interrupted on: those that had an interruption notice
        (the group's, or an agent's), and those lost under it without one (an attempt
        that a later one of its node slot replaced with no word of its end)."""
        noticed = set(self.noticed_instances)
        noticed.update(str(a.instance) for a in self.attempts.values()
                       if a.reason is EndReason.INTERRUPTED)
        noticed.update(str(self.attempts[b.attempt].instance) for b in self.breaks(final)
                       if b.reason is EndReason.LOST)
        return len(noticed)

    def lost_windows(self, now: float) -> list[tuple[float, float]]:
        """The spans the job made no new progress in because of its breaks (each
        :class:`Break`'s, and each time a multi-node job's training went back within an
        attempt), merged where they overlap; one not caught up with runs until ``now``."""
        spans = [w for b in self.breaks() if (w := b.window(now)) is not None]
        spans += [w for s in self.steps.segments
                  if s.went_back and (w := s.window(now)) is not None]
        merged: list[tuple[float, float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def lost_seconds(self, now: float) -> float:
        """Wall-clock seconds the breaks took (:meth:`lost_windows`)."""
        return sum(end - start for start, end in self.lost_windows(now))

    def lost_usd(self, now: float) -> tuple[float, float]:
        """What the instances billed while the breaks took their time
        (:meth:`lost_windows`): at the spot price, and at the on-demand price."""
        spot = ondemand = 0.0
        for start, end in self.lost_windows(now):
            for inst in self.instances.values():
                lo, hi = max(start, inst.start), min(end, inst.end or now)
                if hi <= lo:
                    continue
                spot += self.billed(inst, lo, hi)
                ondemand += (inst.ondemand or 0.0) * (hi - lo) / 3600.0
        return spot, ondemand

    def resumed(self, attempt: int) -> Segment | None:
        """The first segment of rows ``attempt`` logged after a break (its window and
        steps redone are the break's), or None: it logged nothing yet, or what it
        logged follows no earlier rows."""
        seg = next((s for s in self.steps.segments if s.attempt == attempt), None)
        return seg if seg is not None and seg.previous is not None else None

    def join_redone(self, join: Join) -> int | None:
        """Steps redone where the world re-formed around nodes that joined: the steps
        the training went back where it went on after the join (0 if it went on past
        the save, or the job ended first); None until it went on."""
        after = min((s for s in self.steps.segments if s.serial >= join.started),
                    key=lambda s: s.serial, default=None)
        if after is not None:
            return after.redone or 0
        if self.steps.taken > join.taken or self.final:
            return 0
        return None

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

    def handover_seconds(self, sb: StandbyState) -> float | None:
        """How long a standby's takeover took: from the last event of the attempt it
        took over from (its final save durable, the lease released: that attempt's
        :attr:`Break.time`) to its own restore done; None until both are known. (The
        time the break cost the job's training is the break's own window.)"""
        if sb.attempt is None or sb.restored is None:
            return None
        slot = layout.node_slot(sb.attempt, self.max_nodes)
        earlier = [n for n in self.attempts
                   if n < sb.attempt and layout.node_slot(n, self.max_nodes) == slot]
        if not earlier:
            return None
        return max(0.0, sb.restored - self.attempts[max(earlier)].last_time)


def replaced_attempt(attempt: int, booted: Iterable[int], max_nodes: int) -> int | None:
    """The attempt that a boot of ``attempt`` replaces, among those ``booted`` before:
    a multi-node job's node slot's previous attempt (``max_nodes`` earlier; a node
    joining replaces none), else the newest earlier attempt that booted (None for the
    first boot)."""
    if max_nodes > 1:
        previous = attempt - max_nodes
        return previous if previous in set(booted) else None
    return max((a for a in booted if a < attempt), default=None)


def fold(events: Iterable[Event], max_nodes: int = 1) -> JobState:
    """``events`` folded into a new :class:`JobState`."""
    return JobState(max_nodes).apply_all(events)
