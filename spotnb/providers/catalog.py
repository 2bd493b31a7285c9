"""The bundled catalog of GPU instance types, prices and interruption rates (offline).

Everything here comes from the data files in ``spotnb/data/`` (provenance in
``spotnb/data/SOURCES.md``); nothing is fetched and no number is invented:

* ``aws_gpu_catalog.csv``: specs, on-demand price and one spot price per availability
  zone (AZ *id*, e.g. ``use1-az4``) for GPU and accelerator types, a snapshot from about
  December 2024 to May 2025 (:data:`DATA_DATE`).
* ``spot_advisor_gpu.json``: AWS's Spot Instance Advisor feed as of 2025-06-28: the
  interruption-frequency bucket and average savings per (region, type), Linux.
* ``spot_price_history/``: real spot price-change events, p2/p3 from 2019-12 to 2020-03
  (AZ *names*) and GPU families on 2022-05-31 for six hours (AZ *ids*).

Files are parsed on first use and cached for the life of the process.

:func:`price_trace` gives the local cloud's market a price history per pool. It uses
real events of that instance type when the bundled history has them; otherwise it
takes the relative shape (price / median) of the longest real trace of a related type
and scales it to the pool's catalog spot price. The trace's ``source`` says which.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import difflib
import functools
import io
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from importlib import resources
from types import MappingProxyType
from typing import Any

from spotnb.protocol.spec import SpecError

__all__ = [
    "DATA_DATE",
    "GpuSpeed",
    "InstanceType",
    "InterruptionBucket",
    "Pool",
    "PriceTrace",
    "all_regions",
    "check_instance_type",
    "check_region",
    "check_type_name",
    "gpu_speeds",
    "instance_types",
    "interruption_bucket",
    "ondemand_price",
    "pools",
    "price_trace",
    "regions",
    "savings_pct",
]

#: How old each bundled data set is, for the UI's "price age".
DATA_DATE = MappingProxyType({
    "catalog": "2024-12..2025-05 snapshot",
    "advisor": "2025-06-28",
    "history": "2019-12-20..2020-03-23 (p2/p3) and 2022-05-31 (6 hours)",
})

_CATALOG = "aws_gpu_catalog.csv"
_THROUGHPUT = "gpu_throughput.csv"
# A Graviton family: letters, the generation, then suffix letters including a "g".
_GRAVITON = re.compile(r"[a-z]+\d+[a-z]*g[a-z]*")
_ADVISOR = "spot_advisor_gpu.json"
_HISTORY_2019 = "spot_price_history/aws_p2_p3_2019-12_2020-03.csv"
_HISTORY_2022 = "spot_price_history/aws_gpu_2022-05-31_partial_azid.csv"
_LINUX = "Linux/UNIX"

# A real trace of the pool's own type is used from two events on (one event is a price
# level, not a trace). A trace lends its shape to other types only from this many
# events on: the 2022 file has at most two per pool, the 2019-20 file hundreds.
_MIN_REAL_POINTS = 2
_MIN_SHAPE_POINTS = 20
# The shape of last resort: the best-covered GPU trace in the bundled history.
_FALLBACK_SHAPE = ("p3.2xlarge", "us-east-1")


@dataclasses.dataclass(frozen=True)
class InstanceType:
    """One instance type's hardware. ``gpu_memory_mib`` is per GPU (None if unknown)."""

    name: str
    family: str
    gpu_model: str
    gpu_count: int
    gpu_manufacturer: str
    gpu_memory_mib: int | None
    vcpus: int
    memory_gib: float

    @property
    def cpu_arch(self) -> str:
        """``"arm64"`` for Graviton types (a ``g`` after the generation number in the
        family, AWS's naming: ``g5g``), else ``"x86_64"``."""
        return "arm64" if _GRAVITON.fullmatch(self.family) else "x86_64"

    @property
    def cuda(self) -> bool:
        """Whether CUDA training runs here as usual: NVIDIA GPUs on an x86 host (the
        PyTorch wheels most code uses are built for x86)."""
        return self.gpu_manufacturer == "NVIDIA" and self.cpu_arch == "x86_64"


@dataclasses.dataclass(frozen=True)
class GpuSpeed:
    """A GPU model's training speed and where the figure is from
    (``data/gpu_throughput.csv``; ``data/SOURCES.md`` says how to read it).

    ``training`` is mixed-precision training throughput in V100s (V100 = 1), averaged
    over a benchmark's models; ``measured`` says whether it is a published measurement
    or derived from the datasheet peaks (``tflops``: dense FP16 Tensor Core,
    ``bandwidth_gbs``: memory) by a fit on the measured GPUs.
    """

    gpu_model: str
    training: float
    measured: bool
    tflops: float
    bandwidth_gbs: float
    basis: str
    source: str


@dataclasses.dataclass(frozen=True)
class Pool:
    """A spot pool: one instance type in one availability zone (AZ id), USD/hour."""

    instance_type: str
    region: str
    az: str
    ondemand: float | None
    spot: float | None

    @property
    def name(self) -> str:
        """``"<type>@<az>"``, how events and settings name a pool."""
        return f"{self.instance_type}@{self.az}"


@dataclasses.dataclass(frozen=True)
class InterruptionBucket:
    """A Spot Advisor interruption-frequency bucket (AWS's trailing-month estimate).

    ``index`` 0-4, ``label`` as AWS shows it (``"<5%"`` ... ``">20%"``), ``max_pct``
    the feed's upper bound of the bucket (5, 11, 16, 22, 100).
    """

    index: int
    label: str
    max_pct: float


@dataclasses.dataclass(frozen=True)
class PriceTrace:
    """A pool's spot price history: ``points`` are (epoch seconds, USD/hour), in order.

    ``source`` says where the numbers come from; ``scaled`` is True when they are a
    related type's shape scaled to this pool's catalog price rather than its own history.
    """

    instance_type: str
    region: str
    az: str
    points: tuple[tuple[float, float], ...]
    source: str
    scaled: bool = False


# ---------------------------------------------------------------------------- loading


def _read_text(name: str) -> str:
    return resources.files("spotnb").joinpath(f"data/{name}").read_text(encoding="utf-8")


def _rows(name: str) -> Iterable[dict[str, str]]:
    return csv.DictReader(io.StringIO(_read_text(name)))


def _opt_float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _epoch(timestamp: str) -> float:
    # fromisoformat accepts "Z" only from Python 3.11 on.
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


@functools.cache
def _catalog() -> tuple[dict[str, InstanceType], tuple[Pool, ...]]:
    types: dict[str, InstanceType] = {}
    all_pools: list[Pool] = []
    for row in _rows(_CATALOG):
        name = row["instance_type"]
        if name not in types:
            mem = row["accelerator_memory_mib"]
            types[name] = InstanceType(
                name=name,
                family=row["family"],
                gpu_model=row["accelerator_name"],
                gpu_count=int(row["accelerator_count"]),
                gpu_manufacturer=row["accelerator_manufacturer"],
                gpu_memory_mib=int(mem) if mem else None,
                vcpus=int(row["vcpus"]),
                memory_gib=float(row["memory_gib"]),
            )
        all_pools.append(Pool(
            instance_type=name,
            region=row["region"],
            az=row["availability_zone_id"],
            ondemand=_opt_float(row["ondemand_price_usd_per_hour"]),
            spot=_opt_float(row["spot_price_usd_per_hour"]),
        ))
    return types, tuple(all_pools)


@functools.cache
def _pools_by_key() -> dict[tuple[str, str], tuple[Pool, ...]]:
    grouped: dict[tuple[str, str], list[Pool]] = defaultdict(list)
    for pool in _catalog()[1]:
        grouped[pool.instance_type, pool.region].append(pool)
    return {key: tuple(sorted(ps, key=lambda p: p.az)) for key, ps in grouped.items()}


@functools.cache
def _advisor() -> tuple[dict[str, Any], tuple[InterruptionBucket, ...]]:
    raw = json.loads(_read_text(_ADVISOR))
    buckets = tuple(
        InterruptionBucket(index=int(r["index"]), label=r["label"], max_pct=float(r["max"]))
        for r in sorted(raw["ranges"], key=lambda r: r["index"])
    )
    return raw["spot_advisor"], buckets


# Real traces keyed by (instance type, region, zone). 2019-20 zones are AZ names
# (us-east-1b), 2022 zones are AZ ids (use1-az4).
_Trace = tuple[tuple[float, float], ...]


def _collect(events: Iterable[tuple[tuple[str, str, str], float, float]]) -> dict[
        tuple[str, str, str], _Trace]:
    by_key: dict[tuple[str, str, str], dict[float, float]] = defaultdict(dict)
    for key, t, price in events:
        by_key[key][t] = price  # an exact duplicate time keeps the last price
    return {key: tuple(sorted(pts.items())) for key, pts in by_key.items()}


@functools.cache
def _history_2019() -> dict[tuple[str, str, str], _Trace]:
    return _collect(
        ((r["instance_type"], r["region"], r["availability_zone"]),
         _epoch(r["timestamp"]), float(r["spot_price_usd_per_hour"]))
        for r in _rows(_HISTORY_2019) if r["product_description"] == _LINUX
    )


@functools.cache
def _history_2022() -> dict[tuple[str, str, str], _Trace]:
    region_of = {p.az: p.region for p in _catalog()[1]}
    return _collect(
        ((r["instance_type"], region_of.get(r["availability_zone_id"], ""),
          r["availability_zone_id"]),
         _epoch(r["timestamp"]), float(r["spot_price_usd_per_hour"]))
        for r in _rows(_HISTORY_2022) if r["product_description"] == _LINUX
    )


# ------------------------------------------------------------------------- public API


def instance_types() -> dict[str, InstanceType]:
    """Every instance type in the catalog, by name."""
    return dict(_catalog()[0])


@functools.cache
def gpu_speeds() -> dict[str, GpuSpeed]:
    """Training speed per GPU model (NVIDIA models only), :class:`GpuSpeed`."""
    return {row["gpu_model"]: GpuSpeed(
                row["gpu_model"], float(row["training_speed"]), row["kind"] == "measured",
                float(row["fp16_tensor_tflops"]), float(row["memory_bandwidth_gbs"]),
                row["basis"], row["source"])
            for row in _rows(_THROUGHPUT)}


def all_regions() -> list[str]:
    """Every region the catalog has prices for."""
    return sorted({p.region for p in _catalog()[1]})


def pools(instance_type: str, region: str) -> list[Pool]:
    """The spot pools of a type in a region (only those with a spot price), cheapest first."""
    found = [p for p in _pools_by_key().get((instance_type, region), ()) if p.spot is not None]
    return sorted(found, key=lambda p: (p.spot, p.az))


def regions(instance_type: str) -> list[str]:
    """The regions where ``instance_type`` has at least one spot pool."""
    return sorted({
        region for (name, region), ps in _pools_by_key().items()
        if name == instance_type and any(p.spot is not None for p in ps)
    })


def ondemand_price(instance_type: str, region: str) -> float | None:
    """The Linux on-demand price in USD/hour, or None if the catalog has none."""
    for pool in _pools_by_key().get((instance_type, region), ()):
        if pool.ondemand is not None:
            return pool.ondemand
    return None


def _advisor_entry(instance_type: str, region: str) -> dict[str, Any] | None:
    advice, _ = _advisor()
    entry = advice.get(region, {}).get("Linux", {}).get(instance_type)
    return entry if isinstance(entry, dict) else None


def interruption_bucket(instance_type: str, region: str) -> InterruptionBucket | None:
    """The Spot Advisor interruption-frequency bucket (Linux), or None if not listed."""
    entry = _advisor_entry(instance_type, region)
    if entry is None:
        return None
    return _advisor()[1][int(entry["r"])]


def savings_pct(instance_type: str, region: str) -> float | None:
    """The Spot Advisor's average spot saving versus on-demand in percent (Linux)."""
    entry = _advisor_entry(instance_type, region)
    return float(entry["s"]) if entry is not None else None


def price_trace(instance_type: str, region: str, az: str) -> PriceTrace:
    """The spot price history the local cloud replays for one pool (see module docstring).

    Order of preference:

    1. Real events of this type in this AZ id (2022 file), or in this region (2019-20
       file, whose AZ *names* are per-account: the pool's AZ ids and the history's AZ
       names are paired in sorted order); the longer of the two wins.
    2. Otherwise the longest real trace of the same family, else of the same GPU model,
       else of p3.2xlarge in us-east-1, divided by its median and multiplied by this
       pool's catalog spot price.

    Every price is capped at the pool's on-demand price. Raises :class:`LookupError`
    if the pool is unknown, or has no spot price and no history of its own.
    """
    known = _pools_by_key().get((instance_type, region), ())
    pool = next((p for p in known if p.az == az), None)
    if pool is None:
        raise LookupError(f"no pool {instance_type}@{az} in {region} in spotnb's catalog")
    cap = pool.ondemand if pool.ondemand is not None else float("inf")

    own = _own_trace(pool, [p.az for p in known])
    if own is not None:
        points, source = own
        return PriceTrace(instance_type, region, az, _capped(points, cap), source)

    if pool.spot is None:
        raise LookupError(
            f"{instance_type}@{az} has no spot price in the catalog and no price history"
        )
    ref_key, ref = _shape_reference(instance_type)
    median = statistics.median(price for _, price in ref)
    points = tuple((t, round(price / median * pool.spot, 6)) for t, price in ref)
    ref_type, ref_region, ref_zone = ref_key
    source = (
        f"no bundled price history for {instance_type} in {az}: the shape of the real "
        f"{ref_type} {ref_zone} history ({_span(ref)}, {len(ref)} events; price divided "
        f"by its median ${median:.4f}/h) scaled to this pool's catalog spot price "
        f"${pool.spot:.4f}/h ({DATA_DATE['catalog']})"
    )
    if ref_region not in ref_zone:
        source += f" in {ref_region}"
    return PriceTrace(instance_type, region, az, _capped(points, cap), source, scaled=True)


def _own_trace(pool: Pool, region_azs: list[str]) -> tuple[_Trace, str] | None:
    candidates: list[tuple[_Trace, str]] = []
    by_id = _history_2022().get((pool.instance_type, pool.region, pool.az))
    if by_id is not None and len(by_id) >= _MIN_REAL_POINTS:
        candidates.append((by_id, (
            f"real spot price history of {pool.instance_type} in {pool.az} ({_span(by_id)}, "
            f"{len(by_id)} events; ericpauley/aws-spot-price-history)"
        )))
    names = sorted(zone for (name, region, zone) in _history_2019()
                   if name == pool.instance_type and region == pool.region)
    if names:
        zone = names[region_azs.index(pool.az) % len(names)]
        trace = _history_2019()[pool.instance_type, pool.region, zone]
        if len(trace) >= _MIN_REAL_POINTS:
            candidates.append((trace, (
                f"real spot price history of {pool.instance_type} in {zone} ({_span(trace)}, "
                f"{len(trace)} events; stanford-futuredata/training_on_a_dime); AZ names "
                f"differ per AWS account, so {zone} stands in for {pool.az}"
            )))
    return max(candidates, key=lambda c: len(c[0]), default=None)


@functools.cache
def _shape_reference(instance_type: str) -> tuple[tuple[str, str, str], _Trace]:
    types = _catalog()[0]
    this = types[instance_type]
    traces = {**_history_2019(), **_history_2022()}
    usable = {k: v for k, v in traces.items() if len(v) >= _MIN_SHAPE_POINTS}

    def gpu_base(name: str) -> str | None:
        t = types.get(name)
        return t.gpu_model.split("-")[0] if t else None

    related = [
        [k for k in usable if k[0].split(".")[0] == this.family],
        [k for k in usable if gpu_base(k[0]) == gpu_base(instance_type)],
        [k for k in usable if k[:2] == _FALLBACK_SHAPE],
    ]
    for keys in related:
        if keys:
            best = max(keys, key=lambda k: (len(usable[k]), k))
            return best, usable[best]
    raise TypeError("the bundled price history has no usable trace; this is a spotnb bug")


def _capped(points: _Trace, cap: float) -> _Trace:
    return tuple((t, min(price, cap)) for t, price in points)


def _span(points: _Trace) -> str:
    def fmt(t: float) -> str:
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M")

    return f"{fmt(points[0][0])}..{fmt(points[-1][0])} UTC"


def check_region(region: str, field: str | None = None) -> str:
    """``region`` if the catalog has prices there; else :class:`SpecError` with close
    matches (``us-east1`` -> ``us-east-1``) and the regions it has. ``field`` is the
    argument the region came from, for the error to name it."""
    known_regions = all_regions()
    if region in known_regions:
        return region
    close = difflib.get_close_matches(region, known_regions, n=3)
    hint = f"did you mean {_or(close)}? " if close else ""
    where = "{option}: " if field else ""
    raise SpecError(
        f"{where}unknown AWS region {region!r}: {hint}spotnb's catalog has GPU prices "
        f"for {', '.join(known_regions)}", field=field)


def check_instance_type(name: str, region: str = "us-east-1") -> InstanceType:
    """Return the type if it has spot pools in ``region``; else raise :class:`SpecError`.

    The message names close matches for a misspelt type or region, and the regions
    that do have the type, and says where to look next.
    """
    check_region(region)
    found = check_type_name(name)
    if not pools(name, region):
        where = regions(name)
        if where:
            raise SpecError(
                f"{name} has no spot pool in {region} in spotnb's catalog "
                f"({DATA_DATE['catalog']}); regions that have it: {', '.join(where)}. "
                "Choose one of them as the region, or another type with %spot_picker."
            )
        raise SpecError(
            f"{name} has no spot price in any region of spotnb's catalog "
            f"({DATA_DATE['catalog']}); pick another type with %spot_picker."
        )
    return found


def check_type_name(name: str) -> InstanceType:
    """The catalog's :class:`InstanceType` called ``name``, wherever it is offered; else
    :class:`SpecError` naming close matches (a typo) or saying that the catalog covers
    GPU and accelerator types only (``m5.large``), and where to look next."""
    types = _catalog()[0]
    if name not in types:
        families = sorted({t.family for t in types.values()})
        # A known family is a typo; an unknown one (m5.large) is probably not a GPU type.
        known_family = name.split(".")[0] in families
        close = difflib.get_close_matches(name, list(types), n=3,
                                          cutoff=0.6 if known_family else 0.85)
        hint = "" if known_family else (
            "spotnb's catalog covers GPU and accelerator instance types only "
            f"(families {', '.join(families)}). ")
        if close:
            hint += f"Did you mean {_or(close)}? " if hint else f"did you mean {_or(close)}? "
        raise SpecError(
            f"unknown instance type {name!r}: {hint}See the instance types with "
            "`spotnb catalog`, or pick one with %spot_picker."
        )
    return types[name]


def _or(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
