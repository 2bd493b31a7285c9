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
import hashlib
import importlib.metadata
import io
import os
import re
import shlex
import zipfile
from pathlib import Path
from typing import Any

import spotnb
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.providers.aws import parameters

TAG_JOB = "spotnb:job-id"
TAG_STORE = "spotnb:store"
TAG_MANAGED = "spotnb:managed"
IAM_PATH = "/spotnb/"
SECURITY_GROUP = "spotnb-no-inbound"
FIS_ROLE = "spotnb-fis"
BOOTSTRAP_PREFIX = "bootstrap"

#: The public SSM parameter of the AWS Deep Learning AMI (PyTorch, NVIDIA driver, Ubuntu
#: 22.04; Python at /opt/pytorch/bin/python). Override with SPOTNB_AWS_AMI_PARAMETER or
#: SPOTNB_AWS_AMI.
DLAMI_PARAMETER = ("/aws/service/deeplearning/ami/x86_64/"
                   "oss-nvidia-driver-gpu-pytorch-2.7-ubuntu-22.04/latest/ami-id")
DLAMI_PYTHON = "/opt/pytorch/bin/python"

# Actions AWS cannot restrict to a resource; all are read-only. The instance agent
# (:mod:`.instance`) needs each of them; nothing else on the instance calls AWS.
READ_ONLY_ACTIONS = (
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeInstances",
    "ec2:DescribeLaunchTemplates",
    "ec2:DescribeSecurityGroups",  # a multi-node job's own group, to delete it
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
    """

    ami: str | None = None
    ami_parameter: str = DLAMI_PARAMETER
    subnets: tuple[str, ...] = ()
    ondemand_after: float | None = None
    capacity_poll: float = 5.0

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
        )


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
#: its instance's first hour ends (spotnb.protocol.billing.standby_wait).
STANDBY_BOOT_SECONDS = 90
#: How long a standby may take to be ready: EC2's boot and the local group's hold
#: (spotnb.providers.local.group.STANDBY_HOLD_SECONDS). The launch hook waits as long;
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


def instance_policy(*, job_id: str, store_uri: str, region: str,
                    account: str) -> dict[str, Any]:
    """The job's instance role: least privilege, scoped to the job's store prefix."""
    bucket, prefix = s3_location(store_uri)
    partition = "aws-cn" if region.startswith("cn-") else (
        "aws-us-gov" if region.startswith("us-gov-") else "aws")
    role = role_name(job_id)
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
            "Resource": (f"arn:{partition}:autoscaling:{region}:{account}:autoScalingGroup:*:"
                         f"autoScalingGroupName/{group_name(job_id)}"),
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
            "Resource": (f"arn:{partition}:autoscaling:{region}:{account}:autoScalingGroup:*:"
                         f"autoScalingGroupName/{group_name(job_id)}"),
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnTemplate",
            "Effect": "Allow",
            "Action": "ec2:DeleteLaunchTemplate",
            "Resource": f"arn:{partition}:ec2:{region}:{account}:launch-template/*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnNetwork",
            "Effect": "Allow",
            "Action": ["ec2:DeleteSecurityGroup", "ec2:DeletePlacementGroup"],
            "Resource": [f"arn:{partition}:ec2:{region}:{account}:security-group/*",
                         f"arn:{partition}:ec2:{region}:{account}:placement-group/*"],
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


def fis_policy(region: str, account: str) -> dict[str, Any]:
    """The FIS role: send interruption notices to spotnb's spot instances only."""
    return {"Version": "2012-10-17", "Statement": [
        {
            "Sid": "InterruptSpotnbInstances",
            "Effect": "Allow",
            "Action": "ec2:SendSpotInstanceInterruptions",
            "Resource": f"arn:aws:ec2:{region}:{account}:instance/*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}},
        },
        {"Sid": "FindThem", "Effect": "Allow", "Action": "ec2:DescribeInstances",
         "Resource": "*"},
    ]}


def user_policy(region: str, account: str, bucket: str) -> dict[str, Any]:
    """What the notebook user's identity needs (printed by ``spotnb aws setup``)."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "Store", "Effect": "Allow",
         "Action": ["s3:CreateBucket", "s3:ListBucket", "s3:GetObject", "s3:PutObject",
                    "s3:DeleteObject", "s3:PutBucketPublicAccessBlock",
                    "s3:PutEncryptionConfiguration", "s3:PutBucketPolicy",
                    "s3:PutLifecycleConfiguration", "s3:PutBucketTagging",
                    # CreateBucket with ObjectOwnership sets the ownership controls too.
                    "s3:PutBucketOwnershipControls", "s3:GetBucketLocation"],
         "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]},
        {"Sid": "JobRoles", "Effect": "Allow",
         "Action": ["iam:CreateRole", "iam:PutRolePolicy", "iam:TagRole", "iam:GetRole",
                    "iam:DeleteRolePolicy", "iam:DeleteRole", "iam:CreateInstanceProfile",
                    "iam:TagInstanceProfile", "iam:AddRoleToInstanceProfile",
                    "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile",
                    "iam:GetInstanceProfile", "iam:ListRoleTags", "iam:PassRole"],
         "Resource": [f"arn:aws:iam::{account}:role{IAM_PATH}*",
                      f"arn:aws:iam::{account}:instance-profile{IAM_PATH}*"]},
        # Auto Scaling creates its service-linked role on its first group in an account.
        {"Sid": "AutoScalingServiceRole", "Effect": "Allow",
         "Action": "iam:CreateServiceLinkedRole",
         "Resource": f"arn:aws:iam::{account}:role/aws-service-role/"
                     "autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling",
         "Condition": {"StringLike": {"iam:AWSServiceName": "autoscaling.amazonaws.com"}}},
        {"Sid": "Capacity", "Effect": "Allow",
         "Action": ["ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate",
                    "ec2:CreateSecurityGroup", "ec2:CreateTags", "ec2:RunInstances",
                    "ec2:AuthorizeSecurityGroupIngress", "ec2:DeleteSecurityGroup",
                    "ec2:CreatePlacementGroup", "ec2:DeletePlacementGroup",
                    "ec2:TerminateInstances", "autoscaling:CreateAutoScalingGroup",
                    "autoscaling:UpdateAutoScalingGroup", "autoscaling:PutLifecycleHook",
                    "autoscaling:DeleteAutoScalingGroup", "autoscaling:CreateOrUpdateTags",
                    "fis:CreateExperimentTemplate", "fis:StartExperiment",
                    "fis:DeleteExperimentTemplate", "fis:TagResource"],
         "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": region}}},
        {"Sid": "Queues", "Effect": "Allow",
         "Action": ["sqs:CreateQueue", "sqs:TagQueue", "sqs:GetQueueUrl", "sqs:SendMessage",
                    "sqs:ReceiveMessage", "sqs:DeleteQueue", "sqs:ListQueueTags"],
         "Resource": f"arn:aws:sqs:{region}:{account}:spotnb-*"},
        {"Sid": "JobSecrets", "Effect": "Allow",
         "Action": ["ssm:PutParameter", "ssm:AddTagsToResource", "ssm:ListTagsForResource",
                    "ssm:DeleteParameter", "ssm:DeleteParameters"],
         "Resource": f"arn:aws:ssm:{region}:{account}:parameter{parameters.ROOT}/*"},
        {"Sid": "ReadOnly", "Effect": "Allow",
         "Action": ["ec2:Describe*", "autoscaling:Describe*", "ssm:GetParameter",
                    "ssm:DescribeParameters", "sqs:ListQueues",
                    "pricing:GetProducts", "ec2:GetSpotPlacementScores",
                    "servicequotas:GetServiceQuota", "sts:GetCallerIdentity",
                    # No resource-level permissions: only "*" allows them.
                    "iam:ListRoles", "iam:ListInstanceProfiles", "tag:GetResources"],
         "Resource": "*"},
    ]}


# ------------------------------------------------------------------ the bootstrap

@dataclasses.dataclass(frozen=True)
class Bundle:
    """The installed spotnb as a wheel: what every instance of a job installs."""

    filename: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


_BUNDLE: Bundle | None = None
# A fixed time for every zip entry, so the same code always makes the same wheel.
_ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def bundle() -> Bundle:
    """A ``py3-none-any`` wheel of the spotnb this process runs (built once, ~100 ms).

    Built from the package's files as they are installed (an editable checkout
    included), so an instance runs exactly the notebook's code. Dependencies come from
    the installed metadata.
    """
    global _BUNDLE
    if _BUNDLE is not None:
        return _BUNDLE
    version = spotnb.__version__
    root = Path(spotnb.__file__).resolve().parent
    dist = f"spotnb-{version}.dist-info"
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files["spotnb/" + path.relative_to(root).as_posix()] = path.read_bytes()
    try:
        requires = importlib.metadata.requires("spotnb") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    metadata = ["Metadata-Version: 2.1", "Name: spotnb", f"Version: {version}",
                "Requires-Python: >=3.10"]
    extras = sorted({r.split("extra ==")[1].strip().strip("'\"") for r in requires
                     if "extra ==" in r})
    metadata += [f"Provides-Extra: {e}" for e in extras]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    files[f"{dist}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: spotnb\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    files[f"{dist}/entry_points.txt"] = b"[console_scripts]\nspotnb = spotnb.client.cli:main\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, _ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    _BUNDLE = Bundle(f"spotnb-{version}-py3-none-any.whl", buf.getvalue())
    return _BUNDLE


def user_data(*, job_id: str, store_uri: str, wheel: Bundle) -> str:
    """The instance's boot script: install spotnb, then start the instance agent.

    It holds names and a checksum, never a secret: the instance reads the job's prefix
    with its role's credentials, fetched from IMDS by the AWS CLI and boto3.
    Variables a test harness (or a custom image) may set: ``SPOTNB_PYTHON`` (an
    interpreter that already has this spotnb: skip the install), ``SPOTNB_BASE_PYTHON``
    (where to install, default the DLAMI's PyTorch environment), ``SPOTNB_PIP_OPTIONS``
    and ``SPOTNB_INSTANCE_DIR`` (default ``/opt/spotnb``).
    """
    job_uri = shlex.quote(store_uri)
    return f"""#!/bin/bash
# spotnb {spotnb.__version__} bootstrap for job {job_id}: install spotnb from the job's
# prefix, then run the instance agent. No credentials here: the instance role has them.
set -euo pipefail
JOB_URI={job_uri}
WHEEL={shlex.quote(wheel.filename)}
WHEEL_SHA256={wheel.sha256}
WORK="${{SPOTNB_INSTANCE_DIR:-/opt/spotnb}}"
mkdir -p "$WORK"
cd "$WORK"
exec >>"$WORK/bootstrap.log" 2>&1
PY="${{SPOTNB_PYTHON:-}}"
if [ -z "$PY" ]; then
  PY="${{SPOTNB_BASE_PYTHON:-{DLAMI_PYTHON}}}"
  [ -x "$PY" ] || PY="$(command -v python3)"
  if command -v aws >/dev/null; then
    aws s3 cp --only-show-errors "$JOB_URI/{BOOTSTRAP_PREFIX}/$WHEEL" "$WORK/$WHEEL"
  else  # no AWS CLI on this image: boto3 of the target environment
    "$PY" - "$JOB_URI/{BOOTSTRAP_PREFIX}/$WHEEL" "$WORK/$WHEEL" <<'DOWNLOAD'
import sys, boto3
bucket, _, key = sys.argv[1][len("s3://"):].partition("/")
boto3.client("s3").download_file(bucket, key, sys.argv[2])
DOWNLOAD
  fi
  echo "$WHEEL_SHA256  $WORK/$WHEEL" | sha256sum --check --quiet
  "$PY" -m pip install --quiet --disable-pip-version-check ${{SPOTNB_PIP_OPTIONS:-}} \\
    "$WORK/$WHEEL[aws]"
fi
exec "$PY" -m spotnb.providers.aws.instance --job "$JOB_URI"
"""


# -------------------------------------------------------------- launch template

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
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": 1, "InstanceMetadataTags": "disabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                              {"ResourceType": "volume", "Tags": tag_list}],
    }


def mixed_instances_policy(*, template_id: str, instance_types: tuple[str, ...],
                           max_price: float | None, ondemand: bool) -> dict[str, Any]:
    """Spot over the ranked types (0% on-demand unless ``ondemand``), price-capacity-
    optimized across the group's subnets."""
    distribution: dict[str, Any] = {
        "OnDemandBaseCapacity": 0,
        "OnDemandPercentageAboveBaseCapacity": 100 if ondemand else 0,
        "OnDemandAllocationStrategy": "prioritized",
        "SpotAllocationStrategy": "price-capacity-optimized",
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


# ------------------------------------------------------------ scaling activities

_TYPE = re.compile(r"\b([a-z][a-z0-9-]*\d[a-z0-9-]*\.\d*[a-z]+)\b")
_AZ = re.compile(r"\b([a-z]{2}(?:-gov)?-[a-z]+-\d[a-z])\b")


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
