"""Two small widgets with front-end code of their own (anywidget, a few KB each).

:class:`LogPanel` is the dashboard's output panel: the last lines of remote output in
a box that follows the newest line, keeps its place when the user scrolls up (a redraw
changes its lines, not its scroll position), and filters by a search box. An HTML
value redrawn whole would jump back to the top on every update.

:class:`Table` is the picker's table: key columns frozen on the left while the rest
scrolls, a click on a header sorts (the Python side sorts, so the text display and the
widget agree), a click on a row chooses or unchooses it (``chosen``, in order).

:class:`LiveFigure` is the dashboard's plotly figure, drawn with the plotly.js that
JupyterLab's plotly extension loads (:func:`plotly_loader` has it loaded); it fills its
cell's width and keeps the user's zoom across updates.

They keep their state in traits, so a saved notebook shows them as they were; their
front-end code travels with them (no CDN, no extension to install).
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

__all__ = ["LiveFigure", "LogPanel", "Table", "plotly_loader"]

_LOG_ESM = r"""
function render({ model, el }) {
  el.classList.add("spotnb-logpanel");
  const bar = document.createElement("div");
  bar.className = "spotnb-logpanel-bar";
  const search = document.createElement("input");
  search.type = "search";
  search.placeholder = "filter the log";
  search.className = "spotnb-logpanel-search";
  const count = document.createElement("span");
  bar.append(search, count);
  const box = document.createElement("div");
  box.className = "spotnb-logpanel-box";
  const pre = document.createElement("pre");
  pre.className = "spotnb-log";
  box.append(pre);
  el.append(bar, box);
  // Follow the newest line unless the user scrolled up to read an older one. Scroll
  // events of our own (ourTop: where draw() left the box) and of a box that is not
  // laid out (a cell scrolled far out of view) say nothing about the user.
  let follow = true;
  let ourTop = -1;
  box.addEventListener("scroll", () => {
    if (!box.clientHeight || box.scrollTop === ourTop) return;
    follow = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
  });
  function place(top) {
    box.scrollTop = follow ? box.scrollHeight : top;
    ourTop = box.scrollTop;
  }
  function draw() {
    const lines = model.get("lines") || [];
    const query = search.value.trim().toLowerCase();
    const shown = query ? lines.filter((l) => l[1].toLowerCase().includes(query)) : lines;
    const top = box.scrollTop;
    pre.replaceChildren(...shown.map(([kind, text]) => {
      const span = document.createElement("span");
      span.className = "spotnb-log-line spotnb-log-" + kind;
      span.textContent = text + "\n";
      return span;
    }));
    if (!shown.length) {
      pre.textContent = query ? "(no line matches)" : model.get("placeholder");
    }
    count.textContent = query ? `${shown.length} of ${lines.length} lines`
                              : model.get("caption");
    place(top);
  }
  // Laid out again (its cell scrolled back into view): back to the newest line.
  const observer = new ResizeObserver(() => { if (box.clientHeight) place(box.scrollTop); });
  observer.observe(box);
  model.on("change:lines", draw);
  model.on("change:caption", draw);
  search.addEventListener("input", () => { follow = true; draw(); });
  draw();
  return () => observer.disconnect();
}
export default { render };
"""

# The dashboard's figure, drawn with the plotly.js that JupyterLab's own plotly extension
# loads (``window.Plotly``; the dashboard renders a tiny plotly output to have it loaded),
# so that no copy of plotly.js (5 MB) travels in the widget's state or its code: a
# widget whose code takes more than 2 s to start is given up by anywidget, and a slow
# machine parsing 5 MB of it does miss that. Plotly.react redraws in place, so the
# user's zoom survives the updates (the layout's uirevision); arrays arrive as binary
# buffers (DataView) and become Float64Arrays.
_FIGURE_ESM = r"""
function arrays(value) {
  if (value instanceof DataView) {
    return new Float64Array(value.buffer, value.byteOffset, value.byteLength / 8);
  }
  if (Array.isArray(value)) return value.map(arrays);
  if (value && typeof value === "object") {
    const out = {};
    for (const [k, v] of Object.entries(value)) out[k] = arrays(v);
    return out;
  }
  return value;
}
function render({ model, el }) {
  el.classList.add("spotnb-figure");
  const plot = document.createElement("div");
  el.append(plot);
  let Plotly = null;
  const config = { displaylogo: false, responsive: false };
  // One redraw per frame at most, however many changes came in it.
  let pending = false;
  const draw = () => {
    if (!Plotly || pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      const layout = { ...model.get("plot_layout") };
      const width = Math.floor(el.getBoundingClientRect().width);
      if (width > 0) layout.width = width;
      Plotly.react(plot, arrays(model.get("plot_data")), layout, config);
    });
  };
  const waiting = document.createElement("div");
  waiting.className = "spotnb-figure-waiting";
  waiting.textContent = "loading plotly.js…";
  el.append(waiting);
  let tries = 0;
  const start = () => {
    Plotly = window.Plotly || null;
    if (Plotly) {
      waiting.remove();
      draw();
    } else if (++tries < 600) {
      setTimeout(start, 100);
    } else {
      waiting.textContent = "The live figure needs JupyterLab's plotly extension "
        + "(pip install plotly); a picture of it is added when the job ends.";
    }
  };
  start();
  model.on("change:plot_data", draw);
  model.on("change:plot_layout", draw);
  // Fit the cell: drawn, and whenever its width changes (a window or a side panel).
  let width = 0;
  const observer = new ResizeObserver(() => {
    const now = Math.floor(el.getBoundingClientRect().width);
    if (now > 0 && Math.abs(now - width) > 2) {
      width = now;
      draw();
    }
  });
  observer.observe(el);
  return () => {
    observer.disconnect();
    if (Plotly) Plotly.purge(plot);
  };
}
export default { render };
"""

_FIGURE_CSS = """
.spotnb-figure-waiting { color: #57606a; font-size: 85%; padding: 4px 0; }
"""

_LOG_CSS = """
.spotnb-logpanel-bar { display: flex; gap: 8px; align-items: center; font-size: 85%;
  color: #57606a; margin: 2px 0; }
.spotnb-logpanel-search { width: 16em; font-size: 100%; padding: 1px 4px; }
.spotnb-logpanel-box { height: 11em; overflow-y: auto; border: 1px solid #d0d7de;
  border-radius: 4px; background: #f6f8fa; }
.spotnb-logpanel pre.spotnb-log { margin: 0; padding: 4px 8px; font-size: 85%;
  line-height: 1.3; overflow: visible !important; white-space: pre-wrap;
  word-break: break-word; background: transparent; border: none; }
.spotnb-log-stderr { color: #b35900; }
.spotnb-log-spotnb { color: #0969da; }
"""

_TABLE_ESM = r"""
function render({ model, el }) {
  el.classList.add("spotnb-table");
  const wrap = document.createElement("div");
  wrap.className = "spotnb-table-wrap";
  el.append(wrap);
  function draw() {
    const columns = model.get("columns") || [];
    const rows = model.get("rows") || [];
    const chosen = model.get("chosen") || [];
    const sortKey = model.get("sort_key");
    const table = document.createElement("table");
    table.className = model.get("table_class");
    const head = table.createTHead().insertRow();
    for (const col of columns) {
      const th = document.createElement("th");
      th.dataset.key = col.key;
      th.title = col.title || "";
      const arrow = col.key === sortKey ? (model.get("descending") ? " ▼" : " ▲") : "";
      th.textContent = col.label + arrow;
      if (col.frozen) th.classList.add("spotnb-frozen");
      th.addEventListener("click", () => {
        if (model.get("sort_key") === col.key) {
          model.set("descending", !model.get("descending"));
        } else {
          model.set("sort_key", col.key);
          model.set("descending", !!col.descending_first);
        }
        model.save_changes();
      });
      head.append(th);
    }
    const body = table.createTBody();
    for (const row of rows) {
      const tr = body.insertRow();
      tr.dataset.type = row.id;
      const rank = chosen.indexOf(row.id);
      if (rank >= 0) tr.classList.add("spotnb-chosen");
      columns.forEach((col, i) => {
        const td = tr.insertCell();
        let text = row.cells[col.key] ?? "";
        if (i === 0 && rank >= 0 && model.get("number_chosen")) text = `${rank + 1}. ${text}`;
        td.textContent = text;
        if (i === 0 && row.colour) td.style.boxShadow = `inset 4px 0 0 ${row.colour}`;
        if (row.titles && row.titles[col.key]) td.title = row.titles[col.key];
        if (col.frozen) td.classList.add("spotnb-frozen");
        if (!col.numeric) td.classList.add("spotnb-text");
      });
      tr.title = model.get("row_title") + " " + row.id;
      tr.addEventListener("click", () => {
        const now = [...(model.get("chosen") || [])];
        const at = now.indexOf(row.id);
        if (at >= 0) now.splice(at, 1); else now.push(row.id);
        model.set("chosen", now);
        model.save_changes();
      });
    }
    const top = wrap.scrollTop, left = wrap.scrollLeft;
    wrap.replaceChildren(table);
    wrap.scrollTop = top;
    wrap.scrollLeft = left;
    // Frozen columns stick at the sum of the widths of those before them.
    let offset = 0;
    columns.forEach((col, i) => {
      if (!col.frozen) return;
      for (const cell of table.querySelectorAll(`tr > :nth-child(${i + 1})`)) {
        cell.style.left = offset + "px";
      }
      offset += table.rows[0].cells[i].getBoundingClientRect().width;
    });
  }
  for (const name of ["rows", "columns", "chosen", "sort_key", "descending"]) {
    model.on("change:" + name, draw);
  }
  draw();
}
export default { render };
"""

_TABLE_CSS = """
.spotnb-table-wrap { max-height: 24em; overflow: auto; max-width: 100%;
  border: 1px solid #d0d7de; border-radius: 4px; }
.spotnb-table table { border-collapse: separate; border-spacing: 0; font-size: 12px;
  width: max-content; }
.spotnb-table th, .spotnb-table td { padding: 2px 6px; text-align: right;
  white-space: nowrap; background: #fff; border-bottom: 1px solid #eaeef2; }
.spotnb-table td.spotnb-text, .spotnb-table th { text-align: left; }
.spotnb-table th { position: sticky; top: 0; z-index: 2; cursor: pointer;
  background: #f6f8fa; user-select: none; }
.spotnb-table th:hover { background: #eaeef2; }
.spotnb-table .spotnb-frozen { position: sticky; z-index: 1; }
.spotnb-table th.spotnb-frozen { z-index: 3; }
.spotnb-table tbody tr { cursor: pointer; }
.spotnb-table tbody tr:hover td { background: #f3f8ff; }
.spotnb-table tr.spotnb-chosen td { background: #ddf4ff; font-weight: 600; }
.spotnb-compare-table tr.spotnb-chosen td { background: #fff; font-weight: normal;
  color: #8c959f; text-decoration: line-through; }
"""


class LogPanel(anywidget.AnyWidget):
    """The last lines of a job's output (see the module docstring)."""

    _esm = _LOG_ESM
    _css = _LOG_CSS
    lines: traitlets.List[Any] = traitlets.List(
        help="[kind, text] per line; kind is stdout, stderr or spotnb").tag(sync=True)
    caption = traitlets.Unicode("", help="what the panel holds, beside the search box"
                                ).tag(sync=True)
    placeholder = traitlets.Unicode("(no output yet)", help="shown without lines"
                                    ).tag(sync=True)

    def __repr__(self) -> str:
        return f"<spotnb LogPanel: {len(self.lines)} lines>"


class LiveFigure(anywidget.AnyWidget):
    """A plotly figure whose data and layout are traits (see ``_FIGURE_ESM``).

    ``plot_data`` is plotly's list of traces, numpy arrays given as ``memoryview``
    (they travel as binary buffers); ``plot_layout`` plotly's layout. Assigning either
    redraws the figure in place.
    """

    _esm = _FIGURE_ESM
    _css = _FIGURE_CSS
    plot_data: traitlets.List[Any] = traitlets.List(
        help="the traces; arrays as float64 memoryviews").tag(sync=True)
    plot_layout: traitlets.Dict[str, Any] = traitlets.Dict(
        help="the layout").tag(sync=True)

    def __repr__(self) -> str:
        return f"<spotnb LiveFigure: {len(self.plot_data)} traces>"

    def trace(self, name: str, yaxis: str | None = None) -> dict[str, Any]:
        """The first trace called ``name`` (on ``yaxis``, if given)."""
        return next(t for t in self.plot_data if t.get("name") == name
                    and (yaxis is None or t.get("yaxis") == yaxis))


class Table(anywidget.AnyWidget):
    """A table sorted by header clicks, rows chosen by clicks (module docstring).

    ``columns``: ``{"key", "label", "title", "frozen", "numeric", "descending_first"}``
    each; ``rows``: ``{"id", "cells": {key: text}, "titles": {key: tooltip}}`` each,
    and optionally ``"colour"`` (a swatch at the left of its first cell).
    """

    _esm = _TABLE_ESM
    _css = _TABLE_CSS
    columns: traitlets.List[Any] = traitlets.List(help="the columns, left to right").tag(sync=True)
    rows: traitlets.List[Any] = traitlets.List(help="the rows, in display order").tag(sync=True)
    sort_key = traitlets.Unicode("", help="the column sorted by").tag(sync=True)
    descending = traitlets.Bool(False, help="sorted from the largest").tag(sync=True)
    chosen = traitlets.List(traitlets.Unicode(), help="ids of the chosen rows, in order"
                            ).tag(sync=True)
    table_class = traitlets.Unicode("spotnb-picker-table", help="the <table>'s class"
                                    ).tag(sync=True)
    row_title = traitlets.Unicode("click to choose (or unchoose)",
                                  help="a row's tooltip, before its id").tag(sync=True)
    number_chosen = traitlets.Bool(True, help="number the chosen rows in their order"
                                   ).tag(sync=True)

    def __repr__(self) -> str:
        return f"<spotnb Table: {len(self.rows)} rows, sorted by {self.sort_key}>"

    def html(self) -> str:
        """The table as static HTML (tests, and readers that only see HTML)."""
        import html

        def cell(text: Any) -> str:
            return html.escape(str(text))

        head = "".join(f"<th>{cell(c['label'])}</th>" for c in self.columns)
        body = "".join(
            f"<tr data-type='{cell(r['id'])}'>"
            + "".join(f"<td>{cell(r['cells'].get(c['key'], ''))}</td>" for c in self.columns)
            + "</tr>" for r in self.rows)
        return (f"<table class='{cell(self.table_class)}'><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def plotly_loader() -> Any:
    """A widget of no height holding an empty plotly output: rendering it is what makes
    JupyterLab (or Notebook 7) load plotly.js, which :class:`LiveFigure` then uses."""
    import ipywidgets as w

    # Laid out (1 px) but not seen: plotly complains about resizing a plot not displayed.
    loader = w.Output(layout=w.Layout(height="1px", overflow="hidden", visibility="hidden"))
    loader.outputs = ({"output_type": "display_data", "metadata": {},
                       "data": {PLOTLY_MIME: {"data": [], "layout": {"height": 10}},
                                "text/plain": ""}},)
    return loader
