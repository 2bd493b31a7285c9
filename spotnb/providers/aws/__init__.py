"""The AWS provider: one EC2 Auto Scaling group of spot instances per job.

Methods follow the contract in :mod:`spotnb.providers`. What a job gets (names and
documents in :mod:`.resources` and :mod:`.policies`, boto3 only through
:mod:`._boto`):

* a **launch template** that requires IMDSv2, opens no inbound port (a security group
  without ingress rules), runs the AWS Deep Learning AMI (from its public SSM
  parameter, overridable) with an **instance profile** whose role may touch only the
  job's store prefix, and whose user data only bootstraps: it installs the same spotnb
  the notebook runs (a wheel uploaded to ``<job prefix>/bootstrap/``) and starts
  :mod:`.instance`, the instance agent, which runs the job agent;
* an **Auto Scaling group** with min = max = desired = 1 and a ``MixedInstancesPolicy``
  over the job's instance types and the region's subnets, ``price-capacity-optimized``
  (which does not follow the order of the types; ``SPOTNB_AWS_SPOT_STRATEGY=
  capacity-optimized-prioritized`` takes it as a preference), 0% on-demand. The group,
  not spotnb, replaces an interrupted instance: recovery does not need the notebook.
* a **multi-node job** (``--nodes MIN:MAX``): the group keeps MAX instances, all in one
  AZ (chosen at validation, refused there when no AZ has capacity for MAX), in the
  job's cluster placement group, with EFA where every type has it, and in the job's
  own security group, which admits training traffic from the job's nodes only
  (:mod:`.cluster`). Each instance's job agent takes a node slot; the rendezvous
  endpoint is the host node's private IP (IMDS ``local-ipv4``), named in the store.

Launching, narrated (anything created before a failing step is deleted again)::

    Step 1  image (SSM), subnets of the default VPC in AZs that offer the types,
            the shared no-inbound security group; a multi-node job: its AZ (chosen at
            validation), then its placement group and security group (Step 1b)
    Step 2  upload the wheel to the job's prefix; the job's secrets to SSM Parameter
            Store (SecureString, /spotnb/<job-id>/<NAME>: :mod:`.parameters`)
    Step 3  IAM role (prefix-scoped policy) and instance profile
    Step 4  launch template
    Step 5  Auto Scaling group, with its lifecycle hooks (a standby group); retried
            while IAM propagates the new profile
    Step 6  tell the dashboard; watch the group's activities for capacity errors

Where the rest lives, since AWS has no spotnb supervisor process:

* **The end of a job** (completed, failed, stopped, budget, deadline; invariant 6): the
  instance agent deletes its own group, template and role once ``result.json`` exists;
  its role may delete exactly those (by ARN and tag). The role's last step, DeleteRole
  after its own policy is gone, IAM may refuse: the empty role is deleted by the next
  launch in the region or by :meth:`cleanup`. :meth:`AwsProvider.terminate`
  does the same from the notebook (``JobHandle.stop``), and :meth:`cleanup` finds
  whatever survived (a group whose job has a result, an orphan role; a multi-node
  job's security and placement groups, which AWS lets go only once its instances are
  gone: :mod:`.cluster`).
* **Budget and deadline** are checked by the instance agent of the running instance,
  every few seconds, from the job's event log (``spotnb.client.jobs.summarize``: each instance
  billed from its EC2 launch time at the spot prices the agents recorded). Over the
  limit, it writes ``control/stop.json``; the job agent stops the cell, and the group is
  deleted as for any result. While no instance runs nothing is billed, so nothing can
  go over.
* **Waiting for capacity**: EC2 Auto Scaling moves to other pools by itself. Its failed
  activities (``InsufficientInstanceCapacity`` ...) become ``capacity_error`` events:
  from the notebook while it is open (:mod:`.capacity`, which also applies the optional
  on-demand fallback, ``SPOTNB_AWS_ONDEMAND_AFTER``), and from the instance agent when
  an instance boots.
* **Interruptions on request** (``%spot_interrupt``, ``spotnb interrupt``) use the Fault
  Injection Service's ``aws:ec2:send-spot-instance-interruptions`` action against the
  job's instances, with a shared ``spotnb-fis`` role (:mod:`.fis`).

Regions (:mod:`.failover`): a job of several regions (``--region a,b``) keeps its
store, queues and secrets in its home (the first) and runs its group in one region at
a time, chosen at validation by expected cost with EC2's Spot placement scores; its
image (that region's own SSM parameter), template, security group and group are made
there, and its instances read and write the home bucket across regions (the S3 client
of the bucket's region: ``SPOTNB_STORE_REGION`` in their user data). Each call works
in the job's region when this provider launched the job, else in the session's region
(``AWS_DEFAULT_REGION`` or the profile's).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, EventWriter
from spotnb.protocol.secretstore import values_for
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import Store, StoreError, open_store
from spotnb.providers import PoolPrice, Provider, ProviderError, catalog
from spotnb.providers.aws import _boto, cluster, fis, mover, parameters
from spotnb.providers.aws.bootstrap import bundle
from spotnb.providers.aws.capacity import CapacityWatch, stop_capacity_watches, watching
from spotnb.providers.aws.launching import (  # noqa: F401 (their names here before)
    IAM_PROPAGATION_ATTEMPTS,
    LIFECYCLE_HOOK_SECONDS,
    LaunchSteps,
    lifecycle_hooks,
)
from spotnb.providers.aws.leftovers import (
    CleanupIncomplete,
    Leftovers,
    cleanup_failure,
    delete_role_named,
    ignore_missing,
    paginate,
)
from spotnb.providers.aws.resources import (
    BOOTSTRAP_PREFIX,
    TAG_JOB,
    group_name,
    role_name,
    s3_location,
    tags,
    template_name,
)
from spotnb.providers.aws.settings import AwsSettings, image_problem

if TYPE_CHECKING:
    from spotnb.providers.aws.failover import AwsRegionPlan

__all__ = ["AwsProvider", "AwsSettings", "CleanupIncomplete", "stop_capacity_watches"]

log = logging.getLogger(__name__)
#: Its old name here (before cleanup moved to :mod:`.leftovers`).
_cleanup_failure = cleanup_failure

#: What spotnb assumes an instance writes checkpoints to S3 at, before a job has
#: measured it (the submit-time check of spotnb.ckpt.notice): a conservative figure for
#: parallel multipart uploads from the smaller GPU instances, whose network is "up to"
#: 10-25 Gbps. After a job's first save the runtime judges by the measured rate.
ASSUMED_S3_UPLOAD_MBPS = 300.0


class AwsProvider(Leftovers, LaunchSteps, Provider):
    """spot instances on EC2 through Auto Scaling. See the module docstring."""

    name = "aws"

    def __init__(self, region: str | None = None, settings: AwsSettings | None = None) -> None:
        self.settings = settings or AwsSettings.from_env()
        self._region = region
        self._job_regions: dict[str, str] = {}  # where each job's group runs
        self._homes: dict[str, str] = {}  # each job's home (its store's region)
        self._plans: dict[str, Any] = {}  # failover.AwsRegionPlan, chosen at validation
        self._starts: dict[str, Any] = {}  # the region event of each plan's start
        self._clients: dict[tuple[str, str], Any] = {}
        self._watches: dict[str, CapacityWatch] = {}
        self._zones: dict[str, cluster.Zone] = {}  # multi-node jobs, chosen at validation
        self._lock = threading.Lock()
        #: the (regions, bucket) whose mover this provider deployed (mover.ensure)
        self._movers: set[tuple[tuple[str, ...], str]] = set()

    def __repr__(self) -> str:
        return f"AwsProvider(region={self._region!r})"

    # -- plumbing

    def region(self, job_id: str | None = None) -> str:
        """Where the job's group runs if this provider launched it, else the session's
        region."""
        if job_id is not None and job_id in self._job_regions:
            return self._job_regions[job_id]
        if self._region:
            return self._region
        return str(_boto.session().region_name or "us-east-1")

    def regions(self) -> list[str]:
        """Every region spotnb may have made something in, as far as this provider
        knows: the session's, the allowed ones (``$SPOTNB_ALLOWED_REGIONS``), and
        those of the jobs it launched (where they ran and their homes); what ``spotnb
        aws setup``/``doctor``/``cleanup`` cover."""
        from spotnb.providers.regions import allowed_regions

        try:
            allowed = allowed_regions()
        except SpecError as err:
            log.warning("%s: looking in the session's region only", err)
            allowed = ()
        return list(dict.fromkeys([self.region(), *allowed, *self._job_regions.values(),
                                   *self._homes.values()]))

    def client(self, service: str, region: str) -> Any:
        with self._lock:
            key = (service, region)
            if key not in self._clients:
                self._clients[key] = _boto.client(service, region)
            return self._clients[key]

    def upload_mbps(self, spec: JobSpec) -> float | None:
        return ASSUMED_S3_UPLOAD_MBPS

    def default_store(self, region: str) -> str:
        """``s3://spotnb-<account>-<region>``: where jobs go when no store is given."""
        from spotnb.providers.aws.bucket import default_bucket

        _boto.check_region(region)
        return f"s3://{default_bucket(_boto.account_id(region=region), region)}"

    # -- the contract

    def validate(self, spec: JobSpec) -> None:
        from spotnb.providers.aws.bucket import bucket_problem, default_bucket, ensure_bucket

        res = spec.resources
        region = _boto.check_region(res.region)
        for other in res.regions:
            _boto.check_region(other)
        if not res.instance_types:
            raise SpecError("no instance type given: name at least one, e.g. 'g5.xlarge'")
        if len(res.regions) == 1:
            for instance_type in res.instance_types:
                catalog.check_instance_type(instance_type, region)
        else:
            for instance_type in res.instance_types:
                catalog.check_type_name(instance_type)
        problem = image_problem(self.settings, res.instance_types)
        if problem is not None:
            raise SpecError(problem + ". Nothing was started.")
        if spec.simulate_interruptions:
            raise SpecError("simulate_interruptions works on the local cloud only; on AWS "
                            "use handle.interrupt() (Fault Injection Service)")
        if spec.simulate_signals is not None:
            raise SpecError("simulate_signals works on the local cloud only; on AWS, EC2 "
                            "sends the rebalance recommendations")
        run = self._choose_region(spec)
        if self.settings.ami:
            self._check_image(self.settings.ami, run)
        if res.max_nodes > 1 and spec.job_id not in self._zones:
            # One AZ with capacity for all the nodes, or a refusal now, before the bucket is
            # made (cluster.py).
            rows, _ = self._subnet_rows(run)
            self._zones[spec.job_id] = cluster.choose_zone(self.client("ec2", run), spec,
                                                           rows, region=run)
        bucket, _ = s3_location(spec.store_uri)
        account = _boto.account_id(region=region)
        s3 = self.client("s3", region)
        problem = bucket_problem(s3, bucket, account)
        if problem == "missing":
            if bucket != default_bucket(account, region):
                raise SpecError(f"there is no bucket {bucket}: create it, or leave the store "
                                "unset to use spotnb's default bucket. Nothing was started.")
            ensure_bucket(s3, bucket, region, account)
        elif problem is not None:
            raise SpecError(problem + " Nothing was started.")

    def _check_image(self, ami: str, region: str) -> None:
        """A SpecError before anything is made when the user's image (SPOTNB_AWS_AMI)
        does not exist in the region (its launches would fail, one after the other,
        until SPOTNB_AWS_LAUNCH_FAILURE). One DescribeImages; an answer that says
        nothing either way lets the launch go on."""
        try:
            found = self.client("ec2", region).describe_images(ImageIds=[ami])["Images"]
        except Exception as err:
            if "InvalidAMIID" not in _boto.error_code(err):
                log.info("could not look up image %s in %s: %s", ami, region, err)
                return
            found = []
        if not found:
            raise SpecError(f"SPOTNB_AWS_AMI={ami} does not exist in {region}: set it to an "
                            f"image of {region} (`spotnb aws doctor` checks it). Nothing "
                            "was started.")

    def launch(self, spec: JobSpec, secrets: Mapping[str, str] | None = None) -> None:
        self.validate(spec)
        home = spec.resources.region
        job_id = spec.job_id
        region = self._plans[job_id].region  # where the group runs (validate chose it)
        account = _boto.account_id(region=home)
        store = open_store(spec.store_uri)
        tag_list = tags(job_id, spec.store_uri, spec.name)
        undo: list[tuple[str, Callable[[], Any]]] = []
        try:
            # First the roles of ended jobs that IAM would not let their instances
            # delete (a role cannot delete itself reliably).
            self._sweep_roles(region)
            # Step 2: the wheel the instances install.
            wheel = bundle()
            key = f"{BOOTSTRAP_PREFIX}/{wheel.filename}"
            store.put(key, wheel.data)
            undo.append(("bootstrap wheel", lambda: store.delete(key)))
            # Step 2b: the job's secrets, SSM SecureString parameters under its path.
            if spec.secrets:
                ssm = self.client("ssm", home)
                undo.append(("secrets", lambda: parameters.delete(ssm, job_id, spec.secrets)))
                parameters.put(ssm, job_id, values_for(spec.secrets, secrets),
                               [t for t in tag_list if t["Key"] != "Name"])
            # Step 3: the job's role, limited to its prefix.
            profile_arn = self._create_role(spec, account, tag_list)
            # Step 3b: a job of several regions, the mover in each (its owner while no
            # notebook follows it: mover.py); a launch without one goes on.
            no_mover = None
            if len(spec.resources.regions) > 1:
                no_mover = mover.ensure(self, spec, account)
            undo.append(("IAM role", lambda: self._delete_role(job_id, region)))
            subnets, zone = self._make_capacity(spec, region, profile_arn, tag_list, undo)
        except BaseException:
            for label, release in reversed(undo):
                try:
                    release()
                except Exception:
                    log.exception("could not release the %s of job %s; `spotnb aws cleanup` "
                                  "will find it", label, job_id)
            raise
        # Step 6: the dashboard.
        self._job_regions[job_id] = region
        self._homes[job_id] = home
        azs = sorted({az for _, az in subnets})
        types = ", ".join(spec.resources.instance_types)
        detail = (f"Auto Scaling group {group_name(job_id)}: spot {types} in {', '.join(azs)} "
                  f"({self.settings.spot_strategy})")
        if zone is not None:
            detail = (f"Auto Scaling group {group_name(job_id)}: {spec.resources.max_nodes} "
                      f"spot nodes of {types} in {zone.az} ({zone.why}), in a cluster "
                      f"placement group, {'with' if zone.efa else 'without'} EFA")
        if region != home:
            detail += f"; its store stays in {home}"
        try:
            events = EventWriter(store, GROUP_STREAM)
            start = self._starts.pop(job_id, None)
            if start is not None:
                events.emit("region", **dataclasses.asdict(start))
            events.emit("status", state="launching", detail=detail)
            if no_mover is not None:
                events.emit("status", state="launching", detail=no_mover)
            events.close()
        except StoreError:
            log.warning("could not record the launch of job %s", job_id, exc_info=True)
        watch = CapacityWatch(self, spec, store)
        self._watches[job_id] = watch
        watch.start()
        log.info("launched job %s: group %s in %s", job_id, group_name(job_id), region)

    def _choose_region(self, spec: JobSpec) -> str:
        """Where the job's group runs (chosen once per job: :mod:`.failover`)."""
        from spotnb.providers.aws import failover

        plan = self._plans.get(spec.job_id)
        if plan is None:
            plan = self._plans[spec.job_id] = self.region_plan(spec)
            event = failover.start(plan)
            if event is not None:
                self._starts[spec.job_id] = event
        return str(plan.region)

    def region_plan(self, spec: JobSpec) -> AwsRegionPlan:
        """A new plan of where the job's group runs, ranking with EC2's placement
        scores (asked of the home region, at each ranking)."""
        from spotnb.providers.aws import failover

        ec2 = self.client("ec2", spec.resources.region)
        return failover.AwsRegionPlan(spec, lambda: failover.placement_scores(ec2, spec))

    def runs_in(self, job_id: str, region: str, home: str) -> None:
        """The job's group runs in ``region`` now, its store in ``home`` (as its log
        says: a job this provider did not launch, or one another owner moved)."""
        self._job_regions[job_id] = region
        self._homes[job_id] = home

    def ensure_supervised(self, job_id: str, spec: JobSpec | None = None,
                          store: Store | None = None) -> str | None:
        """See the contract. The group lives in AWS; what needs a live process is the
        capacity watch (:mod:`.capacity`: a job of several regions' moves, a launch that
        cannot work). A caller that follows the job (``spec`` and ``store`` given: an
        attached notebook, a wait) takes it over while no watch of this process follows
        the job; the watch learns the group's region from the job's log. Once per
        provider: a watch ends when it is no longer needed (a job of one region that
        launched), and a new one would read the whole log again."""
        if spec is None or store is None or job_id in self._watches or \
                watching(job_id) or store.exists(layout.RESULT):
            return None
        watch = CapacityWatch(self, spec, store)
        self._watches[job_id] = watch
        watch.start()
        if len(spec.resources.regions) > 1:
            return ("this notebook now watches the job's capacity (it moves the job to "
                    "another of its regions when its region has none)")
        return None

    def read_secrets(self, spec: JobSpec) -> dict[str, str]:
        """See the contract: one GetParameters per 10 secrets, with the instance
        role's credentials (which may read the job's path and nothing else)."""
        if not spec.secrets:
            return {}
        return parameters.read(self.client("ssm", spec.resources.region), spec.job_id,
                               spec.secrets)

    def interrupt(self, job_id: str, instance: str | None = None,
                  rebalance_lead: float = 0.0) -> None:
        """Send an interruption notice (FIS, :mod:`.fis`) to the job's running
        instances, or only to ``instance`` (one node of a multi-node job).
        ``rebalance_lead``: seconds (up to 780) by which EC2's rebalance recommendation
        comes before the notice; 0, both at once."""
        fis.duration(rebalance_lead)  # a bad lead is refused before any request
        region = self.region(job_id)
        account = _boto.account_id(region=region)
        running = self._instances(region, job_id, ("running",))
        if instance is not None:
            running = [i for i in running if i["InstanceId"] == instance]
        if not running:
            which = f"instance {instance}" if instance else "instance"
            raise ProviderError(f"job {job_id} has no running {which} to interrupt in "
                                f"{region} (it may be waiting for capacity)")
        arn = (f"arn:aws:ec2:{region}:{account}:instance/{instance}"
               if instance is not None else None)
        role_arn, created = self._fis_role(region, account)
        fis.send(self.client("fis", region), role_arn, created, job_id, arn, rebalance_lead)
        log.info("FIS sends an interruption notice to %s", instance or
                 [i["InstanceId"] for i in running])

    def terminate(self, job_id: str) -> None:
        """See the contract: the job's group, template, instances and network where it
        runs (a job this provider did not launch: in every region it knows, ``regions()``,
        as the job may have moved), its role, and its secrets and queues at home."""
        watch = self._watches.pop(job_id, None)
        if watch is not None:
            watch.stop()
        known = job_id in self._job_regions
        regions = [self.region(job_id)] if known else self.regions()
        for region in regions:
            self._delete_group(job_id, region)
            self._delete_template(job_id, region)
            leftovers = self._instances(region, job_id, ("pending", "running", "stopping",
                                                         "stopped"))
            if leftovers:
                ids = [i["InstanceId"] for i in leftovers]
                self.client("ec2", region).terminate_instances(InstanceIds=ids)
        self._delete_role(job_id, regions[0])
        home = self._homes.get(job_id, self.region())
        try:
            self._delete_secrets(job_id, home)
        except Exception as err:
            log.warning("could not delete job %s's secrets (%s); `spotnb aws cleanup` will",
                        job_id, err)
        try:
            self._delete_queues(job_id, home)
        except Exception as err:
            log.warning("could not delete job %s's queues (%s); `spotnb aws cleanup` will",
                        job_id, err)
        plan = self._plans.get(job_id)  # the regions a move may have left a network in
        for region in dict.fromkeys([*regions, *(plan.regions if plan is not None else ())]):
            self._delete_network(job_id, region)
        log.info("deleted job %s's capacity group, template, role and queues", job_id)

    def _delete_secrets(self, job_id: str, region: str,
                        names: tuple[str, ...] | None = None) -> None:
        """Delete the job's SSM parameters: those named (the instance's teardown, whose
        role may not list parameters), else every one under its path."""
        ssm = self.client("ssm", region)
        if names is None:
            names = tuple(parameters.leftovers(ssm, job_id).get(job_id, ()))
        if names:
            parameters.delete(ssm, job_id, names)

    def _delete_queues(self, job_id: str, region: str,
                       names: list[str] | None = None) -> None:
        """Delete the job's queues: those named (the instance's teardown, whose role
        may not list queues), else every ``spotnb-<job_id>-*`` queue."""
        sqs = self.client("sqs", region)
        if names is None:
            urls = sqs.list_queues(QueueNamePrefix=f"spotnb-{job_id}-").get("QueueUrls", [])
        else:
            urls = []
            for name in names:
                try:
                    urls.append(sqs.get_queue_url(QueueName=name)["QueueUrl"])
                except Exception as err:
                    if "NonExistentQueue" not in _boto.error_code(err) and \
                            _boto.error_code(err) != "QueueDoesNotExist":
                        raise
        for url in urls:
            ignore_missing(partial(sqs.delete_queue, QueueUrl=url))

    def instance_gone(self, job_id: str, instance_id: str) -> bool:
        """See the contract: one DescribeInstances (free, rate-limited), only when a
        replacement finds the lease held."""
        region = self.region(job_id)
        try:
            reply = self.client("ec2", region).describe_instances(InstanceIds=[instance_id])
        except Exception as err:
            if _boto.error_code(err) == "InvalidInstanceID.NotFound":
                return True
            log.info("cannot tell whether %s is gone: %s", instance_id, err)
            return False
        states = [inst.get("State", {}).get("Name") for r in reply.get("Reservations", [])
                  for inst in r.get("Instances", [])]
        return not states or all(s in ("shutting-down", "terminated") for s in states)

    def prices(self, instance_type: str, region: str) -> PoolPrice:
        from spotnb.providers.aws.prices import pool_price

        catalog.check_instance_type(instance_type, region)
        return pool_price(instance_type, region)

    # -- deleting

    def _delete_group(self, job_id: str, region: str) -> bool:
        asg = self.client("autoscaling", region)
        return ignore_missing(lambda: _boto.with_backoff(
            lambda: asg.delete_auto_scaling_group(AutoScalingGroupName=group_name(job_id),
                                                  ForceDelete=True),
            what="deleting the Auto Scaling group",
            retry_codes=frozenset({"ScalingActivityInProgress", "ResourceInUse"})))

    def _delete_template(self, job_id: str, region: str) -> bool:
        ec2 = self.client("ec2", region)
        found = ec2.describe_launch_templates(Filters=[
            {"Name": "launch-template-name", "Values": [template_name(job_id)]}])
        if not found.get("LaunchTemplates"):
            return False
        template_id = found["LaunchTemplates"][0]["LaunchTemplateId"]
        return ignore_missing(lambda: ec2.delete_launch_template(LaunchTemplateId=template_id))

    def _delete_role(self, job_id: str, region: str, own: bool = False) -> None:
        """Delete the job's role and instance profile. ``own``: with the role's own
        credentials (the instance's teardown). Its permission to delete the role is in
        the inline policy that DeleteRole requires deleted first, so IAM may refuse the
        DeleteRole once that deletion has propagated (IAM is eventually consistent; AWS
        promises no lag to rely on): the role is then left with no policy, granting
        nothing, and the next launch in the region (:meth:`_sweep_roles`) or
        ``spotnb aws cleanup`` deletes it with the user's credentials."""
        iam = self.client("iam", region)
        name = role_name(job_id)
        if not own:
            delete_role_named(iam, name)
            return
        try:
            delete_role_named(iam, name)
        except Exception as err:
            if _boto.classify(err) != "fatal" and _boto.error_code(err) not in (
                    "AccessDenied", "UnauthorizedOperation"):
                raise
            log.info("IAM refused to let role %s delete itself once its policy was gone "
                     "(%s): the next launch or `spotnb aws cleanup` deletes it", name,
                     _boto.error_code(err) or err)

    def _instances(self, region: str, job_id: str | None,
                   states: tuple[str, ...]) -> list[dict[str, Any]]:
        tag_filter = ({"Name": f"tag:{TAG_JOB}", "Values": [job_id]} if job_id
                      else {"Name": "tag-key", "Values": [TAG_JOB]})
        ec2 = self.client("ec2", region)
        found = []
        for reservation in paginate(ec2, "describe_instances", "Reservations", Filters=[
                tag_filter, {"Name": "instance-state-name", "Values": list(states)}]):
            found += reservation["Instances"]
        return found

    def _fis_role(self, region: str, account: str) -> tuple[str, bool]:
        """The shared FIS role's ARN, and whether it was created just now."""
        return fis.role(self.client("iam", region), region, account)
