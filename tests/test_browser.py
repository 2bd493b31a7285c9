"""A real front end: JupyterLab on loopback, driven by headless Chromium.

The quickstart is opened in JupyterLab and run whole ("Run All Cells"); the test then
looks at what a person would see: the dashboard's plots with data and the interruption
markers, the header saying the job completed after two interruptions, and the picker
filtering by GPU and taking a choice. Screenshots go to ``tests/artifacts/``.

Chromium is Debian's (``scripts/setup.sh`` installs it); Playwright only drives it
(``executable_path``), nothing is downloaded. Every request to anything but loopback is
refused. Skipped, saying why, where Chromium, Playwright or JupyterLab is missing.
"""

from __future__ import annotations

import contextlib
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
pytest.importorskip("jupyterlab", reason="jupyterlab is not installed: pip install -e '.[dev]'")


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
        yield url, root
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
    """A Chromium page (new empty profile) that may only talk to loopback; the list of
    refused URLs comes with it."""
    refused: list[str] = []

    def only_loopback(route: Any) -> None:
        url = route.request.url
        if _LOOPBACK.match(url) or url.startswith(("data:", "blob:")):
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
            yield context.new_page(), refused
        finally:
            context.close()


def _shot(locator: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    locator.screenshot(path=str(ARTIFACTS / name))


def test_quickstart_in_jupyterlab_shows_the_dashboard_and_the_picker_works(
        lab: tuple[str, Path], page: tuple[Any, list[str]]) -> None:
    url, _root = lab
    p, refused = page
    try:
        _run_and_check(url, p)
    except BaseException:
        with contextlib.suppress(Exception):
            ARTIFACTS.mkdir(exist_ok=True)
            p.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
        raise
    assert not refused, f"the page tried to leave loopback: {refused[:5]}"


def _run_and_check(url: str, p: Any) -> None:
    p.goto(f"{url}/lab/tree/quickstart.ipynb")
    # The kernel has started when the status bar says so.
    p.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)
    p.get_by_role("menuitem", name="Run", exact=True).click()
    p.locator("li[data-command='runmenu:run-all']").click()
    with contextlib.suppress(playwright_sync.TimeoutError):  # asked only without a kernel
        p.locator(".jp-Dialog button", has_text="Select").click(timeout=2000)

    # Live: the dashboard appears and plots while the job runs.
    board = p.locator(".spotnb-dashboard")
    board.locator(".js-plotly-plot").wait_for(timeout=90_000)
    p.wait_for_function(
        "() => [...document.querySelectorAll('.spotnb-dashboard .shapelayer path')]"
        ".length >= 3", timeout=RUN_SECONDS * 1000)
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
    _shot(board, "dashboard-final.png")

    # Plots with data: the loss line has its 300 steps; the time plots have lines too.
    lines = board.locator(".scatterlayer .trace path.js-line")
    lengths = [len(lines.nth(i).get_attribute("d") or "") for i in range(lines.count())]
    assert max(lengths) > 3000, lengths  # ~300 points of "Lx,y"
    assert sum(1 for n in lengths if n > 50) >= 4, lengths  # loss, CPU, RAM, price...
    # Interruption markers: two interruptions and two resumes, on each of three plots,
    # and the two X marks on the loss curve.
    assert board.locator(".shapelayer path").count() >= 12
    marks = board.locator(".scatterlayer .trace").filter(
        has=p.locator("path.point")).locator("path.point")
    assert marks.count() >= 2
    panel = board.locator(".spotnb-log").inner_text()
    assert panel.count("spot interruption notice") == 2 and "test accuracy" in panel
    # The static figure below it, rendered by JupyterLab's plotly extension.
    static = p.locator(".jp-RenderedPlotly")
    static.scroll_into_view_if_needed()
    static.locator(".scatterlayer .trace path.js-line").first.wait_for(timeout=30_000)
    _shot(static, "static-figure.png")

    # The picker: filter by GPU, then choose a type.
    picker = p.locator(".spotnb-picker")
    picker.scroll_into_view_if_needed()
    gpu = picker.locator(".widget-dropdown").filter(
        has=p.locator("label", has_text=re.compile(r"^GPU$"))).locator("select")
    gpu.select_option(label="A10G")
    p.wait_for_function(
        "() => { const rows = [...document.querySelectorAll("
        "'.spotnb-picker-table tbody tr')]; return rows.length > 0 && "
        "rows.every(r => r.cells[1].textContent === 'A10G'); }", timeout=30_000)
    rows = picker.locator(".spotnb-picker-table tbody tr")
    assert rows.count() >= 3
    tags = picker.locator(".jupyter-widget-tagsinput input")
    tags.click()
    tags.fill("g5.xlarge")
    tags.press("Enter")
    if tags.input_value():  # headless Chromium's datalist keeps the Enter to itself
        tags.dispatch_event("change")
    line = picker.locator(".spotnb-train-line")
    line.wait_for(timeout=30_000)
    assert line.inner_text() == "%%spot_train -t g5.xlarge"
    p.wait_for_function(
        "() => document.querySelector(\".spotnb-picker-table tr[data-type='g5.xlarge']\")"
        "?.textContent.startsWith('1.')", timeout=30_000)
    _shot(picker, "picker.png")
    p.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
