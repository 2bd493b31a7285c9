"""The mover (spotnb.providers.aws.mover): its code runs from its zip with nothing but
the standard library beside it, and `spotnb aws setup` deploys it in every allowed
region (function, rule, target, permission, role), `doctor` checks it, a launch of
several regions extends its role to the job's store, and it can be removed. What it
does when a region runs dry: tests/test_aws_failover.py."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotnb.providers.aws import _boto, admin, mover
from spotnb.providers.regions import ENV_ALLOWED

HOME, OTHER = "us-east-1", "eu-west-1"
ACCOUNT = "123456789012"


def test_the_movers_code_runs_from_its_zip_with_only_the_standard_library(
        tmp_path: Path) -> None:
    """Lambda's runtime has none of the notebook's packages: the zip holds spotnb and
    boto3's pure-Python packages, botocore with the models of the services a move calls
    only, and importing the handler and making its clients needs nothing else (no
    psutil, no IPython: ``python -S`` sees no site-packages)."""
    code = mover.package()
    names = zipfile.ZipFile(io.BytesIO(code.data)).namelist()
    services = {n.split("/")[2] for n in names
                if n.startswith("botocore/data/") and n.count("/") > 2}
    assert services == set(mover.SERVICES)
    assert len(code.data) < 10_000_000, "a few MB, not all of botocore's models"
    # The same files make the same bytes: a deployment that matches is left alone.
    assert mover.package.__wrapped__().sha256 == code.sha256
    zipfile.ZipFile(io.BytesIO(code.data)).extractall(tmp_path / "code")
    probe = (
        "import sys, importlib\n"
        "module, _, name = sys.argv[1].rpartition('.')\n"
        "handler = getattr(importlib.import_module(module), name)\n"
        "import boto3\n"
        "for service in sys.argv[2:]:\n"
        "    boto3.client(service, region_name='eu-west-1')\n"
        "import spotnb.providers.aws, spotnb.providers.aws.capacity\n"
        "import spotnb.providers.aws.store, spotnb.ckpt.checkpoints\n"
        "assert boto3.__file__.startswith(sys.path[0]), boto3.__file__\n"
        "print(sorted(m for m in ('psutil', 'IPython', 'numpy') if m in sys.modules))\n")
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe, mover.HANDLER, *mover.SERVICES],
        env={"PYTHONPATH": str(tmp_path / "code"), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.fixture
def two_regions(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(ENV_ALLOWED, f"{HOME},{OTHER}")
    yield
    from spotnb.providers.aws import AwsProvider

    mover.remove(AwsProvider(region=HOME), [HOME, OTHER], HOME)


def _mover_checks() -> dict[str, admin.Check]:
    return {c.name: c for c in admin.doctor(HOME) if c.name.startswith("mover")}


def test_setup_deploys_the_mover_in_every_allowed_region_and_doctor_checks_it(
        two_regions: None) -> None:
    from spotnb.providers.aws import AwsProvider

    report = admin.setup(HOME)
    for region in (HOME, OTHER):
        assert f"did create function {mover.FUNCTION} in {region}, invoked by rule " \
               f"{mover.RULE}" in report.actions
    assert any(name.startswith(mover.ROLE) for name in report.policies)
    for region in (HOME, OTHER):
        lam = _boto.client("lambda", region)
        config = lam.get_function(FunctionName=mover.FUNCTION)["Configuration"]
        assert (config["Handler"], config["Timeout"], config["CodeSha256"]) == (
            mover.HANDLER, mover.TIMEOUT_SECONDS, mover.package().sha256)
        assert config["Role"].endswith(f":role/spotnb/{mover.ROLE}")
        events = _boto.client("events", region)
        rule = events.describe_rule(Name=mover.RULE)
        assert json.loads(rule["EventPattern"]) == mover.EVENT_PATTERN
        (target,) = events.list_targets_by_rule(Rule=mover.RULE)["Targets"]
        assert target["Arn"] == config["FunctionArn"]
        # EventBridge may invoke it, from that rule only.
        (grant,) = json.loads(lam.get_policy(FunctionName=mover.FUNCTION)["Policy"])[
            "Statement"]
        assert grant["Principal"] == {"Service": "events.amazonaws.com"}
        assert grant["Condition"]["ArnLike"]["AWS:SourceArn"] == rule["Arn"]
    checks = _mover_checks()
    assert {name: c.ok for name, c in checks.items()} == {"mover": True,
                                                          f"mover ({OTHER})": True}
    # Once there, setup changes nothing.
    again = admin.setup(HOME)
    assert f"function {mover.FUNCTION} exists in {OTHER}, with this spotnb's code, " \
           f"invoked by rule {mover.RULE}" in again.actions
    assert not [a for a in again.actions if mover.FUNCTION in a and "did " in a]
    # A rule deleted by hand: doctor says so, and setup makes it again.
    events = _boto.client("events", OTHER)
    events.remove_targets(Rule=mover.RULE, Ids=[mover.FUNCTION])
    events.delete_rule(Name=mover.RULE)
    gone = _mover_checks()[f"mover ({OTHER})"]
    assert gone.ok is False and f"no EventBridge rule {mover.RULE}" in gone.detail
    admin.setup(HOME)
    assert _mover_checks()[f"mover ({OTHER})"].ok is True
    # A launch whose store is in another bucket: the role's policy grows to it,
    # keeping the regions and buckets it covered.
    from spotnb.protocol.spec import JobSpec, Policy, Resources

    spec = JobSpec(job_id="j", name="j", code="x = 1", provider="aws",
                   resources=Resources(instance_types=("g5.xlarge",), region=HOME,
                                       regions=(HOME, OTHER)),
                   policy=Policy(), store_uri="s3://their-bucket/jobs/j", created=0.0)
    provider = AwsProvider(region=HOME)
    assert mover.ensure(provider, spec, ACCOUNT) is None
    assert mover._covered(_boto.client("iam", HOME)) == (
        [HOME, OTHER], [f"spotnb-{ACCOUNT}-{HOME}", "their-bucket"])
    # Removed, doctor says what a job of several regions then lacks.
    mover.remove(provider, [HOME, OTHER], HOME)
    missing = _mover_checks()[f"mover ({OTHER})"]
    assert missing.ok is False and "notebook is closed" in missing.detail


def test_a_mover_with_other_code_is_updated_and_doctor_says_so_before(
        two_regions: None) -> None:
    from spotnb.providers.aws import AwsProvider

    admin.setup(HOME)
    lam = _boto.client("lambda", OTHER)
    old = io.BytesIO()
    with zipfile.ZipFile(old, "w") as zf:
        zf.writestr("spotnb/__init__.py", "")
    lam.update_function_code(FunctionName=mover.FUNCTION, ZipFile=old.getvalue())
    stale = _mover_checks()[f"mover ({OTHER})"]
    assert stale.ok is False and "another spotnb's code" in stale.detail
    done = mover.deploy(AwsProvider(region=HOME), [HOME, OTHER], home=HOME,
                        account=ACCOUNT, buckets=[f"spotnb-{ACCOUNT}-{HOME}"])
    assert f"did update function {mover.FUNCTION} in {OTHER} to this spotnb's, invoked " \
           f"by rule {mover.RULE}" in done.actions
    assert lam.get_function(FunctionName=mover.FUNCTION)["Configuration"][
        "CodeSha256"] == mover.package().sha256
