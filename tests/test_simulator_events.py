"""The simulator's EventBridge and Lambda: Auto Scaling's "EC2 Instance Launch
Unsuccessful" event reaches a function only as it would on AWS, and the function's
own zip runs with its role's credentials.

A probe function of the test's own (a zip of a module and the SDK it needs, nothing
of this environment) writes the event it got to S3 with its role's credentials."""

from __future__ import annotations

import io
import json
import logging
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import spot_group

from spotnb.testing import DEFAULT_ACCOUNT, AwsSimulator

BUCKET = "spotnb-events-probe"
SHORT = "g4dn.xlarge"  # the type the groups here ask for: no capacity
PATTERN = {"source": ["aws.autoscaling"], "detail-type": ["EC2 Instance Launch Unsuccessful"],
           "detail": {"AutoScalingGroupName": [{"prefix": "spotnb-"}]}}

PROBE = '''
import json, os, sys, time
import boto3

def handler(event, context):
    group = event["detail"]["AutoScalingGroupName"]
    if os.environ.get("PROBE_SLEEP"):
        time.sleep(float(os.environ["PROBE_SLEEP"]))
    if group == os.environ.get("PROBE_FAIL_GROUP"):
        raise RuntimeError("probe: told to fail for " + group)
    try:
        import pytest  # noqa: F401  (the test's environment: never in a Lambda)
        isolated = False
    except ImportError:
        isolated = True
    boto3.client("s3").put_object(
        Bucket=os.environ["PROBE_BUCKET"], Key="events/" + event["detail"]["ActivityId"],
        Body=json.dumps({"event": event, "function": context.function_name,
                         "remaining": context.get_remaining_time_in_millis(),
                         "boto3": boto3.__file__, "root": os.environ["LAMBDA_TASK_ROOT"],
                         "isolated": isolated}))
'''


@pytest.fixture(scope="module")
def bundle() -> bytes:
    """The probe's zip: its module, boto3 and what it needs (botocore's models of S3
    and STS only, to keep it small)."""
    import boto3
    import botocore
    import dateutil
    import jmespath
    import s3transfer
    import six
    import urllib3

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        archive.writestr("probe.py", PROBE)
        for module in (boto3, botocore, s3transfer, jmespath, dateutil, urllib3):
            root = Path(str(module.__file__)).parent
            for path in root.rglob("*"):
                relative = path.relative_to(root.parent)
                parts = relative.parts
                if path.is_dir() or "__pycache__" in parts or (
                        parts[:2] == ("botocore", "data") and len(parts) > 3
                        and parts[2] not in ("s3", "sts")):
                    continue
                archive.write(path, str(relative))
        archive.write(str(six.__file__), "six.py")
    return out.getvalue()


@pytest.fixture(name="sim")
def simulator(tmp_path: Path) -> Iterator[AwsSimulator]:
    with AwsSimulator(tmp_path / "sim") as sim:
        sim.admin_client("s3").create_bucket(Bucket=BUCKET)
        yield sim


def deploy(sim: AwsSimulator, name: str, code: bytes, *, actions: tuple[str, ...] = (
        "s3:PutObject",), pattern: dict[str, Any] | None = None, enabled: bool = True,
           permission: bool = True, env: dict[str, str] | None = None,
           timeout: int = 60) -> str:
    """The probe as spotnb deploys its mover: a role, the function, a rule on the
    default bus with the function as its target, EventBridge's permission. Its ARN."""
    iam, lam, events = (sim.admin_client(s) for s in ("iam", "lambda", "events"))
    role = iam.create_role(RoleName=name, Path="/spotnb/", AssumeRolePolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
            "Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}))["Role"]["Arn"]
    iam.put_role_policy(RoleName=name, PolicyName=name, PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": list(actions),
                                                "Resource": f"arn:aws:s3:::{BUCKET}/*"}]}))
    function = lam.create_function(
        FunctionName=name, Runtime="python3.11", Handler="probe.handler", Role=role,
        Code={"ZipFile": code}, Timeout=timeout,
        Environment={"Variables": {"PROBE_BUCKET": BUCKET, **(env or {})}})["FunctionArn"]
    rule = events.put_rule(Name=name, EventPattern=json.dumps(pattern or PATTERN),
                           State="ENABLED" if enabled else "DISABLED")["RuleArn"]
    events.put_targets(Rule=name, Targets=[{"Id": name, "Arn": function}])
    if permission:
        lam.add_permission(FunctionName=name, StatementId="events", Principal=
                           "events.amazonaws.com", Action="lambda:InvokeFunction",
                           SourceArn=rule)
    return str(function)


def starve(sim: AwsSimulator, name: str) -> None:
    """A spotnb-tagged group of one whose only pool has no spot capacity."""
    sim.no_capacity(SHORT)
    spot_group(sim, name, [SHORT], desired=1)


def written(sim: AwsSimulator, activity_id: str) -> dict[str, Any]:
    body = sim.admin_client("s3").get_object(Bucket=BUCKET, Key=f"events/{activity_id}")
    return dict(json.loads(body["Body"].read()))


def test_a_failed_launch_runs_the_function_from_its_zip_with_auto_scaling_event(
        sim: AwsSimulator, bundle: bytes) -> None:
    function = deploy(sim, "spotnb-probe", bundle)
    starve(sim, "spotnb-starved")
    done = sim.wait_for_invocations("spotnb-probe", timeout=90)
    assert done[0].ok, done[0].output
    event = done[0].event
    got = written(sim, event["detail"]["ActivityId"])
    assert got["event"] == event, "the function got the event EventBridge routed"
    # The same activity as DescribeScalingActivities shows it.
    asg = sim.admin_client("autoscaling")
    activities = {a["ActivityId"]: a for a in asg.describe_scaling_activities(
        AutoScalingGroupName="spotnb-starved")["Activities"]}
    activity = activities[event["detail"]["ActivityId"]]
    assert activity["StatusCode"] == "Failed"
    detail = event["detail"]
    assert (detail["AutoScalingGroupName"], detail["StatusMessage"], detail["StatusCode"],
            detail["Cause"]) == ("spotnb-starved", activity["StatusMessage"], "Failed",
                                 activity["Cause"])
    assert "InsufficientInstanceCapacity" in detail["StatusMessage"]
    assert detail["Details"] == json.loads(activity["Details"])
    subnet = sim.admin_client("ec2").describe_subnets(SubnetIds=[
        detail["Details"]["Subnet ID"]])["Subnets"][0]
    assert detail["Details"]["Availability Zone"] == subnet["AvailabilityZone"]
    group = asg.describe_auto_scaling_groups(AutoScalingGroupNames=["spotnb-starved"])[
        "AutoScalingGroups"][0]
    assert (event["source"], event["detail-type"], event["account"], event["region"],
            event["resources"]) == ("aws.autoscaling", "EC2 Instance Launch Unsuccessful",
                                    DEFAULT_ACCOUNT, sim.region, [group["AutoScalingGroupARN"]])
    # Lambda's runtime: the zip's own SDK, none of the test's packages, its context.
    assert got["isolated"] and got["boto3"].startswith(got["root"] + os.sep), got
    assert got["function"] == "spotnb-probe" and 0 < got["remaining"] <= 60_000
    assert function.endswith(":function:spotnb-probe")
    text = sim.lambda_log("spotnb-probe").read_text()
    assert f"START RequestId: {done[0].request_id}" in text and "Status: succeeded" in text


def test_nothing_runs_for_a_rule_that_does_not_match_is_disabled_or_may_not_invoke(
        sim: AwsSimulator, bundle: bytes) -> None:
    deploy(sim, "spotnb-other", bundle, pattern={**PATTERN, "detail": {
        "AutoScalingGroupName": [{"prefix": "other-"}]}})
    deploy(sim, "spotnb-disabled", bundle, enabled=False)
    deploy(sim, "spotnb-unallowed", bundle, permission=False)
    deploy(sim, "spotnb-control", bundle)  # so that events are known to flow
    starve(sim, "spotnb-starved")
    # The rules are matched when the event is sent, before any invocation of it runs.
    sim.wait_for_invocations("spotnb-control", timeout=90)
    for name in ("spotnb-other", "spotnb-disabled", "spotnb-unallowed"):
        assert sim.invocations(name) == [], name
        assert not sim.lambda_log(name).exists()
    refused = {u.target.rsplit(":", 1)[-1]: u.reason for u in sim.undelivered}
    assert set(refused) == {"spotnb-unallowed"}, refused
    assert "resource policy does not allow events.amazonaws.com" in refused["spotnb-unallowed"]


def test_a_failed_invocation_is_logged_retried_and_the_next_event_still_runs(
        sim: AwsSimulator, bundle: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spotnb.testing.lambdas")
    deploy(sim, "spotnb-probe", bundle, env={"PROBE_FAIL_GROUP": "spotnb-failing"})
    starve(sim, "spotnb-failing")
    first = sim.wait_for_invocations("spotnb-probe", timeout=90)[0]
    assert first.status == "failed" and first.exit_code == 1
    assert "RuntimeError: probe: told to fail for spotnb-failing" in first.output
    assert "RuntimeError: probe: told to fail" in caplog.text, "a failure is logged"
    # Its group's last event (capacity back: no newer one) is retried twice.
    sim.restore_capacity()
    retried = sim.wait_for_invocations("spotnb-probe", timeout=90, until=lambda found: any(
        i.attempt == 2 for i in found))
    last = next(i for i in retried if i.attempt == 2)
    tries = [i for i in retried if i.event["id"] == last.event["id"]]
    assert [i.attempt for i in tries] == [0, 1, 2] and not any(i.ok for i in tries)
    # Another group's event still runs.
    starve(sim, "spotnb-next")
    ran = sim.wait_for_invocations("spotnb-probe", timeout=90, until=lambda found: any(
        i.ok for i in found))
    good = next(i for i in ran if i.ok)
    assert written(sim, good.event["detail"]["ActivityId"])["event"]["detail"][
        "AutoScalingGroupName"] == "spotnb-next"


def test_the_function_runs_as_its_role_whose_policy_is_enforced(
        sim: AwsSimulator, bundle: bytes) -> None:
    assert sim.iam
    deploy(sim, "spotnb-probe", bundle, actions=("s3:GetObject",))
    starve(sim, "spotnb-starved")
    done = sim.wait_for_invocations("spotnb-probe", timeout=90)[0]
    assert done.status == "failed" and "AccessDenied" in done.output, done.output
    denied = [d for d in sim.denied if d.action == "s3:PutObject"]
    assert denied and denied[0].principal == (
        f"arn:aws:sts::{DEFAULT_ACCOUNT}:assumed-role/spotnb-probe/spotnb-probe"), denied


def test_an_invocation_past_its_timeout_is_killed_and_nothing_outlives_the_simulator(
        tmp_path: Path, bundle: bytes) -> None:
    import psutil

    with AwsSimulator(tmp_path / "sim") as sim:
        deploy(sim, "spotnb-slow", bundle, env={"PROBE_SLEEP": "600"}, timeout=1)
        starve(sim, "spotnb-starved")
        first = sim.wait_for_invocations("spotnb-slow", timeout=90)[0]
        assert first.status == "timed out" and first.exit_code is not None
        assert "Task timed out after 1.00 seconds" in first.output
        # A retry (or the next event) is running or waiting when the simulator stops.
    leftovers = [p for p in psutil.Process().children(recursive=True)
                 if "AWS_LAMBDA_FUNCTION_NAME" in " ".join(_environ(p))]
    assert not leftovers, leftovers


def _environ(proc: Any) -> list[str]:
    import psutil

    try:
        return list(proc.environ())
    except psutil.Error:
        return []


def test_lambda_refuses_what_aws_refuses_at_deployment(sim: AwsSimulator) -> None:
    from botocore.exceptions import ClientError

    iam, lam = sim.admin_client("iam"), sim.admin_client("lambda")
    ec2_role = iam.create_role(RoleName="spotnb-ec2", AssumeRolePolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
            "Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}))["Role"]["Arn"]
    lambda_role = iam.create_role(RoleName="spotnb-lambda", AssumeRolePolicyDocument=(
        json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
            "Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]})))["Role"]["Arn"]
    small = io.BytesIO()
    with zipfile.ZipFile(small, "w") as archive:
        archive.writestr("probe.py", "def handler(event, context):\n    pass\n")

    def refused(message: str, **params: Any) -> None:
        spec = {"FunctionName": "spotnb-refused", "Runtime": "python3.11",
                "Handler": "probe.handler", "Role": lambda_role,
                "Code": {"ZipFile": small.getvalue()}, **params}
        with pytest.raises(ClientError, match=message) as err:
            lam.create_function(**spec)
        assert err.value.response["Error"]["Code"] == "InvalidParameterValueException"

    refused("cannot be assumed by Lambda", Role=ec2_role)
    refused("Reserved keys used in this request: AWS_REGION",
            Environment={"Variables": {"AWS_REGION": "us-west-2"}})
    refused("exceeded the 4KB limit", Environment={"Variables": {"BIG": "x" * 4100}})
    refused("Could not unzip uploaded file", Code={"ZipFile": b"not a zip"})
    lam.create_function(FunctionName="spotnb-fine", Runtime="python3.11",
                        Handler="probe.handler", Role=lambda_role,
                        Code={"ZipFile": small.getvalue()})


def test_a_users_lambda_and_eventbridge_requests_are_checked_against_its_policy(
        sim: AwsSimulator) -> None:
    """IAM enforcement knows Lambda and EventBridge: resources resolved to ARNs, and
    CreateFunction's iam:PassRole of the function's role."""
    import boto3
    from botocore.exceptions import ClientError

    iam = sim.admin_client("iam")
    role = iam.create_role(RoleName="spotnb-mover", Path="/spotnb/",
                           AssumeRolePolicyDocument=json.dumps({
                               "Version": "2012-10-17", "Statement": [{
                                   "Effect": "Allow", "Principal": {
                                       "Service": "lambda.amazonaws.com"},
                                   "Action": "sts:AssumeRole"}]}))["Role"]["Arn"]
    arn = f"{sim.region}:{DEFAULT_ACCOUNT}"
    iam.create_user(UserName="deployer")
    iam.put_user_policy(UserName="deployer", PolicyName="p", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["lambda:CreateFunction", "lambda:AddPermission"],
             "Resource": f"arn:aws:lambda:{arn}:function:spotnb-*"},
            {"Effect": "Allow", "Action": "iam:PassRole", "Resource": role,
             "Condition": {"StringEquals": {"iam:PassedToService": "lambda.amazonaws.com"}}},
            {"Effect": "Allow", "Action": "events:PutRule",
             "Resource": f"arn:aws:events:{arn}:rule/spotnb-*",
             "Condition": {"StringEquals": {"events:source": "aws.autoscaling"}}},
            {"Effect": "Allow", "Action": "events:PutTargets",
             "Resource": f"arn:aws:events:{arn}:rule/spotnb-*",
             "Condition": {"ArnLike": {"events:TargetArn": "arn:aws:lambda:*"}}}]}))
    key = iam.create_access_key(UserName="deployer")["AccessKey"]
    session = boto3.session.Session(aws_access_key_id=key["AccessKeyId"],
                                    aws_secret_access_key=key["SecretAccessKey"],
                                    region_name=sim.region)
    lam, events = session.client("lambda"), session.client("events")
    small = io.BytesIO()
    with zipfile.ZipFile(small, "w") as archive:
        archive.writestr("probe.py", "def handler(event, context):\n    pass\n")
    spec = {"Runtime": "python3.11", "Handler": "probe.handler", "Role": role,
            "Code": {"ZipFile": small.getvalue()}}
    function = lam.create_function(FunctionName="spotnb-mover", **spec)["FunctionArn"]
    with pytest.raises(ClientError) as err:
        lam.create_function(FunctionName="other-mover", **spec)
    assert err.value.response["Error"]["Code"] == "AccessDeniedException"
    rule = events.put_rule(Name="spotnb-launch-unsuccessful",
                           EventPattern=json.dumps(PATTERN))["RuleArn"]
    events.put_targets(Rule="spotnb-launch-unsuccessful",
                       Targets=[{"Id": "spotnb-mover", "Arn": function}])
    with pytest.raises(ClientError):
        events.put_rule(Name="spotnb-ec2", EventPattern=json.dumps({"source": ["aws.ec2"]}))
    lam.add_permission(FunctionName="spotnb-mover", StatementId="events",
                       Principal="events.amazonaws.com", Action="lambda:InvokeFunction",
                       SourceArn=rule)
    denied = {(d.action, d.resource) for d in sim.denied}
    assert denied == {("lambda:CreateFunction", f"arn:aws:lambda:{arn}:function:other-mover"),
                      ("events:PutRule", f"arn:aws:events:{arn}:rule/spotnb-ec2")}, denied
    calls = [c for c in sim.server.requests.calls() if c.operation == "CreateFunction"]
    assert calls and all(c.params["Code"]["ZipFile"] == b"" for c in calls), \
        "a function's zip is not kept in the request log"
