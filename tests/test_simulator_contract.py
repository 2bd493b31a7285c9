"""The simulator held to AWS's contract: request shapes against botocore's models.

Every request that reaches the simulator is parsed back into its operation's
parameters; every test with the AWS provider's ``sim`` fixture checks its requests
against the running botocore's models, and the flow here also against the botocore
that spotnb's requirements allow at the lowest (the declared floor).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotnb.providers.aws import _boto
from spotnb.testing import MotoServer, aws_environment, contract

REPO = Path(__file__).resolve().parents[1]


def declared_floor() -> str:
    """The lowest botocore spotnb's ``aws`` extra allows: boto3 ``1.x.y`` requires
    botocore ``1.x.y`` (their versions move in step)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["aws"]
    for requirement in extras:
        m = re.fullmatch(r"boto3\s*>=\s*([\d.]+)(,.*)?", requirement)
        if m:
            version = m.group(1)
            return version + ".0" * (2 - version.count("."))
    raise AssertionError(f"no boto3 floor in the aws extra: {extras}")


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


def test_a_parameter_an_older_botocore_lacks_is_refused(server: MotoServer) -> None:
    s3 = _boto.client("s3")
    s3.create_bucket(Bucket="spotnb-contract")
    s3.put_object(Bucket="spotnb-contract", Key="k", Body=b"1", IfNoneMatch="*")
    s3.put_object(Bucket="spotnb-contract", Key="plain", Body=b"1")
    # botocore 1.34.0 (Dec 2023) has no conditional writes: IfNoneMatch came in 2024.
    refused = contract.check(server.requests.calls(), contract.models_of("1.34.0"))
    assert [(v.call.operation, v.call.params.get("Key")) for v in refused] == [
        ("PutObject", "k")]
    # Only IfNoneMatch: the checksums the running botocore adds by itself (CRC64NVME
    # is newer than 1.34 too) are not held against spotnb.
    assert re.findall(r'Unknown parameter in input: "(\w+)"', refused[0].report) == [
        "IfNoneMatch"]
