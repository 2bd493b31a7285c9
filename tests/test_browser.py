"""A real front end: JupyterLab on loopback, driven by headless Chromium.

The quickstart is opened in JupyterLab and run whole ("Run All Cells"); the test then
looks at what a person would see: while the job runs, the status bar still saying the
kernel is busy after clicks on the dashboard's buttons, the log panel's newest line in
view (and a reader's scroll kept), each metric on its own axis, the figure as wide as
the cell; at the end, the header saying the job completed after two interruptions, the
plots shown once, the figure following a narrower window; the picker fitting the cell,
sorting by a header and taking a row's click; and the notebook, saved and exported
with a plain ``jupyter nbconvert --to html``, showing its figure as an image offline.
Screenshots go to ``tests/artifacts/``: ``dashboard-live.png``, ``cell-finished.png``,
``picker.png``, ``export-offline.png``, ``notebook.png``.

Chromium is Debian's (``scripts/setup.sh`` installs it); Playwright only drives it
(``executable_path``), nothing is downloaded. Every request to anything but loopback is
refused. Skipped, saying why, where Chromium, Playwright or JupyterLab is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ARTIFACTS, CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LAB_START_SECONDS = 60
RUN_SECONDS = 120
_LOOPBACK = re.compile(r"^(https?|wss?)://(127\.0\.0\.1|localhost)[:/]")

if not Path(CHROMIUM).is_file():
    pytest.skip("Debian's chromium is not installed (apt-get install chromium; "
                "scripts/setup.sh does it when run as root)", allow_module_level=True)
playwright_sync = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
# JupyterLab runs as a server process: looked up, not imported (its import alone takes
# seconds, paid by every pytest-xdist worker that collects this module).
if importlib.util.find_spec("jupyterlab") is None:
    pytest.skip("jupyterlab is not installed: pip install -e '.[dev]'", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lab(spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[tuple[str, Path]]:
    """JupyterLab serving a copy of the quickstart: (base URL, notebook directory)."""
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")  # only the asked-for interruptions
    root = tmp_path / "notebooks"
    root.mkdir()
    for name in ("quickstart.ipynb", "digits_data.py"):
        shutil.copy(REPO / "notebooks" / name, root / name)
    with _jupyter_lab(root, tmp_path) as url:
        yield url, root


@contextlib.contextmanager
def _jupyter_lab(root: Path, tmp_path: Path) -> Iterator[str]:
    """JupyterLab serving ``root`` on loopback, without news or update checks: its URL."""
    settings = tmp_path / "lab-settings"
    # No "get Jupyter news?" prompt over the page, and no news fetched.
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "jupyter-runtime")}
    log = (tmp_path / "lab.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", "--IdentityProvider.token=",
         "--ServerApp.password=", f"--ServerApp.root_dir={root}",
         "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         f"--LabApp.user_settings_dir={settings}",
         f"--LabApp.workspaces_dir={tmp_path / 'lab-workspaces'}"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LAB_START_SECONDS
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("JupyterLab did not start:\n" + (
                        tmp_path / "lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()  # the server shuts its kernels down on the way out
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[tuple[Any, list[str]]]:
    """A Chromium page (new empty profile) that may only talk to loopback (and read
    local files); the list of refused URLs comes with it."""
    refused: list[str] = []

    def only_loopback(route: Any) -> None:
        url = route.request.url
        if _LOOPBACK.match(url) or url.startswith(("data:", "blob:", "file:")):
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    with playwright_sync.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1500})
        try:
            context.route("**/*", only_loopback)
            page = context.new_page()
            # Bounds, not expectations: a shared 2-core machine can be very slow.
            page.set_default_timeout(120_000)
            yield page, refused
        finally:
            context.close()


def _shot(locator: Any, name: str) -> None:
    """A screenshot of what ``locator`` shows, now (a live dashboard never holds still
    long enough for Playwright's own element screenshots)."""
    ARTIFACTS.mkdir(exist_ok=True)
    locator.evaluate("e => e.scrollIntoView({block: 'start'})")
    box = locator.bounding_box()
    page = locator.page
    viewport = page.viewport_size
    clip = {"x": max(0.0, box["x"]), "y": max(0.0, box["y"]),
            "width": min(box["width"], viewport["width"] - max(0.0, box["x"])),
            "height": min(box["height"], viewport["height"] - max(0.0, box["y"]))}
    page.screenshot(path=str(ARTIFACTS / name), clip=clip)


@pytest.mark.timeout(900)  # JupyterLab, a 300-step job with two interruptions, an export
def test_quickstart_in_jupyterlab_shows_the_dashboard_and_the_picker_works(
        lab: tuple[str, Path], page: tuple[Any, list[str]]) -> None:
    url, root = lab
    p, refused = page
    errors: list[str] = []
    p.on("pageerror", lambda err: errors.append(str(err)))
    try:
        _run_and_check(url, p)
        _export_offline(url, root, p)
    except BaseException as err:
        with contextlib.suppress(Exception):
            ARTIFACTS.mkdir(exist_ok=True)
            p.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
        if errors:
            err.add_note("errors in the page: " + "; ".join(errors[:5]))
        raise
    # The notebook itself never leaves loopback; the export's widget loader may try
    # its CDN (refused), but its figures do not need it.
    assert not [u for u in refused if "unpkg" not in u and "cdnjs" not in u], refused[:5]


# What a person sees, measured in the page.
_NEWEST_LINE_VISIBLE = """() => {
  const box = document.querySelector('.spotnb-logpanel-box');
  const lines = box && box.querySelectorAll('.spotnb-log-line');
  if (!lines || !lines.length) return null;
  const b = box.getBoundingClientRect(), l = lines[lines.length - 1].getBoundingClientRect();
  return {visible: l.top >= b.top - 1 && l.bottom <= b.bottom + 1,
          text: lines[lines.length - 1].textContent, count: lines.length,
          scrollTop: box.scrollTop};
}"""
_AXES = """() => {
  const gd = document.querySelector('.spotnb-dashboard .spotnb-figure .js-plotly-plot');
  const axis = name => gd._fullData.find(t => t.name === name)?.yaxis;
  return {loss: axis('loss'), lr: axis('lr'), cpu: axis('CPU utilisation %'),
          subplots: gd.querySelectorAll('.cartesianlayer .subplot').length};
}"""
_Y_TYPES = """() => {
  const gd = document.querySelector('.spotnb-dashboard .spotnb-figure .js-plotly-plot');
  const type = name => {
    const t = gd._fullData.find(t => t.name === name);
    return t && gd._fullLayout[t.yaxis.replace('y', 'yaxis')].type;
  };
  const xs = Object.keys(gd._fullLayout).filter(k => /^xaxis\\d+$/.test(k));
  return {loss: type('loss'), lr: type('lr'), cpu: type('CPU utilisation %'),
          linked: xs.length >= 2 && xs.every(k => gd._fullLayout[k].matches === 'x')};
}"""
_WIDTHS = """() => {
  const plot = document.querySelector('.spotnb-dashboard .spotnb-figure .js-plotly-plot .main-svg');
  const cell = document.querySelector('.spotnb-dashboard').closest('.jp-OutputArea-output');
  return {plot: plot.getBoundingClientRect().width, cell: cell.getBoundingClientRect().width};
}"""

# Per trace: its points (x a number), the runs of two points or more between its gaps
# (a line to draw each), and its line as drawn: the pieces of the path and the width
# they cover, against the length of the trace's x axis.
_DRAWN = """() => {
  const gd = document.querySelector('.spotnb-dashboard .spotnb-figure .js-plotly-plot');
  const out = {};
  for (const t of gd._fullData) {
    const finite = Array.from(t.x || [], x => x !== null && !Number.isNaN(x));
    let runs = 0, run = 0;
    for (const f of [...finite, false]) {
      if (f) { run += 1; } else { if (run >= 2) runs += 1; run = 0; }
    }
    out[t.name] = {points: finite.filter(Boolean).length, runs, pieces: 0, span: 0,
                   axis: gd._fullLayout[t.xaxis.replace('x', 'xaxis')]._length};
  }
  for (const g of gd.querySelectorAll('.scatterlayer .trace')) {
    const name = g.__data__?.[0]?.trace?.name;
    const paths = [...g.querySelectorAll('path.js-line')].filter(p => p.getAttribute('d'));
    if (!name || !out[name] || !paths.length) continue;
    const boxes = paths.map(p => p.getBoundingClientRect());
    out[name].pieces = paths.length;
    out[name].span = Math.max(...boxes.map(b => b.right)) - Math.min(...boxes.map(b => b.left));
  }
  return out;
}"""


# The kernel's status reports as the page receives them: [state, about a comm message].
_RECORD_STATUS = r"""(() => {
  window.spotnbStatus = [];
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      this.addEventListener('message', e => {
        const text = typeof e.data === 'string' ? e.data
          : e.data instanceof ArrayBuffer ? new TextDecoder().decode(e.data) : '';
        const state = /"msg_type":\s*"status"/.test(text)
          && text.match(/"execution_state":\s*"(\w+)"/);
        if (state) window.spotnbStatus.push([state[1], /"msg_type":\s*"comm_msg"/.test(text)]);
      });
    }
  };
})();"""
# Since `mark`: a click's request reported done (idle), after it the last report busy,
# and the status bar saying so.
_BUSY_AFTER_CLICKS = """mark => {
  const seen = window.spotnbStatus.slice(mark);
  return seen.some(([state, comm]) => state === 'idle' && comm)
    && seen[seen.length - 1][0] === 'busy'
    && document.body.innerText.includes('Python 3 (ipykernel) | Busy');
}"""


def _run_and_check(url: str, p: Any) -> None:
    p.add_init_script(_RECORD_STATUS)
    p.goto(f"{url}/lab/tree/quickstart.ipynb")
    # The kernel has started when the status bar says so.
    p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)
    p.get_by_role("menuitem", name="Run", exact=True).click()
    p.locator("li[data-command='runmenu:run-all']").click()
    with contextlib.suppress(playwright_sync.TimeoutError):  # asked only without a kernel
        p.locator(".jp-Dialog button", has_text="Select").click(timeout=2000)

    # Live: the dashboard plots while the job runs, an interruption is marked.
    board = p.locator(".spotnb-dashboard")
    board.locator(".spotnb-figure .js-plotly-plot").wait_for(timeout=90_000)
    # Clicks while the cell runs (Stop asks, Keep running takes it back): once the
    # kernel has reported the clicks done, the status bar still says it is busy.
    p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Busy")).wait_for(timeout=30_000)
    mark = p.evaluate("() => window.spotnbStatus.length")
    board.get_by_role("button", name="Stop job…").click()
    board.get_by_role("button", name="Keep running").click()
    board.get_by_role("button", name="Stop job…").wait_for(timeout=30_000)
    p.wait_for_function(_BUSY_AFTER_CLICKS, arg=mark, timeout=30_000)
    p.wait_for_function(
        "() => [...document.querySelectorAll('.spotnb-log-line')]"
        ".some(l => l.textContent.includes('spot interruption notice'))",
        timeout=RUN_SECONDS * 1000)
    board.locator(".spotnb-logpanel-box").evaluate("e => e.scrollIntoView({block: 'end'})")
    # The log panel follows its newest line...
    p.wait_for_function(f"() => ({_NEWEST_LINE_VISIBLE})()?.visible", timeout=30_000)
    newest = p.evaluate(_NEWEST_LINE_VISIBLE)
    # ... and a reader who scrolls up keeps their place while lines keep coming (the
    # first interruption leaves the resume, a second interruption and the rest to come).
    p.evaluate("() => { const b = document.querySelector('.spotnb-logpanel-box'); "
               "b.scrollTop = 0; b.dispatchEvent(new Event('scroll')); }")
    p.wait_for_function(f"() => ({_NEWEST_LINE_VISIBLE})().count > {newest['count']}",
                        timeout=RUN_SECONDS * 1000)
    assert p.evaluate(_NEWEST_LINE_VISIBLE)["scrollTop"] == 0
    p.evaluate("() => { const b = document.querySelector('.spotnb-logpanel-box'); "
               "b.scrollTop = b.scrollHeight; b.dispatchEvent(new Event('scroll')); }")
    p.wait_for_function(
        "() => { const gd = document.querySelector("
        "'.spotnb-dashboard .spotnb-figure .js-plotly-plot');"
        " return gd && gd._fullData && gd._fullData.some(t => t.name === 'lr' && t.x &&"
        " t.x.length > 0); }", timeout=RUN_SECONDS * 1000)
    # Each metric on its own axis; the figure as wide as the cell.
    axes = p.evaluate(_AXES)
    assert len({axes["loss"], axes["lr"], axes["cpu"]}) == 3 and axes["subplots"] >= 3, axes
    widths = p.evaluate(_WIDTHS)
    assert widths["plot"] > 0.9 * widths["cell"], widths
    # A log scale for one panel (its checkbox, while the job runs): the others keep
    # theirs; every panel's x axis follows the first's zoom.
    board.get_by_role("checkbox", name="lr", exact=True).check()
    p.wait_for_function(f"() => ({_Y_TYPES})().lr === 'log'", timeout=60_000)
    types = p.evaluate(_Y_TYPES)
    assert types["loss"] == types["cpu"] == "linear" and types["linked"], types
    _shot(board, "dashboard-live.png")

    # The end: completed after two interruptions.
    p.wait_for_function(
        "() => [...document.querySelectorAll('.spotnb-header')]"
        ".some(e => e.textContent.includes('completed'))", timeout=RUN_SECONDS * 1000)
    p.wait_for_function(  # the last cell (%spot_jobs) has run: the kernel is idle again
        "() => document.querySelector(\".jp-Notebook-ExecutionIndicator\")"
        ".getAttribute('data-status') === 'idle'", timeout=60_000)
    header = board.locator(".spotnb-header").inner_text()
    assert "completed" in header and re.search(r"interruptions\s+2", header), header
    assert re.search(r"saving\s+\d+%", header), header
    assert "step 300 of 300 (100%)" in header, header
    board.locator(".spotnb-logpanel-box").evaluate("e => e.scrollIntoView({block: 'end'})")
    p.wait_for_function(f"() => ({_NEWEST_LINE_VISIBLE})()?.visible", timeout=30_000)
    assert p.evaluate(_NEWEST_LINE_VISIBLE)["text"].startswith("test accuracy")
    # Plots with data: loss and lr have their 300 steps (and a gap at each resume), the
    # time plot its CPU and RAM samples; the loss line is drawn.
    drawn = p.evaluate(_DRAWN)
    assert drawn["loss"]["points"] >= 300 and drawn["lr"]["points"] >= 300, drawn
    # Each attempt samples its machine a second after it starts, then every second
    # while followed (every 10 s while nobody watches): at least one per attempt.
    for name in ("CPU utilisation %", "RAM used %"):
        assert drawn[name]["points"] >= 3, drawn
    # The loss line, as drawn: a piece for each attempt's run of steps (broken at each
    # resume; on a slow machine an attempt may be interrupted before its loop starts),
    # together across the width of its panel (not how plotly simplifies the path).
    loss = drawn["loss"]
    assert loss["pieces"] >= loss["runs"] >= 1 and loss["span"] > 0.9 * loss["axis"], drawn
    # The plots show once: the cell's static copy (for readers without widgets) is
    # there, hidden next to the live figure.
    cell = board.locator("xpath=ancestor::div[contains(@class, 'jp-Cell')][1]")
    static = cell.locator(".spotnb-static")
    assert static.count() == 1 and not static.is_visible()
    assert cell.locator(".spotnb-figure .js-plotly-plot").count() == 1
    # The figure follows the cell's width when the window changes.
    before = p.evaluate(_WIDTHS)
    p.set_viewport_size({"width": 1100, "height": 1500})
    p.wait_for_function(f"() => ({_WIDTHS})().plot < {before['plot'] - 100}", timeout=30_000)
    widths = p.evaluate(_WIDTHS)
    assert widths["plot"] > 0.9 * widths["cell"], widths
    p.set_viewport_size({"width": 1400, "height": 1500})
    p.wait_for_function(f"() => ({_WIDTHS})().plot > {widths['plot'] + 100}", timeout=30_000)
    cell.scroll_into_view_if_needed()
    _shot(cell, "cell-finished.png")

    _check_picker(p)
    p.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)


def _check_picker(p: Any) -> None:
    """The picker fits the cell without sideways scrolling, sorts by a header and takes
    a choice by a click on a row."""
    picker = p.locator(".spotnb-picker")
    picker.scroll_into_view_if_needed()
    fit = p.evaluate(_PICKER_FIT)
    assert fit["scroll"] <= fit["wrap"] and fit["table"] <= fit["cell"], fit
    types = picker.locator(".spotnb-picker-table tbody tr td:first-child")
    names = [types.nth(i).inner_text() for i in range(types.count())]
    assert names and not any(n.startswith(("g4ad", "g5g")) for n in names)  # CUDA only
    # Sort by the spot price: a click on its header.
    picker.locator(".spotnb-picker-table th", has_text=re.compile(r"^spot \$/h")).click()
    p.wait_for_function(
        "() => { const h = [...document.querySelectorAll('.spotnb-picker-table th')];"
        " const i = h.findIndex(t => t.textContent.startsWith('spot $/h'));"
        " if (!h[i].textContent.includes('▲')) return false;"
        " const v = [...document.querySelectorAll('.spotnb-picker-table tbody tr')]"
        ".map(r => parseFloat(r.cells[i].textContent));"
        " return v.every((x, k) => k === 0 || v[k - 1] <= x); }", timeout=30_000)
    # Choose by a click on a row.
    picker.locator(".spotnb-picker-table tr[data-type='g5.xlarge']").click()
    line = picker.locator(".spotnb-train-line")
    line.wait_for(timeout=30_000)
    assert line.inner_text() == "%%spot_train -t g5.xlarge"
    p.wait_for_function(
        "() => document.querySelector(\".spotnb-picker-table tr[data-type='g5.xlarge']\")"
        "?.textContent.startsWith('1.')", timeout=30_000)
    _shot(picker, "picker.png")


_PICKER_FIT = """() => {
  const wrap = document.querySelector('.spotnb-picker .spotnb-table-wrap');
  const cell = wrap.closest('.jp-OutputArea-output');
  return {wrap: wrap.clientWidth, scroll: wrap.scrollWidth,
          table: wrap.querySelector('table').getBoundingClientRect().width,
          cell: cell.getBoundingClientRect().width};
}"""
_CELL_TEXT = """([type, key]) => {
  const table = document.querySelector('.spotnb-picker-table');
  const i = [...table.rows[0].cells].findIndex(c => c.dataset.key === key);
  return table.querySelector(`tr[data-type='${type}']`).cells[i].textContent;
}"""


@pytest.mark.timeout(600)
def test_picker_fits_the_cell_at_1280px_and_keeps_its_reference_gpu(
        lab: tuple[str, Path], page: tuple[Any, list[str]]) -> None:
    """At a 1280 px window, JupyterLab's default layout, the picker's table fits its
    cell at the default columns; a re-run after choosing an H100 type shows the same
    costs against the same reference GPU; all columns scroll with the type in view."""
    url, root = lab
    p, _refused = page
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "outputs": [],
                     "execution_count": None, "source": src}
                    for src in ("%load_ext spotnb", "%spot_picker")],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "picker.ipynb").write_text(json.dumps(nb))
    p.set_viewport_size({"width": 1280, "height": 900})
    p.goto(f"{url}/lab/tree/picker.ipynb")
    p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)

    def run_all() -> None:
        p.get_by_role("menuitem", name="Run", exact=True).click()
        p.locator("li[data-command='runmenu:run-all']").click()
        with contextlib.suppress(playwright_sync.TimeoutError):
            p.locator(".jp-Dialog button", has_text="Select").click(timeout=2000)

    run_all()
    picker = p.locator(".spotnb-picker")
    picker.locator(".spotnb-picker-table tr[data-type='g4dn.xlarge']").wait_for(timeout=120_000)
    fit = p.evaluate(_PICKER_FIT)
    assert fit["cell"] < 900, fit  # the narrow cell a 1280 px window gives
    assert fit["scroll"] <= fit["wrap"] and fit["table"] <= fit["cell"], fit
    cost = p.evaluate(_CELL_TEXT, ["g4dn.xlarge", "est_spot_usd"])
    reference = picker.locator(".spotnb-reference")
    assert "on one T4" in reference.inner_text()
    _shot(picker, "picker-1280.png")

    # Choosing an H100 type makes it the default instance type; the picker run again
    # still counts the job on a T4, so every cost stays what it was.
    picker.locator(".spotnb-picker-table tr[data-type='p5.48xlarge']").click()
    picker.locator(".spotnb-train-line").wait_for(timeout=30_000)
    run_all()
    p.locator(".spotnb-train-line").wait_for(state="detached", timeout=120_000)
    picker.locator(".spotnb-picker-table tr[data-type='g4dn.xlarge']").wait_for(timeout=120_000)
    assert "on one T4" in reference.inner_text()
    assert p.evaluate(_CELL_TEXT, ["g4dn.xlarge", "est_spot_usd"]) == cost

    # All the columns: wider than the cell, scrolled sideways with the type in view.
    picker.get_by_text(re.compile(r"^all columns")).click()
    p.wait_for_function(f"() => ({_PICKER_FIT})().scroll > ({_PICKER_FIT})().wrap",
                        timeout=30_000)
    wrap = picker.locator(".spotnb-table-wrap")
    wrap.evaluate("w => { w.scrollLeft = w.scrollWidth; }")
    first = picker.locator(".spotnb-picker-table tbody tr td:first-child").first
    assert first.bounding_box()["x"] >= wrap.bounding_box()["x"] - 1
    assert wrap.evaluate("w => w.scrollLeft") > 0


def _export_offline(url: str, root: Path, p: Any) -> None:
    """Save the notebook as a person would, export it with a plain ``jupyter nbconvert
    --to html``, and open the export with nothing but loopback: the figure is an image."""
    saved = root / "quickstart.ipynb"
    p.get_by_role("menuitem", name="File", exact=True).click()
    p.locator("li[data-command='docmanager:save']").click()
    # JupyterLab may find the file's time on disk newer than its own record (it saved
    # it itself meanwhile): it asks, and the notebook open here is the one to keep.
    with contextlib.suppress(playwright_sync.TimeoutError):
        p.locator(".jp-Dialog button", has_text="Overwrite").click(timeout=10_000)
    deadline = time.monotonic() + 120
    while "Final dashboard of spotnb job" not in saved.read_text():
        assert time.monotonic() < deadline, (
            f"JupyterLab did not save the notebook's outputs: {saved.stat().st_size} bytes")
        time.sleep(0.2)
    size = saved.stat().st_size
    assert size < 2**20, f"the saved quickstart is {size / 2**20:.1f} MB"
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html",
                    str(saved)], check=True, capture_output=True, timeout=300)
    # Opened from the disk, as a downloaded export would be; the page's network stays
    # refused beyond loopback (its widget loader asks a CDN, in vain).
    p.goto((root / "quickstart.html").as_uri())
    image = p.get_by_alt_text(re.compile(r"^Final dashboard of spotnb job"))
    image.scroll_into_view_if_needed()
    assert image.is_visible()
    assert image.evaluate("i => i.naturalWidth") > 800
    assert image.bounding_box()["width"] > 600
    assert "interruptions 2" in p.locator("body").inner_text()  # the status, as text
    _shot(image, "export-offline.png")


# The comparison's loss panel as drawn: per run (its curve's legend group), the stroke
# colour and the pieces of its line, and of its interruption marks.
_COMPARE_DRAWN = """() => {
  const gd = document.querySelector('.spotnb-compare .spotnb-figure .js-plotly-plot');
  if (!gd || !gd._fullData) return null;
  const out = {};
  for (const g of gd.querySelectorAll('.scatterlayer .trace')) {
    const t = g.__data__?.[0]?.trace;
    if (!t || !t.meta || !t.meta.run || t.yaxis !== 'y' || t.visible !== true) continue;
    const paths = [...g.querySelectorAll('path.js-line')].filter(p => p.getAttribute('d'));
    if (!paths.length) continue;
    const run = out[t.meta.run] ??= {};
    run[t.meta.marks ? 'marks' : 'line'] = {
      stroke: paths[0].style.stroke, dash: paths[0].style.strokeDasharray,
      pieces: paths.length};
  }
  return out;
}"""


@pytest.mark.timeout(300)
def test_two_runs_appear_overlaid_in_one_panel_with_two_colours(
        spotnb_home: Path, tmp_path: Path, page: tuple[Any, list[str]]) -> None:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook
    from test_compare import fake_job

    fake_job(spotnb_home, "20250101-000000-aaaaaa", lr=0.1, interrupt_after=24, resume_at=20)
    fake_job(spotnb_home, "20250101-000000-bbbbbb", lr=0.05)
    root = tmp_path / "notebooks"
    root.mkdir()
    nbformat.write(new_notebook(
        cells=[new_code_cell("%load_ext spotnb\n%spot_compare aaaaaa bbbbbb")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}}), root / "compare.ipynb")
    p, refused = page
    with _jupyter_lab(root, tmp_path) as url:
        p.goto(f"{url}/lab/tree/compare.ipynb")
        p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)
        p.get_by_role("menuitem", name="Run", exact=True).click()
        p.locator("li[data-command='runmenu:run-all']").click()
        view = p.locator(".spotnb-compare")
        view.locator(".spotnb-figure .js-plotly-plot").wait_for(timeout=90_000)
        p.wait_for_function(f"() => Object.keys(({_COMPARE_DRAWN})() || {{}}).length == 2",
                            timeout=60_000)
        drawn = p.evaluate(_COMPARE_DRAWN)
        a, b = drawn["lr0.1 aaaaaa"], drawn["lr0.05 bbbbbb"]
        # Two curves in the one panel, each its own colour; the interrupted run's mark
        # dashed in its colour (the other run had none).
        assert a["line"]["stroke"] != b["line"]["stroke"], drawn
        assert a["marks"]["stroke"] == a["line"]["stroke"] and a["marks"]["dash"], drawn
        assert "marks" not in b, drawn
        _shot(view, "compare.png")
        # A click on a run's row hides its curves; the other stays.
        view.locator("tr[data-type='lr0.1 aaaaaa']").click()
        p.wait_for_function(f"() => Object.keys(({_COMPARE_DRAWN})() || {{}}).length == 1",
                            timeout=30_000)
        assert list(p.evaluate(_COMPARE_DRAWN)) == ["lr0.05 bbbbbb"]
    assert not refused, refused[:5]
