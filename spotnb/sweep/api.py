"""The sweep API: :func:`sweep` starts one, :func:`attach_sweep` finds one again,
:func:`sweeps` lists them, :func:`stop_sweep` ends one for good.

What a sweep does: :mod:`spotnb.sweep.runner`; how it is kept in the store:
:mod:`spotnb.sweep.state`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import cloudpickle

from spotnb.client.comparison import higher_is_better
from spotnb.protocol import layout
from spotnb.protocol.errors import SpecError
from spotnb.protocol.store import NotFound, open_store
from spotnb.sweep.metric import cell_metrics, missing_metric
from spotnb.sweep.runner import Sweep
from spotnb.sweep.space import import_optuna, make_space
from spotnb.sweep.state import (
    DEFINITION_KEY,
    SEARCH_KEY,
    SweepInfo,
    SweepNotFound,
    Trial,
    definitions,
    find_definition,
    index_sweep,
    liveness,
    new_sweep_id,
    read_state,
    sweep_info,
    sweep_prefix,
    trial_label,
)
from spotnb.sweep.trials import TrialRun, stop_in_store

__all__ = ["SweepStopped", "attach_sweep", "find_sweep", "stop_sweep", "sweep", "sweeps"]

log = logging.getLogger(__name__)


def _cell_names(code: str) -> set[str] | None:
    """The names the cell reads before assigning them (what its parameters can be)."""
    import ast

    from IPython.core.inputtransformer2 import TransformerManager

    from spotnb.client.freevars import free_names_in

    try:
        tree = ast.parse(TransformerManager().transform_cell(code))
    except SyntaxError:
        return None  # the job's own check (below) names the line
    return set(free_names_in(tree))


def _pruner(pruner: Any, study: Any, optuna: Any) -> Any:
    """The pruner to use: the one given (a study's own by default), None for none."""
    if study is not None and pruner is None:
        pruner = study.pruner
    if pruner is not None and not isinstance(pruner, optuna.pruners.BasePruner):
        raise SpecError(f"{{option}} must be an Optuna pruner (optuna.pruners."
                        f"MedianPruner(), ...), not {type(pruner).__name__}", field="pruner")
    if isinstance(pruner, optuna.pruners.NopPruner):
        return None
    return pruner


def sweep(
    code: str,
    *,
    grid: Mapping[str, Sequence[Any]] | None = None,
    params: Sequence[Mapping[str, Any]] | None = None,
    study: Any = None,
    space: Mapping[str, Any] | None = None,
    n_trials: int | None = None,
    sampler: Any = None,
    parallel: int = 2,
    metric: str = "loss",
    direction: str | None = None,
    pruner: Any = None,
    budget_usd: float | None = None,
    name: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    files: Mapping[str, Any] | None = None,
    store: str | os.PathLike[str] | None = None,
    notify_url: str | None = None,
    syntax: str = "python",
    **submit_options: Any,
) -> Sweep:
    """Run ``code`` once per parameter set, each a spot job with its own resume; return
    at once with the running :class:`Sweep` (module docstring).

    The parameter sets: ``grid`` (``{"lr": [0.1, 0.01], "batch": [32, 64]}``: every
    combination), ``params`` (``[{"lr": 0.1}, {"lr": 0.01}]``: these, in order),
    ``space`` (a dict of Optuna distributions, ``n_trials`` asked of ``sampler``:
    ``"tpe"`` (default), ``"random"``, ``"cmaes"``, ``"qmc"``, or an Optuna sampler), or
    ``study`` (an ``optuna.Study``, its own sampler asked ``n_trials`` times over
    ``space``). A ``sampler`` with a grid samples ``n_trials`` of its combinations (each
    parameter a categorical). Each parameter is a variable of the cell. At most
    ``parallel`` trials run at once; ``budget_usd`` covers the whole sweep. ``metric``
    (logged with ``spot.log``) is what a trial is judged by, its last value (the
    objective); better larger or smaller by its name (``direction``:
    ``"minimize"``/``"maximize"``, or a study's own). ``pruner`` (an Optuna pruner;
    default the study's, else none) stops a trial early on the metric's values as they
    are logged. ``notify_url``: a webhook that gets one summary at the end. The other
    options are :func:`spotnb.submit`'s, for every trial. Bad input raises
    :class:`~spotnb.protocol.errors.SpecError` before any instance starts (``syntax``:
    ``"magic"`` for hints in ``%%spot_sweep``'s syntax): among it a ``metric`` that the
    cell's ``spot.log`` calls never name, where nothing else in it can log
    (:mod:`spotnb.sweep.metric`).
    """
    optuna = import_optuna()
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise SpecError(f"{{option}} must be a whole number >= 1 (how many trials run at "
                        f"once), e.g. parallel=2, not {parallel!r}", field="parallel")
    if budget_usd is not None and not (isinstance(budget_usd, (int, float))
                                       and budget_usd > 0):
        raise SpecError(f"{{option}} must be above 0 USD, not {budget_usd!r}",
                        field="budget_usd")
    if not isinstance(metric, str) or not metric:
        raise SpecError(f"{{option}} must name a metric the cell logs with spot.log, not "
                        f"{metric!r}", field="metric")
    if notify_url is not None:
        from spotnb.protocol.notify import check_url

        problem = check_url(str(notify_url))
        if problem:
            raise SpecError(problem, field="notify_url")
    names = _cell_names(code)
    the_space = make_space(grid=grid, params=params, study=study, space=space,
                           n_trials=n_trials, cell_names=names, sampler=sampler,
                           syntax=syntax)
    if study is not None:
        direction = "maximize" if study.direction == optuna.study.StudyDirection.MAXIMIZE \
            else "minimize"
    elif direction is None:
        direction = "maximize" if higher_is_better(metric) else "minimize"
    if direction not in ("minimize", "maximize"):
        raise SpecError(f"{{option}} must be 'minimize' or 'maximize', not {direction!r}",
                        field="direction")
    pruner = _pruner(pruner, study, optuna)
    never = missing_metric(metric, cell_metrics(code, inputs, files))
    if never is not None:
        raise SpecError(f"{{option}} {metric}: {never}. Give one of those", field="metric")
    # Everything a trial's job needs is checked now, with the first trial's parameters:
    # a bad option is refused before any instance starts.
    from spotnb.client.validation import jobs_root, prepare_job

    first = the_space.sets[0] if the_space.sets else {}
    prepared = prepare_job(code, inputs={**(inputs or {}), **first}, files=files,
                           store=store, budget_usd=budget_usd, name=name, **submit_options)
    # The sweep is kept beside its trials' jobs (an S3 bucket on AWS): it re-attaches
    # from wherever they can be read.
    root = jobs_root(prepared.provider, store, prepared.spec.resources.region)
    sweep_id = new_sweep_id()
    name = name or sweep_id
    definition: dict[str, Any] = {"version": 1, "sweep_id": sweep_id, "name": name, "code": code,
                  "created": time.time(), "space": the_space.describe(),
                  "parallel": parallel, "metric": metric, "direction": direction,
                  "budget_usd": budget_usd, "store_uri": root.uri,
                  "pruner": None if pruner is None else type(pruner).__name__,
                  "notify": notify_url is not None,
                  "options": {k: v for k, v in submit_options.items()
                              if isinstance(v, (str, int, float, bool, list, tuple))
                              and k != "secrets"}}
    trials = [Trial(n, dict(p)) for n, p in enumerate(the_space.sets)]
    search = {"space": the_space, "pruner": pruner,
              "sampler": study.sampler if study is not None else the_space.sampler,
              "inputs": dict(inputs or {}), "files": dict(files or {}),
              "submit": {**submit_options, "store": store}}
    made = Sweep(root, definition, trials, {**search, "study": study, "notify_url": notify_url})
    try:  # for a driver that takes over: never the webhook (a secret), nor the study
        kept = cloudpickle.dumps(search)
    except Exception as err:  # a pruner or sampler that does not pickle
        log.warning("sweep %s: its sampler or pruner cannot be kept (%s); a driver that "
                    "takes over uses Optuna's defaults", sweep_id, err)
        kept = cloudpickle.dumps({**search, "pruner": None, "sampler": None})
    made.store.put(SEARCH_KEY, kept)
    made.store.put(DEFINITION_KEY, json.dumps(definition).encode())
    index_sweep(root.uri, sweep_id, name, definition["created"])
    made._save(force=True)
    made.start(drive=True)
    return made


def sweeps(store: str | None = None) -> list[SweepInfo]:
    """Every sweep, oldest first, as its store says it (:class:`SweepInfo`: its
    status, ``abandoned`` where its driver is gone unfinished; trial counts; cost; best
    objective)."""
    return [sweep_info(d) for d in definitions(store)]


def find_sweep(query: str, store: str | None = None) -> dict[str, Any] | None:
    """The definition of the sweep ``query`` names (its id or its name), or None."""
    return find_definition(query, store)


def attach_sweep(query: str, store: str | None = None, resume: bool = False) -> Sweep:
    """The sweep ``query`` names (id or name), with its trials replayed and followed
    while they run. A sweep whose driver is gone (abandoned) starts no trial unless
    ``resume``: it is then driven on here."""
    from spotnb.client.jobs import attach

    definition = find_sweep(query, store)
    if definition is None:
        raise SweepNotFound(query, str(store or layout.default_store_root()))
    root = open_store(definition["store_uri"])
    prefix = sweep_prefix(root, definition["sweep_id"])
    found = read_state(prefix)
    state: dict[str, Any] = found[0] if found is not None else {"status": "running",
                                                                 "trials": []}
    trials = [Trial.from_dict(raw) for raw in state["trials"]]
    search: dict[str, Any] = {}
    with contextlib.suppress(NotFound, Exception):
        search = cloudpickle.loads(prefix.get(SEARCH_KEY))
    made = Sweep(root, definition, trials, search)
    made.status, made.reason = liveness(state), state.get("reason", "")
    made.warning = state.get("warning", "")
    made.ended_at, made.summary_sent = state.get("ended_at"), state.get("summary_sent")
    for trial in trials:
        if trial.job_id:
            run = TrialRun(attach(trial.job_id), trial, trial_label(trial))
            run.replay(follow=not made.ended)
            made.runs[trial.number] = run
    if not made.ended:
        # Follows; drives on where the driver is gone only if asked (and able to).
        made.start(drive=False, take_over=resume and bool(search))
    return made


@dataclasses.dataclass(frozen=True)
class SweepStopped:
    """What :func:`stop_sweep` did: the jobs it stopped, and how the sweep stands."""

    sweep_id: str
    name: str
    status: str
    jobs_stopped: tuple[str, ...]
    already_ended: bool


def stop_sweep(query: str, store: str | None = None,
               reason: str = "spotnb stop") -> SweepStopped:
    """End the sweep ``query`` names for good: its driver (wherever it runs) starts no
    more trials, every running trial's job is stopped, and the store says ``stopped``
    (a later attach starts nothing). A sweep that has ended is left as it is."""
    definition = find_sweep(query, store)
    if definition is None:
        raise SweepNotFound(query, str(store or layout.default_store_root()))
    prefix = sweep_prefix(open_store(definition["store_uri"]), definition["sweep_id"])
    found = read_state(prefix)
    status = liveness(found[0]) if found is not None else "running"
    if status not in ("running", "abandoned"):
        return SweepStopped(definition["sweep_id"], definition["name"], status, (), True)
    stopped = stop_in_store(prefix, reason)
    found = read_state(prefix)
    return SweepStopped(definition["sweep_id"], definition["name"],
                        liveness(found[0]) if found is not None else "stopped",
                        tuple(stopped), False)
