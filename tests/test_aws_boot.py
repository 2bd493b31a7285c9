"""How an EC2 instance boots spotnb: the real user data, as EC2 runs it.

The simulator boots each instance on a simulated operating system
(:mod:`spotnb.testing.boot`: cloud-init runs the user data once, systemd runs the units
it enables at every boot, a power-off becomes EC2's termination). On the plain image
(``install=True``) the "system" Python has no spotnb and refuses pip (PEP 668), the
internet is a local wheel index, and nothing of the test's environment comes through:
the boot script must make its own environment, install, start the agent as a service,
and, when a step fails, end the instance and tell the job why.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_aws_provider as aws_tests
from helpers import wait_until

import spotnb
from spotnb.client.cli import main as cli_main
from spotnb.client.display import Finished, JobView, follow, milestone
from spotnb.client.jobs import JobResult
from spotnb.protocol import layout
from spotnb.protocol.events import (
    EVENTS_PREFIX,
    GROUP_STREAM,
    SCHEMA_VERSION,
    Event,
    codec,
    stream_name,
)
from spotnb.providers.aws import AwsProvider, _boto, bootreport, bootstrap
from spotnb.providers.aws.bootstrap import (
    AGENT_UNIT,
    BOOT_FAILURE_LIMIT,
    USER_DATA_LIMIT,
    bundle,
    user_data,
)
from spotnb.testing import AwsSimulator, boot

pytestmark = pytest.mark.skipif(sys.platform != "linux",
                                reason="simulated instances are Linux processes")


def expanded(script: str) -> str:
    """The boot script with its packed failure report unpacked (what it holds)."""
    packed = re.search(r"<<'SPOTNB_BOOTREPORT'[^\n]*\n(.*?)\nSPOTNB_BOOTREPORT", script, re.S)
    assert packed is not None
    report = gzip.decompress(base64.b64decode(packed.group(1))).decode()
    return script.replace(packed.group(1), report)


def test_the_boot_script_is_bash_within_ec2s_limit_and_holds_no_secret() -> None:
    script = user_data(job_id="j1", store_uri="s3://bkt-jobs/jobs/j1", wheel=bundle())
    assert len(script.encode()) <= USER_DATA_LIMIT
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True,
                             check=False)
    assert checked.returncode == 0, checked.stderr
    full = expanded(script)
    compile(full[full.index("from __future__"):full.index("\nSPOTNB_BOOTREPORT")],
            "bootreport.py", "exec")
    assert not re.search(r"AKIA|ASIA|aws_secret|SECRET_ACCESS|SESSION_TOKEN|password", full)
    # Never pip into the image's Python: only into the environment the script makes.
    assert not re.search(r"python3? -m pip install", full)
    assert "--system-site-packages" not in full or "_spotnb_base.pth" in full


def test_the_failure_report_writes_the_jobs_own_keys() -> None:
    """bootreport.py runs without spotnb: its names of the job's keys are the layout's."""
    assert bootreport.BOOT == layout.BOOT
    assert bootreport.RESULT == layout.RESULT
    assert f"{EVENTS_PREFIX}{stream_name(GROUP_STREAM)}/" == bootreport.GROUP_STREAM
    assert bootreport.SCHEMA_VERSION == SCHEMA_VERSION
    assert codec.Instance(action=bootreport.BOOT_FAILED).boot_failed
    assert layout.boot_log_key("i-1") == f"{bootreport.BOOT}i-1.log"
    assert layout.boot_ok_key("i-1").endswith(".ok")


def test_only_boots_failed_since_an_instance_came_up_count_towards_the_limit() -> None:
    keys = [("p/boot/i-1.log", 10.0), ("p/boot/i-2.log", 20.0), ("p/boot/i-3.ok", 30.0),
            ("p/boot/i-4.log", 40.0)]
    assert bootreport.failures_in_a_row(keys, "p/boot/i-5.log") == 2
    assert bootreport.failures_in_a_row(keys[:2], "p/boot/i-5.log") == 3
    assert bootreport.failures_in_a_row([], "p/boot/i-1.log") == 1
    # A rebooted instance that failed after it had come up counts once.
    assert bootreport.failures_in_a_row([("p/boot/i-3.ok", 30.0), ("p/boot/i-3.log", 50.0)],
                                        "p/boot/i-3.log") == 1


class Recorder:
    """A display (``spotnb.client.display.Renderer``) that keeps what it was told."""

    def __init__(self) -> None:
        self.headers: list[tuple[str, str]] = []
        self.milestones: list[str] = []
        self.final: tuple[str, str] | None = None

    def update(self, view: JobView) -> None:
        self.headers.append((view.state, view.detail))

    def stream(self, name: str, text: str) -> None:
        pass

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        pass

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        self.milestones.append(text)

    def finished(self, view: JobView, result: JobResult) -> None:
        self.final = (view.state, view.reason)

    def detached(self, view: JobView) -> None:
        pass


@pytest.fixture
def sim_home(spotnb_home: Path, tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("SPOTNB_AWS_CAPACITY_POLL", "0.5")
    yield tmp_path


def nothing_billed_left(timeout: float = 60.0) -> None:
    """No group, template or instance of any job (what bills, or would launch)."""
    asg, ec2 = _boto.client("autoscaling"), _boto.client("ec2")

    def clear() -> bool:
        running = [i for r in ec2.describe_instances(Filters=[{
            "Name": "instance-state-name", "Values": ["pending", "running"]}])["Reservations"]
            for i in r["Instances"]]
        return not (running or asg.describe_auto_scaling_groups()["AutoScalingGroups"]
                    or ec2.describe_launch_templates()["LaunchTemplates"])

    wait_until(clear, timeout, "the job's group, template and instances to be gone")


def nothing_left(simulator: AwsSimulator, timeout: float = 60.0) -> None:
    """`spotnb aws cleanup --dry-run` finds nothing (but what the fixture of the AWS
    tests allows), and IAM refused nothing spotnb asked, on the instance (its boot
    report) or off it."""
    try:
        aws_tests.assert_nothing_left(simulator, timeout)
    finally:
        aws_tests.assert_no_request_refused(simulator)


def site_packages(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_path('purelib'))"], capture_output=True, text=True,
                               check=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip())


@pytest.mark.slow  # over 30 s: spotnb and its dependencies installed on the instance
@pytest.mark.timeout(600)
def test_a_plain_image_boots_into_an_environment_of_its_own_and_a_reboot_brings_the_agent_back(
        sim_home: Path) -> None:
    # A plain Deep Learning AMI: its PyTorch environment (a virtual environment, with
    # torch) on a system Python as Ubuntu 23.04+ has it, which pip refuses.
    image = boot.plain_image()
    assert image.pytorch is not None
    refused = subprocess.run([str(image.python), "-m", "pip", "install", "--no-index",
                              "pathspec"], capture_output=True, text=True, check=False,
                             env=image.environment({}, sim_home / "probe"))
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr
    pytorch = image.pytorch / "bin" / "python"
    before = {p: sorted(q.name for q in site_packages(p).iterdir())
              for p in (image.python, pytorch)}
    flag = sim_home / "go"
    code = (f"import pathlib, sys, time\nwhile not pathlib.Path({str(flag)!r}).exists():\n"
            "    time.sleep(0.2)\nimport image_torch\nwhere = (sys.prefix, image_torch.__file__)")
    with AwsSimulator(sim_home / "sim", install=True) as sim:
        handle = spotnb.submit(code, provider="aws", instance_types=["g4dn.xlarge"],
                               outputs=["where"])
        wait_until(lambda: handle.status == "running", 300, "the job to run")
        (inst,) = sim.running(handle.job_id)
        venv = inst.dir / "venv"
        boot_log = (inst.dir / "bootstrap.log").read_text()
        assert f"from {site_packages(venv / 'bin' / 'python')}/spotnb/" in boot_log, boot_log
        # Nothing went into the image's Pythons.
        assert {p: sorted(q.name for q in site_packages(p).iterdir())
                for p in (image.python, pytorch)} == before
        assert (inst.dir / boot.UNITS / boot.WANTS / AGENT_UNIT).exists(), \
            "the agent is an enabled systemd unit"
        # A reboot: every process ends, the user data does not run again, the unit does.
        boot.reboot(inst)
        wait_until(lambda: any(e.attempt == 2 and isinstance(e.body, codec.Status)
                               and e.body.state == "running"
                               for e in handle.events(follow=False)),
                   300, "the job's second attempt to run after the reboot")
        assert not inst.terminated, "a reboot does not end the instance"
        assert (inst.dir / "bootstrap.log").read_text().count("first-boot of job") == 1
        flag.write_text("go")
        result = handle.wait(timeout=180)
        assert result.status == "completed", result
        # The cell ran in the boot's environment, and saw the image's torch.
        assert result.outputs["where"] == (
            str(venv), f"{site_packages(pytorch)}/image_torch/__init__.py")
        assert [a.instance_id for a in result.attempts] == [inst.id, inst.id]
        launches = [e for e in handle.events(follow=False)
                    if isinstance(e.body, codec.Status) and e.body.state == "launching"
                    and e.instance == inst.id]
        assert "started again" in launches[-1].body.detail
        nothing_left(sim)


@pytest.mark.slow  # over 30 s: three boots that fail
@pytest.mark.timeout(600)
def test_a_failing_boot_ends_its_instance_says_why_and_the_third_in_a_row_fails_the_job(
        sim_home: Path) -> None:
    # A custom image whose only Python, the system's, has no ensurepip (Ubuntu without
    # python3-venv), and whose "PyPI" lacks one of spotnb's dependencies (a mirror
    # without it): the environment is made without pip of its own, pip install fails.
    image = boot.plain_image(dlami=False, ensurepip=False).without("pathspec")
    with AwsSimulator(sim_home / "sim", install=image) as sim:
        handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
        # The notebook's display, followed to the end: what it shows on the way.
        display = Recorder()
        finished = follow(handle, display)
        assert isinstance(finished, Finished)
        result = finished.result
        assert result.status == "failed"
        assert any(state == "launching" and "failed to boot (1 of 3 in a row)" in detail
                   for state, detail in display.headers), "the header says it, not booting"
        assert [m for m in display.milestones if "failed to boot" in m], display.milestones
        assert display.final == ("failed", result.reason)
        assert f"failed {BOOT_FAILURE_LIMIT} times in a row" in result.reason
        assert "installing spotnb and its dependencies with pip" in result.reason
        assert "No matching distribution found for pathspec" in result.reason
        events = list(handle.events(follow=False))
        failed = [e for e in events if isinstance(e.body, codec.Instance)
                  and e.body.boot_failed]
        assert [e.body.failures for e in failed] == list(range(1, BOOT_FAILURE_LIMIT + 1))
        assert all(any("No matching distribution found for pathspec" in line
                       for line in e.body.log) for e in failed)
        instances = {e.body.instance_id for e in failed}
        assert len(instances) == BOOT_FAILURE_LIMIT, "each failed boot was a new instance"
        # Each instance ended itself: it powered off and EC2 terminated it.
        for iid in instances:
            wait_until(lambda iid=iid: sim.instances[iid].terminated, 60,
                       f"{iid} to be terminated")
        powered_off = [iid for iid in instances
                       if "powered off: EC2 terminated" in sim.instances[iid].log()]
        assert len(powered_off) >= BOOT_FAILURE_LIMIT - 1  # the last: its group's deletion
        # The environment was made on the image's Python without pip of its own.
        venv = sim.instances[failed[0].body.instance_id or ""].dir / "venv"
        assert (venv / "bin" / "python").exists() and not list(venv.glob("lib/*/site-packages/pip"))
        # What the user sees: the log's end in `spotnb logs`, a line in the display.
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli_main(["logs", handle.job_id]) == 0
        assert "boot-failed" in out.getvalue()
        assert "| ERROR: No matching distribution found for pathspec" in out.getvalue()
        lines = [milestone(e) for e in failed]
        assert all(line and "failed to boot" in line for line in lines), lines
        assert "Auto Scaling launches another instance" in str(lines[0])
        assert "the job fails" in str(lines[-1])
        # Each failed boot's whole log is in the store, beside the job.
        logs = [k for k in handle.store.list_keys(layout.BOOT) if k.endswith(".log")]
        assert len(logs) == BOOT_FAILURE_LIMIT
        assert json.loads(handle.store.get(layout.RESULT))["by"] == "aws-bootstrap"
        # Nothing bills or launches any more; `spotnb aws cleanup` removes the rest.
        nothing_billed_left()
        AwsProvider().cleanup()
        nothing_left(sim)


@pytest.mark.slow  # over 30 s: the AWS CLI installed on the image
@pytest.mark.timeout(600)
def test_without_a_route_to_pypi_the_aws_cli_reports_the_failure_and_ends_the_job(
        sim_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A private subnet without a NAT gateway: S3 answers, PyPI does not. An image with
    # the AWS CLI and no boto3 downloads the wheel and reports with the CLI. One
    # failed boot is the limit here (the count itself is held by the test above).
    monkeypatch.setattr(bootstrap, "BOOT_FAILURE_LIMIT", 1)
    image = boot.plain_image(dlami=False, aws_cli=True).offline()
    with AwsSimulator(sim_home / "sim", install=image) as sim:
        handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
        result = handle.wait(timeout=300)
        assert result.status == "failed"
        assert "installing spotnb and its dependencies with pip" in result.reason
        assert "No matching distribution found" in result.reason
        (inst,) = sim.instances.values()
        log = (inst.dir / "bootstrap.log").read_text()
        assert "reporting the failure to the job with AWS CLI" in log, log
        failed = [e for e in handle.events(follow=False)
                  if isinstance(e.body, codec.Instance) and e.body.boot_failed]
        assert len(failed) == 1 and failed[0].body.instance_id == inst.id
        assert handle.store.exists(layout.boot_log_key(inst.id))
        nothing_billed_left()
        AwsProvider().cleanup()
        nothing_left(sim)


def test_a_failed_boot_fails_the_job_only_once_no_instance_runs_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure report against moto, in this process: a standby's failed boots do not
    end the job its other instance runs (a live lease), up to WHILE_RUNNING times the
    limit; once no agent holds a lease, the limit fails the job and deletes its group."""
    import boto3
    from moto import mock_aws

    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    log = tmp_path / "bootstrap.log"
    log.write_text("spotnb-boot: first-boot of job j1\nERROR: No matching distribution found "
                   "for pathspec>=1.0\nspotnb-boot: step failed (exit 1): installing\n")
    with mock_aws():
        s3, ec2 = boto3.client("s3"), boto3.client("ec2")
        asg = boto3.client("autoscaling")
        s3.create_bucket(Bucket="bkt-jobs")
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        template = ec2.create_launch_template(LaunchTemplateName="spotnb-j1", LaunchTemplateData={
            "ImageId": image, "InstanceType": "g4dn.xlarge"})["LaunchTemplate"]
        asg.create_auto_scaling_group(
            AutoScalingGroupName="spotnb-j1", MinSize=0, MaxSize=1, DesiredCapacity=0,
            LaunchTemplate={"LaunchTemplateId": template["LaunchTemplateId"]},
            AvailabilityZones=["us-east-1a"])
        for earlier in ("i-1", "i-2"):
            s3.put_object(Bucket="bkt-jobs", Key=f"jobs/j1/boot/{earlier}.log", Body=b"...")
        lease = {"epoch": 1, "holder": "i-0", "heartbeat": time.time(), "ttl": 180.0,
                 "released": False}
        s3.put_object(Bucket="bkt-jobs", Key="jobs/j1/lease.json", Body=json.dumps(lease).encode())

        def report(instance: str) -> list[dict[str, Any]]:
            assert bootreport.main([
                "--job-uri", "s3://bkt-jobs/jobs/j1", "--job-id", "j1", "--instance", instance,
                "--instance-type", "g4dn.xlarge", "--region", "us-east-1",
                "--step", "installing spotnb", "--code", "1", "--limit", "3",
                "--log", str(log), "--group", "spotnb-j1", "--template", "spotnb-j1"]) == 0
            chunks = sorted(o["Key"] for o in s3.list_objects_v2(
                Bucket="bkt-jobs", Prefix="jobs/j1/events/000000/")["Contents"])
            body = s3.get_object(Bucket="bkt-jobs", Key=chunks[-1])["Body"].read().decode()
            return [json.loads(line) for line in body.splitlines()]

        def kept() -> bool:
            return bool(asg.describe_auto_scaling_groups()["AutoScalingGroups"]
                        and ec2.describe_launch_templates()["LaunchTemplates"])

        events = report("i-3")  # the third in a row, while i-0 runs the job
        assert [e["type"] for e in events] == ["instance"], "no status: the job runs"
        assert events[0]["data"]["failures"] == 3
        assert events[0]["data"]["limit"] == 3 * bootreport.WHILE_RUNNING
        assert "Contents" not in s3.list_objects_v2(Bucket="bkt-jobs", Prefix="jobs/j1/result.json")
        assert kept()
        # The job's instance let the lease go (an interruption): the next failure ends it.
        lease["released"] = True
        s3.put_object(Bucket="bkt-jobs", Key="jobs/j1/lease.json", Body=json.dumps(lease).encode())
        events = report("i-4")
        assert [e["type"] for e in events] == ["instance", "status", "result"]
        written = s3.get_object(Bucket="bkt-jobs", Key="jobs/j1/result.json")["Body"].read()
        result = json.loads(written)
        assert result["status"] == "failed" and "failed 4 times in a row" in result["reason"]
        assert "No matching distribution found for pathspec" in result["reason"]
        assert not asg.describe_auto_scaling_groups()["AutoScalingGroups"]
        assert not ec2.describe_launch_templates()["LaunchTemplates"]


def test_an_instance_agent_that_keeps_crashing_is_retried_then_ends_its_instance(
        sim_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An instance agent that cannot start (here: a log level it refuses) is started
    # again in place, AGENT_TRIES times, then the boot counts as failed.
    monkeypatch.setattr(bootstrap, "AGENT_RETRY_SECONDS", 0)
    monkeypatch.setattr(bootstrap, "BOOT_FAILURE_LIMIT", 1)
    monkeypatch.setenv("SPOTNB_LOG_LEVEL", "NOT-A-LEVEL")
    with AwsSimulator(sim_home / "sim") as sim:
        handle = spotnb.submit("x = 1", provider="aws", instance_types=["g4dn.xlarge"])
        result = handle.wait(timeout=120)
        assert result.status == "failed"
        assert (f"running the instance agent: it exited with 1, {bootstrap.AGENT_TRIES} "
                "times in a row") in result.reason, result.reason
        (inst,) = sim.instances.values()
        log = (inst.dir / "bootstrap.log").read_text()
        assert log.count("the instance agent exited with 1") == bootstrap.AGENT_TRIES
        assert "ValueError" in log, "the agent's own error is in the log"
        wait_until(lambda: inst.terminated, 60, "the instance to end")
        nothing_billed_left()
        AwsProvider().cleanup()
        nothing_left(sim)


def test_a_boot_failure_reads_in_the_log_and_the_display() -> None:
    event = Event(type="instance", time=1_700_000_000.0, attempt=0, instance="i-1", data={
        "action": "boot-failed", "instance_id": "i-1", "instance_type": "g5.xlarge",
        "az": "use1-az1", "reason": "checking the SHA-256 of spotnb.whl (exit 1)",
        "step": "checking the SHA-256 of spotnb.whl", "exit_code": 1,
        "log": ["spotnb-boot: first-boot", "sha256sum: WARNING: 1 computed checksum did NOT "
                "match", "spotnb-boot: step failed (exit 1)"], "failures": 1, "limit": 3})
    from spotnb.client.listing import format_event

    text = format_event(event)
    assert text is not None and "boot-failed" in text and "(1 of 3 failed boots in a row)" in text
    assert "\n    | sha256sum: WARNING: 1 computed checksum did NOT match" in text
    line = milestone(event)
    assert line is not None
    assert line.startswith("i-1 failed to boot (1 of 3 in a row): checking the SHA-256")
    assert "did NOT match" in line and "Auto Scaling launches another instance" in line
