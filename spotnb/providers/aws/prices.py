"""Prices, GPUs and placement scores from AWS, each falling back to the bundled catalog.

Every answer says where it comes from (``source``), so the picker and the dashboard can
show whether a number is live or the catalog's snapshot (with its date):

* spot: ``ec2:DescribeSpotPriceHistory`` with ``StartTime=now`` (the price in force in
  each AZ). A record older than the 90 days AWS keeps cannot be current (moto answers
  with a placeholder from 2006): it counts as unavailable;
* on-demand: the Pricing API (``pricing:GetProducts``, Linux, shared tenancy);
* GPUs: ``ec2:DescribeInstanceTypes`` (``GpuInfo``);
* placement scores: ``ec2:GetSpotPlacementScores`` (1-10 per AZ).

Lookups are best-effort: one attempt, short timeouts, then the bundled data.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from spotnb.providers import PoolPrice, catalog
from spotnb.providers.aws import _boto

__all__ = ["az_ids", "gpu_info", "ondemand_price", "placement_scores", "pool_price",
           "spot_prices"]

log = logging.getLogger(__name__)

HISTORY_DAYS = 90  # how far back describe_spot_price_history reaches
LINUX = "Linux/UNIX"
# The Pricing API lives in a few regions only; us-east-1 answers for every region.
PRICING_REGION = "us-east-1"
_LOOKUP_TIMEOUT = 10.0


def _quick(service: str, region: str) -> Any:
    return _boto.client(service, region, attempts=1, read_timeout=_LOOKUP_TIMEOUT)


def az_ids(region: str, ec2: Any = None) -> dict[str, str]:
    """AZ name -> AZ id (``us-east-1a`` -> ``use1-az6``) for this account."""
    ec2 = ec2 or _quick("ec2", region)
    zones = ec2.describe_availability_zones()["AvailabilityZones"]
    return {z["ZoneName"]: z.get("ZoneId", z["ZoneName"]) for z in zones}


def spot_prices(instance_type: str, region: str, ec2: Any = None,
                now: datetime.datetime | None = None) -> dict[str, tuple[float, float]]:
    """Current spot price per AZ *name*: {az: (USD/hour, epoch of the price's start)}.

    Empty when AWS has no current record (see the module docstring).
    """
    ec2 = ec2 or _quick("ec2", region)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    reply = ec2.describe_spot_price_history(
        InstanceTypes=[instance_type], ProductDescriptions=[LINUX], StartTime=now,
        EndTime=now)
    oldest = now - datetime.timedelta(days=HISTORY_DAYS)
    found: dict[str, tuple[float, float]] = {}
    for row in reply.get("SpotPriceHistory", ()):
        stamp = row["Timestamp"]
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=datetime.timezone.utc)
        if stamp < oldest:
            continue
        az = row["AvailabilityZone"]
        if az not in found or stamp.timestamp() > found[az][1]:
            found[az] = (float(row["SpotPrice"]), stamp.timestamp())
    return found


def ondemand_price(instance_type: str, region: str, pricing: Any = None) -> float | None:
    """The Linux on-demand USD/hour from the Pricing API, or None."""
    pricing = pricing or _quick("pricing", PRICING_REGION)
    filters = [
        ("instanceType", instance_type), ("regionCode", region), ("operatingSystem", "Linux"),
        ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"),
    ]
    reply = pricing.get_products(
        ServiceCode="AmazonEC2", MaxResults=10,
        Filters=[{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in filters])
    for item in reply.get("PriceList", ()):
        product = json.loads(item) if isinstance(item, str) else item
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = dimension.get("pricePerUnit", {}).get("USD")
                if usd and float(usd) > 0:
                    return float(usd)
    return None


def pool_price(instance_type: str, region: str, az: str | None = None) -> PoolPrice:
    """Spot and on-demand price of a type (in one AZ *id*, or its cheapest AZ).

    Live where AWS answers, else the bundled catalog; ``source`` says which and why.
    """
    spot: float | None = None
    where: str | None = az
    notes: list[str] = []
    try:
        ids = az_ids(region)
        live = {ids.get(name, name): price for name, (price, _) in
                spot_prices(instance_type, region).items()}
        if az is not None:
            live = {k: v for k, v in live.items() if k == az}
        if live:
            where, spot = min(live.items(), key=lambda kv: kv[1])
            notes.append(f"spot: EC2 spot price history (live, {len(live)} AZs)")
        else:
            notes.append("spot: EC2 has no current spot price")
    except Exception as err:
        notes.append(f"spot: EC2 unavailable ({_boto.error_code(err) or type(err).__name__})")
    if spot is None:
        pools = [p for p in catalog.pools(instance_type, region) if az is None or p.az == az]
        if pools:
            where, spot = pools[0].az, pools[0].spot
            notes[-1] += f", so spotnb's bundled catalog ({catalog.DATA_DATE['catalog']})"
    ondemand: float | None = None
    try:
        ondemand = ondemand_price(instance_type, region)
        if ondemand is not None:
            notes.append("on-demand: AWS Pricing API (live)")
    except Exception as err:
        notes.append(f"on-demand: Pricing API unavailable "
                     f"({_boto.error_code(err) or type(err).__name__})")
    if ondemand is None:
        ondemand = catalog.ondemand_price(instance_type, region)
        notes.append(f"on-demand: spotnb's bundled catalog ({catalog.DATA_DATE['catalog']})")
    return PoolPrice(instance_type=instance_type, region=region, az=where, spot=spot,
                     ondemand=ondemand, source="; ".join(notes))


def gpu_info(instance_types: list[str], region: str) -> dict[str, dict[str, Any]]:
    """GPU model, count and memory per type from EC2, else from the bundled catalog."""
    out: dict[str, dict[str, Any]] = {}
    try:
        reply = _quick("ec2", region).describe_instance_types(InstanceTypes=instance_types)
        for row in reply.get("InstanceTypes", ()):
            gpus = (row.get("GpuInfo") or {}).get("Gpus") or [{}]
            out[row["InstanceType"]] = {
                "gpu_model": gpus[0].get("Name"), "gpu_count": gpus[0].get("Count", 0),
                "gpu_memory_mib": (gpus[0].get("MemoryInfo") or {}).get("SizeInMiB"),
                "vcpus": row.get("VCpuInfo", {}).get("DefaultVCpus"),
                "memory_gib": row.get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024,
                "source": "EC2 DescribeInstanceTypes (live)",
            }
    except Exception as err:
        log.info("describe_instance_types unavailable: %s", err)
    known = catalog.instance_types()
    for name in instance_types:
        if name not in out and name in known:
            t = known[name]
            out[name] = {"gpu_model": t.gpu_model, "gpu_count": t.gpu_count,
                         "gpu_memory_mib": t.gpu_memory_mib, "vcpus": t.vcpus,
                         "memory_gib": t.memory_gib,
                         "source": f"spotnb's bundled catalog ({catalog.DATA_DATE['catalog']})"}
    return out


def placement_scores(instance_types: list[str], region: str) -> tuple[dict[str, int], str]:
    """Spot placement score (1-10) per AZ id, and the source; empty when unavailable.

    The bundled fallback is the Spot Advisor's interruption bucket, which is a
    different measure: the picker shows that instead, and says so.
    """
    try:
        reply = _quick("ec2", region).get_spot_placement_scores(
            InstanceTypes=instance_types, TargetCapacity=1, SingleAvailabilityZone=True,
            RegionNames=[region])
    except Exception as err:
        return {}, (f"placement scores unavailable ({_boto.error_code(err) or type(err).__name__});"
                    f" see the Spot Advisor's interruption rates ({catalog.DATA_DATE['advisor']})")
    scores = {row.get("AvailabilityZoneId", row.get("Region", "")): int(row["Score"])
              for row in reply.get("SpotPlacementScores", ())}
    return scores, "EC2 spot placement scores (live)"
