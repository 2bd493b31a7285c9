"""The instance picker: GPU instance types ranked by what your job would cost on them.

:func:`picker_rows` is plain Python (one :class:`PickerRow` per instance type with a
spot pool in the region, from :mod:`spotnb.providers.catalog`); :func:`estimate` prices a job on
a row. :class:`InstancePicker` (``%spot_picker``) shows the rows as a table (key
columns frozen on the left, sorted by a click on a header, a row chosen by a click),
with filters (NVIDIA GPUs on x86 hosts only, by default: what CUDA training needs), and
a list of chosen types in order of preference; choosing sets
``SpotMagics.instance_types`` (and ``region``) for the next ``%%spot_train`` and shows
the equivalent ``%%spot_train -t ...`` line.

The job is sized as ``N`` hours on one reference GPU. The reference is chosen once
and then kept: the ``reference`` given, else the one ``SpotMagics.gpu_reference``
holds, else the GPU of the default instance type when the first picker opens (stored
in ``gpu_reference`` then), so choosing types, which changes the default instance
type, does not change the costs shown by the next picker. GPU models differ in speed:
each has a training throughput (``spotnb/data/gpu_throughput.csv``: published
mixed-precision training benchmarks where they exist, else a fit of the datasheet's
tensor peak and memory bandwidth on the measured GPUs; ``SOURCES.md`` has the sources),
so on an instance of ``g`` GPUs of a model ``r`` times the reference's speed the
estimate is:

* useful wall time ``T = N / r`` hours on one of the instance's GPUs, the default (a
  notebook's training loop mostly uses one), or ``T = N / (g * r)`` on all ``g`` of
  them, scaling perfectly;
* interruptions arrive at the Spot Advisor bucket's upper bound read as interruptions
  per instance-month (``<5%`` -> 0.05 a month, ``>20%`` -> 1 a month), as the local
  cloud's hazard does: ``rate = max_pct / 100 / 720`` an hour;
* each costs half a checkpoint interval of lost work (the expected distance to the last
  checkpoint if the notice's forced save does not make it) plus
  :data:`RESTART_HOURS` for the replacement to launch, boot and restore;
* so the billed hours ``H`` satisfy ``H = T + rate * H * overhead``, hence
  ``H = T / (1 - rate * overhead)``; cost ``H * spot``, against ``T * on-demand``.

The default ranking is that expected cost, cheapest first.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import re
from collections.abc import Callable, Sequence
from typing import Any

from spotnb.protocol.events.fold import savings_pct
from spotnb.providers import catalog

__all__ = ["COLUMNS", "Estimate", "InstancePicker", "PickerRow", "estimate", "filter_rows",
           "picker_rows", "sort_rows", "train_line"]

#: The Spot Advisor's month, as the local cloud reads it (30 days).
MONTH_HOURS = 30 * 24.0
#: A replacement's launch, boot and checkpoint restore: a few minutes on EC2.
RESTART_HOURS = 5 / 60
#: Prices older than this are shown as stale: spot prices move weekly.
STALE_DAYS = 7
#: The reference GPU when the default instance type's GPU has no speed figure.
FALLBACK_REFERENCE = "A10G"
#: The columns shown until "all columns" is ticked: the table then fits a notebook
#: cell (848 px in JupyterLab at 1280 px) without sideways scrolling.
DEFAULT_COLUMNS = ("instance_type", "gpu", "est_spot_usd", "est_hours", "est_interruptions",
                   "spot", "savings_pct", "interruption", "speed")
# The bundled catalog's prices: the snapshot's last month (catalog.DATA_DATE).
_YEAR_MONTH = re.compile(r"(\d{4})-(\d{2})")

#: The table's columns: key -> (label, tooltip). The first two stay in view.
COLUMNS: dict[str, tuple[str, str]] = {
    "instance_type": ("type", "the instance type; click a row to choose it"),
    "gpu": ("GPUs", "GPU count, model and memory per GPU"),
    "est_spot_usd": ("job $ spot", "expected cost of the job on spot, interruptions "
                                   "included"),
    "est_hours": ("job hours", "expected billed hours, interruptions included"),
    "est_interruptions": ("interr.", "expected interruptions during the job"),
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
_FROZEN = ("instance_type", "gpu")
_TEXT = ("instance_type", "gpu", "interruption")


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


def picker_rows(region: str = "us-east-1", gpus_only: bool = True) -> list[PickerRow]:
    """A row per instance type with a spot pool in ``region`` (GPU types only unless
    ``gpus_only`` is False: Inferentia and Trainium are accelerators without CUDA)."""
    date = _catalog_date()
    speeds = catalog.gpu_speeds()
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
        speed = speeds.get(spec.gpu_model)
        rows.append(PickerRow(
            instance_type=name, region=region, gpu_model=spec.gpu_model,
            gpu_count=spec.gpu_count,
            gpu_memory_gib=(spec.gpu_memory_mib / 1024 if spec.gpu_memory_mib else None),
            vcpus=spec.vcpus, memory_gib=spec.memory_gib, ondemand=ondemand, spot=spot,
            pools=len(pools),
            savings_pct=savings_pct(spot, ondemand or 0.0),
            interruption=bucket.label if bucket else None,
            interruption_max_pct=bucket.max_pct if bucket else None,
            price_date=date, source=f"bundled catalog ({catalog.DATA_DATE['catalog']})",
            cpu_arch=spec.cpu_arch, cuda=spec.cuda,
            gpu_speed=speed.training if speed is not None else None,
            gpu_speed_measured=speed is not None and speed.measured,
        ))
    return rows


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a job costs on a row (see the module docstring)."""

    wall_hours: float  # useful time, without interruptions
    billed_hours: float  # with the expected interruption overhead
    interruptions: float  # expected number
    spot_usd: float
    ondemand_usd: float | None


def estimate(row: PickerRow, work_hours: float, checkpoint_seconds: float,
             reference: str | None = None, all_gpus: bool = False) -> Estimate | None:
    """The expected hours, interruptions and cost of a job of ``work_hours`` on one
    ``reference`` GPU, run on ``row`` (on one of its GPUs, or on all of them with
    ``all_gpus``); with ``reference`` None, ``work_hours`` are hours of the row's own
    GPU. None when the row's GPU has no speed figure."""
    if reference is None:
        speed: float | None = float(row.gpu_count if all_gpus else 1)
    else:
        speed = row.speed(reference, all_gpus)
    if not speed:
        return None
    wall = work_hours / speed
    rate = (row.interruption_max_pct or 0.0) / 100.0 / MONTH_HOURS
    overhead = checkpoint_seconds / 3600.0 / 2 + RESTART_HOURS
    # Overhead beyond an hour per hour of rate would never finish; cap it sanely.
    billed = wall / max(1e-9, 1.0 - rate * overhead)
    return Estimate(
        wall_hours=wall, billed_hours=billed, interruptions=rate * billed,
        spot_usd=billed * row.spot,
        ondemand_usd=wall * row.ondemand if row.ondemand is not None else None)


def _sort_value(row: PickerRow, key: str, est: Estimate | None, reference: str,
                all_gpus: bool) -> Any:
    if key == "interruption":
        return row.interruption_max_pct
    if key == "gpu":
        return (row.gpu_speed or 0) * row.gpu_count
    if key == "speed":
        return row.speed(reference, all_gpus)
    if key == "work_price":
        speed = row.speed(reference, all_gpus)
        return row.spot / speed if speed else None
    if key.startswith("est_"):
        if est is None:
            return None
        return {"est_spot_usd": est.spot_usd, "est_hours": est.billed_hours,
                "est_interruptions": est.interruptions,
                "est_ondemand_usd": est.ondemand_usd}[key]
    return getattr(row, key)


def sort_rows(rows: Sequence[PickerRow], key: str, descending: bool = False, *,
              work_hours: float = 100.0, checkpoint_seconds: float = 600.0,
              reference: str = FALLBACK_REFERENCE, all_gpus: bool = False
              ) -> list[PickerRow]:
    """Rows sorted by a column of :data:`COLUMNS` (missing values last)."""
    def value(row: PickerRow) -> Any:
        est = estimate(row, work_hours, checkpoint_seconds, reference, all_gpus) \
            if key.startswith("est_") else None
        return _sort_value(row, key, est, reference, all_gpus)

    keyed = [(value(r), r) for r in rows]
    present = [(v, r) for v, r in keyed if v is not None]
    missing = [r for v, r in keyed if v is None]
    present.sort(key=lambda vr: vr[0], reverse=descending)
    return [r for _v, r in present] + missing


def filter_rows(rows: Sequence[PickerRow], *, gpu_model: str | None = None,
                min_gpu_memory_gib: float = 0.0, gpu_count: int | None = None,
                max_spot: float | None = None, cuda_only: bool = False) -> list[PickerRow]:
    """The rows that pass every filter given (None, 0 or False: no filter)."""
    return [r for r in rows
            if (gpu_model is None or r.gpu_model == gpu_model)
            and (not min_gpu_memory_gib or (r.gpu_memory_gib or 0) >= min_gpu_memory_gib)
            and (gpu_count is None or r.gpu_count == gpu_count)
            and (not max_spot or r.spot <= max_spot)
            and (not cuda_only or r.cuda)]


def hidden_reason(row: PickerRow) -> str:
    """Why the NVIDIA/x86 filter hides a row."""
    if row.cpu_arch != "x86_64":
        return (f"{row.instance_type} has an ARM (Graviton) CPU: x86 builds of PyTorch "
                "and most CUDA code do not run there")
    return (f"{row.instance_type} has {row.gpu_model} GPUs ({row.gpu_count}) that CUDA "
            "does not drive")


def train_line(types: Sequence[str], region: str, default_region: str = "us-east-1") -> str:
    """The ``%%spot_train`` line that runs on ``types`` in ``region``."""
    line = f"%%spot_train -t {','.join(types)}"
    if region != default_region:
        line += f" --region {region}"
    return line


def default_reference(types: Sequence[str]) -> str:
    """The reference GPU: that of the first instance type with a speed figure."""
    specs, speeds = catalog.instance_types(), catalog.gpu_speeds()
    for name in types:
        spec = specs.get(name)
        if spec is not None and spec.gpu_model in speeds:
            return spec.gpu_model
    return FALLBACK_REFERENCE


class InstancePicker:
    """``%spot_picker``: choose instance types from the catalog (module docstring).

    ``magics`` is the ``SpotMagics`` whose defaults a choice sets (by default the one
    loaded in this IPython, if any); ``on_choose`` is called with the chosen types.
    ``work_hours`` sizes the job in hours on one ``reference`` GPU (default: the one
    kept in ``SpotMagics.gpu_reference``, else the GPU of the default instance type,
    which is then kept there: see the module docstring).
    """

    def __init__(self, region: str | None = None, *, magics: Any = None,
                 checkpoint_every: str | float | None = None, work_hours: float = 100.0,
                 reference: str | None = None,
                 on_choose: Callable[[list[str]], None] | None = None) -> None:
        import ipywidgets as w

        from spotnb.widgets.elements import Table

        self.magics = magics if magics is not None else _loaded_magics()
        default_region = getattr(self.magics, "region", None) or "us-east-1"
        self.default_region = default_region
        self.on_choose = on_choose
        every = checkpoint_every if checkpoint_every is not None else \
            getattr(self.magics, "checkpoint_every", "10m")
        speeds = catalog.gpu_speeds()
        kept = getattr(self.magics, "gpu_reference", "") or ""
        reference = reference or (kept if kept in speeds else None) or default_reference(
            list(getattr(self.magics, "instance_types", None) or ()))
        self._keep_reference(reference)
        self.region = w.Dropdown(options=catalog.all_regions(),
                                 value=region or default_region, description="region")
        self.gpu_model = w.Dropdown(description="GPU")
        self.min_memory = w.BoundedFloatText(value=0, min=0, max=1024, step=8,
                                             description="min GPU GiB")
        self.gpu_count = w.Dropdown(description="GPUs")
        self.max_spot = w.BoundedFloatText(value=0, min=0, max=1000, step=0.1,
                                           description="max spot $/h",
                                           tooltip="0: no limit")
        self.cuda_only = w.Checkbox(value=True, description="NVIDIA on x86 only (CUDA)",
                                    indent=False)
        self.work_hours = w.BoundedFloatText(value=work_hours, min=0.01, max=1e6,
                                             description="job: hours on one")
        self.reference = w.Dropdown(
            options=sorted(speeds), value=reference, description="reference GPU",
            tooltip="the GPU the job's hours are counted on; kept for the next pickers")
        self.all_gpus = w.Dropdown(options=[("on one GPU of the instance", False),
                                            ("on all its GPUs (scaling perfectly)", True)],
                                   value=False, description="run")
        self.checkpoint = w.Text(value=_every_text(every), description="checkpoint every",
                                 tooltip="the checkpoint interval, e.g. 10m")
        self.all_columns = w.Checkbox(value=False, indent=False, description="all columns",
                                      tooltip="add the on-demand costs, the spot price "
                                              "per reference GPU-hour, vCPUs and RAM")
        self.chosen = w.TagsInput(allowed_tags=[], allow_duplicates=False,
                                  placeholder="type an instance type, or click rows")
        self.table = Table()
        self.table.sort_key, self.table.descending = "est_spot_usd", False
        self.line = w.HTML()
        self.note = w.HTML()
        self.warning = w.HTML()
        for control in (self.region, self.gpu_model, self.min_memory, self.gpu_count,
                        self.max_spot, self.cuda_only, self.work_hours, self.reference,
                        self.all_gpus, self.checkpoint, self.all_columns):
            control.observe(self._refresh, names="value")
        self.reference.observe(lambda change: self._keep_reference(change["new"]),
                               names="value")
        self.table.observe(self._refresh, names=["sort_key", "descending"])
        self.table.observe(self._clicked, names="chosen")
        self.chosen.observe(self._choose, names="value")
        for control in (self.region, self.gpu_model, self.min_memory, self.gpu_count,
                        self.max_spot, self.work_hours, self.reference, self.all_gpus,
                        self.checkpoint):
            control.style.description_width = "initial"
            control.layout.width = "auto"
        for control in (self.min_memory, self.max_spot):
            control.layout.width = "12em"
        self.work_hours.layout.width = "15em"
        self.checkpoint.layout.width = "16em"
        box = w.Layout(flex_flow="row wrap", grid_gap="4px 14px", align_items="center")
        self.widget = w.VBox([
            w.HBox([self.region, self.gpu_model, self.min_memory, self.gpu_count,
                    self.max_spot, self.cuda_only], layout=box),
            w.HBox([self.work_hours, self.reference, self.all_gpus, self.checkpoint],
                   layout=box),
            self.note, self.all_columns, self.table,
            w.HBox([w.HTML("<b>chosen, in order of preference:</b>&nbsp;"), self.chosen],
                   layout=box),
            self.warning, self.line,
        ], layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-picker")
        self._rows: list[PickerRow] = []
        self._region_loaded: str | None = None
        self._syncing = False
        self.shown: list[PickerRow] = []
        self._refresh()

    def __repr__(self) -> str:
        return f"<spotnb InstancePicker {self.region.value}: {len(self.shown)} types shown>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        data = dict(self.widget._repr_mimebundle_(**kwargs))
        data["text/plain"] = self.text()
        data["text/html"] = self.static_html()
        return data

    def static_html(self, limit: int = 20) -> str:
        """The picker as shown, without widgets (what a saved notebook and its HTML
        export show where widgets do not render): the note, the table's columns and
        its first ``limit`` rows, and the chosen types' ``%%spot_train`` line."""
        from spotnb.widgets import static

        columns = self._columns()
        rows = [[row["cells"][c["key"]] for c in columns]
                for row in (self._cells(r) for r in self.shown[:limit])]
        more = len(self.shown) - limit
        tail = (f"<div style='font-size:85%;color:#57606a'>… and {more} more</div>"
                if more > 0 else "")
        return (f"<div class='spotnb-static-picker'>{self.note.value}"
                f"{static.table_html([c['label'] for c in columns], rows)}{tail}"
                f"{self.warning.value}{self.line.value if self.chosen.value else ''}</div>")

    def text(self, limit: int = 20) -> str:
        """The table as text (what a saved notebook shows where widgets do not)."""
        ref = self.reference.value
        header = ("type", "GPUs", "job $ spot", "job hours", "spot $/h", "on-demand $/h",
                  "interrupted", f"speed (x {ref})")
        rows = []
        for r in self.shown[:limit]:
            est = self._estimate(r)
            speed = r.speed(ref, self.all_gpus.value)
            rows.append((r.instance_type, _gpus(r),
                         _num(est.spot_usd if est else None, "{:.2f}"),
                         _num(est.billed_hours if est else None, "{:.1f}"),
                         f"{r.spot:.4f}", _num(r.ondemand, "{:.3f}"), r.interruption or "?",
                         _speed_text(r, speed)))
        widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in (header, *rows)]
        more = len(self.shown) - limit
        if more > 0:
            lines.append(f"... and {more} more")
        lines.append(f"instance types in {self.region.value} for a job of "
                     f"{self.work_hours.value:g} hours on one {ref}, sorted by "
                     f"{COLUMNS[self.table.sort_key][0]}; speed: measured training "
                     f"throughput, * derived; {self._staleness()}")
        return "\n".join(lines)

    # -- state ---------------------------------------------------------------------

    def _keep_reference(self, reference: str) -> None:
        """Keep the reference GPU in the magics, for the next pickers' costs."""
        if self.magics is not None:
            self.magics.gpu_reference = reference

    def checkpoint_seconds(self) -> float:
        """The checkpoint interval the estimate uses (10 minutes if it is in steps)."""
        from spotnb.protocol.spec import SpecError, parse_duration

        try:
            return parse_duration(self.checkpoint.value, "checkpoint")
        except SpecError:
            return 600.0

    def _estimate(self, row: PickerRow) -> Estimate | None:
        return estimate(row, self.work_hours.value, self.checkpoint_seconds(),
                        self.reference.value, self.all_gpus.value)

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
                           max_spot=self.max_spot.value or None,
                           cuda_only=self.cuda_only.value)
        key = self.table.sort_key if self.table.sort_key in COLUMNS else "est_spot_usd"
        self.shown = sort_rows(rows, key, self.table.descending,
                               work_hours=self.work_hours.value,
                               checkpoint_seconds=self.checkpoint_seconds(),
                               reference=self.reference.value,
                               all_gpus=self.all_gpus.value)
        with self.table.hold_sync():
            self.table.columns = self._columns()
            self.table.rows = [self._cells(r) for r in self.shown]
        self.note.value = self._note()
        self._show_line()

    def _clicked(self, change: Any) -> None:
        """Rows clicked in the table: the chosen list follows (in click order)."""
        if not self._syncing:
            self.chosen.value = list(change["new"])

    def _choose(self, _change: Any = None) -> None:
        types = list(self.chosen.value)
        self._syncing = True
        try:
            self.table.chosen = types
        finally:
            self._syncing = False
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
        shown = {r.instance_type for r in self.shown}
        rows = {r.instance_type: r for r in self._rows}
        hidden = [rows[t] for t in types if t in rows and t not in shown]
        notes = []
        for row in hidden:
            why = hidden_reason(row) if not row.cuda and self.cuda_only.value \
                else "the filters above leave it out"
            notes.append(f"⚠ {row.instance_type} is chosen but hidden: {why}.")
        self.warning.value = "".join(
            f"<div class='spotnb-picker-warning' style='color:#9a6700'>{html.escape(n)}</div>"
            for n in notes)
        if not types:
            self.line.value = ("<span style='color:#57606a'>Click rows or type instance "
                               "types above, most preferred first.</span>")
            return
        line = train_line(types, self.region.value, "us-east-1")
        where = ("these are now the defaults of the next %%spot_train"
                 if self.magics is not None else "no spotnb magics loaded: %load_ext spotnb")
        self.line.value = (f"<code class='spotnb-train-line'>{html.escape(line)}</code>"
                           f" <span style='color:#57606a'>({where})</span>")

    # -- the table -----------------------------------------------------------------

    def _columns(self) -> list[dict[str, Any]]:
        ref = self.reference.value
        labels = {"speed": f"speed (x {ref})", "work_price": f"spot $ per {ref}-h"}
        return [{"key": key, "label": labels.get(key, label), "title": title,
                 "frozen": key in _FROZEN, "numeric": key not in _TEXT,
                 "descending_first": key in ("speed", "savings_pct", "gpu", "vcpus",
                                             "memory_gib")}
                for key, (label, title) in COLUMNS.items()
                if self.all_columns.value or key in DEFAULT_COLUMNS]

    def _cells(self, row: PickerRow) -> dict[str, Any]:
        ref = self.reference.value
        est = self._estimate(row)
        speed = row.speed(ref, self.all_gpus.value)
        no_speed = f"no training throughput figure for {row.gpu_model}"
        cells = {
            "instance_type": row.instance_type,
            "gpu": _gpus(row),
            "est_spot_usd": _num(est.spot_usd if est else None, "{:,.2f}"),
            "est_hours": _num(est.billed_hours if est else None, "{:,.1f}"),
            "est_interruptions": _num(est.interruptions if est else None, "{:.2f}"),
            "est_ondemand_usd": _num(est.ondemand_usd if est else None, "{:,.2f}"),
            "spot": f"{row.spot:.4f}",
            "ondemand": _num(row.ondemand, "{:.3f}"),
            "savings_pct": _num(row.savings_pct, "{:.0f}%"),
            "interruption": row.interruption or "?",
            "speed": _speed_text(row, speed),
            "work_price": _num(row.spot / speed if speed else None, "{:.4f}"),
            "vcpus": str(row.vcpus),
            "memory_gib": f"{row.memory_gib:g}",
        }
        titles = {}
        if est is None:
            titles = {k: no_speed for k in ("est_spot_usd", "est_hours", "speed")}
        elif not row.gpu_speed_measured:
            titles = {"speed": f"no published training benchmark of the {row.gpu_model}: "
                               "derived from its datasheet TFLOPS and memory bandwidth "
                               "(spotnb/data/SOURCES.md)"}
        if not row.cuda:
            titles["instance_type"] = hidden_reason(row)
        return {"id": row.instance_type, "cells": cells, "titles": titles}

    def _staleness(self) -> str:
        rows = self._rows or picker_rows(self.region.value)
        if not rows:
            return "no prices"
        age = rows[0].age_days()
        when = f"prices from spotnb's bundled catalog ({catalog.DATA_DATE['catalog']})"
        return f"{when}, {age} days old" + (": spot prices today may differ"
                                            if rows[0].stale() else "")

    def _note(self) -> str:
        stale = bool(self._rows) and self._rows[0].stale()
        colour = "#9a6700" if stale else "#57606a"
        hidden = len(self._rows) - len(filter_rows(self._rows, cuda_only=True))
        filtered = (f" {hidden} types without CUDA (AMD GPUs, ARM hosts) are hidden: "
                    "untick “NVIDIA on x86 only” to see them." if self.cuda_only.value
                    and hidden else "")
        ref = html.escape(self.reference.value)
        return (
            f"<div class='spotnb-reference' style='margin:2px 0'>Costs are for "
            f"<b>{self.work_hours.value:g} hours of training on one {ref}</b>, the "
            "reference GPU: it stays the same when you choose types or run this cell "
            "again, until you change it above.</div>"
            f"<div style='font-size:85%;color:#57606a'>"
            f"<span class='spotnb-stale' style='color:{colour}'>{'⚠ ' if stale else ''}"
            f"{html.escape(self._staleness())}.</span> Interruption rates: Spot Advisor "
            f"{html.escape(catalog.DATA_DATE['advisor'])}. {len(self.shown)} of "
            f"{len(self._rows)} types in {html.escape(self.region.value)}, ranked by the "
            f"job's expected spot cost: its hours on one {ref} divided by the training "
            f"speed of {'all its GPUs' if self.all_gpus.value else 'one of its GPUs'} "
            "against the reference (published mixed-precision training benchmarks, which "
            "count memory bandwidth; * marks GPUs without one, derived from datasheet "
            "TFLOPS and bandwidth; your model's own ratio may differ), plus "
            "interruptions at the Spot Advisor rate, each costing half a checkpoint "
            f"interval and a 5-minute restart. Spot: the cheapest zone.{filtered} "
            "Click a header to sort, a row to choose.</div>")


def _gpus(row: PickerRow) -> str:
    memory = f" {row.gpu_memory_gib:.0f} GiB" if row.gpu_memory_gib else ""
    return f"{row.gpu_count} x {row.gpu_model}{memory}"


def _speed_text(row: PickerRow, speed: float | None) -> str:
    """The speed, with ``*`` where the row's GPU figure is derived, not measured."""
    return _num(speed, "{:.2f}") + ("" if speed is None or row.gpu_speed_measured else "*")


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
