"""Widgets: the live dashboard of a job and the instance picker.

``Dashboard`` is the display ``%%spot_train`` and ``%spot_attach`` use where widgets
render (a Jupyter kernel with ``ipywidgets`` and ``plotly``: ``pip install
'spotnb[widgets]'``); ``InstancePicker`` is ``%spot_picker``. Both import their
widget libraries when created, so ``import spotnb.widgets`` is cheap.

The modules: ``dashboard`` (the renderer and its wiring), ``header`` (what the job is
doing, at a glance), ``plots`` (the figure's panels and marks), ``series`` (what is
plotted, from events, bounded), ``elements`` (the widgets with front-end code of their
own: figure, log panel, table), ``static`` (the finished figure as a picture),
``picker`` (with ``ranking``: its rows, plain Python), ``compare`` (runs overlaid:
``%spot_compare``) and ``kernel`` (button clicks while the cell is busy).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotnb.widgets.dashboard import Dashboard
    from spotnb.widgets.picker import InstancePicker

__all__ = ["Dashboard", "InstancePicker", "available"]

INSTALL_HINT = "pip install 'spotnb[widgets]' (ipywidgets and plotly)"


def available() -> bool:
    """Whether the widget libraries are installed (not whether a front end renders them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("ipywidgets", "plotly"))


def __getattr__(name: str) -> Any:
    if name == "Dashboard":
        from spotnb.widgets.dashboard import Dashboard

        return Dashboard
    if name == "InstancePicker":
        from spotnb.widgets.picker import InstancePicker

        return InstancePicker
    raise AttributeError(f"module 'spotnb.widgets' has no attribute {name!r}")
