"""A job's secrets on AWS: SSM Parameter Store ``SecureString`` parameters.

Each secret of a job is one parameter ``/spotnb/<job-id>/<NAME>`` (standard tier,
encrypted with the account's default key ``alias/aws/ssm``, tagged like every resource
of the job). Why SSM rather than Secrets Manager: standard parameters cost nothing to
keep and nothing per request at spotnb's rates (Secrets Manager bills $0.40 per secret
per month, prorated, and $0.05 per 10,000 calls), a job's secrets live for hours, and
a path per job lets one IAM statement give the job's role its own secrets and nothing
else (:func:`role_statement`).

Requests per job: one PutParameter per secret at submit, one GetParameters per 10
secrets each time an agent starts (every attempt, every node), one DeleteParameters per
10 at the end (the instance's teardown; the notebook's ``terminate`` again). A few per
job, none per hour.

No value is logged or put in an exception: errors of the calls that carry values are
re-raised with their code only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from spotnb.protocol.secretstore import SecretsUnavailable
from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto

__all__ = ["ROOT", "delete", "leftovers", "parameter_name", "put", "read", "role_statement"]

log = logging.getLogger(__name__)

#: Every job's parameters live under this path.
ROOT = "/spotnb"
#: GetParameters and DeleteParameters take at most 10 names a call.
_BATCH = 10


def job_path(job_id: str) -> str:
    return f"{ROOT}/{job_id}"


def parameter_name(job_id: str, name: str) -> str:
    return f"{job_path(job_id)}/{name}"


def role_statement(*, job_id: str, region: str, account: str,
                   partition: str = "aws") -> dict[str, Any]:
    """The instance role's access to its job's secrets: read them (decrypted with the
    AWS managed key ``aws/ssm``, whose key policy lets the account's principals use it
    through SSM: no KMS statement needed) and delete them at the end; nothing else."""
    return {
        "Sid": "OwnSecrets",
        "Effect": "Allow",
        "Action": ["ssm:GetParameter", "ssm:GetParameters", "ssm:DeleteParameter",
                   "ssm:DeleteParameters"],
        "Resource": f"arn:{partition}:ssm:{region}:{account}:parameter{job_path(job_id)}/*",
    }


def _batches(names: Sequence[str]) -> Iterator[list[str]]:
    for i in range(0, len(names), _BATCH):
        yield list(names[i:i + _BATCH])


def put(ssm: Any, job_id: str, values: Mapping[str, str],
        tag_list: list[dict[str, str]]) -> list[str]:
    """Store each secret; returns the parameter names written (to delete again if a
    later launch step fails). Errors name the secret, never its value."""
    written = []
    for name, value in values.items():
        full = parameter_name(job_id, name)
        try:
            _boto.with_backoff(partial(
                ssm.put_parameter, Name=full, Value=value, Type="SecureString",
                Tier="Standard", Description=f"spotnb job {job_id}: secret {name}",
                Tags=tag_list), what=f"storing the secret {name}")
        except Exception as err:
            raise _scrubbed(err, f"storing the secret {name} in SSM Parameter Store") from None
        written.append(full)
    return written


def _scrubbed(err: BaseException, what: str) -> Exception:
    """``err`` as spotnb's error, by its code alone: AWS's message of a call that
    carried a value might quote it."""
    code = getattr(err, "code", "") or _boto.error_code(err) or type(err).__name__
    kind = _boto.classify(err)
    if kind == "fatal":
        fix = _boto.FATAL_CODES.get(code, "check the account with `spotnb aws doctor`")
        return SpecError(f"{what}: AWS said {code}. Next step: {fix}. Nothing was started.")
    return _boto.AwsError(f"{what}: AWS said {code}; nothing was started", code, kind)


def read(ssm: Any, job_id: str, names: Sequence[str]) -> dict[str, str]:
    """The job's secrets ``names``, decrypted; SecretsUnavailable naming what is
    missing or why it could not be read."""
    found: dict[str, str] = {}
    for batch in _batches(names):
        try:
            reply = _boto.with_backoff(partial(
                ssm.get_parameters, Names=[parameter_name(job_id, n) for n in batch],
                WithDecryption=True), what="reading the job's secrets")
        except Exception as err:
            raise SecretsUnavailable(
                f"SSM Parameter Store refused {', '.join(batch)} "
                f"({_boto.error_code(err) or type(err).__name__})") from None
        for param in reply.get("Parameters", ()):
            found[param["Name"].rsplit("/", 1)[-1]] = param["Value"]
    missing = [n for n in names if n not in found]
    if missing:
        raise SecretsUnavailable(f"{', '.join(missing)} not found in SSM Parameter Store "
                                 f"under {job_path(job_id)}/ (deleted when the job ended?)")
    return found


def delete(ssm: Any, job_id: str, names: Sequence[str]) -> int:
    """Delete the job's parameters ``names``; how many were there."""
    count = 0
    for batch in _batches(names):
        reply = _boto.with_backoff(partial(
            ssm.delete_parameters, Names=[parameter_name(job_id, n) for n in batch]),
            what="deleting the job's secrets")
        count += len(reply.get("DeletedParameters", ()))
    return count


def leftovers(ssm: Any, job_id: str | None = None) -> dict[str, list[str]]:
    """Every job's parameters under :data:`ROOT` (or only ``job_id``'s):
    ``{job_id: [secret names]}`` (names only; DescribeParameters returns no value)."""
    found: dict[str, list[str]] = {}
    path = job_path(job_id) if job_id else ROOT
    params: dict[str, Any] = {"ParameterFilters": [
        {"Key": "Path", "Option": "Recursive", "Values": [path]}], "MaxResults": 50}
    while True:
        reply = ssm.describe_parameters(**params)
        for param in reply.get("Parameters", ()):
            parts = param["Name"].split("/")
            if len(parts) == 4 and parts[1] == ROOT.strip("/"):
                found.setdefault(parts[2], []).append(parts[3])
        if not reply.get("NextToken"):
            return found
        params["NextToken"] = reply["NextToken"]


def tags_of(ssm: Any, job_id: str, name: str) -> dict[str, str]:
    """The tags of one of the job's parameters (``spotnb:store`` tells whether its job
    ended); empty if it is gone."""
    try:
        reply = ssm.list_tags_for_resource(ResourceType="Parameter",
                                           ResourceId=parameter_name(job_id, name))
    except Exception as err:
        if "NotFound" in _boto.error_code(err) or _boto.error_code(err) == "InvalidResourceId":
            return {}
        raise
    return {t["Key"]: t["Value"] for t in reply.get("TagList", ())}
