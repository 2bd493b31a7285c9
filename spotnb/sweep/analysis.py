"""What the sweep's view shows of its trials, as data: the table, the parallel
coordinates, the objective against each parameter, and Optuna's parameter importance.

Every figure of a trial's job comes from its fold (:class:`~spotnb.client.comparison.Facts`
of its :class:`~spotnb.sweep.runner.TrialRun`); the trial's own facts (its parameters,
its state in the sweep, its objective) from the sweep. Two values of the metric are
told apart everywhere: the *objective* (its last value: what the study is told of a
completed trial, and of a running one the newest) and the *lowest* (or highest, by the
sweep's direction) value the trial ever logged. The widget
(:mod:`spotnb.widgets.sweep`) and the static picture (:mod:`spotnb.widgets.static_sweep`)
draw these.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spotnb.sweep.state import round_value

if TYPE_CHECKING:
    from spotnb.sweep.view import Sweep

__all__ = ["IMPORTANCE_MIN_TRIALS", "STATE_COLOURS", "Axis", "Importance", "TrialRow", "axes",
           "importance", "table_columns", "table_rows", "trial_rows"]

#: The trial states' colours in the analysis (pruned grey, as the header's colours say).
STATE_COLOURS = {"completed": "#1f77b4", "running": "#fb8500", "pruned": "#8c959f",
                 "stopped": "#9a6700", "failed": "#cf222e"}

log = logging.getLogger(__name__)

#: Parameter importance is computed from this many completed trials on (Optuna's
#: PED-ANOVA compares the best tenth of them with the rest: with fewer, it says nothing).
IMPORTANCE_MIN_TRIALS = 3


@dataclasses.dataclass(frozen=True)
class TrialRow:
    """One trial as the view shows it."""

    number: int
    label: str
    params: dict[str, Any]
    #: The trial's state in the sweep (waiting, running, completed, pruned, ...).
    state: str
    job_id: str | None
    live: bool
    #: The objective: the metric's last value (a completed trial's, as told to the
    #: study; a running or pruned one's newest).
    objective: float | None
    #: The lowest (or, maximizing, highest) value of the metric the trial logged.
    best_logged: float | None
    #: Where the pruner stopped it, and why (or why it stopped or failed).
    pruned_at: int | None
    reason: str
    interruptions: int
    redone_steps: int
    #: Cost refunds included (never decreases), the refund, and what is billed.
    cost_usd: float | None
    refunded_usd: float
    billed_usd: float | None
    savings_pct: float | None
    duration_s: float | None

    @property
    def interrupted(self) -> bool:
        return self.interruptions > 0

    @property
    def note(self) -> str:
        """``pruned at step 140 (val_loss 0.4452)``, or why it stopped or failed."""
        if self.state in ("pruned", "stopped", "failed", "skipped"):
            return self.reason
        return ""


def trial_rows(made: Sweep) -> list[TrialRow]:
    """Every trial of ``made``, in order."""
    rows = []
    maximize = made.direction == "maximize"
    for trial in list(made.trials):
        run = made.runs.get(trial.number)
        facts = run.facts if run is not None else None
        objective = trial.value
        best = None
        if run is not None:
            with run.lock:
                series = run.data.metrics.get(made.metric)
                values: Any = series.points(full=True)[1] if series is not None else []
            finite = [float(v) for v in values if math.isfinite(v)]
            if finite:
                best = max(finite) if maximize else min(finite)
            if objective is None and facts is not None:
                objective = facts.final.get(made.metric)
        reason = trial.reason or (facts.reason if facts is not None else "")
        if facts is not None and facts.status == "pruned" and facts.reason:
            reason = facts.reason  # the job's own word (its pruned event)
        rows.append(TrialRow(
            number=trial.number, label=f"t{trial.number}", params=dict(trial.params),
            state=trial.state, job_id=trial.job_id,
            live=run is not None and run.live, objective=objective, best_logged=best,
            pruned_at=(facts.pruned_at if facts is not None and facts.pruned_at is not None
                       else trial.pruned_at),
            reason=reason,
            interruptions=facts.interruptions if facts is not None else 0,
            redone_steps=facts.redone_steps if facts is not None else 0,
            cost_usd=facts.gross_usd if facts is not None else None,
            refunded_usd=facts.refunded_usd if facts is not None else 0.0,
            billed_usd=facts.cost_usd if facts is not None else None,
            savings_pct=facts.savings_pct if facts is not None else None,
            duration_s=facts.duration_s if facts is not None else None))
    return rows


@dataclasses.dataclass(frozen=True)
class Axis:
    """One axis of the parallel coordinates: a parameter, the state, the
    interruptions or the objective. ``values`` are the positions (a categorical's index,
    a wide positive range's log10); ``ticks`` what they read as (empty: the numbers)."""

    name: str
    values: tuple[float, ...]
    ticks: tuple[tuple[float, str], ...] = ()
    log: bool = False


# A positive numeric parameter spanning more than this ratio is drawn on a log axis.
_LOG_SPAN = 50.0
_MAX_TICKS = 6
_STATE_ORDER = ("completed", "running", "pruned", "stopped", "failed")


def _param_axis(name: str, values: Sequence[Any]) -> Axis:
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(v) for v in values)
    if numeric and values:
        nums = [float(v) for v in values]
        lo, hi = min(nums), max(nums)
        if wide_range(nums):
            first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
            every = max(1, math.ceil((last - first) / _MAX_TICKS))  # a few ticks, not 40
            decades = range(first, last + 1, every)
            ticks = tuple((float(d), round_value(10.0 ** d, 2)) for d in decades)
            return Axis(name, tuple(math.log10(v) for v in nums), ticks, log=True)
        return Axis(name, tuple(nums))
    labels = list(dict.fromkeys(round_value(v) for v in values))
    index = {label: n for n, label in enumerate(labels)}
    return Axis(name, tuple(float(index[round_value(v)]) for v in values),
                tuple((float(n), label) for n, label in enumerate(labels)))


def axes(rows: Sequence[TrialRow], metric: str) -> tuple[list[Axis], list[TrialRow]]:
    """The parallel coordinates' axes (the parameters, the state, the interruptions,
    the objective) and the trials they draw: those with an objective value (the
    others have nothing to place on its axis yet)."""
    drawn = [r for r in rows if r.objective is not None and math.isfinite(r.objective)]
    if not drawn:
        return [], []
    names = list(dict.fromkeys(k for r in drawn for k in r.params))
    out = [_param_axis(n, [r.params.get(n) for r in drawn]) for n in names]
    states = [s for s in _STATE_ORDER if any(r.state == s for r in drawn)]
    states += sorted({r.state for r in drawn} - set(states))
    out.append(Axis("state", tuple(float(states.index(r.state)) for r in drawn),
                    tuple((float(n), s) for n, s in enumerate(states))))
    out.append(Axis("interruptions", tuple(float(r.interruptions) for r in drawn),
                    tuple((float(n), str(n)) for n in
                          range(max(r.interruptions for r in drawn) + 1))))
    # The objective as a parameter is drawn: a wide positive range (a diverged trial's
    # loss beside the others') on a log axis, which the colours follow.
    out.append(_param_axis(f"{metric} (objective)", [float(r.objective or 0.0)
                                                     for r in drawn]))
    return out, drawn


def wide_range(values: Sequence[float]) -> bool:
    """Whether positive ``values`` span enough to be read on a log scale."""
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > _LOG_SPAN


@dataclasses.dataclass(frozen=True)
class Importance:
    """Optuna's parameter importance (``values``, largest first), or why there is none
    yet (``why``)."""

    values: dict[str, float]
    why: str = ""
    completed: int = 0


def _distribution(values: Sequence[Any], optuna: Any) -> Any:
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        lo, hi = min(values), max(values)
        return optuna.distributions.IntDistribution(lo, max(hi, lo + 1))
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
           for v in values):
        lo, hi = float(min(values)), float(max(values))
        log_scale = lo > 0 and hi / lo > _LOG_SPAN
        return optuna.distributions.FloatDistribution(lo, hi if hi > lo else lo + 1e-12,
                                                      log=log_scale)
    return optuna.distributions.CategoricalDistribution(list(dict.fromkeys(values)))


def importance(rows: Sequence[TrialRow], direction: str) -> Importance:
    """``optuna.importance.get_param_importances`` over the completed trials (a study
    of their parameters and objectives: each numeric parameter a range over the
    values tried, the others categories); :data:`IMPORTANCE_MIN_TRIALS` completed
    trials at least, and some parameter that varies."""
    done = [r for r in rows if r.state == "completed" and r.objective is not None
            and math.isfinite(r.objective)]
    if len(done) < IMPORTANCE_MIN_TRIALS:
        return Importance({}, f"parameter importance needs {IMPORTANCE_MIN_TRIALS} completed "
                              f"trials; {len(done)} so far", len(done))
    names = list(dict.fromkeys(k for r in done for k in r.params))
    varying = [n for n in names if len({repr(r.params.get(n)) for r in done}) > 1]
    if not varying:
        return Importance({}, "parameter importance: no parameter varies among the "
                              "completed trials", len(done))
    try:
        import optuna
    except ImportError:
        return Importance({}, "parameter importance needs Optuna", len(done))
    distributions = {n: _distribution([r.params[n] for r in done if n in r.params], optuna)
                     for n in varying}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        study = optuna.create_study(
            direction="maximize" if direction == "maximize" else "minimize")
        for r in done:
            study.add_trial(optuna.trial.create_trial(
                params={n: r.params[n] for n in varying if n in r.params},
                distributions={n: distributions[n] for n in varying if n in r.params},
                value=r.objective))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            values = optuna.importance.get_param_importances(study)
    except Exception as err:  # Optuna's own refusal: shown, not raised
        log.info("parameter importance failed: %s", err)
        return Importance({}, f"parameter importance: Optuna could not compute it ({err})",
                          len(done))
    finally:
        optuna.logging.set_verbosity(verbosity)
    if any("importances will be equal" in str(w.message) for w in said):
        return Importance({}, "parameter importance: the completed trials do not tell "
                              "the parameters apart yet", len(done))
    return Importance(dict(sorted(values.items(), key=lambda kv: -kv[1])), "", len(done))


def _num(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def table_columns(made: Sweep, rows: list[TrialRow]) -> list[dict[str, Any]]:
    """The trials table's columns: the trial, its parameters, state, note, the
    objective and the best value logged (named apart), then its job's figures."""
    metric = made.metric
    word = "highest" if made.direction == "maximize" else "lowest"
    params = list(dict.fromkeys(k for r in rows for k in r.params))
    maximize = made.direction == "maximize"
    return [
        {"key": "trial", "label": "trial", "frozen": True,
         "title": "the trial (click its row: its own dashboard)"},
        *({"key": f"param:{p}", "label": p, "numeric": True, "title": f"parameter {p}"}
          for p in params),
        {"key": "state", "label": "state"},
        {"key": "note", "label": "pruned / stopped",
         "title": "where the pruner stopped it and its metric then, or why it ended"},
        {"key": "objective", "label": f"{metric} (last: objective)", "numeric": True,
         "descending_first": maximize,
         "title": f"the last value of {metric}: what the study is told of a completed "
                  "trial (a running or pruned one: its newest)"},
        {"key": "best", "label": f"{word} {metric} logged", "numeric": True,
         "descending_first": maximize,
         "title": f"the {word} value of {metric} the trial logged at any step"},
        {"key": "interruptions", "label": "interruptions", "numeric": True},
        {"key": "redone", "label": "redone steps", "numeric": True,
         "title": "steps logged again after an interruption"},
        {"key": "cost", "label": "cost $", "numeric": True,
         "title": "instances at the spot price, refunds included (it never decreases)"},
        {"key": "refunded", "label": "refunded $", "numeric": True,
         "title": "what EC2 refunds: instances it interrupted in their first hour"},
        {"key": "saved", "label": "saved", "numeric": True, "descending_first": True,
         "title": "what is billed (cost less refunds) against on-demand"},
        {"key": "duration", "label": "duration", "numeric": True},
    ]


def table_rows(made: Sweep, rows: list[TrialRow]) -> list[dict[str, Any]]:
    """The trials table's rows (each with ``values``: what it sorts by)."""
    from spotnb.records.figures import RUN_COLOURS

    params = list(dict.fromkeys(k for r in rows for k in r.params))
    out = []
    for r in rows:
        state = r.state + (" (live)" if r.live and r.state == "running" else "")
        values: dict[str, Any] = {
            "trial": r.number, "state": r.state, "note": r.note, "objective": r.objective,
            "best": r.best_logged, "interruptions": r.interruptions,
            "redone": r.redone_steps, "cost": r.cost_usd, "refunded": r.refunded_usd,
            "saved": r.savings_pct, "duration": r.duration_s}
        cells = {
            "trial": r.label, "state": state, "note": r.note, "objective": _num(r.objective),
            "best": _num(r.best_logged), "interruptions": str(r.interruptions),
            "redone": str(r.redone_steps), "cost": _num(r.cost_usd, ".4f"),
            "refunded": _num(r.refunded_usd, ".4f") if r.refunded_usd else "-",
            "saved": "-" if r.savings_pct is None else f"{r.savings_pct:.0f}%",
            "duration": _clock(r.duration_s)}
        for p in params:
            values[f"param:{p}"] = r.params.get(p)
            cells[f"param:{p}"] = round_value(r.params[p]) if p in r.params else "-"
        out.append({"id": r.label, "cells": cells, "values": values,
                    "colour": RUN_COLOURS[r.number % len(RUN_COLOURS)],
                    "titles": {"trial": f"job {r.job_id}" if r.job_id else "not started"}})
    return out
