"""Sweeps: a cell run once per parameter set, each trial a spot job with its own resume.

The notebook side only (the instance side never imports it): ``space.py`` (the
parameter sets, as an Optuna study or sampler asks for them, and their checks),
``metric.py`` (which metrics the cell logs: ``--metric`` checked), ``runner.py``
(:class:`Sweep`: the driver that submits, follows, prunes and ends the trials),
``study.py`` (its Optuna study: asked, reported to, told), ``trials.py`` (a trial's job:
followed, told the sweep's decisions as events, stopped; a sweep ended from outside),
``budget.py`` (its cost, refunds and budget), ``state.py`` (the sweep in the store:
its state, its driver's heartbeat, a stop request), ``analysis.py`` (what the view
shows of the trials: their table, the parallel coordinates, the objective against each
parameter, Optuna's parameter importance), ``api.py`` (:func:`sweep`,
:func:`attach_sweep`, :func:`sweeps`, :func:`stop_sweep`), ``view.py`` (the sweep as
text: its summary). The widget is :mod:`spotnb.widgets.sweep`; ``%%spot_sweep`` and
``%spot_sweep_stop`` are in :mod:`spotnb.client.magics`, ``spotnb sweeps`` and
``spotnb stop SWEEP`` in :mod:`spotnb.client.cli`.
"""

from spotnb.sweep.api import SweepStopped, attach_sweep, find_sweep, stop_sweep, sweep, sweeps
from spotnb.sweep.runner import Sweep
from spotnb.sweep.state import SweepInfo, SweepNotFound, Trial
from spotnb.sweep.trials import TrialRun

__all__ = ["Sweep", "SweepInfo", "SweepNotFound", "SweepStopped", "Trial", "TrialRun",
           "attach_sweep", "find_sweep", "stop_sweep", "sweep", "sweeps"]
