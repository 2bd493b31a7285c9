"""The simulator's instances (a part of :class:`~spotnb.testing.AwsSimulator`): each
instance that moto reports running is booted from its real user data on a simulated
operating system (:mod:`spotnb.testing.boot`) with a metadata service of its own
(serving its instance profile's credentials), and shut down as EC2 shuts it down
(SIGTERM to its processes, SIGKILL after a grace, then its metadata service gone); a
test finds, waits for and crashes them here.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotnb.testing.boot import PlainImage, plain_image, power_on, preinstalled_environment
from spotnb.testing.server import DEFAULT_REGION, FAKE_CREDENTIALS

__all__ = ["InstancesPlay", "SimInstance"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SimInstance:
    """An instance the simulator booted: moto's record plus the local process."""

    id: str
    group: str | None
    job_id: str | None
    instance_type: str
    az: str
    az_id: str
    dir: Path
    imds: Any  # spotnb.providers.local.imds.ImdsServer
    proc: subprocess.Popen[bytes] | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    notice_at: float | None = None
    terminate_at: float | None = None
    #: a notice announced by a rebalance recommendation: (its wall time, notice period)
    pending_notice: tuple[float, float] | None = None
    #: its last rebalance recommendation
    rebalance_at: float | None = None
    terminated: bool = False
    #: when the clock saw EC2 end it (shutting-down or terminated), wall time
    ended: float | None = None
    #: the Auto Scaling group's placement group, when it names one (a multi-node job)
    placement_group: str | None = None
    #: the region it runs in (one of :attr:`AwsSimulator.regions`)
    region: str = DEFAULT_REGION
    #: ``local-ipv4`` in its metadata: a loopback address of its own (see _boot)
    address: str = "127.0.0.1"
    #: capacity rebalancing: the instance its group launched for it on a recommendation
    rebalanced_by: str | None = None
    #: ended through its group's termination hook: when the hook's wait runs out
    hook_until: float | None = None
    #: ended through TerminateInstanceInAutoScalingGroup (the hook's wait first)
    ending_in_group: bool = False
    #: when it booted (its launch hook's wait starts then)
    booted: float = dataclasses.field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        """What the instance printed: its console, bootstrap and agent logs."""
        parts = []
        for name in ("console.log", "bootstrap.log", "agent.log"):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')}")
        return "\n".join(parts)


class InstancesPlay:
    """Booting, killing and finding the simulator's instances (a part of it)."""

    workdir: Path
    iam: bool
    install: bool | PlainImage
    boot_seconds: float
    notice_seconds: float
    time_scale: float
    instances: dict[str, SimInstance]
    errors: list[str]
    _lock: threading.RLock
    _placed: dict[str, str | None]

    def _client(self, service: str, region: str | None = None) -> Any:
        raise NotImplementedError

    def _subnet(self, subnet: str) -> tuple[str, str]:
        raise NotImplementedError

    if TYPE_CHECKING:
        def _instance_role(self, region: str, inst: dict[str, Any]
                           ) -> tuple[str | None, dict[str, str] | None]:
            """Its instance profile's role and a session of it (:class:`PrincipalsPlay`)."""

    def crash(self, instance_id: str) -> None:
        """Kill the instance's processes outright (a kernel panic, a failed host): EC2
        still reports the instance as running, and nothing of spotnb on it can react."""
        self._kill(self.instances[instance_id], grace=0)

    def running(self, job_id: str | None = None) -> list[SimInstance]:
        """Booted instances not terminated yet (of one job), oldest first."""
        with self._lock:
            return [i for i in self.instances.values() if not i.terminated
                    and (job_id is None or i.job_id == job_id)]

    def wait_for_instance(self, job_id: str, timeout: float = 60.0,
                          exclude: tuple[str, ...] = ()) -> SimInstance:
        """The job's first running instance not in ``exclude`` (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [i for i in self.running(job_id) if i.id not in exclude
                     and i.terminate_at is None]
            if found:
                return found[0]
            time.sleep(0.1)
        raise TimeoutError(f"no instance of job {job_id} booted within {timeout}s; "
                           f"errors: {self.errors}")

    def wait_until_idle(self, timeout: float = 30.0) -> None:
        """Until no instance process of the simulator runs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                busy = [i.id for i in self.instances.values() if i.alive]
            if not busy:
                return
            time.sleep(0.1)
        raise TimeoutError(f"instances still running after {timeout}s: {busy}")

    def _boot(self, region: str, inst: dict[str, Any]) -> None:
        from spotnb.providers.aws.resources import TAG_JOB
        from spotnb.providers.local.imds import InstanceIdentity
        from spotnb.testing.iam import instance_metadata

        instance_id = inst["InstanceId"]
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", ())}
        az = inst["Placement"]["AvailabilityZone"]
        az_id = self._subnet(inst.get("SubnetId", ""))[1] or az
        launched = inst["LaunchTime"].timestamp() if inst.get("LaunchTime") else time.time()
        if time.time() < launched + self.boot_seconds:
            return
        # Every instance runs on this machine: its private IP in moto (10.x, 172.31.x)
        # becomes a loopback address of its own (127.x.y.z), so that a node's rendezvous
        # endpoint names *its* instance, as on EC2.
        private = str(inst.get("PrivateIpAddress") or "")
        address = "127." + ".".join(private.split(".")[1:]) if private.count(".") == 3 \
            else "127.0.0.1"
        identity = InstanceIdentity(
            instance_id=instance_id, instance_type=inst["InstanceType"], region=region,
            az=az, az_id=az_id, ami_id=inst.get("ImageId", ""), launched=launched,
            address=address)
        home = self.workdir / "instances" / instance_id
        home.mkdir(parents=True, exist_ok=True)
        with self._lock:
            placement = self._placed.get(instance_id)
        role, credentials = self._instance_role(region, inst) if self.iam else (None, None)
        record = SimInstance(id=instance_id, group=tags.get("aws:autoscaling:groupName"),
                             job_id=tags.get(TAG_JOB), instance_type=inst["InstanceType"],
                             az=az, az_id=az_id, dir=home,
                             imds=instance_metadata(identity, role, credentials).start(),
                             placement_group=placement, address=address, region=region)
        with self._lock:
            self.instances[instance_id] = record
        encoded = self._client("ec2", region).describe_instance_attribute(
            InstanceId=instance_id, Attribute="userData").get("UserData", {}).get("Value")
        if not encoded:
            log.info("instance %s has no user data: nothing to run", instance_id)
            return
        script = home / "user-data"
        script.write_bytes(base64.b64decode(encoded))
        # No region in an instance's environment (EC2 sets none: spotnb's agents take
        # theirs from the metadata service), not the notebook's session's.
        env = {k: v for k, v in os.environ.items()
               if k not in ("AWS_DEFAULT_REGION", "AWS_REGION")}
        env = {**env, "SPOTNB_IMDS_ENDPOINT": record.imds.endpoint,
               # The termination hook's wait, scaled as the notice period is.
               "SPOTNB_TERMINATION_HOOK_SECONDS": str(self.notice_seconds),
               # Its age in market time (spotnb.protocol.billing).
               "SPOTNB_TIME_SCALE": str(self.time_scale),
               "SPOTNB_INSTANCE_DIR": str(home), "SPOTNB_SIM_INSTANCE_ID": instance_id}
        if self.iam:
            # Its credentials are its instance profile's, from its metadata service (as
            # on EC2), not the notebook's keys.
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                         "AWS_EC2_METADATA_DISABLED"):
                env.pop(name, None)
            env.update(AWS_EC2_METADATA_SERVICE_ENDPOINT=record.imds.endpoint,
                       # botocore's 1 s default is for EC2's local link; this machine is
                       # shared and busy.
                       AWS_METADATA_SERVICE_TIMEOUT="5", AWS_METADATA_SERVICE_NUM_ATTEMPTS="3")
        if self.install:  # a plain image: the boot installs spotnb (spotnb.testing.boot)
            image = self.install if isinstance(self.install, PlainImage) else plain_image()
            env = image.environment(env, home)
        else:  # an image with spotnb preinstalled
            env = {**preinstalled_environment(env), "SPOTNB_PYTHON": sys.executable}
        # EC2's part at a power-off (terminating the instance) is the administrator's.
        record.proc = power_on(home, script, env, instance_id=instance_id,
                               region=region, ec2_credentials=FAKE_CREDENTIALS)
        log.info("booted %s (%s in %s, %s) as pid %d", instance_id, inst["InstanceType"],
                 az_id, region, record.proc.pid)

    def _kill(self, inst: SimInstance, grace: float) -> None:
        """EC2's shutdown: SIGTERM to every process of the instance, SIGKILL after
        ``grace``; then the metadata service goes away."""
        import psutil

        with inst.lock:  # the clock's killer thread and stop() may meet here
            self._kill_locked(inst, grace, psutil)

    def _kill_locked(self, inst: SimInstance, grace: float, psutil: Any) -> None:
        proc = inst.proc
        if proc is not None and proc.poll() is None:
            try:
                root = psutil.Process(proc.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                family = []
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for p in family:
                    with contextlib.suppress(psutil.Error):
                        p.send_signal(sig)
                _, family = psutil.wait_procs(family, timeout=grace if sig == signal.SIGTERM
                                              else 5.0)
                if not family:
                    break
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        inst.imds.stop()
