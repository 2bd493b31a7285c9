"""The simulator held to AWS's contract: request shapes against botocore's models.

Every request that reaches the simulator is parsed back into its operation's
parameters; every test with the AWS provider's ``sim`` fixture checks its requests
against the running botocore's models, and the flow here also against the botocore
that spotnb's requirements allow at the lowest (the declared floor, whose models are
vendored in ``tests/aws_reference/``).
"""

from __future__ import annotations

import json
import random
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_aws_provider as aws_tests
from aws_reference import floor
from helpers import spot_group, wait_until

import spotnb
from spotnb.providers.aws import _boto
from spotnb.providers.aws.policies import fis_policy, instance_policy, trust_policy
from spotnb.providers.aws.resources import TAG_JOB, TAG_MANAGED
from spotnb.providers.imds import ImdsClient
from spotnb.testing import (
    DEFAULT_ACCOUNT,
    FAKE_CREDENTIALS,
    AwsSimulator,
    MotoServer,
    aws_environment,
    contract,
)
from spotnb.testing.allocation import pool_order
from spotnb.testing.iam import RESOURCE_GONE, ROLE_DELETED
from spotnb.testing.simulator import SPOTNB_ORIGINS


@pytest.fixture(name="sim")
def simulator(spotnb_home: Path, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsSimulator]:
    """The AWS tests' simulator (nothing left over, every request valid)."""
    yield from aws_tests.sim.__wrapped__(spotnb_home, tmp_path, monkeypatch)


@pytest.fixture
def server() -> Iterator[MotoServer]:
    moto = MotoServer().start()
    try:
        with aws_environment(moto.endpoint):
            yield moto
    finally:
        moto.stop()


def test_requests_are_recorded_as_the_parameters_the_client_sent(server: MotoServer) -> None:
    s3, ec2, ssm, asg = (_boto.client(s) for s in ("s3", "ec2", "ssm", "autoscaling"))
    s3.create_bucket(Bucket="spotnb-contract")
    s3.put_object(Bucket="spotnb-contract", Key="jobs/a/lease", Body=b"x" * 4096,
                  IfNoneMatch="*")
    s3.list_objects_v2(Bucket="spotnb-contract", Prefix="jobs/a/", MaxKeys=7)
    ec2.describe_instances(Filters=[{"Name": "tag:spotnb:job", "Values": ["a", "b"]}])
    ssm.put_parameter(Name="/spotnb/jobs/a/KEY", Value="v", Type="SecureString",
                      Tags=[{"Key": "spotnb:job", "Value": "a"}])
    asg.describe_auto_scaling_groups(AutoScalingGroupNames=["spotnb-a"])
    calls = {(c.service, c.operation): c for c in server.requests.calls()}
    put = calls["s3", "PutObject"]
    assert (put.params["Bucket"], put.params["Key"], put.params["IfNoneMatch"]) == (
        "spotnb-contract", "jobs/a/lease", "*")
    assert put.params["Body"] == b"", "payloads are not kept"
    assert put.origin == "notebook" and not put.error
    listing = calls["s3", "ListObjectsV2"].params
    assert (listing["Prefix"], listing["MaxKeys"]) == ("jobs/a/", 7)
    assert calls["ec2", "DescribeInstances"].params == {
        "Filters": [{"Name": "tag:spotnb:job", "Values": ["a", "b"]}]}
    assert calls["ssm", "PutParameter"].params["Tags"] == [
        {"Key": "spotnb:job", "Value": "a"}]
    assert calls["autoscaling", "DescribeAutoScalingGroups"].params == {
        "AutoScalingGroupNames": ["spotnb-a"]}
    assert contract.check(server.requests.calls(), contract.ModelSet.installed()) == []


def test_a_parameter_the_floors_botocore_lacks_is_refused(server: MotoServer) -> None:
    s3 = _boto.client("s3")
    s3.create_bucket(Bucket="spotnb-contract")
    s3.put_object(Bucket="spotnb-contract", Key="k", Body=b"1", IfNoneMatch="*")
    s3.copy_object(Bucket="spotnb-contract", Key="plain", CopySource="spotnb-contract/k")
    # Conditional copies came to S3 (and botocore's model) long after the floor's 1.35.69.
    s3.copy_object(Bucket="spotnb-contract", Key="guarded", CopySource="spotnb-contract/k",
                   IfNoneMatch="*")
    refused = contract.check(server.requests.calls(), floor.model_set())
    assert [(v.call.operation, v.call.params.get("Key")) for v in refused] == [
        ("CopyObject", "guarded")]
    # Only IfNoneMatch: the floor has PutObject's (finding 1), and the checksums the
    # running botocore adds by itself (CRC64NVME is newer than the floor too) are not
    # held against spotnb.
    assert re.findall(r'Unknown parameter in input: "(\w+)"', refused[0].report) == [
        "IfNoneMatch"]
    assert floor.FLOOR in refused[0].models


# ------------------------------------------------------------------------- FIS


def _spot_instances(sim: AwsSimulator, n: int) -> list[str]:
    ec2 = _boto.client("ec2")
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    ids = [i["InstanceId"] for i in ec2.run_instances(
        ImageId=image, InstanceType="g4dn.xlarge", MinCount=n, MaxCount=n,
        InstanceMarketOptions={"MarketType": "spot"},
        TagSpecifications=[{"ResourceType": "instance", "Tags": [
            {"Key": TAG_MANAGED, "Value": "true"}]}])["Instances"]]
    wait_until(lambda: all(i in sim.instances for i in ids), 20, "the instances booted")
    return ids


def _template(fis: Any, role_arn: str, ids: list[str]) -> dict[str, Any]:
    arns = [f"arn:aws:ec2:us-east-1:{DEFAULT_ACCOUNT}:instance/{i}" for i in ids]
    return dict(fis.create_experiment_template(
        clientToken=secrets.token_hex(8), description="test", roleArn=role_arn,
        stopConditions=[{"source": "none"}],
        targets={"Spot": {"resourceType": "aws:ec2:spot-instance", "resourceArns": arns,
                          "selectionMode": "ALL"}},
        actions={"interrupt": {"actionId": "aws:ec2:send-spot-instance-interruptions",
                               "parameters": {"durationBeforeInterruption": "PT2M"},
                               "targets": {"SpotInstances": "Spot"}}})["experimentTemplate"])


def test_fis_refuses_more_than_five_arns_a_role_it_cannot_assume_and_interrupts_as_asked(
        sim: AwsSimulator) -> None:
    from botocore.exceptions import ClientError

    ids = _spot_instances(sim, 6)
    fis, iam = _boto.client("fis"), _boto.client("iam")
    role = iam.create_role(RoleName="spotnb-fis-test", Path="/spotnb/",
                           AssumeRolePolicyDocument=json.dumps(trust_policy(
                               "fis.amazonaws.com")))["Role"]["Arn"]
    iam.put_role_policy(RoleName="spotnb-fis-test", PolicyName="fis",
                        PolicyDocument=json.dumps(fis_policy("us-east-1", DEFAULT_ACCOUNT)))
    ec2_role = iam.create_role(RoleName="spotnb-not-fis", Path="/spotnb/",
                               AssumeRolePolicyDocument=json.dumps(trust_policy(
                                   "ec2.amazonaws.com")))["Role"]["Arn"]
    for role_arn, targets, message in (
            (role, ids, "at most 5"),
            (ec2_role, ids[:2], "does not let fis.amazonaws.com assume it"),
            (role.replace("spotnb-fis-test", "gone"), ids[:2], "does not exist")):
        with pytest.raises(ClientError, match=message) as refused:
            _template(fis, role_arn, targets)
        assert refused.value.response["Error"]["Code"] == "ValidationException"
    template = _template(fis, role, ids[:5])
    fis.start_experiment(clientToken=secrets.token_hex(8),
                         experimentTemplateId=template["id"])
    noticed = [ImdsClient(sim.instances[i].imds.endpoint, timeout=30).instance_action()
               for i in ids]
    assert [n is not None for n in noticed] == [True] * 5 + [False]
    iam.delete_role_policy(RoleName="spotnb-fis-test", PolicyName="fis")
    for name in ("spotnb-fis-test", "spotnb-not-fis"):
        iam.delete_role(RoleName=name)
    fis.delete_experiment_template(id=template["id"])


def test_fis_selects_a_jobs_running_spot_instances_by_tag_and_recommends_first(
        sim: AwsSimulator) -> None:
    """spotnb's whole-job interruption (a target by tag, not ARNs: six instances here,
    FIS takes five ARNs) as FIS resolves it when the experiment starts: the job's
    running spot instances only; the recommendation at the start, the notice two
    minutes before the end of ``durationBeforeInterruption``; FIS's service-linked
    role made at the first experiment, with the user's permission."""
    from spotnb.providers.aws import fis as aws_fis

    ec2 = sim.admin_client("ec2")
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]

    def launch(job: str, spot: bool = True) -> str:
        params: dict[str, Any] = dict(
            ImageId=image, InstanceType="g4dn.xlarge", MinCount=1, MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                {"Key": TAG_MANAGED, "Value": "true"}, {"Key": TAG_JOB, "Value": job}]}])
        if spot:
            params["InstanceMarketOptions"] = {"MarketType": "spot"}
        return str(ec2.run_instances(**params)["Instances"][0]["InstanceId"])

    mine = [launch("j1") for _ in range(7)]
    on_demand, others = launch("j1", spot=False), launch("j2")
    everyone = [*mine, on_demand, others]
    wait_until(lambda: all(i in sim.instances for i in everyone), 30, "the instances booted")
    stopped = mine.pop()
    ec2.stop_instances(InstanceIds=[stopped])
    assert not sim.admin_client("iam").list_roles(PathPrefix="/aws-service-role/fis")[
        "Roles"], "a fresh account"
    role_arn, made = aws_fis.role(_boto.client("iam"), "us-east-1", DEFAULT_ACCOUNT)
    lead = 60.0  # market seconds: the recommendation a minute before the notice
    sim.notice_seconds = 6.0  # FIS's two minutes, as a test may set them once started
    aws_fis.send(_boto.client("fis"), role_arn, made, "j1", None, rebalance_lead=lead)
    wait_until(lambda: all(sim.instances[i].notice_at is not None for i in mine), 30,
               "the notices")
    signals = {(iid, kind): at for at, iid, kind in sim.signals_sent}
    for iid in mine:
        # The notice is due `lead` after the recommendation (scaled as the notice
        # period is): never earlier; EC2 ends the instance two FIS minutes after it.
        assert signals[iid, "notice"] - signals[iid, "rebalance"] >= \
            lead * sim.notice_seconds / 120.0
        inst = sim.instances[iid]
        assert inst.terminate_at is not None and inst.notice_at is not None
        assert inst.terminate_at - inst.notice_at == pytest.approx(sim.notice_seconds)
    assert not {iid for iid, _ in signals} & {stopped, on_demand, others}, signals
    assert sim.admin_client("iam").get_role(RoleName="AWSServiceRoleForFIS")["Role"][
        "Path"] == "/aws-service-role/fis.amazonaws.com/"
    assert sim.fis.failed == []
    ec2.terminate_instances(InstanceIds=everyone)
    admin = sim.admin_client("iam")
    admin.delete_role_policy(RoleName="spotnb-fis", PolicyName="spotnb-fis")
    admin.delete_role(RoleName="spotnb-fis")


# ----------------------------------------------------------------- Auto Scaling


def test_pool_order_follows_the_allocation_strategy_not_the_list() -> None:
    pools = [("g5.xlarge", "subnet-a", "use1-az1"), ("g4dn.xlarge", "subnet-a", "use1-az1"),
             ("p3.2xlarge", "subnet-a", "use1-az1")]
    rng = random.Random(0)
    by_price = [p[0] for p in pool_order(pools, "price-capacity-optimized", True, "us-east-1",
                                         rng)]
    assert by_price[0] == "g4dn.xlarge", "the cheapest spot pool first"
    assert pool_order(pools, "capacity-optimized-prioritized", True, "us-east-1", rng) == pools
    assert pool_order(pools, "prioritized", False, "us-east-1", rng) == pools
    on_demand = [p[0] for p in pool_order(pools, "lowest-price", False, "us-east-1", rng)]
    assert on_demand == ["g4dn.xlarge", "g5.xlarge", "p3.2xlarge"]
    drawn = {tuple(pool_order(pools, "capacity-optimized", True, "us-east-1", rng))
             for _ in range(20)}
    assert len(drawn) > 1, "capacity decides, not the list"


def test_a_launch_by_price_claims_no_capacity_error_that_did_not_happen(
        sim: AwsSimulator) -> None:
    # Issue 35 finding 11: under price-capacity-optimized Auto Scaling ignores the types'
    # order; the launch said "g5.xlarge had no spot capacity" when g4dn.xlarge was
    # simply cheaper and g5.xlarge never tried.
    handle = spotnb.submit("x = 1", provider="aws", instance_types=["g5.xlarge", "g4dn.xlarge"])
    result = handle.wait(timeout=90)
    assert result.status == "completed", (result.reason, result.error)
    assert [a.instance_type for a in result.attempts] == ["g4dn.xlarge"]
    assert not sim.activities or all(a["StatusCode"] == "Successful"
                                     for acts in sim.activities.values() for a in acts)
    launching = [e.data["detail"] for e in handle.events(follow=False)
                 if e.type == "status" and e.data["state"] == "launching" and e.instance]
    assert launching and not any("had no spot capacity" in d for d in launching), launching
    assert any("Auto Scaling's choice among the job's 2 types" in d for d in launching), \
        launching


def _group_with_hooks(sim: AwsSimulator, name: str, default: str, timeout: int) -> Any:
    """A spotnb-tagged group of one (launched by the simulator) with a launch hook and a
    termination hook; its Auto Scaling client (the administrator's: Auto Scaling's
    rules are under test here, not spotnb's permissions)."""
    image = sim.admin_client("ec2").describe_images(Owners=["amazon"], MaxResults=5)[
        "Images"][0]["ImageId"]
    asg = spot_group(sim, name, ["g4dn.xlarge"], desired=0, max_size=2, image=image)
    asg.put_lifecycle_hook(LifecycleHookName="up", AutoScalingGroupName=name,
                           LifecycleTransition="autoscaling:EC2_INSTANCE_LAUNCHING",
                           HeartbeatTimeout=timeout, DefaultResult=default)
    asg.put_lifecycle_hook(LifecycleHookName="down", AutoScalingGroupName=name,
                           LifecycleTransition="autoscaling:EC2_INSTANCE_TERMINATING",
                           HeartbeatTimeout=30, DefaultResult="CONTINUE")
    asg.set_desired_capacity(AutoScalingGroupName=name, DesiredCapacity=1)
    return asg


def _states(asg: Any, name: str) -> dict[str, str]:
    groups = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"]
    return {i["InstanceId"]: i["LifecycleState"] for g in groups for i in g["Instances"]}


def _remove(sim: AwsSimulator, name: str) -> None:
    sim.admin_client("autoscaling").delete_auto_scaling_group(AutoScalingGroupName=name,
                                                              ForceDelete=True)
    sim.admin_client("ec2").delete_launch_template(LaunchTemplateName=name)


def test_a_member_waits_in_pending_wait_where_aws_refuses_what_it_refuses(
        sim: AwsSimulator) -> None:
    from botocore.exceptions import ClientError

    name = "spotnb-lifecycle-test"
    asg = _group_with_hooks(sim, name, default="ABANDON", timeout=3600)
    first = wait_until(lambda: next(iter(_states(asg, name)), None), 20, "the launch")
    assert _states(asg, name) == {first: "Pending:Wait"}
    described = asg.describe_auto_scaling_instances(InstanceIds=[first])
    assert described["AutoScalingInstances"][0]["LifecycleState"] == "Pending:Wait"

    def refused(code: str, message: str, call: Any, **params: Any) -> None:
        with pytest.raises(ClientError, match=re.escape(message)) as err:
            call(**params)
        assert err.value.response["Error"]["Code"] == code

    refused("ValidationError", "is not in InService or EnteringStandby or Standby",
            asg.set_instance_protection, AutoScalingGroupName=name, InstanceIds=[first],
            ProtectedFromScaleIn=True)
    refused("ValidationError", f"The instance {first} is not in InService",
            asg.detach_instances, AutoScalingGroupName=name, InstanceIds=[first],
            ShouldDecrementDesiredCapacity=True)
    refused("ScalingActivityInProgress", "Pending:Wait",
            asg.terminate_instance_in_auto_scaling_group, InstanceId=first,
            ShouldDecrementDesiredCapacity=True)
    refused("ValidationError", f"No active Lifecycle Action found with instance ID {first}",
            asg.complete_lifecycle_action, LifecycleHookName="down",
            AutoScalingGroupName=name, LifecycleActionResult="CONTINUE", InstanceId=first)
    # CONTINUE: in service; what was refused now works, and the hook is done.
    asg.complete_lifecycle_action(LifecycleHookName="up", AutoScalingGroupName=name,
                                  LifecycleActionResult="CONTINUE", InstanceId=first)
    assert _states(asg, name) == {first: "InService"}
    asg.set_instance_protection(AutoScalingGroupName=name, InstanceIds=[first],
                                ProtectedFromScaleIn=True)
    refused("ValidationError", "No active Lifecycle Action",
            asg.complete_lifecycle_action, LifecycleHookName="up",
            AutoScalingGroupName=name, LifecycleActionResult="CONTINUE", InstanceId=first)
    # Through the termination hook: Terminating:Wait, then protection is refused.
    asg.terminate_instance_in_auto_scaling_group(InstanceId=first,
                                                 ShouldDecrementDesiredCapacity=False)
    assert _states(asg, name)[first] == "Terminating:Wait"
    refused("ValidationError", "is not in InService or EnteringStandby or Standby",
            asg.set_instance_protection, AutoScalingGroupName=name, InstanceIds=[first],
            ProtectedFromScaleIn=False)
    asg.complete_lifecycle_action(LifecycleHookName="down", AutoScalingGroupName=name,
                                  LifecycleActionResult="CONTINUE", InstanceId=first)
    wait_until(lambda: sim.instances[first].terminated, 20, "the first ended")
    # ABANDON on the launch hook: the instance is terminated, the group launches another.
    second = wait_until(lambda: next((i for i in _states(asg, name) if i != first), None),
                        20, "a replacement")
    wait_until(lambda: second in sim.instances, 20, "the replacement booted")
    asg.complete_lifecycle_action(LifecycleHookName="up", AutoScalingGroupName=name,
                                  LifecycleActionResult="ABANDON", InstanceId=second)
    wait_until(lambda: sim.instances[second].terminated, 20, "the abandoned one ended")
    _remove(sim, name)


def test_a_launch_hook_that_times_out_takes_its_default_result(sim: AwsSimulator) -> None:
    name = "spotnb-lifecycle-timeout"
    # 240 s of hook wait is 4 s here (scaled as the notice period: 120 s -> 2 s).
    asg = _group_with_hooks(sim, name, default="CONTINUE", timeout=240)
    first = wait_until(lambda: next(iter(_states(asg, name)), None), 20, "the launch")
    assert _states(asg, name) == {first: "Pending:Wait"}
    wait_until(lambda: _states(asg, name) == {first: "InService"}, 30, "the timeout")
    _remove(sim, name)


# ------------------------------------------------------------- S3's lost responses


def test_a_conditional_write_can_commit_and_lose_its_response(server: MotoServer) -> None:
    """The fault as S3 plays it: the write commits, botocore's retry meets 412."""
    from botocore.exceptions import ClientError

    s3 = _boto.client("s3")
    s3.create_bucket(Bucket="spotnb-lost")
    server.lost_responses.arm("jobs/*", count=1)
    with pytest.raises(ClientError) as err:
        s3.put_object(Bucket="spotnb-lost", Key="jobs/a", Body=b"mine", IfNoneMatch="*")
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket="spotnb-lost", Key="jobs/a")["Body"].read() == b"mine"
    puts = [r.status for r in server.requests.snapshot() if r.operation == "PutObject"]
    assert puts == [500, 412], "the first try committed, the retry was refused"
    assert server.lost_responses.lost == ["jobs/a"]
    s3.put_object(Bucket="spotnb-lost", Key="jobs/b", Body=b"x", IfNoneMatch="*")  # disarmed


def test_a_lease_whose_write_response_was_lost_is_still_held(server: MotoServer) -> None:
    """Issue 35's suspected defect, confirmed: the lease took a committed write whose
    response was lost for a lost race (412 on botocore's retry) and gave up the job."""
    from spotnb.protocol import lease
    from spotnb.protocol.store import open_store

    _boto.client("s3").create_bucket(Bucket="spotnb-lost")
    store = open_store("s3://spotnb-lost/jobs/j1")
    server.lost_responses.arm("*", count=1)
    held = lease.acquire(store, "i-first")
    assert server.lost_responses.lost, "the fault fired"
    assert held is not None, "this instance wrote the lease: it holds it"
    server.lost_responses.arm("*", count=1)
    held.renew()  # no LeaseLost: the renewal went through
    current = lease.read(store)
    assert current is not None and current[0].holder == "i-first"


def test_a_pointer_move_whose_response_was_lost_is_not_fenced(server: MotoServer) -> None:
    """A checkpoint whose LATEST move committed but lost its response was reported
    fenced off; and a real lost race is still one."""
    from spotnb.protocol.store import open_store

    _boto.client("s3").create_bucket(Bucket="spotnb-lost")
    store = open_store("s3://spotnb-lost/jobs/j2")
    first = store.put_if_absent("LATEST", b'{"id": "c1", "step": 1}')
    assert first is not None
    server.lost_responses.arm("*LATEST", count=1)
    moved = store.put_if_match("LATEST", b'{"id": "c2", "step": 2}', first)
    assert server.lost_responses.lost
    assert moved is not None, "the pointer moved: the write committed"
    assert store.get("LATEST") == b'{"id": "c2", "step": 2}'
    assert store.put_if_match("LATEST", b'{"id": "c3", "step": 3}', first) is None, \
        "another writer's move (a stale ETag) still loses"


# ------------------------------------------------------------------- IAM


def test_a_role_iam_would_not_let_delete_itself_is_deleted_by_the_next_launch(
        sim: AwsSimulator) -> None:
    """Issue 35 finding 13: an instance deletes its role's policy, then the role, which
    that policy no longer allows once its deletion has propagated (the simulator has no
    lag: always). The teardown goes on, the role is left with nothing in it, and the
    next launch deletes it (``spotnb aws cleanup`` too: the fixture's check)."""
    first = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
    result = first.wait(timeout=90)
    assert result.status == "completed", (result.reason, result.error)
    role = f"spotnb-job-{first.job_id}"
    refused = wait_until(lambda: [d for d in sim.denied if d.action == "iam:DeleteRole"
                                  and d.resource.endswith(f"/{role}")], 60,
                         "the instance's DeleteRole of its own role")
    assert all(d.reason == ROLE_DELETED and f":assumed-role/{role}/" in d.principal
               for d in refused), refused
    iam = sim.admin_client("iam")
    assert iam.list_role_policies(RoleName=role)["PolicyNames"] == [], "it grants nothing"
    wait_until(lambda: not sim.running(first.job_id), 60, "the first job's instance ended")
    second = spotnb.submit("x = 2", provider="aws", instance_types=["g4dn.xlarge"])
    roles = [r["RoleName"] for r in iam.list_roles(PathPrefix="/spotnb/")["Roles"]]
    assert role not in roles, "the launch deleted the ended job's empty role"
    assert second.wait(timeout=90).status == "completed"


def test_iam_refuses_what_the_policies_do_not_allow(sim: AwsSimulator) -> None:
    """The user may do what the printed policy allows and nothing else; an instance's
    role is scoped to its own job."""
    from botocore.exceptions import ClientError

    s3 = _boto.client("s3")  # the user
    with pytest.raises(ClientError) as err:
        s3.create_bucket(Bucket="not-spotnbs-bucket")
    assert err.value.response["Error"]["Code"] == "AccessDenied"
    denial = sim.denied[-1]
    assert (denial.action, denial.resource) == ("s3:CreateBucket",
                                                "arn:aws:s3:::not-spotnbs-bucket")
    with pytest.raises(ClientError) as err:
        _boto.client("ec2").run_instances(ImageId="ami-12345678", InstanceType="g4dn.xlarge",
                                          MinCount=1, MaxCount=1, SubnetId="subnet-x")
    assert err.value.response["Error"]["Code"] != "UnauthorizedOperation", \
        "RunInstances is the user's in its region"
    with pytest.raises(ClientError) as err:
        _boto.client("ec2", "eu-west-1").create_launch_template(
            LaunchTemplateName="not-spotnbs", LaunchTemplateData={"ImageId": "ami-1"})
    assert err.value.response["Error"]["Code"] == "UnauthorizedOperation", \
        "the Capacity statement is scoped to the region (aws:RequestedRegion)"
    # An unknown key is refused as such.
    bogus = _boto.boto3_module().session.Session(
        aws_access_key_id="AKIAUNKNOWNUNKNOWN00", aws_secret_access_key="x" * 40,
        region_name="us-east-1").client("sqs")
    with pytest.raises(ClientError):
        bogus.list_queues()
    # A role session may do what its policy allows, on its own job only.
    iam = sim.admin_client("iam")
    iam.create_role(RoleName="spotnb-job-a", Path="/spotnb/",
                    AssumeRolePolicyDocument=json.dumps(trust_policy("ec2.amazonaws.com")))
    iam.put_role_policy(RoleName="spotnb-job-a", PolicyName="spotnb-job",
                        PolicyDocument=json.dumps(instance_policy(
                            job_id="a", store_uri="s3://spotnb-123456789012-us-east-1/jobs/a",
                            region="us-east-1", account=DEFAULT_ACCOUNT)))
    keys = sim.admin_client("sts").assume_role(
        RoleArn=f"arn:aws:iam::{DEFAULT_ACCOUNT}:role/spotnb/spotnb-job-a",
        RoleSessionName="i-1")["Credentials"]
    role_s3 = _boto.boto3_module().session.Session(
        aws_access_key_id=keys["AccessKeyId"], aws_secret_access_key=keys["SecretAccessKey"],
        aws_session_token=keys["SessionToken"], region_name="us-east-1").client("s3")
    sim.admin_client("s3").create_bucket(Bucket="spotnb-123456789012-us-east-1")
    role_s3.put_object(Bucket="spotnb-123456789012-us-east-1", Key="jobs/a/x", Body=b"1")
    role_s3.list_objects_v2(Bucket="spotnb-123456789012-us-east-1", Prefix="jobs/a/")
    for call in (lambda: role_s3.put_object(Bucket="spotnb-123456789012-us-east-1",
                                            Key="jobs/b/x", Body=b"1"),
                 lambda: role_s3.list_objects_v2(Bucket="spotnb-123456789012-us-east-1",
                                                 Prefix="jobs/")):
        with pytest.raises(ClientError) as err:
            call()
        assert err.value.response["Error"]["Code"] == "AccessDenied"
    sim.admin_client("s3").delete_object(Bucket="spotnb-123456789012-us-east-1",
                                         Key="jobs/a/x")
    iam.delete_role_policy(RoleName="spotnb-job-a", PolicyName="spotnb-job")
    iam.delete_role(RoleName="spotnb-job-a")
    sim.expected_denials.update({"s3:CreateBucket", "ec2:CreateLaunchTemplate",
                                 "s3:PutObject", "s3:ListBucket"})


def test_a_nodes_teardown_after_its_peers_asks_for_no_network_group_that_is_gone(
        sim: AwsSimulator) -> None:
    """Every node of a multi-node job deletes its network at the end (each as the job's
    role). One that comes after its peer deleted the groups looks first and asks for
    nothing; one whose peer deletes a group between its look and its deletion has that
    deletion refused by IAM (the stricter reading: the role's permission names the
    group's tag, gone with it) and takes it for done, as a deletion of what is gone."""
    from spotnb.providers.aws import cluster

    job = "pg-twice"
    iam, ec2 = sim.admin_client("iam"), sim.admin_client("ec2")
    iam.create_role(RoleName=f"spotnb-job-{job}", Path="/spotnb/",
                    AssumeRolePolicyDocument=json.dumps(trust_policy("ec2.amazonaws.com")))
    iam.put_role_policy(RoleName=f"spotnb-job-{job}", PolicyName="spotnb-job",
                        PolicyDocument=json.dumps(instance_policy(
                            job_id=job, store_uri=f"s3://spotnb-123456789012-us-east-1/jobs/{job}",
                            region="us-east-1", account=DEFAULT_ACCOUNT)))
    tags = [{"Key": TAG_JOB, "Value": job}]
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]

    def network() -> None:
        ec2.create_placement_group(
            GroupName=cluster.placement_group_name(job), Strategy="cluster",
            TagSpecifications=[{"ResourceType": "placement-group", "Tags": tags}])
        ec2.create_security_group(
            GroupName=cluster.training_group_name(job), Description="a job's", VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}])

    def node(session: str) -> Any:
        keys = sim.admin_client("sts").assume_role(
            RoleArn=f"arn:aws:iam::{DEFAULT_ACCOUNT}:role/spotnb/spotnb-job-{job}",
            RoleSessionName=session)["Credentials"]
        return _boto.boto3_module().session.Session(
            aws_access_key_id=keys["AccessKeyId"],
            aws_secret_access_key=keys["SecretAccessKey"],
            aws_session_token=keys["SessionToken"], region_name="us-east-1").client("ec2")

    def gone() -> bool:
        return not ec2.describe_placement_groups()["PlacementGroups"] and not \
            ec2.describe_security_groups(Filters=[{"Name": f"tag:{TAG_JOB}",
                                                   "Values": [job]}])["SecurityGroups"]

    network()
    assert cluster.delete_network(node("i-1"), job) == [] and gone()
    assert cluster.delete_network(node("i-2"), job) == []
    assert sim.denied == [], "the second looked, and asked for nothing"
    for op in ("DeleteSecurityGroup", "DeletePlacementGroup"):
        network()
        peer, late = node("i-1"), node("i-2")
        ran: list[list[str]] = []

        def peer_first(ran: list[list[str]] = ran, peer: Any = peer, **kwargs: Any) -> None:
            if not ran:  # the peer's whole teardown of the network, just before
                ran.append(cluster.delete_network(peer, job))

        late.meta.events.register(f"before-call.ec2.{op}", peer_first)
        before = len(sim.denied)
        assert cluster.delete_network(late, job) == []
        assert ran == [[]] and gone()
        refused = sim.denied[before:]
        assert [(d.action, d.reason) for d in refused] == [(f"ec2:{op}", RESOURCE_GONE)], \
            refused
    iam.delete_role_policy(RoleName=f"spotnb-job-{job}", PolicyName="spotnb-job")
    iam.delete_role(RoleName=f"spotnb-job-{job}")


# ------------------------------------------------- the representative flow, twice checked


@pytest.mark.slow  # over 30 s: setup, a job with a secret, an interruption through FIS
def test_every_request_of_a_flow_validates_against_the_declared_floor(
        sim: AwsSimulator, tmp_path: Path) -> None:
    from spotnb.client.cli import main as cli_main

    assert cli_main(["aws", "setup"]) == 0
    gate = tmp_path / "gate"
    handle = spotnb.submit(aws_tests.GATED.format(gate=str(gate)), provider="aws",
                           instance_types=["g5.xlarge", "g4dn.xlarge"],
                           secrets={"WANDB_API_KEY": secrets.token_hex(8)})
    first = sim.wait_for_instance(handle.job_id)
    handle.interrupt()  # FIS
    sim.wait_for_instance(handle.job_id, timeout=120, exclude=(first.id,))
    gate.touch()
    result = handle.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    assert cli_main(["aws", "cleanup"]) == 0
    calls = [c for c in sim.server.requests.calls() if c.origin in SPOTNB_ORIGINS]
    operations = {(c.service, c.operation) for c in calls}
    assert {("s3", "PutObject"), ("autoscaling", "CreateAutoScalingGroup"),
            ("fis", "CreateExperimentTemplate"), ("ssm", "PutParameter"),
            ("iam", "CreateRole")} <= operations
    assert sim.check_requests() == []
    # (Issue 35 finding 1: a floor before botocore 1.35.69 refused every lease and
    # pointer write here, IfNoneMatch/IfMatch on PutObject.)
    assert floor.declared_floor() == floor.FLOOR
    refused = sim.check_requests(floor.model_set())
    assert not refused, "\n".join(map(str, refused))
    admin = sim.admin_client("iam")
    admin.delete_role_policy(RoleName="spotnb-fis", PolicyName="spotnb-fis")
    admin.delete_role(RoleName="spotnb-fis")


def test_an_instance_runs_as_its_role_not_with_the_notebooks_keys(
        sim: AwsSimulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_the_notebooks_own")  # nothing of EC2's
    gate = tmp_path / "gate"
    handle = spotnb.submit(aws_tests.GATED.format(gate=str(gate)), provider="aws",
                           instance_types=["g4dn.xlarge"])
    inst = sim.wait_for_instance(handle.job_id)
    # Its operating system (spotnb.testing.boot) starts once the user data is read.
    proc = wait_until(lambda: inst.proc, 60, "the instance's operating system")
    # Every process of the instance (the user data, its agents) has the metadata
    # service's credentials and no keys of its own.
    wait_until(lambda: len(_instance_environs(proc.pid)) >= 2, 60,
               "the instance's processes")
    for environ in _instance_environs(proc.pid):
        assert "AWS_ACCESS_KEY_ID" not in environ and "AWS_SECRET_ACCESS_KEY" not in environ
        assert environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] == inst.imds.endpoint
        assert "HF_TOKEN" not in environ, "the notebook's environment is not the instance's"
    role = f"spotnb-job-{handle.job_id}"
    imds = ImdsClient(inst.imds.endpoint, timeout=30)
    served = json.loads(imds.get(f"iam/security-credentials/{role}") or "{}")
    assert served["Code"] == "Success" and served["AccessKeyId"] not in (
        FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], sim.user_credentials["AWS_ACCESS_KEY_ID"])
    # The instance's agents made their requests as that role's session.
    wait_until(lambda: any(f":assumed-role/{role}/{inst.id}" in who
                           for who, _, _ in sim.server.iam.allowed), 60,
               "a request of the instance as its role")
    gate.touch()
    result = handle.wait(timeout=90)
    assert result.status == "completed", (result.reason, result.error)


def _instance_environs(os_pid: int) -> list[dict[str, str]]:
    """The environments of the processes an instance's operating system runs."""
    import psutil

    found = []
    for proc in psutil.Process(os_pid).children(recursive=True):
        try:
            found.append(proc.environ())
        except psutil.Error:
            continue  # ended meanwhile
    return found
