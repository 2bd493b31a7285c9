"""The instance picker: GPU instance types with prices and interruption rates.

:func:`picker_rows` is plain Python (one :class:`PickerRow` per instance type with a
spot pool in the region, from :mod:`spotnb.catalog`); :func:`estimate` prices a job
of N GPU-hours on a row. :class:`InstancePicker` (``%spot_picker``) shows the rows as
a table with filters, a sort, the estimate, and a list of chosen types in order of
preference; choosing sets ``SpotMagics.instance_types`` (and ``region``) for the next
``%%spot_train`` and shows the equivalent ``%%spot_train -t ...`` line.

The estimate, for a job needing ``N`` GPU-hours on an instance with ``g`` GPUs:

* useful wall time ``T = N / g`` hours (GPUs of different models are not normalised);
* interruptions arrive at the Spot Advisor bucket's upper bound read as interruptions
  per instance-month (``<5%`` -> 0.05 a month, ``>20%`` -> 1 a month), as the local
  cloud's hazard does: ``rate = max_pct / 100 / 720`` an hour;
* each costs half a checkpoint interval of lost work (the expected distance to the last
  checkpoint if the notice's forced save does not make it) plus
  :data:`RESTART_HOURS` for the replacement to launch, boot and restore;
* so the billed hours ``H`` satisfy ``H = T + rate * H * overhead``, hence
  ``H = T / (1 - rate * overhead)``; cost ``H * spot``, against ``T * on-demand``.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import re
from collections.abc import Callable, Sequence
from typing import Any

from spotnb import catalog

__all__ = ["Estimate", "InstancePicker", "PickerRow", "estimate", "picker_rows"]

#: The Spot Advisor's month, as the local cloud reads it (30 days).
MONTH_HOURS = 30 * 24.0
#: A replacement's launch, boot and checkpoint restore: a few minutes on EC2.
RESTART_HOURS = 5 / 60
#: Prices older than this are shown as stale: spot prices move weekly.
STALE_DAYS = 7
#: The bundled catalog's prices: the snapshot's last month (catalog.DATA_DATE).
_YEAR_MONTH = re.compile(r"(\d{4})-(\d{2})")

COLUMNS: dict[str, str] = {
    "instance_type": "type",
    "gpu_model": "GPU",
    "gpu_count": "GPUs",
    "gpu_memory_gib": "GPU mem GiB",
    "vcpus": "vCPUs",
    "memory_gib": "RAM GiB",
    "ondemand": "on-demand $/h",
    "spot": "spot $/h",
    "savings_pct": "savings %",
    "interruption": "interruptions",
    "spot_per_gpu_hour": "$/GPU-h",
    "price_date": "prices from",
}


@dataclasses.dataclass(frozen=True)
class PickerRow:
    """One instance type in one region.

    ``spot`` is the cheapest pool's price (of ``pools`` pools); ``gpu_memory_gib`` is
    per GPU; ``interruption`` the Spot Advisor label and ``interruption_max_pct`` its
    upper bound (None when the advisor does not list the type); ``price_date`` when the
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

    @property
    def spot_per_gpu_hour(self) -> float:
        return self.spot / self.gpu_count

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


def picker_rows(region: str = "us-east-1", gpus_only: bool = True) -> list[PickerRow]:
    """A row per instance type with a spot pool in ``region`` (GPU types only unless
    ``gpus_only`` is False: Inferentia and Trainium are accelerators without CUDA)."""
    date = _catalog_date()
    rows = []
    for name, spec in sorted(catalog.instance_types().items()):
        if gpus_only and spec.gpu_manufacturer == "AWS":
            continue
        pools = catalog.pools(name, region)
        if not pools or pools[0].spot is None:
            continue
        spot = pools[0].spot
        ondemand = catalog.ondemand_price(name, region)
        bucket = catalog.interruption_bucket(name, region)
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
        ))
    return rows


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a job of ``gpu_hours`` costs on a row (see the module docstring)."""

    wall_hours: float  # useful time, without interruptions
    billed_hours: float  # with the expected interruption overhead
    interruptions: float  # expected number
    spot_usd: float
    ondemand_usd: float | None


def estimate(row: PickerRow, gpu_hours: float, checkpoint_seconds: float) -> Estimate:
    """The expected hours, interruptions and cost of ``gpu_hours`` on ``row``."""
    wall = gpu_hours / row.gpu_count
    rate = (row.interruption_max_pct or 0.0) / 100.0 / MONTH_HOURS
    overhead = checkpoint_seconds / 3600.0 / 2 + RESTART_HOURS
    # Overhead beyond an hour per hour of rate would never finish; cap it sanely.
    billed = wall / max(1e-9, 1.0 - rate * overhead)
    return Estimate(
        wall_hours=wall, billed_hours=billed, interruptions=rate * billed,
        spot_usd=billed * row.spot,
        ondemand_usd=wall * row.ondemand if row.ondemand is not None else None)


def sort_rows(rows: Sequence[PickerRow], key: str, descending: bool = False
              ) -> list[PickerRow]:
    """Rows sorted by a column of :data:`COLUMNS` (missing values last)."""
    def value(row: PickerRow) -> tuple[bool, Any]:
        v = row.interruption_max_pct if key == "interruption" else getattr(row, key)
        return (v is None, v if v is not None else 0)

    present = [r for r in rows if value(r)[0] is False]
    missing = [r for r in rows if value(r)[0] is True]
    return sorted(present, key=value, reverse=descending) + missing


def filter_rows(rows: Sequence[PickerRow], *, gpu_model: str | None = None,
                min_gpu_memory_gib: float = 0.0, gpu_count: int | None = None,
                max_spot: float | None = None) -> list[PickerRow]:
    """The rows that pass every filter given (None or 0: no filter)."""
    return [r for r in rows
            if (gpu_model is None or r.gpu_model == gpu_model)
            and (not min_gpu_memory_gib or (r.gpu_memory_gib or 0) >= min_gpu_memory_gib)
            and (gpu_count is None or r.gpu_count == gpu_count)
            and (not max_spot or r.spot <= max_spot)]


def train_line(types: Sequence[str], region: str, default_region: str = "us-east-1") -> str:
    """The ``%%spot_train`` line that runs on ``types`` in ``region``."""
    line = f"%%spot_train -t {','.join(types)}"
    if region != default_region:
        line += f" --region {region}"
    return line


class InstancePicker:
    """``%spot_picker``: choose instance types from the catalog (module docstring).

    ``magics`` is the ``SpotMagics`` whose defaults a choice sets (by default the one
    loaded in this IPython, if any); ``on_choose`` is called with the chosen types.
    """

    def __init__(self, region: str | None = None, *, magics: Any = None,
                 checkpoint_every: str | float | None = None, gpu_hours: float = 100.0,
                 on_choose: Callable[[list[str]], None] | None = None) -> None:
        import ipywidgets as w

        self.magics = magics if magics is not None else _loaded_magics()
        default_region = getattr(self.magics, "region", None) or "us-east-1"
        self.default_region = default_region
        self.on_choose = on_choose
        regions = catalog.all_regions()
        every = checkpoint_every if checkpoint_every is not None else \
            getattr(self.magics, "checkpoint_every", "10m")
        self.region = w.Dropdown(options=regions, value=region or default_region,
                                 description="region")
        self.gpu_model = w.Dropdown(description="GPU")
        self.min_memory = w.BoundedFloatText(value=0, min=0, max=1024, step=8,
                                             description="min GPU GiB")
        self.gpu_count = w.Dropdown(description="GPUs")
        self.max_spot = w.BoundedFloatText(value=0, min=0, max=1000, step=0.1,
                                           description="max spot $/h",
                                           tooltip="0: no limit")
        self.sort_by = w.Dropdown(options=[(label, key) for key, label in COLUMNS.items()],
                                  value="spot_per_gpu_hour", description="sort by")
        self.descending = w.Checkbox(value=False, description="descending", indent=False)
        self.gpu_hours = w.BoundedFloatText(value=gpu_hours, min=0.1, max=1e6,
                                            description="job GPU-h")
        self.checkpoint = w.Text(value=_every_text(every), description="checkpoint",
                                 tooltip="the checkpoint interval, e.g. 10m")
        self.chosen = w.TagsInput(allowed_tags=[], allow_duplicates=False,
                                  placeholder="type or pick an instance type")
        self.table = w.HTML()
        self.line = w.HTML()
        self.note = w.HTML()
        for control in (self.region, self.gpu_model, self.min_memory, self.gpu_count,
                        self.max_spot, self.sort_by, self.descending, self.gpu_hours,
                        self.checkpoint):
            control.observe(self._refresh, names="value")
        self.chosen.observe(self._choose, names="value")
        for control in (self.region, self.gpu_model, self.min_memory, self.gpu_count,
                        self.max_spot, self.sort_by, self.gpu_hours, self.checkpoint):
            control.style.description_width = "initial"
            control.layout.width = "auto"
        box = w.Layout(flex_flow="row wrap", grid_gap="4px 16px")
        self.widget = w.VBox([
            w.HBox([self.region, self.gpu_model, self.min_memory, self.gpu_count,
                    self.max_spot], layout=box),
            w.HBox([self.sort_by, self.descending, self.gpu_hours, self.checkpoint],
                   layout=box),
            self.table,
            w.HBox([w.HTML("<b>chosen, in order of preference:</b>&nbsp;"), self.chosen],
                   layout=box),
            self.line, self.note,
        ])
        self.widget.add_class("spotnb-picker")
        self._rows: list[PickerRow] = []
        self._region_loaded: str | None = None
        self.shown: list[PickerRow] = []
        self._refresh()

    def __repr__(self) -> str:
        return f"<spotnb InstancePicker {self.region.value}: {len(self.shown)} types shown>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        data = dict(self.widget._repr_mimebundle_(**kwargs))
        data["text/plain"] = self.text()
        return data

    def text(self, limit: int = 20) -> str:
        """The table as text (what a saved notebook shows where widgets do not)."""
        header = ("type", "GPU", "GPUs", "on-demand $/h", "spot $/h", "$/GPU-h",
                  "interruptions", "prices from")
        rows = [(r.instance_type, r.gpu_model, str(r.gpu_count), _num(r.ondemand, "{:.3f}"),
                 f"{r.spot:.4f}", f"{r.spot_per_gpu_hour:.4f}", r.interruption or "?",
                 r.price_date.isoformat() + (" (stale)" if r.stale() else ""))
                for r in self.shown[:limit]]
        widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in (header, *rows)]
        more = len(self.shown) - limit
        if more > 0:
            lines.append(f"... and {more} more")
        lines.append(f"instance types in {self.region.value}, cheapest per GPU-hour first")
        return "\n".join(lines)

    # -- state ---------------------------------------------------------------------

    def checkpoint_seconds(self) -> float:
        """The checkpoint interval the estimate uses (10 minutes if it is in steps)."""
        from spotnb.spec import SpecError, parse_duration

        try:
            return parse_duration(self.checkpoint.value, "checkpoint")
        except SpecError:
            return 600.0

    def _load_region(self) -> None:
        if self._region_loaded == self.region.value:
            return
        self._rows = picker_rows(self.region.value)
        self._region_loaded = self.region.value
        models = sorted({r.gpu_model for r in self._rows})
        counts = sorted({r.gpu_count for r in self._rows})
        keep_model = self.gpu_model.value if self.gpu_model.value in models else None
        keep_count = self.gpu_count.value if self.gpu_count.value in counts else None
        # "any" is "" and 0: a Dropdown shows None as no choice at all.
        self.gpu_model.options = [("any", ""), *((m, m) for m in models)]
        self.gpu_model.value = keep_model or ""
        self.gpu_count.options = [("any", 0), *((str(c), c) for c in counts)]
        self.gpu_count.value = keep_count or 0
        names = [r.instance_type for r in self._rows]
        self.chosen.allowed_tags = names
        self.chosen.value = [t for t in self.chosen.value if t in names]

    def _refresh(self, _change: Any = None) -> None:
        self._load_region()
        rows = filter_rows(self._rows, gpu_model=self.gpu_model.value or None,
                           min_gpu_memory_gib=self.min_memory.value,
                           gpu_count=self.gpu_count.value or None,
                           max_spot=self.max_spot.value or None)
        self.shown = sort_rows(rows, self.sort_by.value, self.descending.value)
        self.table.value = self._table_html()
        self._show_line()

    def _choose(self, _change: Any = None) -> None:
        self.table.value = self._table_html()
        types = list(self.chosen.value)
        if types and self.magics is not None:
            self.magics.instance_types = types
            self.magics.region = self.region.value
        if types and self.on_choose is not None:
            self.on_choose(types)
        self._show_line()

    def choose(self, *types: str) -> None:
        """Choose instance types in order of preference (as typing them would)."""
        self.chosen.value = list(types)

    def _show_line(self) -> None:
        types = list(self.chosen.value)
        if not types:
            self.line.value = ("<span style='color:#57606a'>Type or pick instance types "
                               "above, most preferred first.</span>")
            return
        line = train_line(types, self.region.value, "us-east-1")
        where = ("these are now the defaults of the next %%spot_train"
                 if self.magics is not None else "no spotnb magics loaded: %load_ext spotnb")
        self.line.value = (f"<code class='spotnb-train-line'>{html.escape(line)}</code>"
                           f" <span style='color:#57606a'>({where})</span>")

    # -- the table -----------------------------------------------------------------

    def _table_html(self) -> str:
        chosen = list(self.chosen.value)
        hours = self.gpu_hours.value
        seconds = self.checkpoint_seconds()
        labels = [*COLUMNS.values(), f"est. h for {hours:g} GPU-h", "est. interruptions",
                  "est. spot $", "on-demand $"]
        head = "".join(f"<th style='{_CELL}'>{html.escape(label)}</th>" for label in labels)
        body = []
        for row in self.shown:
            est = estimate(row, hours, seconds)
            rank = chosen.index(row.instance_type) + 1 if row.instance_type in chosen else 0
            stale = row.stale()
            cells = [
                (f"<b>{rank}.</b> " if rank else "") + html.escape(row.instance_type),
                html.escape(row.gpu_model), str(row.gpu_count),
                _num(row.gpu_memory_gib, "{:.0f}"), str(row.vcpus), f"{row.memory_gib:g}",
                _num(row.ondemand, "{:.3f}"), f"{row.spot:.4f}",
                _num(row.savings_pct, "{:.0f}"), html.escape(row.interruption or "?"),
                f"{row.spot_per_gpu_hour:.4f}",
                (f"<span class='spotnb-stale' style='color:#9a6700' "
                 f"title='{html.escape(row.source)}: {row.age_days()} days old'>"
                 f"⚠ {row.price_date.isoformat()} stale</span>"
                 if stale else row.price_date.isoformat()),
                f"{est.billed_hours:.1f}", f"{est.interruptions:.2f}", f"{est.spot_usd:.2f}",
                _num(est.ondemand_usd, "{:.2f}"),
            ]
            style = " style='background:#ddf4ff'" if rank else ""
            body.append(f"<tr data-type='{html.escape(row.instance_type)}'{style}>"
                        + "".join(f"<td style='{_CELL}'>{c}</td>" for c in cells) + "</tr>")
        stale_note = ""
        if any(r.stale() for r in self.shown):
            stale_note = (f"<div style='color:#9a6700;font-size:85%'>⚠ prices from the "
                          f"bundled catalog ({html.escape(catalog.DATA_DATE['catalog'])}); "
                          "spot prices today may differ. Interruption buckets: Spot Advisor "
                          f"{html.escape(catalog.DATA_DATE['advisor'])}.</div>")
        return (
            "<div style='max-height:22em;overflow:auto'><table class='spotnb-picker-table' "
            "style='border-collapse:collapse;font-size:85%'><thead style='position:sticky;"
            f"top:0;background:#fff'><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
            f"</table></div>{stale_note}"
            f"<div style='font-size:85%;color:#57606a'>{len(self.shown)} of "
            f"{len(self._rows)} types in {html.escape(self.region.value)}. Spot: the "
            "cheapest zone. Estimate: interruptions at the bucket's upper bound per month, "
            "each costing half a checkpoint interval plus a 5-minute restart.</div>")


_CELL = "white-space:nowrap;padding:1px 6px;text-align:right"


def _num(value: float | None, fmt: str) -> str:
    return fmt.format(value) if value is not None else "?"


def _every_text(every: str | float) -> str:
    return f"{every:g}s" if isinstance(every, (int, float)) else str(every)


def _loaded_magics() -> Any:
    """The ``SpotMagics`` of the running IPython, if ``%load_ext spotnb`` was run."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    if ip is None:
        return None
    return ip.magics_manager.registry.get("SpotMagics")
