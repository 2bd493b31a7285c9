"""A multi-node job's network on AWS: one AZ, a cluster placement group, EFA where the
types have it, and a security group that admits training traffic from the job only.

A job of MAX nodes (``--nodes MIN:MAX``) gets one Auto Scaling group of MAX instances,
as a single-node job gets one of one; what differs is where they may run:

* **One AZ** (:func:`choose_zone`, at validation, before anything is created): the
  AZs whose subnets offer at least one of the job's types
  (``DescribeInstanceTypeOfferings`` by AZ), ranked by EC2's spot placement score
  for MAX instances in a single AZ (``GetSpotPlacementScores`` with
  ``SingleAvailabilityZone``, ``TargetCapacity`` = MAX). An AZ scored
  :data:`NO_CAPACITY_SCORE` is treated as having no capacity for the job; when every
  AZ is (for a job of at least :data:`SCORED_REFUSAL_MIN_TYPES` types: AWS scores one
  or two types low whatever the capacity), or none offers the types, the job is
  refused with the next step (fewer nodes, other types, another region). Without
  scores (no permission, a region or partition without the API) the first AZ that
  offers the types is used, and the choice says so.
* **A cluster placement group** per job (:func:`create_network`), named in the Auto
  Scaling group (``PlacementGroup``): its instances are placed close together.
* **EFA** where every type of the job supports it (``DescribeInstanceTypes``
  ``NetworkInfo.EfaSupported``, cached per process: the catalog has no such column):
  the launch template's primary interface is an EFA (:func:`.resources.launch_template_data`).
* **A security group** per job whose only ingress rule has the group itself as its
  source (:func:`.resources.training_ingress`): the nodes reach each other's
  rendezvous store and worker ports, nobody else reaches anything. With EFA, an
  egress rule to the group itself too (:func:`.resources.training_egress`: EFA's
  traffic is not IP, so the default egress rule to 0.0.0.0/0 does not carry it).

Their end (:func:`delete_network`): when the job ends, after its Auto Scaling group.
AWS refuses to delete a security group that a network interface still uses
(``DependencyViolation``) or a placement group that still holds an instance
(``InvalidPlacementGroup.InUse``); the instance that deletes the group is itself still
in both for a minute. So the deletion is tried at the end of the job (the instance's
teardown, :meth:`AwsProvider.terminate`), and what AWS refused then is deleted by the
next multi-node launch in the region (:func:`sweep`: two Describe calls) or by
``spotnb aws cleanup``. Both are free while they wait (an empty security group or
placement group costs nothing; AWS's default quotas are 2,500 security groups per VPC
and 500 placement groups per region). Every node's teardown tries, at about the same
time: each deletes only what it finds (a Describe first), and an IAM refusal of a
group that a peer deleted meanwhile is taken for done (the instance role's permission
names the group's tag, and AWS does not say whether IAM or existence is checked
first).

Requests: validation makes 5 Describe/Get calls once per job (4 once a process cached
the types' EFA support); the launch 5 more (the sweep's two Describe calls, create
the placement group, create the security group, authorize its rule; with EFA a sixth,
its egress rule); the end 3 per
instance that tears down (describe and delete the security group, delete the
placement group). None of them repeats while the job runs: what an instance calls
per hour is what a single-node job's instance calls (``benchmarks/bench_requests.py
--nodes``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import (
    TAG_JOB,
    TAG_STORE,
    placement_group_name,
    region_types,
    training_egress,
    training_group_name,
    training_ingress,
)

__all__ = ["NO_CAPACITY_SCORE", "Network", "Zone", "choose_zone", "create_network",
           "delete_network", "efa_supported", "sweep"]

log = logging.getLogger(__name__)

#: EC2's spot placement scores run from 1 to 10; AWS documents 1 as "not likely to
#: succeed". An AZ scored this (or lower) for the job's MAX nodes is not launched in.
NO_CAPACITY_SCORE = 1
#: AWS: "If you specify one or two instance types ... the returned placement score will
#: always be low". With fewer types than this the scores rank the AZs but refuse nothing.
SCORED_REFUSAL_MIN_TYPES = 3

# Error codes that say "still in use: try again once the instances are gone".
_IN_USE = frozenset({"DependencyViolation", "InvalidPlacementGroup.InUse"})
# IAM's refusals: of a deletion, also what may be said of a resource another node's
# teardown deleted just before (the instance role's permission names the resource's
# tag, gone with it; AWS does not document whether IAM or existence is checked first).
_REFUSED = frozenset({"UnauthorizedOperation", "AccessDenied"})

_EFA: dict[tuple[str, str], bool] = {}
_EFA_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Zone:
    """Where a multi-node job runs: one AZ and its subnet, and why it was chosen."""

    az: str          # name, e.g. us-east-1a
    az_id: str       # e.g. use1-az4
    subnet: str
    vpc: str
    efa: bool
    why: str


@dataclasses.dataclass(frozen=True)
class Network:
    """What :func:`create_network` made for one job."""

    security_group: str
    placement_group: str


def efa_supported(ec2: Any, region: str, instance_types: tuple[str, ...]) -> bool:
    """Whether every one of ``instance_types`` supports EFA (one cached Describe call)."""
    with _EFA_LOCK:
        missing = [t for t in instance_types if (region, t) not in _EFA]
    if missing:
        try:
            rows = ec2.describe_instance_types(InstanceTypes=missing).get("InstanceTypes", ())
        except Exception as err:
            # Not knowing is not a reason to refuse the job: it runs without EFA.
            log.info("cannot tell whether %s support EFA (%s): launching without EFA",
                     ", ".join(missing), _boto.error_code(err) or err)
            return False
        with _EFA_LOCK:
            for row in rows:
                _EFA[(region, row["InstanceType"])] = bool(
                    (row.get("NetworkInfo") or {}).get("EfaSupported"))
    with _EFA_LOCK:
        return all(_EFA.get((region, t), False) for t in instance_types)


def choose_zone(ec2: Any, spec: JobSpec, subnets: list[dict[str, Any]],
                region: str | None = None) -> Zone:
    """The AZ (and subnet) a multi-node job runs in, or a SpecError with the next step.

    ``subnets``: the candidate subnets (the default VPC's, or SPOTNB_AWS_SUBNETS), as
    ``DescribeSubnets`` rows, of ``region`` (where its group runs: its home by
    default), whose client ``ec2`` is. See the module docstring for the ranking.
    """
    res = spec.resources
    region = region or res.region
    types, nodes = region_types(spec, region), res.max_nodes
    # Step 1: AZs that offer at least one of the types and have a subnet.
    offered: dict[str, set[str]] = {}
    for row in ec2.describe_instance_type_offerings(
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": list(types)}],
    ).get("InstanceTypeOfferings", ()):
        offered.setdefault(row["Location"], set()).add(row["InstanceType"])
    by_az: dict[str, dict[str, Any]] = {}
    for row in sorted(subnets, key=lambda r: (r["AvailabilityZone"], r["SubnetId"])):
        if row["AvailabilityZone"] in offered:
            by_az.setdefault(row["AvailabilityZone"], row)
    if not by_az:
        raise SpecError(
            f"no capacity for {nodes} nodes in one AZ: none of {', '.join(types)} is "
            f"offered in an AZ of {region} that has a subnet spotnb may use: name other "
            "instance types (-t), or another region")
    # Step 2: EC2's spot placement score for all the nodes in a single AZ.
    scores: dict[str, int] = {}
    try:
        reply = ec2.get_spot_placement_scores(
            InstanceTypes=list(types), TargetCapacity=nodes, SingleAvailabilityZone=True,
            RegionNames=[region])
        scores = {row["AvailabilityZoneId"]: int(row["Score"])
                  for row in reply.get("SpotPlacementScores", ())
                  if row.get("AvailabilityZoneId")}
    except Exception as err:
        log.info("spot placement scores unavailable (%s): choosing the AZ by offerings",
                 _boto.error_code(err) or type(err).__name__)
    efa = efa_supported(ec2, region, types)

    def zone(row: dict[str, Any], why: str) -> Zone:
        return Zone(az=row["AvailabilityZone"],
                    az_id=row.get("AvailabilityZoneId", row["AvailabilityZone"]),
                    subnet=row["SubnetId"], vpc=row["VpcId"], efa=efa, why=why)

    if not scores:
        first = next(iter(by_az.values()))
        return zone(first, "the first AZ that offers the types (no spot placement scores)")
    ranked = sorted(by_az.values(), key=lambda r: -scores.get(
        r.get("AvailabilityZoneId", ""), 0))
    best = ranked[0]
    best_score = scores.get(best.get("AvailabilityZoneId", ""), 0)
    if len(types) < SCORED_REFUSAL_MIN_TYPES:
        return zone(best, f"spot placement score {best_score}/10 for {nodes} nodes, the "
                          "best of its AZs (scores of one or two types are always low)")
    if best_score <= NO_CAPACITY_SCORE:
        raise SpecError(
            f"no capacity for {nodes} nodes in one AZ: no AZ of {region} is likely to have "
            f"{nodes} spot instances of {', '.join(types)} (EC2 spot placement score "
            f"{best_score}/10 at best, in {best['AvailabilityZone']}). Nothing was started. "
            "Ask for fewer nodes (--nodes), name more instance types (-t), or try another "
            "region")
    return zone(best, f"spot placement score {best_score}/10 for {nodes} nodes")


def create_network(ec2: Any, spec: JobSpec, zone: Zone, tag_list: list[dict[str, str]],
                   undo: list[tuple[str, Callable[[], Any]]]) -> Network:
    """Create the job's cluster placement group and security group (launch Step 1b);
    each is added to ``undo`` as soon as it exists."""
    job_id = spec.job_id
    pg = placement_group_name(job_id)
    _boto.with_backoff(lambda: ec2.create_placement_group(
        GroupName=pg, Strategy="cluster",
        TagSpecifications=[{"ResourceType": "placement-group", "Tags": tag_list}]),
        what="creating the cluster placement group")
    undo.append(("placement group", lambda: _delete(
        lambda: ec2.delete_placement_group(GroupName=pg))))
    sg = str(_boto.with_backoff(lambda: ec2.create_security_group(
        GroupName=training_group_name(job_id), VpcId=zone.vpc,
        Description=f"spotnb job {job_id}: training traffic between its own nodes only",
        TagSpecifications=[{"ResourceType": "security-group", "Tags": tag_list}]),
        what="creating the job's security group")["GroupId"])
    undo.append(("security group", lambda: _delete(
        lambda: ec2.delete_security_group(GroupId=sg))))
    _boto.with_backoff(lambda: ec2.authorize_security_group_ingress(
        GroupId=sg, IpPermissions=training_ingress(sg, zone.efa)),
        what="opening the training ports to the job's own nodes")
    egress = training_egress(sg, zone.efa)
    if egress:
        _boto.with_backoff(lambda: ec2.authorize_security_group_egress(
            GroupId=sg, IpPermissions=egress),
            what="letting EFA traffic out to the job's own nodes")
    return Network(security_group=sg, placement_group=pg)


def delete_network(ec2: Any, job_id: str, multi_node: bool = True) -> list[str]:
    """Delete the job's security group and placement group where AWS allows it now;
    returns what is left (still in use: see the module docstring).

    ``multi_node=False``: the caller does not know the job's shape; a job without its
    own security group is taken to be a single-node one (one Describe call, no more).
    """
    left: list[str] = []
    groups = ec2.describe_security_groups(Filters=[
        {"Name": f"tag:{TAG_JOB}", "Values": [job_id]},
        {"Name": "group-name", "Values": [training_group_name(job_id)]}]).get(
        "SecurityGroups", ())
    if not groups and not multi_node:
        return left
    for group in groups:
        gid = group["GroupId"]
        if not _delete(partial(ec2.delete_security_group, GroupId=gid),
                       gone=partial(_security_group_gone, ec2, job_id, gid)):
            left.append(f"security group {gid}")
    # Only what is still there (as the security groups are looked up first): the other
    # nodes of the job tear it down at the same time.
    name = placement_group_name(job_id)
    if _placement_group_exists(ec2, job_id, name) and \
            not _delete(lambda: ec2.delete_placement_group(GroupName=name),
                        gone=lambda: not _placement_group_exists(ec2, job_id, name)):
        left.append(f"placement group {name}")
    return left


def _placement_group_exists(ec2: Any, job_id: str, name: str) -> bool:
    """Whether the job's placement group is still there; True when the lookup fails
    (the deletion then says)."""
    try:
        found = ec2.describe_placement_groups(Filters=[
            {"Name": f"tag:{TAG_JOB}", "Values": [job_id]},
            {"Name": "group-name", "Values": [name]}]).get("PlacementGroups", ())
    except Exception:
        log.debug("looking up placement group %s failed", name, exc_info=True)
        return True
    return any(g.get("GroupName") == name for g in found)


def _security_group_gone(ec2: Any, job_id: str, group_id: str) -> bool:
    """Whether the job's security group ``group_id`` is no longer there; False when
    the lookup fails."""
    try:
        found = ec2.describe_security_groups(Filters=[
            {"Name": f"tag:{TAG_JOB}", "Values": [job_id]},
            {"Name": "group-id", "Values": [group_id]}]).get("SecurityGroups", ())
    except Exception:
        log.debug("looking up security group %s failed", group_id, exc_info=True)
        return False
    return not any(g.get("GroupId") == group_id for g in found)


def _delete(fn: Callable[[], Any], gone: Callable[[], bool] | None = None) -> bool:
    """Run a delete: True when done or already gone; False when AWS says the resource
    is still in use (it is deleted later); anything else raises, but IAM's refusal of
    a resource that ``gone()`` finds deleted meanwhile (by another node)."""
    try:
        fn()
    except Exception as err:
        code = _boto.error_code(err)
        if code in _IN_USE:
            return False
        if "NotFound" in code or "Unknown" in code:
            return True
        if code in _REFUSED and gone is not None and gone():
            return True
        raise
    return True


def leftovers(ec2: Any, kinds: tuple[str, ...] = ("security-group", "placement-group")
              ) -> list[tuple[str, str, str, dict[str, str]]]:
    """Every multi-node job network resource in the region of ``kinds``: (kind, id or
    name, label, tags); one Describe call per kind."""
    found = []
    if "security-group" in kinds:
        for group in ec2.describe_security_groups(Filters=[
                {"Name": "tag-key", "Values": [TAG_JOB]}]).get("SecurityGroups", ()):
            tags = {t["Key"]: t["Value"] for t in group.get("Tags", ())}
            found.append(("security-group", group["GroupId"],
                          f"security group {group['GroupName']} ({group['GroupId']})", tags))
    if "placement-group" in kinds:
        for group in ec2.describe_placement_groups(Filters=[
                {"Name": "tag-key", "Values": [TAG_JOB]}]).get("PlacementGroups", ()):
            tags = {t["Key"]: t["Value"] for t in group.get("Tags", ())}
            found.append(("placement-group", group["GroupName"],
                          f"placement group {group['GroupName']}", tags))
    return found


def delete_leftover(ec2: Any, kind: str, ident: str) -> bool:
    """Delete one resource of :func:`leftovers`; False while it is still in use."""
    if kind == "security-group":
        return _delete(lambda: ec2.delete_security_group(GroupId=ident))
    return _delete(lambda: ec2.delete_placement_group(GroupName=ident))


def sweep(ec2: Any, over: Callable[[str, str | None], tuple[bool, str]]) -> list[str]:
    """Delete the network resources of jobs that are over (``over(job_id, store_uri)``)
    and that AWS now allows to delete; what was deleted, for the log."""
    done = []
    for kind, ident, label, tags in leftovers(ec2):
        ended, _ = over(tags.get(TAG_JOB, ""), tags.get(TAG_STORE))
        if ended and delete_leftover(ec2, kind, ident):
            done.append(label)
    return done
