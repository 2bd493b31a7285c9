"""A fake AWS for trying spotnb's AWS provider with no account: moto plus real agents.

:class:`AwsSimulator` is what the tests use, and users can use it too::

    from spotnb.testing import AwsSimulator

    with AwsSimulator() as sim:                 # moto on 127.0.0.1, boto3 pointed at it
        handle = spotnb.submit(code, provider="aws", instance_types=["g5.xlarge"])
        sim.wait_for_instance(handle.job_id)
        sim.interrupt(sim.running(handle.job_id)[0].id)   # notice, then termination
        handle.wait()

Its rule: **never more lenient than AWS where spotnb depends on it**. Where AWS refuses
a call, a state or a limit, the simulator refuses it too; what it does not model is
listed at the end. The parts:

* moto in server mode (``moto.server.ThreadedMotoServer``) on loopback, on a free port,
  with boto3 pointed at it through ``AWS_ENDPOINT_URL`` (restored on exit); in one
  region or several (``AwsSimulator(regions=("us-east-1", "us-west-2"))``, the first
  the session's): moto serves every region, and the simulator plays EC2 and Auto
  Scaling in each (its subnets, its own Deep Learning AMI behind its own parameter,
  its groups, placement groups, scaling activities and capacity); an instance's
  metadata names its region, and its environment has no region of the notebook's;
* **IAM per principal** (:mod:`spotnb.testing.iam`, on by default): spotnb runs as an
  IAM user holding exactly the policy it prints for users (``spotnb aws setup
  --dry-run``), each instance as its instance profile's role, whose credentials its
  metadata service serves as EC2's does (not the notebook's keys); each request is
  evaluated against the principal's identity policies (actions, resource ARNs,
  conditions), and a missing permission is refused as AWS refuses it
  (:attr:`AwsSimulator.denied`). The simulator and a test looking around use the
  administrator's key (:meth:`AwsSimulator.admin_client`);
* **request shapes** (:mod:`spotnb.testing.contract`): every request is parsed back into
  its operation's parameters and can be checked against botocore's service models,
  the running botocore's or an older one's (:meth:`AwsSimulator.check_requests`);
* **EC2 Auto Scaling** for spotnb's groups (:mod:`spotnb.testing.autoscaling`), which
  moto does not play: each missing instance is launched with ``ec2:RunInstances`` in
  the order of the group's allocation strategy (by price under
  ``price-capacity-optimized``, never the types' order, which only the prioritized
  strategies honour); a pool without capacity (:meth:`AwsSimulator.no_capacity`) is a
  failed scaling activity, as ``DescribeScalingActivities`` shows it on AWS. Lifecycle
  hooks hold instances in ``Pending:Wait`` / ``Terminating:Wait``, and the calls AWS
  refuses there (``SetInstanceProtection``, ``DetachInstances``, a second
  ``CompleteLifecycleAction``, ``TerminateInstanceInAutoScalingGroup`` in
  ``Pending:Wait``) are refused;
* **boots** every running instance that moto reports (replacements included): it runs
  the instance's real user data with ``bash`` on a simulated operating system
  (:mod:`spotnb.testing.boot`: cloud-init, systemd units, reboots, a power-off that
  EC2 turns into the instance's termination or stop, as the
  ``InstanceInitiatedShutdownBehavior`` of its launch template says), with the
  instance's own IMDSv2 endpoint in ``SPOTNB_IMDS_ENDPOINT`` (serving its instance
  profile's credentials);
* delivers **spot interruptions**: the notice appears in the instance's metadata, and
  after the notice period the instance is terminated in moto (SIGTERM to its processes,
  then SIGKILL after a grace), or earlier when a test says so
  (:meth:`AwsSimulator.take_back`: a test gives a notice period it cannot outlast and
  ends it once what it waits for happened, instead of racing it); the **rebalance
  recommendation** comes with it, or some time before it, or not at all
  (:meth:`AwsSimulator.interrupt`'s ``lead``, which :meth:`AwsSimulator.drawn_lead`
  draws as the local cloud does), or alone, a false alarm
  (:meth:`AwsSimulator.recommend_rebalance`);
* plays the **Fault Injection Service** inside moto's FIS (:mod:`spotnb.testing.fis`):
  a target lists at most 5 resource ARNs or selects instances by ``resourceTags`` and
  the ``State.Name`` filter, the template's role must exist and trust
  ``fis.amazonaws.com``, and ``aws:ec2:send-spot-instance-interruptions`` interrupts
  only what that role's policy allows: the rebalance recommendation when the
  experiment starts, the notice two minutes before the end of
  ``durationBeforeInterruption``;
* **EventBridge and Lambda** (:mod:`spotnb.testing.events`, :mod:`spotnb.testing.lambdas`):
  a failed launch activity of a group is Auto Scaling's "EC2 Instance Launch
  Unsuccessful" event; the enabled rules of its region's default bus that match it
  deliver it to their Lambda targets whose resource policy lets that rule invoke them,
  and the function's own zip runs (``python -S``: the standard library and the zip)
  with a session of its role, its timeout, one invocation at a time per function;
  :meth:`AwsSimulator.invocations`, :meth:`AwsSimulator.wait_for_invocations`,
  :meth:`AwsSimulator.lambda_log`, :attr:`AwsSimulator.undelivered`;
* **faults** a test can turn on: capacity errors for chosen pools
  (:meth:`AwsSimulator.no_capacity`: a type, a type in an AZ, a type in a region, or a
  whole region; until restored or for a while); conditional S3 writes that commit and lose their
  response, so that botocore's retry meets ``412`` (``sim.server.lost_responses``,
  :class:`~spotnb.testing.server.LostResponses`).

Where moto differs from AWS and how the simulator makes up for it (the only places
that reach into moto's in-process state; each is restored on exit):

* S3 does not check ``ExpectedBucketOwner`` in moto: a WSGI middleware in front of moto
  answers ``403 AccessDenied`` when the bucket's owner differs, as S3 does.
* moto's conditional writes (``If-None-Match``/``If-Match``) are check-then-write
  without a lock, so two racing writers could both win: the middleware serialises
  conditional S3 writes, which gives S3's atomicity.
* Auto Scaling: moto's own instance launch for spotnb's groups is switched off (the
  fulfilment replaces it), ``DescribeScalingActivities`` (always empty in moto) serves
  the activities the simulator records, and the lifecycle states above are kept in
  moto's records of the groups' instances. ``CreateAutoScalingGroup`` refuses a name
  that exists with ``AlreadyExists`` (moto replaces the group) and makes the hooks of
  ``LifecycleHookSpecificationList`` (which moto ignores) with the group; a refused
  ``RunInstances`` that is not about capacity (an instance profile, an image) is a
  failed scaling activity too, and the group tries again later.
  ``TerminateInstanceInAutoScalingGroup``
  (which moto carries out at once) ends a member of a spotnb group with a termination
  hook through that hook, as Auto Scaling does: IMDS
  ``autoscaling/target-lifecycle-state`` ``Terminated``, the instance terminated once
  its agent completes the hook or the hook's wait (scaled as the notice period is)
  runs out; the desired capacity goes down at once when asked. Instances count their
  age (their first hour) in the simulator's market time (``SPOTNB_TIME_SCALE``,
  :attr:`AwsSimulator.time_scale`).
* The Deep Learning AMI's public SSM parameter does not exist in moto: the simulator
  publishes it, pointing at an image it registers under the Deep Learning AMI's name.
* EC2 placement groups do not exist in moto (its server answers HTTP 500): the
  simulator answers ``CreatePlacementGroup``, ``DescribePlacementGroups`` and
  ``DeletePlacementGroup`` (refused with ``InvalidPlacementGroup.InUse`` while an
  instance it launched for a group naming the placement group runs, as on AWS;
  ``InvalidPlacementGroup.Unknown`` for a name that does not exist), added
  to moto's EC2 responder so that the instances' own calls reach it too; moto accepts
  an Auto Scaling group's ``PlacementGroup`` and echoes it, but places nothing.
* ``GetSpotPlacementScores`` is not in moto either: the simulator scores each AZ that
  offers the types in each requested region it plays (``RegionNames``) 9, or 1 where
  :meth:`AwsSimulator.no_capacity` covers every requested type there (it does not model
  a count: any N scores the same); without ``SingleAvailabilityZone``, a region's row
  (its best AZ's score).
* moto's ``AttachInstances`` sets a group's desired capacity to the instances it holds:
  after attaching the instance it launched for a group of N, the simulator sets it back.
* Every instance runs on this machine: its IMDS ``local-ipv4`` is a loopback address of
  its own, 127.x.y.z from its private IP in moto (172.31.x.y), so that the rendezvous
  endpoint of a multi-node job names the host node as on EC2.
* Spot prices in moto are a constant placeholder from 2006: spotnb treats a price
  older than AWS's 90 days of history as unavailable and uses its bundled catalog,
  with the catalog's date in the source; the Pricing API and spot placement scores
  are not in moto and fall back the same way.

**What it still does not model** (so a test here cannot show a defect there):

* IAM: resource-based policies (the bucket policy spotnb writes, key and queue
  policies), permission boundaries, SCPs, signatures (any secret passes with a known
  key), credential expiry and refresh (an instance's role session lasts 12 hours), and
  IAM's propagation delay (a new role is usable at once, a deleted policy grants
  nothing at once: a role that deleted its own policy may not delete itself after, the
  worst case of issue 35's finding 13); an IAM call on a role or instance profile that
  does not exist is answered ``NoSuchEntity`` unchecked. Which AWS checks first, IAM
  or the resource's existence, is not documented: a request whose permission names
  the tags of a resource that is gone (a security or placement group another node
  deleted) is refused by IAM here, the stricter of the two (its denial's reason says
  so: ``spotnb.testing.iam.RESOURCE_GONE``).
* Auto Scaling: capacity depth (a pool has capacity or none; ``capacity-optimized``
  draws an order), ``Standby``, warm pools, health checks, AZ rebalancing, cooldowns,
  ``ScalingActivityInProgress`` anywhere but an instance in ``Pending:Wait``, and a
  launch hook added after the group's first launch (the simulator applies the hooks
  that exist when it launches). The message texts of the refusals are the
  simulator's; their codes are AWS's.
* EC2: instances run as local processes on this machine (no GPU, no EFA or network
  isolation: security group rules are not enforced; no root file system of their
  own, see :mod:`spotnb.testing.boot`), the hop limit of the metadata service, a
  stopped instance started again (it boots nothing), ``RebootInstances`` (a reboot
  comes from the instance, or a test's :func:`spotnb.testing.boot.reboot`), launch
  failures of a bad instance profile (an instance without a usable role just gets no
  credentials).
* S3: throttling (``SlowDown``), ``409 ConditionalRequestConflict``, eventual
  consistency of listings (S3 is strongly consistent today), and lost responses of
  anything but conditional writes.
* FIS: experiments' own lifecycle (they stay ``running``), actions other than spot
  interruptions, stop conditions.
* EventBridge and Lambda: see :mod:`spotnb.testing.events` and
  :mod:`spotnb.testing.lambdas` (Auto Scaling's other events, custom buses, targets
  other than Lambda, concurrency, warm starts, synchronous ``Invoke``).

By default an instance runs its user data with ``SPOTNB_PYTHON`` set to this Python,
like an image with spotnb preinstalled (fast; its environment holds the simulator's
variables and the machine's, none of the notebook's others:
:func:`spotnb.testing.boot.preinstalled_environment`); ``install=True`` boots it on a plain
image (:class:`spotnb.testing.boot.PlainImage`: a system Python without spotnb that
refuses pip, PEP 668; a local wheel index for PyPI; nothing of the test's environment
but the simulator's variables), where the boot downloads the wheel that the provider
uploaded to the job's prefix, checks its SHA-256 and installs it with its dependencies
into a virtual environment of its own, as on real EC2; ``install=`` a ``PlainImage``
boots on that one (``plain_image().without("pathspec")``: an index that lacks one).
"""

from spotnb.testing.instances import SimInstance
from spotnb.testing.server import (
    DEFAULT_ACCOUNT,
    DEFAULT_REGION,
    FAKE_CREDENTIALS,
    LostResponses,
    MotoServer,
    aws_environment,
)
from spotnb.testing.simulator import AwsSimulator

__all__ = [
    "DEFAULT_ACCOUNT",
    "DEFAULT_REGION",
    "FAKE_CREDENTIALS",
    "AwsSimulator",
    "LostResponses",
    "MotoServer",
    "SimInstance",
    "aws_environment",
]
