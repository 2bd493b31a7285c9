"""A fake AWS for trying spotnb's AWS provider with no account: moto plus real agents.

:class:`AwsSimulator` is what the tests use, and users can use it too::

    from spotnb.testing import AwsSimulator

    with AwsSimulator() as sim:                 # moto on 127.0.0.1, boto3 pointed at it
        handle = spotnb.submit(code, provider="aws", instance_types=["g5.xlarge"])
        sim.wait_for_instance(handle.job_id)
        sim.interrupt(sim.running(handle.job_id)[0].id)   # notice, then termination
        handle.wait()

What it does:

* starts moto in server mode (``moto.server.ThreadedMotoServer``) on loopback, on a
  free port, and points boto3 at it through ``AWS_ENDPOINT_URL`` with fake credentials
  (restored on exit); agents started by the simulator inherit the same environment;
* plays **EC2 Auto Scaling's fulfilment** for spotnb's groups, which moto does not: moto
  launches one instance of the launch template's type in the first subnet and ignores
  the ``MixedInstancesPolicy``. The simulator launches each missing instance itself
  with ``ec2:RunInstances`` (real HTTP, through boto3), trying the policy's instance
  types in order and, for each, the group's subnets in order; a pool that answers with
  a capacity error (see :meth:`AwsSimulator.no_capacity`) is skipped and recorded as a
  failed scaling activity, exactly as ``describe_scaling_activities`` shows it on AWS.
  Replacements after a termination come from the same loop;
* **boots** every running instance that moto reports (replacements included): it runs
  the instance's real user data with ``bash`` on a simulated operating system
  (:mod:`spotnb.testing.boot`: cloud-init, systemd units, reboots, a power-off that
  EC2 turns into the instance's termination), with the instance's own IMDSv2 endpoint
  (:class:`spotnb.providers.local.imds.ImdsServer`) in ``SPOTNB_IMDS_ENDPOINT``;
* delivers **spot interruptions**: the notice appears in the instance's metadata, and
  after the notice period the instance is terminated in moto (SIGTERM to its processes,
  then SIGKILL after a grace); the **rebalance recommendation** comes with it, or
  some time before it, or not at all (:meth:`AwsSimulator.interrupt`'s ``lead``, which
  :meth:`AwsSimulator.drawn_lead` draws as the local cloud does), or alone, a false
  alarm (:meth:`AwsSimulator.recommend_rebalance`); ``spotnb interrupt`` on AWS goes
  through the Fault Injection Service, which moto cannot run, so the simulator answers FIS's
  ``StartExperiment`` itself with a botocore event hook (templates are real moto ones);
* **injects capacity errors** for chosen pools with a botocore event hook on its
  ``RunInstances`` calls.

Where moto differs from AWS and how the simulator makes up for it (the only places
that reach into moto's in-process state; each is restored on exit):

* S3 does not check ``ExpectedBucketOwner`` in moto: a WSGI middleware in front of moto
  answers ``403 AccessDenied`` when the bucket's owner differs, as S3 does.
* moto's conditional writes (``If-None-Match``/``If-Match``) are check-then-write
  without a lock, so two racing writers could both win: the middleware serialises
  conditional S3 writes, which gives S3's atomicity.
* Auto Scaling: moto's own instance launch for spotnb's groups is switched off (the
  simulator's fulfilment loop replaces it), and ``DescribeScalingActivities`` (always
  empty in moto) serves the activities the simulator records. Lifecycle hooks, which
  moto only stores (and ignores when made with the group: the simulator adds those of
  ``LifecycleHookSpecificationList``): ``CompleteLifecycleAction`` is recorded
  (:attr:`AwsSimulator.hooks_completed`), and ``TerminateInstanceInAutoScalingGroup``
  (which moto carries out at once) ends a member of a spotnb group with a termination
  hook through that hook, as Auto Scaling does: IMDS
  ``autoscaling/target-lifecycle-state`` ``Terminated``, the instance terminated once
  its agent completes the hook or the hook's wait (scaled as the notice period is)
  runs out; the desired capacity goes down at once when asked. Instances count their
  age (their first hour) in the simulator's market time (``SPOTNB_TIME_SCALE``,
  :attr:`AwsSimulator.time_scale`).
* The Deep Learning AMI's public SSM parameter does not exist in moto: the simulator
  publishes it, pointing at one of moto's images.
* Instance processes get the simulator's fake credentials through the environment
  instead of instance-profile credentials from IMDS (moto does not enforce IAM).
* EC2 placement groups do not exist in moto (its server answers HTTP 500): the
  simulator answers ``CreatePlacementGroup``, ``DescribePlacementGroups`` and
  ``DeletePlacementGroup`` (refused with ``InvalidPlacementGroup.InUse`` while an
  instance it launched for a group naming the placement group runs, as on AWS), added
  to moto's EC2 responder so that the instances' own calls reach it too; moto accepts
  an Auto Scaling group's ``PlacementGroup`` and echoes it, but places nothing.
* ``GetSpotPlacementScores`` is not in moto either: the simulator scores each AZ that
  offers the types 9, or 1 where :meth:`AwsSimulator.no_capacity` covers every
  requested type there (it does not model a count: any N scores the same).
* moto's ``AttachInstances`` sets a group's desired capacity to the instances it holds:
  after attaching the instance it launched for a group of N, the simulator sets it back.
* moto keeps a launch template's EFA interface (``InterfaceType: efa``) but launches a
  plain interface, and takes no security group from a template's interface.
* Every instance runs on this machine: its IMDS ``local-ipv4`` is a loopback address of
  its own, 127.x.y.z from its private IP in moto (172.31.x.y), so that the rendezvous
  endpoint of a multi-node job names the host node as on EC2.
* Spot prices in moto are a constant placeholder from 2006: spotnb treats a price
  older than AWS's 90 days of history as unavailable and uses its bundled catalog,
  with the catalog's date in the source; the Pricing API and spot placement scores
  are not in moto and fall back the same way.

By default an instance runs its user data with ``SPOTNB_PYTHON`` set to this Python,
like an image with spotnb preinstalled (fast); ``install=True`` boots it on a plain
image (:class:`spotnb.testing.boot.PlainImage`: a system Python without spotnb that
refuses pip, PEP 668; a local wheel index for PyPI; nothing of the test's environment
but the simulator's variables), where the boot downloads the wheel that the provider
uploaded to the job's prefix, checks its SHA-256 and installs it with its dependencies
into a virtual environment of its own, as on real EC2; ``install=`` a ``PlainImage``
boots on that one (``plain_image().without("pathspec")``: an index that lacks one).
"""

from spotnb.testing.server import (
    DEFAULT_ACCOUNT,
    DEFAULT_REGION,
    FAKE_CREDENTIALS,
    MotoServer,
    aws_environment,
)
from spotnb.testing.simulator import AwsSimulator, SimInstance

__all__ = [
    "DEFAULT_ACCOUNT",
    "DEFAULT_REGION",
    "FAKE_CREDENTIALS",
    "AwsSimulator",
    "MotoServer",
    "SimInstance",
    "aws_environment",
]
