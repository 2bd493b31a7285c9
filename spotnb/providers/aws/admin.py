"""Account-level chores behind ``spotnb aws setup`` and ``spotnb aws doctor``.

Both return typed outcomes; :mod:`.cli` prints them.

``setup(region, dry_run)`` creates (or checks) what jobs share: the default bucket with
its settings (in ``region``, the home), the no-inbound security group of the default
VPC of ``region`` and of every other allowed region (``$SPOTNB_ALLOWED_REGIONS``: where
jobs may run), the FIS role used by ``spotnb interrupt``, and with several allowed
regions the mover in each (:mod:`.mover`: the owner of a job of several regions whose
notebook is closed). Per-job resources (role, template, group) are made by each
launch. It also returns the IAM policies spotnb uses, so they can be reviewed.

``doctor(region)`` checks, in order, what a launch needs: credentials, region, the
bucket, the network, the image (the network, image and quotas in each allowed region
too, each line naming its region) (it exists, is available, and is the PyTorch Deep
Learning AMI by default), the spot vCPU quotas that count the GPU families it runs
(named and numbered as Service Quotas has them), the mover in each allowed region
(with several), the FIS role, where secrets go (SSM
Parameter Store) and the caller's permissions: whether IAM lets it do what the printed
notebook-user policy grants (``iam:SimulatePrincipalPolicy``, which that policy grants).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto, mover
from spotnb.providers.aws.policies import (
    fis_policy,
    instance_policy,
    mover_policy,
    user_policy,
)
from spotnb.providers.aws.resources import FIS_ROLE, SECURITY_GROUP
from spotnb.providers.aws.settings import (
    DLAMI_FAMILIES,
    DLAMI_NAME,
    DLAMI_PARAMETER,
    DLAMI_PYTHON,
    AwsSettings,
)

__all__ = ["Check", "SetupReport", "doctor", "setup"]

#: The suffix of EC2's spot vCPU quotas' names in Service Quotas ("All G and VT Spot
#: Instance Requests", "All P4, P3 and P2 Spot Instance Requests", "All P5 Spot Instance
#: Requests", ...: EC2 User Guide, "Spot Instance quotas"). doctor reads the quotas'
#: names and codes from Service Quotas itself, which AWS renames and splits over time
#: ("All P" became "All P4, P3 and P2" when P5 got a quota of its own).
SPOT_QUOTA_SUFFIX = " Spot Instance Requests"
#: The actions of the notebook-user policy that a pattern stands for, as doctor asks
#: IAM about them (SimulatePrincipalPolicy takes action names, not patterns).
_EXAMPLE_ACTIONS = {"ec2:Describe*": "ec2:DescribeInstances",
                    "autoscaling:Describe*": "autoscaling:DescribeAutoScalingGroups"}


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


def _regions(home: str) -> list[str]:
    """``home`` and the other allowed regions (``$SPOTNB_ALLOWED_REGIONS``), in order."""
    from spotnb.providers.regions import allowed_regions

    return list(dict.fromkeys([home, *allowed_regions()]))


def _shared_network(provider: Any, region: str, dry_run: bool) -> list[str]:
    """The no-inbound security group of ``region``'s default VPC, made or checked."""
    ec2 = provider.client("ec2", region)
    vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
    if not vpcs:
        return [f"no default VPC in {region}: create one with `aws ec2 "
                "create-default-vpc`, or set SPOTNB_AWS_SUBNETS"]
    vpc = vpcs[0]["VpcId"]
    found = ec2.describe_security_groups(Filters=[
        {"Name": "group-name", "Values": [SECURITY_GROUP]},
        {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
    if found:
        return [f"security group {SECURITY_GROUP} ({found[0]['GroupId']}) exists in {vpc} "
                f"({region})"]
    if dry_run:
        return [f"would create security group {SECURITY_GROUP} (no inbound rules) in {vpc} "
                f"({region})"]
    group = provider._security_group(region, vpc)
    return [f"did create security group {SECURITY_GROUP} ({group}) in {vpc} ({region})"]


def setup(region: str | None = None, dry_run: bool = False) -> SetupReport:
    """Create or check the shared resources; see the module docstring."""
    from spotnb.providers.aws import AwsProvider
    from spotnb.providers.aws.bucket import default_bucket, ensure_bucket

    region = _region(region)
    regions = _regions(region)
    account = _boto.account_id(region=region)
    bucket = default_bucket(account, region)
    provider = AwsProvider(region=region)
    actions = ensure_bucket(provider.client("s3", region), bucket, region, account,
                            dry_run=dry_run)
    for where in regions:
        actions += _shared_network(provider, where, dry_run)
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
    if len(regions) > 1:  # a job of several regions: its owner with no notebook
        actions += mover.deploy(provider, regions, home=region, account=account,
                                buckets=[bucket], dry_run=dry_run).actions
    example_job = "<job-id>"
    policies = {
        "notebook user (attach to your IAM identity)": user_policy(regions, account, bucket),
        f"each job's instance role (spotnb-job-{example_job}, made per job)": instance_policy(
            job_id=example_job, store_uri=f"s3://{bucket}/jobs/{example_job}",
            region=region, account=account, regions=regions),
        f"{FIS_ROLE} (Fault Injection Service)": fis_policy(region, account),
    }
    if len(regions) > 1:
        policies[f"{mover.ROLE} (moves a job of several regions: Lambda)"] = mover_policy(
            regions, account, [bucket])
    return SetupReport(region=region, account=account, bucket=bucket,
                       actions=tuple(actions), policies=policies)


def doctor(region: str | None = None) -> list[Check]:
    """Everything a launch needs, checked; see the module docstring."""
    from spotnb.providers.aws import AwsProvider
    from spotnb.providers.aws.bucket import bucket_problem, default_bucket

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
        regions = _regions(region)
    except SpecError as err:
        checks.append(Check("allowed regions", False, str(err)))
        regions = [region]
    for where in regions:
        named = (lambda name: name) if where == region else (
            lambda name, where=where: f"{name} ({where})")
        try:
            subnets, vpc = provider._subnets(where, ("g4dn.xlarge", "g5.xlarge"))
            checks.append(Check(named("network"), True, (
                f"{len(subnets)} subnets in {vpc} ({', '.join(az for _, az in subnets)})")))
        except Exception as err:
            checks.append(Check(named("network"), False, str(err)))
        image = _image(provider, where, settings)
        checks.append(dataclasses.replace(image, name=named(image.name)))
        checks += [dataclasses.replace(c, name=named(c.name)) for c in _quotas(
            _boto.client("service-quotas", where, attempts=1), DLAMI_FAMILIES)]
        if len(regions) > 1:  # jobs of several regions: their owner with no notebook
            try:
                wrong = mover.problem(provider, where)
                checks.append(Check(named("mover"), wrong is None, wrong or (
                    f"{mover.FUNCTION} runs this spotnb's code, invoked by {mover.RULE}")))
            except Exception as err:
                checks.append(Check(named("mover"), None, f"could not look: {err}"))
    iam = provider.client("iam", region)
    try:
        iam.get_role(RoleName=FIS_ROLE)
        checks.append(Check("FIS role", True, f"{FIS_ROLE} exists"))
    except Exception as err:
        checks.append(Check("FIS role", None, (
            f"{FIS_ROLE} is missing ({_boto.error_code(err)}): `spotnb interrupt` creates "
            "it on first use, or run `spotnb aws setup`")))
    checks.append(_secrets(provider.client("ssm", region)))
    checks.append(_permissions(iam, str(me["Arn"]), user_policy(regions, account, bucket),
                               region))
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


def spot_quota_for(family: str, names: list[str]) -> str | None:
    """Which of EC2's spot quotas (``names``, as Service Quotas names them) counts the
    vCPUs of instance ``family`` (``p5en``): the one whose name lists the longest prefix
    of it ("P5" before "P"; "Inf" before the Standard quota's "I")."""
    best: tuple[int, str] | None = None
    for name in names:
        if not name.endswith(SPOT_QUOTA_SUFFIX) or not name.startswith("All "):
            continue
        listed = name[len("All "):-len(SPOT_QUOTA_SUFFIX)]
        inside = re.search(r"\(([^)]*)\)", listed)
        for token in re.split(r",\s*|\s+and\s+|\s+", inside.group(1) if inside else listed):
            token = token.strip().upper()
            if token and family.upper().startswith(token) and (
                    best is None or len(token) > best[0]):
                best = (len(token), name)
    return best[1] if best else None


def _quotas(quotas: Any, families: tuple[str, ...]) -> list[Check]:
    """One line per spot vCPU quota that counts the GPU families spotnb runs on: its
    value, and which families it counts (names and codes as Service Quotas has them)."""
    try:
        rows = [q for page in quotas.get_paginator("list_service_quotas").paginate(
                    ServiceCode="ec2") for q in page.get("Quotas", ())]
    except Exception as err:
        return [Check("quotas", None, "could not read EC2's spot vCPU quotas "
                                      f"({_boto.error_code(err) or err}); see the Service "
                                      "Quotas console")]
    by_name = {str(q.get("QuotaName")): q for q in rows}
    covered: dict[str, list[str]] = {}
    unknown = []
    for family in families:
        name = spot_quota_for(family, list(by_name))
        if name is None:
            unknown.append(family)
        else:
            covered.setdefault(name, []).append(family)
    checks = []
    for name, which in covered.items():
        quota = by_name[name]
        value = float(quota.get("Value") or 0)
        checks.append(Check(f"quota {quota.get('QuotaCode')}", value > 0, (
            f"{name}: {value:g} vCPUs, for {', '.join(which)}" + (
                "" if value > 0 else ": request an increase in the Service Quotas console, "
                                     "or none of these can start as spot"))))
    if unknown:
        checks.append(Check("quotas", None, f"no spot quota of EC2 names {', '.join(unknown)}"
                                            " (see the Service Quotas console)"))
    return checks


def _principal_arn(iam: Any, arn: str) -> str | None:
    """The IAM ARN that SimulatePrincipalPolicy takes for the caller ``arn``: a user's
    is itself; an assumed role's (``arn:aws:sts::A:assumed-role/NAME/SESSION``, SSO
    included) is its role's, with its path (found with ``iam:ListRoles``)."""
    found = re.fullmatch(r"arn:[^:]+:sts::\d+:assumed-role/([^/]+)/.+", arn)
    if not found:
        return arn if ":iam::" in arn else None
    for page in iam.get_paginator("list_roles").paginate():
        for role in page.get("Roles", ()):
            if role.get("RoleName") == found.group(1):
                return str(role["Arn"])
    return None


def _permissions(iam: Any, arn: str, policy: dict[str, Any], region: str) -> Check:
    """Whether the caller may do what the notebook-user policy (``policy``, as `spotnb
    aws setup --dry-run` prints it) allows: one SimulatePrincipalPolicy per statement
    (:func:`simulation`)."""
    why = "not a user or a role"
    try:
        source = _principal_arn(iam, arn)
    except Exception as err:
        source, why = None, _boto.error_code(err) or str(err)
    if source is None:
        return Check("permissions", None, (
            f"could not tell which IAM user or role {arn} is ({why}); compare its "
            "policies with `spotnb aws setup --dry-run`"))
    denied: list[str] = []
    asked = 0
    try:
        for statement in policy["Statement"]:
            request = simulation(statement, region)
            if request is None:
                continue
            reply = iam.simulate_principal_policy(PolicySourceArn=source, **request)
            asked += len(request["ActionNames"])
            denied += [r["EvalActionName"] for r in reply.get("EvaluationResults", ())
                       if r.get("EvalDecision") != "allowed"]
    except Exception as err:
        return Check("permissions", None, (
            f"could not simulate the policy of {source} ({_boto.error_code(err) or err}); "
            "compare it with `spotnb aws setup --dry-run`"))
    if denied:
        return Check("permissions", False, (
            f"{source} may not call {', '.join(denied)}: attach the notebook-user policy "
            "printed by `spotnb aws setup --dry-run`"))
    return Check("permissions", True, f"{asked} actions allowed")


def simulation(statement: dict[str, Any], region: str) -> dict[str, Any] | None:
    """The SimulatePrincipalPolicy parameters (but the principal) that ask IAM whether
    the caller has what ``statement`` grants, as a launch would use it: its actions (a
    pattern as an example action), one of its resources (a ``*`` in it as a name), and
    the context its conditions ask for (the job's region; the first value each other
    key allows). None for a statement with nothing to ask about."""
    actions = statement["Action"] if isinstance(statement["Action"], list) else \
        [statement["Action"]]
    names = [str(_EXAMPLE_ACTIONS.get(a, a)) for a in actions]
    names = [a for a in names if "*" not in a]
    if statement.get("Effect") != "Allow" or not names:
        return None
    request: dict[str, Any] = {"ActionNames": names}
    resources = statement.get("Resource", "*")
    first = resources[0] if isinstance(resources, list) else resources
    if first != "*":
        request["ResourceArns"] = [first.replace("*", "spotnb-doctor")]
    context = []
    for conditions in (statement.get("Condition") or {}).values():
        for key, values in conditions.items():
            value = values[0] if isinstance(values, list) else values
            if key == "aws:RequestedRegion":
                value = region
            context.append({"ContextKeyName": key, "ContextKeyValues": [str(value)],
                            "ContextKeyType": "string"})
    if context:
        request["ContextEntries"] = context
    return request


def policies_json(report: SetupReport) -> str:
    """The report's policies as indented JSON, one document per heading."""
    return "\n".join(f"# {name}\n{json.dumps(doc, indent=2)}"
                     for name, doc in report.policies.items())
