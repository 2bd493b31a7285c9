"""The simulator: EC2 Auto Scaling's fulfilment, booting, interruptions, FIS.

See :mod:`spotnb.testing`. :class:`AwsSimulator` starts moto and makes up for its gaps,
takes capacity away when a test asks, and runs the world's clock; its parts play the
rest (:mod:`.autoscaling`, :mod:`.ec2`, :mod:`.principals`, :mod:`.instances`,
:mod:`.interruptions`, :mod:`.fis`, :mod:`.events` with :mod:`.lambdas`)."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spotnb.protocol.signals import SignalModel
from spotnb.testing import contract
from spotnb.testing.autoscaling import AutoScalingPlay
from spotnb.testing.boot import PlainImage
from spotnb.testing.ec2 import Ec2Play
from spotnb.testing.events import EventsPlay
from spotnb.testing.instances import InstancesPlay, SimInstance
from spotnb.testing.interruptions import InterruptionsPlay
from spotnb.testing.principals import PrincipalsPlay
from spotnb.testing.server import (
    DEFAULT_ACCOUNT,
    DEFAULT_REGION,
    FAKE_CREDENTIALS,
    MotoServer,
    aws_environment,
)

__all__ = ["AwsSimulator"]

log = logging.getLogger(__name__)


#: EC2's notice period (two minutes) and FIS's ``PT2M`` map to this many real seconds.
DEFAULT_NOTICE_SECONDS = 2.0
TICK_SECONDS = 0.2
# EC2 shuts the OS down before power-off; the simulator's agents get this long.
KILL_GRACE_SECONDS = 3.0
DLAMI_IMAGE_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch (simulated)"
#: The origins of spotnb's own requests (``spotnb-origin/<name>`` in the User-Agent):
#: everything but the simulator's and a test's own clients.
SPOTNB_ORIGINS = ("job-agent", "instance-agent", "runtime", "notebook", "cli", "mover")


class AwsSimulator(EventsPlay, AutoScalingPlay, Ec2Play, PrincipalsPlay, InstancesPlay,
                   InterruptionsPlay):
    """A fake AWS on loopback in which spotnb's instances really run. See the module
    docstring; use as a context manager."""

    _active: AwsSimulator | None = None

    def __init__(self, workdir: str | os.PathLike[str] | None = None, *,
                 region: str = DEFAULT_REGION, regions: Sequence[str] = (),
                 notice_seconds: float = DEFAULT_NOTICE_SECONDS,
                 boot_seconds: float = 0.0, kill_grace: float = KILL_GRACE_SECONDS,
                 install: bool | PlainImage = False, signals: SignalModel | None = None,
                 time_scale: float | None = None, iam: bool = True) -> None:
        #: Every region the simulator plays EC2 and Auto Scaling in, each with its own
        #: subnets, image, capacity and groups (moto serves them all); ``regions`` when
        #: given, else ``region`` alone. The first is the session's (``AWS_DEFAULT_REGION``).
        self.regions: tuple[str, ...] = tuple(dict.fromkeys(regions or (region,)))
        self.region = self.regions[0]
        #: the Deep Learning AMI each region's public parameter names (each its own)
        self.images: dict[str, str] = {}
        #: IAM enforced per principal (:mod:`spotnb.testing.iam`): spotnb runs as a user
        #: with the policy it prints, each instance as its instance profile's role.
        self.iam = iam
        self.user_credentials: dict[str, str] = {}
        #: IAM actions a test expects spotnb to be refused (a check that degrades).
        self.expected_denials: set[str] = set()
        self._admin: Any = None
        #: Market seconds a real second, as the instances count their age (their first
        #: hour, which an interruption refunds): by default as the notice period is
        #: compressed (120 s in ``notice_seconds``); a test may compress the hour more.
        self.time_scale = time_scale if time_scale is not None else 120.0 / notice_seconds
        #: what :meth:`drawn_lead` draws from (EC2's signals as the local cloud plays them)
        self.signals = signals or SignalModel()
        self._signal_rng = random.Random(self.signals.seed)
        #: every signal sent, in order: (wall time, instance id, "rebalance" or "notice")
        self.signals_sent: list[tuple[float, str, str]] = []
        self.notice_seconds = notice_seconds
        self.boot_seconds = boot_seconds
        self.kill_grace = kill_grace
        self.install = install
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="spotnb-sim-"))
        self.server = MotoServer()
        self.instances: dict[str, SimInstance] = {}
        #: each group's scaling activities, by (region, group name)
        self.activities: dict[tuple[str, str], list[dict[str, Any]]] = {}
        #: EC2 placement groups (moto has none), per region: name -> {"GroupName", ...}
        self.placement_groups_in: dict[str, dict[str, dict[str, Any]]] = {
            name: {} for name in self.regions}
        #: pools without spot capacity (:meth:`no_capacity`): pool -> until (wall time)
        self._no_capacity: dict[str, float] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._undo: list[Callable[[], None]] = []
        self._env: contextlib.ExitStack | None = None
        self._ec2: Any = None
        self._asg: Any = None
        self._clients: dict[tuple[str, str], Any] = {}
        self._subnet_az: dict[str, tuple[str, str, str]] = {}
        self._retry_at: dict[tuple[str, str], float] = {}
        self._placed: dict[str, str | None] = {}  # instance id -> its placement group
        self._attaching: set[str] = set()  # instances its groups' launches attach now
        self._launch_waits: dict[str, tuple[str, str, float, str]] = {}
        #: draws the pools' order where capacity decides (``capacity-optimized``)
        self._allocation_rng = random.Random(self.signals.seed)
        self._killers: list[threading.Thread] = []
        #: (instance id, hook name) of each CompleteLifecycleAction, in order
        self.hooks_completed: list[tuple[str, str]] = []
        self.errors: list[str] = []

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> AwsSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> AwsSimulator:
        """Start moto, point boto3 at it, and start playing EC2 and Auto Scaling."""
        if AwsSimulator._active is not None:
            raise RuntimeError("an AwsSimulator is already running in this process; stop it "
                               "first (moto's state is per process)")
        AwsSimulator._active = self
        try:
            self.server.start()
            self._undo.append(self.server.stop)
            self._env = contextlib.ExitStack()
            self._env.enter_context(aws_environment(self.server.endpoint, self.region))
            self._undo.append(self._env.close)
            self.server.reset()
            self._admin = self._admin_session()
            self._patch_moto()
            self._publish_dlami()
            self._install_fis()
            self._install_events()
            if self.iam:
                self._enforce_iam()
            for name in self.regions:
                # Capacity errors are injected into the fulfilment's own RunInstances.
                self._client("ec2", name).meta.events.register(
                    "before-parameter-build.ec2.RunInstances", self.capacity_hook)
            self._ec2 = self._client("ec2")
            self._asg = self._client("autoscaling")
            self._thread = threading.Thread(target=self._run, name="spotnb-aws-sim",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every instance process, restore moto and the environment."""
        from spotnb.providers.aws import stop_capacity_watches

        try:
            self._stop.set()
            stop_capacity_watches()
            if self._thread is not None:
                self._thread.join(timeout=10)
                self._thread = None
            with self._lock:
                instances = list(self.instances.values())
            for inst in instances:
                self._kill(inst, grace=0.5)
            for killer in self._killers:
                killer.join(timeout=10)
        finally:
            while self._undo:
                try:
                    self._undo.pop()()
                except Exception:
                    log.exception("restoring after the simulator failed")
            if AwsSimulator._active is self:
                AwsSimulator._active = None
            if self._own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def check_requests(self, models: contract.ModelSet | None = None, *,
                       origins: tuple[str, ...] = SPOTNB_ORIGINS) -> list[contract.Violation]:
        """Every request spotnb sent (from ``origins``) that botocore's models refuse:
        :func:`spotnb.testing.contract.check` against ``models`` (the running botocore's
        by default; an older botocore's: ``ModelSet(name, its data folder)``)."""
        calls = [c for c in self.server.requests.calls() if c.origin in origins]
        return contract.check(calls, models or contract.ModelSet.installed())

    # ---------------------------------------------------------------- capacity

    def no_capacity(self, *pools: str, seconds: float | None = None) -> None:
        """Make spot launches in these pools fail with ``InsufficientInstanceCapacity``:
        ``"g5.xlarge"`` (every AZ of every region), ``"g5.xlarge@use1-az1"`` (one AZ
        id), ``"g5.xlarge@us-west-2"`` (one region), or ``"us-west-2"`` (every type in
        that region); for ``seconds`` (then capacity returns by itself), else until
        :meth:`restore_capacity`. On-demand launches still succeed, as during a real
        spot shortage; spot placement scores say 1 where no requested type has any."""
        until = float("inf") if seconds is None else time.time() + seconds
        with self._lock:
            self._no_capacity.update(dict.fromkeys(pools, until))

    def short(self, instance_type: str, region: str, az_id: str) -> bool:
        """Whether the pool (``instance_type`` in ``az_id`` of ``region``) has no spot
        capacity now (:meth:`no_capacity`)."""
        now = time.time()
        keys = (instance_type, f"{instance_type}@{az_id}", f"{instance_type}@{region}",
                region)
        with self._lock:
            return any(self._no_capacity.get(key, 0.0) > now for key in keys)

    def restore_capacity(self, *pools: str) -> None:
        """Undo :meth:`no_capacity` for ``pools`` (all of them when none is named)."""
        with self._lock:
            if pools:
                for pool in pools:
                    self._no_capacity.pop(pool, None)
            else:
                self._no_capacity.clear()

    # --------------------------------------------------- moto's gaps (see above)

    def _patch_moto(self) -> None:
        self._patch_autoscaling()
        self._patch_ec2()
        self._patch_iam()

    def _patch_iam(self) -> None:
        """RemoveRoleFromInstanceProfile of a role the profile no longer holds: IAM
        answers ``NoSuchEntity`` (404), moto a 500 (``list.remove``), which made an
        instance's teardown and a cleanup that both remove the job's role fail where
        AWS lets the second go on to delete it."""
        from moto.iam.exceptions import NotFoundException
        from moto.iam.models import IAMBackend

        original = IAMBackend.remove_role_from_instance_profile

        def remove_role_from_instance_profile(backend: Any, profile_name: str,
                                              role_name: str) -> None:
            profile = backend.get_instance_profile(profile_name)
            role = backend.get_role(role_name)
            if role not in profile.roles:
                raise NotFoundException(
                    f"Role {role_name} in Instance Profile {profile_name} cannot be found.")
            original(backend, profile_name, role_name)

        patched: Any = remove_role_from_instance_profile
        IAMBackend.remove_role_from_instance_profile = patched  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(IAMBackend, "remove_role_from_instance_profile",
                                          original))

    def _publish_dlami(self) -> None:
        """Put the Deep Learning AMI's public parameter into moto in each region (AWS
        publishes it per region, naming that region's own image)."""
        from moto.ssm.models import Parameter, ssm_backends

        from spotnb.providers.aws.resources import DLAMI_NAME, DLAMI_PARAMETER

        for region in self.regions:
            # An image named as AWS names the Deep Learning AMI (moto's own are not).
            image = self._client("ec2", region).register_image(
                Name=f"{DLAMI_NAME} 20260815", Architecture="x86_64",
                RootDeviceName="/dev/sda1", Description=DLAMI_IMAGE_NAME)["ImageId"]
            self.images[region] = image
            backend = ssm_backends[DEFAULT_ACCOUNT][region]
            backend._parameters[DLAMI_PARAMETER].append(Parameter(  # type: ignore[abstract]
                account_id=DEFAULT_ACCOUNT, name=DLAMI_PARAMETER, value=image,
                parameter_type="String", description=DLAMI_IMAGE_NAME, allowed_pattern=None,
                keyid=None, last_modified_date=datetime.datetime.now(), version=1,
                data_type="aws:ec2:image"))

    def _install_fis(self) -> None:
        from spotnb.testing.fis import FisPlay

        def interrupt(instance_id: str, seconds: float, lead: float) -> None:
            # FIS's seconds, scaled as the notice period is now (a test may change it).
            scale = self.notice_seconds / 120.0
            if instance_id in self.instances:
                self.interrupt(instance_id, seconds * scale, lead=lead * scale)

        #: FIS as the simulator plays it (:mod:`spotnb.testing.fis`)
        self.fis = FisPlay(interrupt, authorize=self._role_may,
                           rng=random.Random(self.signals.seed))
        self._undo.append(self.fis.install())

    @property
    def placement_groups(self) -> dict[str, dict[str, Any]]:
        """The placement groups of the first region (:attr:`placement_groups_in` has
        every region's)."""
        return self.placement_groups_in[self.region]

    def _placement_groups(self, region: str) -> dict[str, dict[str, Any]]:
        return self.placement_groups_in.setdefault(region, {})

    def _client(self, service: str, region: str | None = None) -> Any:
        """A client with the administrator's key (the simulator's own requests), in
        ``region`` (the first of :attr:`regions` by default)."""
        from spotnb.providers.aws import _boto

        key = (service, region or self.region)
        with self._lock:
            if key not in self._clients:
                self._clients[key] = _boto.client(service, key[1], sess=self._admin,
                                                  attempts=3, origin="simulator")
            return self._clients[key]

    def admin_client(self, service: str, region: str | None = None) -> Any:
        """A client with the account administrator's key, for a test to look around or
        set things up (spotnb's own clients use the user's key, with IAM enforced). Its
        requests' origin is ``test``: AWS's other rules apply to them."""
        from spotnb.providers.aws import _boto

        return _boto.client(service, region or self.region, sess=self._admin, attempts=3,
                            origin="test")

    def _admin_session(self) -> Any:
        from spotnb.providers.aws import _boto

        with _boto._SESSION_LOCK:
            return _boto.boto3_module().session.Session(
                aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                region_name=self.region)

    # ------------------------------------------------------- the world's clock

    def _run(self) -> None:
        while not self._stop.wait(TICK_SECONDS):
            try:
                self._tick()
            except Exception as err:
                if self._stop.is_set():
                    return
                log.exception("simulator tick failed")
                self.errors.append(f"{type(err).__name__}: {err}")

    def _tick(self) -> None:
        for region in self.regions:
            self._tick_region(region, time.time())

    def _tick_region(self, region: str, now: float) -> None:
        """One turn of the clock in ``region``: its notices, terminations, groups and
        boots."""
        # Notices a rebalance recommendation announced.
        with self._lock:
            for inst in self.instances.values():
                if inst.pending_notice is not None and inst.pending_notice[0] <= now \
                        and not inst.terminated and inst.region == region:
                    self._notice(inst, now, inst.pending_notice[1])
        # Interruptions whose notice period is over.
        with self._lock:
            due = [i for i in self.instances.values() if i.region == region and
                   i.terminate_at is not None and i.terminate_at <= now and not i.terminated]
        ec2 = self._client("ec2", region)
        if due:
            ec2.terminate_instances(InstanceIds=[i.id for i in due])
        # Auto Scaling: instances its termination hook ends, capacity rebalancing
        # (groups that have it on), then fill every spotnb group up to its desired
        # capacity.
        self._expire_launch_waits(region, now)
        asg = self._client("autoscaling", region)
        for group in asg.describe_auto_scaling_groups()["AutoScalingGroups"]:
            if self._end_through_hook(region, group, now):
                continue  # the description is stale: the next tick fills the group
            if group.get("CapacityRebalance") and self._rebalance(region, group, now):
                continue
            self._fulfil(region, group, now)
        # EC2: boot new instances, shut down terminated ones.
        states = self._instance_states(region)
        new = [i for i, state in states.items()
               if state in ("pending", "running") and i not in self.instances]
        if new:
            for reservation in ec2.describe_instances(InstanceIds=new)["Reservations"]:
                for inst in reservation["Instances"]:
                    if inst["State"]["Name"] in ("pending", "running"):  # not ended since
                        self._boot(region, inst)
        for instance_id, state in states.items():
            known = self.instances.get(instance_id)
            if state in ("shutting-down", "terminated") and known is not None \
                    and not known.terminated:
                known.terminated, known.ended = True, time.time()
                killer = threading.Thread(target=self._kill, args=(known, self.kill_grace),
                                          daemon=True)
                self._killers.append(killer)
                killer.start()

    def _instance_states(self, region: str) -> dict[str, str]:
        """Every instance of ``region`` and its state, read from moto's EC2 backend
        in this process: the clock asks five times a second, and a DescribeInstances
        of every instance the region ever had, made into XML by moto and parsed back
        by botocore, costs ~3 ms of CPU with none and more with each. What an instance
        boots with is still asked of EC2 (:meth:`_tick_region`)."""
        from moto.ec2.models import ec2_backends

        backend = ec2_backends[DEFAULT_ACCOUNT][region]
        return {inst.id: inst.state for reservation in backend.all_reservations()
                for inst in reservation.instances}

    def _subnet(self, subnet: str) -> tuple[str, str]:
        """The AZ name and id of ``subnet`` (of any region)."""
        return self._subnet_place(subnet)[:2]

    def _subnet_place(self, subnet: str) -> tuple[str, str, str]:
        """The AZ name, AZ id and region of ``subnet`` (subnet ids are unique)."""
        if subnet not in self._subnet_az:
            for region in self.regions:
                for row in self._client("ec2", region).describe_subnets()["Subnets"]:
                    self._subnet_az[row["SubnetId"]] = (
                        row["AvailabilityZone"], row.get("AvailabilityZoneId", ""), region)
        return self._subnet_az.get(subnet, (self.region + "a", "", self.region))

    def capacity_hook(self, params: dict[str, Any], **kwargs: Any) -> None:
        """``before-parameter-build.ec2.RunInstances``: refuse launches in pools without
        capacity, as EC2 does (an ``InsufficientInstanceCapacity`` ClientError)."""
        from botocore.exceptions import ClientError

        if not params.get("InstanceMarketOptions"):
            return  # on-demand
        instance_type = str(params.get("InstanceType", ""))
        az, az_id, region = self._subnet_place(str(params.get("SubnetId", "")))
        if self.short(instance_type, region, az_id):
            raise ClientError({
                "Error": {"Code": "InsufficientInstanceCapacity", "Message": (
                    f"We currently do not have sufficient {instance_type} capacity in the "
                    f"Availability Zone you requested ({az}). Our system will be working on "
                    "provisioning additional capacity.")},
                "ResponseMetadata": {"HTTPStatusCode": 500}}, "RunInstances")
