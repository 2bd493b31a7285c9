"""EC2 calls moto lacks, as the simulator answers them (a part of
:class:`~spotnb.testing.AwsSimulator`): placement groups and spot placement scores."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Ec2Play"]

#: Spot placement scores the simulator gives an AZ: where no_capacity() covers every
#: requested type there, EC2's "not likely" (1); elsewhere "likely" (9).
NO_SCORE = 1
GOOD_SCORE = 9


class Ec2Play:
    """Placement groups and spot placement scores for the simulator (a part of it)."""

    region: str
    regions: tuple[str, ...]
    instances: dict[str, Any]
    _lock: threading.RLock
    _undo: list[Callable[[], None]]

    def _client(self, service: str, region: str | None = None) -> Any:
        raise NotImplementedError

    def short(self, instance_type: str, region: str, az_id: str) -> bool:
        raise NotImplementedError

    def _placement_groups(self, region: str) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _patch_ec2(self) -> None:
        """EC2 calls moto lacks, answered by the simulator: placement groups (create,
        describe, delete; a group that holds a running instance is "in use", as on
        AWS) and spot placement scores (from the capacity set with :meth:`no_capacity`).
        Added to moto's EC2 responder, so the instances' own calls reach them too."""
        from moto.core.responses import ActionResult, EmptyResult
        from moto.ec2.exceptions import EC2ClientError
        from moto.ec2.responses import EC2Response

        sim = self

        def create_placement_group(response: Any) -> Any:
            name = response._get_param("GroupName")
            tags = response._parse_tag_specification().get("placement-group", {})
            with sim._lock:
                groups = sim._placement_groups(response.region)
                if name in groups:
                    raise EC2ClientError("InvalidPlacementGroup.Duplicate",
                                         f"The placement group '{name}' already exists.")
                groups[name] = {
                    "GroupName": name, "State": "available",
                    "Strategy": response._get_param("Strategy"),
                    "GroupId": "pg-" + secrets.token_hex(8),
                    "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
                return ActionResult({"PlacementGroup": groups[name]})

        def describe_placement_groups(response: Any) -> Any:
            names = response._get_param("GroupNames", [])
            filters = response._filters_from_querystring()
            with sim._lock:
                groups = sim._placement_groups(response.region)
                missing = [n for n in names if n not in groups]
                if missing:  # named ones must exist, as on EC2 (filters need not match)
                    raise EC2ClientError("InvalidPlacementGroup.Unknown",
                                         f"The Placement Group '{missing[0]}' is unknown.")
                found = [g for g in groups.values()
                         if (not names or g["GroupName"] in names)
                         and g["GroupName"] in filters.get("group-name", [g["GroupName"]])
                         and _tags_match(g["Tags"], filters)]
            return ActionResult({"PlacementGroups": found})

        def delete_placement_group(response: Any) -> Any:
            name = response._get_param("GroupName")
            with sim._lock:
                groups = sim._placement_groups(response.region)
                if name not in groups:
                    raise EC2ClientError("InvalidPlacementGroup.Unknown",
                                         f"The Placement Group '{name}' is unknown.")
                if any(i.placement_group == name and not i.terminated
                       and i.region == response.region for i in sim.instances.values()):
                    raise EC2ClientError("InvalidPlacementGroup.InUse",
                                         f"The placement group '{name}' is in use.")
                del groups[name]
            return EmptyResult()

        def get_spot_placement_scores(response: Any) -> Any:
            types = response._get_param("InstanceTypes", [])
            # The regions asked (at most 10, botocore's model), those the simulator
            # plays; without RegionNames, every one of them (AWS: every region).
            asked = response._get_param("RegionNames", []) or list(sim.regions)
            scores = []
            for region in [r for r in asked if r in sim.regions]:
                offered = sim._client("ec2", region).describe_instance_type_offerings(
                    LocationType="availability-zone-id",
                    Filters=[{"Name": "instance-type", "Values": types}]
                )["InstanceTypeOfferings"]
                found = {az_id: NO_SCORE if all(sim.short(t, region, az_id) for t in types)
                         else GOOD_SCORE for az_id in sorted({o["Location"] for o in offered})}
                if str(response._get_param("SingleAvailabilityZone")).lower() == "true":
                    scores += [{"Region": region, "AvailabilityZoneId": az_id, "Score": score}
                               for az_id, score in found.items()]
                elif found:  # the region's score, without an AZ (its best AZ's here)
                    scores.append({"Region": region, "Score": max(found.values())})
            return ActionResult({"SpotPlacementScores": scores})

        added = {"create_placement_group": create_placement_group,
                 "describe_placement_groups": describe_placement_groups,
                 "delete_placement_group": delete_placement_group,
                 "get_spot_placement_scores": get_spot_placement_scores}
        before = {name: EC2Response.__dict__.get(name) for name in added}
        for name, fn in added.items():
            setattr(EC2Response, name, fn)

        def unpatch() -> None:
            for name, fn in before.items():
                if fn is None:
                    delattr(EC2Response, name)
                else:
                    setattr(EC2Response, name, fn)

        self._undo.append(unpatch)


def _tags_match(tags: list[dict[str, str]], filters: dict[str, Any]) -> bool:
    """EC2's ``tag:<key>`` and ``tag-key`` filters over ``tags``."""
    found = {t["Key"]: t["Value"] for t in tags}
    for name, values in filters.items():
        if name == "tag-key" and not any(v in found for v in values):
            return False
        if name.startswith("tag:") and found.get(name[4:]) not in values:
            return False
    return True
