"""EC2 Auto Scaling as the simulator plays it for spotnb's groups (moto stores groups but
launches nothing of a mixed-instances policy and keeps no lifecycle).

:class:`AutoScalingPlay` is a part of :class:`~spotnb.testing.AwsSimulator`:

* **Fulfilment**: each missing instance is launched with ``ec2:RunInstances`` (real
  HTTP) and attached to its group. The pools (type x subnet) are tried in the order the
  group's allocation strategy gives (:func:`.allocation.pool_order`): by price under
  ``price-capacity-optimized`` and ``lowest-price`` (the bundled catalog's spot price of
  the pool, else the type's on-demand price), in a drawn order under
  ``capacity-optimized`` (capacity, which the simulator does not model beyond
  :meth:`~spotnb.testing.AwsSimulator.no_capacity`, decides, never the list's order),
  and in the list's order only under ``capacity-optimized-prioritized`` and
  on-demand's ``prioritized``, as Auto Scaling documents. A pool without capacity is
  recorded as a failed scaling activity and the next one tried; any other refusal of
  ``RunInstances`` (an instance profile, an image, a permission) is a failed activity
  with EC2's message, and the group tries again later.
* **Groups**: ``CreateAutoScalingGroup`` of a name that exists is refused with
  ``AlreadyExists`` (moto would replace the group), and the hooks of its
  ``LifecycleHookSpecificationList`` (which moto ignores) are made with the group,
  before its first launch. ``UpdateAutoScalingGroup`` changes only what it names, as
  its API reference says ("Any properties that you don't specify are not changed");
  moto's drops the mixed-instances policy of a request that names none.
* **Lifecycle**: with a launch hook, a new member waits in ``Pending:Wait`` until
  ``CompleteLifecycleAction`` (``CONTINUE``: ``InService``; ``ABANDON``: terminated) or
  its heartbeat timeout (the hook's ``DefaultResult``); ``TerminateInstanceInAutoScalingGroup``
  on a member of a group with a termination hook puts it in ``Terminating:Wait`` until
  its agent completes the hook or the wait runs out. Waits are scaled as the notice
  period is. ``DescribeAutoScalingGroups`` and ``DescribeAutoScalingInstances`` show
  these states.
* **What is refused in those states**, as on AWS: ``SetInstanceProtection`` on an
  instance not ``InService``/``Standby`` (``ValidationError: The instance ... is not
  in InService or EnteringStandby or Standby.``); ``DetachInstances`` of an instance
  not ``InService`` (the user guide: "You can detach an instance only when it's in the
  InService state"); ``CompleteLifecycleAction`` with no lifecycle action of that
  hook in progress (``ValidationError: No active Lifecycle Action found ...``); and
  ``TerminateInstanceInAutoScalingGroup`` of an instance in ``Pending:Wait``
  (``ScalingActivityInProgress``: its launch is a scaling activity in progress until
  the hook completes; the API reference lists the error but not this exact condition,
  so this is the simulator's reading: complete the launch hook with ``ABANDON``
  instead).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from spotnb.testing.allocation import pool_order

__all__ = ["AutoScalingPlay", "pool_order"]

log = logging.getLogger(__name__)

# After every pool failed, Auto Scaling tries again after a while.
CAPACITY_RETRY_SECONDS = 2.0
#: States in which an instance may be protected from scale-in.
PROTECTABLE = ("InService", "EnteringStandby", "Standby")
#: Lifecycle states that count toward a group's size.
IN_GROUP = ("Pending", "Pending:Wait", "Pending:Proceed", "InService")
class AutoScalingPlay:
    """Auto Scaling's fulfilment and lifecycle for :class:`~spotnb.testing.AwsSimulator`
    (a part of it: it shares the simulator's state)."""

    region: str
    regions: tuple[str, ...]
    notice_seconds: float
    instances: dict[str, Any]
    activities: dict[tuple[str, str], list[dict[str, Any]]]
    hooks_completed: list[tuple[str, str]]
    signals_sent: list[tuple[float, str, str]]
    _lock: threading.RLock
    _undo: list[Callable[[], None]]
    _retry_at: dict[tuple[str, str], float]
    _placed: dict[str, str | None]
    _attaching: set[str]
    #: instances waiting on their launch hook: id -> (group, hook, deadline, default)
    _launch_waits: dict[str, tuple[str, str, float, str]]
    _allocation_rng: random.Random

    def _subnet(self, subnet: str) -> tuple[str, str]:
        raise NotImplementedError

    def _placement_groups(self, region: str) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _client(self, service: str, region: str | None = None) -> Any:
        raise NotImplementedError

    def _launch_failed(self, region: str, activity: dict[str, Any]) -> None:
        raise NotImplementedError

    def _patch_autoscaling(self) -> None:
        """Auto Scaling as the simulator plays it inside moto (see the module docstring)."""
        from moto.autoscaling.exceptions import AutoscalingClientError
        from moto.autoscaling.models import AutoScalingBackend, FakeAutoScalingGroup
        from moto.autoscaling.responses import AutoScalingResponse
        from moto.core.responses import ActionResult, EmptyResult

        from spotnb.providers.aws.resources import TAG_JOB

        original = FakeAutoScalingGroup.replace_autoscaling_group_instances

        def replace(group: Any, count_needed: int, propagated_tags: dict[str, str]) -> None:
            if any(t.get("Key") == TAG_JOB for t in group.tags):
                return  # the simulator's fulfilment loop launches spotnb's instances
            original(group, count_needed, propagated_tags)

        def activities(response: Any) -> Any:
            name = response._get_param("AutoScalingGroupName")
            with self._lock:
                found = list(reversed(  # newest first
                    self.activities.get((response.region, name), [])))
            return ActionResult({"Activities": found})

        def complete_lifecycle_action(response: Any) -> Any:
            # Only an instance in a lifecycle action of that hook (Pending:Wait for the
            # launch hook, Terminating:Wait for the termination hook) can complete it.
            instance_id = str(response._get_param("InstanceId"))
            hook_name = str(response._get_param("LifecycleHookName"))
            result = str(response._get_param("LifecycleActionResult"))
            state = _member(response.autoscaling_backend, instance_id)
            wanted = {"Pending:Wait": "LAUNCHING", "Terminating:Wait": "TERMINATING"}.get(
                state.lifecycle_state if state is not None else "")
            hook = None if state is None or wanted is None else next(
                (h for h in response.autoscaling_backend.describe_lifecycle_hooks(
                    state.auto_scaling_group.name)
                 if h.name == hook_name
                 and h.lifecycle_transition == f"autoscaling:EC2_INSTANCE_{wanted}"), None)
            if state is None or hook is None:
                raise AutoscalingClientError("ValidationError", (
                    f"No active Lifecycle Action found with instance ID {instance_id}"))
            with self._lock:
                self.hooks_completed.append((instance_id, hook_name))
                if wanted == "LAUNCHING":
                    self._launch_waits.pop(instance_id, None)
            if wanted == "LAUNCHING":
                self._end_launch_wait(state, result)
            return EmptyResult()

        def set_instance_protection(response: Any) -> Any:
            for instance_id in response._get_param("InstanceIds", []):
                state = _member(response.autoscaling_backend, instance_id)
                if state is not None and state.lifecycle_state not in PROTECTABLE:
                    raise AutoscalingClientError("ValidationError", (
                        f"The instance {instance_id} is not in InService or EnteringStandby "
                        "or Standby."))
            return original_protect(response)

        def detach_instances(response: Any) -> Any:
            if not _from_simulator(response):  # its own moves model Auto Scaling's
                for instance_id in response._get_param("InstanceIds", []):
                    state = _member(response.autoscaling_backend, instance_id)
                    if state is not None and state.lifecycle_state != "InService":
                        raise AutoscalingClientError("ValidationError", (
                            f"The instance {instance_id} is not in InService."))
            return original_detach(response)

        original_terminate = AutoScalingResponse.terminate_instance_in_auto_scaling_group
        original_protect = AutoScalingResponse.set_instance_protection
        original_detach = AutoScalingResponse.detach_instances

        def terminate_in_group(response: Any) -> Any:
            # Auto Scaling ends a member of a group with a termination hook through that
            # hook: Terminating:Wait (IMDS target-lifecycle-state "Terminated") until
            # its agent completes the hook or the wait runs out (the tick then
            # terminates it); the desired capacity goes down at once if asked.
            instance_id = str(response._get_param("InstanceId"))
            decrement = response._get_bool_param("ShouldDecrementDesiredCapacity", False)
            backend = response.autoscaling_backend
            state = _member(backend, instance_id)
            if state is not None and state.lifecycle_state == "Pending:Wait":
                raise AutoscalingClientError("ScalingActivityInProgress", (
                    f"Scaling activities are in progress for instance {instance_id} "
                    "(Pending:Wait): its launch lifecycle action must complete first."))
            group = state.auto_scaling_group if state is not None else None
            hook = None if group is None else next(
                (h for h in backend.describe_lifecycle_hooks(group.name)
                 if h.lifecycle_transition == "autoscaling:EC2_INSTANCE_TERMINATING"), None)
            with self._lock:
                inst = self.instances.get(instance_id)
            if hook is None or inst is None or state is None or group is None or \
                    not any(t.get("Key") == TAG_JOB for t in group.tags):
                return original_terminate(response)
            now = time.time()
            with self._lock:
                if not inst.ending_in_group:
                    inst.ending_in_group = True
                    inst.hook_until = now + float(hook.heartbeat_timeout) * \
                        self.notice_seconds / 120.0
                    inst.imds.set_target_lifecycle_state("Terminated")
                    self.signals_sent.append((now, inst.id, "terminating"))
                    state.lifecycle_state = "Terminating:Wait"
                    if decrement:
                        group.desired_capacity = max(0, (group.desired_capacity or 0) - 1)
            return ActionResult({"Activity": {
                "ActivityId": secrets.token_hex(16), "AutoScalingGroupName": group.name,
                "Description": f"Terminating EC2 instance: {instance_id}",
                "Cause": "the instance was taken out of service in response to a "
                         "user request", "StartTime": datetime.datetime.now(
                             datetime.timezone.utc), "StatusCode": "InProgress",
                "Progress": 0}})

        original_delete = AutoScalingBackend.delete_auto_scaling_group

        def delete_group(backend: Any, group_name: str) -> None:
            # spotnb deletes its groups with ForceDelete, which ends every instance,
            # protected from scale-in or not, in a lifecycle wait or not (moto's scales
            # in, sparing protected ones and counting only InService).
            group = backend.autoscaling_groups.get(group_name)
            if group is not None:
                for state in group.instance_states:
                    state.protected_from_scale_in = False
                    state.lifecycle_state = "InService"
                    with self._lock:
                        self._launch_waits.pop(state.instance.id, None)
            original_delete(backend, group_name)

        original_active = FakeAutoScalingGroup.active_instances

        def active_instances(group: Any) -> list[Any]:
            # The group's size counts instances launching (Pending:Wait) as AWS does,
            # not only InService ones (moto's): so SetDesiredCapacity below it scales in.
            if not any(t.get("Key") == TAG_JOB for t in group.tags):
                return list(original_active(group))
            return [st for st in group.instance_states if st.lifecycle_state in IN_GROUP]

        original_attach = AutoScalingBackend.attach_instances

        def attach(backend: Any, group_name: str, instance_ids: list[str]) -> None:
            # With a launch hook, an instance joins in Pending:Wait (in the same call,
            # so that nobody sees it InService first). moto's AttachInstances sets the
            # desired capacity to the instances the group holds; the group's own
            # launches leave it (a group of N): kept in the same call, so that nobody
            # sees a desired capacity below the group's minimum meanwhile.
            group = backend.autoscaling_groups.get(group_name)
            desired = None if group is None else group.desired_capacity
            original_attach(backend, group_name, instance_ids)
            with self._lock:
                own = [i for i in instance_ids if i in self._attaching]
                self._attaching.difference_update(own)
            if own and group is not None and desired is not None:
                group.desired_capacity = max(desired, group.min_size)
            hook = next((h for h in backend.describe_lifecycle_hooks(group_name)
                         if h.lifecycle_transition == "autoscaling:EC2_INSTANCE_LAUNCHING"),
                        None)
            if hook is None:
                return
            now = time.time()
            wait = float(hook.heartbeat_timeout or 3600) * self.notice_seconds / 120.0
            for state in backend.autoscaling_groups[group_name].instance_states:
                if state.instance.id in instance_ids:
                    with self._lock:
                        state.lifecycle_state = "Pending:Wait"
                        self._launch_waits[state.instance.id] = (
                            group_name, hook.name, now + wait, hook.default_result or "ABANDON")

        original_create = AutoScalingResponse.create_auto_scaling_group

        def create_group(response: Any) -> Any:
            # moto replaces a group of the same name where AWS answers AlreadyExists;
            # and it ignores the lifecycle hooks made with a group
            # (LifecycleHookSpecificationList): they are added as PutLifecycleHook would,
            # before the group's first launch.
            name = response._get_param("AutoScalingGroupName")
            if name in response.autoscaling_backend.autoscaling_groups:
                raise AutoscalingClientError(
                    "AlreadyExists", f"AutoScalingGroup by this name already exists - A "
                    f"group with the name {name} already exists")
            result = original_create(response)
            for hook in response._get_params().get("LifecycleHookSpecificationList") or ():
                response.autoscaling_backend.create_lifecycle_hook(
                    name=hook["LifecycleHookName"], as_name=name,
                    transition=hook["LifecycleTransition"],
                    timeout=int(hook.get("HeartbeatTimeout") or 3600),
                    result=hook.get("DefaultResult") or "ABANDON")
            return result

        original_update = FakeAutoScalingGroup.update

        def update_group(group: Any, *args: Any, **kwargs: Any) -> None:
            # A request that names no launch template, configuration or policy keeps
            # the group's (moto would drop its mixed-instances policy).
            policy = group.mixed_instances_policy
            if policy and not (kwargs.get("launch_config_name") or kwargs.get(
                    "launch_template") or kwargs.get("mixed_instances_policy")):
                kept = copy.deepcopy(policy)  # named by its id only, as it was given
                kept["LaunchTemplate"]["LaunchTemplateSpecification"].pop(
                    "LaunchTemplateName", None)
                kwargs["mixed_instances_policy"] = kept
            original_update(group, *args, **kwargs)

        original_activities = AutoScalingResponse.describe_scaling_activities
        AutoScalingResponse.create_auto_scaling_group = create_group  # type: ignore[method-assign,assignment]
        FakeAutoScalingGroup.replace_autoscaling_group_instances = replace  # type: ignore[method-assign,assignment]
        AutoScalingResponse.describe_scaling_activities = activities  # type: ignore[method-assign,assignment]
        AutoScalingResponse.complete_lifecycle_action = complete_lifecycle_action  # type: ignore[attr-defined]
        AutoScalingResponse.terminate_instance_in_auto_scaling_group = terminate_in_group  # type: ignore[method-assign,assignment]
        AutoScalingBackend.delete_auto_scaling_group = delete_group  # type: ignore[method-assign,assignment]
        AutoScalingBackend.attach_instances = attach  # type: ignore[method-assign,assignment]
        FakeAutoScalingGroup.active_instances = active_instances  # type: ignore[method-assign,assignment]
        FakeAutoScalingGroup.update = update_group  # type: ignore[method-assign,assignment]
        AutoScalingResponse.set_instance_protection = set_instance_protection  # type: ignore[method-assign,assignment]
        AutoScalingResponse.detach_instances = detach_instances  # type: ignore[method-assign,assignment]

        def unpatch() -> None:
            AutoScalingResponse.create_auto_scaling_group = original_create  # type: ignore[method-assign]
            AutoScalingBackend.attach_instances = original_attach  # type: ignore[method-assign]
            FakeAutoScalingGroup.active_instances = original_active  # type: ignore[method-assign]
            FakeAutoScalingGroup.update = original_update  # type: ignore[method-assign]
            AutoScalingResponse.set_instance_protection = original_protect  # type: ignore[method-assign]
            AutoScalingResponse.detach_instances = original_detach  # type: ignore[method-assign]
            FakeAutoScalingGroup.replace_autoscaling_group_instances = original  # type: ignore[method-assign]
            AutoScalingResponse.describe_scaling_activities = original_activities  # type: ignore[method-assign]
            AutoScalingResponse.terminate_instance_in_auto_scaling_group = original_terminate  # type: ignore[method-assign]
            AutoScalingBackend.delete_auto_scaling_group = original_delete  # type: ignore[method-assign]
            del AutoScalingResponse.complete_lifecycle_action  # type: ignore[attr-defined]

        self._undo.append(unpatch)

    def _fulfil(self, region: str, group: dict[str, Any], now: float) -> None:
        from spotnb.providers.aws.resources import TAG_JOB

        tags = {t["Key"]: t["Value"] for t in group.get("Tags", ())}
        policy = group.get("MixedInstancesPolicy")
        if TAG_JOB not in tags or not policy:
            return
        name = group["AutoScalingGroupName"]
        active = [i for i in group.get("Instances", ())
                  if i.get("LifecycleState") not in ("Terminating", "Terminated")]
        if len(active) >= group["DesiredCapacity"] or \
                now < self._retry_at.get((region, name), 0.0):
            return
        self._launch(region, group, now)

    def _launch(self, region: str, group: dict[str, Any], now: float) -> str | None:
        """Launch one instance for ``group`` as Auto Scaling does (its pools in the order
        of its allocation strategy: :func:`pool_order`); its id, or None if no pool had
        capacity. Attaching it leaves the group's desired capacity as it was. With a
        launch hook, the instance waits in ``Pending:Wait``."""
        from spotnb.providers.aws import _boto

        name = group["AutoScalingGroupName"]
        key = (region, name)
        ec2, asg = self._client("ec2", region), self._client("autoscaling", region)
        policy = group["MixedInstancesPolicy"]
        spec = policy["LaunchTemplate"]
        template = spec["LaunchTemplateSpecification"]
        types = [o["InstanceType"] for o in spec.get("Overrides", ())]
        subnets = [s for s in group.get("VPCZoneIdentifier", "").split(",") if s]
        spot = int(policy.get("InstancesDistribution", {}).get(
            "OnDemandPercentageAboveBaseCapacity", 100)) < 100
        placement = group.get("PlacementGroup") or None
        if placement is not None and placement not in self._placement_groups(region):
            self._activity(key, "Failed", (
                f"Launching a new EC2 instance. Status Reason: The placement group "
                f"'{placement}' is unknown. Launching EC2 instance failed."), types[0],
                subnets[0] if subnets else "")
            self._retry_at[key] = now + CAPACITY_RETRY_SECONDS
            return None
        distribution = policy.get("InstancesDistribution", {})
        strategy = distribution.get("SpotAllocationStrategy", "lowest-price") if spot \
            else distribution.get("OnDemandAllocationStrategy", "prioritized")
        pools = pool_order([(t, subnet, self._subnet(subnet)[1]) for t in types
                            for subnet in subnets], strategy, spot, region,
                           self._allocation_rng)
        for instance_type, subnet, _ in pools:
            az, az_id = self._subnet(subnet)
            params: dict[str, Any] = dict(
                LaunchTemplate={"LaunchTemplateId": template["LaunchTemplateId"],
                                "Version": template.get("Version", "$Latest")},
                InstanceType=instance_type, SubnetId=subnet, MinCount=1, MaxCount=1)
            if spot:
                params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate"}}
            try:
                launched = ec2.run_instances(**params)["Instances"][0]
            except Exception as err:
                if _boto.classify(err) != "capacity":
                    if not _boto.error_code(err):
                        raise
                    # Any other refusal (an instance profile, an image, a permission)
                    # fails the activity, and is not the pool's: the group tries again
                    # later, as Auto Scaling records it.
                    self._activity(key, "Failed", (
                        f"Launching a new EC2 instance. Status Reason: "
                        f"{_boto.error_message(err)}. Launching EC2 instance failed."),
                        instance_type, subnet)
                    self._retry_at[key] = now + CAPACITY_RETRY_SECONDS
                    return None
                self._activity(key, "Failed", (
                    f"Could not launch {'Spot' if spot else 'On-Demand'} Instances. "
                    f"{_boto.error_code(err)} - {_boto.error_message(err)} "
                    "Launching EC2 instance failed."), instance_type, subnet)
                continue
            with self._lock:
                self._placed[launched["InstanceId"]] = placement
                self._attaching.add(launched["InstanceId"])
            try:
                asg.attach_instances(AutoScalingGroupName=name,
                                     InstanceIds=[launched["InstanceId"]])
            except Exception:
                if asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])[
                        "AutoScalingGroups"]:
                    raise
                # Deleted while this launch ran (a rollback, a stop): a forced deletion
                # ends the group's launches in flight too, as on AWS.
                with self._lock:
                    self._attaching.discard(launched["InstanceId"])
                ec2.terminate_instances(InstanceIds=[launched["InstanceId"]])
                return None
            self._activity(key, "Successful", (
                f"Launching a new EC2 instance: {launched['InstanceId']} "
                f"({instance_type} in {az}, {az_id})"), instance_type, subnet)
            self._retry_at.pop(key, None)
            return str(launched["InstanceId"])
        self._retry_at[key] = now + CAPACITY_RETRY_SECONDS
        return None

    def _expire_launch_waits(self, region: str, now: float) -> None:
        """Launch hooks whose wait ran out in ``region``: their ``DefaultResult`` applies."""
        backend = self._asg_backend(region)
        with self._lock:
            due = [(i, w) for i, w in self._launch_waits.items() if w[2] <= now
                   and _member(backend, i) is not None]
            for instance_id, _ in due:
                del self._launch_waits[instance_id]
        for instance_id, (_, hook, _, default) in due:
            state = _member(backend, instance_id)
            if state is not None and state.lifecycle_state == "Pending:Wait":
                log.info("launch hook %s of %s timed out: %s", hook, instance_id, default)
                self._end_launch_wait(state, default)

    def _end_launch_wait(self, state: Any, result: str) -> None:
        """Out of ``Pending:Wait``: in service (``CONTINUE``), or terminated
        (``ABANDON``; the group launches a replacement)."""
        if result == "CONTINUE":
            state.lifecycle_state = "InService"
            return
        group = state.auto_scaling_group
        group.instance_states = [s for s in group.instance_states if s is not state]
        group.autoscaling_backend.ec2_backend.terminate_instances([state.instance.id])

    def _asg_backend(self, region: str) -> Any:
        from moto.autoscaling.models import autoscaling_backends

        from spotnb.testing.server import DEFAULT_ACCOUNT

        return autoscaling_backends[DEFAULT_ACCOUNT][region]

    def _rebalance(self, region: str, group: dict[str, Any], now: float) -> bool:
        """Auto Scaling's capacity rebalancing for a group that has it on: a replacement
        for each instance EC2 recommended rebalancing (the group may exceed its desired
        capacity meanwhile); once that replacement is in service (booted and, if the
        group has a launch hook, that hook completed or its wait over), the at-risk
        instance is ended through the group's termination hook (IMDS
        ``autoscaling/target-lifecycle-state`` ``Terminated``), and terminated when its
        agent completes the hook or the hook's wait runs out; with no such hook, at
        once. Hooks' waits (HeartbeatTimeout) are scaled as the notice period is.
        Whether the group changed (its description is stale then)."""
        name = group["AutoScalingGroupName"]
        with self._lock:
            members = [self.instances[i["InstanceId"]] for i in group.get("Instances", ())
                       if i["InstanceId"] in self.instances]
        if not any(i.rebalance_at is not None for i in members):
            return False  # nothing recommended: no request this tick
        changed = False
        asg = self._client("autoscaling", region)
        hooks = asg.describe_lifecycle_hooks(AutoScalingGroupName=name)["LifecycleHooks"]
        launch_wait = self._hook(hooks, "LAUNCHING")
        ending = self._hook(hooks, "TERMINATING") or ("", 0.0)
        for inst in members:
            if inst.terminated or inst.rebalance_at is None:
                continue
            if inst.rebalanced_by is None and inst.terminate_at is None:
                if now >= self._retry_at.get((region, name), 0.0):
                    # Auto Scaling goes over the group's size for the replacement (moto
                    # refuses to attach past MaxSize: raised meanwhile).
                    asg.update_auto_scaling_group(AutoScalingGroupName=name,
                                                  MaxSize=group["MaxSize"] + 1)
                    inst.rebalanced_by = self._launch(region, group, now)
                    if inst.rebalanced_by is None:
                        asg.update_auto_scaling_group(AutoScalingGroupName=name,
                                                      MaxSize=group["MaxSize"])
                    changed = True
                continue
            with self._lock:
                standby = self.instances.get(inst.rebalanced_by or "")
            if inst.hook_until is None and standby is not None and standby.alive \
                    and inst.terminate_at is None:
                if launch_wait is not None and now < standby.booted + launch_wait[1] \
                        and not self._completed(standby.id, launch_wait[0]):
                    continue  # not in service yet (Pending:Wait)
                inst.hook_until = now + ending[1]
                inst.imds.set_target_lifecycle_state("Terminated")
                self.signals_sent.append((now, inst.id, "terminating"))
                log.info("capacity rebalancing: %s is in service; ending %s through the "
                         "termination hook", standby.id, inst.id)
            if inst.hook_until is not None and inst.terminate_at is None and (
                    now >= inst.hook_until or self._completed(inst.id, ending[0])):
                inst.terminate_at = now  # the tick's termination below takes it
        # The group goes back to its size as each at-risk instance ends: it leaves the
        # group (once: moto decrements the desired capacity at every call).
        for inst in members:
            if inst.rebalanced_by is not None and inst.terminate_at is not None \
                    and inst.terminate_at <= now:
                asg.detach_instances(AutoScalingGroupName=name, InstanceIds=[inst.id],
                                     ShouldDecrementDesiredCapacity=True)
                asg.update_auto_scaling_group(AutoScalingGroupName=name,
                                              MaxSize=max(1, group["MaxSize"] - 1))
                changed = True
        return changed

    def _end_through_hook(self, region: str, group: dict[str, Any], now: float) -> bool:
        """Members that TerminateInstanceInAutoScalingGroup ended through the group's
        termination hook: once their agent completed it or its wait ran out, they leave
        the group and EC2 terminates them. Whether the group changed."""
        from spotnb.providers.aws.resources import LIFECYCLE_HOOK_NAME

        name = group["AutoScalingGroupName"]
        with self._lock:
            members = [self.instances[i["InstanceId"]] for i in group.get("Instances", ())
                       if i["InstanceId"] in self.instances]
        done = [i for i in members if i.ending_in_group and i.terminate_at is None
                and i.hook_until is not None and (
                    now >= i.hook_until or self._completed(i.id, LIFECYCLE_HOOK_NAME))]
        for inst in done:
            inst.terminate_at = now  # the next tick's termination takes it
            self._client("autoscaling", region).detach_instances(
                AutoScalingGroupName=name, InstanceIds=[inst.id],
                ShouldDecrementDesiredCapacity=False)
        return bool(done)

    def _hook(self, hooks: list[dict[str, Any]], transition: str) -> tuple[str, float] | None:
        """The group's lifecycle hook for ``transition`` (``LAUNCHING``,
        ``TERMINATING``): its name and its wait in real seconds (HeartbeatTimeout,
        scaled as the notice period is); None if it has none."""
        for h in hooks:
            if h["LifecycleTransition"] == f"autoscaling:EC2_INSTANCE_{transition}":
                return (h["LifecycleHookName"],
                        float(h.get("HeartbeatTimeout", 3600)) * self.notice_seconds / 120.0)
        return None

    def _completed(self, instance_id: str, hook: str) -> bool:
        """Whether ``instance_id``'s agent completed lifecycle hook ``hook``."""
        with self._lock:
            return (instance_id, hook) in self.hooks_completed

    def _activity(self, group: tuple[str, str], status: str, message: str,
                  instance_type: str, subnet: str) -> None:
        """Record a scaling activity of ``group`` ((region, name)) in ``subnet``; a
        failed one is also Auto Scaling's event (:mod:`spotnb.testing.events`)."""
        now = datetime.datetime.now(datetime.timezone.utc)
        activity = {
            "ActivityId": str(uuid.uuid4()), "AutoScalingGroupName": group[1],
            "Description": f"Launching a new EC2 instance ({instance_type})",
            "Cause": f"At {now.isoformat()} an instance was started in response to a "
                     "difference between desired and actual capacity.",
            "StartTime": now, "EndTime": now, "StatusCode": status,
            "StatusMessage": message if status != "Successful" else "", "Progress": 100,
            "Details": json.dumps({"Subnet ID": subnet,
                                   "Availability Zone": self._subnet(subnet)[0]
                                   if subnet else ""}),
        }
        with self._lock:
            self.activities.setdefault(group, []).append(activity)
        if status == "Failed":
            self._launch_failed(group[0], activity)


def _member(backend: Any, instance_id: str) -> Any:
    """moto's record of ``instance_id`` in its Auto Scaling group (None if in none)."""
    return next((st for g in backend.autoscaling_groups.values()
                 for st in g.instance_states if st.instance.id == instance_id), None)


def _from_simulator(response: Any) -> bool:
    """Whether a request to moto is the simulator's own (its User-Agent's origin)."""
    return "spotnb-origin/simulator" in str(response.headers.get("User-Agent", ""))
