"""Waiting for capacity: the group's failed activities as events, failed launches, and
the on-demand fallback.

EC2 Auto Scaling tries the group's other pools by itself when one has no spot capacity;
it records each failure as a scaling activity (``InsufficientInstanceCapacity`` ...).
While the notebook that launched a job is open, a :class:`CapacityWatch` thread reads
those activities until the first instance boots and writes them to the group's stream
as ``capacity_error`` events with a ``waiting_for_capacity`` status, so the dashboard
says why nothing runs yet. With ``SPOTNB_AWS_ONDEMAND_AFTER`` set, it also switches the
group to on-demand after that many seconds without spot capacity.

A failed activity that is not about capacity (an instance profile IAM has not
propagated yet, an image that does not exist, a missing permission) is said as it
happens (a ``launching`` status with AWS's reason): Auto Scaling retries those too, and
the first (a new profile) usually heal. When they go on for ``SPOTNB_AWS_LAUNCH_FAILURE``
seconds (default 300) and no instance has launched, the job fails with AWS's reason and
its group is deleted: a job never sits at "launching" with a launch that cannot work.

A job of several regions (:mod:`.failover`) is also moved here: its watch goes on for
the job's life, and when :data:`~spotnb.providers.failover.MOVE_AFTER_FAILED_ROUNDS`
launch rounds in a row failed for capacity (a *round*: as many capacity failures in a
row, since the group's last successful launch, as the group has pools, types x
subnets: Auto Scaling's try of each) while fewer than the job's minimum of nodes run,
the job's capacity moves to the next region (:meth:`AwsProvider.move_region`), said in a
``region`` event; the nodes still running in the region it leaves (a multi-node job's,
fewer than its minimum) get a ``region-move`` notice, said in the group's stream, and
save and go before the new region launches. Each poll of such a job costs one
``DescribeScalingActivities`` (free) and one read of the job's log (an S3 LIST, as a
follower's).

**Who watches.** The notebook that launched the job, and every notebook or process that
follows it later (``%spot_attach``, ``spotnb.attach(...).wait()``, ``spotnb logs
--follow``: :meth:`AwsProvider.ensure_supervised`) while no watch of its own process
does. A watch that did not launch the job takes the group's region and the regions left
dry from the job's ``region`` events (:meth:`RegionPlan.resume`), and follows a move
another owner made the same way. Two owners never move a job twice for the same
shortage: each move is claimed first in the job's store (``group/moves/<n>.json``, one
conditional write; :func:`claim_move`), and only the watch that wrote the claim moves.
A move whose notebook closed before it let the new region's group launch is finished by
the next watch that takes over (:meth:`AwsProvider.finish_move`).

Not needed for recovery: the group keeps trying by itself, and the instance agent
(:mod:`.instance`) reports the capacity failures when an instance boots. (With no
notebook following the job, a launch that cannot work is left to the group's retries,
nothing is billed while no instance runs, and ``spotnb aws cleanup`` deletes the group;
a job of several regions is moved by the mover, :mod:`.mover`, through
:func:`move_if_dry`, the same decision.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spotnb.protocol import billing, layout
from spotnb.protocol.events import GROUP_STREAM, Event, EventReader, EventWriter, codec
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store
from spotnb.providers.aws.activities import capacity_failures, launch_failures
from spotnb.providers.aws.resources import group_name, mixed_instances_policy, region_types

if TYPE_CHECKING:
    from spotnb.providers.aws import AwsProvider

__all__ = ["CapacityWatch", "claim_move", "move_if_dry", "stop_capacity_watches", "watching"]

#: Launch rounds in a row without capacity after which a job moves to its next region:
#: the local cloud's bound (spotnb.providers.failover), one rule for both
#: (tests/test_aws_failover.py holds them equal).
MOVE_AFTER_FAILED_ROUNDS = 3

log = logging.getLogger(__name__)

#: Capacity errors that are the account's spot vCPU quota, not EC2's capacity.
QUOTA_CODES = frozenset({"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded",
                         "InstanceLimitExceeded"})
#: A move claimed this long ago whose ``region`` event never came is another owner's to
#: make (the claimer's notebook closed): a move takes a few requests, seconds.
MOVE_CLAIM_SECONDS = 300.0
# The watcher gives up after this long without a first instance; the group keeps
# trying, and the instance agent reports what happened when it boots.
CAPACITY_WATCH_SECONDS = 3600.0

_WATCHES: set[CapacityWatch] = set()
_WATCHES_LOCK = threading.Lock()


def watching(job_id: str) -> bool:
    """Whether a capacity watch of this process follows job ``job_id``."""
    with _WATCHES_LOCK:
        return any(w.spec.job_id == job_id and w.is_alive() for w in _WATCHES)


def claim_move(store: Store, choices: int, owner: str) -> bool:
    """Claim the job's next region move, the one after its ``choices`` region choices so
    far (one conditional write of ``group/moves/<choices>.json``): True for the owner
    that wrote it. A write whose answer was lost is ours if the claim names us; a claim
    older than :data:`MOVE_CLAIM_SECONDS` whose move never came (its notebook closed
    between the two) is taken over, by one conditional replace."""
    key = f"{layout.REGION_MOVES}{choices}.json"
    body = json.dumps({"owner": owner, "time": time.time()}).encode()
    if store.put_if_absent(key, body) is not None:
        return True
    try:
        data, etag = store.get_with_etag(key)
        claim = json.loads(data)
        if claim.get("owner") == owner:
            return True
        if time.time() - float(claim.get("time", 0)) < MOVE_CLAIM_SECONDS:
            return False
        return store.put_if_match(key, body, etag) is not None
    except Exception:
        log.info("could not read the move claim %s", key, exc_info=True)
        return False


def stop_capacity_watches() -> None:
    """Stop every capacity watcher of this process (the simulator does at its end)."""
    with _WATCHES_LOCK:
        watches = list(_WATCHES)
    for watch in watches:
        watch.stop()
    for watch in watches:
        if watch.is_alive():
            watch.join(timeout=5)


class CapacityWatch(threading.Thread):
    """Reports a job's capacity failures until its first instance boots; see the module
    docstring."""

    def __init__(self, provider: AwsProvider, spec: JobSpec, store: Store) -> None:
        super().__init__(name=f"spotnb-capacity-{spec.job_id}", daemon=True)
        self.provider = provider
        self.spec = spec
        self.store = store
        self._halt = threading.Event()
        self._owner = f"{self.name}-{uuid.uuid4().hex[:12]}"
        #: The group's region choices read from the job's log, in time order.
        self._choices: list[tuple[float, codec.Region]] = []

    def stop(self) -> None:
        self._halt.set()

    def start(self) -> None:
        with _WATCHES_LOCK:
            _WATCHES.add(self)
        super().start()

    def run(self) -> None:
        try:
            self._watch()
        except Exception:
            log.debug("the capacity watch of job %s ended", self.spec.job_id, exc_info=True)
        finally:
            with _WATCHES_LOCK:
                _WATCHES.discard(self)

    def _watch(self) -> None:
        settings = self.provider.settings
        reader = EventReader(self.store)
        reported = set()
        said: set[str] = set()
        last_reason: str | None = None
        failing_since: float | None = None
        started = time.monotonic()
        ondemand = settings.ondemand_after == 0
        # A job of several regions is watched for its life, to move it (module docstring).
        moving = len(self.spec.resources.regions) > 1
        launched = False
        state_bytes: int | None = None  # its newest durable checkpoint's size
        writer: EventWriter | None = None
        try:
            while not self._halt.wait(settings.capacity_poll):
                polled = reader.poll()
                events = [e for e in polled if e.attempt == GROUP_STREAM]
                reported |= {e.data.get("activity_id") for e in events}
                for e in polled:
                    body = codec.peek(e)
                    if isinstance(body, codec.CheckpointEvent) and body.durable \
                            and not body.sync:
                        state_bytes = body.bytes
                self._follow_choices(events)
                asg = self.provider.client("autoscaling",
                                           self.provider.region(self.spec.job_id))
                launched = launched or any(
                    isinstance(e.body, codec.Instance) and e.body.launched for e in events)
                if (launched and not moving) or self.store.exists(layout.RESULT):
                    return
                if not moving and time.monotonic() - started > CAPACITY_WATCH_SECONDS:
                    return
                activities = asg.describe_scaling_activities(
                    AutoScalingGroupName=group_name(self.spec.job_id))["Activities"]
                fresh = [f for f in capacity_failures(activities)
                         if f["activity_id"] not in reported]
                failed = [f for f in launch_failures(activities)
                          if f["activity_id"] not in said]
                if (fresh or failed) and writer is None:
                    writer = EventWriter(self.store, GROUP_STREAM)
                for failure in failed:
                    assert writer is not None
                    said.add(failure["activity_id"])
                    failing_since = failing_since or time.monotonic()
                    if failure["reason"] != last_reason:  # each cause once, as it changes
                        last_reason = failure["reason"]
                        writer.emit("status", state="launching", detail=(
                            f"Auto Scaling could not launch an instance: {last_reason} "
                            "(it tries again)"))
                if failing_since is not None and self._still_failing(activities) and \
                        time.monotonic() - failing_since > settings.launch_failure:
                    self._fail(writer, activities, time.monotonic() - failing_since)
                    return
                if failing_since is not None and not self._still_failing(activities):
                    failing_since = None
                for failure in fresh:
                    assert writer is not None
                    reported.add(failure["activity_id"])
                    quota = failure["reason"] in QUOTA_CODES
                    writer.emit("status", state="waiting_for_capacity", detail=(
                        f"waiting for capacity: {failure['reason']}"
                        f"{' for ' + failure['instance_type'] if failure['instance_type'] else ''}"
                        + ("; the account's spot vCPU quota for it is used up (a new "
                           "account's is 0): `spotnb aws doctor` shows it, the Service "
                           "Quotas console raises it" if quota else "")
                        + "; Auto Scaling tries the other pools"))
                    writer.emit("instance", **failure)
                if moving:
                    writer = move_if_dry(self.provider, self.spec, self.store, asg=asg,
                                         activities=activities, writer=writer,
                                         state_bytes=state_bytes, choices=len(self._choices),
                                         owner=self._owner)
                waited = time.monotonic() - started
                if (not launched and not ondemand and settings.ondemand_after is not None
                        and reported and waited > settings.ondemand_after):
                    self._fall_back_to_ondemand(asg, writer, waited)
                    ondemand = True
        finally:
            if writer is not None:
                writer.close()

    def _follow_choices(self, events: Sequence[Event]) -> None:
        """Take in the group's region choices among ``events``: the provider learns
        where the group runs now, and the plan follows a move another owner made (the
        plan of a watch that did not launch the job is made here, from them)."""
        fresh = [(e.time, e.body) for e in events if isinstance(e.body, codec.Region)
                 and e.body.region]
        if not fresh:
            return
        self._choices = sorted(self._choices + fresh, key=lambda item: item[0])
        choices = [choice for _t, choice in self._choices]
        self.provider.runs_in(self.spec.job_id, choices[-1].region,
                              self.spec.resources.region)
        plan = self.provider._plans.get(self.spec.job_id)
        if plan is None and len(self.spec.resources.regions) > 1:
            plan = self.provider._plans[self.spec.job_id] = self.provider.region_plan(
                self.spec)
            plan.resume(choices)
            newest = choices[-1]
            if newest.previous:  # a move whose notebook may have closed before its end
                try:
                    self.provider.finish_move(self.spec, newest.previous, newest.region)
                except Exception:
                    log.info("could not look whether job %s's move to %s is finished",
                             self.spec.job_id, newest.region, exc_info=True)
        elif plan is not None and plan.region != choices[-1].region:
            plan.resume(choices)  # another owner moved it

    @staticmethod
    def _still_failing(activities: list[dict[str, Any]]) -> bool:
        """Whether the group's newest activity is a failed launch not about capacity."""
        if not activities:
            return False
        newest = max(activities, key=lambda a: str(a.get("StartTime")))
        return bool(launch_failures([newest]))

    def _fail(self, writer: EventWriter | None, activities: list[dict[str, Any]],
              waited: float) -> None:
        """The launch cannot work: the job fails with AWS's reason, its group is deleted
        (no instance ever ran: nothing was billed)."""
        reason = launch_failures(activities)[-1]["reason"]
        name = group_name(self.spec.job_id)
        detail = (f"Auto Scaling could not launch an instance for {waited:.0f} s: {reason}. "
                  "Next step: `spotnb aws doctor` (image, permissions, quotas); the "
                  "group's scaling activities: `aws autoscaling describe-scaling-activities "
                  f"--auto-scaling-group-name {name}`")
        log.warning("job %s: %s", self.spec.job_id, detail)
        body = {"status": "failed", "reason": detail, "time": time.time(),
                "by": "aws-capacity-watch"}
        if self.store.put_if_absent(layout.RESULT, json.dumps(body).encode()) is not None \
                and writer is not None:
            writer.emit("result", status="failed", reason=detail)
            writer.emit("status", state="failed", detail=detail)
            writer.flush()
        try:
            self.provider.terminate(self.spec.job_id)
        except Exception:
            log.warning("could not delete job %s's group; `spotnb aws cleanup` will",
                        self.spec.job_id, exc_info=True)

    def _fall_back_to_ondemand(self, asg: Any, writer: EventWriter | None,
                               waited: float) -> None:
        group = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(self.spec.job_id)])["AutoScalingGroups"]
        if not group:
            return
        template = group[0]["MixedInstancesPolicy"]["LaunchTemplate"][
            "LaunchTemplateSpecification"]["LaunchTemplateId"]
        asg.update_auto_scaling_group(
            AutoScalingGroupName=group_name(self.spec.job_id),
            MixedInstancesPolicy=mixed_instances_policy(
                template_id=template, instance_types=self.spec.resources.instance_types,
                max_price=self.spec.resources.max_price, ondemand=True,
                strategy=group[0]["MixedInstancesPolicy"]["InstancesDistribution"].get(
                    "SpotAllocationStrategy") or self.provider.settings.spot_strategy))
        if writer is not None:
            writer.emit("status", state="waiting_for_capacity", detail=(
                f"no spot capacity for {waited:.0f} s: falling back to on-demand "
                "(SPOTNB_AWS_ONDEMAND_AFTER)"))


def move_if_dry(provider: AwsProvider, spec: JobSpec, store: Store, *, asg: Any,
                activities: list[dict[str, Any]], writer: EventWriter | None,
                state_bytes: int | None, choices: int, owner: str) -> EventWriter | None:
    """Move the job to its next region if its group failed enough rounds for capacity
    with too few nodes running (module docstring), as ``owner``: a notebook's watch, or
    the mover function (:mod:`.mover`) when no notebook follows the job. ``activities``:
    the group's scaling activities in its region (``asg``'s); ``choices``: the job's
    region choices so far (its ``region`` events), whose next move is claimed in the
    store; the provider's plan of the job (``provider._plans``) knows where it runs.
    Returns the writer, made if the move was told."""
    plan = provider._plans.get(spec.job_id)
    if plan is None or plan.region is None:
        return writer
    failures = _failures_in_a_row(activities)
    if not failures:
        return writer
    name = group_name(spec.job_id)
    found = asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=[name])["AutoScalingGroups"]
    if not found:
        return writer
    group = found[0]
    subnets = [s for s in str(group.get("VPCZoneIdentifier", "")).split(",") if s]
    pools = max(1, len(region_types(spec, plan.region)) * max(1, len(subnets)))
    running = [i for i in group.get("Instances", ())
               if not str(i.get("LifecycleState", "")).startswith("Terminat")]
    plan.failed_rounds = failures // pools
    if len(running) >= spec.resources.min_nodes or not plan.failed_rounds or \
            plan.failed_rounds < MOVE_AFTER_FAILED_ROUNDS:
        return writer
    if not claim_move(store, choices, owner):
        return writer  # another owner moves it: its region event comes next
    previous = plan.region
    at = time.time()
    choice = plan.move(state_bytes)
    if choice is None:
        return writer
    writer = writer or EventWriter(store, GROUP_STREAM)
    told = writer

    def tell() -> None:
        """The move, said before the nodes left in ``previous`` get their notice (as
        the local cloud says it): the region event, then each node's notice."""
        told.emit_event(Event(type="region", time=at, attempt=GROUP_STREAM,
                              instance=None, data=dataclasses.asdict(choice)))
        told.emit("status", state="waiting_for_capacity", detail=(
            f"moved to {choice.region}: {choice.reason}; it resumes there from its "
            f"checkpoint in {choice.home}" + (
                f"; its {len(running)} node(s) left in {previous} save and go first"
                if running else "")))
        for inst in running:
            told.emit("instance", action="notice", reason=billing.REGION_MOVE,
                      instance_id=inst["InstanceId"],
                      instance_type=inst.get("InstanceType"), region=previous)
        told.flush()

    try:
        provider.move_region(spec, choice.region,
                             nodes=[i["InstanceId"] for i in running], tell=tell)
    except Exception as err:
        plan.resume_in(previous)  # it stays, and tries to move again later
        log.warning("job %s could not move from %s to %s: %s", spec.job_id,
                    previous, choice.region, err)
    return writer


def _failures_in_a_row(activities: list[dict[str, Any]]) -> int:
    """The group's capacity failures since its newest successful launch (the other
    failures, not about capacity, neither count nor end the run)."""
    count = 0
    for act in sorted(activities, key=lambda a: str(a.get("StartTime")), reverse=True):
        if act.get("StatusCode") == "Successful":
            break
        if capacity_failures([act]):
            count += 1
    return count
