"""The static copy of a finished dashboard, for readers where widgets do not render.

A finished ``%%spot_train`` cell shows its plots once: in JupyterLab (or Notebook 7,
or VS Code) the live dashboard; elsewhere (GitHub, nbviewer, an HTML export read
offline, a notebook reopened without its widget state) a PNG of the same figure.
:func:`bundle` is that PNG as one output: ``image/png``, and ``text/html`` with the
image inline and a style rule that hides it on a page where the job's live dashboard
has drawn its figure (``body:has(.spotnb-live-JOB .spotnb-figure .js-plotly-plot)``).
No script and
no CDN: it reads the same offline.

The PNG is drawn with matplotlib (:func:`spotnb.records.figures.render`), in about a
second, from the data the dashboard already holds; it is not drawn when matplotlib is
missing (``pip install 'spotnb[widgets]'`` installs it).
"""

from __future__ import annotations

import base64
import html
import logging
from collections.abc import Sequence
from typing import Any

from spotnb.widgets.series import DashboardData

__all__ = ["bundle", "live_class", "png"]

log = logging.getLogger(__name__)

#: ``metadata.spotnb.figure`` of the static copy (what ``spotnb record`` looks for).
FIGURE_KIND = "dashboard"


def live_class(job_id: str) -> str:
    """The CSS class of a job's live dashboard (its static copy hides next to it)."""
    return f"spotnb-live-{job_id}"


def png(data: DashboardData, title: str, lines: Sequence[str]) -> bytes | None:
    """The dashboard's figure as a PNG, or None (no matplotlib, or it failed)."""
    try:
        from spotnb.records import figures

        if not figures.available():
            log.info("no static copy of the dashboard: %s", figures.INSTALL_HINT)
            return None
        return figures.render(data, title, lines)
    except Exception:  # the cell's outcome must not depend on a picture
        log.warning("drawing the static copy of the dashboard failed", exc_info=True)
        return None


def bundle(image: bytes, job_id: str, caption: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The static copy as ``(data, metadata)`` of one display output (module docstring).

    ``caption`` is the image's text: its ``alt`` and the output's ``text/plain``.
    """
    encoded = base64.b64encode(image).decode()
    static = f"spotnb-static-{job_id}"
    rule = (f"body:has(.{live_class(job_id)} .spotnb-figure .js-plotly-plot) .{static} "
            "{ display: none; }")
    alt = html.escape(caption, quote=True)
    page = (f"<style>{rule}</style><div class='spotnb-static {static}'>"
            f"<img src='data:image/png;base64,{encoded}' alt='{alt}' "
            "style='max-width:100%'></div>")
    data = {"image/png": encoded, "text/html": page, "text/plain": caption}
    return data, {"spotnb": {"figure": FIGURE_KIND, "job_id": job_id}}
