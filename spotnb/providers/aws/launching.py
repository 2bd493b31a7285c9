"""The launch's steps that make a job's capacity in a region, as a part of
:class:`~spotnb.providers.aws.AwsProvider` (its base class, :class:`LaunchSteps`): the
image (the region's own public parameter), subnets, the shared no-inbound security
group, the job's IAM role, launch template and Auto Scaling group with its lifecycle
hooks; and the move of a job's capacity to another of its regions
(:meth:`LaunchSteps.move_region`, :mod:`.failover`). The launch's narrative is in
:mod:`spotnb.providers.aws`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from spotnb.protocol import billing, layout
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import open_store
from spotnb.providers.aws import _boto, cluster
from spotnb.providers.aws.bootstrap import bundle, user_data
from spotnb.providers.aws.leftovers import delete_role_named
from spotnb.providers.aws.policies import instance_policy, trust_policy
from spotnb.providers.aws.resources import (
    IAM_PATH,
    LAUNCH_HOOK_NAME,
    LAUNCH_HOOK_SECONDS,
    LIFECYCLE_HOOK_NAME,
    SECURITY_GROUP,
    TAG_JOB,
    TAG_MANAGED,
    group_name,
    launch_template_data,
    mixed_instances_policy,
    rebalancing,
    region_types,
    role_name,
    tags,
    template_name,
)
from spotnb.providers.aws.settings import AwsSettings
from spotnb.providers.imds import TERMINATION_HOOK_SECONDS

__all__ = ["IAM_PROPAGATION_ATTEMPTS", "LEAVE_SECONDS", "LIFECYCLE_HOOK_SECONDS",
           "LaunchSteps", "lifecycle_hooks"]

log = logging.getLogger(__name__)

# A new instance profile is "invalid" to Auto Scaling until IAM has propagated it
# (usually under 10 s): the group is created again with backoff for about a minute.
IAM_PROPAGATION_ATTEMPTS = 9
_IAM_NOT_YET = frozenset({"Invalid IamInstanceProfile", "Invalid IAM Instance Profile",
                          "iamInstanceProfile"})
# A standby group's termination hook waits this long before Auto Scaling ends the
# instance the job moves off: EC2's notice period, for the agent's final save (the
# instance agent completes the hook once the job agent is done, which ends the wait).
LIFECYCLE_HOOK_SECONDS = int(TERMINATION_HOOK_SECONDS)
#: A move to another region waits this long for the nodes it ends in the region it
#: leaves to be gone, before the new region's group launches: the termination hook's
#: wait (whose timeout ends a node that never completes it) and EC2's shutdown. A node
#: still there then is ended by its group's deletion, without waiting more.
LEAVE_SECONDS = LIFECYCLE_HOOK_SECONDS + 60.0


def lifecycle_hooks() -> list[dict[str, Any]]:
    """A standby group's two lifecycle hooks (made with the group).

    The job moves to a ready standby (whose agent completes the launch hook then) by
    ending the at-risk instance through the termination hook, whose wait (IMDS
    ``target-lifecycle-state`` ``Terminated``) is its agent's notice, as long as EC2's,
    for its final save. (A move to another region ends the nodes it leaves through the
    same hook: :meth:`LaunchSteps.move_region`.)"""
    return [
        {"LifecycleHookName": LAUNCH_HOOK_NAME,
         "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING",
         "HeartbeatTimeout": LAUNCH_HOOK_SECONDS, "DefaultResult": "CONTINUE"},
        termination_hook(),
    ]


def termination_hook() -> dict[str, Any]:
    """The termination lifecycle hook: its wait is a node's notice (see above)."""
    return {"LifecycleHookName": LIFECYCLE_HOOK_NAME,
            "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "HeartbeatTimeout": LIFECYCLE_HOOK_SECONDS, "DefaultResult": "CONTINUE"}


class LaunchSteps:
    """The launch's steps in a region (the module docstring); a part of
    :class:`~spotnb.providers.aws.AwsProvider`, whose state and calls it uses."""

    settings: AwsSettings
    _zones: dict[str, cluster.Zone]
    _job_regions: dict[str, str]

    def client(self, service: str, region: str) -> Any:
        raise NotImplementedError

    def region(self, job_id: str | None = None) -> str:
        raise NotImplementedError

    def _sweep_networks(self, region: str) -> None:
        raise NotImplementedError

    def _delete_group(self, job_id: str, region: str) -> bool:
        raise NotImplementedError

    def _delete_template(self, job_id: str, region: str) -> bool:
        raise NotImplementedError

    def _instances(self, region: str, job_id: str | None,
                   states: tuple[str, ...]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _make_capacity(self, spec: JobSpec, region: str, profile_arn: str,
                       tag_list: list[dict[str, str]], undo: list[tuple[str, Callable[[], Any]]],
                       hold: bool = False
                       ) -> tuple[list[tuple[str, str]], cluster.Zone | None]:
        """The job's capacity in ``region`` (launch Steps 1, 4 and 5; each made thing
        added to ``undo``): its subnets there, and a multi-node job's AZ. ``hold``: its
        group is made with no instance, until :meth:`_release_group`."""
        job_id = spec.job_id
        # Step 1: image (the region's own parameter) and network.
        ami = self._ami(region)
        zone = self._zones.get(job_id)
        network: cluster.Network | None = None
        if zone is None:
            subnets, vpc = self._subnets(region, region_types(spec, region))
            security_group = self._security_group(region, vpc)
        else:
            # Step 1b: a multi-node job's AZ, placement group and security group;
            # first the leftovers of ended jobs that AWS would not delete then.
            self._sweep_networks(region)
            subnets = [(zone.subnet, zone.az_id)]
            network = cluster.create_network(self.client("ec2", region), spec, zone,
                                             tag_list, undo)
            security_group = network.security_group
        # Step 4: the launch template.
        ec2 = self.client("ec2", region)
        script = user_data(job_id=job_id, store_uri=spec.store_uri, wheel=bundle(),
                           store_region=spec.resources.region)
        template = _boto.with_backoff(lambda: ec2.create_launch_template(
            LaunchTemplateName=template_name(job_id),
            VersionDescription=f"spotnb job {job_id}",
            LaunchTemplateData=launch_template_data(
                ami=ami, profile_arn=profile_arn, security_group=security_group,
                script=script, tag_list=tag_list, efa=zone is not None and zone.efa),
            TagSpecifications=[{"ResourceType": "launch-template", "Tags": tag_list}],
        ), what="creating the launch template")["LaunchTemplate"]
        undo.append(("launch template", lambda: self._delete_template(job_id, region)))
        # Step 5: the group (Auto Scaling may not see the new profile for a while).
        # In the undo list before the call: a call whose answer is lost may have
        # made the group, which launches at once (a missing group is no error).
        undo.append(("Auto Scaling group", lambda: self._delete_group(job_id, region)))
        self._create_group(spec, region, template["LaunchTemplateId"], subnets, tag_list,
                           ondemand=self.settings.ondemand_after == 0,
                           placement_group=network.placement_group if network else None,
                           hold=hold)
        return subnets, zone

    def _delete_network(self, job_id: str, region: str) -> None:
        """Delete the job's security and placement groups in ``region``; what is still
        in use waits for the next launch there or `spotnb aws cleanup`."""
        left = cluster.delete_network(self.client("ec2", region), job_id, multi_node=False)
        if left:
            log.info("job %s's %s in %s: in use until its instances are gone; the next "
                     "launch there or `spotnb aws cleanup` deletes them", job_id,
                     " and ".join(left), region)

    def move_region(self, spec: JobSpec, target: str, nodes: Sequence[str] = (),
                    tell: Callable[[], None] | None = None) -> None:
        """Move the job's capacity to ``target`` (:mod:`.failover`), as the local cloud
        moves its group (:mod:`spotnb.providers.failover`). ``nodes``: the job's
        instances still in the region it leaves (a multi-node job's, fewer than its
        minimum: they do not train)::

            Step 1  its group, template and network made in ``target`` (its role,
                    wheel, secrets and store stay); while ``nodes`` are still in the
                    region it leaves, the new group is made with no instance. Raises,
                    with nothing left in ``target``, when they cannot be made: the job
                    then stays where it was
            Step 2  ``tell()``: the caller says the move (its ``region`` event, each
                    node's notice); from here on nothing raises
            Step 3  each of ``nodes`` gets its notice (:meth:`_end_nodes`): marked in
                    the store, then ended by Auto Scaling through its group's
                    termination hook, whose wait its agents read as their notice (a
                    node that trains saves; one that does not has nothing to save);
                    each gives up its node slot and its instance agent ends the wait.
                    Waited for up to LEAVE_SECONDS
            Step 4  the group and template deleted in the region it leaves (ending
                    what is still there), and its network, which AWS keeps a while
                    after an instance in it is gone (then the job's end deletes it)
            Step 5  the new group launches the job's nodes: they are never in two
                    regions at once
        """
        job_id = spec.job_id
        previous = self.region(job_id)
        iam = self.client("iam", spec.resources.region)
        profile_arn = str(iam.get_instance_profile(
            InstanceProfileName=role_name(job_id))["InstanceProfile"]["Arn"])
        tag_list = tags(job_id, spec.store_uri, spec.name)
        undo: list[tuple[str, Callable[[], Any]]] = []
        old_zone = self._zones.pop(job_id, None)
        try:
            if spec.resources.max_nodes > 1:
                rows, _ = self._subnet_rows(target)
                self._zones[job_id] = cluster.choose_zone(self.client("ec2", target), spec,
                                                          rows, region=target)
            self._make_capacity(spec, target, profile_arn, tag_list, undo,
                                hold=bool(nodes))
        except BaseException:
            for label, release in reversed(undo):
                try:
                    release()
                except Exception:
                    log.exception("could not release the %s of job %s in %s; `spotnb aws "
                                  "cleanup` will find it", label, job_id, target)
            if old_zone is not None:
                self._zones[job_id] = old_zone
            raise
        self._job_regions[job_id] = target
        if tell is not None:
            try:
                tell()
            except Exception:
                log.warning("could not say job %s's move to %s", job_id, target,
                            exc_info=True)
        if nodes:
            self._end_nodes(spec, previous, target, nodes)
        self._leave_region(job_id, previous)
        if nodes:
            self._release_group(spec, target)
        log.info("moved job %s's capacity from %s to %s", job_id, previous, target)

    def _end_nodes(self, spec: JobSpec, region: str, target: str,
                   nodes: Sequence[str]) -> None:
        """Step 3 of :meth:`move_region`: the job's ``nodes`` in ``region`` get their
        notice and go. The group's termination hook (a group with warm standbys has
        it; another gets it now) makes each node's end a wait that its agents read as
        their notice (IMDS ``target-lifecycle-state``); the mark in the store
        (:func:`spotnb.protocol.layout.leaving_region_key`) tells them why; the group's
        minimum and desired capacity go to 0 so that it launches nobody more there.
        Requests: a PutLifecycleHook (a group without standbys), an
        UpdateAutoScalingGroup, a PUT and a TerminateInstanceInAutoScalingGroup per
        node, a DescribeInstances per ``capacity_poll`` while they go (free)."""
        job_id = spec.job_id
        asg = self.client("autoscaling", region)
        name = group_name(job_id)
        store = open_store(spec.store_uri)
        try:
            if not rebalancing(spec):
                asg.put_lifecycle_hook(AutoScalingGroupName=name, **termination_hook())
            asg.update_auto_scaling_group(AutoScalingGroupName=name, MinSize=0,
                                          DesiredCapacity=len(nodes))
        except Exception as err:
            log.warning("job %s's nodes in %s get no notice (%s): its group's deletion "
                        "ends them", job_id, region, _boto.error_code(err) or err)
            return
        mark = json.dumps({"reason": billing.REGION_MOVE, "region": target,
                           "previous": region, "time": time.time()}).encode()
        ending = []
        for instance_id in nodes:
            try:
                store.put(layout.leaving_region_key(instance_id), mark)
                asg.terminate_instance_in_auto_scaling_group(
                    InstanceId=instance_id, ShouldDecrementDesiredCapacity=True)
                ending.append(instance_id)
            except Exception as err:
                log.warning("node %s of job %s gets no notice (%s): its group's deletion "
                            "ends it", instance_id, job_id, _boto.error_code(err) or err)
        deadline = time.monotonic() + LEAVE_SECONDS
        while ending and time.monotonic() < deadline:
            try:
                live = {i["InstanceId"] for i in self._instances(
                    region, job_id, ("pending", "running", "stopping", "stopped"))}
            except Exception as err:
                log.info("cannot tell whether job %s's nodes in %s are gone: %s", job_id,
                         region, err)
                live = set(ending)
            ending = [i for i in ending if i in live]
            if ending:
                time.sleep(self.settings.capacity_poll)
        if ending:
            log.warning("job %s's nodes %s in %s are still there %g s after their notice: "
                        "its group's deletion ends them", job_id, ", ".join(ending), region,
                        LEAVE_SECONDS)

    def _release_group(self, spec: JobSpec, region: str) -> None:
        """Step 5 of :meth:`move_region`: the job's group in ``region``, made with no
        instance, launches its nodes (one UpdateAutoScalingGroup)."""
        nodes = spec.resources.max_nodes
        asg = self.client("autoscaling", region)
        try:
            _boto.with_backoff(lambda: asg.update_auto_scaling_group(
                AutoScalingGroupName=group_name(spec.job_id), MinSize=nodes,
                DesiredCapacity=nodes), what="launching the job's nodes")
        except Exception:
            log.exception("job %s's group in %s could not be told to launch its nodes; a "
                          "notebook that follows the job tells it (finish_move)",
                          spec.job_id, region)

    def _leave_region(self, job_id: str, region: str) -> None:
        """Step 4 of :meth:`move_region`: the job's group, template and network in the
        region it leaves."""
        self._delete_group(job_id, region)
        self._delete_template(job_id, region)
        try:
            self._delete_network(job_id, region)
        except Exception:
            log.warning("could not delete job %s's network in %s; `spotnb aws cleanup` "
                        "will", job_id, region, exc_info=True)

    def finish_move(self, spec: JobSpec, previous: str, region: str) -> bool:
        """A move whose notebook closed between its Steps 2 and 5 (:meth:`move_region`)
        is finished by the next that follows the job: the group in ``region`` that holds
        no instance launches the job's nodes, and what is left in ``previous`` is
        deleted. One DescribeAutoScalingGroups; whether there was a move to finish."""
        asg = self.client("autoscaling", region)
        found = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(spec.job_id)])["AutoScalingGroups"]
        if not found or found[0].get("MinSize") or found[0].get("DesiredCapacity"):
            return False
        log.info("finishing job %s's move from %s to %s", spec.job_id, previous, region)
        self._leave_region(spec.job_id, previous)
        self._release_group(spec, region)
        return True

    # -- launch steps

    def _ami(self, region: str) -> str:
        if self.settings.ami:
            return self.settings.ami
        ssm = self.client("ssm", region)
        try:
            return str(ssm.get_parameter(Name=self.settings.ami_parameter)["Parameter"]["Value"])
        except Exception as err:
            if _boto.error_code(err) == "ParameterNotFound":
                raise SpecError(
                    f"the AMI parameter {self.settings.ami_parameter} does not exist in "
                    f"{region}: set SPOTNB_AWS_AMI to an AMI id, or SPOTNB_AWS_AMI_PARAMETER "
                    "to another Deep Learning AMI parameter") from None
            _boto.raise_for(err, "looking up the Deep Learning AMI")
            raise

    def _subnet_rows(self, region: str) -> tuple[list[dict[str, Any]], Any]:
        """The subnets spotnb may use (SPOTNB_AWS_SUBNETS, else the default VPC's), as
        DescribeSubnets rows, and the EC2 client."""
        ec2 = self.client("ec2", region)
        if self.settings.subnets:
            rows = ec2.describe_subnets(SubnetIds=list(self.settings.subnets))["Subnets"]
        else:
            vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise SpecError(f"{region} has no default VPC: create one (`aws ec2 "
                                "create-default-vpc`) or set SPOTNB_AWS_SUBNETS to subnet ids")
            rows = ec2.describe_subnets(Filters=[
                {"Name": "vpc-id", "Values": [vpcs[0]["VpcId"]]},
                {"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
        return list(rows), ec2

    def _subnets(self, region: str,
                 instance_types: tuple[str, ...]) -> tuple[list[tuple[str, str]], str]:
        """[(subnet id, AZ id)] to launch in, and their VPC."""
        rows, ec2 = self._subnet_rows(region)
        offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(instance_types)}],
        ).get("InstanceTypeOfferings", ())}
        usable = [r for r in rows if not offered or r["AvailabilityZone"] in offered]
        if not usable:
            raise SpecError(f"none of {', '.join(instance_types)} is offered in the subnets "
                            f"of {region}: choose other types or another region")
        usable.sort(key=lambda r: r["AvailabilityZone"])
        return ([(r["SubnetId"], r.get("AvailabilityZoneId", r["AvailabilityZone"]))
                 for r in usable], str(usable[0]["VpcId"]))

    def _security_group(self, region: str, vpc: str) -> str:
        """The shared group without ingress rules (egress only: S3, AWS APIs, PyPI)."""
        ec2 = self.client("ec2", region)
        found = ec2.describe_security_groups(Filters=[
            {"Name": "group-name", "Values": [SECURITY_GROUP]},
            {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
        if found:
            group = found[0]
            if group.get("IpPermissions"):
                raise SpecError(
                    f"the security group {SECURITY_GROUP} ({group['GroupId']}) has inbound "
                    "rules; spotnb instances open no port: remove them or delete the group")
            return str(group["GroupId"])
        return str(ec2.create_security_group(
            GroupName=SECURITY_GROUP, VpcId=vpc,
            Description="spotnb instances: no inbound traffic",
            TagSpecifications=[{"ResourceType": "security-group",
                                "Tags": [{"Key": TAG_MANAGED, "Value": "true"}]}],
        )["GroupId"])

    def _create_role(self, spec: JobSpec, account: str, tag_list: list[dict[str, str]]) -> str:
        iam = self.client("iam", spec.resources.region)
        name = role_name(spec.job_id)
        policy = instance_policy(job_id=spec.job_id, store_uri=spec.store_uri,
                                 region=spec.resources.region, account=account,
                                 regions=spec.resources.regions)
        iam_tags = [t for t in tag_list if t["Key"] != "Name"]
        try:
            iam.create_role(RoleName=name, Path=IAM_PATH, MaxSessionDuration=3600,
                            AssumeRolePolicyDocument=json.dumps(trust_policy("ec2.amazonaws.com")),
                            Description=f"spotnb job {spec.job_id}: its store prefix only",
                            Tags=iam_tags)
            iam.put_role_policy(RoleName=name, PolicyName="spotnb-job",
                                PolicyDocument=json.dumps(policy))
            profile = iam.create_instance_profile(InstanceProfileName=name, Path=IAM_PATH,
                                                  Tags=iam_tags)["InstanceProfile"]
            iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        except Exception as err:
            delete_role_named(iam, name)
            _boto.raise_for(err, "creating the job's IAM role")
            raise
        return str(profile["Arn"])

    def _create_group(self, spec: JobSpec, region: str, template_id: str,
                      subnets: list[tuple[str, str]], tag_list: list[dict[str, str]],
                      ondemand: bool, placement_group: str | None = None,
                      hold: bool = False) -> None:
        asg = self.client("autoscaling", region)
        name = group_name(spec.job_id)
        nodes = spec.resources.max_nodes  # a multi-node job's group keeps MAX instances
        held = 0 if hold else nodes  # a move's new group: none until the old nodes went
        params: dict[str, Any] = dict(
            # A standby group has room for one warm standby (a multi-node job's: for
            # one node at a time), which the agent of the instance recommended asks
            # for (SetDesiredCapacity) on a rebalance recommendation, timed in the
            # instance's first hour (providers/aws/standby.py); not Auto Scaling's
            # capacity rebalancing, which launches it at once and would forfeit that
            # hour's refund (protocol/billing.py).
            AutoScalingGroupName=name, MinSize=held,
            MaxSize=nodes + 1 if rebalancing(spec) else nodes, DesiredCapacity=held,
            VPCZoneIdentifier=",".join(s for s, _ in subnets),
            MixedInstancesPolicy=mixed_instances_policy(
                template_id=template_id, instance_types=region_types(spec, region),
                max_price=spec.resources.max_price, ondemand=ondemand,
                strategy=self.settings.spot_strategy),
            CapacityRebalance=False,
            HealthCheckType="EC2",
            Tags=[{**t, "PropagateAtLaunch": False, "ResourceId": name,
                   "ResourceType": "auto-scaling-group"} for t in tag_list],
        )
        if placement_group is not None:
            params["PlacementGroup"] = placement_group
        if rebalancing(spec):
            # Made with the group, not after it: a hook added to a group that exists
            # applies to the instances launched after it, and the group launches its
            # first at once (CreateAutoScalingGroup's LifecycleHookSpecificationList:
            # "lifecycle hooks to add to the Auto Scaling group before instances are
            # launched"). One call also leaves no group without its hooks to roll back.
            params["LifecycleHookSpecificationList"] = lifecycle_hooks()

        def create() -> None:
            try:
                asg.create_auto_scaling_group(**params)
            except Exception as err:
                # A retry after an answer that was lost: the first try made the group.
                if _boto.error_code(err) != "AlreadyExists" or not self._group_is_jobs(asg, spec):
                    raise

        _boto.with_backoff(create, what="creating the Auto Scaling group",
                           attempts=IAM_PROPAGATION_ATTEMPTS, retry_codes=_IAM_NOT_YET)

    @staticmethod
    def _group_is_jobs(asg: Any, spec: JobSpec) -> bool:
        """Whether the job's group exists and carries its job's tag."""
        found = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(spec.job_id)]).get("AutoScalingGroups", ())
        return any(t.get("Key") == TAG_JOB and t.get("Value") == spec.job_id
                   for g in found for t in g.get("Tags", ()))
