"""What a record keeps of an executed notebook, and its HTML export.

**Widget state.** A plotly ``FigureWidget`` (a user's own) is an anywidget whose saved
state carries the whole plotly.js bundle (``_esm``, about 5 MB) for every figure.
Neither a record nor ``spotnb run``'s executed copy keeps it:
:func:`drop_bundled_widgets` removes every anywidget model whose ``_esm`` passes
:data:`MAX_WIDGET_ESM_BYTES` and unlinks it from the boxes that held it. The rest of the
widget state stays (the dashboard's header, output panel, controls and buttons; the
instance picker), and the figure survives as the PNG that a finished dashboard displays
below itself (:mod:`spotnb.widgets.static`; for a cell without one,
:func:`add_static_figure` adds it), which every viewer shows: GitHub, nbviewer, an HTML
export read offline, an image viewer, and JupyterLab itself wherever the live figure is
not drawn.

**Views without state.** A widget view whose model the saved state does not hold (a
widget closed before the notebook was saved, or a notebook saved without its widget
state) would stay a "Loading widget..." placeholder forever:
:func:`drop_views_without_state` removes the view from its output, which keeps its
static form (spotnb's widgets give every view a ``text/html`` and a ``text/plain``
beside it; see :mod:`spotnb.widgets.static`), and removes an output left empty.

**HTML export.** :func:`export_html` runs nbconvert's ``lab`` template on a copy of the
record in which a cell's plotly outputs (an older dashboard's static copy) give way to
its PNG: plotly's HTML loads plotly.js from a CDN, so offline it would leave a blank box
where the curves should be; a widget view with a static form beside it gives way to
that form (the dashboard's header and output panel, the picker's table), since the
page's widget manager comes from a CDN and offline draws nothing; without views left,
the page loads no widget manager at all. The export is then one self-contained file
that reads whole with no script and no network. A plain ``jupyter nbconvert --to
html`` of a notebook run with this version reads offline too for its figures (that
same PNG), though widget views with saved state are left to the CDN's widget manager.
"""

from __future__ import annotations

import base64
import copy
import html
import json
import os
import re
from pathlib import Path
from typing import Any

import nbformat

__all__ = [
    "FIGURE_KIND",
    "MAX_WIDGET_ESM_BYTES",
    "PLOTLY_MIME",
    "WIDGET_STATE_MIME",
    "WIDGET_VIEW_MIME",
    "add_static_figure",
    "cell_mentions",
    "drop_bundled_widgets",
    "drop_views_without_state",
    "export_html",
    "figure_png",
    "static_figures",
]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
#: ``metadata.spotnb.figure`` of the PNG a record adds to a job's cell.
FIGURE_KIND = "dashboard"
#: An anywidget whose front-end code is larger than this bundles a library (plotly.js):
#: a record keeps the figure's data in other outputs instead.
MAX_WIDGET_ESM_BYTES = 256 * 1024
_IMAGE_MIMES = ("image/png", "image/svg+xml")


def _model_ref(model_id: str) -> str:
    return f"IPY_MODEL_{model_id}"


def drop_bundled_widgets(nb: nbformat.NotebookNode) -> list[str]:
    """Remove the widget models that carry a bundled library (see the module
    docstring); the descriptions of those removed."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE_MIME, {}).get("state", {})
    doomed = {}
    for model_id, model in state.items():
        esm = (model.get("state") or {}).get("_esm")
        if isinstance(esm, str) and len(esm) > MAX_WIDGET_ESM_BYTES:
            name = (model.get("state") or {}).get("_anywidget_id") or model.get("model_name")
            doomed[model_id] = f"{name} ({len(esm) / 2**20:.1f} MB of front-end code)"
    for model_id in doomed:
        del state[model_id]
    refs = {_model_ref(m) for m in doomed}
    for model in state.values():
        fields = model.get("state") or {}
        for key, value in list(fields.items()):
            if isinstance(value, list) and any(v in refs for v in value if isinstance(v, str)):
                fields[key] = [v for v in value if not (isinstance(v, str) and v in refs)]
            elif isinstance(value, str) and value in refs:
                fields[key] = None
    # A view of a removed model would show an error: keep its text instead.
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = (output.get("data") or {}).get(WIDGET_VIEW_MIME)
            if isinstance(view, dict) and view.get("model_id") in doomed:
                output["data"].setdefault("text/plain", "(interactive figure not kept)")
    drop_views_without_state(nb)
    return sorted(doomed.values())


def _widget_state(nb: nbformat.NotebookNode) -> dict[str, Any]:
    widgets = nb.metadata.get("widgets") or {}
    return (widgets.get(WIDGET_STATE_MIME) or {}).get("state") or {}


def _drop_views(nb: nbformat.NotebookNode, doomed: Any) -> int:
    """Remove the widget views for which ``doomed(output_data)`` holds; an output left
    without data goes too. How many views went."""
    count = 0
    for cell in nb.cells:
        if "outputs" not in cell:
            continue
        kept = []
        for output in cell.outputs:
            data = output.get("data") or {}
            if WIDGET_VIEW_MIME in data and doomed(data):
                del data[WIDGET_VIEW_MIME]
                count += 1
                if not data:
                    continue
            kept.append(output)
        cell.outputs = kept
    return count


def drop_views_without_state(nb: nbformat.NotebookNode) -> int:
    """Remove every widget view whose model is not in the notebook's saved widget
    state (see the module docstring); how many went."""
    state = _widget_state(nb)

    def stateless(data: dict[str, Any]) -> bool:
        view = data[WIDGET_VIEW_MIME]
        return not isinstance(view, dict) or view.get("model_id") not in state

    return _drop_views(nb, stateless)


def figure_png(output: dict[str, Any]) -> bytes | None:
    """The PNG of a static figure output: its ``image/png``, or the image inline in its
    ``text/html`` (a dashboard's static copy stores it there only); None without one."""
    data = output.get("data") or {}
    if isinstance(data.get("image/png"), str):
        return base64.b64decode(data["image/png"])
    found = re.search(r"src=['\"]data:image/png;base64,([A-Za-z0-9+/=]+)['\"]",
                      str(data.get("text/html", "")))
    return base64.b64decode(found.group(1)) if found else None


def cell_mentions(cell: nbformat.NotebookNode, text: str) -> bool:
    """Whether ``text`` (a job id) appears in the cell's outputs."""
    return any(text in json.dumps(output.get("data") or output.get("text") or "")
               for output in cell.get("outputs", []))


def static_figures(cell: nbformat.NotebookNode, job_id: str) -> list[dict[str, Any]]:
    """The cell's outputs that are a static image of ``job_id``'s dashboard: the one a
    record adds, or one the dashboard made itself (an image next to its plotly JSON)."""
    found = []
    for output in cell.get("outputs", []):
        data = output.get("data") or {}
        meta = (output.get("metadata") or {}).get("spotnb") or {}
        ours = meta.get("figure") == FIGURE_KIND and meta.get("job_id") == job_id
        theirs = any(m in data for m in _IMAGE_MIMES) and job_id in str(data.get("text/plain", ""))
        if ours or theirs:
            found.append(output)
    return found


def add_static_figure(cell: nbformat.NotebookNode, job_id: str, png: bytes,
                      caption: str) -> None:
    """Put ``png`` (the job's final dashboard) among the cell's outputs: after the
    job's own displays, before an error (which stays last, as the notebook showed it)."""
    output = nbformat.v4.new_output(
        "display_data",
        data={"image/png": base64.b64encode(png).decode(), "text/plain": caption},
        metadata={"spotnb": {"figure": FIGURE_KIND, "job_id": job_id}},
    )
    outputs = cell.setdefault("outputs", [])
    errors = [i for i, o in enumerate(outputs) if o.get("output_type") == "error"]
    outputs.insert(errors[0] if errors else len(outputs), output)


def _is_figure(output: dict[str, Any]) -> bool:
    return ((output.get("metadata") or {}).get("spotnb") or {}).get("figure") == FIGURE_KIND


def _has_image(cell: nbformat.NotebookNode) -> bool:
    return any(_is_figure(o) or any(m in (o.get("data") or {}) for m in _IMAGE_MIMES)
               for o in cell.get("outputs", []))


def for_html(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` for the HTML export: where a cell has a static image, its
    plotly outputs give way to it (see the module docstring); the records' own figures
    become ``<img>`` tags with their caption as alternative text; widget views with a
    static form beside them give way to it, and views without state go."""
    nb = copy.deepcopy(nb)
    _drop_views(nb, lambda data: "text/html" in data)
    drop_views_without_state(nb)
    if not any(WIDGET_VIEW_MIME in (o.get("data") or {})
               for c in nb.cells for o in c.get("outputs", [])):
        nb.metadata.pop("widgets", None)  # nothing to draw: no widget manager to load
    for cell in nb.cells:
        if cell.cell_type != "code" or not _has_image(cell):
            continue
        kept = []
        for output in cell.get("outputs", []):
            data = output.get("data") or {}
            if PLOTLY_MIME in data:
                if not any(m in data for m in _IMAGE_MIMES):
                    continue
                for mime in (PLOTLY_MIME, "text/html"):
                    data.pop(mime, None)
            if _is_figure(output) and "image/png" in data:
                alt = html.escape(str(data.get("text/plain", "")), quote=True)
                data["text/html"] = (f'<img src="data:image/png;base64,{data["image/png"]}" '
                                     f'alt="{alt}" style="max-width:100%">')
                del data["image/png"]
            kept.append(output)
        cell.outputs = kept
    return nb


def export_html(nb: nbformat.NotebookNode, path: str | os.PathLike[str]) -> Path:
    """Write the HTML export of the record ``nb`` to ``path`` (nbconvert, ``lab``
    template); its figures are visible without JavaScript."""
    from nbconvert import HTMLExporter

    body, _resources = HTMLExporter(template_name="lab").from_notebook_node(for_html(nb))
    out = Path(path)
    out.write_text(body, encoding="utf-8")
    return out

