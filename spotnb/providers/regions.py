"""Regions: where a job may run, and what running there is expected to cost.

**A job's regions.** ``%%spot_train --region us-east-1,us-west-2`` (``spotnb.submit(...,
region=["us-east-1", "us-west-2"])``) names the regions a job may run in, in the order
of preference; ``--region any`` stands for the regions the user allows
(:func:`allowed_regions`: ``SpotMagics.allowed_regions``, else
``$SPOTNB_ALLOWED_REGIONS``). The first is the job's *home*: its store stays there
(``Resources.region``), wherever its instances run; all of them are kept in
``Resources.regions``. :func:`job_regions` checks them before anything starts: a region
the catalog does not know (with the closest names), one outside the allowed list, one
where none of the job's instance types is offered, ``any`` with nothing allowed.

**The expected cost** of a job on an instance type in a region, :func:`expected_cost`,
is the one figure the instance picker ranks rows by and a launch ranks the job's regions
by (:func:`rank_regions`). A job is ``work_hours`` of training on one reference GPU:

* useful wall time ``T = work_hours / (speed * nodes)``: ``speed`` is an instance's
  training throughput in reference GPUs (the catalog's GPU figures:
  ``data/gpu_throughput.csv``), nodes scale perfectly;
* interruptions arrive at the Spot Advisor bucket's upper bound read as interruptions per
  instance-month (``<5%`` -> 0.05 a month, ``>20%`` -> 1), as the local cloud's hazard
  does, on each of the ``nodes`` instances; each costs half a checkpoint interval of lost
  work plus :data:`RESTART_HOURS`; so the billed hours per instance are
  ``H = T / (1 - nodes * rate * overhead)``, and the spot cost ``H * spot * nodes``;
* the checkpoint crosses regions when the region is not home: each restore (every
  interruption's, and the first start's when the job resumes) downloads the state to
  every node from the home store, priced at the home region's inter-region transfer
  rate; each save (every checkpoint interval, and each interruption's forced save)
  uploads it once, at the running region's rate (AWS charges the sending region only:
  ``data/aws_inter_region_transfer.csv``, ``data/SOURCES.md``);
* the store's requests, wherever the instances run (:mod:`spotnb.protocol.usage`'s
  list prices): per save :data:`SAVE_WRITES` writes plus one per
  :data:`S3_PART_BYTES` of state, per restore and node :data:`RESTORE_READS` reads;
* and, when known, the Spot placement score of the region (:mod:`.placement`): a region
  scored :data:`NO_CAPACITY_SCORE` is "not likely to succeed" (AWS) and ranks after every
  region that is, whatever it costs.

The total is what the picker shows as the job's cost and what the ranking sorts by.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import math
import os
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from spotnb.protocol import usage
from spotnb.protocol.spec import SpecError
from spotnb.providers import catalog

if TYPE_CHECKING:
    from spotnb.protocol.spec import JobSpec
    from spotnb.providers.placement import PlacementScores

__all__ = [
    "ANY",
    "ENV_ALLOWED",
    "NO_CAPACITY_SCORE",
    "RANKING_HOURS",
    "ExpectedCost",
    "RegionChoice",
    "allowed_regions",
    "catalog_cost",
    "expected_cost",
    "job_regions",
    "rank_regions",
    "region_names",
    "transfer_price",
]

#: ``--region any``: the regions the user allows.
ANY = "any"
#: The allowed regions for code that sets none itself (comma-separated names).
ENV_ALLOWED = "SPOTNB_ALLOWED_REGIONS"

#: The Spot Advisor's month, as the local cloud reads it (30 days).
MONTH_HOURS = 30 * 24.0
#: A replacement's launch, boot and checkpoint restore: a few minutes on EC2.
RESTART_HOURS = 5 / 60
#: EC2's spot placement scores run from 1 to 10; AWS documents 1 as "not likely to
#: succeed" (the AWS provider refuses a multi-node AZ scored this: ``aws/cluster.py``).
NO_CAPACITY_SCORE = 1
#: A launch ranks regions by the cost of this many hours of the job's work: the next
#: hour there, a move's restore included (the job's own length is unknown).
RANKING_HOURS = 1.0
#: The interval costs count when a job checkpoints every N steps (time unknown).
STEPS_CHECKPOINT_SECONDS = 600.0

#: Requests of one checkpoint save besides its data parts: the manifest, the ``LATEST``
#: pointer, the multipart upload's create and complete, the listing that prunes old
#: checkpoints (``spec.CheckpointEvery``: "about five requests").
SAVE_WRITES = 5
#: A restore reads ``LATEST``, the manifest and the checkpoint file, on every node.
RESTORE_READS = 3
#: A checkpoint file goes up in parts of this size, a write request each
#: (``spotnb.providers.aws.store.STREAM_PART_BYTES``; a test holds them equal).
S3_PART_BYTES = 16 * 2**20
#: Bytes in a GB of transfer: AWS's transfer prices do not say which GB they mean, and
#: the decimal one is the dearer reading (2**30 would be 7% less).
GB = 10**9

_TRANSFER = "aws_inter_region_transfer.csv"


# ----------------------------------------------------------------- the job's regions


def _names(value: Any, what: str, field: str | None) -> list[str]:
    """Region names from one comma-separated string or a sequence of strings."""
    items = [value] if isinstance(value, str) else value
    if isinstance(value, (bytes, bytearray)) or not isinstance(items, Sequence) or not all(
            isinstance(item, str) for item in items):
        raise SpecError(f"{what} must be region names such as 'us-east-1' (one, a "
                        f"comma-separated list, or a list of them), not {value!r}",
                        field=field)
    return list(dict.fromkeys(part.strip() for item in items for part in item.split(",")
                              if part.strip()))


def allowed_regions(configured: Any = None) -> tuple[str, ...]:
    """The regions the user allows jobs to run in, in order: ``configured`` (the
    magics' ``SpotMagics.allowed_regions``) when it names any, else
    ``$SPOTNB_ALLOWED_REGIONS``; empty when neither does (no restriction: a job runs
    where it names, and ``--region any`` is refused). SpecError for an unknown name."""
    if configured:
        names = _names(configured, "{option}", "allowed_regions")
        for name in names:
            catalog.check_region(name, field="allowed_regions")
        return tuple(names)
    text = os.environ.get(ENV_ALLOWED, "")
    names = _names(text, f"${ENV_ALLOWED}", None)
    for name in names:
        try:
            catalog.check_region(name)
        except SpecError as err:
            raise SpecError(f"${ENV_ALLOWED}: {err}") from None
    return tuple(names)


_HOW_TO_ALLOW = ("%config SpotMagics.allowed_regions = ['us-east-1', 'us-west-2'] (or "
                 f"${ENV_ALLOWED}=us-east-1,us-west-2 for code outside a notebook)")


def region_names(value: Any, allowed: Sequence[str] = (),
                 field: str = "region") -> tuple[str, ...]:
    """The regions of ``value`` (a name, a comma-separated list, a list, or ``"any"``
    for the ``allowed`` regions), each one the catalog has, within ``allowed`` when it
    names any; SpecError (about ``field``) naming the next step otherwise."""
    names = _names(value, "{option}", field)
    if not names:
        raise SpecError("{option} is empty: name a region, e.g. us-east-1, a list "
                        "(us-east-1,us-west-2), or 'any' for the regions you allow",
                        field=field)
    if ANY in names:
        if names != [ANY]:
            others = ", ".join(n for n in names if n != ANY)
            raise SpecError(f"{{option}}: 'any' stands for every region you allow, alone; "
                            f"give either 'any' or region names ({others}), not both",
                            field=field)
        if not allowed:
            raise SpecError(
                "{option} any means the regions you allow, and you allow none yet: set "
                f"them with {_HOW_TO_ALLOW}, or name the regions: us-east-1,us-west-2",
                field=field)
        return tuple(allowed)
    for name in names:
        catalog.check_region(name, field=field)
    outside = [name for name in names if allowed and name not in allowed]
    if outside:
        raise SpecError(
            f"{{option}}: {', '.join(outside)} {'is' if len(outside) == 1 else 'are'} not "
            f"among the regions you allow ({', '.join(allowed)}): choose among those "
            f"(or 'any'), or add {'it' if len(outside) == 1 else 'them'} to the allowed "
            f"regions: {_HOW_TO_ALLOW}", field=field)
    return tuple(names)


def job_regions(value: Any, instance_types: Sequence[str],
                allowed: Sequence[str] = ()) -> tuple[str, ...]:
    """The regions a job of ``instance_types`` may run in, home first, from what the
    user typed (:func:`region_names`); SpecError (about ``region``) naming the next
    step otherwise.

    ``any`` keeps the allowed regions that offer one of the types at least; a named
    region must offer one (the launch uses those of the job's types offered there).
    """
    names = region_names(value, allowed)
    types = list(dict.fromkeys(instance_types))
    for name in types:
        catalog.check_type_name(name)
    if ANY in _names(value, "{option}", "region"):
        found = tuple(name for name in names if _offered(types, name))
        if not found:
            raise SpecError(
                f"{{option}} any: none of {', '.join(types)} has a spot pool in the "
                f"regions you allow ({', '.join(names)}) in spotnb's catalog; "
                f"{_where_offered(types)}. Allow one of those, or choose types offered in "
                "yours with %spot_picker", field="region")
        return found
    for name in names:
        if not _offered(types, name):
            fix = (f"Drop {name}, or add a type offered there" if len(names) > 1 else
                   "Choose one of them as the region, or a type offered in " + name)
            raise SpecError(
                f"{{option}}: none of {', '.join(types)} has a spot pool in {name} in "
                f"spotnb's catalog ({catalog.DATA_DATE['catalog']}); "
                f"{_where_offered(types)}. {fix} (`spotnb catalog --region {name}`, "
                "%spot_picker)", field="region")
    return names


def _offered(types: Iterable[str], region: str) -> bool:
    return any(catalog.pools(name, region) for name in types)


def _where_offered(types: Sequence[str]) -> str:
    where = sorted({r for name in types for r in catalog.regions(name)})
    return (f"regions that have {'it' if len(types) == 1 else 'them'}: {', '.join(where)}"
            if where else "no region has a spot price for them")


# ------------------------------------------------------------------- transfer prices


@functools.cache
def _transfer_table() -> dict[tuple[str, str], float]:
    text = resources.files("spotnb").joinpath(f"data/{_TRANSFER}").read_text("utf-8")
    return {(row["source_region"], row["destination_region"]): float(row["usd_per_gb"])
            for row in csv.DictReader(io.StringIO(text))}


def transfer_price(source: str, destination: str) -> float:
    """USD per GB that AWS charges for data sent from ``source`` to another region
    ``destination`` (0 within a region). AWS prices it by the sending region; a pair the
    bundled table lacks gets the source's highest rate to any region, else the highest
    rate of the table (an upper bound, never an invented figure)."""
    if source == destination:
        return 0.0
    table = _transfer_table()
    price = table.get((source, destination))
    if price is not None:
        return price
    from_source = [p for (s, _d), p in table.items() if s == source]
    return max(from_source or table.values())


# --------------------------------------------------------------------- the cost


@dataclasses.dataclass(frozen=True)
class ExpectedCost:
    """What a job is expected to cost on one instance type in one region, its store in
    ``home`` (see the module docstring). Costs are USD for the whole job, every node."""

    instance_type: str
    region: str
    home: str
    wall_hours: float  # useful time, without interruptions
    billed_hours: float  # per instance, with the expected interruption overhead
    interruptions: float  # expected number, every node's
    spot_usd: float  # the instances' spot hours
    ondemand_usd: float | None  # the same useful time on on-demand instances
    transfer_gb: float  # checkpoint data crossing regions
    transfer_usd: float
    requests_usd: float  # the store's requests
    score: int | None = None  # the region's Spot placement score, if known
    decisive: bool = True  # whether a low score is to be believed (placement.py)

    @property
    def total_usd(self) -> float:
        """Everything the job is expected to cost here: instances, transfer, requests."""
        return self.spot_usd + self.transfer_usd + self.requests_usd

    @property
    def likely(self) -> bool:
        """False when EC2 says a spot request here is not likely to succeed."""
        return self.score is None or not self.decisive or self.score > NO_CAPACITY_SCORE

    def rank_key(self) -> tuple[bool, float]:
        """Sorts the cheapest first, every unlikely place after every likely one."""
        return (not self.likely, self.total_usd)


def expected_cost(*, instance_type: str, region: str, home: str, spot: float,
                  ondemand: float | None, interruption_max_pct: float | None,
                  speed: float, work_hours: float, checkpoint_seconds: float,
                  state_gb: float = 0.0, nodes: int = 1, resume: bool = False,
                  score: int | None = None, decisive: bool = True) -> ExpectedCost:
    """The expected cost of ``work_hours`` of reference-GPU work on ``nodes`` instances
    of ``instance_type`` in ``region`` at ``spot`` USD/h, each ``speed`` reference GPUs
    fast, checkpointing ``state_gb`` every ``checkpoint_seconds`` into the store in
    ``home``; ``resume``: the first start restores a checkpoint too (a move). Pure: the
    prices come from the caller (:func:`catalog_cost` reads them from the catalog)."""
    if not (speed > 0 and work_hours > 0 and checkpoint_seconds > 0 and nodes >= 1):
        raise ValueError("speed, work_hours, checkpoint_seconds and nodes must be above 0")
    wall = work_hours / (speed * nodes)
    rate = (interruption_max_pct or 0.0) / 100.0 / MONTH_HOURS * nodes
    overhead = checkpoint_seconds / 3600.0 / 2 + RESTART_HOURS
    # Overhead beyond an hour per hour of rate would never finish; cap it sanely.
    billed = wall / max(1e-9, 1.0 - rate * overhead)
    interruptions = rate * billed
    saves = billed * 3600.0 / checkpoint_seconds + interruptions
    restores = interruptions + (1.0 if resume else 0.0)
    down_gb = restores * nodes * state_gb
    up_gb = saves * state_gb
    transfer_usd = (down_gb * transfer_price(home, region)
                    + up_gb * transfer_price(region, home))
    parts = math.ceil(state_gb * GB / S3_PART_BYTES) if state_gb > 0 else 0
    requests_usd = (saves * (SAVE_WRITES + parts) * usage.PRICES["s3-write"]
                    + restores * nodes * RESTORE_READS * usage.PRICES["s3-read"])
    return ExpectedCost(
        instance_type=instance_type, region=region, home=home, wall_hours=wall,
        billed_hours=billed, interruptions=interruptions, spot_usd=billed * spot * nodes,
        ondemand_usd=wall * ondemand * nodes if ondemand is not None else None,
        transfer_gb=(down_gb + up_gb) if region != home else 0.0,
        transfer_usd=transfer_usd, requests_usd=requests_usd, score=score,
        decisive=decisive)


def instance_speed(instance_type: str, reference: str | None,
                   all_gpus: bool = False) -> float | None:
    """An instance's training throughput in ``reference`` GPUs (the catalog's figures):
    of one of its GPUs, or of all of them (perfect scaling) with ``all_gpus``; with
    ``reference`` None, in GPUs of its own model. None without a figure."""
    spec = catalog.instance_types().get(instance_type)
    if spec is None:
        return None
    count = spec.gpu_count if all_gpus else 1
    if reference is None:
        return float(count)
    speeds = catalog.gpu_speeds()
    ref, own = speeds.get(reference), speeds.get(spec.gpu_model)
    if ref is None or own is None:
        return None
    return count * own.training / ref.training


def catalog_cost(instance_type: str, region: str, *, home: str, work_hours: float,
                 checkpoint_seconds: float, reference: str | None = None,
                 all_gpus: bool = False, state_gb: float = 0.0, nodes: int = 1,
                 resume: bool = False, scores: PlacementScores | None = None
                 ) -> ExpectedCost | None:
    """:func:`expected_cost` at the bundled catalog's prices (the cheapest pool's spot
    price), Spot Advisor rate and GPU speed; ``scores`` gives the region's placement
    score when they cover the type. None when the type has no spot pool in the region
    or no speed figure against ``reference``."""
    found = catalog.pools(instance_type, region)
    speed = instance_speed(instance_type, reference, all_gpus)
    if not found or found[0].spot is None or not speed:
        return None
    bucket = catalog.interruption_bucket(instance_type, region)
    covered = scores is not None and scores.covers(instance_type)
    return expected_cost(
        instance_type=instance_type, region=region, home=home, spot=found[0].spot,
        ondemand=catalog.ondemand_price(instance_type, region),
        interruption_max_pct=bucket.max_pct if bucket else None, speed=speed,
        work_hours=work_hours, checkpoint_seconds=checkpoint_seconds, state_gb=state_gb,
        nodes=nodes, resume=resume,
        score=scores.region_score(region) if covered and scores else None,
        decisive=scores.decisive if covered and scores else True)


# ------------------------------------------------------------------ the launch's ranking


@dataclasses.dataclass(frozen=True)
class RegionChoice:
    """One of a job's regions, as :func:`rank_regions` ranks it: the expected cost of
    its best instance type there, and a sentence saying why it ranks where it does."""

    region: str
    cost: ExpectedCost
    why: str


def rank_regions(spec: JobSpec, *, state_bytes: int = 0,
                 scores: PlacementScores | None = None, resume: bool = False,
                 hours: float = RANKING_HOURS) -> list[RegionChoice]:
    """The job's regions (``spec.resources.regions``), best first, for a launch to try
    in turn: each by the expected cost of :data:`RANKING_HOURS` of its work on the best
    of its types offered there (at the catalog's prices, a checkpoint of
    ``state_bytes``, its store in the home region), regions that ``scores`` finds not
    likely to have capacity last; ties keep the job's own order. ``resume``: the job
    has a checkpoint to restore at the start (a move after a failure). Regions where
    none of its types is offered are left out."""
    res = spec.resources
    every = spec.policy.checkpoint_every
    seconds = every.seconds if every.seconds is not None else STEPS_CHECKPOINT_SECONDS
    reference = _reference(res.instance_types)
    state_gb = state_bytes / GB
    ranked: list[tuple[tuple[bool, float], int, RegionChoice]] = []
    for order, region in enumerate(res.regions):
        costs = [cost for name in res.instance_types if (cost := catalog_cost(
            name, region, home=res.region, work_hours=hours, checkpoint_seconds=seconds,
            reference=reference, all_gpus=res.procs_per_node > 1, state_gb=state_gb,
            nodes=res.max_nodes, resume=resume, scores=scores)) is not None]
        if not costs:
            continue
        best = min(costs, key=ExpectedCost.rank_key)
        ranked.append((best.rank_key(), order, RegionChoice(region, best, _why(best, hours))))
    ranked.sort(key=lambda item: (item[0], item[1]))
    return [choice for _key, _order, choice in ranked]


def _reference(types: Sequence[str]) -> str | None:
    specs, speeds = catalog.instance_types(), catalog.gpu_speeds()
    for name in types:
        spec = specs.get(name)
        if spec is not None and spec.gpu_model in speeds:
            return spec.gpu_model
    return None


def _why(cost: ExpectedCost, hours: float) -> str:
    where = "home" if cost.region == cost.home else f"store in {cost.home}"
    text = (f"{cost.instance_type} ${cost.total_usd:.2f} for {hours:g} h of work "
            f"(spot ${cost.spot_usd:.2f}, {cost.interruptions:.2f} interruptions, "
            f"transfer ${cost.transfer_usd:.2f}, {where})")
    if cost.score is not None:
        text += f", placement score {cost.score}/10"
        if not cost.likely:
            text += ": not likely to have capacity"
    return text
