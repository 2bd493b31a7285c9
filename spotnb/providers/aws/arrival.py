"""Step 2 of an instance's life (:mod:`.instance`): what happened while no instance of
the job ran, then this instance's launch, as events of the group's stream.

Capacity failures from the group's scaling activities (each reported once), and
predecessors that ended without a word (terminated in EC2: billed until their last
event), then "launched" (at EC2's launch time, with the pool's spot and on-demand
prices; a warm standby says for which instance), then this instance is marked as up
(``boot/<instance>.ok``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.protocol import billing, layout
from spotnb.protocol.events import GROUP_STREAM, Event
from spotnb.providers.aws import _boto
from spotnb.providers.aws.activities import capacity_failures
from spotnb.providers.aws.resources import choice_detail, group_name, rebalancing
from spotnb.providers.aws.standby import claimed_for

if TYPE_CHECKING:
    from spotnb.protocol.events import EventWriter
    from spotnb.protocol.events.fold import JobState
    from spotnb.protocol.spec import JobSpec
    from spotnb.protocol.store import Store

__all__ = ["announce", "came_up", "describe", "report_the_gap"]

log = logging.getLogger(__name__)


class Agent(Protocol):
    """What Step 2 uses of the instance agent (:class:`.instance.InstanceAgent`)."""

    spec: JobSpec
    store: Store
    identity: dict[str, str]
    events: EventWriter | None
    history: list[Event]
    state: JobState
    launched_at: float
    price: float | None
    standby_for: str | None
    spot_strategy: str
    no_capacity: set[str]

    def emit(self, type: str, **data: Any) -> None: ...

    def emit_event(self, event: Event) -> None: ...


def describe(region: str, instance_ids: list[str]) -> dict[str, Any]:
    """EC2's description of these instances, by id (those it does not know, or all of
    them if the call fails, are missing)."""
    ec2 = _boto.client("ec2", region)
    found: dict[str, Any] = {}
    try:
        for reservation in ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]:
            for inst in reservation["Instances"]:
                found[inst["InstanceId"]] = inst
    except Exception as err:
        log.info("describe_instances %s failed: %s", instance_ids, err)
    return found


def report_the_gap(agent: Agent) -> None:
    """Capacity failures and silently ended predecessors, from the job's events read
    (``agent.history``, ``agent.state``)."""
    group = [e for e in agent.history if e.attempt == GROUP_STREAM]
    reported = {e.data.get("activity_id") for e in group}
    asg = _boto.client("autoscaling", agent.identity["region"])
    try:
        activities = asg.describe_scaling_activities(
            AutoScalingGroupName=group_name(agent.spec.job_id))["Activities"]
    except Exception as err:
        log.info("cannot read the group's scaling activities: %s", err)
        activities = []
    try:  # how the group chooses among the job's types (its announcement says)
        (group,) = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(agent.spec.job_id)])["AutoScalingGroups"]
        agent.spot_strategy = str(group["MixedInstancesPolicy"]["InstancesDistribution"]
                                  ["SpotAllocationStrategy"])
    except Exception as err:
        log.info("cannot read the group's allocation strategy: %s", err)
    failures = capacity_failures(activities)
    agent.no_capacity = {f["instance_type"] for f in failures if f["instance_type"]}
    fresh = [f for f in failures if f["activity_id"] not in reported]
    if fresh:
        kinds = sorted({f"{f['reason']} for {f['instance_type'] or 'a pool'}"
                        for f in fresh})
        agent.emit("status", state="waiting_for_capacity", detail=(
            f"Auto Scaling could not get spot capacity ({'; '.join(kinds)}) and tried "
            "other pools"))
    for failure in fresh:
        agent.emit("instance", **failure)
    launched = agent.state.instances
    silent = [i for i in launched if i not in agent.state.terminated
              and i != agent.identity["instance_id"]]
    states = describe(agent.identity["region"], silent) if silent else {}
    for instance_id in silent:
        state = states.get(instance_id, {}).get("State", {}).get("Name", "terminated")
        if state not in ("shutting-down", "terminated"):
            continue  # still running (its notice period): it reports its own end
        inst = launched[instance_id]
        last = max((e.time for e in agent.history if e.instance == instance_id),
                   default=inst.start)
        noticed = instance_id in agent.state.noticed_instances
        data = {"instance_id": instance_id, "instance_type": inst.instance_type,
                "az": inst.az, "pool": inst.pool or None}
        agent.emit_event(Event(
            type="instance", time=last, attempt=GROUP_STREAM, instance=instance_id,
            data={**data, "action": "terminated", "reported_by": agent.identity["instance_id"],
                  "reason": "spot-interruption" if noticed else "terminated"}))


def announce(agent: Agent) -> None:
    """This instance's "launched" event and its pool's price; a warm standby's says
    for which instance it stands by (``agent.standby_for``)."""
    from spotnb.providers.aws.prices import pool_price

    ident = agent.identity
    iid, region = ident["instance_id"], ident["region"]
    me = describe(region, [iid]).get(iid, {})
    launch_time = me.get("LaunchTime")
    started = launch_time.timestamp() if launch_time is not None else time.time()
    agent.launched_at = started
    lifecycle = me.get("InstanceLifecycle") or "on-demand"
    price = pool_price(ident["instance_type"], region, ident.get("az_id"))
    agent.price = price.ondemand if lifecycle == "on-demand" and me else price.spot
    pool = f"{ident['instance_type']}@{ident.get('az_id') or ident.get('az')}"
    # This instance announced itself before: its agent started again (the boot
    # script's systemd unit, after a reboot; or in place, after a crash).
    again = iid in agent.state.instances
    # The group's first MAX launches are its nodes; each launch after them replaces one.
    launched = len([i for i in agent.state.instances if i != iid])
    replacing = max(0, launched - agent.spec.resources.max_nodes + 1)
    detail = (f"{iid} ({ident['instance_type']} in {ident.get('az_id')}, "
              f"{'spot' if me.get('InstanceLifecycle') == 'spot' else lifecycle}) started "
              f"by the Auto Scaling group")
    # A warm standby: launched while an instance's claim on the group's standby
    # stood (providers/aws/standby.py), for that instance.
    standby_for = None
    if rebalancing(agent.spec):
        try:
            standby_for = claimed_for(agent.store, iid, started)
        except Exception:
            log.debug("reading the standby claim failed", exc_info=True)
    agent.standby_for = standby_for
    if again:
        detail += " (its instance agent started again: a reboot, or a crash)"
    elif standby_for is not None:
        detail += f" (standby for {standby_for}: rebalance recommendation)"
    elif replacing:
        detail += f" (replacement #{replacing})"
    detail += choice_detail(ident["instance_type"], agent.spec.resources.instance_types,
                            agent.spot_strategy, agent.no_capacity)
    assert agent.events is not None
    agent.emit("status", state="launching", detail=detail,
               instance_type=ident["instance_type"], az=ident.get("az_id"))
    agent.emit_event(Event(
        type="instance", time=started, attempt=GROUP_STREAM, instance=iid, data={
            "action": "launched", "instance_id": iid,
            "instance_type": ident["instance_type"], "az": ident.get("az_id"),
            "az_name": ident.get("az"), "pool": pool, "region": region,
            "price": agent.price, "ondemand": price.ondemand, "lifecycle": lifecycle,
            "price_source": price.source,
            **({"standby_for": standby_for} if standby_for is not None else {}),
            **({"time_scale": scale} if (scale := billing.time_scale()) != 1 else {})}))
    agent.emit("price", pool=pool, instance_type=ident["instance_type"],
               az=ident.get("az_id"), price=agent.price, ondemand=price.ondemand,
               source=price.source)
    agent.events.flush()


def came_up(agent: Agent) -> None:
    """Mark this instance as one whose agent came up (``boot/<instance>.ok``): the
    job's failed boots before it no longer count as in a row
    (:mod:`.bootstrap`). One PUT per instance start."""
    try:
        agent.store.put(layout.boot_ok_key(agent.identity["instance_id"]), b"")
    except Exception:
        log.warning("could not mark this instance as up; earlier failed boots still "
                    "count towards the job's limit", exc_info=True)
