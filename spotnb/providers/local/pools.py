"""Where the local cloud's capacity group launches an instance, and at what price.

Pools are tried in the spec's order of instance types, cheapest AZ first (at the current
market price). A pool without simulated capacity (the local cloud's settings, read
again at every launch: shortages may be switched on and off while a job runs), or above
``max_price``, is skipped with a ``capacity_error`` event, said once per wait; the group
(:mod:`.group`) retries when no pool can launch. Each pool's market replays real price
history from the group's first start, across supervisors (:mod:`.market`). A launch is
logged as EC2 and Auto Scaling would show it: ``status`` launching, ``instance``
launched (with its prices), ``price``.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any, Protocol

from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import Store
from spotnb.providers import catalog
from spotnb.providers.catalog import Pool
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.interruptions import Interruptions
from spotnb.providers.local.market import Market
from spotnb.providers.local.state import Settings, az_name

__all__ = ["Pools"]

log = logging.getLogger(__name__)


class Emit(Protocol):
    """The group's writer of its own events (:meth:`.group.Supervisor._emit`)."""

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

    def market(self, pool: Pool) -> Market:
        market = self.markets.get(pool.name)
        if market is None:
            market = Market(pool, self.started, self.settings.time_scale, seed=self.spec.job_id)
            self.markets[pool.name] = market
        return market

    def candidates(self, now: float) -> list[Pool]:
        """Pools in launch order: the spec's types in order, cheapest AZ first right now."""
        ordered = []
        region = self.spec.resources.region
        for instance_type in self.spec.resources.instance_types:
            type_pools = catalog.pools(instance_type, region)
            ordered += sorted(type_pools, key=lambda p: (self.market(p).price_at(now), p.az))
        return ordered

    def launch(self, now: float, index: int, target: int,
               standby_for: str | None = None) -> LocalInstance | None:
        """Start the group's ``index``-th instance in the first pool that can take it
        (``target``: the job's nodes: a later index is a replacement); None if none
        can. ``standby_for``: a warm standby for that instance (logged as such)."""
        try:  # capacity shortages may be switched on and off while the job runs
            settings = Settings.load()
        except SpecError as e:
            log.warning("keeping the previous local cloud settings: %s", e)
            settings = self.settings
        max_price = self.spec.resources.max_price
        for pool in self.candidates(now):
            price = self.market(pool).price_at(now)
            if max_price is not None and price > max_price:
                self._capacity_error(pool, now, "SpotMaxPriceTooLow", (
                    f"Your Spot request price of {max_price} is lower than the minimum "
                    f"required Spot request fulfillment price of {price}."))
            elif not settings.has_capacity(pool.instance_type, pool.az):
                self._capacity_error(pool, now, "InsufficientInstanceCapacity", (
                    f"We currently do not have sufficient {pool.instance_type} capacity in "
                    f"the Availability Zone you requested ({az_name(pool.region, pool.az)})."))
            else:
                return self._start(pool, now, settings, index, target, standby_for)
        return None

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
                  az=pool.az, pool=pool.name)

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
