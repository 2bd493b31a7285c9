"""spotnb: train in Jupyter on cheap spot GPU instances, and survive interruptions.

The Python API (the magics are a thin layer over it)::

    import spotnb
    handle = spotnb.submit(code, instance_types=["g5.xlarge"], outputs=["model"])
    result = handle.wait()

Inside the cell, on the instance: ``from spotnb import runtime as spot``.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from spotnb._version import __version__

if TYPE_CHECKING:
    from spotnb.client.jobs import (
        Attempt,
        JobHandle,
        JobInfo,
        JobNotFound,
        JobResult,
        attach,
        find_job,
        jobs,
        prepare,
        submit,
    )
    from spotnb.protocol.spec import SpecError

# The public names, loaded when first used (PEP 562): importing a submodule runs this
# file first, and the instance side (``spotnb.train.runtime``, the agent) must not load the
# notebook side's ``jobs`` and ``validation`` with it.
_LAZY = {
    "Attempt": "spotnb.client.jobs",
    "JobHandle": "spotnb.client.jobs",
    "JobInfo": "spotnb.client.jobs",
    "JobNotFound": "spotnb.client.jobs",
    "JobResult": "spotnb.client.jobs",
    "attach": "spotnb.client.jobs",
    "find_job": "spotnb.client.jobs",
    "jobs": "spotnb.client.jobs",
    "prepare": "spotnb.client.jobs",
    "submit": "spotnb.client.jobs",
    "SpecError": "spotnb.protocol.spec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spotnb' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"sweep"})


class _Package(types.ModuleType):
    """This package's module. ``spotnb.sweep`` is the function that runs a sweep, and
    also the subpackage that defines it (:mod:`spotnb.sweep`): importing that
    subpackage sets the package's attribute to it, which must not hide the function."""

    @property
    def sweep(self) -> Any:
        """:func:`spotnb.sweep.api.sweep`: run a cell once per parameter set (a grid, a
        list, or an Optuna study's sampler), each trial a spot job with its own resume,
        at most ``parallel`` at once, under one budget, pruned by an Optuna pruner
        (needs ``spotnb[sweep]``)."""
        if "_sweep" in self.__dict__:  # set on purpose (a test's monkeypatch, say)
            return self.__dict__["_sweep"]
        return importlib.import_module("spotnb.sweep.api").sweep

    @sweep.setter
    def sweep(self, value: Any) -> None:
        # The import system sets the subpackage here: the function stays. Anything
        # else is set on purpose and is what ``spotnb.sweep`` then is.
        if not isinstance(value, types.ModuleType):
            self.__dict__["_sweep"] = value


sys.modules[__name__].__class__ = _Package


def compare(*runs: Any, store: str | None = None, follow: bool = True) -> Any:
    """Overlay runs in one view: jobs (ids, names, ends of ids, handles; running or
    ended) and records (``.ipynb`` paths): a panel per metric, a colour per run, each
    run's interruptions marked, and a table of the runs that sorts and hides. With
    ``follow``, live runs keep updating. Returns a
    :class:`spotnb.widgets.compare.Comparison` (needs ``spotnb[widgets]``)."""
    from spotnb.client.comparison import gather
    from spotnb.widgets.compare import Comparison

    return Comparison(gather(runs, store=store, follow=follow), follow=follow)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext spotnb``: register ``%%spot_train`` and the other magics."""
    from spotnb.client.magics import SpotMagics

    ipython.register_magics(SpotMagics)

__all__ = [
    "Attempt",
    "JobHandle",
    "JobInfo",
    "JobNotFound",
    "JobResult",
    "SpecError",
    "__version__",
    "attach",
    "compare",
    "find_job",
    "jobs",
    "load_ipython_extension",
    "prepare",
    "submit",
    "sweep",
]
