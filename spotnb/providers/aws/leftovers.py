"""What ended jobs leave behind, found and deleted.

:meth:`Leftovers.cleanup` is ``spotnb aws cleanup`` (the contract's ``cleanup``): every
kind of resource a job makes, looked for by its tags and deleted when its job is over
(:func:`job_over`: it has a result, or no spec). The launch sweeps too, before it makes
anything (:meth:`Leftovers._sweep_roles`: roles that IAM would not let delete
themselves; :meth:`Leftovers._sweep_networks`: a multi-node job's security and
placement groups that AWS kept while an instance was in them). :class:`Leftovers` is a
part of :class:`~spotnb.providers.aws.AwsProvider` (its base class); the deletes of one
job's resources it calls are the provider's (:class:`_Deleting` names them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from spotnb.protocol import layout
from spotnb.protocol.spec import SpecError
from spotnb.protocol.store import StoreError, open_store
from spotnb.providers import ProviderError
from spotnb.providers.aws import _boto, cluster, parameters
from spotnb.providers.aws.resources import IAM_PATH, TAG_JOB, TAG_STORE

__all__ = ["CleanupIncomplete", "Leftovers", "delete_role_named", "ignore_missing",
           "job_over", "paginate"]

log = logging.getLogger(__name__)


class _Deleting(Protocol):
    """What :class:`Leftovers` uses of the provider it is a part of."""

    _job_regions: dict[str, str]

    def region(self, job_id: str | None = None) -> str: ...

    def regions(self) -> list[str]: ...

    def client(self, service: str, region: str) -> Any: ...

    def _delete_group(self, job_id: str, region: str) -> bool: ...

    def _instances(self, region: str, job_id: str | None,
                   states: tuple[str, ...]) -> list[dict[str, Any]]: ...

    def _secrets_left(self, region: str,
                      over: Callable[[str, str | None], tuple[bool, str]],
                      verb: str, dry_run: bool, done: list[str]) -> None: ...


class Leftovers:
    """The provider's part that finds and deletes what ended jobs left (the module
    docstring)."""

    def cleanup(self: _Deleting, dry_run: bool = False) -> list[str]:
        """See the contract, in every region spotnb may have used (:meth:`regions`: the
        session's, the allowed ones, those of the jobs this provider launched). Each
        kind of resource is looked for and deleted on its own: a call that fails (a
        policy that denies it, an AWS without it) is named with the permission it
        needed, the other kinds are cleaned up all the same, and then
        :class:`CleanupIncomplete` says what could not be done."""
        done: list[str] = []
        failed: list[str] = []
        verdicts: dict[str, tuple[bool, str]] = {}
        regions = set(self.regions())
        verb = "would delete" if dry_run else "deleted"

        def over(job_id: str, store_uri: str | None) -> tuple[bool, str]:
            if job_id not in verdicts:
                verdicts[job_id] = job_over(store_uri)
            return verdicts[job_id]

        def guarded(what: str, step: Callable[[], object]) -> bool:
            """Run one step of the cleanup; a failure is recorded (False), not raised."""
            try:
                step()
                return True
            except Exception as err:
                clients = [self.client(name, self.region()) for name in
                           ("ec2", "autoscaling", "sqs", "iam", "ssm")]
                failed.append(cleanup_failure(what, err, clients))
                log.warning("cleanup: %s", failed[-1])
                return False

        for region in sorted(regions):
            asg = self.client("autoscaling", region)
            ec2 = self.client("ec2", region)

            def groups(region: str = region, asg: Any = asg) -> None:
                for group in paginate(asg, "describe_auto_scaling_groups",
                                       "AutoScalingGroups"):
                    found = {t["Key"]: t["Value"] for t in group.get("Tags", ())}
                    if TAG_JOB not in found:
                        continue
                    ended, why = over(found[TAG_JOB], found.get(TAG_STORE))
                    if not ended:
                        continue
                    name = group["AutoScalingGroupName"]
                    if dry_run or guarded(
                            f"delete Auto Scaling group {name} in {region}",
                            partial(self._delete_group, found[TAG_JOB], region)):
                        done.append(f"{verb} Auto Scaling group {name} in {region} ({why})")

            def templates(region: str = region, ec2: Any = ec2) -> None:
                for template in ec2.describe_launch_templates(Filters=[
                        {"Name": "tag-key", "Values": [TAG_JOB]}]).get("LaunchTemplates", ()):
                    found = {t["Key"]: t["Value"] for t in template.get("Tags", ())}
                    ended, why = over(found.get(TAG_JOB, ""), found.get(TAG_STORE))
                    if not ended:
                        continue
                    name = template["LaunchTemplateName"]
                    if dry_run or guarded(
                            f"delete launch template {name} in {region}",
                            partial(ignore_missing, partial(
                                ec2.delete_launch_template,
                                LaunchTemplateId=template["LaunchTemplateId"]))):
                        done.append(f"{verb} launch template {name} in {region} ({why})")

            def network(kind: str, region: str = region, ec2: Any = ec2) -> None:
                for kind_, ident, label, found in cluster.leftovers(ec2, kinds=(kind,)):
                    ended, why = over(found.get(TAG_JOB, ""), found.get(TAG_STORE))
                    if not ended:
                        continue
                    deleted: list[bool] = [True]  # False: in use by an instance still

                    def delete(kind_: str = kind_, ident: str = ident,
                               deleted: list[bool] = deleted) -> None:
                        deleted[0] = cluster.delete_leftover(ec2, kind_, ident)

                    if not dry_run and not guarded(f"delete {label} in {region}", delete):
                        continue
                    if deleted[0]:
                        done.append(f"{verb} {label} in {region} ({why})")
                    else:
                        done.append(f"kept {label} in {region} ({why}, but an instance "
                                    "still uses it: run cleanup again in a minute)")

            def instances(region: str = region, ec2: Any = ec2) -> None:
                for inst in self._instances(region, None, ("pending", "running", "stopping",
                                                           "stopped")):
                    found = {t["Key"]: t["Value"] for t in inst.get("Tags", ())}
                    ended, why = over(found.get(TAG_JOB, ""), found.get(TAG_STORE))
                    if not ended:
                        continue
                    ident = inst["InstanceId"]
                    if dry_run or guarded(
                            f"terminate instance {ident} in {region}",
                            partial(ec2.terminate_instances, InstanceIds=[ident])):
                        done.append(f"{verb} instance {ident} in {region} ({why})")

            guarded(f"look for Auto Scaling groups in {region}", groups)
            guarded(f"look for launch templates in {region}", templates)
            guarded(f"look for security groups in {region}",
                    partial(network, "security-group"))
            guarded(f"look for placement groups in {region}",
                    partial(network, "placement-group"))
            guarded(f"look for instances in {region}", instances)

        def queues(region: str) -> None:
            sqs = self.client("sqs", region)
            for url in sqs.list_queues(QueueNamePrefix="spotnb-").get("QueueUrls", []):
                name = url.rsplit("/", 1)[-1]
                try:
                    found = sqs.list_queue_tags(QueueUrl=url).get("Tags", {})
                except Exception as err:
                    if "NonExistentQueue" in _code(err) or _code(err) == "QueueDoesNotExist":
                        continue
                    raise
                ended, why = over(found.get(TAG_JOB, ""), found.get(TAG_STORE))
                if not ended:
                    continue
                if dry_run or guarded(
                        f"delete queue {name} in {region}",
                        partial(ignore_missing, partial(sqs.delete_queue, QueueUrl=url))):
                    done.append(f"{verb} queue {name} in {region} ({why})")

        for region in sorted(regions):
            guarded(f"look for queues in {region}", partial(queues, region))
            guarded(f"look for jobs' secrets in {region}",
                    partial(self._secrets_left, region, over, verb, dry_run, done))
        iam = self.client("iam", self.region())

        def roles() -> None:
            for name, why in ended_roles(iam, over):
                if dry_run or guarded(f"delete IAM role {name}",
                                      partial(delete_role_named, iam, name)):
                    done.append(f"{verb} IAM role and instance profile {name} ({why})")

        def profiles() -> None:
            for profile in paginate(iam, "list_instance_profiles", "InstanceProfiles",
                                     PathPrefix=IAM_PATH):
                name = profile["InstanceProfileName"]
                if not name.startswith("spotnb-job-") or profile.get("Roles"):
                    continue
                if dry_run or guarded(
                        f"delete instance profile {name}",
                        partial(ignore_missing, partial(iam.delete_instance_profile,
                                                         InstanceProfileName=name))):
                    done.append(f"{verb} instance profile {name} (it has no role left)")

        guarded("look for IAM roles", roles)
        guarded("look for instance profiles", profiles)
        if failed:
            raise CleanupIncomplete(done, failed)
        return done

    def _secrets_left(self: _Deleting, region: str,
                      over: Callable[[str, str | None], tuple[bool, str]],
                      verb: str, dry_run: bool, done: list[str]) -> None:
        """cleanup's part for secrets: the parameters of jobs that ended, added to
        ``done``. A call that fails raises (cleanup names the call and its permission:
        an identity set up before secrets existed may lack ssm:DescribeParameters)."""
        ssm = self.client("ssm", region)
        for job_id, names in sorted(parameters.leftovers(ssm).items()):
            found = parameters.tags_of(ssm, job_id, names[0])
            ended, why = over(found.get(TAG_JOB, job_id), found.get(TAG_STORE))
            if ended:
                if not dry_run:
                    parameters.delete(ssm, job_id, names)
                done.append(f"{verb} {len(names)} secret{'s' if len(names) > 1 else ''} of "
                            f"job {job_id} in {region} (SSM {parameters.job_path(job_id)}/; "
                            f"{why})")

    def _sweep_roles(self: _Deleting, region: str) -> None:
        """Delete the roles of ended jobs (a ListRoles, and a ListRoleTags and the job's
        result looked for per job role left): an instance's teardown deletes its role's
        policy, but IAM may refuse the DeleteRole after it (the permission was in that
        policy), so a role with nothing in it can be left (:meth:`_delete_role`). Only
        such empty roles: a role that still has its policy is one whose instance may be
        tearing down right now (a job that ended a moment ago), and its teardown deletes
        it (a ListRolePolicies per ended job's role)."""
        verdicts: dict[str, tuple[bool, str]] = {}

        def over(job_id: str, store_uri: str | None) -> tuple[bool, str]:
            if job_id not in verdicts:
                verdicts[job_id] = job_over(store_uri)
            return verdicts[job_id]

        iam = self.client("iam", region)
        try:
            for name, _ in ended_roles(iam, over):
                if iam.list_role_policies(RoleName=name).get("PolicyNames"):
                    continue  # its instance's teardown is not over yet
                delete_role_named(iam, name)
                log.info("deleted the role %s of an ended job", name)
        except Exception as err:
            log.info("could not look for ended jobs' roles: %s", err)

    def _sweep_networks(self: _Deleting, region: str) -> None:
        """Delete ended jobs' security and placement groups that AWS refused to delete
        while their instances were still in them (cluster.py)."""
        verdicts: dict[str, tuple[bool, str]] = {}

        def over(job_id: str, store_uri: str | None) -> tuple[bool, str]:
            if job_id not in verdicts:
                verdicts[job_id] = job_over(store_uri)
            return verdicts[job_id]

        try:
            done = cluster.sweep(self.client("ec2", region), over)
        except Exception as err:
            log.info("could not look for ended jobs' network leftovers: %s", err)
            return
        if done:
            log.info("deleted what ended jobs left: %s", ", ".join(done))


def _code(err: BaseException) -> str:
    return _boto.error_code(err)


def ignore_missing(fn: Callable[[], Any], *codes: str) -> bool:
    """Run a delete; False if the resource was already gone (``codes`` or "not found").

    Two parties may delete the same resource at once (the instance's own teardown and
    the notebook's stop): an answer that is not even an AWS error (an HTTP 500 without
    a body botocore can parse) is tried again a few times.
    """
    for attempt in range(_DELETE_TRIES):
        try:
            return _delete_once(fn, codes)
        except Exception as err:
            if type(err).__name__ != "ResponseParserError" or attempt == _DELETE_TRIES - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    return False


_DELETE_TRIES = 3


def _delete_once(fn: Callable[[], Any], codes: tuple[str, ...]) -> bool:
    try:
        fn()
    except Exception as err:
        code = _code(err)
        if code in codes or "NotFound" in code or "not found" in str(err) or \
                code in ("NoSuchEntity", "AWS.SimpleQueueService.NonExistentQueue",
                         "QueueDoesNotExist"):
            return False
        raise
    return True



def delete_role_named(iam: Any, name: str) -> None:
    """Delete a job role, its inline policy and its instance profile; missing is fine."""
    ignore_missing(lambda: iam.remove_role_from_instance_profile(
        InstanceProfileName=name, RoleName=name))
    ignore_missing(lambda: iam.delete_instance_profile(InstanceProfileName=name))
    ignore_missing(lambda: iam.delete_role_policy(RoleName=name, PolicyName="spotnb-job"))
    ignore_missing(lambda: iam.delete_role(RoleName=name))


def ended_roles(iam: Any, over: Callable[[str, str | None], tuple[bool, str]]
                 ) -> list[tuple[str, str]]:
    """The job roles (``spotnb-job-*`` under :data:`IAM_PATH`) whose jobs are over, with
    why (``over(job_id, store_uri)``, from the role's tags)."""
    found = []
    for role in paginate(iam, "list_roles", "Roles", PathPrefix=IAM_PATH):
        name = role["RoleName"]
        if not name.startswith("spotnb-job-"):
            continue
        try:
            tags = {t["Key"]: t["Value"] for t in
                    iam.list_role_tags(RoleName=name).get("Tags", ())}
        except Exception as err:
            if _code(err) == "NoSuchEntity":
                continue  # deleted meanwhile (its instance agent's teardown)
            raise
        ended, why = over(tags.get(TAG_JOB, ""), tags.get(TAG_STORE))
        if ended:
            found.append((name, why))
    return found


def paginate(client: Any, method: str, key: str, **params: Any) -> list[Any]:
    items: list[Any] = []
    for page in client.get_paginator(method).paginate(**params):
        items += page.get(key, ())
    return items


class CleanupIncomplete(ProviderError):
    """``spotnb aws cleanup`` could not do everything: ``done`` (what it did, as
    :meth:`AwsProvider.cleanup` returns it) and ``failed`` (what it could not, each with
    the call and the permission it needed)."""

    def __init__(self, done: list[str], failed: list[str]) -> None:
        self.done = done
        self.failed = failed
        super().__init__(
            f"the cleanup could not {len(failed)} thing(s): " + "; ".join(failed))


def cleanup_failure(what: str, err: BaseException, clients: list[Any]) -> str:
    """A line for a step of the cleanup that failed: what, the call, the permission
    (its IAM action: the service of whichever client has the operation), the fix."""
    operation = getattr(err, "operation_name", None)
    service = next((c.meta.service_model.signing_name for c in clients
                    if operation in c.meta.service_model.operation_names), None)
    code = _code(err) or type(err).__name__
    message = (getattr(err, "response", None) or {}).get("Error", {}).get("Message") \
        or str(err)
    if operation and service:
        return (f"could not {what}: {operation} failed ({code}: {message}); it needs the "
                f"permission {service}:{operation}: attach the notebook-user policy "
                "printed by `spotnb aws setup --dry-run` (or check the account with "
                "`spotnb aws doctor`), then run `spotnb aws cleanup` again")
    return (f"could not {what}: {code}: {message}; check the account with `spotnb aws "
            "doctor`, then run `spotnb aws cleanup` again")


def job_over(store_uri: str | None) -> tuple[bool, str]:
    """Whether a job is over (its resources are leftovers), and why."""
    if not store_uri:
        return True, "it names no job store"
    try:
        store = open_store(store_uri)
        if store.exists(layout.RESULT):
            return True, "its job has a result"
        if not store.exists(layout.SPEC):
            return True, "its job does not exist in the store"
    except (StoreError, SpecError) as err:
        return False, f"kept: cannot read its store ({err})"
    return False, "its job is running"
