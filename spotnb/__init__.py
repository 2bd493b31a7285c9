"""spotnb: train in Jupyter on cheap spot GPU instances, and survive interruptions.

The Python API (the magics are a thin layer over it)::

    import spotnb
    handle = spotnb.submit(code, instance_types=["g5.xlarge"], outputs=["model"])
    result = handle.wait()

Inside the cell, on the instance: ``from spotnb import runtime as spot``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from spotnb.jobs import (
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
from spotnb.spec import SpecError


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext spotnb``: register ``%%spot_train`` and the other magics."""
    from spotnb.magics import SpotMagics

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
    "find_job",
    "jobs",
    "load_ipython_extension",
    "prepare",
    "submit",
]
