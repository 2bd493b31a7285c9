"""Step 3 of an instance's life (:mod:`.instance`): what the instance agent watches while
its job agent runs, each at its own pace (the agent's loop calls them).

* IMDS: the interruption notice ("notice" event), and Auto Scaling ending the instance
  through its termination hook (the job moves to its warm standby);
* the job's stop request, budget and deadline (over: control/stop.json, which the job
  agent obeys);
* the spot price ("price" event when it changed);
* in a standby group, the lifecycle hooks to complete: the launch hook once the job
  agent holds the lease (a node slot's) or, a warm standby, is ready; the termination
  hook once it let go of the lease; and, once it holds the lease, this instance's
  protection from scale-in.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.protocol import billing, layout
from spotnb.protocol.events.live import request_stop
from spotnb.protocol.limits import limit_reached
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import LAUNCH_HOOK_NAME, LIFECYCLE_HOOK_NAME, group_name

if TYPE_CHECKING:
    from spotnb.protocol.events.fold import JobState
    from spotnb.protocol.spec import JobSpec
    from spotnb.protocol.store import Store
    from spotnb.providers.aws.standby import StandbyDriver
    from spotnb.providers.imds import ImdsClient

__all__ = ["PROTECT_TRIES", "STOP_CHECK_SECONDS", "complete_hook", "stop_the_job",
           "watch_hooks", "watch_limits", "watch_notice", "watch_price"]

log = logging.getLogger(__name__)

# Asking Auto Scaling to protect this instance from scale-in is tried this many times.
PROTECT_TRIES = 30
# A stop request is looked for this often (an S3 HEAD: 60/h = $0.000024/h).
STOP_CHECK_SECONDS = 60.0


class Agent(Protocol):
    """What the watches use of the instance agent (:class:`.instance.InstanceAgent`)."""

    spec: JobSpec
    store: Store
    imds: ImdsClient
    identity: dict[str, str]
    state: JobState
    standbys: StandbyDriver | None
    notice: dict[str, Any] | None
    hook_ending: bool
    ending_reason: str | None
    launch_hook_due: bool
    end_hook_due: bool
    protect_due: bool
    protect_tries: int
    stop_checked: float
    stop_seen_at: float | None
    price: float | None

    def emit(self, type: str, **data: Any) -> None: ...


def watch_notice(agent: Agent) -> None:
    """The interruption notice, or Auto Scaling ending this instance through its
    termination hook (no notice: not EC2 taking it back)."""
    if agent.notice is not None:
        return
    try:
        action = agent.imds.instance_action()
        if not action and not agent.hook_ending and \
                agent.imds.target_lifecycle_state() == "Terminated":
            # Not EC2 taking the instance back: no notice event, no interruption. The
            # job moves to its standby, or, the instance marked so in the store, to
            # another region (read first: a failed read is tried again next turn).
            moving = agent.store.exists(
                layout.leaving_region_key(agent.identity["instance_id"]))
            agent.hook_ending = agent.end_hook_due = True
            if moving:
                agent.ending_reason = billing.REGION_MOVE
                log.info("Auto Scaling is ending this instance through its termination "
                         "hook: the job moves to another region")
            else:
                log.info("Auto Scaling is ending this instance through its termination "
                         "hook: the job moves to its standby (or, a standby, it is "
                         "given back)")
    except OSError:
        return
    if action:
        agent.notice = action
        ident = agent.identity
        agent.emit("instance", action="notice", reason="spot-interruption",
                   instance_id=ident["instance_id"], instance_type=ident["instance_type"],
                   az=ident.get("az_id"), termination_time=action.get("time"),
                   notice_action=action.get("action"), price=agent.price)
        log.info("interruption notice: %s", action)


def watch_limits(agent: Agent) -> None:
    """A stop request (every STOP_CHECK_SECONDS), then the budget and deadline, from
    what the agent knows (no request)."""
    policy = agent.spec.policy
    now_m = time.monotonic()
    if agent.stop_seen_at is None and now_m - agent.stop_checked >= STOP_CHECK_SECONDS:
        agent.stop_checked = now_m
        if agent.store.exists(layout.STOP):
            agent.stop_seen_at = now_m
    if agent.stop_seen_at is not None or (policy.budget_usd is None
                                          and policy.max_duration is None):
        return
    passed = limit_reached(policy, agent.state, time.time())
    if passed is not None:
        stop_the_job(agent, passed.reason, passed.detail)


def stop_the_job(agent: Agent, reason: str, detail: str) -> None:
    """Ask the job to stop (control/stop.json, which the job agent obeys)."""
    log.info("stopping the job: %s", detail)
    body = {"reason": reason, "detail": detail, "time": time.time(), "by": "aws-instance",
            "instance_id": agent.identity["instance_id"]}
    request_stop(agent.store, agent.spec.job_id, body)
    agent.stop_seen_at = time.monotonic()
    agent.emit("status", state="stopped", detail=f"stopping: {detail}")


def watch_price(agent: Agent) -> None:
    """A "price" event when the pool's spot price changed."""
    from spotnb.providers.aws.prices import pool_price

    ident = agent.identity
    try:
        price = pool_price(ident["instance_type"], ident["region"], ident.get("az_id"))
    except Exception:
        log.debug("price lookup failed", exc_info=True)
        return
    if price.spot is not None and price.spot != agent.price and agent.price is not None:
        agent.price = price.spot
        agent.emit("price", pool=f"{ident['instance_type']}@{ident.get('az_id')}",
                   instance_type=ident["instance_type"], az=ident.get("az_id"),
                   price=price.spot, ondemand=price.ondemand, source=price.source)


def watch_hooks(agent: Agent) -> None:
    """Complete the group's lifecycle hooks once their time came: the launch hook
    once this instance's job agent holds the lease or, a warm standby, says it is
    ready (the group may then end the at-risk instance); the termination hook once
    it holds the lease no more (its final save is durable, the standby has the job),
    so that Auto Scaling terminates it now, not at the end of the hook's wait, and
    the instance the job left is not billed for the rest of it. Once it holds the
    lease, protect it from scale-in (``protect_due``)."""
    iid = agent.identity["instance_id"]
    assert agent.standbys is not None  # made once this instance knew who it is
    try:
        held = agent.standbys.holds_lease()
        if agent.launch_hook_due and (
                held or agent.store.exists(layout.standby_ready_key(iid))):
            agent.launch_hook_due = False
            complete_hook(agent, LAUNCH_HOOK_NAME)
        if agent.end_hook_due and not held:
            agent.end_hook_due = False
            complete_hook(agent, LIFECYCLE_HOOK_NAME)
        if agent.protect_due and held and agent.notice is None and not agent.hook_ending:
            agent.protect_tries += 1
            if agent.standbys.protect(True) or agent.protect_tries >= PROTECT_TRIES:
                agent.protect_due = False
    except Exception:
        log.debug("reading the lease for the lifecycle hooks failed", exc_info=True)


def complete_hook(agent: Agent, hook: str) -> None:
    """Tell Auto Scaling this instance is done with lifecycle hook ``hook`` (one
    request); if that fails, the hook's timeout does it."""
    ident = agent.identity
    try:
        _boto.with_backoff(lambda: _boto.client("autoscaling", ident["region"])
                           .complete_lifecycle_action(
                               LifecycleHookName=hook,
                               AutoScalingGroupName=group_name(agent.spec.job_id),
                               LifecycleActionResult="CONTINUE",
                               InstanceId=ident["instance_id"]),
                           what=f"completing the lifecycle hook {hook}")
        log.info("completed the lifecycle hook %s", hook)
    except Exception as err:
        log.warning("could not complete the lifecycle hook %s (%s); Auto Scaling goes "
                    "on at its timeout", hook, err)
