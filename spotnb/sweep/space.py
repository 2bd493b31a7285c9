"""What a sweep tries: its parameter sets, as an Optuna study asks for them.

A sweep's search is Optuna's, never one of ours: a grid (its every combination) and a
list are trials enqueued in order (``Study.enqueue_trial``), and a study of the user's
own (any sampler, any pruner) is asked for trials over the ``space`` of distributions
given with it. :func:`make_space` checks everything before anything starts (an empty
grid, a parameter the cell does not read, a bad count, Optuna missing), raising
:class:`~spotnb.protocol.errors.SpecError` with the next step to take.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spotnb.protocol.errors import SpecError

__all__ = ["INSTALL_HINT", "Space", "import_optuna", "make_space", "parse_assignments"]

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
    trials at most."""

    kind: str
    names: tuple[str, ...]
    n_trials: int
    choices: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    sets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    distributions: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """JSON-ready, for the sweep's record in the store."""
        if self.kind == "study":
            return {"kind": self.kind, "n_trials": self.n_trials,
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


def _hashable_values(name: str, values: Any) -> list[Any]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise SpecError(f"the values of parameter {name!r} must be a list, e.g. "
                        f"{name}=[0.1, 0.01], not {values!r}", field="grid")
    out = list(values)
    if not out:
        raise SpecError(f"parameter {name!r} has no values: give at least one, e.g. "
                        f"{name}=[0.1, 0.01]", field="grid")
    for v in out:
        if not (v is None or isinstance(v, (int, float, str, bool))):
            raise SpecError(f"parameter {name!r}: {v!r} is not a number, string, bool or "
                            "None; a grid or list takes those (Optuna's categorical "
                            "values)", field="grid")
    return out


def make_space(*, grid: Mapping[str, Sequence[Any]] | None = None,
               params: Sequence[Mapping[str, Any]] | None = None,
               study: Any = None, space: Mapping[str, Any] | None = None,
               n_trials: int | None = None, cell_names: Iterable[str] | None = None
               ) -> Space:
    """The sweep's :class:`Space` from one of ``grid`` (a dict of value lists),
    ``params`` (a list of parameter dicts) or ``study`` with ``space`` (an Optuna study
    and a dict of its distributions; ``n_trials`` required). ``cell_names``: the names
    the cell reads; a parameter not among them is refused (a typo would otherwise run
    every trial with the same cell)."""
    given = [x for x in (grid, params, study) if x is not None]
    if len(given) != 1:
        raise SpecError("give one of grid= (a dict of value lists), params= (a list of "
                        "parameter dicts) or study= with space= (an Optuna study and its "
                        "distributions)", field="grid")
    optuna = import_optuna()
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int)
                                 or n_trials < 1):
        raise SpecError(f"{{option}} must be a whole number of trials >= 1, not "
                        f"{n_trials!r}", field="n_trials")
    if grid is not None:
        if not isinstance(grid, Mapping) or not grid:
            raise SpecError("the grid is empty: give each parameter's values, e.g. "
                            "grid={'lr': [0.1, 0.01]} or --grid lr=0.1,0.01", field="grid")
        choices = {str(k): _hashable_values(str(k), v) for k, v in grid.items()}
        total = math.prod(len(v) for v in choices.values())
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
        sets = [dict(p) for p in params if isinstance(p, Mapping)]
        if not sets or len(sets) != len(params):
            raise SpecError("the list of parameter sets is empty: give a list of dicts, "
                            "e.g. params=[{'lr': 0.1}, {'lr': 0.01}]", field="grid")
        names = tuple(dict.fromkeys(k for s in sets for k in s))
        if any(set(s) != set(names) for s in sets):
            raise SpecError(f"every parameter set must name the same parameters "
                            f"({', '.join(names)}); give each set all of them",
                            field="grid")
        choices = {n: list(dict.fromkeys(_hashable_values(n, [s[n] for s in sets])))
                   for n in names}
        result = Space("list", names, min(len(sets), n_trials or len(sets)), choices, sets)
    else:
        if not isinstance(study, optuna.Study):
            raise SpecError(f"study= must be an optuna.Study (optuna.create_study(...)), "
                            f"not {type(study).__name__}", field="study")
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
            raise SpecError("a study needs n_trials= (--trials N): how many trials to run",
                            field="n_trials")
        result = Space("study", tuple(space), n_trials, distributions=dict(space))
    if cell_names is not None:
        known = set(cell_names)
        unknown = [n for n in result.names if n not in known]
        if unknown:
            shown = ", ".join(sorted(known)) or "none"
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
