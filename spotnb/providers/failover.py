"""Where a job's group launches its instances, the rules both clouds follow: the job's
regions ranked by expected cost, the move to the next region when one has no capacity,
and the checkpoint's transfer between regions, billed as AWS bills it. The local
cloud's group (:mod:`spotnb.providers.local.group`) and the AWS provider
(:mod:`spotnb.providers.aws.failover`, with EC2's placement scores) both use
:class:`RegionPlan`; told here as the local cloud runs it.

A job names its regions (``Resources.regions``); the first (``Resources.region``) is its
*home*, where its store stays. The group launches in one region at a time, *its
region*, and keeps every node of a multi-node job in one region and one AZ (the AZ of
its nodes still running). The story (:class:`RegionPlan`)::

    start   rank the job's regions (spotnb.providers.regions.rank_regions: the expected
            cost of an hour of its work on the best of its types there, the checkpoint's
            transfer to and from home counted at the size of its newest checkpoint, or
            UNKNOWN_STATE_BYTES before it has one; the local cloud's simulated placement
            scores put a region without capacity last) -> its region is the first ->
            a ``region`` event (cause ``start``) says which and why
    round   a launch tries every pool of the job's types in its region (the types in
            the job's order, the cheapest AZ first; a multi-node job's: in its nodes'
            AZ) -> none has capacity: a failed round; the next comes
            CAPACITY_RETRY_SECONDS later (spotnb.providers.local.pools, .group)
    move    MOVE_AFTER_FAILED_ROUNDS failed rounds in a row, another region to go to,
            and fewer than min_nodes nodes running (a multi-node job that still trains
            stays where it is) -> the region is left dry; the regions are ranked again
            (the checkpoint's restore from home counted) and the best one not dry is
            the group's region -> a ``region`` event (cause ``no-capacity``, "no
            capacity in us-east-1 for g5.xlarge after 3 tries") -> the nodes left in the
            old region get a notice (they save and go) -> once they are gone the group
            launches in the new region, whose agent resumes from the checkpoint in the
            home store
    all dry every region was left dry -> all are open again, the best first: the group
            retries forever, as in one region (until stop, budget or deadline)

A job stays in its region while it finds capacity there: it does not go back home
when home's capacity returns (that would cost another restore across regions).

The transfer (:class:`TransferMeter`): the local cloud's instances all read and write
the same store, but each crossing is billed as AWS would bill it: the sending region
pays its inter-region price per GB (``spotnb.providers.regions.transfer_price``), each
durable checkpoint saved by an instance outside home (sent home), and each attempt that
boots outside home once the job has a checkpoint (it restores it from home). The group
says each in a ``transfer`` event, which the job's fold sums into its cost. A synced
directory's snapshots (``spot.sync_dir``) are not counted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

from spotnb.protocol import billing
from spotnb.protocol.events import Event, codec
from spotnb.protocol.spec import JobSpec
from spotnb.providers import catalog
from spotnb.providers.catalog import Pool
from spotnb.providers.placement import PlacementScores, simulated_placement_scores
from spotnb.providers.regions import GB, rank_regions, transfer_price

__all__ = ["MOVE_AFTER_FAILED_ROUNDS", "REGION_MOVE", "UNKNOWN_STATE_BYTES", "RegionPlan",
           "TransferMeter", "notice_end"]

log = logging.getLogger(__name__)

#: A job moves to its next region after this many launch rounds in a row found no
#: capacity in its region (each round tries every pool of its types there,
#: CAPACITY_RETRY_SECONDS apart: about 6 s on the local cloud). One would move on a
#: pool's passing shortage and pay a restore across regions for it; EC2 answers a
#: launch at once, so three rounds are seconds there too.
MOVE_AFTER_FAILED_ROUNDS = 3
#: Before a job has a checkpoint its size is unknown: the ranking takes it as the
#: instance picker's default checkpoint (1 GB), so that a region far from home pays for
#: the saves it would send there.
UNKNOWN_STATE_BYTES = GB
#: The notice (and the end) of the nodes a move to another region leaves behind.
REGION_MOVE = billing.REGION_MOVE


def notice_end(notice_reason: str | None) -> str:
    """How an instance under notice (``notice_reason``) ends: the group's own notice to
    the nodes a move to another region leaves behind (billed: the owner ends it), or
    EC2's interruption (free in its first hour)."""
    return REGION_MOVE if notice_reason == REGION_MOVE else billing.EC2_INTERRUPTION


class RegionPlan:
    """The group's region and its failed launch rounds there (module docstring).

    ``has_capacity(type, az_id)``: the local cloud's capacity now (its settings, at the
    group's age), which its simulated placement scores are made of."""

    def __init__(self, spec: JobSpec, has_capacity: Callable[[str, str], bool]) -> None:
        self.spec = spec
        self.home = spec.resources.region
        self.regions = spec.resources.regions
        self.has_capacity = has_capacity
        self.region: str | None = None  # None until the first launch chooses it
        self.failed_rounds = 0
        self.dry: set[str] = set()  # left after MOVE_AFTER_FAILED_ROUNDS, since all were

    def rank(self, state_bytes: int | None, resume: bool) -> list[tuple[str, str, bool]]:
        """The job's regions that offer one of its types, best first, each as (region,
        why, likely to have capacity): as
        :func:`~spotnb.providers.regions.rank_regions` ranks them with the local
        cloud's placement scores for its node count; then, in the job's order, those it
        has no estimate for (no speed figure for the types offered there)."""
        res = self.spec.resources
        ranked = [(c.region, c.why, c.cost.likely) for c in rank_regions(
            self.spec, scores=self.placement_scores(), resume=resume,
            state_bytes=UNKNOWN_STATE_BYTES if state_bytes is None else state_bytes)]
        known = {region for region, _why, _likely in ranked}
        ranked += [(region, "no estimate for its types (no speed figure)", True)
                   for region in res.regions if region not in known
                   and any(catalog.pools(t, region) for t in res.instance_types)]
        return ranked

    def placement_scores(self) -> PlacementScores | None:
        """The placement scores the ranking reads: the local cloud's, simulated from its
        capacity model for the job's node count (a cloud's own plan asks its API)."""
        res = self.spec.resources
        return simulated_placement_scores(res.instance_types, res.regions, res.max_nodes,
                                          has_capacity=self.has_capacity)

    def start(self, state_bytes: int | None) -> codec.Region:
        """Choose the group's first region (a job that resumes, ``state_bytes`` known,
        restores its checkpoint there)."""
        ranked = self.rank(state_bytes, resume=state_bytes is not None) or [
            (self.home, "none of its regions offers its types", True)]
        region, why, _likely = ranked[0]
        self.region, self.failed_rounds = region, 0
        skipped = [r for r, _why, likely in ranked if not likely]
        reason = ("the lowest expected cost among the job's regions"
                  + (" with capacity" if skipped else ""))
        if skipped:
            reason += "; " + ", ".join(
                f"{r} has none for {', '.join(self._offered(r))} (placement score 1)"
                for r in skipped)
        log.info("starting in %s: %s", region, why)
        return codec.Region(region=region, cause="start", reason=reason, home=self.home,
                            estimate=why)

    def _offered(self, region: str) -> list[str]:
        return [t for t in self.spec.resources.instance_types if catalog.pools(t, region)]

    def pools(self, price_at: Callable[[Pool], float], az: str | None = None) -> list[Pool]:
        """The pools of a launch round in the group's region, in launch order: the
        job's types in order, the cheapest AZ first right now (``price_at``); with
        ``az``, that AZ's only (a multi-node job's nodes)."""
        assert self.region is not None, "the region is chosen before the first round"
        ordered: list[Pool] = []
        for instance_type in self.spec.resources.instance_types:
            found = [p for p in catalog.pools(instance_type, self.region)
                     if az is None or p.az == az]
            ordered += sorted(found, key=lambda p: (price_at(p), p.az))
        return ordered

    def launched(self) -> None:
        """A round found capacity."""
        self.failed_rounds = 0

    def failed(self) -> bool:
        """A round found no capacity: whether the job should move now (the bound is
        reached, and the job has another region)."""
        self.failed_rounds += 1
        return self.failed_rounds >= MOVE_AFTER_FAILED_ROUNDS and len(self.regions) > 1

    def move(self, state_bytes: int | None) -> codec.Region | None:
        """Leave the group's region (dry now) for the best region not dry (all open
        again when every one is), a checkpoint of ``state_bytes`` to restore there;
        None when no other region offers the job's types (it stays, and retries)."""
        previous, tries = self.region, self.failed_rounds
        assert previous is not None
        ranked = [item for item in self.rank(state_bytes, resume=state_bytes is not None)
                  if item[0] != previous]
        if not ranked:
            self.failed_rounds = 0
            return None
        self.dry.add(previous)
        if all(region in self.dry for region, _why, _likely in ranked):
            self.dry = {previous}  # every region tried: all open again, but this one
        region, why, _likely = next(item for item in ranked if item[0] not in self.dry)
        self.region, self.failed_rounds = region, 0
        reason = (f"no capacity in {previous} for {', '.join(self._offered(previous))} "
                  f"after {tries} {'try' if tries == 1 else 'tries'}")
        log.info("moving from %s to %s: %s; %s", previous, region, reason, why)
        return codec.Region(region=region, previous=previous, cause="no-capacity",
                            reason=reason, home=self.home, tries=tries, estimate=why)

    def resume_in(self, region: str) -> None:
        """A restarted supervisor takes over in the region its predecessor chose."""
        self.region, self.failed_rounds = region, 0

    def resume(self, choices: Sequence[codec.Region]) -> None:
        """A new owner of the group (a restarted supervisor, a notebook that attached to
        an AWS job) carries on from the group's region choices so far (the fold's
        ``regions``, in time order): in the newest one's region, with the regions the
        moves left dry still dry, as :meth:`move` left them."""
        self.dry = set()
        for choice in choices:
            if choice.cause == "no-capacity" and choice.previous:
                self.dry.add(choice.previous)
                if all(r in self.dry for r in self.regions if r != choice.previous):
                    self.dry = {choice.previous}  # every region tried: all open again
        if choices:
            self.resume_in(choices[-1].region)


@dataclasses.dataclass
class TransferMeter:
    """Bills the checkpoint's crossings between regions (module docstring): fed the
    job's events in the order a follower reads them, it says which ``transfer`` events
    to write. ``counted``: the keys already written (a restarted supervisor's
    predecessor's, from the group's stream)."""

    home: str
    counted: set[str] = dataclasses.field(default_factory=set)
    newest_bytes: int = 0  # the newest durable checkpoint's (what a restore reads)

    def see(self, event: Event, region_of: Mapping[str, str]) -> list[codec.Transfer]:
        """The crossings ``event`` makes (``region_of``: the region of each instance)."""
        body = codec.peek(event)
        region = region_of.get(event.instance or "")
        if isinstance(body, codec.CheckpointEvent) and body.durable and not body.sync:
            self.newest_bytes = body.bytes
            if region is not None and region != self.home and body.bytes:
                return self._bill("save", f"save:{event.attempt}:{body.id or body.step}",
                                  body.bytes, region, self.home, body.step)
        elif (isinstance(body, codec.Status) and body.state == "booting" and not body.retrying
              and region is not None and region != self.home and self.newest_bytes):
            return self._bill("restore", f"restore:{event.attempt}", self.newest_bytes,
                              self.home, region, None)
        return []

    def _bill(self, kind: str, key: str, size: int, source: str, destination: str,
              step: int | None) -> list[codec.Transfer]:
        if key in self.counted:
            return []
        self.counted.add(key)
        per_gb = transfer_price(source, destination)
        return [codec.Transfer(kind=kind, bytes=size, source=source, destination=destination,
                               usd=size / GB * per_gb, usd_per_gb=per_gb, key=key,
                               step=step)]

