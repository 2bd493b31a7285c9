"""Where an AWS job's Auto Scaling group runs: the job's regions ranked by expected cost
with EC2's Spot placement scores, and the move to the next region when one has no
capacity.

The rules are the local cloud's (:mod:`spotnb.providers.failover`, whose
:class:`~spotnb.providers.failover.RegionPlan` this module's plan is): a job names
its regions (``--region a,b``), the first is its *home*, where its store (bucket), its
queues and its secrets stay; its group, launch template, security group (a multi-node
job's placement group) and the image they run are made in one region at a time, *its
region*, and deleted there. What differs on AWS:

* **the scores** are EC2's (``GetSpotPlacementScores``, asked once of the home region
  for all the job's regions, for its MAX nodes in one AZ:
  :func:`spotnb.providers.placement.fetch_placement_scores`), not simulated. AWS scores
  one or two types "always low": only scores of at least
  :data:`~spotnb.providers.placement.DECISIVE_MIN_TYPES` types put a region last;
  with fewer, the job starts where the expected cost is lowest and moves if that
  region has no capacity. Without scores (no permission, a partition without the API)
  the ranking is by expected cost alone, and says so in the log.
* **who moves it**: there is no spotnb supervisor on AWS. The launch chooses the
  first region (:func:`start`); the notebook that launched the job, and any that
  follows it later (``%spot_attach``), watches its group
  (:class:`spotnb.providers.aws.capacity.CapacityWatch`, one move per shortage however
  many watch) and, after
  :data:`~spotnb.providers.aws.capacity.MOVE_AFTER_FAILED_ROUNDS` failed launch rounds
  in a row with fewer than the job's minimum of nodes running, moves it
  (:meth:`AwsProvider.move_region`: the group, template and network made in the new
  region; the nodes still in the old one, a multi-node job's, get their notice through
  their group's termination hook, save and go; then the new group launches and the old
  one is deleted; the next instances resume from the checkpoint in the home store).
  With no notebook following the job the mover moves it (:mod:`.mover`: a Lambda
  function that EventBridge invokes on the group's failed launches, making the same
  decision); without the mover deployed the group keeps trying in its region (nothing
  is billed meanwhile), as a one-region job's does.
* **the crossings** of the checkpoint are billed by the instance outside home that
  makes them (:mod:`.transfers`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from spotnb.protocol.events import codec
from spotnb.protocol.spec import JobSpec
from spotnb.providers.aws import _boto
from spotnb.providers.failover import RegionPlan
from spotnb.providers.placement import PlacementScores, fetch_placement_scores

__all__ = ["AwsRegionPlan", "placement_scores", "start"]

log = logging.getLogger(__name__)


def placement_scores(ec2: object, spec: JobSpec) -> PlacementScores | None:
    """EC2's Spot placement scores of the job's types for its MAX nodes in one AZ, in
    each of its regions (one request of the home region's ``ec2`` client for up to 10
    regions); None when EC2 will not say (the ranking goes on without them)."""
    res = spec.resources
    try:
        return fetch_placement_scores(ec2, res.instance_types, res.regions, res.max_nodes)
    except Exception as err:
        log.info("spot placement scores unavailable (%s): ranking %s by expected cost only",
                 _boto.error_code(err) or type(err).__name__, ", ".join(res.regions))
        return None


class AwsRegionPlan(RegionPlan):
    """The local cloud's :class:`RegionPlan` with EC2's placement scores (fetched by
    ``scores()`` at each ranking: the start and each move)."""

    def __init__(self, spec: JobSpec,
                 scores: Callable[[], PlacementScores | None]) -> None:
        super().__init__(spec, has_capacity=lambda _type, _az: True)
        self._scores = scores

    def placement_scores(self) -> PlacementScores | None:
        """EC2's scores (or none), asked once for all the job's regions."""
        return self._scores()


def start(plan: AwsRegionPlan) -> codec.Region | None:
    """Choose the first region of a job's launch; the ``region`` event to tell (None
    for a job of one region: nothing to choose)."""
    if len(plan.regions) == 1:
        plan.region = plan.home
        return None
    return plan.start(None)
