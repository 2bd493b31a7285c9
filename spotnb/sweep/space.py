"""What a sweep tries: its parameter sets, as an Optuna study asks for them.

A sweep's search is Optuna's, never one of ours: a grid (its every combination) and a
list are trials enqueued in order (``Study.enqueue_trial``); a study of the user's own
(any sampler, any pruner) is asked for trials over the ``space`` of distributions given
with it; and a sampler named by the user (``--sampler tpe|random|cmaes|qmc``,
:func:`make_sampler`) is asked for ``n_trials`` trials over a ``space`` of
distributions, or over a grid's values (each parameter a categorical). :func:`make_space`
checks everything before anything starts (an empty grid, a parameter the cell does not
read, a bad count, a sampler that cannot take the space, Optuna missing), raising
:class:`~spotnb.protocol.errors.SpecError` with the next step to take, in the syntax the
user typed (``syntax``: ``python`` for :func:`spotnb.sweep`, ``magic`` for
``%%spot_sweep``).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import itertools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spotnb.protocol.errors import SpecError

__all__ = ["INSTALL_HINT", "SAMPLERS", "Space", "import_optuna", "make_sampler", "make_space",
           "parse_assignments"]

#: The samplers ``--sampler`` names: Optuna's TPE, random, CMA-ES (needs ``cmaes``),
#: quasi-Monte Carlo (needs SciPy), and the grid (every combination, in order).
SAMPLERS = ("tpe", "random", "cmaes", "qmc", "grid")

INSTALL_HINT = "sweeps need Optuna: pip install 'spotnb[sweep]' (or pip install optuna)"


def import_optuna() -> Any:
    """Optuna, or a :class:`SpecError` saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise SpecError(INSTALL_HINT, field="study") from None
    return optuna


@dataclasses.dataclass
class Space:
    """The parameter sets of a sweep. ``kind``: ``grid``, ``list`` or ``study``;
    ``choices``: each parameter's values (grid and list; a list's in their order);
    ``sets``: the parameter sets in the order they run (a grid's every combination);
    ``distributions``: a study's space (Optuna distributions); ``n_trials``: how many
    trials at most; ``sampler``: the sampler to ask (a study of spotnb's own; None: the
    user's study's, or a grid's order)."""

    kind: str
    names: tuple[str, ...]
    n_trials: int
    choices: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    sets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    distributions: dict[str, Any] = dataclasses.field(default_factory=dict)
    sampler: Any = None

    def describe(self) -> dict[str, Any]:
        """JSON-ready, for the sweep's record in the store."""
        if self.kind == "study":
            return {"kind": self.kind, "n_trials": self.n_trials,
                    "sampler": None if self.sampler is None else type(self.sampler).__name__,
                    "distributions": {k: repr(v) for k, v in self.distributions.items()}}
        return {"kind": self.kind, "n_trials": self.n_trials,
                "choices": {k: [_plain(v) for v in vs] for k, vs in self.choices.items()},
                "sets": [{k: _plain(v) for k, v in s.items()} for s in self.sets]}

    def fixed_distributions(self) -> dict[str, Any]:
        """What ``Study.ask`` is given: each parameter's distribution."""
        if self.kind == "study":
            return dict(self.distributions)
        optuna = import_optuna()
        return {name: optuna.distributions.CategoricalDistribution(values)
                for name, values in self.choices.items()}


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else repr(value)


def _example(name: str, syntax: str) -> str:
    """A parameter with two values, as the user would type it."""
    return f"--grid {name}=0.1,0.01" if syntax == "magic" else f"grid={{{name!r}: [0.1, 0.01]}}"


def _hashable_values(name: str, values: Any, syntax: str = "python") -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise SpecError(f"the values of parameter {name!r} must be a list, e.g. "
                        f"{_example(name, syntax)}, not {values!r}", field="grid")
    out = list(values)
    if not out:
        raise SpecError(f"parameter {name!r} has no values: give at least one, e.g. "
                        f"{_example(name, syntax)}", field="grid")
    for v in out:
        if not (v is None or isinstance(v, (int, float, str, bool))):
            raise SpecError(f"parameter {name!r}: {v!r} is not a number, string, bool or "
                            "None; a grid or list takes those (Optuna's categorical "
                            "values)", field="grid")
    return out


def make_sampler(sampler: Any, syntax: str = "python") -> Any:
    """The Optuna sampler ``sampler`` names (:data:`SAMPLERS`; None and ``"grid"``:
    None, a grid's order), or ``sampler`` itself if it is one."""
    optuna = import_optuna()
    option = "--sampler" if syntax == "magic" else "sampler="
    if sampler is None or isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    if not isinstance(sampler, str) or sampler.lower() not in SAMPLERS:
        raise SpecError(f"{option} takes one of {', '.join(SAMPLERS)} (or, in Python, an "
                        f"optuna sampler), not {sampler!r}", field="sampler")
    name = sampler.lower()
    if name == "grid":
        return None
    if name == "cmaes" and importlib.util.find_spec("cmaes") is None:
        raise SpecError(f"{option} cmaes needs the cmaes package: pip install cmaes",
                        field="sampler")
    if name == "qmc" and importlib.util.find_spec("scipy") is None:
        raise SpecError(f"{option} qmc needs SciPy: pip install scipy", field="sampler")
    made = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
            "cmaes": optuna.samplers.CmaEsSampler, "qmc": optuna.samplers.QMCSampler}[name]
    with warnings.catch_warnings():
        # Asked for by name: Optuna's "experimental" note (QMC) is no news to the user.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return made()


def _numeric_only(sampler: Any) -> bool:
    """Samplers that search numeric ranges only (a categorical is sampled at random)."""
    optuna = import_optuna()
    return isinstance(sampler, (optuna.samplers.CmaEsSampler, optuna.samplers.QMCSampler))


def make_space(*, grid: Mapping[str, Sequence[Any]] | None = None,
               params: Sequence[Mapping[str, Any]] | None = None,
               study: Any = None, space: Mapping[str, Any] | None = None,
               n_trials: int | None = None, cell_names: Iterable[str] | None = None,
               sampler: Any = None, syntax: str = "python") -> Space:
    """The sweep's :class:`Space` from one of ``grid`` (a dict of value lists),
    ``params`` (a list of parameter dicts), ``study`` with ``space`` (an Optuna study
    and a dict of its distributions; ``n_trials`` required), or ``space`` alone (a
    study of spotnb's own, its ``sampler`` TPE unless named). ``sampler``
    (:data:`SAMPLERS`, or an Optuna sampler) with a grid: ``n_trials`` trials (default:
    as many as the grid has) sampled over its values. ``cell_names``: the names the cell
    reads; a parameter not among them is refused (a typo would otherwise run every
    trial with the same cell). ``syntax``: how the user typed it (``python`` or
    ``magic``), for the hints."""
    magic = syntax == "magic"

    def said(python: str, typed: str) -> str:
        return typed if magic else python

    given = [x for x in (grid, params, study) if x is not None]
    if len(given) > 1 or (not given and space is None):
        raise SpecError(said("give one of grid= (a dict of value lists), params= (a list "
                             "of parameter dicts), space= (Optuna distributions, with "
                             "n_trials=) or study= with space=",
                             "give one of --grid NAME=V1,V2 (repeatable), --params VAR, "
                             "--space VAR --trials N, or --study VAR --space VAR"),
                        field="grid")
    optuna = import_optuna()
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int)
                                 or n_trials < 1):
        raise SpecError(f"{{option}} must be a whole number of trials >= 1, not "
                        f"{n_trials!r}", field="n_trials")
    made_sampler = make_sampler(sampler, syntax)
    sampled = made_sampler is not None
    sampler_option = said("sampler=", "--sampler")
    if grid is not None:
        if not isinstance(grid, Mapping) or not grid:
            raise SpecError("the grid is empty: give each parameter's values, e.g. "
                            + said("grid={'lr': [0.1, 0.01]}", "--grid lr=0.1,0.01"),
                            field="grid")
        choices = {str(k): _hashable_values(str(k), v, syntax) for k, v in grid.items()}
        total = math.prod(len(v) for v in choices.values())
        if sampled:
            if _numeric_only(made_sampler):
                raise SpecError(
                    f"{sampler_option} {sampler} searches numeric ranges, and a grid's "
                    "values are categories: give the ranges as Optuna distributions ("
                    + said("space={'lr': optuna.distributions.FloatDistribution(1e-4, "
                           "1e-1, log=True)}, n_trials=20",
                           "--space VAR --trials N, VAR a dict of optuna.distributions")
                    + "), or use tpe or random over the grid", field="sampler")
            distributions = {name: optuna.distributions.CategoricalDistribution(values)
                             for name, values in choices.items()}
            result = Space("study", tuple(choices), n_trials or total, choices,
                           distributions=distributions, sampler=made_sampler)
        else:
            # Every combination, in order: run as a list, whose order a reader can follow.
            sets = [dict(zip(choices, values, strict=True))
                    for values in itertools.product(*choices.values())]
            result = Space("grid", tuple(choices), min(total, n_trials or total), choices,
                           sets[:n_trials or total])
    elif params is not None:
        if isinstance(params, Mapping):
            raise SpecError("params= takes a list of parameter dicts ([{'lr': 0.1}, "
                            "{'lr': 0.01}]); a dict of value lists is a grid: grid=",
                            field="grid")
        if sampled:
            raise SpecError(said("params= runs its sets in their order; a sampler takes "
                                 "grid= or space=",
                                 "--params runs its sets in their order; --sampler takes "
                                 "--grid or --space"), field="sampler")
        sets = [dict(p) for p in params if isinstance(p, Mapping)]
        if not sets or len(sets) != len(params):
            raise SpecError("the list of parameter sets is empty: give a list of dicts, "
                            "e.g. " + said("params=[{'lr': 0.1}, {'lr': 0.01}]",
                                           "sets = [{'lr': 0.1}, {'lr': 0.01}] in a cell "
                                           "above, then --params sets"), field="grid")
        names = tuple(dict.fromkeys(k for s in sets for k in s))
        if any(set(s) != set(names) for s in sets):
            raise SpecError(f"every parameter set must name the same parameters "
                            f"({', '.join(names)}); give each set all of them",
                            field="grid")
        choices = {n: list(dict.fromkeys(_hashable_values(n, [s[n] for s in sets], syntax)))
                   for n in names}
        result = Space("list", names, min(len(sets), n_trials or len(sets)), choices, sets)
    else:
        if study is not None and not isinstance(study, optuna.Study):
            raise SpecError(f"study= must be an optuna.Study (optuna.create_study(...)), "
                            f"not {type(study).__name__}", field="study")
        if study is not None and sampled:
            raise SpecError(f"{sampler_option}: the study picks its trials with its own "
                            "sampler (optuna.create_study(sampler=...)); give one or the "
                            "other", field="sampler")
        if not space or not isinstance(space, Mapping):
            raise SpecError("a study needs space=, its parameters' distributions, e.g. "
                            "space={'lr': optuna.distributions.FloatDistribution(1e-4, 1, "
                            "log=True)}", field="space")
        bad = [k for k, v in space.items()
               if not isinstance(v, optuna.distributions.BaseDistribution)]
        if bad:
            raise SpecError(f"space= {', '.join(map(repr, bad))}: each value must be an "
                            "optuna distribution (optuna.distributions.FloatDistribution, "
                            "IntDistribution, CategoricalDistribution)", field="space")
        if n_trials is None:
            raise SpecError("a " + ("study" if study is not None else "space") + " needs "
                            + said("n_trials=", "--trials N") + ": how many trials to run",
                            field="n_trials")
        if study is None and sampler == "grid":
            raise SpecError(f"{sampler_option} grid takes a grid of values ("
                            + said("grid={'lr': [0.1, 0.01]}", "--grid lr=0.1,0.01")
                            + "); over distributions use tpe, random, cmaes or qmc",
                            field="sampler")
        if study is None and made_sampler is None:
            made_sampler = optuna.samplers.TPESampler()
        result = Space("study", tuple(space), n_trials, distributions=dict(space),
                       sampler=made_sampler)
    if cell_names is not None:
        known = set(cell_names)
        unknown = [n for n in result.names if n not in known]
        if unknown:
            # What a parameter may be: a name the cell reads before assigning it, that
            # is not a builtin (range, print) nor the runtime (spot).
            shown = ", ".join(sorted(known - set(dir(builtins)) - {"spot"})) or "none"
            raise SpecError(
                f"the cell does not read parameter {', '.join(map(repr, unknown))}: a "
                f"typo? Use the name in the cell (names it reads and does not assign "
                f"first: {shown}), or remove it from the sweep", field="grid")
    for name in result.names:
        if not name.isidentifier():
            raise SpecError(f"parameter {name!r} is not a Python name; the cell reads each "
                            "parameter as a variable", field="grid")
    return result


def parse_assignments(items: Sequence[str], what: str) -> dict[str, list[Any]]:
    """``["lr=0.1,0.01", "batch=32,64"]`` (``--grid`` as typed) as ``{"lr": [0.1,
    0.01], "batch": [32, 64]}``: each value a Python literal, else a string."""
    out: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise SpecError(f"{what} takes NAME=V1,V2,..., e.g. {what} lr=0.1,0.01; not "
                            f"{item!r}", field="grid")
        out[name] = [_literal(v) for v in values.split(",") if v.strip()]
    return out


def _literal(text: str) -> Any:
    text = text.strip()
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
