"""Sweeps: a cell run once per parameter set, each trial a spot job with its own resume.

The notebook side only (the instance side never imports it): ``space.py`` (the
parameter sets, as an Optuna study asks for them, and their checks), ``runner.py``
(:class:`Sweep`: the driver that submits, follows, prunes and ends the trials, under
one budget, and keeps the sweep in the store), ``api.py`` (:func:`sweep`,
:func:`attach_sweep`, :func:`sweeps`), ``view.py`` (the sweep's line over the
comparison of its trials, and its summary). ``%%spot_sweep`` is in
:mod:`spotnb.client.magics`.
"""

from spotnb.sweep.api import attach_sweep, find_sweep, sweep, sweeps
from spotnb.sweep.runner import Sweep, SweepNotFound, Trial

__all__ = ["Sweep", "SweepNotFound", "Trial", "attach_sweep", "find_sweep", "sweep",
           "sweeps"]
