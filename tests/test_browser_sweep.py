"""A sweep and a comparison in a real front end, then saved, reopened and exported.

JupyterLab on loopback, driven by headless Chromium (``tests/test_browser.py``'s
server and page, with their rules: Debian's Chromium, nothing downloaded, every request
to anything but loopback refused), at a 1,440 px window and JupyterLab's default
settings (widget state is not saved with the notebook). A notebook runs a sweep of five
trials (two at once, each interrupted once, one pruned), compares two of its trials and
lists the jobs. What a person would see is checked: the kernel busy for as long as the
sweep's cell runs; the trials table (parameters rounded, the pruned trial's step and
reason, the objective and the lowest value logged named apart) scrolling within the
cell, not cut; the analysis (parallel coordinates, the objective against each
parameter, Optuna's importance); a row's click opening that trial's own dashboard; the
comparison showing the trials' parameters; ``%spot_jobs`` saying pruned. Then the
notebook is saved, reopened in a fresh JupyterLab (a new kernel: no widget lives) and
exported with a plain ``jupyter nbconvert --to html`` opened from the disk with the
network off: the sweep's final view and the comparison are pictures in both.
Screenshots go to ``tests/artifacts/``: ``sweep-view.png``, ``sweep-reopened.png``,
``sweep-export-offline.png``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ARTIFACTS

pytestmark = pytest.mark.slow

from test_browser import (  # noqa: E402  (its module-level skips apply here too)
    _COMPARE_DRAWN,
    _jupyter_lab,
    _shot,
    page,  # noqa: F401  (the fixture)
    playwright_sync,
)

pytest.importorskip("optuna", reason="optuna is not installed: pip install -e '.[dev]'")

WIDTH = 1440

CELL = """
import time
ck = spot.Checkpoint(progress={"n": 0})
for step in range(ck.restore(), 60):
    spot.log(step, loss=lr * hidden / 64 * (1 + 1 / (step + 1)))
    ck.maybe_save(step)
    time.sleep(0.1)
"""
SETS = [{"lr": 0.03028525153605885, "hidden": 64}, {"lr": 0.1, "hidden": 32},
        {"lr": 0.01, "hidden": 128}, {"lr": 5.0, "hidden": 64}, {"lr": 0.003, "hidden": 32}]

# The kernel's status as the status bar says it, every 200 ms, until the sweep's line
# says it has ended: [text, the sweep's view shown].
_WATCH_STATUS = """() => {
  window.spotnbSeen = [];
  const timer = setInterval(() => {
    const status = (document.body.innerText.match(/Python 3 \\(ipykernel\\) \\| (\\w+)/)
                    || [])[1];
    const header = document.querySelector('.spotnb-sweep-header');
    window.spotnbSeen.push([status, !!header]);
    if (header && /\\) completed: /.test(header.textContent)) clearInterval(timer);
  }, 200);
}"""
_TABLE_FIT = """() => {
  const wrap = document.querySelector('.spotnb-sweep .spotnb-sweep-table').closest(
    '.spotnb-table-wrap');
  const cell = wrap.closest('.jp-OutputArea-output');
  const w = wrap.getBoundingClientRect(), c = cell.getBoundingClientRect();
  return {wrapRight: w.right, cellRight: c.right, scroll: wrap.scrollWidth,
          client: wrap.clientWidth};
}"""
_ANALYSIS = """() => {
  const gd = document.querySelector('.spotnb-sweep-analysis .js-plotly-plot');
  if (!gd || !gd._fullData) return null;
  const par = gd._fullData.find(t => t.type === 'parcoords');
  return {types: gd._fullData.map(t => t.type),
          dims: par ? par.dimensions.map(d => d.label) : [],
          lines: par ? par.line.color.length : 0,
          axes: gd.querySelectorAll('.parcoords .y-axis').length,
          canvas: document.querySelectorAll('.spotnb-sweep-analysis canvas').length};
}"""


def _notebook(root: Path) -> Path:
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    path = root / "sweep.ipynb"
    nbformat.write(new_notebook(cells=[
        new_code_cell("%load_ext spotnb\nimport optuna\n"
                      "pruner = optuna.pruners.ThresholdPruner(upper=1.0)\n"
                      f"sets = {SETS!r}"),
        new_code_cell("%%spot_sweep --params sets -k 2 --pruner pruner --name swept "
                      "--simulate-interruptions 1 --checkpoint-every 10steps" + CELL),
        new_code_cell("%spot_compare swept-t0 swept-t1"),
        new_code_cell("%spot_jobs")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}}), path)
    return path


def _run_all(p: Any, url: str, name: str) -> None:
    p.goto(f"{url}/lab/tree/{name}")
    p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)
    p.get_by_role("menuitem", name="Run", exact=True).click()
    p.locator("li[data-command='runmenu:run-all']").click()
    with contextlib.suppress(playwright_sync.TimeoutError):  # asked only without a kernel
        p.locator(".jp-Dialog button", has_text="Select").click(timeout=2000)


@pytest.mark.timeout(900)
def test_a_sweep_is_analysed_live_and_survives_saving_and_sharing(
        spotnb_home: Path, tmp_path: Path, page: tuple[Any, list[str]],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")  # only the asked-for interruptions
    root = tmp_path / "notebooks"
    root.mkdir()
    saved = _notebook(root)
    p, refused = page
    errors: list[str] = []
    p.on("pageerror", lambda err: errors.append(str(err)))
    p.set_viewport_size({"width": WIDTH, "height": 1500})
    try:
        with _jupyter_lab(root, tmp_path) as url:
            _run_all(p, url, saved.name)
            _check_live(p)
            _save(p, saved)
        # A fresh JupyterLab and kernel: no widget of the run lives; the notebook as
        # saved under the defaults (no widget state).
        assert "widgets" not in json.loads(saved.read_text())["metadata"]
        with _jupyter_lab(root, tmp_path / "again") as url:
            p.goto(f"{url}/lab/tree/{saved.name}")
            _check_pictures(p, "sweep-reopened.png")
        _export_offline(root, saved, p)
    except BaseException as err:
        with contextlib.suppress(Exception):
            ARTIFACTS.mkdir(exist_ok=True)
            p.screenshot(path=str(ARTIFACTS / "sweep-failure.png"), full_page=True)
        if errors:
            err.add_note("errors in the page: " + "; ".join(errors[:5]))
        raise
    # Nothing left loopback but what nbconvert's page template asks of a CDN (its
    # MathJax); the figures need none of it.
    assert not [u for u in refused if "cdnjs" not in u and "unpkg" not in u], refused[:5]
    # Never more than two trials at once, judged from the jobs' own events: a trial from
    # its first instance's launch to its last one's end (its replacement included).
    from test_sweep import most_at_once

    import spotnb
    from spotnb.client.jobs import attach
    from spotnb.protocol.events import EventReader
    from spotnb.protocol.events.fold import fold
    from spotnb.sweep import sweeps

    (info,) = sweeps()
    jobs = {r.name: r.job_id for r in spotnb.jobs()}
    spans = []
    for n in range(5):
        job = jobs[f"swept-t{n}"]
        instances = fold(EventReader(attach(job).store, batches=True).poll()).instances
        assert all(i.end is not None for i in instances.values()), job
        spans.append((min(i.start for i in instances.values()),
                      max(i.end or 0.0 for i in instances.values())))
    assert info.status == "completed" and most_at_once(spans) == 2


def _check_live(p: Any) -> None:
    view = p.locator(".spotnb-sweep")
    view.wait_for(timeout=120_000)
    p.evaluate(_WATCH_STATUS)
    # The sweep's end, as its line says it; meanwhile the kernel was busy throughout.
    view.locator(".spotnb-sweep-header", has_text=") completed: 5 trials").wait_for(
        timeout=400_000)
    seen = p.evaluate("() => window.spotnbSeen")
    shown = [status for status, viewed in seen if viewed]
    assert len(shown) > 20 and set(shown) == {"Busy"}, seen
    # The trials table: every trial, parameters rounded, the pruned trial's step and
    # reason, the objective and the lowest value logged named apart.
    rows = view.locator(".spotnb-sweep-table tbody tr")
    p.wait_for_function("() => document.querySelectorAll('.spotnb-sweep-table tbody tr')"
                        ".length == 5", timeout=30_000)
    heads = view.locator(".spotnb-sweep-table th").all_inner_texts()
    assert "loss (last: objective)" in heads and "lowest loss logged" in heads, heads
    texts = {rows.nth(i).locator("td").first.inner_text(): rows.nth(i).inner_text()
             for i in range(5)}
    assert "0.03029" in texts["t0"] and "0.030285" not in texts["t0"], texts["t0"]
    assert re.search(r"pruned\s+pruned at step \d+ \(loss [\d.]+\)", texts["t3"]), texts
    # Wider than the cell at 1,440 px: it scrolls within the cell, not cut.
    fit = p.evaluate(_TABLE_FIT)
    assert fit["wrapRight"] <= fit["cellRight"] + 1, fit
    # The analysis: parallel coordinates of the trials (each parameter, the state, the
    # interruptions, the objective), a panel per parameter and Optuna's importance.
    p.wait_for_function(f"() => ({_ANALYSIS})()?.types.includes('bar')", timeout=60_000)
    found = p.evaluate(_ANALYSIS)
    assert found["dims"][:4] == ["lr (log)", "hidden", "state", "interruptions"], found
    assert found["dims"][4].startswith("loss (objective)"), found
    # A line per trial, drawn (WebGL) across an axis per dimension.
    assert found["lines"] == 5 and found["axes"] == 5 and found["canvas"] >= 1, found
    assert found["types"].count("scatter") >= 2, found
    # The trials' curves in the loss panel, a colour each.
    p.wait_for_function(f"() => Object.keys(({_COMPARE_DRAWN})() || {{}}).length == 5",
                        timeout=30_000)
    drawn = p.evaluate(_COMPARE_DRAWN)
    assert len({run["line"]["stroke"] for run in drawn.values()}) == 5, drawn
    _shot(view, "sweep-view.png")
    # A trial's row opens its own dashboard, replayed: its figure and its header.
    view.locator(".spotnb-sweep-table tr[data-type='t1']").click()
    board = view.locator(".spotnb-dashboard")
    board.locator(".spotnb-figure .js-plotly-plot").wait_for(timeout=60_000)
    p.wait_for_function(
        "() => /completed/.test(document.querySelector('.spotnb-sweep .spotnb-header')"
        "?.textContent || '')", timeout=60_000)
    assert "interruptions" in board.locator(".spotnb-header").inner_text()
    # The static copy is there for readers without widgets, hidden next to the view.
    # It is drawn (matplotlib) after the header says the end: waited for, not assumed.
    static = p.locator(".spotnb-static").filter(has=p.get_by_alt_text(
        re.compile(r"^Final view of spotnb sweep")))
    static.first.wait_for(state="attached", timeout=120_000)
    assert static.count() == 1 and not static.is_visible()
    # The comparison of two trials shows their parameters; %spot_jobs says pruned.
    compare = p.locator(".spotnb-compare").last
    compare.locator(".spotnb-compare-table th", has_text="hidden").wait_for(timeout=120_000)
    assert compare.locator(".spotnb-compare-table th", has_text="lr").count() >= 1
    p.wait_for_function(
        "() => [...document.querySelectorAll('.jp-OutputArea-output')]"
        ".some(o => /swept-t3\\s*pruned/.test(o.textContent))", timeout=120_000)
    p.wait_for_function(  # the last cell has run: the kernel is idle again
        "() => document.querySelector('.jp-Notebook-ExecutionIndicator')"
        ".getAttribute('data-status') === 'idle'", timeout=120_000)


def _save(p: Any, saved: Path) -> None:
    p.get_by_role("menuitem", name="File", exact=True).click()
    p.locator("li[data-command='docmanager:save']").click()
    with contextlib.suppress(playwright_sync.TimeoutError):
        p.locator(".jp-Dialog button", has_text="Overwrite").click(timeout=10_000)
    deadline = time.monotonic() + 120
    while "Comparison of 2 runs" not in saved.read_text():
        assert time.monotonic() < deadline, "JupyterLab did not save the outputs"
        time.sleep(0.2)


def _check_pictures(p: Any, shot: str) -> None:
    """The sweep's final view and the comparison, as pictures, visible."""
    for alt in (r"^Final view of spotnb sweep", r"^Comparison of 2 runs"):
        image = p.get_by_alt_text(re.compile(alt))
        image.wait_for(timeout=60_000)
        image.scroll_into_view_if_needed()
        assert image.is_visible(), alt
        assert image.evaluate("i => i.naturalWidth") > 800, alt
        assert image.bounding_box()["width"] > 600, alt
    _shot(p.get_by_alt_text(re.compile(r"^Final view of spotnb sweep")), shot)
    # The trials table beside the picture, as text.
    assert re.search(r"pruned at step \d+", p.locator("body").inner_text())


def _export_offline(root: Path, saved: Path, p: Any) -> None:
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html",
                    str(saved)], check=True, capture_output=True, timeout=300)
    html_path = root / "sweep.html"
    page_text = html_path.read_text()
    # Our outputs carry no script: what the page draws of them needs no network.
    for marker in ("Final view of spotnb sweep", "Comparison of 2 runs"):
        start = page_text.index(marker)
        block = page_text[page_text.rfind("<div", 0, start):start]
        assert "<script" not in block
    p.goto(html_path.as_uri())
    _check_pictures(p, "sweep-export-offline.png")
