"""A static copy of the dashboard's figure, for readers where widgets do not render.

:func:`bundle` gives a MIME bundle: plotly's own JSON (``application/vnd.plotly.v1+json``,
rendered by JupyterLab, Notebook 7 and VS Code without a kernel), HTML that loads
plotly.js from its CDN (nbviewer, an HTML export; front ends that render the JSON never
use it, and untrusted notebooks do not run its script), and plain text. :func:`to_png`
renders a PNG with kaleido, which drives a Chrome or Chromium: measured here with
Debian's chromium, about 3.5 s a figure, so it is not part of the bundle unless asked.
"""

from __future__ import annotations

import json
import logging
from typing import Any

__all__ = ["bundle", "to_png"]

log = logging.getLogger(__name__)

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _static_figure(figure: Any) -> Any:
    import plotly.graph_objects as go

    static = go.Figure(figure)
    static.layout.uirevision = None
    return static


def bundle(figure: Any, title: str = "spotnb job", png: bool = False) -> dict[str, Any]:
    """A MIME bundle of ``figure`` (a ``FigureWidget`` or ``Figure``); see the module
    docstring. ``png`` adds ``image/png`` when kaleido can render it."""
    import plotly.io as pio

    static = _static_figure(figure)
    names = [t.name for t in static.data if t.name and len(t.x if t.x is not None else ())]
    out: dict[str, Any] = {
        PLOTLY_MIME: json.loads(pio.to_json(static, validate=False)),
        "text/html": pio.to_html(static, include_plotlyjs="cdn", full_html=False,
                                 validate=False),
        "text/plain": f"<{title}: figure of {', '.join(names) or 'no data'}>",
    }
    if png:
        image = to_png(static)
        if image is not None:
            out["image/png"] = image
    return out


def to_png(figure: Any, width: int = 1000, height: int = 640) -> bytes | None:
    """The figure as a PNG (kaleido and a Chrome or Chromium needed), or None."""
    import plotly.io as pio

    try:
        return bytes(pio.to_image(_static_figure(figure), format="png", width=width,
                                  height=height))
    except Exception as err:  # no kaleido, no browser: the bundle goes without a PNG
        log.info("no PNG of the figure: %s", err)
        return None
