"""The sweep's Optuna study, as its driver uses it: asked for trials, told their
values as they are logged, asked whether to prune, told how each ended.

The study is the user's own (``study=``: its trials show there), or one of spotnb's
over the sweep's space: a grid or a list enqueued in order (its sampler never
samples), or the sampler the user named. A driver that takes over an abandoned sweep
rebuilds it from the trials over (:meth:`SweepStudy.prepare`), so that its sampler and
pruner compare with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from spotnb.sweep.space import Space, import_optuna
from spotnb.sweep.state import Trial

__all__ = ["Curve", "SweepStudy"]

#: A trial's values of the sweep's metric: ``[(step, value), ...]`` in step order.
Curve = list[tuple[int, float]]


class SweepStudy:
    """The driver's study (module docstring). ``search`` is the sweep's search (its
    space, pruner, sampler and the user's study); ``curve(trial)`` a trial's metric."""

    def __init__(self, search: dict[str, Any], name: str, direction: str,
                 curve: Callable[[Trial], Curve]) -> None:
        self.search = search
        self.name = name
        self.direction = direction
        self.curve = curve
        self.study: Any = None
        self._asked: dict[int, Any] = {}  # trial number -> its Optuna trial, while it runs
        self._reported: dict[int, int] = {}  # trial number -> last step reported

    @property
    def space(self) -> Space:
        space: Space = self.search["space"]
        return space

    def prepare(self, trials: Sequence[Trial]) -> None:
        """The study made new, or (taking over) rebuilt from the trials over."""
        optuna = import_optuna()
        space = self.space
        if space.kind == "study" and self.search.get("study") is not None:
            self.study = self.search["study"]
        else:
            # A grid or a list runs only its enqueued trials: the sampler never samples.
            sampler = (space.sampler or self.search.get("sampler") if space.kind == "study"
                       else optuna.samplers.RandomSampler(seed=0))
            # A study of our own is no news to the cell's output ("A new study created
            # in memory ..." at Optuna's INFO); the user's own logging is left as it is.
            verbosity = optuna.logging.get_verbosity()
            optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
            try:
                self.study = optuna.create_study(
                    study_name=self.name, direction=self.direction, sampler=sampler,
                    pruner=self.search.get("pruner") or optuna.pruners.NopPruner())
            finally:
                optuna.logging.set_verbosity(verbosity)
        for trial in trials:
            if trial.over and trial.state != "skipped":
                self.add_frozen(trial)
        if space.kind != "study":
            for trial in trials:
                if trial.state == "waiting":
                    self.study.enqueue_trial(trial.params)

    def add_frozen(self, trial: Trial) -> None:
        """A trial that ended before this driver (or that it did not ask for), told to
        the study as it ended: pruners compare with it."""
        optuna = import_optuna()
        TrialState = optuna.trial.TrialState
        state = {"completed": TrialState.COMPLETE, "pruned": TrialState.PRUNED}.get(
            trial.state, TrialState.FAIL)
        if state == TrialState.COMPLETE and trial.value is None:
            state = TrialState.FAIL
        distributions = self.space.fixed_distributions()
        with contextlib.suppress(ValueError):
            self.study.add_trial(optuna.trial.create_trial(
                params=trial.params,
                distributions={k: distributions[k] for k in trial.params
                               if k in distributions},
                value=trial.value if state == TrialState.COMPLETE else None,
                state=state, intermediate_values=dict(self.curve(trial))))

    def ask(self) -> Any:
        """The next trial (a grid's or a list's next set, enqueued; else the sampler's)."""
        return self.study.ask(self.space.fixed_distributions())

    def started(self, number: int, asked: Any) -> None:
        self._asked[number] = asked

    def failed_to_start(self, asked: Any) -> None:
        self.study.tell(asked, state=import_optuna().trial.TrialState.FAIL)

    def asks_about(self, number: int) -> bool:
        """Whether this driver asked for the trial (and may prune it)."""
        return number in self._asked

    def report(self, trial: Trial) -> tuple[int, float] | None:
        """Report the trial's new values of the metric; the step and value at which
        the pruner says to prune it (None: go on)."""
        asked = self._asked.get(trial.number)
        if asked is None:
            return None
        last = self._reported.get(trial.number, -1)
        new = [(s, v) for s, v in self.curve(trial) if s > last]
        if not new:
            return None
        for step, value in new:
            asked.report(value, step)
        self._reported[trial.number] = new[-1][0]
        return new[-1] if asked.should_prune() else None

    def ended(self, trial: Trial) -> None:
        """Tell the study how the trial ended (its ``state`` and ``value`` set)."""
        TrialState = import_optuna().trial.TrialState
        asked = self._asked.pop(trial.number, None)
        if asked is None:
            if trial.state == "completed" and self.study is not None:
                self.add_frozen(trial)
            return
        if trial.state == "pruned":
            self.study.tell(asked, state=TrialState.PRUNED)
        elif trial.state == "completed" and trial.value is not None:
            self.study.tell(asked, trial.value)
        else:
            self.study.tell(asked, state=TrialState.FAIL)
