"""What the AWS provider creates, by name, tag and document: pure functions, no calls.

Everything a job creates carries its id, so :meth:`AwsProvider.cleanup` can find it:

==========================  ==============================================  ==========
resource                    name                                            lifetime
==========================  ==============================================  ==========
Auto Scaling group          ``spotnb-<job_id>``                             the job
launch template             ``spotnb-<job_id>``                             the job
IAM role, instance profile  ``spotnb-job-<job_id>`` (path ``/spotnb/``)     the job
bootstrap wheel             ``<job prefix>/bootstrap/spotnb-<v>-py3-none-any.whl``  the job
security group              ``spotnb-no-inbound`` (one per VPC, no ingress)  shared
training security group     ``spotnb-<job_id>`` (multi-node: ingress from   the job
                            itself only, :func:`training_ingress`)
cluster placement group     ``spotnb-<job_id>`` (multi-node)                 the job
SSM parameters (secrets)    ``/spotnb/<job_id>/<NAME>`` (SecureString,       the job
                            :mod:`.parameters`)
FIS role                    ``spotnb-fis`` (``%spot_interrupt`` on AWS)      shared
bucket                      ``spotnb-<account>-<region>`` (default store)    shared
==========================  ==============================================  ==========

Tags: ``spotnb:job-id`` (the job), ``spotnb:store`` (the job's store URI, so cleanup
can tell a finished job from a running one), ``spotnb:managed=true`` on everything.

The instance role (:func:`instance_policy`) is least-privilege: objects under the job's
prefix only, listing only that prefix, deleting only its own group, template, role and
profile (by ARN and by tag), a multi-node job's own security and placement groups (by
tag), reading and deleting its own secrets (SSM parameters under
``/spotnb/<job_id>/``), plus read-only calls that AWS cannot scope to a resource.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.providers.aws import parameters

TAG_JOB = "spotnb:job-id"
TAG_STORE = "spotnb:store"
TAG_MANAGED = "spotnb:managed"
IAM_PATH = "/spotnb/"
SECURITY_GROUP = "spotnb-no-inbound"
FIS_ROLE = "spotnb-fis"
BOOTSTRAP_PREFIX = "bootstrap"

#: The default image: AWS's Deep Learning AMI for PyTorch, the newest framework line AWS
#: supports ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.11 (Ubuntu 24.04)",
#: first released 2026-08-15; DLAMI release notes), from its public SSM parameter
#: (DLAMI Developer Guide, "Finding the ID of a DLAMI": the AMI's name without "deep",
#: "learning" and "ami"), whose ``latest`` follows the line's patch releases. Python
#: with PyTorch at /opt/pytorch/bin/python. When AWS ends the line's support, move to
#: the next one here. Override with SPOTNB_AWS_AMI_PARAMETER or SPOTNB_AWS_AMI.
DLAMI_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.11 (Ubuntu 24.04)"
DLAMI_PARAMETER = ("/aws/service/deeplearning/ami/x86_64/"
                   "oss-nvidia-driver-gpu-pytorch-2.11-ubuntu-24.04/latest/ami-id")
DLAMI_PYTHON = "/opt/pytorch/bin/python"
#: The instance families that image supports (its release notes' supported_ec2_instances:
#: G4dn, G5, G6, Gr6, G6e, P4 (p4d), P4de, P5, P5e, P5en, P6-B200). Others are refused
#: with it: AMD (g4ad), Arm (g5g), Inferentia/Trainium and V100 (p3) instances need
#: another image (SPOTNB_AWS_AMI).
DLAMI_FAMILIES = ("g4dn", "g5", "g6", "gr6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en",
                  "p6-b200")

# Actions AWS cannot restrict to a resource; all are read-only. The instance agent
# (:mod:`.instance`) needs each of them; nothing else on the instance calls AWS.
READ_ONLY_ACTIONS = (
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeInstances",
    "ec2:DescribeLaunchTemplates",
    "ec2:DescribeSecurityGroups",  # a multi-node job's own group, to delete it
    "ec2:DescribePlacementGroups",  # its placement group, if no peer deleted it
    "ec2:DescribeSpotPriceHistory",
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeScalingActivities",
    "pricing:GetProducts",
)


@dataclasses.dataclass(frozen=True)
class AwsSettings:
    """Provider settings from the environment (none is needed; all have defaults).

    ``SPOTNB_AWS_AMI``             an AMI id to use instead of the Deep Learning AMI
    ``SPOTNB_AWS_AMI_PARAMETER``   the SSM parameter to read the AMI id from
    ``SPOTNB_AWS_SUBNETS``         comma-separated subnet ids (default: the default VPC's
                                   subnets in every AZ that offers one of the types)
    ``SPOTNB_AWS_ONDEMAND_AFTER``  seconds without spot capacity after which the group
                                   may launch on-demand (default: never, spot only)
    ``SPOTNB_AWS_CAPACITY_POLL``   seconds between looks at the group's scaling
                                   activities while waiting for capacity (default 5)
    ``SPOTNB_AWS_LAUNCH_FAILURE``  seconds of failed launches that are not about
                                   capacity (and no instance) after which the job fails
                                   with AWS's reason (default 300: IAM propagation of a
                                   new instance profile heals within it)
    ``SPOTNB_AWS_SPOT_STRATEGY``   how Auto Scaling picks among the job's types
                                   (:data:`SPOT_STRATEGIES`; default
                                   ``price-capacity-optimized``, which ignores their order)
    """

    ami: str | None = None
    ami_parameter: str = DLAMI_PARAMETER
    subnets: tuple[str, ...] = ()
    ondemand_after: float | None = None
    capacity_poll: float = 5.0
    launch_failure: float = 300.0
    spot_strategy: str = "price-capacity-optimized"

    @classmethod
    def from_env(cls) -> AwsSettings:
        env = os.environ
        subnets = tuple(s.strip() for s in env.get("SPOTNB_AWS_SUBNETS", "").split(",")
                        if s.strip())
        return cls(
            ami=env.get("SPOTNB_AWS_AMI") or None,
            ami_parameter=env.get("SPOTNB_AWS_AMI_PARAMETER") or DLAMI_PARAMETER,
            subnets=subnets,
            ondemand_after=_seconds(env, "SPOTNB_AWS_ONDEMAND_AFTER"),
            capacity_poll=_seconds(env, "SPOTNB_AWS_CAPACITY_POLL") or 5.0,
            launch_failure=_seconds(env, "SPOTNB_AWS_LAUNCH_FAILURE") or 300.0,
            spot_strategy=_strategy(env.get("SPOTNB_AWS_SPOT_STRATEGY") or
                                    "price-capacity-optimized"),
        )


#: The spot allocation strategies a job's group may use, and what each does with the
#: order of the job's instance types (Auto Scaling User Guide, "Allocation strategies
#: for multiple instance types"):
SPOT_STRATEGIES = {
    # The pools least likely to be interrupted soon, then the lowest price among them:
    # the order of the types is no preference. spotnb's default (AWS recommends it).
    "price-capacity-optimized": "the order of the types is no preference",
    # The pools with the most capacity, taking the order as a preference "on a
    # best-effort basis": for a job whose first type matters (a faster GPU, say).
    "capacity-optimized-prioritized": "the order of the types is a preference, "
                                      "capacity first",
}


def image_problem(settings: AwsSettings, instance_types: tuple[str, ...]) -> str | None:
    """Why the job's types cannot run the image it would get, or None: the default image
    (:data:`DLAMI_PARAMETER`) supports the families :data:`DLAMI_FAMILIES` only. An image
    of the user's own (SPOTNB_AWS_AMI or SPOTNB_AWS_AMI_PARAMETER) is the user's call."""
    if settings.ami or settings.ami_parameter != DLAMI_PARAMETER:
        return None
    others = [t for t in instance_types if t.split(".")[0] not in DLAMI_FAMILIES]
    if not others:
        return None
    return (f"{', '.join(others)} cannot run spotnb's default image, the {DLAMI_NAME} "
            f"(it supports {', '.join(DLAMI_FAMILIES)}): choose one of those types, or "
            "set SPOTNB_AWS_AMI to an image of yours for them")


def _strategy(name: str) -> str:
    if name not in SPOT_STRATEGIES:
        raise SpecError(f"SPOTNB_AWS_SPOT_STRATEGY must be one of "
                        f"{', '.join(SPOT_STRATEGIES)}, not {name!r}")
    return name


def _seconds(env: Any, name: str) -> float | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise SpecError(f"{name} must be a number of seconds, not {raw!r}")
    return value


# ------------------------------------------------------------------------- names

#: The termination lifecycle hook of a standby group (:func:`rebalancing`): its wait is
#: the instance's final save when the job moves off it; the instance agent completes it.
LIFECYCLE_HOOK_NAME = "spotnb-final-save"
#: The launch lifecycle hook of a standby group: an instance is in service once its
#: instance agent completes it: at once for the job's instance, when its job agent holds
#: the lease; for a warm standby, once it is ready (kernel started, checkpoint
#: prefetched, cell at its restore point).
LAUNCH_HOOK_NAME = "spotnb-standby-ready"
#: EC2's boot, as the instance agent counts it when it times a standby to be ready as
#: its instance's first hour ends (spotnb.protocol.standby.standby_wait).
STANDBY_BOOT_SECONDS = 90
#: How long a standby may take to be ready: EC2's boot and the standby policy's hold
#: (spotnb.protocol.standby.STANDBY_HOLD_SECONDS, 600 s). The launch hook waits as long;
#: the job's instance gives back a standby not ready by then.
LAUNCH_HOOK_SECONDS = STANDBY_BOOT_SECONDS + 600


def rebalancing(spec: JobSpec) -> bool:
    """Whether the job's group has warm standbys (its ``policy.standby``): room for one
    instance more than its nodes, the two lifecycle hooks, and instance agents that ask
    for a standby on a rebalance recommendation and move the job (a node) to it
    (providers/aws/standby.py)."""
    return bool(spec.policy.standby)


def group_name(job_id: str) -> str:
    return f"spotnb-{job_id}"


def template_name(job_id: str) -> str:
    return f"spotnb-{job_id}"


def role_name(job_id: str) -> str:
    return f"spotnb-job-{job_id}"


def placement_group_name(job_id: str) -> str:
    """A multi-node job's cluster placement group."""
    return f"spotnb-{job_id}"


def training_group_name(job_id: str) -> str:
    """A multi-node job's security group (its nodes reach each other, nobody else)."""
    return f"spotnb-{job_id}"


def training_ingress(group_id: str, efa: bool) -> list[dict[str, Any]]:
    """The ingress rules of a multi-node job's security group: from itself only.

    The ports are not fixed: torchelastic's rendezvous store (``TCPStore`` on port 0,
    named in ``rendezvous.json``), ``MASTER_PORT`` and gloo's and NCCL's pair
    connections all bind ephemeral ports, so the rule opens every TCP port, but only to
    instances in this same group (source = the group: the job's own nodes). With EFA,
    AWS requires all traffic from the group itself (EFA's SRD is not TCP), so the rule
    is protocol ``-1`` with the same source. No rule admits anything else: the nodes
    have no other inbound port (egress stays open: S3, the AWS APIs, PyPI).
    """
    pair = {"GroupId": group_id, "Description": "the job's own nodes (training traffic)"}
    if efa:
        return [{"IpProtocol": "-1", "UserIdGroupPairs": [pair]}]
    return [{"IpProtocol": "tcp", "FromPort": 0, "ToPort": 65535, "UserIdGroupPairs": [pair]}]


def training_egress(group_id: str, efa: bool) -> list[dict[str, Any]]:
    """The egress rules a multi-node job's security group needs besides the default
    one (all traffic to 0.0.0.0/0): with EFA, all traffic to the group itself.

    EFA's OS-bypass traffic is not IP, so an address range never matches it: AWS's EFA
    set-ups give the group a self-referencing outbound rule as well as the inbound one
    (AWS PCS User Guide, "Create a security group to support EFA communications":
    ``authorize-security-group-egress --protocol -1 --source-group`` the group itself;
    EC2 User Guide, "Get started with EFA": outbound, all traffic, to the group).
    Without EFA, TCP leaves through the default rule."""
    if not efa:
        return []
    return [{"IpProtocol": "-1", "UserIdGroupPairs": [
        {"GroupId": group_id, "Description": "the job's own nodes (EFA traffic)"}]}]


def tags(job_id: str, store_uri: str, name: str | None = None) -> list[dict[str, str]]:
    """The tags every resource of the job carries (EC2/IAM ``Key``/``Value`` form)."""
    found = [{"Key": TAG_JOB, "Value": job_id}, {"Key": TAG_STORE, "Value": store_uri},
             {"Key": TAG_MANAGED, "Value": "true"}]
    if name:
        found.append({"Key": "Name", "Value": f"spotnb {name} ({job_id})"[:255]})
    return found


def s3_location(store_uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes) of an ``s3://`` store URI."""
    if not store_uri.startswith("s3://"):
        raise SpecError(
            f"the AWS provider needs an S3 store, not {store_uri!r}: leave store unset for "
            "the default bucket spotnb-<account>-<region>, or pass store='s3://bucket/prefix'")
    bucket, _, prefix = store_uri[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


# ------------------------------------------------------------------------- IAM

def trust_policy(service: str) -> dict[str, Any]:
    """Who may assume a role: the AWS service ``service`` (``ec2.amazonaws.com``)."""
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]}


def region_types(spec: JobSpec, region: str) -> tuple[str, ...]:
    """The job's instance types offered in ``region`` (in its order), for its group's
    overrides there; all of them when the catalog offers none there (AWS then says)."""
    from spotnb.providers import catalog

    offered = tuple(t for t in spec.resources.instance_types if catalog.pools(t, region))
    return offered or spec.resources.instance_types


def instance_policy(*, job_id: str, store_uri: str, region: str,
                    account: str, regions: Sequence[str] = ()) -> dict[str, Any]:
    """The job's instance role: least privilege, scoped to the job's store prefix.

    ``region``: the job's home (its store's; its queues and secrets are there);
    ``regions``: every region its group may run in (its own group, template and
    network there), home by default. One role for the job's life: a move to another
    of its regions changes no policy."""
    bucket, prefix = s3_location(store_uri)
    partition = "aws-cn" if region.startswith("cn-") else (
        "aws-us-gov" if region.startswith("us-gov-") else "aws")
    role = role_name(job_id)
    where = list(dict.fromkeys(regions or (region,)))

    def arns(*templates: str) -> str | list[str]:
        found = [t.format(region=r) for t in templates for r in where]
        return found[0] if len(found) == 1 else found

    own_group = arns(f"arn:{partition}:autoscaling:{{region}}:{account}:autoScalingGroup:*:"
                     f"autoScalingGroupName/{group_name(job_id)}")
    return {"Version": "2012-10-17", "Statement": [
        {
            "Sid": "JobObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                       "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
            "Resource": f"arn:{partition}:s3:::{bucket}/{prefix}/*",
        },
        {
            "Sid": "ListJobPrefix",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": f"arn:{partition}:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/", f"{prefix}/*"]}},
        },
        {
            "Sid": "EndOwnGroup",
            "Effect": "Allow",
            "Action": "autoscaling:DeleteAutoScalingGroup",
            "Resource": own_group,
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            # Warm standbys (providers/aws/instance.py): the job's instance asks its
            # group for a second instance on a rebalance recommendation, moves the job
            # to it (ends itself through the termination hook, whose wait it ends once
            # its final save is durable), gives back one not ready in time, or leaves
            # the group at a notice (EC2 ends it; the standby is its replacement); an
            # instance that runs the job protects itself from scale-in.
            "Sid": "OwnGroupStandby",
            "Effect": "Allow",
            "Action": ["autoscaling:CompleteLifecycleAction",
                       "autoscaling:SetDesiredCapacity",
                       "autoscaling:SetInstanceProtection",
                       "autoscaling:TerminateInstanceInAutoScalingGroup",
                       "autoscaling:DetachInstances"],
            "Resource": own_group,
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnTemplate",
            "Effect": "Allow",
            "Action": "ec2:DeleteLaunchTemplate",
            "Resource": arns(f"arn:{partition}:ec2:{{region}}:{account}:launch-template/*"),
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnNetwork",
            "Effect": "Allow",
            "Action": ["ec2:DeleteSecurityGroup", "ec2:DeletePlacementGroup"],
            "Resource": arns(f"arn:{partition}:ec2:{{region}}:{account}:security-group/*",
                             f"arn:{partition}:ec2:{{region}}:{account}:placement-group/*"),
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnRole",
            "Effect": "Allow",
            "Action": ["iam:DeleteRolePolicy", "iam:DeleteRole",
                       "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"],
            "Resource": [f"arn:{partition}:iam::{account}:role{IAM_PATH}{role}",
                         f"arn:{partition}:iam::{account}:instance-profile{IAM_PATH}{role}"],
        },
        {
            "Sid": "OwnQueues",
            "Effect": "Allow",
            "Action": ["sqs:CreateQueue", "sqs:TagQueue", "sqs:GetQueueUrl",
                       "sqs:ReceiveMessage", "sqs:SendMessage", "sqs:DeleteQueue"],
            "Resource": f"arn:{partition}:sqs:{region}:{account}:spotnb-{job_id}-*",
        },
        parameters.role_statement(job_id=job_id, region=region, account=account,
                                  partition=partition),
        {
            "Sid": "ReadOnlyUnscopable",
            "Effect": "Allow",
            "Action": list(READ_ONLY_ACTIONS),
            "Resource": "*",
        },
    ]}


def fis_target(job_id: str, instance_arn: str | None = None) -> dict[str, Any]:
    """The FIS experiment target of ``%spot_interrupt``: one instance by its ARN, or
    every running spot instance of the job by its tag.

    Not a list of the job's ARNs: FIS takes at most five ``resourceArns`` a target (the
    FIS API Reference; ``max: 5`` in botocore's model), and a job may have up to 65
    instances. Tags and a ``State.Name`` filter select any number, resolved by FIS when
    the experiment starts (through the role's ``ec2:DescribeInstances``)."""
    target: dict[str, Any] = {"resourceType": "aws:ec2:spot-instance", "selectionMode": "ALL"}
    if instance_arn is not None:
        return {**target, "resourceArns": [instance_arn]}
    return {**target, "resourceTags": {TAG_JOB: job_id},
            "filters": [{"path": "State.Name", "values": ["running"]}]}


def fis_policy(region: str, account: str) -> dict[str, Any]:
    """The FIS role: send interruption notices to spotnb's spot instances only, in any
    region (one role for the account, whose jobs run in several: ``region`` names the
    partition)."""
    partition = "aws-cn" if region.startswith("cn-") else (
        "aws-us-gov" if region.startswith("us-gov-") else "aws")
    return {"Version": "2012-10-17", "Statement": [
        {
            "Sid": "InterruptSpotnbInstances",
            "Effect": "Allow",
            "Action": "ec2:SendSpotInstanceInterruptions",
            "Resource": f"arn:{partition}:ec2:*:{account}:instance/*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}},
        },
        {"Sid": "FindThem", "Effect": "Allow", "Action": "ec2:DescribeInstances",
         "Resource": "*"},
    ]}


#: The service-linked roles AWS creates in an account on a service's first use, by the
#: caller's request: Auto Scaling's at the first group (Auto Scaling User Guide,
#: "Service-linked roles for Amazon EC2 Auto Scaling"), FIS's at the first experiment
#: template (FIS User Guide, "Use service-linked roles for AWS FIS"). Without
#: ``iam:CreateServiceLinkedRole`` for them a fresh account's first launch (or first
#: ``%spot_interrupt``) fails.
SERVICE_LINKED_ROLES = {
    "autoscaling.amazonaws.com": "AWSServiceRoleForAutoScaling",
    "fis.amazonaws.com": "AWSServiceRoleForFIS",
}


def user_policy(region: str | Sequence[str], account: str, bucket: str) -> dict[str, Any]:
    """What the notebook user's identity needs (printed by ``spotnb aws setup``), in
    ``region`` (or each of several: the allowed regions, where jobs may run; the first
    is home, ``bucket``'s).

    Every action is checked against AWS's Service Authorization Reference in the tests
    (``tests/aws_reference/iam.py``): list calls that AWS cannot scope to a resource
    (``iam:ListRoles``, ``ec2:Describe*`` ...) are granted on ``*``, the rest on
    spotnb's own resources or in the allowed regions."""
    regions = [region] if isinstance(region, str) else list(dict.fromkeys(region))
    allowed: str | list[str] = regions[0] if len(regions) == 1 else regions

    def arns(template: str) -> str | list[str]:
        found = [template.format(region=r) for r in regions]
        return found[0] if len(found) == 1 else found

    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "Store", "Effect": "Allow",
         "Action": ["s3:CreateBucket", "s3:ListBucket", "s3:GetObject", "s3:PutObject",
                    "s3:DeleteObject", "s3:PutBucketPublicAccessBlock",
                    "s3:PutEncryptionConfiguration", "s3:PutBucketPolicy",
                    "s3:PutLifecycleConfiguration", "s3:PutBucketTagging",
                    "s3:GetBucketLocation", "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts"],
         "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]},
        {"Sid": "JobRoles", "Effect": "Allow",
         "Action": ["iam:CreateRole", "iam:PutRolePolicy", "iam:TagRole", "iam:GetRole",
                    "iam:DeleteRolePolicy", "iam:DeleteRole", "iam:CreateInstanceProfile",
                    "iam:TagInstanceProfile", "iam:AddRoleToInstanceProfile",
                    "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile",
                    "iam:GetInstanceProfile", "iam:ListRoleTags", "iam:ListRolePolicies",
                    "iam:PassRole"],
         "Resource": [f"arn:aws:iam::{account}:role{IAM_PATH}*",
                      f"arn:aws:iam::{account}:instance-profile{IAM_PATH}*"]},
        {"Sid": "ServiceLinkedRoles", "Effect": "Allow",
         "Action": "iam:CreateServiceLinkedRole",
         "Resource": [f"arn:aws:iam::{account}:role/aws-service-role/{service}/{role}"
                      for service, role in SERVICE_LINKED_ROLES.items()],
         "Condition": {"StringEquals": {"iam:AWSServiceName": list(SERVICE_LINKED_ROLES)}}},
        {"Sid": "Capacity", "Effect": "Allow",
         "Action": ["ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate",
                    "ec2:CreateSecurityGroup", "ec2:CreateTags", "ec2:RunInstances",
                    "ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress",
                    "ec2:DeleteSecurityGroup",
                    "ec2:CreatePlacementGroup", "ec2:DeletePlacementGroup",
                    "ec2:TerminateInstances", "autoscaling:CreateAutoScalingGroup",
                    "autoscaling:UpdateAutoScalingGroup", "autoscaling:PutLifecycleHook",
                    # a move to another region ends the nodes it leaves through their
                    # group's termination hook (their notice)
                    "autoscaling:TerminateInstanceInAutoScalingGroup",
                    "autoscaling:DeleteAutoScalingGroup", "autoscaling:CreateOrUpdateTags",
                    "fis:CreateExperimentTemplate", "fis:StartExperiment",
                    "fis:DeleteExperimentTemplate", "fis:TagResource"],
         "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": allowed}}},
        {"Sid": "Queues", "Effect": "Allow",
         "Action": ["sqs:CreateQueue", "sqs:TagQueue", "sqs:GetQueueUrl", "sqs:SendMessage",
                    "sqs:ReceiveMessage", "sqs:DeleteQueue", "sqs:ListQueueTags"],
         "Resource": arns(f"arn:aws:sqs:{{region}}:{account}:spotnb-*")},
        {"Sid": "JobSecrets", "Effect": "Allow",
         "Action": ["ssm:PutParameter", "ssm:AddTagsToResource", "ssm:ListTagsForResource",
                    "ssm:DeleteParameter", "ssm:DeleteParameters"],
         "Resource": arns(f"arn:aws:ssm:{{region}}:{account}:parameter{parameters.ROOT}/*")},
        # `spotnb aws doctor` asks IAM whether this identity has the rest of this policy.
        {"Sid": "SelfCheck", "Effect": "Allow",
         "Action": "iam:SimulatePrincipalPolicy",
         "Resource": [f"arn:aws:iam::{account}:user/*", f"arn:aws:iam::{account}:role/*"]},
        {"Sid": "ReadOnly", "Effect": "Allow",
         "Action": ["ec2:Describe*", "autoscaling:Describe*", "ssm:GetParameter",
                    "ssm:DescribeParameters", "sqs:ListQueues",
                    "pricing:GetProducts", "ec2:GetSpotPlacementScores",
                    "servicequotas:ListServiceQuotas", "sts:GetCallerIdentity",
                    "tag:GetResources", "iam:ListRoles", "iam:ListInstanceProfiles"],
         "Resource": "*"},
    ]}


# -------------------------------------------------------------- launch template

#: How many network hops an IMDSv2 token may travel: 2 reaches a container on the
#: instance (see :func:`launch_template_data`).
METADATA_HOP_LIMIT = 2


def launch_template_data(*, ami: str, profile_arn: str, security_group: str,
                         script: str, tag_list: list[dict[str, str]],
                         efa: bool = False) -> dict[str, Any]:
    """IMDSv2 only, the job's role, tags; no inbound port (``security_group`` has no
    ingress, or, for a multi-node job, ingress from itself only).

    ``efa``: the instance's primary network interface is an Elastic Fabric Adapter
    (every type of the job must support it: the template is shared by the types).
    """
    network: dict[str, Any] = {"SecurityGroupIds": [security_group]}
    if efa:
        # An EFA is requested as the primary interface; its security groups go with it.
        network = {"NetworkInterfaces": [{"DeviceIndex": 0, "InterfaceType": "efa",
                                          "Groups": [security_group],
                                          "DeleteOnTermination": True}]}
    return {
        "ImageId": ami,
        "IamInstanceProfile": {"Arn": profile_arn},
        **network,
        "UserData": base64.b64encode(script.encode()).decode(),
        # Hop limit 2: a container the cell starts (docker's bridge network is a hop)
        # reaches IMDSv2 as the cell does, for the job's role and the spot notices;
        # with 1 its token PUT never comes back ("if HTTP tokens are required,
        # container ... need a minimum of two hops": AWS's InstanceMetadataOptions).
        # The role is the job's, least privilege, as the cell has it anyway.
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": METADATA_HOP_LIMIT,
                            "InstanceMetadataTags": "disabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                              {"ResourceType": "volume", "Tags": tag_list}],
    }


def mixed_instances_policy(*, template_id: str, instance_types: tuple[str, ...],
                           max_price: float | None, ondemand: bool,
                           strategy: str = "price-capacity-optimized") -> dict[str, Any]:
    """Spot over the job's types (0% on-demand unless ``ondemand``) across the group's
    subnets, allocated by ``strategy`` (:data:`SPOT_STRATEGIES`: by default the order
    of the types is no preference); on-demand, if allowed, in the types' order."""
    distribution: dict[str, Any] = {
        "OnDemandBaseCapacity": 0,
        "OnDemandPercentageAboveBaseCapacity": 100 if ondemand else 0,
        "OnDemandAllocationStrategy": "prioritized",
        "SpotAllocationStrategy": _strategy(strategy),
    }
    if max_price is not None:
        distribution["SpotMaxPrice"] = f"{max_price:.5f}"
    return {
        "LaunchTemplate": {
            "LaunchTemplateSpecification": {"LaunchTemplateId": template_id,
                                            "Version": "$Latest"},
            "Overrides": [{"InstanceType": t} for t in instance_types],
        },
        "InstancesDistribution": distribution,
    }


def choice_detail(instance_type: str, instance_types: tuple[str, ...], strategy: str,
                  no_capacity: set[str]) -> str:
    """What to say of the type Auto Scaling launched, among the job's types: only what
    is known. The types that had no spot capacity are those its scaling activities say
    so of (``no_capacity``); otherwise it was the strategy's choice, which under
    ``price-capacity-optimized`` does not follow the order of the types at all."""
    if len(instance_types) <= 1 or instance_type not in instance_types:
        return ""
    others = [t for t in instance_types if t in no_capacity and t != instance_type]
    if others:
        return f"; {', '.join(others)} had no spot capacity (the group's scaling activities)"
    rank = instance_types.index(instance_type)
    if strategy == "capacity-optimized-prioritized":
        return "" if rank == 0 else (
            f"; type {rank + 1} of {len(instance_types)} in the job's order ({strategy}: "
            f"{SPOT_STRATEGIES[strategy]})")
    return (f"; Auto Scaling's choice among the job's {len(instance_types)} types "
            f"({strategy}: {SPOT_STRATEGIES.get(strategy, '')})")


# ------------------------------------------------------------ scaling activities

_TYPE = re.compile(r"\b([a-z][a-z0-9-]*\d[a-z0-9-]*\.\d*[a-z]+)\b")
_AZ = re.compile(r"\b([a-z]{2}(?:-gov)?-[a-z]+-\d[a-z])\b")


def launch_failures(activities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed Auto Scaling activities that were not about spot capacity (an instance
    profile IAM has not propagated yet or that is gone, an image that does not exist,
    a type the image cannot run, a missing permission...), oldest first: ``activity_id``
    and AWS's ``reason`` (the activity's status message)."""
    from spotnb.providers.aws._boto import capacity_code_in

    found = []
    for act in activities:
        if act.get("StatusCode") not in ("Failed", "Cancelled"):
            continue
        message = str(act.get("StatusMessage") or act.get("Description") or "").strip()
        if capacity_code_in(message) is None:
            found.append({"activity_id": act.get("ActivityId"), "reason": message,
                          "start": str(act.get("StartTime"))})
    found.sort(key=lambda f: str(f["start"]))
    return found


def capacity_failures(activities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed Auto Scaling activities that were about spot capacity, oldest first, as
    ``instance`` event data (``action="capacity_error"``, ``reason`` the AWS code)."""
    from spotnb.providers.aws._boto import capacity_code_in

    found = []
    for act in activities:
        if act.get("StatusCode") not in ("Failed", "Cancelled"):
            continue
        message = str(act.get("StatusMessage") or act.get("Description") or "")
        code = capacity_code_in(message)
        if code is None:
            continue
        instance_type = _TYPE.search(message)
        az = _AZ.search(message)
        found.append({
            "action": "capacity_error", "reason": code, "detail": message,
            "instance_id": None,
            "instance_type": instance_type.group(1) if instance_type else None,
            "az": None,  # events name AZs by id; AWS's messages by name (az_name)
            "az_name": az.group(1) if az else None,
            "activity_id": act.get("ActivityId"),
            "start": act.get("StartTime"),
        })
    found.sort(key=lambda f: str(f["start"]))
    for f in found:
        f.pop("start")
    return found
