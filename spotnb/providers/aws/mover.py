"""The mover: the owner of a job of several regions whose notebook is closed.

A job of several regions (:mod:`.failover`) moves to its next region when its group
cannot get capacity where it runs. A notebook that follows the job moves it
(:class:`~spotnb.providers.aws.capacity.CapacityWatch`); with none open, the
account's *mover* does, an AWS Lambda function that spotnb deploys in each region a
job of several regions may run in (``spotnb aws setup`` in the allowed regions, and
each such launch in the job's regions if it is not there yet or runs other code)::

    EC2 Auto Scaling  a launch of spotnb-<job> fails (no capacity, or another reason)
         |            -> an "EC2 Instance Launch Unsuccessful" event on the region's
         v               default EventBridge bus
    EventBridge       rule RULE (source aws.autoscaling, that detail type, groups
         |            named spotnb-*) -> target: the function, asynchronously
         v
    Lambda            FUNCTION in that region, as ROLE: handler() reads the group's
                      tags (its job and store), the job's spec and its region choices
                      (the group's stream only), and makes the one decision a notebook's
                      watch makes (capacity.move_if_dry: MOVE_AFTER_FAILED_ROUNDS
                      failed rounds in a row with fewer than the job's minimum of nodes
                      running -> the move, claimed first in the job's store, so that
                      however many owners look, it moves once)

What it costs: nothing while launches succeed; per failed launch one invocation
(about a second of 256 MB: Lambda's free tier covers millions) with a
DescribeAutoScalingGroups, a GetBucketLocation, the spec's GET, one LIST and the
group stream's GETs, and a DescribeScalingActivities. The function's code is spotnb
itself with the pure-Python packages it needs (:func:`package`: boto3 and botocore
with the models of the services a move calls, so that it runs spotnb's own botocore
floor whatever the runtime's boto3 is), a few MB.

A move left half-done (its owner, a notebook or the function, ended between the new
group's making and the old one's deletion) is finished by the next invocation for the
old group once the move's claim is :data:`STALE_MOVE_SECONDS` old (a live owner may
still be waiting for the nodes it leaves to save and go): the new group launches, the
old one is deleted. (A move cut short after the old group's deletion, before the new
one was let launch, leaves no group that fails: the next notebook that attaches
finishes it.) A group whose job has ended is deleted at its next failed launch: it
would launch a billed instance for nothing once capacity came back.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import importlib
import io
import json
import logging
import os
import sys
import time
import uuid
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import spotnb
from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, EventReader, codec
from spotnb.protocol.spec import JobSpec
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import (
    IAM_PATH,
    MOVER_FUNCTION,
    MOVER_ROLE,
    MOVER_RULE,
    TAG_JOB,
    TAG_MANAGED,
    TAG_STORE,
    partition,
)

__all__ = ["EVENT_PATTERN", "FUNCTION", "HANDLER", "ROLE", "RULE", "Deployment",
           "deploy", "ensure", "handler", "package", "problem", "remove"]

log = logging.getLogger(__name__)

FUNCTION = MOVER_FUNCTION
RULE = MOVER_RULE
ROLE = MOVER_ROLE
HANDLER = "spotnb.providers.aws.mover.handler"
#: The events the function is for (EC2 Auto Scaling User Guide, "Amazon EventBridge
#: events for Amazon EC2 Auto Scaling": "EC2 Instance Launch Unsuccessful").
EVENT_PATTERN = {"source": ["aws.autoscaling"],
                 "detail-type": ["EC2 Instance Launch Unsuccessful"],
                 "detail": {"AutoScalingGroupName": [{"prefix": "spotnb-"}]}}
#: A move with nodes to end waits for them (launching.LEAVE_SECONDS) inside one
#: invocation; Lambda's longest is 900 s.
TIMEOUT_SECONDS = 900
MEMORY_MB = 256
#: The packages of the function's code besides spotnb (pure Python): boto3's.
PACKAGES = ("boto3", "botocore", "s3transfer", "jmespath", "dateutil", "six", "urllib3")
#: The AWS services a move calls: botocore's models of these only go in the package.
SERVICES = ("autoscaling", "ec2", "iam", "s3", "ssm", "sts")
#: Lambda's Python runtimes; the notebook's own if it is one, else the newest.
RUNTIMES = ("python3.10", "python3.11", "python3.12", "python3.13")
#: A move claimed this long ago whose old region still has the job's group is taken
#: for left half-done: longer than a live owner waits for the nodes it leaves.
STALE_MOVE_SECONDS = 600.0
#: The settings of a move (the image's parameter in the new region, the group's
#: strategy there) the function takes from the environment of whoever deploys it.
SETTINGS_ENV = ("SPOTNB_AWS_AMI_PARAMETER", "SPOTNB_AWS_SPOT_STRATEGY")


# -- the function's code


@dataclasses.dataclass(frozen=True)
class Package:
    """The function's zip and its ``CodeSha256`` (base64 of its SHA-256, as Lambda
    reports it)."""

    data: bytes
    sha256: str


@functools.cache
def package() -> Package:
    """The function's code: spotnb and :data:`PACKAGES` at the zip's root, botocore's
    models of :data:`SERVICES` only. The same bytes for the same files (entries sorted,
    fixed times), so a deployment whose ``CodeSha256`` matches is left as it is."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in ("spotnb", *PACKAGES):
            for path, arcname in sorted(_files(name), key=lambda item: item[1]):
                info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
    data = buf.getvalue()
    return Package(data, base64.b64encode(hashlib.sha256(data).digest()).decode())


def _files(name: str) -> Iterable[tuple[Path, str]]:
    """The files of the importable package or module ``name``: (path, name in the zip)."""
    module = importlib.import_module(name)
    path = Path(module.__file__ or "")
    if path.name != "__init__.py":
        yield path, path.name
        return
    root = path.parent
    data = root / "data"
    for found in root.rglob("*"):
        if not found.is_file() or "__pycache__" in found.parts or found.suffix == ".pyc":
            continue
        if name == "botocore" and data in found.parents:
            service = found.relative_to(data).parts
            if len(service) > 1 and service[0] not in SERVICES:
                continue
        yield found, f"{name}/{found.relative_to(root).as_posix()}"


def _runtime() -> str:
    mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return mine if mine in RUNTIMES else RUNTIMES[-1]


# -- deployment


@dataclasses.dataclass(frozen=True)
class Deployment:
    """What :func:`deploy` did or found, a line per thing."""

    actions: tuple[str, ...]


def role_arn(account: str, region: str) -> str:
    return f"arn:{partition(region)}:iam::{account}:role{IAM_PATH}{ROLE}"


def _role(provider: Any, home: str, regions: Sequence[str], account: str,
          buckets: Sequence[str], dry_run: bool) -> tuple[str, list[str]]:
    """The function's role, made if missing; its policy covers ``regions`` and
    ``buckets`` besides those it covered already (one role for the account, whose jobs
    have different homes and stores): written only when that grows it."""
    from spotnb.providers.aws.policies import mover_policy, trust_policy

    iam = provider.client("iam", home)
    actions: list[str] = []
    covered: tuple[list[str], list[str]] = ([], [])
    try:
        iam.get_role(RoleName=ROLE)
        actions.append(f"IAM role {ROLE} (the mover's) exists")
        covered = _covered(iam)
    except Exception as err:
        if _boto.error_code(err) != "NoSuchEntity":
            _boto.raise_for(err, f"looking up the IAM role {ROLE}")
        if dry_run:
            return role_arn(account, home), [f"would create IAM role {ROLE} (the mover's)"]
        iam.create_role(RoleName=ROLE, Path=IAM_PATH,
                        AssumeRolePolicyDocument=json.dumps(
                            trust_policy("lambda.amazonaws.com")),
                        Description="spotnb's mover: moves a job of several regions "
                                    "whose region has no capacity",
                        Tags=[{"Key": TAG_MANAGED, "Value": "true"}])
        actions.append(f"did create IAM role {ROLE} (the mover's)")
    want_regions = list(dict.fromkeys([*covered[0], *regions]))
    want_buckets = list(dict.fromkeys([*covered[1], *buckets]))
    if (want_regions, want_buckets) != covered and not dry_run:
        iam.put_role_policy(RoleName=ROLE, PolicyName=ROLE, PolicyDocument=json.dumps(
            mover_policy(want_regions, account, want_buckets)))
        actions.append(f"the policy of IAM role {ROLE} covers {', '.join(want_regions)} "
                       f"and the stores in {', '.join(want_buckets)}")
    return role_arn(account, home), actions


def _covered(iam: Any) -> tuple[list[str], list[str]]:
    """The regions and buckets the role's policy covers now (as
    :func:`~spotnb.providers.aws.policies.mover_policy` wrote them)."""
    try:
        document = iam.get_role_policy(RoleName=ROLE, PolicyName=ROLE)["PolicyDocument"]
    except Exception as err:
        if _boto.error_code(err) == "NoSuchEntity":
            return [], []
        raise
    if isinstance(document, str):  # botocore leaves it URL-encoded JSON for some clients
        from urllib.parse import unquote

        document = json.loads(unquote(document))
    regions: list[str] = []
    buckets: list[str] = []
    for statement in document.get("Statement", ()):
        if statement.get("Sid") == "JobCapacity":
            found = statement["Condition"]["StringEquals"]["aws:RequestedRegion"]
            regions = [found] if isinstance(found, str) else list(found)
        elif statement.get("Sid") == "ListJobStores":
            found = statement["Resource"]
            buckets = [arn.rsplit(":", 1)[-1] for arn in (
                [found] if isinstance(found, str) else found)]
    return regions, buckets


def _environment() -> dict[str, str]:
    env = {name: os.environ[name] for name in SETTINGS_ENV if os.environ.get(name)}
    env["SPOTNB_ORIGIN"] = "mover"
    return env


def deploy(provider: Any, regions: Sequence[str], *, home: str, account: str,
           buckets: Sequence[str], dry_run: bool = False,
           thorough: bool = True) -> Deployment:
    """The mover in each of ``regions``: its role (IAM, global: its policy covers
    ``regions`` and ``buckets``, the stores of the jobs it moves), and in each region
    the function (made, or its code and settings brought up to this spotnb's), the
    rule and its target, and the permission for EventBridge to invoke it (each put
    again, in case one was removed, unless not ``thorough``: a launch's check, where
    a function with this spotnb's code is taken to have them). Requests when all is
    there already, not ``thorough``: a GetRole and a GetRolePolicy, then a GetFunction
    per region."""
    code = package()
    arn, actions = _role(provider, home, regions, account, buckets, dry_run)
    for region in regions:
        actions += _function(provider, region, arn, code, account, dry_run, thorough)
    return Deployment(tuple(actions))


def _function(provider: Any, region: str, role: str, code: Package, account: str,
              dry_run: bool, thorough: bool) -> list[str]:
    from spotnb.providers.aws.launching import IAM_PROPAGATION_ATTEMPTS

    lam = provider.client("lambda", region)
    env = _environment()
    try:
        found = lam.get_function(FunctionName=FUNCTION)["Configuration"]
    except Exception as err:
        if _boto.error_code(err) != "ResourceNotFoundException":
            _boto.raise_for(err, f"looking up the function {FUNCTION} in {region}")
        found = None
    current = found is not None and found.get("CodeSha256") == code.sha256 and \
        (found.get("Environment") or {}).get("Variables", {}) == env
    if current and (dry_run or not thorough):
        return [f"function {FUNCTION} exists in {region}, with this spotnb's code"]
    if dry_run:
        return [f"would {'update' if found else 'create'} function {FUNCTION} in {region} "
                "(moves a job of several regions when its region has no capacity)"]
    if current:
        done = f"function {FUNCTION} exists in {region}, with this spotnb's code"
    elif found is None:
        def create() -> None:
            lam.create_function(
                FunctionName=FUNCTION, Runtime=_runtime(), Role=role, Handler=HANDLER,
                Code={"ZipFile": code.data}, Timeout=TIMEOUT_SECONDS, MemorySize=MEMORY_MB,
                Description=f"spotnb {spotnb.__version__}: moves a job of several regions "
                            "when its region has no capacity",
                Environment={"Variables": env},
                Tags={TAG_MANAGED: "true"})

        # A role IAM has not propagated yet "cannot be assumed by Lambda" for seconds.
        _boto.with_backoff(create, what=f"creating the function {FUNCTION} in {region}",
                           attempts=IAM_PROPAGATION_ATTEMPTS,
                           retry_codes=frozenset({"cannot be assumed by Lambda"}))
        done = f"did create function {FUNCTION} in {region}"
    else:
        if found.get("CodeSha256") != code.sha256:
            lam.update_function_code(FunctionName=FUNCTION, ZipFile=code.data)
            _wait_updated(lam)
        lam.update_function_configuration(FunctionName=FUNCTION,
                                          Environment={"Variables": env})
        done = f"did update function {FUNCTION} in {region} to this spotnb's"
    function_arn = f"arn:{partition(region)}:lambda:{region}:{account}:function:{FUNCTION}"
    events = provider.client("events", region)
    rule_arn = events.put_rule(
        Name=RULE, EventPattern=json.dumps(EVENT_PATTERN), State="ENABLED",
        Description="spotnb: a failed launch of a spotnb group, to its mover",
        Tags=[{"Key": TAG_MANAGED, "Value": "true"}])["RuleArn"]
    events.put_targets(Rule=RULE, Targets=[{"Id": FUNCTION, "Arn": function_arn}])
    try:
        lam.add_permission(FunctionName=FUNCTION, StatementId=RULE,
                           Action="lambda:InvokeFunction", Principal="events.amazonaws.com",
                           SourceArn=rule_arn)
    except Exception as err:
        if _boto.error_code(err) != "ResourceConflictException":  # it has it already
            raise
    return [done + f", invoked by rule {RULE}"]


def _wait_updated(lam: Any, tries: int = 60) -> None:
    """An update's code is in place (``LastUpdateStatus`` not ``InProgress``) before the
    configuration may change (Lambda refuses it meanwhile)."""
    for _ in range(tries):
        status = lam.get_function_configuration(FunctionName=FUNCTION).get(
            "LastUpdateStatus")
        if status != "InProgress":
            return
        time.sleep(1.0)


def ensure(provider: Any, spec: JobSpec, account: str) -> str | None:
    """The mover in each of a job's regions, for its launch (once per provider and
    set of regions and store); None, or why the job has none (its launch goes on: a
    notebook that follows it still moves it)."""
    from spotnb.providers.aws.bucket import default_bucket
    from spotnb.providers.aws.resources import s3_location

    home = spec.resources.region
    bucket = s3_location(spec.store_uri)[0]
    key = (tuple(spec.resources.regions), bucket)
    done: set[tuple[tuple[str, ...], str]] = provider._movers
    if key in done:
        return None
    try:
        deploy(provider, spec.resources.regions, home=home, account=account,
               buckets=[default_bucket(account, home), bucket], thorough=False)
    except Exception as err:
        log.warning("could not deploy the mover for job %s", spec.job_id, exc_info=True)
        return (f"no mover in its regions ({_boto.error_code(err) or err}): it moves to "
                "another region only while a notebook follows it; `spotnb aws doctor` "
                "says what is missing")
    done.add(key)
    return None


def problem(provider: Any, region: str) -> str | None:
    """What is wrong with the mover in ``region`` (None: it is there, runs this
    spotnb's code, and its rule is enabled and targets it): for ``spotnb aws doctor``."""
    lam = provider.client("lambda", region)
    try:
        found = lam.get_function(FunctionName=FUNCTION)["Configuration"]
    except Exception as err:
        if _boto.error_code(err) == "ResourceNotFoundException":
            return (f"no function {FUNCTION} in {region}: a job of several regions whose "
                    "notebook is closed does not move when its region has no capacity; "
                    "`spotnb aws setup` makes it (a launch of such a job does too)")
        raise
    if found.get("CodeSha256") != package().sha256:
        return (f"function {FUNCTION} in {region} runs another spotnb's code: `spotnb aws "
                "setup` updates it (the next launch of a job of several regions does too)")
    events = provider.client("events", region)
    try:
        rule = events.describe_rule(Name=RULE)
    except Exception as err:
        if _boto.error_code(err) == "ResourceNotFoundException":
            return f"no EventBridge rule {RULE} in {region}: `spotnb aws setup` makes it"
        raise
    if rule.get("State") != "ENABLED":
        return f"the EventBridge rule {RULE} in {region} is disabled: enable it"
    targets = events.list_targets_by_rule(Rule=RULE)["Targets"]
    if not any(str(t.get("Arn", "")).endswith(f":function:{FUNCTION}") for t in targets):
        return f"the EventBridge rule {RULE} in {region} does not target {FUNCTION}"
    return None


def remove(provider: Any, regions: Sequence[str], home: str) -> list[str]:
    """Delete the mover: each region's rule (its target first) and function, then its
    role. What was deleted, a line each."""
    from spotnb.providers.aws.leftovers import ignore_missing

    done = []
    for region in regions:
        events = provider.client("events", region)
        if ignore_missing(functools.partial(events.remove_targets, Rule=RULE,
                                            Ids=[FUNCTION]), "ResourceNotFoundException"):
            ignore_missing(functools.partial(events.delete_rule, Name=RULE),
                           "ResourceNotFoundException")
            done.append(f"deleted rule {RULE} in {region}")
        lam = provider.client("lambda", region)
        if ignore_missing(functools.partial(lam.delete_function, FunctionName=FUNCTION),
                          "ResourceNotFoundException"):
            done.append(f"deleted function {FUNCTION} in {region}")
    iam = provider.client("iam", home)
    ignore_missing(functools.partial(iam.delete_role_policy, RoleName=ROLE,
                                     PolicyName=ROLE))
    if ignore_missing(functools.partial(iam.delete_role, RoleName=ROLE)):
        done.append(f"deleted IAM role {ROLE}")
    return done


# -- the function


def handler(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Lambda's entry: one "EC2 Instance Launch Unsuccessful" event of a spotnb group.
    Returns what it decided (Lambda logs it)."""
    logging.getLogger().setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO)
    detail = event.get("detail") or {}
    name = str(detail.get("AutoScalingGroupName") or "")
    region = str(event.get("region") or os.environ.get("AWS_REGION") or "")
    request = str(getattr(context, "aws_request_id", "") or uuid.uuid4().hex[:12])
    result = _handle(name, region, owner=f"mover-{request}")
    log.info("%s in %s: %s", name, region, json.dumps(result))
    return result


def _handle(name: str, region: str, owner: str) -> dict[str, Any]:
    from spotnb.providers.aws import AwsProvider
    from spotnb.providers.aws.capacity import MOVE_CLAIM_SECONDS, move_if_dry
    from spotnb.providers.aws.resources import group_name, s3_location
    from spotnb.providers.aws.store import S3Store

    asg = _boto.client("autoscaling", region)
    found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])[
        "AutoScalingGroups"]
    if not found:
        return {"group": name, "moved": False, "why": "the group is gone"}
    tags = {t.get("Key"): t.get("Value") for t in found[0].get("Tags", ())}
    job_id, store_uri = str(tags.get(TAG_JOB) or ""), str(tags.get(TAG_STORE) or "")
    if not job_id or not store_uri or group_name(job_id) != name:
        return {"group": name, "moved": False, "why": "not a spotnb job's group"}
    bucket = s3_location(store_uri)[0]
    located = _boto.client("s3", region).get_bucket_location(Bucket=bucket)
    store = S3Store.from_uri(store_uri, region=located.get("LocationConstraint")
                             or "us-east-1")
    spec = JobSpec.from_json(store.get(layout.SPEC))
    provider = AwsProvider(region=spec.resources.region)
    if store.exists(layout.RESULT):
        # A group left after its job's end (its instance agent deletes it; a notebook's
        # stop does; a move cut short may have left one): it would launch a billed
        # instance for nothing once capacity comes back.
        provider._leave_region(job_id, region)
        return {"job": job_id, "moved": False, "why": "the job has ended: its group here "
                "is deleted"}
    if len(spec.resources.regions) < 2:
        return {"job": job_id, "moved": False, "why": "a job of one region"}
    events = EventReader(store, attempts=(GROUP_STREAM,)).poll()
    choices = sorted(((e.time, e.body) for e in events
                      if isinstance(e.body, codec.Region) and e.body.region),
                     key=lambda item: item[0])
    regions = [choice for _t, choice in choices]
    provider.runs_in(job_id, regions[-1].region if regions else region,
                     spec.resources.region)
    plan = provider._plans[job_id] = provider.region_plan(spec)
    if regions:
        plan.resume(regions)
    else:
        plan.resume_in(region)
    if plan.region != region:
        # A group the job moved away from: finish a move its owner left half-done.
        newest = regions[-1]
        claimed = _claim_age(store, len(regions) - 1)
        if newest.previous == region and (claimed is None or claimed > max(
                STALE_MOVE_SECONDS, MOVE_CLAIM_SECONDS)):
            # Its new group holding no instance is let launch, and the group here
            # deleted: the job runs there now.
            if not provider.finish_move(spec, region, newest.region):
                provider._leave_region(job_id, region)
            return {"job": job_id, "moved": False, "finished_move": True,
                    "region": newest.region}
        return {"job": job_id, "moved": False, "why": f"the job runs in {plan.region}"}
    activities = asg.describe_scaling_activities(AutoScalingGroupName=name)["Activities"]
    writer = move_if_dry(provider, spec, store, asg=asg, activities=activities, writer=None,
                         state_bytes=_state_bytes(store), choices=len(regions), owner=owner)
    if writer is not None:
        writer.close()
    now = provider.region(job_id)
    return {"job": job_id, "moved": now != region, "region": now,
            "failed_rounds": plan.failed_rounds}


def _claim_age(store: Any, n: int) -> float | None:
    """Seconds since the claim of the job's move after its ``n``-th region choice."""
    try:
        claim = json.loads(store.get(f"{layout.REGION_MOVES}{n}.json"))
        return time.time() - float(claim.get("time", 0))
    except Exception:
        return None


def _state_bytes(store: Any) -> int | None:
    """The size of the job's newest complete checkpoint (None before its first): what
    a restore in the next region reads across regions."""
    from spotnb.ckpt.checkpoints import CheckpointStore

    try:
        newest = CheckpointStore(store, prefix=layout.CHECKPOINTS).latest()
    except Exception:
        log.info("could not read the job's newest checkpoint", exc_info=True)
        return None
    return None if newest is None else newest.total_bytes
