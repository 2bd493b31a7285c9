"""What Lambda's and EventBridge's requests need from IAM (see :mod:`.iam_checks`).

Resources as the Service Authorization Reference names them: a function
``arn:aws:lambda:<region>:<account>:function:<name>[:<qualifier>]`` (its tags as
``aws:ResourceTag/*``), a rule ``arn:aws:events:<region>:<account>:rule/[<bus>/]<name>``,
an event bus ``...:event-bus/<name>``. The permissions a request needs besides its
own: ``CreateFunction`` and an ``UpdateFunctionConfiguration`` that names a role need
``iam:PassRole`` of that role (``iam:PassedToService`` ``lambda.amazonaws.com``),
``PutTargets`` with a target's ``RoleArn`` needs it for ``events.amazonaws.com``.
Condition keys filled in: ``lambda:Principal`` (``AddPermission``), ``lambda:Layer``,
``lambda:VpcIds``/``SubnetIds``/``SecurityGroupIds``, ``events:source`` and
``events:detail-type`` (``PutRule``: the pattern's plain values; ``PutEvents``: the
entries'), ``events:TargetArn`` (``PutTargets``), ``events:creatorAccount``,
``aws:RequestTag/*``. Actions AWS cannot scope (``ListFunctions``, ``ListRules``) are
checked on ``*``; an action with resource types not resolved here fails closed.
"""

from __future__ import annotations

import json
from typing import Any

from spotnb.testing import iam_checks
from spotnb.testing.contract import Call
from spotnb.testing.iam_checks import (
    Check,
    World,
    _has_resource_types,
    _request_tag_context,
    _tag_context,
)

__all__ = ["checks", "serverless_checks"]

# Lambda operations whose IAM action has another name.
_LAMBDA_ACTIONS = {"Invoke": "InvokeFunction", "InvokeWithResponseStream":
                   "InvokeFunction", "GetFunctionConfiguration": "GetFunctionConfiguration"}


def checks(call: Call, signing: str, world: World) -> list[Check]:
    """What ``call`` needs (:func:`.iam_checks.checks`, and Lambda's and EventBridge's
    requests here)."""
    if signing in ("lambda", "events"):
        return serverless_checks(call.params, call.operation, signing,
                                 {"aws:RequestedRegion": (world.region,)}, world)
    return iam_checks.checks(call, signing, world)


def serverless_checks(p: dict[str, Any], op: str, prefix: str,
                      base: dict[str, tuple[str, ...]], world: World) -> list[Check]:
    """The checks of a ``lambda`` or ``events`` request."""
    if prefix == "lambda":
        return _lambda_checks(p, op, base, world)
    return _events_checks(p, op, base, world)


def _function_arn(p: dict[str, Any], world: World) -> str:
    """A function's ARN from a name, a partial ARN or an ARN (and ``Qualifier``)."""
    name = str(p.get("FunctionName", ""))
    if name.startswith("arn:"):
        arn = name
    elif ":function:" in name:  # 123456789012:function:name
        arn = f"arn:aws:lambda:{world.region}:{name}"
    else:
        arn = f"arn:aws:lambda:{world.region}:{world.account}:function:{name}"
    qualifier = p.get("Qualifier")
    return f"{arn}:{qualifier}" if qualifier and arn.count(":") == 6 else arn


def _function_tags(arn: str, world: World) -> dict[str, str]:
    from moto.awslambda.models import lambda_backends

    name = arn.split(":")[6] if arn.count(":") >= 6 else ""
    try:
        fn = lambda_backends[world.account][world.region].get_function(name)
    except Exception:
        return {}
    return {str(k): str(v) for k, v in (getattr(fn, "tags", None) or {}).items()}


def _pass_role(role: str, service: str, base: dict[str, tuple[str, ...]]) -> Check:
    return Check("iam:PassRole", role, {**base, "iam:PassedToService": (service,)})


def _lambda_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                   world: World) -> list[Check]:
    action = "lambda:" + _LAMBDA_ACTIONS.get(op, op)
    if not _has_resource_types("lambda", _LAMBDA_ACTIONS.get(op, op)):
        return [Check(action, "*", base)]
    if op in ("TagResource", "UntagResource", "ListTags"):
        resource = str(p.get("Resource", ""))
        context = {**base, **_tag_context(_function_tags(resource, world))}
        if op == "TagResource":
            context.update(_request_tag_context({"Tags": p.get("Tags") or {}}))
        return [Check(action, resource, context)]
    if "FunctionName" not in p:
        return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]
    arn = _function_arn(p, world)
    context = {**base, **_tag_context(_function_tags(arn, world))}
    found: list[Check] = []
    if op == "CreateFunction":
        context = {**base, **_request_tag_context({"Tags": p.get("Tags") or {}})}
    if op in ("CreateFunction", "UpdateFunctionConfiguration"):
        if p.get("Layers"):
            context["lambda:Layer"] = tuple(p["Layers"])
        vpc = p.get("VpcConfig") or {}
        for key, name in (("SubnetIds", "lambda:SubnetIds"),
                          ("SecurityGroupIds", "lambda:SecurityGroupIds")):
            if vpc.get(key):
                context[name] = tuple(vpc[key])
        if p.get("Role"):
            found.append(_pass_role(str(p["Role"]), "lambda.amazonaws.com", base))
    if op == "AddPermission" and p.get("Principal"):
        context["lambda:Principal"] = (str(p["Principal"]),)
    return [Check(action, arn, context), *found]


def _bus_name(value: str | None) -> str:
    name = (value or "default").rsplit("/", 1)[-1]
    return name or "default"


def _rule_arn(name: str, bus: str | None, world: World) -> str:
    bus_name = _bus_name(bus)
    middle = "" if bus_name == "default" else f"{bus_name}/"
    return f"arn:aws:events:{world.region}:{world.account}:rule/{middle}{name}"


def _pattern_values(pattern: str | None, field: str) -> tuple[str, ...]:
    """The plain string values of ``field`` in an event pattern (filters left out)."""
    try:
        found = json.loads(pattern or "{}").get(field, [])
    except (ValueError, AttributeError):
        return ()
    return tuple(v for v in (found if isinstance(found, list) else [found])
                 if isinstance(v, str))


def _events_checks(p: dict[str, Any], op: str, base: dict[str, tuple[str, ...]],
                   world: World) -> list[Check]:
    action = f"events:{op}"
    if not _has_resource_types("events", op):
        return [Check(action, "*", base)]
    creator = {"events:creatorAccount": (world.account,)}
    if op in ("TagResource", "UntagResource", "ListTagsForResource"):
        context = {**base, **creator}
        if op == "TagResource":
            context.update(_request_tag_context(p))
        return [Check(action, str(p.get("ResourceARN", "")), context)]
    if op == "PutEvents":
        found = []
        for entry in p.get("Entries", ()):
            bus = _bus_name(entry.get("EventBusName"))
            found.append(Check(action, f"arn:aws:events:{world.region}:{world.account}:"
                                       f"event-bus/{bus}", {
                **base, "events:source": (str(entry.get("Source", "")),),
                "events:detail-type": (str(entry.get("DetailType", "")),)}))
        return found
    if op in ("DescribeEventBus",):
        bus = _bus_name(p.get("Name"))
        return [Check(action, f"arn:aws:events:{world.region}:{world.account}:"
                              f"event-bus/{bus}", base)]
    name = p.get("Name") if "Name" in p else p.get("Rule")
    if name is None:
        return [Check(action, "*", base, unresolved=f"no resource resolver for {action}")]
    arn = _rule_arn(str(name), p.get("EventBusName"), world)
    context = {**base, **creator}
    found = []
    if op == "PutRule":
        context.update(_request_tag_context(p))
        for field, key in (("source", "events:source"), ("detail-type", "events:detail-type")):
            values = _pattern_values(p.get("EventPattern"), field)
            if values:
                context[key] = values
    if op == "PutTargets":
        context["events:TargetArn"] = tuple(str(t.get("Arn", "")) for t in p.get("Targets", ()))
        found = [_pass_role(str(t["RoleArn"]), "events.amazonaws.com", base)
                 for t in p.get("Targets", ()) if t.get("RoleArn")]
    return [Check(action, arn, context), *found]
