"""What the AWS provider creates, by name, tag and document (the launch template, the
group's mix of instance types, a multi-node job's network rules): pure functions, no
calls.

Everything a job creates carries its id, so :meth:`AwsProvider.cleanup` can find it:

==========================  ==============================================  ==========
resource                    name                                            lifetime
==========================  ==============================================  ==========
Auto Scaling group          ``spotnb-<job_id>``                             the job
launch template             ``spotnb-<job_id>``                             the job
IAM role, instance profile  ``spotnb-job-<job_id>`` (path ``/spotnb/``)     the job
bootstrap wheel             ``<job prefix>/bootstrap/spotnb-<v>-py3-none-any.whl``  the job
security group              ``spotnb-no-inbound`` (one per VPC, no ingress)  shared
training security group     ``spotnb-<job_id>`` (multi-node: ingress from   the job
                            itself only, :func:`training_ingress`)
cluster placement group     ``spotnb-<job_id>`` (multi-node)                 the job
SSM parameters (secrets)    ``/spotnb/<job_id>/<NAME>`` (SecureString,       the job
                            :mod:`.parameters`)
FIS role                    ``spotnb-fis`` (``%spot_interrupt`` on AWS)      shared
bucket                      ``spotnb-<account>-<region>`` (default store)    shared
==========================  ==============================================  ==========

Tags: ``spotnb:job-id`` (the job), ``spotnb:store`` (the job's store URI, so cleanup
can tell a finished job from a running one), ``spotnb:managed=true`` on everything.

The IAM documents are :mod:`.policies`'s, the provider's settings and default image
:mod:`.settings`'s, what the group's scaling activities say :mod:`.activities`'s.
"""

from __future__ import annotations

import base64
from typing import Any

from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.providers.aws.activities import capacity_failures
from spotnb.providers.aws.settings import (
    DLAMI_NAME,
    DLAMI_PARAMETER,
    SPOT_STRATEGIES,
    AwsSettings,
    check_strategy,
    image_problem,
)

# Importable from here too, as before they had modules of their own (tests,
# spotnb.testing): the settings, the default image, the capacity failures.
__all__ = ["DLAMI_NAME", "DLAMI_PARAMETER", "AwsSettings", "capacity_failures",
           "image_problem"]

TAG_JOB = "spotnb:job-id"
TAG_STORE = "spotnb:store"
TAG_MANAGED = "spotnb:managed"
IAM_PATH = "/spotnb/"
SECURITY_GROUP = "spotnb-no-inbound"
FIS_ROLE = "spotnb-fis"
#: The mover (mover.py): its function and IAM role in each region, and the EventBridge
#: rule that invokes it.
MOVER_FUNCTION = "spotnb-mover"
MOVER_ROLE = "spotnb-mover"
MOVER_RULE = "spotnb-launch-unsuccessful"
BOOTSTRAP_PREFIX = "bootstrap"


# ------------------------------------------------------------------------- names

#: The termination lifecycle hook of a standby group (:func:`rebalancing`): its wait is
#: the instance's final save when the job moves off it; the instance agent completes it.
LIFECYCLE_HOOK_NAME = "spotnb-final-save"
#: The launch lifecycle hook of a standby group: an instance is in service once its
#: instance agent completes it: at once for the job's instance, when its job agent holds
#: the lease; for a warm standby, once it is ready (kernel started, checkpoint
#: prefetched, cell at its restore point).
LAUNCH_HOOK_NAME = "spotnb-standby-ready"
#: EC2's boot, as the instance agent counts it when it times a standby to be ready as
#: its instance's first hour ends (spotnb.protocol.standby.standby_wait).
STANDBY_BOOT_SECONDS = 90
#: How long a standby may take to be ready: EC2's boot and the standby policy's hold
#: (spotnb.protocol.standby.STANDBY_HOLD_SECONDS, 600 s). The launch hook waits as long;
#: the job's instance gives back a standby not ready by then.
LAUNCH_HOOK_SECONDS = STANDBY_BOOT_SECONDS + 600


def rebalancing(spec: JobSpec) -> bool:
    """Whether the job's group has warm standbys (its ``policy.standby``): room for one
    instance more than its nodes, the two lifecycle hooks, and instance agents that ask
    for a standby on a rebalance recommendation and move the job (a node) to it
    (providers/aws/standby.py)."""
    return bool(spec.policy.standby)


def group_name(job_id: str) -> str:
    return f"spotnb-{job_id}"


def template_name(job_id: str) -> str:
    return f"spotnb-{job_id}"


def partition(region: str) -> str:
    """The AWS partition of ``region`` (its ARNs' second field)."""
    return "aws-cn" if region.startswith("cn-") else (
        "aws-us-gov" if region.startswith("us-gov-") else "aws")


def role_name(job_id: str) -> str:
    return f"spotnb-job-{job_id}"


def placement_group_name(job_id: str) -> str:
    """A multi-node job's cluster placement group."""
    return f"spotnb-{job_id}"


def training_group_name(job_id: str) -> str:
    """A multi-node job's security group (its nodes reach each other, nobody else)."""
    return f"spotnb-{job_id}"


def training_ingress(group_id: str, efa: bool) -> list[dict[str, Any]]:
    """The ingress rules of a multi-node job's security group: from itself only.

    The ports are not fixed: torchelastic's rendezvous store (``TCPStore`` on port 0,
    named in ``rendezvous.json``), ``MASTER_PORT`` and gloo's and NCCL's pair
    connections all bind ephemeral ports, so the rule opens every TCP port, but only to
    instances in this same group (source = the group: the job's own nodes). With EFA,
    AWS requires all traffic from the group itself (EFA's SRD is not TCP), so the rule
    is protocol ``-1`` with the same source. No rule admits anything else: the nodes
    have no other inbound port (egress stays open: S3, the AWS APIs, PyPI).
    """
    pair = {"GroupId": group_id, "Description": "the job's own nodes (training traffic)"}
    if efa:
        return [{"IpProtocol": "-1", "UserIdGroupPairs": [pair]}]
    return [{"IpProtocol": "tcp", "FromPort": 0, "ToPort": 65535, "UserIdGroupPairs": [pair]}]


def training_egress(group_id: str, efa: bool) -> list[dict[str, Any]]:
    """The egress rules a multi-node job's security group needs besides the default
    one (all traffic to 0.0.0.0/0): with EFA, all traffic to the group itself.

    EFA's OS-bypass traffic is not IP, so an address range never matches it: AWS's EFA
    set-ups give the group a self-referencing outbound rule as well as the inbound one
    (AWS PCS User Guide, "Create a security group to support EFA communications":
    ``authorize-security-group-egress --protocol -1 --source-group`` the group itself;
    EC2 User Guide, "Get started with EFA": outbound, all traffic, to the group).
    Without EFA, TCP leaves through the default rule."""
    if not efa:
        return []
    return [{"IpProtocol": "-1", "UserIdGroupPairs": [
        {"GroupId": group_id, "Description": "the job's own nodes (EFA traffic)"}]}]


def tags(job_id: str, store_uri: str, name: str | None = None) -> list[dict[str, str]]:
    """The tags every resource of the job carries (EC2/IAM ``Key``/``Value`` form)."""
    found = [{"Key": TAG_JOB, "Value": job_id}, {"Key": TAG_STORE, "Value": store_uri},
             {"Key": TAG_MANAGED, "Value": "true"}]
    if name:
        found.append({"Key": "Name", "Value": f"spotnb {name} ({job_id})"[:255]})
    return found


def s3_location(store_uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes) of an ``s3://`` store URI."""
    if not store_uri.startswith("s3://"):
        raise SpecError(
            f"the AWS provider needs an S3 store, not {store_uri!r}: leave store unset for "
            "the default bucket spotnb-<account>-<region>, or pass store='s3://bucket/prefix'")
    bucket, _, prefix = store_uri[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def region_types(spec: JobSpec, region: str) -> tuple[str, ...]:
    """The job's instance types offered in ``region`` (in its order), for its group's
    overrides there; all of them when the catalog offers none there (AWS then says)."""
    from spotnb.providers import catalog

    offered = tuple(t for t in spec.resources.instance_types if catalog.pools(t, region))
    return offered or spec.resources.instance_types


# -------------------------------------------------------------- launch template

#: How many network hops an IMDSv2 token may travel: 2 reaches a container on the
#: instance (see :func:`launch_template_data`).
METADATA_HOP_LIMIT = 2


def launch_template_data(*, ami: str, profile_arn: str, security_group: str,
                         script: str, tag_list: list[dict[str, str]],
                         efa: bool = False) -> dict[str, Any]:
    """IMDSv2 only, the job's role, tags; no inbound port (``security_group`` has no
    ingress, or, for a multi-node job, ingress from itself only).

    ``efa``: the instance's primary network interface is an Elastic Fabric Adapter
    (every type of the job must support it: the template is shared by the types).
    """
    network: dict[str, Any] = {"SecurityGroupIds": [security_group]}
    if efa:
        # An EFA is requested as the primary interface; its security groups go with it.
        network = {"NetworkInterfaces": [{"DeviceIndex": 0, "InterfaceType": "efa",
                                          "Groups": [security_group],
                                          "DeleteOnTermination": True}]}
    return {
        "ImageId": ami,
        "IamInstanceProfile": {"Arn": profile_arn},
        **network,
        "UserData": base64.b64encode(script.encode()).decode(),
        # Hop limit 2: a container the cell starts (docker's bridge network is a hop)
        # reaches IMDSv2 as the cell does, for the job's role and the spot notices;
        # with 1 its token PUT never comes back ("if HTTP tokens are required,
        # container ... need a minimum of two hops": AWS's InstanceMetadataOptions).
        # The role is the job's, least privilege, as the cell has it anyway.
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": METADATA_HOP_LIMIT,
                            "InstanceMetadataTags": "disabled"},
        "InstanceInitiatedShutdownBehavior": "terminate",
        "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                              {"ResourceType": "volume", "Tags": tag_list}],
    }


def mixed_instances_policy(*, template_id: str, instance_types: tuple[str, ...],
                           max_price: float | None, ondemand: bool,
                           strategy: str = "price-capacity-optimized") -> dict[str, Any]:
    """Spot over the job's types (0% on-demand unless ``ondemand``) across the group's
    subnets, allocated by ``strategy`` (:data:`SPOT_STRATEGIES`: by default the order
    of the types is no preference); on-demand, if allowed, in the types' order."""
    distribution: dict[str, Any] = {
        "OnDemandBaseCapacity": 0,
        "OnDemandPercentageAboveBaseCapacity": 100 if ondemand else 0,
        "OnDemandAllocationStrategy": "prioritized",
        "SpotAllocationStrategy": check_strategy(strategy),
    }
    if max_price is not None:
        distribution["SpotMaxPrice"] = f"{max_price:.5f}"
    return {
        "LaunchTemplate": {
            "LaunchTemplateSpecification": {"LaunchTemplateId": template_id,
                                            "Version": "$Latest"},
            "Overrides": [{"InstanceType": t} for t in instance_types],
        },
        "InstancesDistribution": distribution,
    }


def choice_detail(instance_type: str, instance_types: tuple[str, ...], strategy: str,
                  no_capacity: set[str]) -> str:
    """What to say of the type Auto Scaling launched, among the job's types: only what
    is known. The types that had no spot capacity are those its scaling activities say
    so of (``no_capacity``); otherwise it was the strategy's choice, which under
    ``price-capacity-optimized`` does not follow the order of the types at all."""
    if len(instance_types) <= 1 or instance_type not in instance_types:
        return ""
    others = [t for t in instance_types if t in no_capacity and t != instance_type]
    if others:
        return f"; {', '.join(others)} had no spot capacity (the group's scaling activities)"
    rank = instance_types.index(instance_type)
    if strategy == "capacity-optimized-prioritized":
        return "" if rank == 0 else (
            f"; type {rank + 1} of {len(instance_types)} in the job's order ({strategy}: "
            f"{SPOT_STRATEGIES[strategy]})")
    return (f"; Auto Scaling's choice among the job's {len(instance_types)} types "
            f"({strategy}: {SPOT_STRATEGIES.get(strategy, '')})")
