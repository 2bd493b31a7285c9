"""What a record keeps of an executed notebook, and its HTML export.

**Widget state.** A plotly ``FigureWidget`` (a user's own, or the dashboard figure of
an older spotnb) is an anywidget whose saved state carries the whole plotly.js bundle
(``_esm``, about 5 MB) for every figure. Neither a record nor ``spotnb run``'s executed
copy keeps it: :func:`drop_bundled_widgets` removes every
anywidget model whose ``_esm`` passes :data:`MAX_WIDGET_ESM_BYTES` and unlinks it from
the boxes that held it. The rest of the widget state stays (the dashboard's header,
output panel, controls and buttons; the instance picker), and the figure survives as
the PNG that a finished dashboard displays below itself (:mod:`spotnb.widgets.static`;
for a cell without one, :func:`add_static_figure` adds it), which every viewer shows:
GitHub, nbviewer, an HTML export read offline, an image viewer, and JupyterLab itself
wherever the live figure is not drawn.

**HTML export.** :func:`export_html` runs nbconvert's ``lab`` template on a copy of the
record in which a cell's plotly outputs (an older dashboard's static copy) give way to
its PNG: plotly's HTML loads plotly.js from a CDN, so offline it would leave a blank box
where the curves should be. The export is then one self-contained file whose figures
need no script and no network. A plain ``jupyter nbconvert --to html`` of a notebook
run with this version reads offline too: its figures are that same PNG.
"""

from __future__ import annotations

import base64
import copy
import html
import json
import os
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
    "export_html",
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
                del output["data"][WIDGET_VIEW_MIME]
                output["data"].setdefault("text/plain", "(interactive figure not kept)")
    return sorted(doomed.values())


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


def _has_image(cell: nbformat.NotebookNode) -> bool:
    return any(m in (o.get("data") or {}) for o in cell.get("outputs", []) for m in _IMAGE_MIMES)


def for_html(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` for the HTML export: where a cell has a static image, its
    plotly outputs give way to it (see the module docstring); the records' own figures
    become ``<img>`` tags with their caption as alternative text."""
    nb = copy.deepcopy(nb)
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
            meta = (output.get("metadata") or {}).get("spotnb") or {}
            if meta.get("figure") == FIGURE_KIND and "image/png" in data:
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

