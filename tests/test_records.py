"""Experiment records: ``spotnb record``, ``spotnb records list|show|compare``.

The quickstart is recorded once for the module (about 40 s: a real training job on the
local cloud, interrupted twice), with its HTML export; a small notebook with a
``parameters`` cell is recorded twice with different parameters, for listing and
comparing; a failing notebook once. The module shares one SPOTNB_HOME (and fails if a
local-cloud process outlives it, like the ``spotnb_home`` fixture), and fake AWS
credentials in the environment, which one cell of the small notebook prints: no record
may keep them.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import random
import re
import shutil
import string
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from conftest import ARTIFACTS, CHROMIUM, CHROMIUM_FLAGS, LEFTOVER_GRACE_SECONDS, _spotnb_processes
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

import spotnb
from spotnb.client import cli
from spotnb.protocol import layout
from spotnb.records import document, figures
from spotnb.records.library import compare_rows, find_records, load_record
from spotnb.records.run import inject_parameters, parse_parameters
from spotnb.records.scrub import REDACTED, scrub

# One worker runs the whole module (pytest-xdist's loadgroup): its recordings are module
# fixtures, which a module split across workers would make once on each.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("records")]

REPO = Path(__file__).resolve().parents[1]
_rng = random.Random()
FAKE_KEY_ID = "AKIA" + "".join(_rng.choices(string.ascii_uppercase + string.digits, k=16))
FAKE_SECRET = "".join(_rng.choices(string.ascii_letters + string.digits + "/+", k=40))
AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
GIT = ["git", "-c", "user.name=spotnb tests", "-c", "user.email=tests@spotnb.invalid"]


# -- the recordings, once per module ------------------------------------------------------

@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One SPOTNB_HOME for the module, with fake AWS credentials in the environment."""
    root = tmp_path_factory.mktemp("records-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPOTNB_HOME", str(root))
        mp.setenv("SPOTNB_LOCAL_HAZARD", "0")  # only the interruptions a notebook asks for
        mp.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        yield root
        deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
        while (leftovers := _spotnb_processes(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        assert not leftovers, f"processes outlived the module: {leftovers}"


@pytest.fixture(scope="module")
def records_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("records")


@pytest.fixture(scope="module")
def quickstart(home: Path, records_dir: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Any]:
    """The quickstart, recorded with its HTML export (about 40 s)."""
    src = tmp_path_factory.mktemp("quickstart")
    for name in ("quickstart.ipynb", "digits_data.py"):
        shutil.copy(REPO / "notebooks" / name, src / name)
    out = records_dir / "quickstart.record.ipynb"
    started = time.monotonic()
    code = cli.main(["record", str(src / "quickstart.ipynb"), "-o", str(out), "--html"])
    return {"code": code, "path": out, "html": out.with_suffix(".html"), "source": src,
            "seconds": time.monotonic() - started}


SMALL_TRAIN = """\
%%spot_train --name small --out final_loss -t g4dn.xlarge
import time

w = 4.0
for step in range(STEPS):
    w -= LR * 0.2 * w  # gradient descent on 0.1 * w**2
    spot.log(step, loss=0.1 * w * w)
    time.sleep(0.02)
final_loss = 0.1 * w * w
print(f"final loss {final_loss:.6f}")"""

# A careless cell: it prints the credentials in the environment.
LEAKY = """\
import os
print("key id", os.environ["AWS_ACCESS_KEY_ID"], "secret", os.environ["AWS_SECRET_ACCESS_KEY"])
dict(os.environ)"""


def _small_notebook(path: Path) -> Path:
    nb = new_notebook(cells=[
        new_markdown_cell("# A small parameterised notebook"),
        new_code_cell("%load_ext spotnb"),
        new_code_cell("STEPS = 30\nLR = 0.5", metadata={"tags": ["parameters"]}),
        new_code_cell(SMALL_TRAIN),
        new_code_cell(LEAKY),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}})
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def small(home: Path, records_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Any]:
    """The small notebook in a git repository, recorded twice: A with its own parameters
    from a clean checkout, B with ``-p STEPS=60 -p LR=0.25`` after an untracked file
    appeared."""
    repo = tmp_path_factory.mktemp("small-repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    _small_notebook(repo / "small.ipynb")
    subprocess.run([*GIT, "-C", str(repo), "add", "small.ipynb"], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-q", "-m", "small"], check=True)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()
    a, b = records_dir / "small-a.record.ipynb", records_dir / "small-b.record.ipynb"
    code_a = cli.main(["record", str(repo / "small.ipynb"), "-o", str(a)])
    (repo / "notes.txt").write_text("not committed\n")
    code_b = cli.main(["record", str(repo / "small.ipynb"), "-o", str(b),
                       "-p", "STEPS=60", "-p", "LR=0.25"])
    return {"a": a, "b": b, "codes": (code_a, code_b), "commit": commit, "repo": repo}


@pytest.fixture(scope="module")
def failing(home: Path, records_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> dict[str, Any]:
    src = tmp_path_factory.mktemp("failing")
    nb = new_notebook(cells=[
        new_code_cell("%load_ext spotnb"),
        new_code_cell("%%spot_train --name failing\nx = 1\nx / 0"),
        new_code_cell("print('not run')"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}})
    nbformat.write(nb, src / "failing.ipynb")
    out = records_dir / "failing.record.ipynb"
    code = cli.main(["record", str(src / "failing.ipynb"), "-o", str(out)])
    return {"code": code, "path": out}


def _meta(path: Path) -> dict[str, Any]:
    return dict(nbformat.read(path, as_version=4).metadata["spotnb"])


def _text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            parts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append(_ANSI.sub("", "\n".join(out["traceback"])))
    return "".join(parts)


# -- the quickstart's record ----------------------------------------------------------------

def test_recording_the_quickstart_keeps_interruptions_cost_and_accuracy(
        quickstart: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert quickstart["code"] == 0
    nb = nbformat.read(quickstart["path"], as_version=4)
    nbformat.validate(nb)
    meta = nb.metadata["spotnb"]
    run = meta["run"]
    assert run["status"] == "completed" and run["error"] is None
    assert run["notebook"] == "quickstart.ipynb"
    assert run["default_parameters"] == {"SEED": 0, "STEPS": 300, "LR": 0.1,
                                         "STEP_SECONDS": 0.02}
    assert run["parameters"] == {}
    assert {"python", "spotnb", "torch", "nbclient", "kernel_python"} <= set(run["versions"])
    assert run["versions"]["spotnb"] == spotnb.__version__

    (job,) = meta["jobs"]
    train = nb.cells[job["cell"]]
    assert train.source.startswith("%%spot_train")
    assert job["name"] == "quickstart" and job["status"] == "completed"
    assert job["interruptions"] == 2
    assert [a["end_reason"] for a in job["attempts"]] == ["interrupted", "interrupted",
                                                          "completed"]
    assert all(a["instance_type"] == "g4dn.xlarge" and a["spot_price_usd_per_hour"] > 0
               for a in job["attempts"])
    assert 0 < job["cost_usd"] < job["ondemand_cost_usd"]
    assert job["savings_pct"] == pytest.approx(
        100 * (1 - job["cost_usd"] / job["ondemand_cost_usd"]), abs=0.01)
    assert meta["totals"]["cost_usd"] == job["cost_usd"]
    # The final accuracy is the --out value the notebook printed.
    printed = float(re.search(r"test accuracy (\d\.\d+)", _text(train)).group(1))  # type: ignore[union-attr]
    accuracy = job["final_metrics"]["accuracy"]
    assert accuracy > 0.9 and accuracy == pytest.approx(printed, abs=1e-3)
    assert job["outputs"]["model"] == {"type": "torch.nn.modules.container.Sequential"}
    assert job["final_metrics"]["loss"] == job["metrics"]["loss"]
    assert job["options"]["instance_types"] == ["g4dn.xlarge", "g5.xlarge"]
    assert job["options"]["checkpoint_every"] == "every 25 steps"
    assert len(job["curves"]["loss"]["step"]) == 300  # steps 0..299, redone ones once

    handle = spotnb.attach(job["job_id"])
    assert job["code_sha256"] == hashlib.sha256(handle.spec.code.encode()).hexdigest()
    latest = job["checkpoints"]["latest"]
    assert latest.startswith("file://") and Path(latest[len("file://"):], "MANIFEST.json").is_file()
    # A notice forces a save. (Not one per notice: a notice that lands while an attempt
    # boots, or just after a periodic save, has nothing new to save: a busy machine saw
    # 1 of 2.)
    assert job["checkpoints"]["written"] >= 3 and job["checkpoints"]["forced_by_notice"] >= 1
    # The same record is the job's summary.json in its store prefix.
    stored = json.loads(handle.store.get(layout.SUMMARY))
    assert stored == {k: v for k, v in job.items() if k != "cell"}


def test_the_quickstart_survives_two_interruptions_and_shows_what_it_cost(
        quickstart: dict[str, Any]) -> None:
    """What a reader of the executed quickstart sees (a record is the executed copy,
    as ``spotnb run`` writes it, plus its metadata: one run of the quickstart for both;
    it takes the better part of a minute)."""
    assert quickstart["code"] == 0
    nb = nbformat.read(quickstart["path"], as_version=4)
    train = next(c for c in nb.cells if c.source.startswith("%%spot_train"))
    text = _text(train)
    assert text.count("spot interruption notice") == 2, text
    assert "attempt 3: resuming on a replacement instance" in text
    # The resumed attempts started where the checkpoint left off, not at 0.
    starts = [int(s) for s in re.findall(r"attempt \d: starting at step (\d+)", text)]
    assert len(starts) == 3 and starts[0] == 0 and 0 < starts[1] < starts[2], starts
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", text).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.9
    status = [o["data"]["text/plain"] for o in train.outputs
              if o.get("data", {}).get("text/plain", "").startswith("spotnb job")][-1]
    assert "completed" in status and "interruptions 2" in status
    report = _text(next(c for c in nb.cells if c.cell_type == "code"
                        and "%spot_result" in c.source))
    match = re.search(r"accuracy (\d\.\d+) after 2 interruptions and 3 attempts\n"
                      r"cost \$(\d+\.\d+) on spot vs \$(\d+\.\d+) on-demand", report)
    assert match, report
    assert float(match.group(1)) == pytest.approx(accuracy, abs=1e-3)
    assert 0 < float(match.group(2)) < float(match.group(3))
    # Its widgets, as a reader of the executed copy sees them.
    from test_widgets_notebook import (
        assert_executed_quickstart_is_small_and_shows_its_plots_once_as_an_image as widgets,
    )
    widgets(quickstart["path"])


def test_the_quickstart_record_is_small_and_carries_a_static_dashboard(
        quickstart: dict[str, Any]) -> None:
    from PIL import Image

    size = quickstart["path"].stat().st_size
    assert size < 2**20, f"the record is {size / 2**20:.1f} MB"
    nb = nbformat.read(quickstart["path"], as_version=4)
    (job,) = nb.metadata["spotnb"]["jobs"]
    train = nb.cells[job["cell"]]
    # The dashboard's own PNG: the record adds none of its own.
    (figure,) = document.static_figures(train, job["job_id"])
    png = document.figure_png(figure)
    assert png is not None
    image = Image.open(io.BytesIO(png))
    assert image.size[0] >= 900 and image.size[1] >= 400
    # The figure's 5 MB bundle is not kept, and nothing needs a CDN.
    assert not any(document.PLOTLY_MIME in o.get("data", {}) for o in train.outputs)
    state = nb.metadata["widgets"][document.WIDGET_STATE_MIME]["state"]
    assert all(len(json.dumps(m)) < document.MAX_WIDGET_ESM_BYTES for m in state.values())
    # The live figure carries no plotly.js of its own: nothing had to be dropped.
    assert nb.metadata["spotnb"]["run"]["widgets_dropped"] == []
    # The rest of the dashboard's widgets remain, and no box points at a missing model.
    views = [o["data"][document.WIDGET_VIEW_MIME]["model_id"] for o in train.outputs
             if document.WIDGET_VIEW_MIME in o.get("data", {})]
    assert views and all(v in state for v in views)
    refs = set(re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(state)))
    assert refs <= set(state)


def _loss_pixels(png: bytes) -> int:
    """Pixels of the loss curve's colour (nothing else in the figure uses it)."""
    import numpy as np
    from PIL import Image

    target = np.array([int(figures.LOSS_COLOUR[i:i + 2], 16) for i in (1, 3, 5)])
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=int)
    return int(np.all(np.abs(pixels - target) <= 24, axis=-1).sum())


def test_the_html_export_shows_the_loss_curve_in_headless_chromium(
        quickstart: dict[str, Any], tmp_path: Path) -> None:
    if not Path(CHROMIUM).is_file():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    html = quickstart["html"]
    assert html.is_file()
    body = html.read_text()
    assert document.PLOTLY_MIME not in body  # the export shows the PNG, not a CDN script
    # The final PNG is stored once, in the record and in its export.
    nb = nbformat.read(quickstart["path"], as_version=4)
    (job,) = nb.metadata["spotnb"]["jobs"]
    (figure,) = document.static_figures(nb.cells[job["cell"]], job["job_id"])
    encoded = base64.b64encode(document.figure_png(figure) or b"").decode()
    assert quickstart["path"].read_text().count(encoded) == 1
    assert body.count(encoded) == 1
    # No widget manager to fetch: every widget view gave way to its static form.
    assert document.WIDGET_VIEW_MIME not in body and "html-manager" not in body
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        shot = _screenshot_with_cli(html, tmp_path)
    else:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                # Nothing but the file itself: the figures must not need the network.
                page.route("**/*", lambda route: route.continue_()
                           if route.request.url.startswith("file:") else route.abort())
                page.goto(html.as_uri())
                # What a person reads offline: the picker's table, the training's
                # output (the dashboard's output panel), and no widget placeholder.
                text = page.inner_text("body")
                assert "Loading widget" not in text
                picker = page.locator(".spotnb-static-picker table")
                assert picker.count() == 1 and picker.is_visible()
                assert "g4dn.xlarge" in picker.inner_text()
                assert "job $ spot" in picker.inner_text()
                panel = page.locator(".spotnb-static-log")
                assert panel.count() == 1 and panel.is_visible()
                log = panel.inner_text()
                assert "test accuracy" in log and log.count("spot interruption notice") == 2
                sizes = page.evaluate("Array.from(document.images).map("
                                      "i => [i.naturalWidth, i.getBoundingClientRect().width])")
                assert sizes and all(w > 0 for w, _ in sizes), sizes
                image = page.get_by_alt_text(re.compile(r"^Final dashboard of spotnb job"))
                image.scroll_into_view_if_needed()
                assert image.is_visible()
                box = image.bounding_box()
                assert box is not None and box["width"] > 600 and box["height"] > 400
                shot = image.screenshot()
            finally:
                browser.close()
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "record-html-figure.png").write_bytes(shot)
    assert _loss_pixels(shot) > 500, "the loss curve is not visible in the export"


def _screenshot_with_cli(html: Path, tmp_path: Path) -> bytes:
    """Without Playwright: the whole page, tall enough to hold every output."""
    out = tmp_path / "page.png"
    subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                    f"--screenshot={out}", "--window-size=1280,9000", html.as_uri()],
                   check=True, capture_output=True, timeout=120)
    return out.read_bytes()


def test_the_job_ended_hook_stores_and_returns_the_record(
        quickstart: dict[str, Any]) -> None:
    from spotnb import records

    (job,) = _meta(quickstart["path"])["jobs"]
    handle = spotnb.attach(job["job_id"])
    handle.store.delete(layout.SUMMARY)
    result = handle.wait(timeout=10)  # with its outputs, as the notebook has them
    record = records.job_ended(handle, result)
    assert record is not None
    assert record["job_id"] == job["job_id"] and record["interruptions"] == 2
    assert record["final_metrics"]["accuracy"] == pytest.approx(
        job["final_metrics"]["accuracy"])
    assert json.loads(handle.store.get(layout.SUMMARY)) == record
    line = records.record_bundle(record)["text/plain"]
    assert "2 interruption(s)" in line and "accuracy 0.9" in line


def test_a_cell_whose_job_ended_carries_the_record_in_its_output_metadata(
        quickstart: dict[str, Any]) -> None:
    nb = nbformat.read(quickstart["path"], as_version=4)
    (job,) = nb.metadata["spotnb"]["jobs"]
    carried = [o["metadata"]["spotnb"]["job"] for o in nb.cells[job["cell"]].outputs
               if "job" in (o.get("metadata") or {}).get("spotnb", {})]
    assert [c["job_id"] for c in carried] == [job["job_id"]]
    assert carried[0]["interruptions"] == 2
    assert carried[0]["final_metrics"]["accuracy"] == job["final_metrics"]["accuracy"]
    # A notebook saved by hand (no metadata.spotnb) still lists as a record.
    del nb.metadata["spotnb"]
    by_hand = quickstart["source"] / "by-hand.ipynb"
    nbformat.write(nb, by_hand)
    assert load_record(by_hand).jobs[0]["job_id"] == job["job_id"]


# -- parameters, listing, comparing -----------------------------------------------------

def test_parameters_are_injected_after_the_parameters_cell(small: dict[str, Any]) -> None:
    assert small["codes"] == (0, 0)
    nb = nbformat.read(small["b"], as_version=4)
    nbformat.validate(nb)
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    at = tags.index(["parameters"])
    assert tags[at + 1] == ["injected-parameters"]
    assert "STEPS = 60" in nb.cells[at + 1].source and "LR = 0.25" in nb.cells[at + 1].source
    run = nb.metadata["spotnb"]["run"]
    assert run["parameters"] == {"STEPS": 60, "LR": 0.25}
    assert run["default_parameters"] == {"STEPS": 30, "LR": 0.5}
    (job,) = nb.metadata["spotnb"]["jobs"]
    assert len(job["curves"]["loss"]["step"]) == 60  # the job ran with the override
    assert job["final_metrics"]["final_loss"] == pytest.approx(0.1 * (4 * 0.95 ** 60) ** 2)
    (job_a,) = _meta(small["a"])["jobs"]
    assert len(job_a["curves"]["loss"]["step"]) == 30


def test_the_record_notes_the_git_commit_and_uncommitted_changes(
        small: dict[str, Any]) -> None:
    git_a, git_b = _meta(small["a"])["run"]["git"], _meta(small["b"])["run"]["git"]
    assert git_a["commit"] == git_b["commit"] == small["commit"]
    assert (git_a["dirty"], git_b["dirty"]) == (False, True)
    assert git_b["changes"] == ["notes.txt"]


def test_records_list_and_compare_two_runs_with_different_parameters(
        quickstart: dict[str, Any], small: dict[str, Any], failing: dict[str, Any],
        records_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli.main(["records", "list", str(records_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["record", "date", "status"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"quickstart.record.ipynb", "small-a.record.ipynb",
                         "small-b.record.ipynb", "failing.record.ipynb"}
    assert "completed" in rows["quickstart.record.ipynb"]
    assert re.search(r"\s2\s+accuracy 0\.9\d+, loss", rows["quickstart.record.ipynb"])
    assert "failed" in rows["failing.record.ipynb"]
    assert "final_loss" in rows["small-b.record.ipynb"]

    figure = records_dir / "a-vs-b.png"
    assert cli.main(["records", "compare", str(small["a"]), str(small["b"]),
                     "-o", str(figure)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\* STEPS\s+30\s+60$", out, re.M), out
    assert re.search(r"^\* LR\s+0\.5\s+0\.25$", out, re.M), out
    assert re.search(r"^  instance_types\s+\[\"g4dn.xlarge\"\]\s+\[\"g4dn.xlarge\"\]$", out, re.M)
    assert re.search(r"^\* final_loss\s+[\d.e-]+\s+[\d.e-]+$", out, re.M), out
    assert "cost $" in out and f"the metric curves, overlaid: {figure}" in out
    from PIL import Image

    with Image.open(figure) as image:
        assert image.size[0] >= 800

    # The same from Python: both curves, different lengths, in one comparison.
    a, b = load_record(small["a"]), load_record(small["b"])
    sections = dict(compare_rows(a, b))
    assert ("STEPS", "30", "60") in sections["parameters"]
    assert [len(r.jobs[0]["curves"]["loss"]["step"]) for r in (a, b)] == [30, 60]
    # Oldest run first.
    assert [r.path.name for r in find_records(records_dir)] == [
        "quickstart.record.ipynb", "small-a.record.ipynb", "small-b.record.ipynb",
        "failing.record.ipynb"]


def test_records_compare_three_records_with_the_interruptions_marked(
        quickstart: dict[str, Any], small: dict[str, Any], records_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The quickstart was interrupted twice: its record says where each attempt stopped.
    (job,) = load_record(quickstart["path"]).jobs
    breaks = job["breaks"]
    assert [b["reason"] for b in breaks] == ["interrupted", "interrupted"], breaks
    steps = job["curves"]["loss"]["step"]
    for b in breaks:
        assert steps[0] <= b["step"] <= steps[-1] and b["resumed_at"] <= b["step"] + 1
        assert b["redone"] == b["step"] - b["resumed_at"] + 1
    assert job["redone_steps"] == sum(b["redone"] for b in breaks)

    capsys.readouterr()
    figure = records_dir / "three.png"
    assert cli.main(["records", "compare", str(quickstart["path"]), str(small["a"]),
                     str(small["b"]), "-o", str(figure)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\* interruptions\s+2\s+0\s+0$", out, re.M), out
    assert re.search(r"^\* STEPS\s+\S+\s+30\s+60$", out, re.M), out
    assert f"the metric curves, overlaid: {figure} (dashed lines: interruptions" in out
    import numpy as np
    from PIL import Image

    from spotnb.records.figures import RUN_COLOURS

    with Image.open(figure) as image:
        rgb = np.asarray(image.convert("RGB")).astype(int)
    first = np.array([int(RUN_COLOURS[0][i:i + 2], 16) for i in (1, 3, 5)])
    near = np.abs(rgb - first).sum(axis=2) < 60
    # The quickstart's two interruptions: two columns of its colour (dashed) per panel.
    tall = np.flatnonzero(near.sum(axis=0) > 100)
    assert len(tall) and (np.diff(tall) > 3).sum() >= 1, tall


def test_records_show_prints_the_run_and_its_jobs(
        quickstart: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli.main(["records", "show", str(quickstart["path"])]) == 0
    out = capsys.readouterr().out
    assert "status:     completed" in out
    assert "2 interruption(s); cost $" in out and "accuracy 0.9" in out
    assert out.count("interrupted") == 2
    assert cli.main(["records", "show", str(quickstart["path"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["jobs"][0]["interruptions"] == 2


# -- failures, credentials, options ----------------------------------------------------------

def test_a_failing_notebook_gives_a_failed_record_and_exit_1(
        failing: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert failing["code"] == 1
    nb = nbformat.read(failing["path"], as_version=4)
    nbformat.validate(nb)
    run = nb.metadata["spotnb"]["run"]
    assert run["status"] == "failed"
    assert run["error"]["cell"] == 1 and run["error"]["ename"] == "SpotJobError"
    assert "ZeroDivisionError" in run["error"]["traceback"]
    (job,) = nb.metadata["spotnb"]["jobs"]
    assert job["status"] == "failed" and job["cell"] == 1
    assert job["error"]["ename"] == "ZeroDivisionError"
    assert "\x1b[" not in job["error"]["traceback"]
    assert not nb.cells[2].get("outputs")  # the run stopped at the failed cell
    # The dashboard's image sits before the error, which stays the cell's last output.
    outputs = nb.cells[1].outputs
    assert outputs[-1]["output_type"] == "error"
    assert document.static_figures(nb.cells[1], job["job_id"])


def test_no_record_keeps_a_credential(quickstart: dict[str, Any], small: dict[str, Any],
                                      failing: dict[str, Any], records_dir: Path) -> None:
    # The careless cell did print them, and they were replaced.
    nb = nbformat.read(small["a"], as_version=4)
    leaky = next(c for c in nb.cells if c.source == LEAKY)
    text = _text(leaky)
    assert f"key id {REDACTED} secret {REDACTED}" in text
    assert f"'AWS_SECRET_ACCESS_KEY': '{REDACTED}'" in text
    assert nb.metadata["spotnb"]["run"]["redactions"] >= 4
    files = sorted(records_dir.glob("*.record.*"))
    assert len(files) >= 5  # four records and the HTML export
    for path in files:
        body = path.read_text(errors="replace")
        assert FAKE_SECRET not in body and FAKE_KEY_ID not in body, path
        assert not AWS_KEY_ID.findall(body), path
    for job_id in (j["job_id"] for path in records_dir.glob("*.ipynb")
                   for j in _meta(path)["jobs"]):
        summary = spotnb.attach(job_id).store.get(layout.SUMMARY).decode()
        assert FAKE_SECRET not in summary and not AWS_KEY_ID.findall(summary)


def test_provider_option_sets_the_magics_default(home: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    nb = new_notebook(cells=[new_code_cell(
        "%load_ext spotnb\n"
        "print('provider:', get_ipython().magics_manager.registry['SpotMagics'].provider)")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}})
    nbformat.write(nb, tmp_path / "which.ipynb")
    assert cli.main(["record", str(tmp_path / "which.ipynb"), "--provider", "aws"]) == 0
    recorded = nbformat.read(tmp_path / "which.record.ipynb", as_version=4)
    assert "provider: aws" in _text(recorded.cells[0])
    assert recorded.metadata["spotnb"]["run"]["provider"] == "aws"
    assert recorded.metadata["spotnb"]["jobs"] == []
    capsys.readouterr()
    assert cli.main(["record", str(tmp_path / "which.ipynb"), "--provider", "gcp"]) == 2
    assert "unknown provider 'gcp'" in capsys.readouterr().err


def test_a_job_no_cell_shows_is_named_not_counted(home: Path, tmp_path: Path) -> None:
    nb = new_notebook(cells=[
        new_code_cell("%load_ext spotnb"),
        new_code_cell("%%spot_train --name shown\nprint('hello')"),
        # Submitted by code that shows nothing: it might as well be another process's.
        new_code_cell("import spotnb\n_ = spotnb.submit('x = 1', name='unseen').wait()"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                "language": "python"}})
    nbformat.write(nb, tmp_path / "two.ipynb")
    assert cli.main(["record", str(tmp_path / "two.ipynb")]) == 0
    meta = _meta(tmp_path / "two.record.ipynb")
    assert [(j["name"], j["cell"]) for j in meta["jobs"]] == [("shown", 1)]
    assert [j["name"] for j in meta["run"]["other_jobs"]] == ["unseen"]
    assert meta["totals"]["jobs"] == 1


# -- units ------------------------------------------------------------------------------

def test_parameters_parse_as_literals_else_strings() -> None:
    assert parse_parameters(["STEPS=100", "LR=0.5", "NAME=run a", "FLAGS=[1, 2]",
                             "ON=True", "EMPTY="]) == {
        "STEPS": 100, "LR": 0.5, "NAME": "run a", "FLAGS": [1, 2], "ON": True, "EMPTY": ""}
    for bad in ("STEPS", "1X=2", "class=3"):
        with pytest.raises(ValueError, match="name=value"):
            parse_parameters([bad])


def test_parameters_go_to_the_top_without_a_parameters_cell() -> None:
    nb = new_notebook(cells=[new_code_cell("x = 1"),
                             new_code_cell("y = 2", metadata={"tags": ["injected-parameters"]})])
    assert inject_parameters(nb, {"x": 5}) == 0
    assert [c.source for c in nb.cells] == [
        "# Parameters (injected by spotnb record)\nx = 5", "x = 1"]


def test_scrub_replaces_credentials_and_leaves_the_rest() -> None:
    env = ["s3cr3t-value-from-env"]
    text = ("AKIAIOSFODNN7EXAMPLE aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLE"
            " https://bob:hunter2hunter2@example.com/x GITHUB_TOKEN=ghp_abcdefgh12345678"
            " -> s3cr3t-value-from-env")
    clean, count = scrub({"text": text, "image/png": "AKIAIOSFODNN7EXAMPLE"}, env)
    assert count == 5
    assert clean["text"] == (f"{REDACTED} aws_secret_access_key = {REDACTED}"
                             f" https://bob:{REDACTED}@example.com/x GITHUB_TOKEN={REDACTED}"
                             f" -> {REDACTED}")
    assert clean["image/png"] == "AKIAIOSFODNN7EXAMPLE"  # binary data is not text
    harmless = ("commit 6cb5d33a5f2fc9b0561234567890abcdef123456; "
                "tokenizer = AutoTokenizer.from_pretrained('bert'); max_tokens=4096")
    assert scrub(harmless, env) == (harmless, 0)


def test_bundled_widgets_are_dropped_and_unlinked() -> None:
    nb = new_notebook(cells=[new_code_cell("d")])
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "display_data", data={document.WIDGET_VIEW_MIME: {"model_id": "fig"},
                              "text/plain": "FigureWidget"})]
    state = {
        "fig": {"model_name": "AnyModel", "state": {
            "_anywidget_id": "plotly.FigureWidget", "_esm": "x" * (300 * 1024)}},
        "box": {"model_name": "VBoxModel", "state": {
            "children": ["IPY_MODEL_head", "IPY_MODEL_fig"]}},
        "head": {"model_name": "HTMLModel", "state": {"value": "<b>job</b>"}},
    }
    nb.metadata["widgets"] = {document.WIDGET_STATE_MIME: {
        "state": state, "version_major": 2, "version_minor": 0}}
    dropped = document.drop_bundled_widgets(nb)
    assert dropped == ["plotly.FigureWidget (0.3 MB of front-end code)"]
    state = nb.metadata["widgets"][document.WIDGET_STATE_MIME]["state"]
    assert set(state) == {"box", "head"}
    assert state["box"]["state"]["children"] == ["IPY_MODEL_head"]
    assert nb.cells[0].outputs[0]["data"] == {"text/plain": "FigureWidget"}


def _view_output(model_id: str, **data: str) -> Any:
    return nbformat.v4.new_output(
        "display_data", data={document.WIDGET_VIEW_MIME: {"model_id": model_id}, **data})


def test_widget_views_without_state_give_way_to_their_static_form() -> None:
    nb = new_notebook(cells=[new_code_cell("d")])
    nb.cells[0].outputs = [
        _view_output("kept", **{"text/html": "<b>kept</b>", "text/plain": "kept"}),
        _view_output("closed", **{"text/html": "<table>picker</table>",
                                  "text/plain": "picker"}),
        _view_output("bare"),
    ]
    nb.metadata["widgets"] = {document.WIDGET_STATE_MIME: {
        "state": {"kept": {"model_name": "HTMLModel", "state": {}}},
        "version_major": 2, "version_minor": 0}}
    assert document.drop_views_without_state(nb) == 2
    kept, closed = nb.cells[0].outputs  # the view with nothing else went whole
    assert document.WIDGET_VIEW_MIME in kept["data"]
    assert closed["data"] == {"text/html": "<table>picker</table>", "text/plain": "picker"}
    # Saved without any widget state: no view is left to wait for a model.
    del nb.metadata["widgets"]
    assert document.drop_views_without_state(nb) == 1
    assert not any(document.WIDGET_VIEW_MIME in o["data"] for o in nb.cells[0].outputs)


def test_the_html_export_shows_static_forms_in_place_of_widget_views() -> None:
    nb = new_notebook(cells=[new_code_cell("d")])
    nb.cells[0].outputs = [
        _view_output("board", **{"text/html": "<pre>epoch 3 done</pre>",
                                 "text/plain": "epoch 3 done"}),
        nbformat.v4.new_output("display_data", data={
            "text/html": "<img src='data:image/png;base64,iVBORw0KGgo=' alt='fig'>",
            "text/plain": "Final dashboard"},
            metadata={"spotnb": {"figure": document.FIGURE_KIND, "job_id": "j"}}),
    ]
    nb.metadata["widgets"] = {document.WIDGET_STATE_MIME: {
        "state": {"board": {"model_name": "VBoxModel", "state": {}}},
        "version_major": 2, "version_minor": 0}}
    page = document.for_html(nb)
    assert page.cells[0].outputs[0]["data"] == {"text/html": "<pre>epoch 3 done</pre>",
                                                "text/plain": "epoch 3 done"}
    assert "widgets" not in page.metadata  # no widget manager to fetch from a CDN
    assert document.WIDGET_VIEW_MIME in nb.cells[0].outputs[0]["data"]  # a copy
    assert document.figure_png(page.cells[0].outputs[1]) == base64.b64decode("iVBORw0KGgo=")


def test_a_notebook_saved_by_hand_is_read_from_its_output_metadata(tmp_path: Path) -> None:
    job = {"job_id": "20250101-000000-abcdef", "name": "train", "status": "completed",
           "attempts": [{"number": 1}], "interruptions": 1, "cost_usd": 0.5,
           "ondemand_cost_usd": 2.0, "final_metrics": {"loss": 0.25}}
    nb = new_notebook(cells=[new_code_cell("%%spot_train\n...")])
    nb.cells[0].outputs = [nbformat.v4.new_output(
        "display_data", data={"text/plain": "record"}, metadata={"spotnb": {"job": job}})]
    nbformat.write(nb, tmp_path / "by-hand.ipynb")
    nbformat.write(new_notebook(), tmp_path / "plain.ipynb")
    (record,) = find_records(tmp_path)
    assert record.run["status"] == "saved by hand"
    assert record.totals["savings_pct"] == 75.0 and record.final_metrics == {"loss": 0.25}


def test_jobs_are_tied_to_their_cells_by_code_in_order() -> None:
    from types import SimpleNamespace

    from spotnb.records.run import _cells_of

    train = "%%spot_train -t g5.xlarge\nfit(model)"
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell(train),
                             new_code_cell(train), new_code_cell("print(handle)")])
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                  text="<JobHandle 20250101-000003-c>\n")]

    def job(job_id: str, code: str) -> Any:
        return SimpleNamespace(job_id=job_id, spec=SimpleNamespace(code=code))

    # The magic gets the body with a trailing newline; the first line is its own.
    jobs = [job("20250101-000001-a", "# %%spot_train -t g5.xlarge\nfit(model)\n"),
            job("20250101-000002-b", "# %%spot_train -t g5.xlarge\nfit(model)\n"),
            job("20250101-000003-c", "x = 2"),
            job("20250101-000004-d", "y = 3")]
    assert _cells_of(nb, jobs, {}) == {"20250101-000001-a": 1, "20250101-000002-b": 2,
                                       "20250101-000003-c": 3, "20250101-000004-d": None}
