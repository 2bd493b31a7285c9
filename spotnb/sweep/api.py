"""The sweep API: :func:`sweep` starts one, :func:`attach_sweep` finds one again.

What a sweep does, and how it is kept in the store: :mod:`spotnb.sweep.runner`.
"""

from __future__ import annotations

import contextlib
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
from spotnb.sweep.runner import (
    DEFINITION_KEY,
    SEARCH_KEY,
    STATE_KEY,
    SWEEPS_PREFIX,
    Sweep,
    SweepNotFound,
    Trial,
    TrialRun,
    new_sweep_id,
    store_root,
    trial_label,
)
from spotnb.sweep.space import import_optuna, make_space

__all__ = ["attach_sweep", "find_sweep", "sweep", "sweeps"]

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


def sweep(
    code: str,
    *,
    grid: Mapping[str, Sequence[Any]] | None = None,
    params: Sequence[Mapping[str, Any]] | None = None,
    study: Any = None,
    space: Mapping[str, Any] | None = None,
    n_trials: int | None = None,
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
    **submit_options: Any,
) -> Sweep:
    """Run ``code`` once per parameter set, each a spot job with its own resume; return
    at once with the running :class:`Sweep` (module docstring).

    The parameter sets: ``grid`` (``{"lr": [0.1, 0.01], "batch": [32, 64]}``: every
    combination), ``params`` (``[{"lr": 0.1}, {"lr": 0.01}]``: these, in order) or
    ``study`` (an ``optuna.Study``, its sampler asked ``n_trials`` times over ``space``,
    a dict of Optuna distributions). Each parameter is a variable of the cell. At most
    ``parallel`` trials run at once; ``budget_usd`` covers the whole sweep. ``metric``
    (logged with ``spot.log``) is what a trial is judged by, its last value; better
    larger or smaller by its name (``direction``: ``"minimize"``/``"maximize"``, or a
    study's own). ``pruner`` (an Optuna pruner; default the study's, else none) stops
    a trial early on the metric's values as they are logged. ``notify_url``: a webhook
    that gets one summary at the end. The other options are :func:`spotnb.submit`'s,
    for every trial. Bad input raises :class:`~spotnb.protocol.errors.SpecError` before any
    instance starts.
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
                           n_trials=n_trials, cell_names=names)
    if study is not None:
        direction = "maximize" if study.direction == optuna.study.StudyDirection.MAXIMIZE \
            else "minimize"
        pruner = pruner or study.pruner
    elif direction is None:
        direction = "maximize" if higher_is_better(metric) else "minimize"
    if direction not in ("minimize", "maximize"):
        raise SpecError(f"{{option}} must be 'minimize' or 'maximize', not {direction!r}",
                        field="direction")
    if pruner is not None and not isinstance(pruner, optuna.pruners.BasePruner):
        raise SpecError(f"{{option}} must be an Optuna pruner (optuna.pruners."
                        f"MedianPruner(), ...), not {type(pruner).__name__}", field="pruner")
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
    definition = {"version": 1, "sweep_id": sweep_id, "name": name, "code": code,
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
              "sampler": study.sampler if study is not None else None,
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
    _index(made)
    made._save(force=True)
    made.start(drive=True)
    return made


def _index(made: Sweep) -> None:
    path = layout.index_dir() / "sweeps" / f"{made.sweep_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"store_uri": made.root.uri, "name": made.name,
                                "created": made.definition["created"]}))


def sweeps(store: str | None = None) -> list[dict[str, Any]]:
    """Every sweep (its ``sweep.json``), oldest first."""
    roots = {store_root(store).uri}
    if store is None and (layout.index_dir() / "sweeps").is_dir():
        for path in (layout.index_dir() / "sweeps").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                roots.add(json.loads(path.read_text())["store_uri"])
    out = {}
    for uri in roots:
        root = open_store(uri)
        for sweep_id in root.list_children(SWEEPS_PREFIX):
            with contextlib.suppress(NotFound, ValueError):
                out[sweep_id] = json.loads(root.child(f"{SWEEPS_PREFIX}/{sweep_id}")
                                           .get(DEFINITION_KEY))
    return sorted(out.values(), key=lambda d: d["created"])


def find_sweep(query: str, store: str | None = None) -> dict[str, Any] | None:
    """The definition of the sweep ``query`` names (its id or its name), or None."""
    if not query:
        return None
    matches = [d for d in sweeps(store) if query in (d["sweep_id"], d["name"])]
    return matches[-1] if matches else None


def attach_sweep(query: str, store: str | None = None, drive: bool = True) -> Sweep:
    """The sweep ``query`` names (id or name), with its trials replayed and followed
    while they run. A sweep whose driver is gone is driven on here (``drive``)."""
    from spotnb.client.jobs import attach

    definition = find_sweep(query, store)
    if definition is None:
        raise SweepNotFound(query, str(store or layout.default_store_root()))
    root = open_store(definition["store_uri"])
    prefix = root.child(f"{SWEEPS_PREFIX}/{definition['sweep_id']}")
    state = json.loads(prefix.get(STATE_KEY))
    trials = [Trial(**raw) for raw in state["trials"]]
    search: dict[str, Any] = {}
    with contextlib.suppress(NotFound, Exception):
        search = cloudpickle.loads(prefix.get(SEARCH_KEY))
    made = Sweep(root, definition, trials, search)
    made.status, made.reason = state["status"], state.get("reason", "")
    made.ended_at, made.summary_sent = state.get("ended_at"), state.get("summary_sent")
    for trial in trials:
        if trial.job_id:
            run = TrialRun(attach(trial.job_id), trial, trial_label(trial))
            run.replay(follow=not made.ended)
            made.runs[trial.number] = run
    if not made.ended and drive and search:
        made.start(drive=False)  # follows, and takes over once the driver is found gone
    return made
