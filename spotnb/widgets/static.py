"""Static forms of spotnb's widgets, for readers where widgets do not render.

A finished ``%%spot_train`` cell shows its plots once: in JupyterLab (or Notebook 7,
or VS Code) the live dashboard; elsewhere (GitHub, nbviewer, an HTML export read
offline, a notebook reopened without its widget state) a PNG of the same figure.
:func:`bundle` is that PNG as one output whose ``text/html`` holds the image inline
(the PNG is stored once: no ``image/png`` copy beside it) and a style rule that hides
it on a page where the job's live dashboard has drawn its figure
(``body:has(.spotnb-live-JOB .spotnb-figure .js-plotly-plot)``); its ``text/plain`` is
the caption. No script and no CDN: it reads the same offline.

The widgets' own outputs carry a ``text/html`` beside their widget view, which a
reader without widgets shows instead: the dashboard's header and output panel
(:func:`log_html`), the picker's table (:func:`table_html`).

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

__all__ = ["bundle", "live_class", "log_html", "png", "table_html"]

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
    :func:`spotnb.records.document.figure_png` reads the PNG back.
    """
    encoded = base64.b64encode(image).decode()
    static = f"spotnb-static-{job_id}"
    rule = (f"body:has(.{live_class(job_id)} .spotnb-figure .js-plotly-plot) .{static} "
            "{ display: none; }")
    alt = html.escape(caption, quote=True)
    page = (f"<style>{rule}</style><div class='spotnb-static {static}'>"
            f"<img src='data:image/png;base64,{encoded}' alt='{alt}' "
            "style='max-width:100%'></div>")
    data = {"text/html": page, "text/plain": caption}
    return data, {"spotnb": {"figure": FIGURE_KIND, "job_id": job_id}}


_LOG_COLOURS = {"stderr": "#b35900", "spotnb": "#0969da"}


def log_html(lines: Sequence[tuple[str, str]], caption: str = "") -> str:
    """The output panel's lines (``(kind, text)``, kind stdout, stderr or spotnb) as a
    static block: stderr and spotnb's own lines coloured as the live panel shows them."""
    rows = []
    for kind, text in lines:
        colour = _LOG_COLOURS.get(kind)
        escaped = html.escape(text)
        rows.append(f"<span style='color:{colour}'>{escaped}</span>" if colour else escaped)
    body = "\n".join(rows) if rows else "(no output)"
    note = (f"<div style='font-size:85%;color:#57606a'>{html.escape(caption)}</div>"
            if caption else "")
    return (f"<div class='spotnb-static-log'>{note}<pre style='margin:0;padding:4px 8px;"
            "font-size:85%;line-height:1.3;white-space:pre-wrap;word-break:break-word;"
            f"background:#f6f8fa;border:1px solid #d0d7de;border-radius:4px'>{body}</pre>"
            "</div>")


def table_html(header: Sequence[str], rows: Sequence[Sequence[str]],
               css_class: str = "spotnb-static-table") -> str:
    """A plain HTML table (every cell escaped), for a widget's table read without
    widgets."""
    head = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(h)}</th>"
                   for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in row)
        + "</tr>" for row in rows)
    return (f"<table class='{css_class}' style='border-collapse:collapse;font-size:85%'>"
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
