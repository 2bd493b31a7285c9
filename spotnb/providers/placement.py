"""Spot placement scores: how likely EC2 is to have spot capacity for a job, per region
and availability zone, with the time they were taken.

EC2's ``GetSpotPlacementScores`` scores a *configuration* (a set of instance types and
a target count) from 1 ("not likely to succeed") to 10 ("highly likely") in each of up
to :data:`MAX_REGIONS_PER_REQUEST` regions at once, per AZ with
``SingleAvailabilityZone`` (the placement a multi-node job needs; a one-node job's group
spans the AZs, so its region scores as its best AZ). It costs nothing, but AWS may
refuse new configurations after many in a day, and scores one or two types "always
low": scores of fewer than :data:`DECISIVE_MIN_TYPES` types rank regions but demote
none (as the AWS provider refuses no AZ on them: ``aws/cluster.py``).

* :func:`fetch_placement_scores`: the request, on any boto3-like EC2 client (tests give
  it a client stubbed by botocore's ``Stubber``);
* :func:`aws_placement_scores`: the same with spotnb's AWS client (credentials from the
  standard chain);
* :func:`simulated_placement_scores`: the local cloud's, from its capacity settings
  (``SPOTNB_LOCAL_NO_CAPACITY``): an AZ scores :data:`SIMULATED_SCORE` where one of the
  types has capacity, 1 where none has (the AWS simulator's rule, ``spotnb.testing``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from spotnb.providers import catalog

__all__ = ["DECISIVE_MIN_TYPES", "MAX_REGIONS_PER_REQUEST", "PlacementScores",
           "aws_placement_scores", "fetch_placement_scores", "placement_scores",
           "simulated_placement_scores"]

#: ``RegionNames`` takes at most 10 regions (botocore's EC2 model): more are asked in
#: several requests.
MAX_REGIONS_PER_REQUEST = 10
#: A page of scores at most (the model's ``MaxResults`` maximum): a request of 10
#: regions has some 40 AZs, so one page in practice.
MAX_RESULTS = 1000
#: AWS: "If you specify one or two instance types ... the returned placement score will
#: always be low."
DECISIVE_MIN_TYPES = 3
#: The local cloud scores an AZ with capacity this (the AWS simulator's GOOD_SCORE).
SIMULATED_SCORE = 9
#: The scored AZs of a region whose scores come per region (``SingleAvailabilityZone``
#: false): the region's own score, under this AZ.
WHOLE_REGION = ""


@dataclasses.dataclass(frozen=True)
class PlacementScores:
    """Spot placement scores of one configuration (``instance_types`` x
    ``target_capacity``): ``scores[(region, az_id)]`` from 1 to 10, taken at ``fetched``
    (epoch seconds) from ``source``. ``decisive``: whether a score of 1 is to be believed
    (False for AWS scores of fewer than :data:`DECISIVE_MIN_TYPES` types)."""

    instance_types: tuple[str, ...]
    target_capacity: int
    scores: Mapping[tuple[str, str], int]
    fetched: float
    source: str
    decisive: bool = True

    def covers(self, instance_type: str) -> bool:
        """Whether these scores are of a configuration holding ``instance_type``."""
        return instance_type in self.instance_types

    def region_score(self, region: str) -> int | None:
        """The region's score: that of its best AZ (None when not scored)."""
        found = [score for (where, _az), score in self.scores.items() if where == region]
        return max(found) if found else None

    def age_seconds(self, now: float | None = None) -> float:
        return max(0.0, (time.time() if now is None else now) - self.fetched)

    def age_text(self, now: float | None = None) -> str:
        """How old the scores are, for people: "just now", "4 min ago", "2 h ago"."""
        age = self.age_seconds(now)
        if age < 60:
            return "just now"
        if age < 3600:
            return f"{age // 60:.0f} min ago"
        return f"{age / 3600:.0f} h ago"


def fetch_placement_scores(ec2: Any, instance_types: Sequence[str], regions: Sequence[str],
                           target_capacity: int = 1, *,
                           clock: Callable[[], float] = time.time) -> PlacementScores:
    """EC2's Spot placement scores of ``instance_types`` for ``target_capacity``
    instances in one AZ, in each of ``regions``, asked of ``ec2`` (a boto3 EC2 client
    of any region: the call takes the regions it scores) in requests of at most
    :data:`MAX_REGIONS_PER_REQUEST` regions, every page read. Errors are the client's
    (``botocore.exceptions.ClientError``: no permission, a throttle), for the caller to
    say."""
    types = list(dict.fromkeys(instance_types))
    wanted = list(dict.fromkeys(regions))
    scores: dict[tuple[str, str], int] = {}
    for start in range(0, len(wanted), MAX_REGIONS_PER_REQUEST):
        request: dict[str, Any] = {
            "InstanceTypes": types, "TargetCapacity": int(target_capacity),
            "SingleAvailabilityZone": True,
            "RegionNames": wanted[start:start + MAX_REGIONS_PER_REQUEST],
            "MaxResults": MAX_RESULTS}
        while True:
            reply = ec2.get_spot_placement_scores(**request)
            for row in reply.get("SpotPlacementScores", ()):
                if row.get("Region") and row.get("Score") is not None:
                    key = (row["Region"], row.get("AvailabilityZoneId") or WHOLE_REGION)
                    scores[key] = int(row["Score"])
            token = reply.get("NextToken")
            if not token:
                break
            request["NextToken"] = token
    return PlacementScores(
        instance_types=tuple(types), target_capacity=int(target_capacity),
        scores=MappingProxyType(scores), fetched=clock(),
        source="EC2 GetSpotPlacementScores", decisive=len(types) >= DECISIVE_MIN_TYPES)


#: Seconds to wait for EC2's answer before the picker goes on without scores.
AWS_TIMEOUT_SECONDS = 10.0


def aws_placement_scores(instance_types: Sequence[str], regions: Sequence[str],
                         target_capacity: int = 1, *, home: str = "us-east-1"
                         ) -> PlacementScores:
    """:func:`fetch_placement_scores` through spotnb's AWS client of ``home`` (the
    standard credential chain; one attempt, a short timeout: the caller goes on without
    scores when it fails)."""
    from spotnb.providers.aws._boto import client

    ec2 = client("ec2", home, attempts=1, read_timeout=AWS_TIMEOUT_SECONDS)
    return fetch_placement_scores(ec2, instance_types, regions, target_capacity)


def simulated_placement_scores(
        instance_types: Sequence[str], regions: Sequence[str], target_capacity: int = 1, *,
        has_capacity: Callable[[str, str], bool] | None = None,
        clock: Callable[[], float] = time.time) -> PlacementScores:
    """The local cloud's scores: each AZ (id) of ``regions`` where one of the types has
    a catalog pool scores :data:`SIMULATED_SCORE`, or 1 where none of them has capacity
    (``has_capacity(type, az_id)``, by default the local cloud's settings, read now).
    Like the AWS simulator's, they do not model the count."""
    if has_capacity is None:
        from spotnb.providers.local.state import Settings

        has_capacity = Settings.load().has_capacity
    types = list(dict.fromkeys(instance_types))
    scores: dict[tuple[str, str], int] = {}
    for region in dict.fromkeys(regions):
        offered: dict[str, list[str]] = {}
        for name in types:
            for pool in catalog.pools(name, region):
                offered.setdefault(pool.az, []).append(name)
        for az, names in sorted(offered.items()):
            short = not any(has_capacity(name, az) for name in names)
            scores[(region, az)] = 1 if short else SIMULATED_SCORE
    return PlacementScores(
        instance_types=tuple(types), target_capacity=int(target_capacity),
        scores=MappingProxyType(scores), fetched=clock(),
        source="the local cloud's simulated capacity", decisive=True)


def placement_scores(provider: str, instance_types: Sequence[str], regions: Sequence[str],
                     target_capacity: int = 1, *, home: str = "us-east-1"
                     ) -> PlacementScores:
    """The scores where ``provider``'s instances come from: the local cloud's simulated
    ones, or EC2's (AWS: errors as :func:`fetch_placement_scores`'s)."""
    if provider == "aws":
        return aws_placement_scores(instance_types, regions, target_capacity, home=home)
    return simulated_placement_scores(instance_types, regions, target_capacity)
