"""Account-level chores behind ``spotnb aws setup`` and ``spotnb aws doctor``.

Both return typed outcomes; :mod:`.cli` prints them.

``setup(region, dry_run)`` creates (or checks) what jobs share: the default bucket with
its settings, the no-inbound security group of the default VPC, and the FIS role used
by ``spotnb interrupt``. Per-job resources (role, template, group) are made by each
launch. It also returns the IAM policies spotnb uses, so they can be reviewed.

``doctor(region)`` checks, in order, what a launch needs: credentials, region, the
bucket, the network, the image (it exists, is available, and is the PyTorch Deep
Learning AMI by default), spot vCPU quotas, the FIS role, where secrets go (SSM
Parameter Store) and the caller's permissions (``iam:SimulatePrincipalPolicy`` where
the caller may use it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import (
    DLAMI_FAMILIES,
    DLAMI_NAME,
    DLAMI_PARAMETER,
    DLAMI_PYTHON,
    FIS_ROLE,
    SECURITY_GROUP,
    AwsSettings,
    fis_policy,
    instance_policy,
    user_policy,
)

__all__ = ["Check", "SetupReport", "doctor", "setup"]

# Spot vCPU quotas of the GPU families (Service Quotas codes, EC2).
SPOT_QUOTAS = {
    "L-3819A6DF": "All G and VT Spot Instance Requests",
    "L-7212CCBC": "All P Spot Instance Requests",
}
# What a notebook user's identity must be allowed to do (checked by doctor).
NEEDED_ACTIONS = (
    "ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate", "ec2:RunInstances",
    "autoscaling:CreateAutoScalingGroup", "autoscaling:DeleteAutoScalingGroup",
    "autoscaling:PutLifecycleHook",
    "iam:CreateRole", "iam:PutRolePolicy", "iam:CreateInstanceProfile",
    "iam:AddRoleToInstanceProfile", "iam:PassRole", "iam:DeleteRole",
    "s3:PutObject", "s3:GetObject", "s3:ListBucket", "ssm:GetParameter",
    "fis:CreateExperimentTemplate", "fis:StartExperiment",
    # secrets (providers/aws/parameters.py)
    "ssm:PutParameter", "ssm:AddTagsToResource", "ssm:DeleteParameters",
    "ssm:DescribeParameters", "ssm:ListTagsForResource",
    # multi-node jobs (providers/aws/cluster.py)
    "ec2:CreatePlacementGroup", "ec2:DeletePlacementGroup", "ec2:CreateSecurityGroup",
    "ec2:AuthorizeSecurityGroupIngress", "ec2:DeleteSecurityGroup",
)


@dataclasses.dataclass(frozen=True)
class SetupReport:
    """What ``setup`` did (or would do), and the policies spotnb uses."""

    region: str
    account: str
    bucket: str
    actions: tuple[str, ...]
    policies: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of ``doctor``: ``ok`` (True, False, or None for "could not tell")."""

    name: str
    ok: bool | None
    detail: str


def _region(region: str | None) -> str:
    return _boto.check_region(region or str(_boto.session().region_name or "us-east-1"))


def setup(region: str | None = None, dry_run: bool = False) -> SetupReport:
    """Create or check the shared resources; see the module docstring."""
    from spotnb.providers.aws import AwsProvider
    from spotnb.providers.aws.store import default_bucket, ensure_bucket

    region = _region(region)
    account = _boto.account_id(region=region)
    bucket = default_bucket(account, region)
    provider = AwsProvider(region=region)
    actions = ensure_bucket(provider.client("s3", region), bucket, region, account,
                            dry_run=dry_run)
    ec2 = provider.client("ec2", region)
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
    if not vpcs:
        actions.append(f"no default VPC in {region}: create one with `aws ec2 "
                       "create-default-vpc`, or set SPOTNB_AWS_SUBNETS")
    else:
        vpc = vpcs[0]["VpcId"]
        found = ec2.describe_security_groups(Filters=[
            {"Name": "group-name", "Values": [SECURITY_GROUP]},
            {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
        if found:
            actions.append(f"security group {SECURITY_GROUP} ({found[0]['GroupId']}) exists "
                           f"in {vpc}")
        elif dry_run:
            actions.append(f"would create security group {SECURITY_GROUP} (no inbound rules) "
                           f"in {vpc}")
        else:
            group = provider._security_group(region, vpc)
            actions.append(f"did create security group {SECURITY_GROUP} ({group}) in {vpc}")
    iam = provider.client("iam", region)
    try:
        iam.get_role(RoleName=FIS_ROLE)
        actions.append(f"IAM role {FIS_ROLE} (for `spotnb interrupt`) exists")
    except Exception as err:
        if _boto.error_code(err) != "NoSuchEntity":
            _boto.raise_for(err, f"looking up the IAM role {FIS_ROLE}")
        if dry_run:
            actions.append(f"would create IAM role {FIS_ROLE} (for `spotnb interrupt`)")
        else:
            provider._fis_role(region, account)
            actions.append(f"did create IAM role {FIS_ROLE} (for `spotnb interrupt`)")
    example_job = "<job-id>"
    policies = {
        "notebook user (attach to your IAM identity)": user_policy(region, account, bucket),
        f"each job's instance role (spotnb-job-{example_job}, made per job)": instance_policy(
            job_id=example_job, store_uri=f"s3://{bucket}/jobs/{example_job}",
            region=region, account=account),
        f"{FIS_ROLE} (Fault Injection Service)": fis_policy(region, account),
    }
    return SetupReport(region=region, account=account, bucket=bucket,
                       actions=tuple(actions), policies=policies)


def doctor(region: str | None = None) -> list[Check]:
    """Everything a launch needs, checked; see the module docstring."""
    from spotnb.providers.aws import AwsProvider
    from spotnb.providers.aws.store import bucket_problem, default_bucket

    checks: list[Check] = []
    try:
        region = _region(region)
        checks.append(Check("region", True, region))
    except SpecError as err:
        return [Check("region", False, str(err))]
    try:
        sts = _boto.client("sts", region, attempts=2)
        me = sts.get_caller_identity()
        account = str(me["Account"])
        checks.append(Check("credentials", True, f"{me['Arn']} (account {account})"))
    except Exception as err:
        message = str(_boto.fatal_error(err, "AWS credentials")) if \
            _boto.classify(err) == "fatal" else f"cannot reach AWS STS: {err}"
        return [*checks, Check("credentials", False, message)]
    provider = AwsProvider(region=region)
    bucket = default_bucket(account, region)
    problem = bucket_problem(provider.client("s3", region), bucket, account)
    checks.append(Check("bucket", problem is None or problem == "missing", (
        f"s3://{bucket} is yours" if problem is None else
        f"s3://{bucket} does not exist yet: the first job (or `spotnb aws setup`) creates it"
        if problem == "missing" else problem)))
    settings = AwsSettings.from_env()
    try:
        subnets, vpc = provider._subnets(region, ("g4dn.xlarge", "g5.xlarge"))
        checks.append(Check("network", True, f"{len(subnets)} subnets in {vpc} "
                                             f"({', '.join(az for _, az in subnets)})"))
    except Exception as err:
        checks.append(Check("network", False, str(err)))
    checks.append(_image(provider, region, settings))
    quotas = _boto.client("service-quotas", region, attempts=1)
    for code, label in SPOT_QUOTAS.items():
        try:
            value = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            checks.append(Check(f"quota {code}", value > 0, (
                f"{label}: {value:g} vCPUs" + ("" if value > 0 else
                                               ": request an increase in the Service Quotas "
                                               "console, or no spot GPU can start"))))
        except Exception as err:
            checks.append(Check(f"quota {code}", None, f"{label}: could not read it "
                                                       f"({_boto.error_code(err) or err})"))
    iam = provider.client("iam", region)
    try:
        iam.get_role(RoleName=FIS_ROLE)
        checks.append(Check("FIS role", True, f"{FIS_ROLE} exists"))
    except Exception as err:
        checks.append(Check("FIS role", None, (
            f"{FIS_ROLE} is missing ({_boto.error_code(err)}): `spotnb interrupt` creates "
            "it on first use, or run `spotnb aws setup`")))
    checks.append(_secrets(provider.client("ssm", region)))
    checks.append(_permissions(iam, str(me["Arn"])))
    return checks


def _image(provider: Any, region: str, settings: AwsSettings) -> Check:
    """The image instances boot: it exists and is available in the region, runs on
    x86_64 (the GPU types spotnb's catalog offers), and, the default one, is the PyTorch
    Deep Learning AMI (its name), whose PyTorch environment the boot uses."""
    source = settings.ami or settings.ami_parameter
    try:
        ami = provider._ami(region)
    except Exception as err:
        return Check("image", False, str(err))
    try:
        images = provider.client("ec2", region).describe_images(ImageIds=[ami])["Images"]
    except Exception as err:
        if "InvalidAMIID" not in _boto.error_code(err):
            return Check("image", None, f"{ami} from {source}; could not describe it "
                                        f"({_boto.error_code(err) or err})")
        images = []
    if not images:
        return Check("image", False, f"{ami} (from {source}) does not exist in {region}: "
                                     "set SPOTNB_AWS_AMI to an image of this region")
    image = images[0]
    name = str(image.get("Name") or "")
    if image.get("State", "available") != "available":
        return Check("image", False, f"{ami} ({name}) is {image['State']}, not available")
    if image.get("Architecture", "x86_64") != "x86_64":
        return Check("image", False, f"{ami} ({name}) is for {image['Architecture']}; "
                                     "spotnb's GPU types need an x86_64 image")
    if settings.ami or settings.ami_parameter != DLAMI_PARAMETER:
        return Check("image", True, f"{ami} ({name}) from {source}, your own image: the "
                                    "boot needs python3 on it")
    if not name.startswith(DLAMI_NAME):
        return Check("image", False, (
            f"{ami} from {source} is {name!r}, not the {DLAMI_NAME}: spotnb's boot looks "
            f"for its PyTorch environment ({DLAMI_PYTHON}); set SPOTNB_AWS_AMI to an "
            "image of yours, or update spotnb"))
    return Check("image", True, (
        f"{ami}: {name}, PyTorch in {DLAMI_PYTHON}; for {', '.join(DLAMI_FAMILIES)}"))


def _secrets(ssm: Any) -> Check:
    """Where jobs' secrets go, and whether this identity may look there."""
    from spotnb.providers.aws import parameters

    where = (f"SSM Parameter Store, SecureString under {parameters.ROOT}/<job-id>/ "
             "(standard tier, free), encrypted with the account's default key alias/aws/ssm")
    try:
        jobs = parameters.leftovers(ssm)
    except Exception as err:
        return Check("secrets", None, f"{where}; could not list them "
                                      f"({_boto.error_code(err) or type(err).__name__}): "
                                      "the notebook-user policy of `spotnb aws setup "
                                      "--dry-run` allows it")
    return Check("secrets", True, f"{where}; {len(jobs)} job(s) hold secrets now")


def _permissions(iam: Any, arn: str) -> Check:
    try:
        reply = iam.simulate_principal_policy(PolicySourceArn=arn,
                                              ActionNames=list(NEEDED_ACTIONS))
    except Exception as err:
        return Check("permissions", None, (
            f"could not simulate the policy of {arn} ({_boto.error_code(err) or err}); "
            "compare it with `spotnb aws setup --dry-run`"))
    denied = [r["EvalActionName"] for r in reply.get("EvaluationResults", ())
              if r.get("EvalDecision") != "allowed"]
    if denied:
        return Check("permissions", False, (
            f"{arn} may not call {', '.join(denied)}: attach the notebook-user policy "
            "printed by `spotnb aws setup --dry-run`"))
    return Check("permissions", True, f"{len(NEEDED_ACTIONS)} actions allowed")


def policies_json(report: SetupReport) -> str:
    """The report's policies as indented JSON, one document per heading."""
    return "\n".join(f"# {name}\n{json.dumps(doc, indent=2)}"
                     for name, doc in report.policies.items())
