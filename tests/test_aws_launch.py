"""The AWS provider's launch, rollback and teardown held to AWS's contracts, on the
simulator (moto in server mode plus real agents).

Every test here ends with ``spotnb aws cleanup --dry-run`` finding nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_aws_provider as aws_tests
from aws_reference import floor

import spotnb
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import LAUNCH_HOOK_NAME, LIFECYCLE_HOOK_NAME
from spotnb.testing import AwsSimulator

Requests = list[tuple[str, str, dict[str, Any]]]


@pytest.fixture
def sim(spotnb_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsSimulator]:
    """The AWS tests' simulator (nothing left over, no request refused)."""
    yield from aws_tests.sim.__wrapped__(spotnb_home, tmp_path, monkeypatch)


@contextlib.contextmanager
def recording() -> Iterator[Requests]:
    """Every request spotnb's clients make meanwhile: (service, operation, params)."""
    found: Requests = []

    def record(params: Any = None, model: Any = None, **kwargs: Any) -> None:
        if model is not None and isinstance(params, dict):
            found.append((model.service_model.service_name, model.name, dict(params)))

    remove = _boto.add_hook("before-parameter-build.*", record)
    try:
        yield found
    finally:
        remove()


def groups() -> list[str]:
    return [g["AutoScalingGroupName"] for g in _boto.client("autoscaling")
            .describe_auto_scaling_groups()["AutoScalingGroups"]]


def test_a_group_made_although_its_answer_failed_is_deleted_by_the_rollback(
        sim: AwsSimulator) -> None:
    # The group exists (and launches) as soon as CreateAutoScalingGroup is done, whatever
    # becomes of its answer: it is in the rollback before the call.
    def lost(**kwargs: Any) -> None:
        raise RuntimeError("the answer was lost")

    remove = _boto.add_hook("after-call.auto-scaling.CreateAutoScalingGroup", lost)
    try:
        with pytest.raises(Exception, match="the answer was lost"):
            spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
    finally:
        remove()
    assert groups() == [], "no group survives the failed launch"


def test_a_group_deleted_while_its_instance_launches_leaves_no_instance(
        sim: AwsSimulator) -> None:
    # A stop, or a launch's rollback, deletes the group while Auto Scaling launches its
    # instance: the forced deletion ends the launch in flight too (the simulator once
    # left that instance running, outside any group).
    from helpers import wait_until

    autoscaling, ec2 = sim.admin_client("autoscaling"), sim.admin_client("ec2")
    deleted: list[str] = []

    def delete_the_group(**kwargs: Any) -> None:
        if not deleted:  # the group's first launch, between RunInstances and its attach
            (group,) = autoscaling.describe_auto_scaling_groups()["AutoScalingGroups"]
            deleted.append(group["AutoScalingGroupName"])
            autoscaling.delete_auto_scaling_group(AutoScalingGroupName=deleted[0],
                                                  ForceDelete=True)

    remove = _boto.add_hook("after-call.ec2.RunInstances", delete_the_group)
    try:
        handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
        wait_until(lambda: bool(deleted), 60, "the group's first launch")
    finally:
        remove()

    def left() -> list[str]:  # not terminated (nor on its way)
        return [i["InstanceId"] for r in ec2.describe_instances(Filters=[
            {"Name": "instance-state-name",
             "Values": ["pending", "running", "stopping", "stopped"]}])[
            "Reservations"] for i in r["Instances"]]
    wait_until(lambda: not left(), 30, "the instance launched for the deleted group")
    handle.stop()


def test_a_standby_group_is_made_with_its_hooks_and_a_lost_answer_is_no_failure(
        sim: AwsSimulator) -> None:
    # A lost answer (the connection closed after AWS made the group): the retry's
    # AlreadyExists is the same group, the job's, and the launch goes on.
    from botocore.exceptions import ConnectionClosedError

    answers = []

    def lose_the_first(**kwargs: Any) -> None:
        answers.append(1)
        if len(answers) == 1:
            raise ConnectionClosedError(endpoint_url="https://autoscaling")

    remove = _boto.add_hook("after-call.auto-scaling.CreateAutoScalingGroup",
                            lose_the_first)
    try:
        with recording() as sent:
            handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
    finally:
        remove()
    assert groups() == [f"spotnb-{handle.job_id}"]
    ops = [op for _, op, _ in sent]
    assert "PutLifecycleHook" not in ops, "no moment without the hooks"
    create = [p for _, op, p in sent if op == "CreateAutoScalingGroup"]
    assert len(create) == 2, "the retry after the lost answer"
    hooks = {h["LifecycleHookName"]: h["LifecycleTransition"]
             for h in create[0]["LifecycleHookSpecificationList"]}
    assert hooks == {LAUNCH_HOOK_NAME: "autoscaling:EC2_INSTANCE_LAUNCHING",
                     LIFECYCLE_HOOK_NAME: "autoscaling:EC2_INSTANCE_TERMINATING"}
    assert floor.validate("autoscaling", "CreateAutoScalingGroup", create[0]) == []
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.status, result.reason)


# ------------------------------------------------------- the default image (finding 12)


def test_doctor_checks_the_image_is_the_pytorch_deep_learning_ami(
        sim: AwsSimulator, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotnb.providers.aws import admin
    from spotnb.providers.aws.resources import DLAMI_NAME, DLAMI_PARAMETER

    # The supported PyTorch line (2.7's lost its patch support in April 2026).
    assert "pytorch-2.11-ubuntu-24.04" in DLAMI_PARAMETER
    (image,) = [c for c in admin.doctor() if c.name == "image"]
    assert image.ok is True and DLAMI_NAME in image.detail, image
    assert "/opt/pytorch/bin/python" in image.detail and "g6e" in image.detail
    monkeypatch.setenv("SPOTNB_AWS_AMI", "ami-0000000000000dead")
    (image,) = [c for c in admin.doctor() if c.name == "image"]
    assert image.ok is False and "does not exist in us-east-1" in image.detail, image
    # A launch with it is refused before anything is made (its launches would fail
    # one after the other for SPOTNB_AWS_LAUNCH_FAILURE).
    from spotnb.protocol.spec import SpecError

    with pytest.raises(SpecError, match=r"SPOTNB_AWS_AMI=ami-0000000000000dead does not "
                                        r"exist in us-east-1.*Nothing was started"):
        spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
    assert groups() == []


# ------------------------------------------------------ a role that cannot delete itself


def test_the_next_launch_deletes_a_role_that_iam_would_not_let_delete_itself(
        sim: AwsSimulator) -> None:
    # An instance deletes its role's policy, then the role: the permission for the
    # second was in the first, so IAM may refuse it (eventual consistency is no
    # promise). The role left behind, policy-less, is the next launch's to delete.
    import json

    from spotnb.protocol import layout
    from spotnb.protocol.store import open_store
    from spotnb.providers.aws.policies import trust_policy
    from spotnb.providers.aws.resources import IAM_PATH, TAG_JOB, TAG_STORE
    from spotnb.providers.aws.store import ensure_bucket

    ended = "20260101-000000-e0e0e0"
    uri = f"s3://spotnb-123456789012-us-east-1/jobs/{ended}"
    ensure_bucket(_boto.client("s3"), "spotnb-123456789012-us-east-1", "us-east-1",
                  "123456789012")
    open_store(uri).put(layout.RESULT, json.dumps({"status": "completed"}).encode())
    iam = _boto.client("iam")
    iam.create_role(RoleName=f"spotnb-job-{ended}", Path=IAM_PATH,
                    AssumeRolePolicyDocument=json.dumps(trust_policy("ec2.amazonaws.com")),
                    Tags=[{"Key": TAG_JOB, "Value": ended}, {"Key": TAG_STORE, "Value": uri}])
    second = spotnb.submit("x = 2", provider="aws", instance_types=["g4dn.xlarge"])
    roles = [r["RoleName"] for r in iam.list_roles(PathPrefix=IAM_PATH)["Roles"]]
    assert f"spotnb-job-{ended}" not in roles
    assert f"spotnb-job-{second.job_id}" in roles, "a running job's role is kept"
    assert second.wait(timeout=240).status == "completed"


# ----------------------------------------------- a launch that cannot work (finding 15)


def test_a_launch_that_cannot_work_is_said_and_fails_the_job_with_awss_reason(
        sim: AwsSimulator, monkeypatch: pytest.MonkeyPatch) -> None:
    # An instance profile that never becomes valid (deleted meanwhile, a policy that
    # denies iam:PassRole...): Auto Scaling's activities fail, not for capacity.
    from botocore.awsrequest import AWSResponse

    monkeypatch.setenv("SPOTNB_AWS_LAUNCH_FAILURE", "3")
    reason = ("Value (spotnb-job-x) for parameter iamInstanceProfile.name is invalid. "
              "Invalid IAM Instance Profile name")

    def refuse(**kwargs: Any) -> Any:
        return AWSResponse("", 400, {}, None), {"Error": {
            "Code": "InvalidParameterValue", "Message": reason}}

    remove = _boto.add_hook("before-call.ec2.RunInstances", refuse)
    try:
        handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
        result = handle.wait(timeout=120)
    finally:
        remove()
    assert result.status == "failed"
    assert reason in str(result.reason) and "spotnb aws doctor" in str(result.reason)
    said = [e.data.get("detail") for e in handle.events(follow=False)
            if e.type == "status" and e.data.get("state") == "launching"]
    assert any("Auto Scaling could not launch an instance: " in str(d) and reason in str(d)
               for d in said), said
    assert groups() == [], "the group of a job that failed is deleted"
