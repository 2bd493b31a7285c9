"""When EC2 wants a local-cloud instance back: the interruption and signal model of the
local cloud's capacity group (:mod:`.group`, which acts on what this says: it publishes
the recommendation, gives the notice, ends the instance).

Interruptions: on request (``LocalProvider.interrupt``: reason ``requested``; of one
named instance, or of the first running one not yet under notice; every request read in
a tick is its own notice); the spec's ``simulate_interruptions`` ``{"count": N}`` (reason
``simulated``: once an instance's attempt has a durable checkpoint and any later event,
or after ``interrupt_after`` seconds after the first output of a cell without any
checkpoint; see :meth:`Interruptions.simulated_due`) or ``{"schedule": [s, ...]}``
(reason ``scheduled``, seconds since the first launch); the market price rising above
``max_price`` (``price``); and the Spot Advisor's interruption rate (``hazard``).

Rebalance recommendations (:mod:`spotnb.protocol.signals`: the job's ``simulate_signals``
or the model's defaults): for each interruption the group knows ahead (``hazard``,
``scheduled``, ``price``), one ``lead`` before its notice (market seconds over
``time_scale``; no earlier than the instance's launch) or none (``no_recommendation``);
false alarms, recommendations no notice follows, at ``false_alarms_per_interruption``
times the instance's Spot Advisor rate (with ``hazard``) and the schedule's rate over
its span, and at the model's ``false_alarms`` times; an interruption nobody could know
ahead (``requested``, ``simulated``) brings its recommendation with its notice, as
EC2's sometimes does. Each is published at the instance's metadata service and logged
as an ``instance`` event with action ``rebalance`` and the reason it stands for
(``false-alarm`` for a false alarm). Recommendations on request
(``LocalProvider.recommend``: reason ``requested``, no notice follows) come at the next
tick, for tests that must aim them at a moment.

Every draw has its own generator, named by what it is for: the same seed gives the same
draws whatever order the ticks meet them in.
"""

from __future__ import annotations

import logging
import random
import secrets

from spotnb.protocol.events import GROUP_STREAM, Event, codec
from spotnb.protocol.events.fold import JobState
from spotnb.protocol.events.live import Follower
from spotnb.protocol.signals import SignalModel
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store
from spotnb.providers import catalog
from spotnb.providers.catalog import Pool
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.state import Settings

__all__ = ["FORESEEN", "Interruptions"]

log = logging.getLogger(__name__)

# The Spot Advisor's buckets are "per month"; its month is taken as 30 days.
MONTH_SECONDS = 30 * 86400.0
# simulate_interruptions={"count": N}, for a cell that saves no checkpoint and shows
# nothing yet (still importing, loading data): wait this many times interrupt_after.
QUIET_CELL_FACTOR = 3
# The interruptions the group knows ahead (their recommendation can come earlier).
FORESEEN = ("hazard", "scheduled", "price")
# Simulated interruptions follow the job's log this often (the local queue is free).
FOLLOW_SECONDS = 0.5


class Interruptions:
    """The interruptions and signals of one job's instances (see the module docstring):
    which are due at a tick, for the group to act on. ``first_launch``: the group's
    first launch, from which the schedule and the fixed false alarms count."""

    def __init__(self, spec: JobSpec, settings: Settings, store: Store) -> None:
        self.spec = spec
        self.settings = settings
        self.store = store
        sim = spec.simulate_interruptions or {}
        self.sim_count = int(sim.get("count", 0))
        self.sim_done = 0
        self.schedule = sorted(float(s) for s in sim.get("schedule", ()))
        self.schedule_next = 0
        # The instances an interruption was asked for and not yet given (every request
        # counts: two in one tick are two notices, to two instances).
        self.requested: list[str] = []
        # Simulated interruptions wait for progress after a checkpoint: follow the job
        # live, as a notebook would.
        self.reader = (Follower(store, spec.job_id, batches=True,
                                quiet_log_seconds=FOLLOW_SECONDS)
                       if self.sim_count else None)
        # The group bills the checkpoint's transfer between regions from the same read
        # of the log (:mod:`.pools`): then the reader stays after the simulations.
        self.keep_following = False
        seed = settings.seed
        self.rng = random.Random(f"{seed}:{spec.job_id}") if seed is not None else random.Random()
        self.signals = SignalModel.from_dict(spec.simulate_signals)
        signal_seed = self.signals.seed or settings.seed
        self.signal_seed = (f"{signal_seed}:{spec.job_id}" if signal_seed is not None
                            else secrets.token_hex(8))
        self.recommended: set[tuple[str, int]] = set()  # interruptions recommended for
        self.signal_leads: dict[tuple[str, int], float | None] = {}
        self.false_alarm_rngs: dict[int, random.Random] = {}  # by instance index
        times = list(self.signals.false_alarms)
        if self.schedule and self.schedule[-1] > 0:
            # A scheduled rate of interruptions brings its false alarms over its span.
            rng = self._signal_rng("schedule-false-alarms")
            rate = len(self.schedule) / self.schedule[-1]
            t = 0.0
            while (gap := self.signals.false_alarm_gap(rng, rate)) is not None and \
                    (t := t + gap) < self.schedule[-1]:
                times.append(t)
        self.false_alarm_times = sorted(times)
        self.false_alarm_next = 0

    def _signal_rng(self, name: str) -> random.Random:
        return random.Random(f"{self.signal_seed}:{name}")

    # ----------------------------------------------------------- a new supervisor

    def resume(self, history: JobState, first_launch: float | None, now: float) -> None:
        """Carry on after a supervisor of the job that died, from what its stream says:
        simulated and scheduled interruptions already served, false alarms passed."""
        reasons = [reason for _instance, reason in history.group_notices]
        self.sim_done = min(self.sim_count, reasons.count("simulated"))
        self.schedule_next = min(len(self.schedule), reasons.count("scheduled"))
        self.recommended.update(("scheduled", i) for i in range(self.schedule_next))
        if first_launch is not None:
            self.false_alarm_next = sum(1 for t in self.false_alarm_times
                                        if first_launch + t <= now)
        if self.sim_done >= self.sim_count:
            self.stop_following()

    def adopted(self, inst: LocalInstance, now: float) -> None:
        """An instance a new supervisor took over: what its recommendation stood for is
        lost (none is given again for it); its signals planned anew."""
        if inst.rebalance_at is not None:
            self.recommended.update({("hazard", inst.index), ("price", inst.index)})
        self.plan(inst, now)

    # -------------------------------------------------------------- at the launch

    def hazard_time(self, pool: Pool, now: float) -> float | None:
        """When the Spot Advisor's interruption rate takes an instance launched now in
        ``pool`` (or None).

        The bucket's upper bound (``<5%`` -> 5, ``>20%`` -> 100) is read as interruptions
        per month, a constant hazard rate in market time, hence ``time_scale`` faster in
        real time.
        """
        rate = self.hazard_rate(pool)
        return now + self.rng.expovariate(rate) if rate else None

    def hazard_rate(self, pool: Pool) -> float:
        """Interruptions per real second at the pool's Spot Advisor rate (0 without
        ``hazard`` or a bucket)."""
        if not self.settings.hazard:
            return 0.0
        bucket = catalog.interruption_bucket(pool.instance_type, pool.region)
        if bucket is None:
            return 0.0
        return bucket.max_pct / 100.0 / MONTH_SECONDS * self.settings.time_scale

    def plan(self, inst: LocalInstance, now: float) -> None:
        """What of an instance's signals is known at its launch: its first drawn false
        alarm, and when the market takes it back at ``max_price``."""
        rng = self.false_alarm_rngs[inst.index] = self._signal_rng(f"false-alarm:{inst.index}")
        gap = self.signals.false_alarm_gap(rng, self.hazard_rate(inst.pool))
        inst.next_false_alarm = None if gap is None else now + gap
        max_price = self.spec.resources.max_price
        if max_price is not None:
            inst.price_risk_at = inst.market.next_above(now, max_price)

    # ------------------------------------------------------------------ each tick

    def first_uninterrupted(self, running: list[LocalInstance]) -> str | None:
        """An interruption of "the first running" instance: the first one that is not
        under notice and not already asked for (else the first running; None if none
        runs)."""
        for inst in running:
            if inst.terminate_at is None and inst.id not in self.requested:
                return inst.id
        return running[0].id if running else None

    def foreseen(self, inst: LocalInstance, first_launch: float | None,
                 first: str | None) -> list[tuple[str, int, float]]:
        """The interruptions of ``inst`` the group knows ahead: (reason, the draw's
        number, the notice's wall time). ``first``: the first uninterrupted instance,
        which the schedule's interruptions are for."""
        found = []
        if inst.hazard_at is not None:
            found.append(("hazard", inst.index, inst.hazard_at))
        if inst.price_risk_at is not None:
            found.append(("price", inst.index, inst.price_risk_at))
        if (self.schedule_next < len(self.schedule) and first_launch is not None
                and inst.id == first):
            found.append(("scheduled", self.schedule_next,
                          first_launch + self.schedule[self.schedule_next]))
        return found

    def recommendations_due(self, inst: LocalInstance, now: float,
                            first_launch: float | None, first: str | None) -> list[str]:
        """The reasons of the recommendations for ``inst`` due now (each given once):
        the lead of an interruption known ahead, a drawn false alarm, a fixed one."""
        due = []
        for reason, number, notice_at in self.foreseen(inst, first_launch, first):
            key = (reason, number)
            if key in self.recommended:
                continue
            if key not in self.signal_leads:
                lead = self.signals.draw(self._signal_rng(f"{reason}:{number}"))
                self.signal_leads[key] = (None if lead is None
                                          else lead / self.settings.time_scale)
            lead = self.signal_leads[key]
            if lead is not None and now >= notice_at - lead:
                self.recommended.add(key)
                due.append(reason)
        if inst.next_false_alarm is not None and now >= inst.next_false_alarm:
            gap = self.signals.false_alarm_gap(self.false_alarm_rngs[inst.index],
                                               self.hazard_rate(inst.pool))
            inst.next_false_alarm = None if gap is None else now + gap
            due.append("false-alarm")
        if (self.false_alarm_next < len(self.false_alarm_times) and first_launch
                is not None and now >= first_launch
                + self.false_alarm_times[self.false_alarm_next] and inst.id == first):
            self.false_alarm_next += 1
            due.append("false-alarm")
        return due

    def notice_due(self, inst: LocalInstance, now: float,
                   first_launch: float | None) -> str | None:
        """The reason of the interruption of ``inst`` due now, if one is (counted as
        given: the group gives its notice)."""
        if inst.id in self.requested:
            self.withdraw(inst.id)
            return "requested"
        max_price = self.spec.resources.max_price
        if max_price is not None and inst.price > max_price:
            return "price"
        if (self.schedule_next < len(self.schedule) and first_launch is not None
                and now >= first_launch + self.schedule[self.schedule_next]):
            self.schedule_next += 1
            return "scheduled"
        if self.sim_done < self.sim_count and self.simulated_due(inst, now):
            self.sim_done += 1
            return "simulated"
        if inst.hazard_at is not None and now >= inst.hazard_at:
            return "hazard"
        return None

    def withdraw(self, instance_id: str) -> None:
        """Requests to interrupt ``instance_id`` are void (it is under notice already,
        or winding down)."""
        self.requested = [i for i in self.requested if i != instance_id]

    def moved(self, inst: LocalInstance, first_launch: float | None,
              first: str | None) -> None:
        """The job moved off ``inst`` to its standby: an interruption the schedule
        foresaw for it (its recommendation came) leaves with it."""
        for reason, number, _ in self.foreseen(inst, first_launch, first):
            if reason == "scheduled" and (reason, number) in self.recommended:
                self.schedule_next = max(self.schedule_next, number + 1)

    def simulated_due(self, inst: LocalInstance, now: float) -> bool:
        """Whether to interrupt ``inst`` for ``simulate_interruptions={"count": N}``.

        Step 1: after the attempt's first durable checkpoint, at its next sign of life
        (output, a metric, a CPU sample: about a second), or ``interrupt_after`` seconds
        after the checkpoint. Not only after a metric: a cell need not call spot.log.
        Step 2: an attempt without a checkpoint, ``interrupt_after`` seconds after the
        cell's first output or metric (its imports and data loading are then done: on
        a busy machine they alone can take longer than that), or
        :data:`QUIET_CELL_FACTOR` times as long after the cell started, if it shows
        nothing. Never counted from the instance's start: a slow boot is not the cell's.
        Both are the events' own times: the simulated interruption comes that long
        after the cell showed something, however late the supervisor read of it.
        """
        limit = self.settings.interrupt_after
        if inst.durable_at is not None:
            return inst.progressed or now - inst.durable_at >= limit
        if inst.first_output is not None:
            return now - inst.first_output >= limit
        return inst.cell_started is not None and \
            now - inst.cell_started >= QUIET_CELL_FACTOR * limit

    def follow(self) -> None:
        """Read the job's log from now on (from its start), whether or not a simulated
        interruption is left: the group bills the checkpoint's transfer from it."""
        self.keep_following = True
        if self.reader is None:
            self.reader = Follower(self.store, self.spec.job_id, batches=True,
                                   quiet_log_seconds=FOLLOW_SECONDS)

    def track_progress(self, instances: list[LocalInstance]) -> list[Event]:
        """Watch each instance's attempt: its cell's start, its first durable checkpoint,
        and any event after that (one read of the log for all of them). Returns every
        event read, for the group's transfer metering (:meth:`follow`)."""
        if self.reader is None:
            return []
        by_id = {inst.id: inst for inst in instances}
        events = self.reader.poll(wait=0)
        for event in events:
            if self.sim_done >= self.sim_count:
                break  # nothing left to simulate: the events are the metering's only
            inst = by_id.get(event.instance or "")
            if inst is None or event.attempt == GROUP_STREAM:
                continue
            body = codec.peek(event)
            if (isinstance(body, codec.Status) and body.state == "running"
                    and inst.cell_started is None):
                inst.cell_started = event.time
            if codec.is_output(event) and inst.first_output is None:
                inst.first_output = event.time
            if (isinstance(body, codec.CheckpointEvent) and body.durable
                    and inst.durable_at is None):
                inst.durable_at = event.time
            elif inst.durable_at is not None and event.time > inst.durable_at:
                inst.progressed = True
        if self.sim_done >= self.sim_count and not self.keep_following:
            self.stop_following()  # nothing left to simulate or bill: stop reading the log
        return events

    def stop_following(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.close()
