"""What a job's instances billed: the money figures of its fold, one definition each
for every view (the headers, the result, records, comparisons, sweeps, notifications,
both clouds' budget checks). :class:`Money` is the part of
:class:`~spotnb.protocol.events.fold.JobState` that reads its instances, pools, usage
and standbys.

Each instance bills per second from its launch to its end at its pool's spot price as
it changed, nothing if EC2 interrupted it in its first hour
(:mod:`spotnb.protocol.billing`); spotnb's own requests at list price
(:mod:`spotnb.protocol.usage`) and the checkpoint's transfer between regions (its
``transfer`` events: AWS's inter-region price) are part of the job's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spotnb.protocol import usage
from spotnb.protocol.events import codec
from spotnb.protocol.events.parts import AttemptState, InstanceState, PoolState, StandbyState

__all__ = ["Money", "integrate", "savings_pct"]


def savings_pct(cost: float, ondemand: float) -> float | None:
    """The saving against on-demand in percent (None without an on-demand cost): the
    one formula of every view that says it."""
    if ondemand <= 0:
        return None
    return 100.0 * (1.0 - cost / ondemand)


class Money:
    """The money figures of a job's fold (module docstring)."""

    instances: dict[str, InstanceState]
    pools: dict[str, PoolState]
    prices: dict[str, list[tuple[float, float]]]
    usage: dict[tuple[Any, int, str | None], dict[str, Any]]
    standbys: dict[str, StandbyState]
    attempts: dict[int, AttemptState]
    last_time: float | None
    heard: dict[str, float]
    transfers: dict[str, codec.Transfer]

    def current_attempt(self) -> AttemptState | None:
        """The newest attempt that booted (:meth:`JobState.current_attempt`)."""
        raise NotImplementedError("JobState says it")

    def requests_usd(self) -> float:
        """spotnb's own requests at list price (the newest total of each process)."""
        return sum(usage.cost(counts) for counts in self.usage.values())

    def transfer_usd(self) -> float:
        """What the checkpoint's crossings between regions cost (AWS's inter-region
        transfer: each save sent home from another region, each restore there; each
        ``transfer`` event's key counted once)."""
        return sum(t.usd for t in self.transfers.values())

    def cost(self, end: float) -> tuple[float, float]:
        """What the instances billed until ``end`` (those still running): at the spot
        price of their pool as it changed, and at the on-demand price."""
        return self._cost_until(lambda inst: end)

    def cost_heard(self) -> tuple[float, float]:
        """:meth:`cost` with each running instance billed until the newest event heard
        from it, not until now: a figure that only grows as a job's events come in
        (``cost(now)`` bills a running instance to now, then gives back the time past
        its end once that end, read later, says it was earlier). Equal to ``cost`` once
        every instance has ended."""
        return self._cost_until(
            lambda inst: max(inst.start, self.heard.get(inst.instance_id, inst.start)))

    def cost_heard_usd(self) -> tuple[float, float]:
        """What the job has cost as its events tell it so far (:meth:`cost_heard`,
        spotnb's own requests and the checkpoint's transfer between regions), and the
        same instance time on-demand: a sweep's trials' and a comparison's running
        jobs' money, which never decreases."""
        cost, ondemand = self.cost_heard()
        return cost + self.requests_usd() + self.transfer_usd(), ondemand

    def _cost_until(self, running_until: Callable[[InstanceState], float]
                    ) -> tuple[float, float]:
        """:meth:`cost`, a running instance billed until ``running_until(it)``."""
        cost = ondemand = 0.0
        for inst in self.instances.values():
            stop = inst.end if inst.end is not None else running_until(inst)
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

    def cost_between(self, start: float, stop: float) -> float:
        """What the instances billed between ``start`` and ``stop``, at the spot price
        of their pool as it changed (the time an interruption cost, say)."""
        total = 0.0
        for inst in self.instances.values():
            lo, hi = max(start, inst.start), min(stop, inst.end or stop)
            total += self.billed(inst, lo, hi)
        return total

    def cost_usd(self, end: float) -> float:
        """What the job has cost until ``end``: its instances at the spot price,
        spotnb's own requests and the checkpoint's transfer between regions (a
        :class:`~spotnb.client.jobs.JobResult`'s ``cost_usd``, the headers', the budget
        checks')."""
        return self.cost(end)[0] + self.requests_usd() + self.transfer_usd()

    def instance_cost(self, instance_id: str, end: float | None = None) -> float:
        """What one instance billed (until ``end`` while it runs), at its pool's price."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return 0.0
        stop = inst.end or end or self.last_time or inst.start
        return self.billed(inst, inst.start, stop)

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
        """The job's instances that have not ended."""
        return [i for i in self.instances.values() if i.end is None]

    def spot_price(self, inst: InstanceState) -> float:
        """The instance's spot price now (its pool's newest)."""
        pool = self.pools.get(inst.pool)
        price = None if pool is None else pool.price
        return price if price is not None else (inst.price or 0.0)

    def ondemand_price(self, inst: InstanceState) -> float | None:
        """The instance's on-demand price (its launch's, else its pool's)."""
        pool = self.pools.get(inst.pool)
        return inst.ondemand or (None if pool is None else pool.ondemand)

    def running_prices(self) -> tuple[float, float, int] | None:
        """The spot and on-demand USD/hour of every instance running now, summed (a
        multi-node job pays for each of its nodes), and how many there are; None
        while none runs."""
        running = self.running_instances()
        if not running:
            return None
        return (sum(self.spot_price(i) for i in running),
                sum(self.ondemand_price(i) or 0.0 for i in running), len(running))

    def price_now(self) -> tuple[float, float | None] | None:
        """The spot and on-demand USD/hour of the instance the job runs on: the newest
        attempt's while it runs, else the newest launched that runs (a replacement
        booting), else the newest attempt's last; None before any launch."""
        current = self.current_attempt()
        inst = None if current is None else self.instances.get(current.instance or "")
        if inst is None or inst.end is not None:
            running = self.running_instances()
            inst = max(running, key=lambda i: i.start) if running else inst
        if inst is None:
            return None
        return self.spot_price(inst), self.ondemand_price(inst)


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
