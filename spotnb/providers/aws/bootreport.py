"""What a failed boot of an AWS instance leaves for its job.

Run by the boot script's failure handler (:mod:`spotnb.providers.aws.bootstrap`), as
a file of its own: the boot may have failed before or while installing spotnb, so
this imports nothing of spotnb. It needs the standard library of any Python 3.7+ and
one way to reach AWS with the instance role: boto3, or else the AWS CLI. It

1. writes the instance's boot log (its last MiB) to ``boot/<instance>.log``;
2. counts the failed boots in a row: the ``boot/*.log`` newer than the newest
   ``boot/*.ok`` (the mark an instance agent that came up writes);
3. at ``--limit`` failed boots in a row, fails the job: ``result.json``, create-only,
   with the failing step and the log's last line as the reason. While an agent holds
   one of the job's leases (not released, its heartbeat younger than its TTL: the job
   runs on another instance, and this was its warm standby or a node's replacement),
   only at WHILE_RUNNING times the limit: the running job is not ended for a standby
   that will not boot, but a group that keeps launching instances that fail is;
4. appends to the group's stream of the event log (``events/000000/``) one chunk,
   create-only under the next free number as every writer of that stream does
   (:class:`spotnb.protocol.events.EventWriter`): an ``instance`` event
   ``boot-failed`` (the step, its exit code, the log's last lines) and, unless the
   job runs on another instance (whose agents say its status), a ``status`` event that
   says what happens next and, when the job failed, its ``result``;
5. having failed the job, deletes its launch template and its Auto Scaling group
   (which would only launch another instance that fails the same way, forever).

Each step is tried on its own and what fails is said on stderr (the boot log); the
instance powers off all the same. Exit status: 0, or 3 when no way to reach AWS was
found (boto3 nor the AWS CLI): then nothing reached the job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# The job prefix's keys (spotnb.protocol.layout, spotnb.protocol.events: a test holds
# these equal to them).
BOOT = "boot/"
RESULT = "result.json"
GROUP_STREAM = "events/000000/"
SCHEMA_VERSION = 1
BOOT_FAILED = "boot-failed"
_LEASE = re.compile(r"^lease(\.\d+)?\.json$")
#: While the job runs on another instance, the limit is this many times larger.
WHILE_RUNNING = 3
#: The boot log's part kept in the store, and the lines of its end in the event.
LOG_BYTES = 1 << 20
TAIL_LINES = 40
LINE_CHARS = 400
#: Tries at the group stream's next free chunk number (another writer may take it).
APPEND_TRIES = 20
#: The prefix of the boot script's own lines in its log (not the failing command's).
OWN = "spotnb-boot:"
_CHUNK = re.compile(r"^(\d{8})\.")


class Unsupported(Exception):
    """This boto3 or AWS CLI cannot make a conditional write (older than S3's
    ``If-None-Match``, August 2024)."""


class _Boto3:
    """S3, Auto Scaling and EC2 through boto3 (the instance role's credentials)."""

    name = "boto3"

    def __init__(self, region: str | None) -> None:
        import boto3
        from botocore.exceptions import ClientError, ParamValidationError

        self._boto3 = boto3
        self._client_error = ClientError
        self._invalid = ParamValidationError
        self.region = region
        # The job's bucket is in its home region (the boot script's SPOTNB_STORE_REGION).
        self.s3 = boto3.client("s3", region_name=os.environ.get("SPOTNB_STORE_REGION")
                               or region)

    def put(self, bucket: str, key: str, body: bytes, create: bool = False) -> bool:
        """Write ``key``; with ``create``, only if it does not exist (False if it did)."""
        extra = {"IfNoneMatch": "*"} if create else {}
        try:
            self.s3.put_object(Bucket=bucket, Key=key, Body=body, **extra)
        except self._invalid as err:
            raise Unsupported(str(err)) from None
        except self._client_error as err:
            if err.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return False
            raise
        return True

    def get(self, bucket: str, key: str) -> bytes:
        return bytes(self.s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    def keys(self, bucket: str, prefix: str) -> list[tuple[str, float]]:
        """Every key under ``prefix``, with the time it was last written."""
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                       Prefix=prefix):
            for obj in page.get("Contents", ()):
                out.append((obj["Key"], obj["LastModified"].timestamp()))
        return out

    def delete_group(self, name: str) -> None:
        self._boto3.client("autoscaling", region_name=self.region).delete_auto_scaling_group(
            AutoScalingGroupName=name, ForceDelete=True)

    def delete_template(self, name: str) -> None:
        self._boto3.client("ec2", region_name=self.region).delete_launch_template(
            LaunchTemplateName=name)


class _Cli:
    """The same through the AWS CLI (v1 or v2), for an image without boto3."""

    name = "AWS CLI"

    def __init__(self, aws: str, region: str | None) -> None:
        self.aws = aws
        self.region = region

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [self.aws, *args, "--output", "json"]
        if self.region:
            cmd += ["--region", self.region]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, check=False)

    def _check(self, done: subprocess.CompletedProcess[str]) -> str:
        if done.returncode != 0:
            raise RuntimeError(f"aws {' '.join(done.args[1:3])} exited with "
                               f"{done.returncode}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def put(self, bucket: str, key: str, body: bytes, create: bool = False) -> bool:
        with tempfile.NamedTemporaryFile(prefix="spotnb-report-") as f:
            f.write(body)
            f.flush()
            args = ["s3api", "put-object", "--bucket", bucket, "--key", key, "--body", f.name]
            done = self._run(*args, *(["--if-none-match", "*"] if create else []))
        if done.returncode and "PreconditionFailed" in done.stderr:
            return False
        if done.returncode and create and "if-none-match" in done.stderr.lower():
            raise Unsupported(done.stderr.strip()[-300:])
        self._check(done)
        return True

    def get(self, bucket: str, key: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="spotnb-report-") as where:
            out = os.path.join(where, "object")
            self._check(self._run("s3api", "get-object", "--bucket", bucket, "--key", key,
                                  out))
            with open(out, "rb") as f:
                return f.read()

    def keys(self, bucket: str, prefix: str) -> list[tuple[str, float]]:
        listed = self._check(self._run("s3api", "list-objects-v2", "--bucket", bucket,
                                       "--prefix", prefix))
        found = json.loads(listed or "{}").get("Contents") or []
        return [(o["Key"], _timestamp(o["LastModified"])) for o in found]

    def delete_group(self, name: str) -> None:
        self._check(self._run("autoscaling", "delete-auto-scaling-group",
                              "--auto-scaling-group-name", name, "--force-delete"))

    def delete_template(self, name: str) -> None:
        self._check(self._run("ec2", "delete-launch-template", "--launch-template-name",
                              name))


def _timestamp(text: str) -> float:
    """An ISO 8601 time as the AWS CLI prints it (``...Z`` or ``...+00:00``)."""
    value = text.strip().replace("Z", "+00:00")
    when = datetime.datetime.fromisoformat(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def transport(region: str | None) -> _Boto3 | _Cli | None:
    """boto3 where this Python has it, else the AWS CLI, else None."""
    try:
        return _Boto3(region)
    except ImportError:
        pass
    aws = shutil.which("aws")
    return _Cli(aws, region) if aws else None


def tail(path: str, size: int = LOG_BYTES) -> str:
    """The last ``size`` bytes of the log (from a line's start), as text."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            start = max(0, f.tell() - size)
            f.seek(start)
            data = f.read()
    except OSError as err:
        return f"{OWN} the boot log {path} cannot be read: {err}\n"
    if start:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


def last_lines(text: str, count: int = TAIL_LINES) -> list[str]:
    """The log's last ``count`` non-empty lines, each cut to LINE_CHARS."""
    lines = [line.rstrip()[:LINE_CHARS] for line in text.splitlines() if line.strip()]
    return lines[-count:]


def cause(lines: list[str]) -> str:
    """The failing command's last line: the log's last line the script did not write."""
    for line in reversed(lines):
        if not line.startswith(OWN):
            return line.strip()
    return ""


def failures_in_a_row(keys: list[tuple[str, float]], own: str) -> int:
    """Boot logs newer than the newest mark of an instance that came up, ``own`` (this
    boot's, just written) always among them."""
    last_ok = max((t for k, t in keys if k.endswith(".ok")), default=0.0)
    logs = {k for k, t in keys if k.endswith(".log") and t > last_ok}
    logs.add(own)
    return len(logs)


def job_running(store: Any, bucket: str, prefix: str, now: float) -> bool:
    """Whether an agent holds one of the job's leases (``lease.json``,
    ``lease.<k>.json``): not released, and its heartbeat younger than its TTL."""
    for key, _t in store.keys(bucket, prefix + "lease"):
        if not _LEASE.match(key[len(prefix):]):
            continue
        try:
            lease = json.loads(store.get(bucket, key))
            if not lease.get("released") and \
                    now - float(lease["heartbeat"]) < float(lease.get("ttl", 180.0)):
                return True
        except Exception as err:  # unreadable: not a holder this report can count on
            print(f"{OWN} reading {key} failed: {type(err).__name__}: {err}",
                  file=sys.stderr)
    return False


def _append(store: Any, bucket: str, prefix: str, events: list[dict[str, Any]]) -> str:
    """``events`` as one new chunk of the group's stream; its key."""
    body = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events).encode()
    stream = prefix + GROUP_STREAM
    for _ in range(APPEND_TRIES):
        taken = [-1]
        for k, _t in store.keys(bucket, stream):
            m = _CHUNK.match(k[len(stream):])
            if m:
                taken.append(int(m.group(1)))
        key = f"{stream}{max(taken) + 1:08d}.jsonl"
        if store.put(bucket, key, body, create=True):
            return key
    raise RuntimeError(f"no free chunk number in {stream} after {APPEND_TRIES} tries")


def _fail_job(store: Any, bucket: str, prefix: str, body: bytes) -> bool:
    """``result.json``, unless the job has one: whether this wrote it."""
    try:
        return bool(store.put(bucket, prefix + RESULT, body, create=True))
    except Unsupported:
        # No conditional write here: look first (a result written between the two
        # is overwritten; only an agent that came up writes one, and none did).
        if any(k == prefix + RESULT for k, _t in store.keys(bucket, prefix + RESULT)):
            return False
        return bool(store.put(bucket, prefix + RESULT, body))


def _attempt(what: str, step: Callable[[], Any]) -> Any:
    try:
        return step()
    except Exception as err:
        print(f"{OWN} {what} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python bootreport.py --job-uri ... --step ... --log ...``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("job-uri", "job-id", "instance", "step", "log", "group", "template"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("instance-type", "az", "region"):
        parser.add_argument(f"--{name}", default="")
    parser.add_argument("--code", type=int, default=1)
    parser.add_argument("--limit", type=int, required=True)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # killed any time

    store = transport(args.region or None)
    if store is None:
        print(f"{OWN} neither boto3 nor the AWS CLI is on this image: the failure cannot "
              "reach the job", file=sys.stderr)
        return 3
    print(f"{OWN} reporting the failure to the job with {store.name}")
    bucket, _, prefix = args.job_uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    iid = args.instance
    text = tail(args.log)
    lines = last_lines(text)
    own_log = prefix + BOOT + f"{iid}.log"
    # Step 1: the whole log, for whoever wants more than the event's last lines.
    _attempt("writing the boot log", lambda: store.put(bucket, own_log, text.encode()))
    # Step 2: how many boots failed in a row.
    count = _attempt("counting the failed boots", lambda: failures_in_a_row(
        store.keys(bucket, prefix + BOOT), own_log)) or 1
    now = time.time()
    running = bool(_attempt("reading the job's leases",
                            lambda: job_running(store, bucket, prefix, now)))
    limit = args.limit * WHILE_RUNNING if running else args.limit
    give_up = count >= limit
    what = f"{args.step} (exit {args.code})"
    last = cause(lines)
    said = f"{what}: {last}" if last else what
    where = f"{iid} ({args.instance_type})" if args.instance_type else iid
    if give_up:
        detail = (f"the instance bootstrap failed {count} times in a row; on the last, "
                  f"{where}, {said}. `spotnb logs {args.job_id}` shows the log's end; "
                  f"each failed boot's whole log is in {args.job_uri.rstrip('/')}/{BOOT}")
    else:
        elsewhere = " (the job runs on another instance)" if running else ""
        detail = (f"{where} failed to boot ({count} of {limit} in a row{elsewhere}): "
                  f"{said}; Auto Scaling launches another instance")
    # Step 3: the job fails, with that reason.
    if give_up:
        result = {"status": "failed", "reason": detail, "time": now, "by": "aws-bootstrap",
                  "instance_id": iid}
        wrote = _attempt("failing the job", lambda: _fail_job(
            store, bucket, prefix, json.dumps(result).encode()))
        if wrote is False:
            print(f"{OWN} the job has a result already", file=sys.stderr)
    # Step 4: the events, which every view of the job reads.
    event = {"time": now, "attempt": 0, "instance": iid, "v": SCHEMA_VERSION}
    events = [
        {**event, "type": "instance", "data": {
            "action": BOOT_FAILED, "instance_id": iid,
            "instance_type": args.instance_type or None, "az": args.az or None,
            "reason": what, "step": args.step, "exit_code": args.code, "log": lines,
            "failures": count, "limit": limit}}]
    if give_up or not running:  # a running job's status is its agents' to say
        events.append({**event, "type": "status", "data": {
            "state": "failed" if give_up else "launching", "detail": detail}})
    if give_up:
        events.append({**event, "type": "result", "data": {"status": "failed",
                                                           "reason": detail}})
    try:
        key = _append(store, bucket, prefix, events)
        print(f"{OWN} the failure is in the job's events ({key})")
    except Unsupported:
        print(f"{OWN} this {store.name} cannot write create-only, so the failure is not "
              "in the job's events (boot/ has it)", file=sys.stderr)
    except Exception as err:
        print(f"{OWN} recording the failure in the job's events failed: "
              f"{type(err).__name__}: {err}", file=sys.stderr)
    # Step 5: nothing more is launched for a job that failed. The template first: the
    # group's deletion ends this instance (as the instance agent's teardown does).
    if give_up:
        print(f"{OWN} {count} boots failed in a row: the job failed; deleting its group")
        _attempt("deleting the launch template", lambda: store.delete_template(args.template))
        _attempt("deleting the Auto Scaling group", lambda: store.delete_group(args.group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
