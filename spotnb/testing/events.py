"""Amazon EventBridge as the simulator plays it: Auto Scaling's events, routed to Lambda.

:class:`EventsPlay` is a part of :class:`~spotnb.testing.AwsSimulator`. moto's Auto
Scaling sends no event and moto's EventBridge cannot invoke Lambda; here:

* **Auto Scaling's event**: each failed launch activity that the simulator records
  (:mod:`spotnb.testing.autoscaling`: a pool without capacity, any other refused
  launch) is sent to its region's default event bus as Auto Scaling sends it
  ("EC2 Instance Launch Unsuccessful", EC2 Auto Scaling User Guide): ``source``
  ``aws.autoscaling``, ``resources`` the group's ARN, ``detail`` with the activity's
  ``ActivityId``, ``StatusMessage``, ``Cause``, ``StartTime``/``EndTime``, ``Details``
  (``Availability Zone``, ``Subnet ID``), ``StatusCode`` ``Failed``, and an empty
  ``EC2InstanceId``. DescribeScalingActivities shows the same activity.
* **Routing**, as EventBridge does: the *enabled* rules of the region's default bus in
  moto whose ``EventPattern`` matches (moto's own pattern matcher), and each of their
  targets that is a Lambda function of that region's moto (an ``Input``,
  ``InputPath`` or ``InputTransformer`` applied); the function is invoked
  asynchronously (:mod:`spotnb.testing.lambdas`) only if its resource policy
  (``AddPermission``) allows ``lambda:InvokeFunction`` to ``events.amazonaws.com``
  with that rule's ARN as ``aws:SourceArn`` (a statement's conditions evaluated as
  IAM's). A delivery that does not happen is logged with its reason and kept in
  :attr:`EventsPlay.undelivered`.
* **Cost**: nothing is built or matched in a region whose default bus has no rule
  (most tests deploy no function); nothing polls.

Not modelled: other events of Auto Scaling (successful launches, terminations,
lifecycle actions), other services' events, custom buses, targets other than Lambda
(moto's ``PutEvents`` handles queues and log groups itself), EventBridge's own
delivery retries and dead-letter queues (a permission missing is not retried on AWS
either), at-least-once duplicates (each event is delivered once here), the rule's
role (Lambda targets need none).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotnb.testing.lambdas import Invocation, LambdaRuntime
from spotnb.testing.server import CLOSED_ENDPOINT, DEFAULT_ACCOUNT, MotoServer

__all__ = ["EventsPlay", "Undelivered", "launch_unsuccessful"]

log = logging.getLogger(__name__)

EVENTS_PRINCIPAL = "events.amazonaws.com"


@dataclasses.dataclass(frozen=True)
class Undelivered:
    """An event a rule matched that reached no function: which, and why."""

    event_id: str
    rule: str  # the rule's ARN
    target: str  # the target's ARN
    reason: str


def launch_unsuccessful(region: str, group_arn: str, activity: dict[str, Any]
                        ) -> dict[str, Any]:
    """The "EC2 Instance Launch Unsuccessful" event of a failed scaling ``activity``
    (as DescribeScalingActivities shows it) of the group ``group_arn``."""
    def stamp(at: datetime.datetime) -> str:
        return at.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + \
            f"{at.microsecond // 1000:03d}Z"

    end = activity.get("EndTime") or activity["StartTime"]
    return {
        "version": "0", "id": str(uuid.uuid4()),
        "detail-type": "EC2 Instance Launch Unsuccessful", "source": "aws.autoscaling",
        "account": group_arn.split(":")[4], "region": region,
        "time": end.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "resources": [group_arn],
        "detail": {
            "StatusCode": activity["StatusCode"],
            "AutoScalingGroupName": activity["AutoScalingGroupName"],
            "ActivityId": activity["ActivityId"],
            "Details": json.loads(activity.get("Details") or "{}"),
            "RequestId": activity["ActivityId"],
            "StatusMessage": activity.get("StatusMessage", ""),
            "EndTime": stamp(end), "EC2InstanceId": "",
            "StartTime": stamp(activity["StartTime"]), "Cause": activity.get("Cause", ""),
        },
    }


class EventsPlay:
    """EventBridge and Lambda for :class:`~spotnb.testing.AwsSimulator` (a part of it)."""

    regions: tuple[str, ...]
    workdir: Path
    server: MotoServer
    notice_seconds: float
    _lock: threading.RLock
    _undo: list[Callable[[], None]]

    def _client(self, service: str, region: str | None = None) -> Any:
        raise NotImplementedError

    def _install_events(self) -> None:
        #: every event the simulator sent to a bus that had a rule, in order
        self.events_sent: list[dict[str, Any]] = []
        #: every delivery a rule matched that did not happen (:class:`Undelivered`)
        self.undelivered: list[Undelivered] = []
        #: Lambda's runtime (:mod:`spotnb.testing.lambdas`)
        self.lambdas = LambdaRuntime(self.workdir, DEFAULT_ACCOUNT, self._lambda_session,
                                     self._lambda_endpoints,
                                     lambda: self.notice_seconds / 120.0)
        self._undo.append(self.lambdas.install())
        self._undo.append(self.lambdas.stop)

    # ------------------------------------------------------------------- the API

    def invocations(self, function: str, region: str | None = None) -> list[Invocation]:
        """The finished invocations of Lambda function ``function`` (its name), in every
        region by default (:class:`~spotnb.testing.lambdas.Invocation`: ``status``,
        ``event``, ``output``...)."""
        return self.lambdas.invocations(function, region)

    def wait_for_invocations(self, function: str, count: int = 1, timeout: float = 60.0,
                             region: str | None = None,
                             until: Callable[[list[Invocation]], bool] | None = None
                             ) -> list[Invocation]:
        """Wait (on a condition) until ``function`` has ``count`` finished invocations,
        or ``until(invocations)`` holds; returns them. TimeoutError with the function's
        log's tail otherwise. Its log: :meth:`lambda_log`."""
        return self.lambdas.wait_for(function, count, timeout, region, until)

    def lambda_log(self, function: str, region: str | None = None) -> Path:
        """The file where ``function``'s invocations in ``region`` write their output."""
        return self.lambdas.log_path(region or self.regions[0], function)

    # ----------------------------------------------------- events and their routes

    def _launch_failed(self, region: str, activity: dict[str, Any]) -> None:
        """Auto Scaling recorded a failed launch ``activity`` in ``region``: its event."""
        rules = self._rules(region)
        if not rules:
            return  # no rule on the bus: nothing to match, nothing to build
        from spotnb.testing.iam_checks import World

        world = World(DEFAULT_ACCOUNT, region, lambda r, n: None)
        event = launch_unsuccessful(region, world.group_arn(activity["AutoScalingGroupName"]),
                                    activity)
        with self._lock:
            self.events_sent.append(event)
        self._route(region, event, rules, key=activity["AutoScalingGroupName"])

    @staticmethod
    def _rules(region: str) -> list[Any]:
        from moto.events.models import events_backends

        bus = events_backends[DEFAULT_ACCOUNT][region].event_buses.get("default")
        return list(bus.rules.values()) if bus is not None else []

    def _route(self, region: str, event: dict[str, Any], rules: list[Any], key: str) -> None:
        """Deliver ``event`` to the Lambda targets of the enabled rules it matches."""
        from moto.awslambda.models import lambda_backends

        for rule in rules:
            if rule.state != "ENABLED" or not rule.event_pattern.matches_event(event):
                continue
            for target in rule.targets:
                arn = str(target.get("Arn", ""))
                parts = arn.split(":")
                if len(parts) < 7 or parts[2] != "lambda" or parts[5] != "function":
                    self._undelivered(event, rule.arn, arn, "the simulator delivers to "
                                      "Lambda functions only")
                    continue
                if parts[3] != region:
                    self._undelivered(event, rule.arn, arn, "a function of another region")
                    continue
                try:
                    fn = lambda_backends[DEFAULT_ACCOUNT][region].get_function(parts[6])
                except Exception:
                    self._undelivered(event, rule.arn, arn, "no such function")
                    continue
                refused = invoke_refused(fn.policy.statements, arn, rule.arn, event["account"])
                if refused:
                    self._undelivered(event, rule.arn, arn, refused)
                    continue
                self.lambdas.invoke_async(region, fn.function_name, _input(target, event),
                                          key)

    def _undelivered(self, event: dict[str, Any], rule: str, target: str,
                     reason: str) -> None:
        log.warning("EventBridge: event %s (%s) matched rule %s, not delivered to %s: %s",
                    event["id"], event["detail-type"], rule, target, reason)
        with self._lock:
            self.undelivered.append(Undelivered(event["id"], rule, target, reason))

    # ------------------------------------------------------------ Lambda's needs

    def _lambda_session(self, role_arn: str, function: str) -> dict[str, str] | str:
        """A session of a function's role (Lambda assumes it for each environment)."""
        try:
            found = self._client("sts").assume_role(RoleArn=role_arn,
                                                    RoleSessionName=function)["Credentials"]
        except Exception as err:
            return f"Lambda could not assume {role_arn}: {err}"
        return {k: str(found[k]) for k in ("AccessKeyId", "SecretAccessKey", "SessionToken")}

    def _lambda_endpoints(self) -> dict[str, str]:
        """What points a function's SDK at the simulator, as its instances' is."""
        import os

        return {"AWS_ENDPOINT_URL": self.server.endpoint,
                "AWS_ENDPOINT_URL_PRICING": CLOSED_ENDPOINT,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true"}


def invoke_refused(statements: list[dict[str, Any]], function_arn: str, rule_arn: str,
                   account: str) -> str:
    """Why a function's resource policy (``statements``) does not let EventBridge's
    rule ``rule_arn`` invoke it ("" when it does): a statement for the principal
    ``events.amazonaws.com`` (or ``*``) allowing ``lambda:InvokeFunction`` on the
    function, whose conditions hold for ``aws:SourceArn``/``aws:SourceAccount``; an
    explicit Deny wins."""
    from spotnb.testing.iam import Check, evaluate

    def for_events(s: dict[str, Any]) -> bool:
        principal = s.get("Principal")
        if principal == "*":
            return True
        services = (principal or {}).get("Service", []) if isinstance(principal, dict) else []
        return EVENTS_PRINCIPAL in ([services] if isinstance(services, str) else services)

    policy = {"Statement": [s for s in statements if for_events(s)]}
    check = Check("lambda:InvokeFunction", function_arn, {
        "aws:SourceArn": (rule_arn,), "aws:SourceAccount": (account,),
        "aws:PrincipalServiceName": (EVENTS_PRINCIPAL,)})
    verdict = evaluate([policy], check)
    if verdict == "allow":
        return ""
    return (f"the function's resource policy does not allow {EVENTS_PRINCIPAL} to invoke "
            f"it from {rule_arn} (lambda:AddPermission with SourceArn the rule's ARN)"
            + (": an explicit Deny" if verdict == "deny" else ""))


def _input(target: dict[str, Any], event: dict[str, Any]) -> Any:
    """What a target receives: the event, or its ``Input``, ``InputPath`` or
    ``InputTransformer``."""
    if target.get("Input"):
        return json.loads(target["Input"])
    if target.get("InputPath"):
        from jsonpath_ng.ext import parse

        found = [m.value for m in parse(target["InputPath"]).find(event)]
        return found[0] if found else None
    if target.get("InputTransformer"):
        from moto.events.utils import EventTemplateParser

        transformer = target["InputTransformer"]
        return EventTemplateParser.parse(
            input_template=transformer.get("InputTemplate"),
            input_paths_map=transformer.get("InputPathsMap", {}), event=event)  # type: ignore[arg-type]
    return event

