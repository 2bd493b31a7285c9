"""The instance picker (``%spot_picker``): instance types in each region, ranked by what
your job would cost there.

The rows (one per instance type per region) and their ranking are plain Python in
:mod:`spotnb.widgets.ranking` (re-exported here); a job's expected cost on a row is
:func:`spotnb.providers.regions.expected_cost`, the function a launch ranks a job's
regions by: the spot hours with interruptions at the Spot Advisor's rate, the job's
checkpoint moved to and from its home region when the row is elsewhere (AWS's
inter-region transfer prices), the store's requests, and the Spot placement score: a
row EC2 finds not likely to get capacity ranks after all others.

:class:`InstancePicker` shows the rows as a table (key columns frozen on the left,
sorted by a click on a header, a row chosen by a click), with filters: the regions
(the allowed ones, ``SpotMagics.allowed_regions``: all of them, or a chosen subset;
first shown: the regions of the next ``%%spot_train``), NVIDIA GPUs on x86 hosts only
(by default: what CUDA training needs), GPU model, memory and count, a price cap.
Choosing rows sets ``SpotMagics.instance_types`` and ``region`` (the chosen rows'
regions, the home region first) for the next ``%%spot_train`` and shows the equivalent
``%%spot_train -t ... --region ...`` line.

Placement scores: on the local cloud, its simulated capacity (``SPOTNB_LOCAL_NO_CAPACITY``)
per type, at every refresh; with the AWS provider, EC2's scores of the chosen types (or
the default ones) for the job's instance count, fetched once for all the regions shown
when the picker opens and again on a click, and shown with their age
(:mod:`spotnb.providers.placement`).

The job is sized as ``N`` hours on one reference GPU. The reference is chosen once
and then kept: the ``reference`` given, else the one ``SpotMagics.gpu_reference``
holds, else the GPU of the default instance type when the first picker opens (stored
in ``gpu_reference`` then), so choosing types, which changes the default instance
type, does not change the costs shown by the next picker.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any

from spotnb.protocol.spec import MAX_NODES
from spotnb.providers import catalog
from spotnb.providers import regions as where
from spotnb.providers.placement import PlacementScores
from spotnb.widgets.ranking import (
    COLUMNS,
    DEFAULT_COLUMNS,
    FALLBACK_REFERENCE,
    FROZEN,
    MONTH_HOURS,
    RESTART_HOURS,
    STALE_DAYS,
    TEXT,
    Estimate,
    PickerRow,
    default_reference,
    estimate,
    filter_rows,
    gpus_text,
    hidden_reason,
    num_text,
    picker_rows,
    row_cells,
    score_of,
    sort_rows,
    speed_text,
    train_line,
)

__all__ = ["COLUMNS", "DEFAULT_COLUMNS", "FALLBACK_REFERENCE", "MONTH_HOURS",
           "RESTART_HOURS", "STALE_DAYS", "Estimate", "InstancePicker", "PickerRow",
           "default_reference", "estimate", "filter_rows", "hidden_reason", "picker_rows",
           "sort_rows", "train_line"]

#: The checkpoint a job is sized with until told (``--state-gb``): what each save
#: sends home and each restore brings back when the job runs away from its store.
DEFAULT_STATE_GB = 1.0
#: Rows sent to the table at most (the best ranked); the rest are counted below it.
MAX_TABLE_ROWS = 300


class InstancePicker:
    """``%spot_picker``: choose instance types and regions (module docstring).

    ``region``: the regions shown first (a name, several, or ``"any"``; default the
    magics' ``region``). ``magics`` is the ``SpotMagics`` whose defaults a choice sets
    (by default the one loaded in this IPython, if any); ``on_choose`` is called with
    the chosen types. ``work_hours`` sizes the job in hours on one ``reference`` GPU
    (default: the one kept in ``SpotMagics.gpu_reference``, else the GPU of the default
    instance type, which is then kept there); ``state_gb`` is its checkpoint's size and
    ``count`` how many instances it needs at once (the placement score's target).
    """

    def __init__(self, region: str | Sequence[str] | None = None, *, magics: Any = None,
                 checkpoint_every: str | float | None = None, work_hours: float = 100.0,
                 reference: str | None = None, state_gb: float = DEFAULT_STATE_GB,
                 count: int = 1, on_choose: Callable[[list[str]], None] | None = None
                 ) -> None:
        import ipywidgets as w

        from spotnb.widgets.elements import Table

        self.magics = magics if magics is not None else _loaded_magics()
        self.provider = str(getattr(self.magics, "provider", None) or "local")
        self.on_choose = on_choose
        self.allowed = where.allowed_regions(
            list(getattr(self.magics, "allowed_regions", None) or ()) or None)
        options = list(self.allowed) or catalog.all_regions()
        self._magics_regions = _names_in(getattr(self.magics, "region", None) or "",
                                         self.allowed, options)
        start = _names_in(region, self.allowed, options) if region is not None \
            else self._magics_regions
        every = checkpoint_every if checkpoint_every is not None else \
            getattr(self.magics, "checkpoint_every", "10m")
        speeds = catalog.gpu_speeds()
        kept = getattr(self.magics, "gpu_reference", "") or ""
        reference = reference or (kept if kept in speeds else None) or default_reference(
            list(getattr(self.magics, "instance_types", None) or ()))
        self._keep_reference(reference)
        everywhere = "all allowed regions" if self.allowed else "all regions"
        self.regions = w.TagsInput(value=start or options[:1], allowed_tags=options,
                                   allow_duplicates=False,
                                   placeholder=f"{everywhere}: type a region")
        self.home = w.Dropdown(options=[("the next job's home", ""),
                                        *((r, r) for r in options)],
                               value="", description="store in",
                               tooltip="the job's home region: its store stays there")
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
        self.state_gb = w.BoundedFloatText(
            value=state_gb, min=0, max=1e6, step=1, description="checkpoint GB",
            tooltip="the checkpoint's size: a job away from its home region sends it "
                    "home at each save and back at each restore")
        self.count = w.BoundedIntText(value=count, min=1, max=MAX_NODES,
                                      description="instances",
                                      tooltip="instances the job needs at once (nodes)")
        self.rescore = w.Button(description="refresh placement scores",
                                tooltip="ask EC2 again for the chosen types' scores")
        if self.provider != "aws":
            self.rescore.layout.display = "none"
        self.all_columns = w.Checkbox(value=False, indent=False, description="all columns",
                                      tooltip="add the on-demand costs, the transfer, the "
                                              "spot price per reference GPU-hour, vCPUs "
                                              "and RAM")
        self.chosen = w.TagsInput(allowed_tags=[], allow_duplicates=False,
                                  placeholder="type an instance type, or click rows")
        self.table = Table()
        self.table.sort_key, self.table.descending = "est_spot_usd", False
        self.line = w.HTML()
        self.note = w.HTML()
        self.warning = w.HTML()
        for control in (self.gpu_model, self.min_memory, self.gpu_count, self.max_spot,
                        self.cuda_only, self.work_hours, self.reference, self.all_gpus,
                        self.checkpoint, self.all_columns, self.home, self.state_gb,
                        self.count):
            control.observe(self._refresh, names="value")
        self.regions.observe(self._regions_changed, names="value")
        self.reference.observe(lambda change: self._keep_reference(change["new"]),
                               names="value")
        self.rescore.on_click(lambda _button: self.fetch_scores())
        self.table.observe(self._refresh, names=["sort_key", "descending"])
        self.table.observe(self._clicked, names="chosen")
        self.chosen.observe(self._choose, names="value")
        for control in (self.home, self.gpu_model, self.min_memory, self.gpu_count,
                        self.max_spot, self.work_hours, self.reference, self.all_gpus,
                        self.checkpoint, self.state_gb, self.count):
            control.style.description_width = "initial"
            control.layout.width = "auto"
        for control in (self.min_memory, self.max_spot, self.state_gb, self.count):
            control.layout.width = "12em"
        self.work_hours.layout.width = "15em"
        self.checkpoint.layout.width = "16em"
        box = w.Layout(flex_flow="row wrap", grid_gap="4px 14px", align_items="center")
        self.widget = w.VBox([
            w.HBox([w.HTML("<b>regions:</b>"), self.regions, self.home, self.rescore],
                   layout=box),
            w.HBox([self.gpu_model, self.min_memory, self.gpu_count, self.max_spot,
                    self.cuda_only], layout=box),
            w.HBox([self.work_hours, self.reference, self.all_gpus, self.checkpoint,
                    self.state_gb, self.count], layout=box),
            self.note, self.all_columns, self.table,
            w.HBox([w.HTML("<b>chosen, in order of preference:</b>&nbsp;"), self.chosen],
                   layout=box),
            self.warning, self.line,
        ], layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-picker")
        self._rows: list[PickerRow] = []
        self._loaded: tuple[str, ...] = ()
        self._syncing = False
        self.shown: list[PickerRow] = []
        self.scores: list[PlacementScores] = []
        self.scores_problem: str | None = None
        self._load_rows()
        if self.provider == "aws":
            self.fetch_scores(refresh=False)
        self._refresh()

    def __repr__(self) -> str:
        return (f"<spotnb InstancePicker {','.join(self.shown_regions())}: "
                f"{len(self.shown)} rows shown>")

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
        several = self._several()
        header = ("type", *(("region",) if several else ()), "GPUs", "job $ spot",
                  "job hours", "spot $/h", "on-demand $/h", "interrupted", f"speed (x {ref})")
        rows = []
        for r in self.shown[:limit]:
            est = self._estimate(r)
            speed = r.speed(ref, self.all_gpus.value)
            rows.append((r.instance_type, *((r.region,) if several else ()), gpus_text(r),
                         num_text(est.total_usd if est else None, "{:.2f}"),
                         num_text(est.billed_hours if est else None, "{:.1f}"),
                         f"{r.spot:.4f}", num_text(r.ondemand, "{:.3f}"), r.interruption or "?",
                         speed_text(r, speed)))
        widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                 for row in (header, *rows)]
        more = len(self.shown) - limit
        if more > 0:
            lines.append(f"... and {more} more")
        lines.append(f"instance types in {', '.join(self.shown_regions())} for a job of "
                     f"{self.work_hours.value:g} hours on one {ref}, its store in "
                     f"{self.home_region()}, sorted by {COLUMNS[self.table.sort_key][0]}; "
                     f"speed: measured training throughput, * derived; {self._staleness()}")
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

    def shown_regions(self) -> list[str]:
        """The regions the filter shows: those chosen in it, else every allowed one."""
        return list(self.regions.value) or list(self.regions.allowed_tags)

    def _several(self) -> bool:
        return len(self.shown_regions()) > 1

    def home_region(self) -> str:
        """Where the job's store would be: the region chosen for it (**store in**),
        else the next job's home when it is shown, else the first region shown. It does
        not follow the rows chosen: the costs shown stay those the choice was made on."""
        if self.home.value:
            return str(self.home.value)
        shown = self.shown_regions()
        first = self._magics_regions[:1]
        return first[0] if first and first[0] in shown else shown[0]

    def chosen_pairs(self) -> list[tuple[str, str]]:
        """The chosen rows as (instance type, region), in the order chosen."""
        return [_pair(name, self._single()) for name in self.chosen.value]

    def _single(self) -> str:
        """The region that rows named by their type alone are of (one region shown)."""
        return self._loaded[0] if len(self._loaded) == 1 else ""

    def _row_id(self, row: PickerRow) -> str:
        return row.key if len(self._loaded) > 1 else row.instance_type

    def _estimate(self, row: PickerRow) -> Estimate | None:
        return estimate(row, self.work_hours.value, self.checkpoint_seconds(),
                        self.reference.value, self.all_gpus.value, home=self.home_region(),
                        state_gb=self.state_gb.value, nodes=self.count.value,
                        scores=self.scores)

    def _regions_changed(self, _change: Any) -> None:
        """A new region filter: rows loaded for it, the chosen rows renamed for it."""
        pairs = [_pair(name, self._single()) for name in self.chosen.value]
        self._load_rows()
        ids = {row.key: self._row_id(row) for row in self._rows}
        self.chosen.value = [ids[f"{t}@{r}"] for t, r in pairs if f"{t}@{r}" in ids]
        self._refresh()

    def _load_rows(self) -> None:
        shown = tuple(self.shown_regions())
        if shown == self._loaded:
            return
        self._rows = picker_rows(shown)
        self._loaded = shown
        models = sorted({r.gpu_model for r in self._rows})
        counts = sorted({r.gpu_count for r in self._rows})
        keep_model = self.gpu_model.value if self.gpu_model.value in models else None
        keep_count = self.gpu_count.value if self.gpu_count.value in counts else None
        # "any" is "" and 0: a Dropdown shows None as no choice at all.
        self.gpu_model.options = [("any", ""), *((m, m) for m in models)]
        self.gpu_model.value = keep_model or ""
        self.gpu_count.options = [("any", 0), *((str(c), c) for c in counts)]
        self.gpu_count.value = keep_count or 0
        names = [self._row_id(r) for r in self._rows]
        self.chosen.allowed_tags = names
        self.chosen.value = [t for t in self.chosen.value if t in names]
        if self.provider != "aws":
            self._simulate_scores()

    def _simulate_scores(self) -> None:
        """The local cloud's placement scores, one configuration per type (free)."""
        from spotnb.providers.local.state import Settings
        from spotnb.providers.placement import simulated_placement_scores

        try:
            has = Settings.load().has_capacity
        except Exception as err:  # an unreadable config: the scores are not essential
            self.scores, self.scores_problem = [], f"no simulated scores ({err})"
            return
        types = sorted({r.instance_type for r in self._rows})
        self.scores = [simulated_placement_scores([name], self._loaded, self.count.value,
                                                  has_capacity=has) for name in types]
        self.scores_problem = None

    def fetch_scores(self, refresh: bool = True) -> None:
        """Ask EC2 for the Spot placement scores of the chosen types (else the default
        ones) for the job's instance count, in every region shown, once; a failure is
        said above the table (the ranking goes on without scores)."""
        from spotnb.providers.placement import placement_scores

        types = list(dict.fromkeys(t for t, _r in self.chosen_pairs())) or list(
            getattr(self.magics, "instance_types", None) or ())
        if not types:
            self.scores, self.scores_problem = [], "choose types to see their scores"
        else:
            try:
                self.scores = [placement_scores(
                    self.provider, types, self.shown_regions(), self.count.value,
                    home=self.home_region())]
                self.scores_problem = None
            except Exception as err:
                self.scores = []
                self.scores_problem = (f"no Spot placement scores ({type(err).__name__}: "
                                       f"{_short(err)}): the ranking goes on without them")
        if refresh:
            self._refresh()

    def _refresh(self, _change: Any = None) -> None:
        self._load_rows()
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
                               all_gpus=self.all_gpus.value, home=self.home_region(),
                               state_gb=self.state_gb.value, nodes=self.count.value,
                               scores=self.scores)
        with self.table.hold_sync():
            self.table.columns = self._columns()
            self.table.rows = [self._cells(r) for r in self.shown[:MAX_TABLE_ROWS]]
        self.note.value = self._note()
        self._show_line()

    def _clicked(self, change: Any) -> None:
        """Rows clicked in the table: the chosen list follows (in click order)."""
        if not self._syncing:
            self.chosen.value = list(change["new"])

    def _choose(self, _change: Any = None) -> None:
        pairs = self.chosen_pairs()
        types = list(dict.fromkeys(t for t, _r in pairs))
        self._syncing = True
        try:
            self.table.chosen = list(self.chosen.value)
        finally:
            self._syncing = False
        if types and self.magics is not None:
            self.magics.instance_types = types
            self.magics.region = ",".join(self.job_regions())
        if types and self.on_choose is not None:
            self.on_choose(types)
        self._show_line()

    def job_regions(self) -> list[str]:
        """The chosen rows' regions, the home region first: the job's ``--region``."""
        chosen = [r for _t, r in self.chosen_pairs()]
        return list(dict.fromkeys([self.home_region(), *chosen]))

    def _show_line(self) -> None:
        types = [t for t, _r in self.chosen_pairs()]
        shown = {self._row_id(r) for r in self.shown}
        rows = {self._row_id(r): r for r in self._rows}
        hidden = [rows[t] for t in self.chosen.value if t in rows and t not in shown]
        notes = []
        for row in hidden:
            why = hidden_reason(row) if not row.cuda and self.cuda_only.value \
                else "the filters above leave it out"
            notes.append(f"⚠ {self._row_id(row)} is chosen but hidden: {why}.")
        self.warning.value = "".join(
            f"<div class='spotnb-picker-warning' style='color:#9a6700'>{html.escape(n)}</div>"
            for n in notes)
        if not types:
            self.line.value = ("<span style='color:#57606a'>Click rows or type instance "
                               "types above, most preferred first.</span>")
            return
        line = train_line(list(dict.fromkeys(types)), self.job_regions(), "us-east-1")
        where_to = ("these are now the defaults of the next %%spot_train"
                    if self.magics is not None else "no spotnb magics loaded: %load_ext spotnb")
        self.line.value = (f"<code class='spotnb-train-line'>{html.escape(line)}</code>"
                           f" <span style='color:#57606a'>({where_to})</span>")

    # -- the table -----------------------------------------------------------------

    def _columns(self) -> list[dict[str, Any]]:
        ref = self.reference.value
        labels = {"speed": f"speed (x {ref})", "work_price": f"spot $ per {ref}-h"}
        keys = set(COLUMNS) if self.all_columns.value else set(DEFAULT_COLUMNS)
        if self._several():
            keys.add("region")
            if not self.all_columns.value:  # room for it: the bucket says as much
                keys -= {"est_interruptions", "savings_pct"}
        if len({score_of(r, self.scores) for r in self.shown}) > 1:
            keys.add("placement")
        if self.state_gb.value and any(r.region != self.home_region() for r in self.shown):
            keys.add("est_transfer_usd")
        return [{"key": key, "label": labels.get(key, label), "title": title,
                 "frozen": key in FROZEN, "numeric": key not in TEXT,
                 "descending_first": key in ("speed", "savings_pct", "gpu", "vcpus",
                                             "memory_gib", "placement")}
                for key, (label, title) in COLUMNS.items() if key in keys]

    def _cells(self, row: PickerRow) -> dict[str, Any]:
        return row_cells(row, self._row_id(row), self._estimate(row),
                         row.speed(self.reference.value, self.all_gpus.value),
                         score_of(row, self.scores), scored=bool(self.scores),
                         count=self.count.value)

    def _staleness(self) -> str:
        rows = self._rows or picker_rows(self.shown_regions())
        if not rows:
            return "no prices"
        age = rows[0].age_days()
        when = f"prices from spotnb's bundled catalog ({catalog.DATA_DATE['catalog']})"
        return f"{when}, {age} days old" + (": spot prices today may differ"
                                            if rows[0].stale() else "")

    def _scores_note(self) -> str:
        if self.scores_problem:
            return f" {self.scores_problem}."
        if not self.scores:
            return ""
        first = self.scores[0]
        what = ("the local cloud's simulated capacity" if first.source.startswith("the local")
                else f"EC2's, for {', '.join(first.instance_types)}")
        scored = sorted({s for s in (score_of(r, self.scores) for r in self.shown)
                         if s is not None})
        values = (f"{scored[0]}/10 for every row" if len(scored) == 1 else
                  f"{scored[0]} to {scored[-1]}/10" if scored else "none for these rows")
        low = "" if first.decisive else (
            "; scores of one or two types are always low (AWS), so they demote none")
        count = first.target_capacity
        return (f" Spot placement scores ({what}, for {count} instance"
                f"{'' if count == 1 else 's'}, {first.age_text()}): {values}; a row scored 1 "
                f"ranks last{low}.")

    def _note(self) -> str:
        stale = bool(self._rows) and self._rows[0].stale()
        colour = "#9a6700" if stale else "#57606a"
        hidden = len(self._rows) - len(filter_rows(self._rows, cuda_only=True))
        filtered = (f" {hidden} rows without CUDA (AMD GPUs, ARM hosts) are hidden: "
                    "untick “NVIDIA on x86 only” to see them." if self.cuda_only.value
                    and hidden else "")
        ref = html.escape(self.reference.value)
        home = html.escape(self.home_region())
        shown = self.shown_regions()
        regions = html.escape(", ".join(shown) if len(shown) <= 4
                              else f"{len(shown)} regions")
        more = len(self.shown) - MAX_TABLE_ROWS
        cut = (f" The table holds the first {MAX_TABLE_ROWS}: narrow the filters to see "
               f"the other {more}." if more > 0 else "")
        away = (f" The job's store stays in {home}: a row elsewhere pays AWS's inter-region "
                f"transfer for its {self.state_gb.value:g} GB checkpoint, sent home at each "
                "save and back at each restore." if len(shown) > 1 or shown[0] != home
                else "")
        return (
            f"<div class='spotnb-reference' style='margin:2px 0'>Costs are for "
            f"<b>{self.work_hours.value:g} hours of training on one {ref}</b>, the "
            "reference GPU: it stays the same when you choose types or run this cell "
            "again, until you change it above.</div>"
            f"<div style='font-size:85%;color:#57606a'>"
            f"<span class='spotnb-stale' style='color:{colour}'>{'⚠ ' if stale else ''}"
            f"{html.escape(self._staleness())}.</span> Interruption rates: Spot Advisor "
            f"{html.escape(catalog.DATA_DATE['advisor'])}. {len(self.shown)} of "
            f"{len(self._rows)} types in {regions}, ranked by the "
            f"job's expected spot cost: its hours on one {ref} divided by the training "
            f"speed of {'all its GPUs' if self.all_gpus.value else 'one of its GPUs'} "
            "against the reference (published mixed-precision training benchmarks, which "
            "count memory bandwidth; * marks GPUs without one, derived from datasheet "
            "TFLOPS and bandwidth; your model's own ratio may differ), plus "
            "interruptions at the Spot Advisor rate, each costing half a checkpoint "
            f"interval and a 5-minute restart, and the store's requests.{away}"
            f"{html.escape(self._scores_note(), quote=False)} Spot: the cheapest zone."
            f"{filtered}{cut} "
            "Click a header to sort, a row to choose.</div>")


def _names_in(value: str | Sequence[str] | None, allowed: Sequence[str],
              options: Sequence[str]) -> list[str]:
    """The regions of ``value`` (a name, several, ``any``) among ``options``."""
    names = [value] if isinstance(value, str) else list(value or ())
    found = [p.strip() for n in names for p in str(n).split(",") if p.strip()]
    if where.ANY in found:
        found = list(allowed)
    return [n for n in dict.fromkeys(found) if n in options]


def _pair(name: str, single: str) -> tuple[str, str]:
    """(type, region) of a row's id: ``type@region``, or ``type`` of ``single``."""
    kind, at, region = name.partition("@")
    return (kind, region) if at else (kind, single)


def _short(err: BaseException, limit: int = 160) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
