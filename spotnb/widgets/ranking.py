"""The instance picker's rows and their ranking, in plain Python (no widgets).

:func:`picker_rows` makes one :class:`PickerRow` per instance type with a spot pool in
each region asked (from :mod:`spotnb.providers.catalog`); :func:`estimate` prices a job
on a row with :func:`spotnb.providers.regions.expected_cost`, the function a launch
ranks a job's regions by too (compute at the spot price with interruptions, the
checkpoint's transfer to and from a home region elsewhere, the store's requests, and
the placement score when known); :func:`sort_rows` ranks rows by it (or by any column
of :data:`COLUMNS`), :func:`filter_rows` filters them. ``spotnb catalog`` and the
picker (:mod:`spotnb.widgets.picker`) share them.

The job is sized as ``N`` hours on one reference GPU. GPU models differ in speed: each
has a training throughput (``spotnb/data/gpu_throughput.csv``: published
mixed-precision training benchmarks where they exist, else a fit of the datasheet's
tensor peak and memory bandwidth on the measured GPUs; ``SOURCES.md`` has the sources),
so on an instance of ``g`` GPUs of a model ``r`` times the reference's speed the job's
useful time is ``N / r`` hours on one of its GPUs (the default: a notebook's training
loop mostly uses one), or ``N / (g * r)`` on all of them, scaling perfectly; the rest
of the estimate is :mod:`spotnb.providers.regions`'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from spotnb.providers import catalog
from spotnb.providers.regions import (
    MONTH_HOURS,
    RESTART_HOURS,
    ExpectedCost,
    expected_cost,
)

if TYPE_CHECKING:
    from spotnb.providers.placement import PlacementScores

__all__ = [
    "COLUMNS",
    "DEFAULT_COLUMNS",
    "MONTH_HOURS",
    "RESTART_HOURS",
    "Estimate",
    "PickerRow",
    "estimate",
    "filter_rows",
    "picker_rows",
    "sort_rows",
    "train_line",
]

#: What :func:`estimate` returns (the providers' :class:`ExpectedCost`).
Estimate = ExpectedCost

#: Prices older than this are shown as stale: spot prices move weekly.
STALE_DAYS = 7
#: The reference GPU when the default instance type's GPU has no speed figure.
FALLBACK_REFERENCE = "A10G"
#: The columns shown until "all columns" is ticked: the table then fits a notebook
#: cell (848 px in JupyterLab at 1280 px) without sideways scrolling. ``region`` takes
#: the place of the expected interruptions and the saving when the rows are of several
#: regions (the Spot Advisor bucket stays), ``est_transfer_usd`` joins them when a row
#: is away from home, ``placement`` when the rows' scores differ (a value every row
#: shares is said once, above the table).
DEFAULT_COLUMNS = ("instance_type", "gpu", "est_spot_usd", "est_hours", "est_interruptions",
                   "spot", "savings_pct", "interruption", "speed")
# The bundled catalog's prices: the snapshot's last month (catalog.DATA_DATE).
_YEAR_MONTH = re.compile(r"(\d{4})-(\d{2})")

#: The table's columns: key -> (label, tooltip). The first ones stay in view.
COLUMNS: dict[str, tuple[str, str]] = {
    "instance_type": ("type", "the instance type; click a row to choose it"),
    "region": ("region", "the region; the job's store stays in its home region, and a "
                         "job elsewhere pays to move its checkpoint there and back"),
    "gpu": ("GPUs", "GPU count, model and memory per GPU"),
    "est_spot_usd": ("job $ spot", "expected cost of the job on spot: interruptions, "
                                   "the checkpoint's transfer to and from the home "
                                   "region, and the store's requests included"),
    "est_hours": ("job hours", "expected billed hours, interruptions included"),
    "est_interruptions": ("interr.", "expected interruptions during the job"),
    "est_transfer_usd": ("transfer $", "moving the checkpoint between this region and "
                                       "the home region (AWS inter-region transfer)"),
    "placement": ("placement", "Spot placement score (1-10): how likely a spot request "
                               "for the job's count is to succeed here; 1 ranks last"),
    "est_ondemand_usd": ("job $ on-demand", "the same job on on-demand instances"),
    "spot": ("spot $/h", "the cheapest zone's spot price"),
    "ondemand": ("on-demand $/h", "the on-demand price"),
    "savings_pct": ("saving", "spot against on-demand"),
    "interruption": ("interrupted", "Spot Advisor: how often instances of this type "
                                    "were interrupted over the last month"),
    "speed": ("speed", "training throughput the job gets, in reference GPUs (published "
                       "training benchmarks; * derived from datasheet TFLOPS and memory "
                       "bandwidth where none was published)"),
    "work_price": ("spot $/ref-GPU-h", "spot price per hour of reference-GPU work"),
    "vcpus": ("vCPUs", "virtual CPUs"),
    "memory_gib": ("RAM GiB", "instance memory"),
}
FROZEN = ("instance_type", "region", "gpu")
TEXT = ("instance_type", "region", "gpu", "interruption")


@dataclasses.dataclass(frozen=True)
class PickerRow:
    """One instance type in one region.

    ``spot`` is the cheapest pool's price (of ``pools`` pools); ``gpu_memory_gib`` is
    per GPU; ``interruption`` the Spot Advisor label and ``interruption_max_pct`` its
    upper bound (None when the advisor does not list the type); ``gpu_speed`` the GPU
    model's training throughput in V100s (None without a figure) and
    ``gpu_speed_measured`` whether a benchmark measured it; ``price_date`` when the
    prices were taken and ``source`` from where.
    """

    instance_type: str
    region: str
    gpu_model: str
    gpu_count: int
    gpu_memory_gib: float | None
    vcpus: int
    memory_gib: float
    ondemand: float | None
    spot: float
    pools: int
    savings_pct: float | None
    interruption: str | None
    interruption_max_pct: float | None
    price_date: datetime.date
    source: str
    cpu_arch: str = "x86_64"
    cuda: bool = True
    gpu_speed: float | None = None
    gpu_speed_measured: bool = False

    @property
    def key(self) -> str:
        """``"<type>@<region>"``: the row among those of several regions."""
        return f"{self.instance_type}@{self.region}"

    @property
    def spot_per_gpu_hour(self) -> float:
        return self.spot / self.gpu_count

    def speed(self, reference: str, all_gpus: bool = False) -> float | None:
        """The instance's training throughput in reference GPUs (None without figures):
        of one of its GPUs, or of all of them (perfect scaling) with ``all_gpus``."""
        ref = catalog.gpu_speeds().get(reference)
        if ref is None or self.gpu_speed is None:
            return None
        return (self.gpu_count if all_gpus else 1) * self.gpu_speed / ref.training

    def age_days(self, today: datetime.date | None = None) -> int:
        return ((today or datetime.date.today()) - self.price_date).days

    def stale(self, today: datetime.date | None = None) -> bool:
        return self.age_days(today) > STALE_DAYS


def _catalog_date() -> datetime.date:
    """The last day of the bundled catalog's snapshot window."""
    matches = _YEAR_MONTH.findall(catalog.DATA_DATE["catalog"])
    year, month = (int(p) for p in matches[-1])
    first_of_next = datetime.date(year + month // 12, month % 12 + 1, 1)
    return first_of_next - datetime.timedelta(days=1)


def picker_rows(regions: str | Iterable[str] = "us-east-1",
                gpus_only: bool = True) -> list[PickerRow]:
    """A row per instance type with a spot pool in each of ``regions`` (one name or
    several), region by region (GPU types only unless ``gpus_only`` is False:
    Inferentia and Trainium are accelerators without CUDA)."""
    date = _catalog_date()
    speeds = catalog.gpu_speeds()
    rows = []
    for region in ([regions] if isinstance(regions, str) else list(dict.fromkeys(regions))):
        for name, spec in sorted(catalog.instance_types().items()):
            if gpus_only and spec.gpu_manufacturer == "AWS":
                continue
            pools = catalog.pools(name, region)
            if not pools or pools[0].spot is None:
                continue
            spot = pools[0].spot
            ondemand = catalog.ondemand_price(name, region)
            bucket = catalog.interruption_bucket(name, region)
            speed = speeds.get(spec.gpu_model)
            rows.append(PickerRow(
                instance_type=name, region=region, gpu_model=spec.gpu_model,
                gpu_count=spec.gpu_count,
                gpu_memory_gib=(spec.gpu_memory_mib / 1024 if spec.gpu_memory_mib else None),
                vcpus=spec.vcpus, memory_gib=spec.memory_gib, ondemand=ondemand, spot=spot,
                pools=len(pools),
                savings_pct=(100.0 * (1 - spot / ondemand) if ondemand else None),
                interruption=bucket.label if bucket else None,
                interruption_max_pct=bucket.max_pct if bucket else None,
                price_date=date, source=f"bundled catalog ({catalog.DATA_DATE['catalog']})",
                cpu_arch=spec.cpu_arch, cuda=spec.cuda,
                gpu_speed=speed.training if speed is not None else None,
                gpu_speed_measured=speed is not None and speed.measured,
            ))
    return rows


def estimate(row: PickerRow, work_hours: float, checkpoint_seconds: float,
             reference: str | None = None, all_gpus: bool = False, *,
             home: str | None = None, state_gb: float = 0.0, nodes: int = 1,
             scores: Sequence[PlacementScores] = ()) -> Estimate | None:
    """The expected hours, interruptions and cost of a job of ``work_hours`` on one
    ``reference`` GPU, run on ``row`` (on one of its GPUs, or on all of them with
    ``all_gpus``; on ``nodes`` instances), its checkpoint of ``state_gb`` kept in
    ``home`` (default: the row's region); with ``reference`` None, ``work_hours`` are
    hours of the row's own GPU. ``scores``: placement scores, the first covering the
    row's type counts. None when the row's GPU has no speed figure."""
    if reference is None:
        speed: float | None = float(row.gpu_count if all_gpus else 1)
    else:
        speed = row.speed(reference, all_gpus)
    if not speed:
        return None
    found = next((s for s in scores if s.covers(row.instance_type)), None)
    return expected_cost(
        instance_type=row.instance_type, region=row.region, home=home or row.region,
        spot=row.spot, ondemand=row.ondemand, interruption_max_pct=row.interruption_max_pct,
        speed=speed, work_hours=work_hours, checkpoint_seconds=checkpoint_seconds,
        state_gb=state_gb, nodes=nodes,
        score=found.region_score(row.region) if found is not None else None,
        decisive=found.decisive if found is not None else True)


def score_of(row: PickerRow, scores: Sequence[PlacementScores]) -> int | None:
    """The row's placement score: its region's, in the first scores covering its type."""
    found = next((s for s in scores if s.covers(row.instance_type)), None)
    return found.region_score(row.region) if found is not None else None


def _sort_value(row: PickerRow, key: str, est: Estimate | None, reference: str,
                all_gpus: bool, scores: Sequence[PlacementScores]) -> Any:
    if key == "interruption":
        return row.interruption_max_pct
    if key == "gpu":
        return (row.gpu_speed or 0) * row.gpu_count
    if key == "speed":
        return row.speed(reference, all_gpus)
    if key == "work_price":
        speed = row.speed(reference, all_gpus)
        return row.spot / speed if speed else None
    if key == "placement":
        return score_of(row, scores)
    if key.startswith("est_"):
        if est is None:
            return None
        if key == "est_spot_usd":  # the ranking: unlikely places after every other
            return est.rank_key()
        return {"est_hours": est.billed_hours, "est_interruptions": est.interruptions,
                "est_transfer_usd": est.transfer_usd,
                "est_ondemand_usd": est.ondemand_usd}[key]
    return getattr(row, key)


def sort_rows(rows: Sequence[PickerRow], key: str, descending: bool = False, *,
              work_hours: float = 100.0, checkpoint_seconds: float = 600.0,
              reference: str = FALLBACK_REFERENCE, all_gpus: bool = False,
              home: str | None = None, state_gb: float = 0.0, nodes: int = 1,
              scores: Sequence[PlacementScores] = ()) -> list[PickerRow]:
    """Rows sorted by a column of :data:`COLUMNS` (missing values last); by the job's
    expected cost (``est_spot_usd``), rows in a region scored not likely to have
    capacity come after all others."""
    def value(row: PickerRow) -> Any:
        est = estimate(row, work_hours, checkpoint_seconds, reference, all_gpus, home=home,
                       state_gb=state_gb, nodes=nodes, scores=scores) \
            if key.startswith("est_") else None
        return _sort_value(row, key, est, reference, all_gpus, scores)

    keyed = [(value(r), r) for r in rows]
    present = [(v, r) for v, r in keyed if v is not None]
    missing = [r for v, r in keyed if v is None]
    present.sort(key=lambda vr: vr[0], reverse=descending)
    return [r for _v, r in present] + missing


def filter_rows(rows: Sequence[PickerRow], *, gpu_model: str | None = None,
                min_gpu_memory_gib: float = 0.0, gpu_count: int | None = None,
                max_spot: float | None = None, cuda_only: bool = False,
                regions: Iterable[str] | None = None) -> list[PickerRow]:
    """The rows that pass every filter given (None, 0, False or empty: no filter);
    ``regions``: the rows of these regions only."""
    wanted = set(regions or ())
    return [r for r in rows
            if (gpu_model is None or r.gpu_model == gpu_model)
            and (not min_gpu_memory_gib or (r.gpu_memory_gib or 0) >= min_gpu_memory_gib)
            and (gpu_count is None or r.gpu_count == gpu_count)
            and (not max_spot or r.spot <= max_spot)
            and (not cuda_only or r.cuda)
            and (not wanted or r.region in wanted)]


def hidden_reason(row: PickerRow) -> str:
    """Why the NVIDIA/x86 filter hides a row."""
    if row.cpu_arch != "x86_64":
        return (f"{row.instance_type} has an ARM (Graviton) CPU: x86 builds of PyTorch "
                "and most CUDA code do not run there")
    return (f"{row.instance_type} has {row.gpu_model} GPUs ({row.gpu_count}) that CUDA "
            "does not drive")


def train_line(types: Sequence[str], region: str | Sequence[str],
               default_region: str = "us-east-1") -> str:
    """The ``%%spot_train`` line that runs on ``types`` in ``region`` (one region, or
    several: the first is home)."""
    where = region if isinstance(region, str) else ",".join(region)
    line = f"%%spot_train -t {','.join(types)}"
    if where and where != default_region:
        line += f" --region {where}"
    return line


def default_reference(types: Sequence[str]) -> str:
    """The reference GPU: that of the first instance type with a speed figure."""
    specs, speeds = catalog.instance_types(), catalog.gpu_speeds()
    for name in types:
        spec = specs.get(name)
        if spec is not None and spec.gpu_model in speeds:
            return spec.gpu_model
    return FALLBACK_REFERENCE


def row_cells(row: PickerRow, row_id: str, est: Estimate | None, speed: float | None,
              score: int | None, *, scored: bool = False, count: int = 1) -> dict[str, Any]:
    """A table row (``{"id", "cells", "titles"}``, :class:`~spotnb.widgets.elements.Table`'s
    shape): every column's text, and tooltips that say where a figure comes from.
    ``scored``: placement scores are known for some rows; ``count``: the instances they
    are for."""
    no_speed = f"no training throughput figure for {row.gpu_model}"
    cells = {
        "instance_type": row.instance_type,
        "region": row.region,
        "gpu": gpus_text(row),
        "est_spot_usd": num_text(est.total_usd if est else None, "{:,.2f}"),
        "est_hours": num_text(est.billed_hours if est else None, "{:,.1f}"),
        "est_interruptions": num_text(est.interruptions if est else None, "{:.2f}"),
        "est_transfer_usd": num_text(est.transfer_usd if est else None, "{:,.2f}"),
        "placement": str(score) if score is not None else "-",
        "est_ondemand_usd": num_text(est.ondemand_usd if est else None, "{:,.2f}"),
        "spot": f"{row.spot:.4f}",
        "ondemand": num_text(row.ondemand, "{:.3f}"),
        "savings_pct": num_text(row.savings_pct, "{:.0f}%"),
        "interruption": row.interruption or "?",
        "speed": speed_text(row, speed),
        "work_price": num_text(row.spot / speed if speed else None, "{:.4f}"),
        "vcpus": str(row.vcpus),
        "memory_gib": f"{row.memory_gib:g}",
    }
    titles = {}
    if est is None:
        titles = {k: no_speed for k in ("est_spot_usd", "est_hours", "speed")}
    else:
        if not row.gpu_speed_measured:
            titles["speed"] = (f"no published training benchmark of the {row.gpu_model}: "
                               "derived from its datasheet TFLOPS and memory bandwidth "
                               "(spotnb/data/SOURCES.md)")
        titles["est_spot_usd"] = _cost_title(est)
        if not est.likely:
            titles["placement"] = (f"EC2: a spot request for {count} here is not likely to "
                                   "succeed: ranked after the others")
    if score is None and scored:
        titles["placement"] = "not among the scored types: choose it to score it"
    if not row.cuda:
        titles["instance_type"] = hidden_reason(row)
    return {"id": row_id, "cells": cells, "titles": titles}


def _cost_title(est: Estimate) -> str:
    text = (f"spot ${est.spot_usd:,.2f} + checkpoint transfer ${est.transfer_usd:,.2f} "
            f"+ store requests ${est.requests_usd:,.2f}")
    if est.region != est.home:
        text += f" (store in {est.home}: {est.transfer_gb:,.0f} GB cross regions)"
    return text


def gpus_text(row: PickerRow) -> str:
    """``"4 x A10G 22 GiB"``: count, model and memory per GPU."""
    memory = f" {row.gpu_memory_gib:.0f} GiB" if row.gpu_memory_gib else ""
    return f"{row.gpu_count} x {row.gpu_model}{memory}"


def speed_text(row: PickerRow, speed: float | None) -> str:
    """The speed, with ``*`` where the row's GPU figure is derived, not measured."""
    return num_text(speed, "{:.2f}") + ("" if speed is None or row.gpu_speed_measured
                                        else "*")


def num_text(value: float | None, fmt: str) -> str:
    """``value`` formatted, or ``?`` when unknown."""
    return fmt.format(value) if value is not None else "?"
