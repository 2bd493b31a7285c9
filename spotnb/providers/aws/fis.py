"""Interruptions on request (``%spot_interrupt``, ``spotnb interrupt``): AWS Fault
Injection Service's ``aws:ec2:send-spot-instance-interruptions``.

One experiment per request, from a template made for it and deleted once started (a
started experiment keeps its own copy), run by the shared ``spotnb-fis`` role (made on
first use; :func:`role`). The target (:func:`fis_target`) is one instance by
its ARN, or every running spot instance of the job by its tag: FIS takes at most five
ARNs a target. FIS sends the rebalance recommendation when the experiment starts and
the interruption notice two minutes before the end of ``durationBeforeInterruption``
(2 to 15 minutes; FIS actions reference): a longer duration is a recommendation that
comes ahead of its notice, as EC2's often does (:func:`duration`).
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto
from spotnb.providers.aws.policies import fis_policy, trust_policy
from spotnb.providers.aws.resources import FIS_ROLE, IAM_PATH, TAG_JOB, TAG_MANAGED

__all__ = ["MAX_LEAD_SECONDS", "NOTICE", "duration", "role", "send"]

log = logging.getLogger(__name__)

# FIS's shortest notice, as on a real interruption; FIS interrupts at most 15 minutes
# after its experiment starts (durationBeforeInterruption PT2M to PT15M).
NOTICE = "PT2M"
NOTICE_SECONDS = 120.0
MAX_LEAD_SECONDS = 780.0
# A new FIS role is not assumable until IAM has propagated it: tried this often.
ROLE_ATTEMPTS = 6


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


def duration(rebalance_lead: float) -> str:
    """``durationBeforeInterruption`` for a recommendation ``rebalance_lead`` seconds
    before its notice (0: both at once)."""
    if not 0 <= rebalance_lead <= MAX_LEAD_SECONDS:
        raise SpecError(f"rebalance_lead must be 0 to {MAX_LEAD_SECONDS:g} s (FIS "
                        "interrupts at most 15 minutes after it starts)")
    return NOTICE if not rebalance_lead else f"PT{int(NOTICE_SECONDS + rebalance_lead)}S"


def role(iam: Any, region: str, account: str) -> tuple[str, bool]:
    """The shared FIS role's ARN, and whether it was created just now. A role that
    exists gets the current policy again (one made before jobs ran in several regions
    named one region's instances)."""
    try:
        arn = str(iam.get_role(RoleName=FIS_ROLE)["Role"]["Arn"])
        iam.put_role_policy(RoleName=FIS_ROLE, PolicyName="spotnb-fis",
                            PolicyDocument=json.dumps(fis_policy(region, account)))
        return arn, False
    except Exception as err:
        if _boto.error_code(err) != "NoSuchEntity":
            _boto.raise_for(err, "looking up the FIS role")
    made = iam.create_role(
        RoleName=FIS_ROLE, Path=IAM_PATH,
        AssumeRolePolicyDocument=json.dumps(trust_policy("fis.amazonaws.com")),
        Description="spotnb: send spot interruption notices to spotnb instances",
        Tags=[{"Key": TAG_MANAGED, "Value": "true"}])["Role"]
    iam.put_role_policy(RoleName=FIS_ROLE, PolicyName="spotnb-fis",
                        PolicyDocument=json.dumps(fis_policy(region, account)))
    return str(made["Arn"]), True


def send(fis: Any, role_arn: str, role_is_new: bool, job_id: str,
         instance_arn: str | None, rebalance_lead: float = 0.0) -> None:
    """Start one experiment that interrupts the job's running spot instances (or the
    one ``instance_arn``); its template is deleted once the experiment started."""
    wait = duration(rebalance_lead)

    def role_not_ready(err: BaseException) -> bool:
        # A role made just now is not assumable by FIS until IAM has propagated it
        # (FIS answers ValidationException naming the role); any other validation
        # error (a bad target, say) is raised at once.
        return role_is_new and _boto.error_code(err) == "ValidationException" and \
            "role" in _boto.error_message(err).lower()

    template = _boto.with_backoff(lambda: fis.create_experiment_template(
        clientToken=str(uuid.uuid4()),
        description=f"spotnb: interrupt job {job_id}",
        roleArn=role_arn,
        stopConditions=[{"source": "none"}],
        targets={"SpotInstances": fis_target(job_id, instance_arn)},
        actions={"interrupt": {
            "actionId": "aws:ec2:send-spot-instance-interruptions",
            "parameters": {"durationBeforeInterruption": wait},
            "targets": {"SpotInstances": "SpotInstances"}}},
        tags={TAG_JOB: job_id, TAG_MANAGED: "true"},
    ), what="creating the FIS experiment template", retry_if=role_not_ready,
        attempts=ROLE_ATTEMPTS)["experimentTemplate"]
    try:
        _boto.with_backoff(lambda: fis.start_experiment(
            clientToken=str(uuid.uuid4()), experimentTemplateId=template["id"],
            tags={TAG_JOB: job_id}), what="starting the FIS experiment")
    finally:
        # A started experiment keeps its own copy of the template.
        try:
            fis.delete_experiment_template(id=template["id"])
        except Exception as err:
            if "NotFound" not in _boto.error_code(err):
                raise
