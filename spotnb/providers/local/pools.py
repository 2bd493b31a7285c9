"""Where the local cloud's capacity group launches an instance, and at what price.

Pools are tried in the group's region (:mod:`.failover`: the job's region with the
lowest expected cost among those with capacity, chosen at the first launch and said in a
``region`` event), in the spec's order of instance types, cheapest AZ first (at the
current market price; a multi-node job's in the AZ of its nodes still running). A pool
without simulated capacity (the local cloud's settings, read again at every launch:
shortages may be switched on and off while a job runs), or above ``max_price``, is
skipped with a ``capacity_error`` event, said once per wait; the group (:mod:`.group`)
retries when no pool can launch, and after ``MOVE_AFTER_FAILED_ROUNDS`` such rounds in a
row moves to the job's next region (a multi-node job only while it cannot train: its
nodes left behind get a notice, ``region-move``, and the new region's launches wait
until they are gone: :meth:`Pools.leaving`). The checkpoint's crossings between regions
are billed from the job's log (``transfer`` events). Each pool's market replays real
price history from the group's first start, across supervisors (:mod:`.market`). A
launch is logged as EC2 and Auto Scaling would show it: ``status`` launching, ``instance``
launched (with its prices), ``price``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, Event, codec
from spotnb.protocol.events.fold import JobState
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import Store
from spotnb.providers.catalog import Pool
from spotnb.providers.failover import REGION_MOVE, RegionPlan, TransferMeter
from spotnb.providers.local.imds import iso_utc
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.interruptions import Interruptions
from spotnb.providers.local.market import Market
from spotnb.providers.local.state import Settings, az_name

__all__ = ["Pools"]

log = logging.getLogger(__name__)


class Emit(Protocol):
    """The group's writer of its own events (:meth:`.group.Supervisor.emit`)."""

    def __call__(self, type: str, instance: str | None, at: float | None = None,
                 **data: Any) -> None: ...


class Pools:
    """The job's pools and their markets (see the module docstring). ``started``: the
    group's first start, from which the markets replay."""

    def __init__(self, spec: JobSpec, settings: Settings, store: Store, started: float,
                 interruptions: Interruptions, emit: Emit) -> None:
        self.spec = spec
        self.settings = settings
        self.store = store
        self.started = started
        self.interruptions = interruptions
        self.emit = emit
        self.markets: dict[str, Market] = {}
        self.reported: set[str] = set()  # pools whose capacity error this wait said
        # The settings of the newest launch (capacity shortages may be switched on and
        # off while the job runs); the group's region; the checkpoint's transfer
        # between regions (:mod:`.failover`), billed once the job leaves home.
        self.launch_settings = settings
        self.plan = RegionPlan(spec, self.has_capacity)
        self.meter = TransferMeter(spec.resources.region)

    def market(self, pool: Pool) -> Market:
        market = self.markets.get(pool.name)
        if market is None:
            market = Market(pool, self.started, self.settings.time_scale, seed=self.spec.job_id)
            self.markets[pool.name] = market
        return market

    def candidates(self, now: float, running: list[LocalInstance],
                   target: int) -> list[Pool]:
        """Pools in launch order, in the group's region (chosen at the first launch):
        the spec's types in order, cheapest AZ first right now; a multi-node job's
        (``target`` nodes) in the AZ of its nodes ``running`` there (all of them in one
        region and AZ)."""
        if self.plan.region is None:
            self._region(self.plan.start(self.checkpoint_bytes()), now)
        az = None
        if target > 1:
            az = next((i.pool.az for i in running if i.pool.region == self.plan.region),
                      None)
        return self.plan.pools(lambda p: self.market(p).price_at(now), az)

    def launch(self, now: float, index: int, running: list[LocalInstance], target: int,
               standby_for: str | None = None) -> LocalInstance | None:
        """Start the group's ``index``-th instance in the first pool that can take it
        (``target``: the job's nodes: a later index is a replacement; ``running``: the
        group's instances now); None if none can. ``standby_for``: a warm standby for
        that instance (logged as such)."""
        try:  # capacity shortages may be switched on and off while the job runs
            settings = self.launch_settings = Settings.load()
        except SpecError as e:
            log.warning("keeping the previous local cloud settings: %s", e)
            settings = self.launch_settings
        max_price = self.spec.resources.max_price
        for pool in self.candidates(now, running, target):
            price = self.market(pool).price_at(now)
            if max_price is not None and price > max_price:
                self._capacity_error(pool, now, "SpotMaxPriceTooLow", (
                    f"Your Spot request price of {max_price} is lower than the minimum "
                    f"required Spot request fulfillment price of {price}."))
            elif not self.has_capacity(pool.instance_type, pool.az):
                self._capacity_error(pool, now, "InsufficientInstanceCapacity", (
                    f"We currently do not have sufficient {pool.instance_type} capacity in "
                    f"the Availability Zone you requested ({az_name(pool.region, pool.az)})."))
            else:
                self.plan.launched()
                return self._start(pool, now, settings, index, target, standby_for)
        return None

    def has_capacity(self, instance_type: str, az: str) -> bool:
        """The simulated capacity of a pool now (the settings of the newest launch, at
        the group's age: a shortage may be over, ``no_capacity_seconds``)."""
        return self.launch_settings.has_capacity(instance_type, az,
                                                 since_start=time.time() - self.started)

    # ------------------------------------------------------------------ regions

    def failed_round(self, now: float, running: list[LocalInstance]) -> bool:
        """A launch round found no capacity: whether the group moved to another region
        (:meth:`move`: a job below its minimum of nodes moves; one that trains stays)."""
        if self.plan.failed() and len(running) < self.spec.resources.min_nodes:
            return self.move(now, running)
        return False

    def move(self, now: float, running: list[LocalInstance]) -> bool:
        """Repeated launch rounds found no capacity in the group's region: move to the
        next (:mod:`.failover`); False when no other region offers the job's types (it
        retries here). The nodes still there (fewer than the job's minimum: it does not
        train) get a notice: they save and go, and the launches in the new region
        follow (:meth:`leaving`)."""
        choice = self.plan.move(self.checkpoint_bytes())
        if choice is None:
            return False
        self._region(choice, now)
        self.reported.clear()
        for inst in running:
            if inst.terminate_at is None:
                inst.notice(now, self.settings.notice_seconds, REGION_MOVE)
                self.emit("instance", inst.id, action="notice", reason=REGION_MOVE,
                          **inst.describe(), notice_time=iso_utc(now),
                          termination_time=iso_utc(inst.terminate_at or now),
                          price=inst.price)
        return True

    def leaving(self, running: list[LocalInstance]) -> bool:
        """Whether nodes of a region the group left are still going (their notice
        runs): the launches in its new region wait, so that the job's nodes are never
        in two regions at once."""
        return any(i.pool.region != self.plan.region for i in running)

    def checkpoint_bytes(self) -> int | None:
        """The size of the job's newest checkpoint (None without one), which a move's
        ranking counts the restore of."""
        from spotnb.ckpt.checkpoints import CHECKPOINT_FORMATS, CheckpointStore

        try:
            newest = CheckpointStore(self.store, prefix=layout.CHECKPOINTS,
                                     keep=self.spec.policy.keep_checkpoints,
                                     formats=CHECKPOINT_FORMATS).latest()
        except Exception as err:  # a damaged checkpoint: ranked as if of unknown size
            log.warning("cannot read the newest checkpoint's size: %s", err)
            return None
        return None if newest is None else newest.total_bytes

    def _region(self, choice: codec.Region, now: float) -> None:
        """The group launches in ``choice.region`` from now on: say so and why; bill
        the checkpoint's transfer once it is away from home."""
        self.emit("region", None, at=now, **dataclasses.asdict(choice))
        if choice.region != self.plan.home:
            self.interruptions.follow()

    def bill(self, events: Iterable[Event], instances: list[LocalInstance]) -> None:
        """The checkpoint's crossings between regions in ``events`` (the job's log as
        the group reads it), as ``transfer`` events, once the job left home."""
        if not self.interruptions.keep_following:
            return
        regions = {inst.id: inst.pool.region for inst in instances}
        for event in events:
            if event.attempt != GROUP_STREAM:
                for crossing in self.meter.see(event, regions):
                    self.emit("transfer", None, at=event.time,
                              **dataclasses.asdict(crossing))

    def resume(self, history: JobState, adopted: list[LocalInstance]) -> None:
        """A new supervisor carries on in the region its predecessor chose (that of
        the instances it adopted), with the transfers it billed."""
        self.meter.counted.update(history.transfers)
        self.plan.resume([choice for _t, choice in history.regions])
        for inst in adopted:
            self.plan.resume_in(inst.pool.region)
        if self.plan.region not in (None, self.plan.home):
            self.interruptions.follow()

    def _capacity_error(self, pool: Pool, now: float, code: str, message: str) -> None:
        if pool.name in self.reported:
            return  # reported once per wait; the retries would only repeat it
        if not self.reported:
            self.emit("status", None, at=now, state="waiting_for_capacity",
                      detail=f"no spot capacity in {pool.name} ({code}); trying other pools")
        self.reported.add(pool.name)
        log.info("cannot launch in %s: %s", pool.name, code)
        self.emit("instance", None, at=now, action="capacity_error", reason=code,
                  detail=message, instance_id=None, instance_type=pool.instance_type,
                  az=pool.az, region=pool.region, pool=pool.name)

    def _start(self, pool: Pool, now: float, settings: Settings, index: int, target: int,
               standby_for: str | None) -> LocalInstance:
        inst = LocalInstance.create(
            pool, self.market(pool), index=index, now=now,
            boot_seconds=settings.boot_seconds,
            hazard_at=self.interruptions.hazard_time(pool, now),
            job_id=self.spec.job_id, store_uri=self.store.uri)
        self.interruptions.plan(inst, now)
        self.reported.clear()
        replacing = f" (replacement #{index - target})" if index > target else ""
        if standby_for is not None:
            replacing = f" (standby for {standby_for}: rebalance recommendation)"
        extra = {} if standby_for is None else {"standby_for": standby_for}
        # Stamped with the tick's time, like the capacity errors before them: schedules
        # and budgets count from it, and readers see the events in this order.
        self.emit("status", None, at=now, state="launching", instance_type=pool.instance_type,
                  az=pool.az, detail=f"launching {pool.instance_type} in {pool.az}{replacing}")
        self.emit("instance", inst.id, at=now, action="launched", **inst.describe(),
                  price=inst.price, ondemand=pool.ondemand, region=pool.region,
                  az_name=az_name(pool.region, pool.az), time_scale=inst.market.time_scale,
                  **extra)
        self.emit_price(inst)
        log.info("launched %s in %s at $%.4f/h; %s", inst.id, pool.name, inst.price,
                 inst.market.source)
        return inst

    def emit_price(self, inst: LocalInstance) -> None:
        """A ``price`` event of ``inst``'s pool now, with the history it replays."""
        now = time.time()
        # Which real prices these are: the history's source and the moment replayed.
        replayed = datetime.datetime.fromtimestamp(inst.market.history_time(now),
                                                   datetime.timezone.utc)
        self.emit("price", inst.id, at=now, pool=inst.pool.name,
                  instance_type=inst.pool.instance_type, az=inst.pool.az, price=inst.price,
                  ondemand=inst.pool.ondemand, price_source=inst.market.source,
                  history_time=replayed.isoformat(timespec="seconds"),
                  history_scale=inst.market.time_scale)
