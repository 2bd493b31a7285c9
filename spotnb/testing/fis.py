"""The Fault Injection Service as the simulator plays it, inside moto's FIS.

moto stores experiment templates and experiments but runs nothing. The simulator:

* refuses a template as FIS does: a target lists at most
  :data:`MAX_RESOURCE_ARNS` resource ARNs (FIS's quota "resource ARNs per target"),
  and its ``roleArn`` must name an existing role that ``fis.amazonaws.com`` may assume
  (its trust policy): else ``ValidationException`` (the messages are the simulator's);
* resolves each target when an experiment starts, as FIS does: its ``resourceArns``,
  or the spot instances whose tags hold all of its ``resourceTags`` and that pass its
  ``State.Name`` filter (FIS looks them up with the role's ``ec2:DescribeInstances``),
  then its ``selectionMode`` (``ALL``, ``COUNT(n)``, ``PERCENT(n)``); a target that
  resolves to nothing fails the experiment (FIS's default
  ``emptyTargetResolutionMode``);
* runs ``aws:ec2:send-spot-instance-interruptions`` as the experiment's role: each
  targeted instance gets its notice only if the role's policies allow
  ``ec2:SendSpotInstanceInterruptions`` on it (with IAM enforced, see
  :mod:`spotnb.testing.iam`); the experiment fails otherwise, as FIS's does, and
  :attr:`FisPlay.failed` says why. As FIS sends them: the rebalance recommendation when
  the experiment starts, the interruption notice two minutes before the end of
  ``durationBeforeInterruption`` (both at once for ``PT2M``).

It is added to moto's FIS backend, so every process's requests reach it.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_RESOURCE_ARNS", "FisPlay"]

log = logging.getLogger(__name__)

#: FIS's quota on the resource ARNs one target may list.
MAX_RESOURCE_ARNS = 5
SPOT_INTERRUPTIONS = "aws:ec2:send-spot-instance-interruptions"
FIS_PRINCIPAL = "fis.amazonaws.com"
#: EC2's interruption notice: FIS sends it this long before the interruption.
NOTICE_SECONDS = 120.0


class FisPlay:
    """Patches moto's FIS backend (:meth:`install`; undone by the returned callable).

    ``interrupt(instance_id, notice_seconds, lead)`` delivers an interruption: the
    rebalance recommendation now, the notice ``lead`` seconds later, the termination
    ``notice_seconds`` after it, both in FIS's seconds (the simulator scales them as
    its notice period is, when the experiment starts); ``authorize(role_arn, action,
    resource_arn)`` says why a role may not act on a resource (None: it may).
    """

    def __init__(self, interrupt: Callable[[str, float, float], None],
                 authorize: Callable[[str, str, str], str | None] | None = None,
                 rng: random.Random | None = None) -> None:
        self._interrupt = interrupt
        self.authorize = authorize
        self._rng = rng or random.Random(0)  # COUNT(n) and PERCENT(n) draw with it
        self._lock = threading.Lock()
        #: experiments that failed: (experiment id, reason)
        self.failed: list[tuple[str, str]] = []

    def install(self) -> Callable[[], None]:
        from moto.fis.models import FISBackend

        original_create = FISBackend.create_experiment_template
        original_start = FISBackend.start_experiment
        play = self

        def create(backend: Any, *args: Any, **kwargs: Any) -> Any:
            play._validate(backend, kwargs.get("targets") or {}, kwargs.get("role_arn", ""))
            return original_create(backend, *args, **kwargs)

        def start(backend: Any, *args: Any, **kwargs: Any) -> Any:
            experiment = original_start(backend, *args, **kwargs)
            template = backend.experiment_templates[kwargs["experiment_template_id"]]
            play._run(backend, experiment, template)
            return experiment

        FISBackend.create_experiment_template = create  # type: ignore[method-assign,assignment]
        FISBackend.start_experiment = start  # type: ignore[method-assign,assignment]

        def undo() -> None:
            FISBackend.create_experiment_template = original_create  # type: ignore[method-assign]
            FISBackend.start_experiment = original_start  # type: ignore[method-assign]
        return undo

    def _validate(self, backend: Any, targets: dict[str, Any], role_arn: str) -> None:
        from moto.fis.exceptions import FISException

        for name, target in targets.items():
            arns = target.get("resourceArns") or []
            if len(arns) > MAX_RESOURCE_ARNS:
                raise FISException("ValidationException", (
                    f"Target '{name}' lists {len(arns)} resource ARNs; a target may list "
                    f"at most {MAX_RESOURCE_ARNS}"))
        reason = _unassumable(backend.account_id, role_arn)
        if reason:
            raise FISException("ValidationException",
                               f"Unable to assume role {role_arn}: {reason}")

    def _run(self, backend: Any, experiment: dict[str, Any], template: Any) -> None:
        """Carry out the template's spot interruptions as its role, or fail the
        experiment (its state in moto) with the reason."""
        targets = template.targets or {}
        plan: list[tuple[str, float]] = []
        for action in (template.actions or {}).values():
            if action.get("actionId") != SPOT_INTERRUPTIONS:
                continue
            duration = _iso_duration(action.get("parameters", {}).get(
                "durationBeforeInterruption", "PT2M"))
            # The recommendation now, the notice two minutes before the end.
            lead = max(0.0, duration - NOTICE_SECONDS)
            for target_name in action.get("targets", {}).values():
                arns, why = self._resolve(backend, template.role_arn,
                                          targets.get(target_name, {}))
                if why:
                    self._fail(backend, experiment, f"target {target_name}: {why}")
                    return
                for arn in arns:
                    denied = self._may_not(template.role_arn,
                                           "ec2:SendSpotInstanceInterruptions", arn)
                    if denied:
                        self._fail(backend, experiment, denied)
                        return
                    plan.append((arn.rsplit("/", 1)[1], lead))
        for instance_id, lead in plan:
            self._interrupt(instance_id, NOTICE_SECONDS, lead)

    def _may_not(self, role_arn: str, action: str, resource: str) -> str | None:
        return self.authorize(role_arn, action, resource) if self.authorize else None

    def _resolve(self, backend: Any, role_arn: str, target: dict[str, Any]
                 ) -> tuple[list[str], str]:
        """The instance ARNs a target names when the experiment starts, and why it
        resolves to nothing ("" when it does not)."""
        from moto.ec2.models import ec2_backends

        prefix = f"arn:aws:ec2:{backend.region_name}:{backend.account_id}:instance/"
        if target.get("resourceArns"):
            found = list(target["resourceArns"])
        else:
            denied = self._may_not(role_arn, "ec2:DescribeInstances", "*")
            if denied:
                return [], denied
            wanted = target.get("resourceTags") or {}
            states = [v for f in target.get("filters") or () if f.get("path") == "State.Name"
                      for v in f.get("values", ())]
            ec2 = ec2_backends[backend.account_id][backend.region_name]
            found = []
            for instance in ec2.all_instances():
                tags = ec2.tags.get(instance.id, {})
                if wanted and all(tags.get(k) == v for k, v in wanted.items()) and \
                        instance.lifecycle == "spot" and \
                        (not states or instance._state.name in states):
                    found.append(prefix + instance.id)
        mode = str(target.get("selectionMode", "ALL"))
        counted = re.fullmatch(r"(COUNT|PERCENT)\((\d+)\)", mode)
        if counted:
            n = int(counted.group(2))
            size = n if counted.group(1) == "COUNT" else -(-len(found) * n // 100)
            found = self._rng.sample(found, min(size, len(found)))
        return found, "" if found else "Target resolution returned empty set"

    def _fail(self, backend: Any, experiment: dict[str, Any], reason: str) -> None:
        log.info("FIS experiment %s failed: %s", experiment.get("id"), reason)
        with self._lock:
            self.failed.append((str(experiment.get("id")), reason))
        found = backend.experiments.get(experiment.get("id"))
        if found is not None:
            found.status = "failed"  # moto's ManagedState: it stays there
        experiment["state"] = {"status": "failed", "reason": reason}


def _unassumable(account: str, role_arn: str) -> str:
    """Why FIS cannot assume ``role_arn`` ("" if it can)."""
    from moto.iam.models import iam_backends

    backend = iam_backends[account]["aws"]
    try:
        role = backend.get_role_by_arn(role_arn)
    except Exception:
        return "the role does not exist"
    document = role.assume_role_policy_document
    policy = json.loads(document) if isinstance(document, str) else document
    statements = policy.get("Statement", [])
    for s in statements if isinstance(statements, list) else [statements]:
        services = (s.get("Principal") or {}).get("Service", [])
        services = [services] if isinstance(services, str) else services
        actions = s.get("Action", [])
        actions = [actions] if isinstance(actions, str) else actions
        if s.get("Effect") == "Allow" and FIS_PRINCIPAL in services and \
                "sts:AssumeRole" in actions:
            return ""
    return f"its trust policy does not let {FIS_PRINCIPAL} assume it"


def _iso_duration(text: str) -> float:
    """Seconds of an ISO 8601 duration like ``PT2M`` or ``PT90S``."""
    m = re.fullmatch(r"PT(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?", text)
    if not m:
        return 120.0
    hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return hours * 3600.0 + minutes * 60.0 + seconds
