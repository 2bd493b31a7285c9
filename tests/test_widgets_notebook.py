"""The widgets in real kernels: an executed notebook keeps them, and buttons act while
the cell is busy.

The quickstart is executed with ``spotnb run``'s own function: the executed copy must
stay small (no plotly.js in its widget state), show the finished job's plots once, as
an image that needs no script, and keep the rest of the dashboard's widgets; the picker
in it must show the numbers of the bundled data (``../shared/data/``, read here
independently).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import queue
import time
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
from conftest import SHARED_DATA
from jupyter_client.manager import start_new_kernel

import spotnb
from spotnb.records import document
from spotnb.widgets.picker import picker_rows

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

STEPS = 300  # the quickstart's
CHECKED_TYPES = ("g5.xlarge", "g4dn.xlarge", "p3.2xlarge")


@pytest.fixture(autouse=True)
def _no_random_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")


def shared_numbers(instance_type: str, region: str = "us-east-1") -> dict[str, Any]:
    """On-demand, cheapest spot and interruption bucket, from the shared data files."""
    with (SHARED_DATA / "aws_gpu_catalog.csv").open() as f:
        rows = [r for r in csv.DictReader(f)
                if r["instance_type"] == instance_type and r["region"] == region]
    advisor = json.loads((SHARED_DATA / "spot_advisor_gpu.json").read_text())
    bucket = advisor["spot_advisor"][region]["Linux"][instance_type]["r"]
    label = next(r["label"] for r in advisor["ranges"] if r["index"] == bucket)
    return {
        "ondemand": float(rows[0]["ondemand_price_usd_per_hour"]),
        "spot": min(float(r["spot_price_usd_per_hour"]) for r in rows
                    if r["spot_price_usd_per_hour"]),
        "gpus": int(rows[0]["accelerator_count"]),
        "interruption": label,
    }


def test_picker_numbers_match_the_shared_data() -> None:
    rows = {r.instance_type: r for r in picker_rows("us-east-1")}
    for name in CHECKED_TYPES:
        want = shared_numbers(name)
        row = rows[name]
        assert (row.ondemand, row.spot, row.gpu_count, row.interruption) == (
            want["ondemand"], want["spot"], want["gpus"], want["interruption"]), name
        assert row.savings_pct == pytest.approx(100 * (1 - want["spot"] / want["ondemand"]))
        assert row.spot_per_gpu_hour == pytest.approx(want["spot"] / want["gpus"])


def _decode(buffer: dict[str, str]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(buffer["data"]), dtype=float)


def _resolve(state: dict[str, Any], path: list[Any]) -> Any:
    """What a front end does with a saved buffer (``put_buffers``): walk to its parent."""
    obj: Any = state
    for key in path[:-1]:
        obj = obj[key]
    assert isinstance(obj, dict), f"buffer path {path} has no home in the saved state"
    return obj


def _model(state: dict[str, Any], model_id: str) -> dict[str, Any]:
    return dict(state[model_id.removeprefix("IPY_MODEL_")]["state"])


def assert_executed_quickstart_is_small_and_shows_its_plots_once_as_an_image(
        executed: Path) -> None:
    """What the executed quickstart (``spotnb run``, or the record ``spotnb record``
    writes: the same executed copy with its metadata) keeps of its widgets. Called by
    tests/test_records.py's quickstart test, which runs the notebook once for both."""
    from PIL import Image

    from spotnb.records.figures import LOSS_COLOUR

    size = executed.stat().st_size
    assert size < 2**20, f"the executed quickstart is {size / 2**20:.1f} MB"
    nb = nbformat.read(executed, as_version=4)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    # No model carries plotly.js (about 5 MB a figure).
    assert all(len(json.dumps(m)) < 256 * 1024 for m in state.values())

    train = next(c for c in nb.cells if c.source.startswith("%%spot_train"))
    kinds = [sorted(o.get("data", {})) for o in train.outputs
             if o["output_type"] == "display_data"]
    # The dashboard, its static copy (a PNG), and the job's record line.
    assert kinds == [["application/vnd.jupyter.widget-view+json", "text/html", "text/plain"],
                     ["text/html", "text/plain"], ["text/plain"]], kinds
    dashboard, static, record = (o for o in train.outputs if o["output_type"] == "display_data")
    assert record["metadata"]["spotnb"]["job"]["interruptions"] == 2
    job_id = record["metadata"]["spotnb"]["job"]["job_id"]
    # Without widgets the dashboard reads as text: status, then the output panel.
    text = dashboard["data"]["text/plain"]
    assert text.startswith("spotnb job") and "completed" in text
    assert f"step {STEPS} of {STEPS} (100%)" in text and "interruptions 2 (took" in text
    assert text.count("spot interruption notice") == 2 and "test accuracy" in text
    assert "saving at the next opportunity" not in text  # one line per interruption

    # The static copy: the final figure as an image, hidden next to a live dashboard.
    assert static["metadata"]["spotnb"] == {"figure": "dashboard", "job_id": job_id}
    html = static["data"]["text/html"]
    assert f"body:has(.spotnb-live-{job_id} .spotnb-figure .js-plotly-plot)" in html
    assert "<script" not in html
    png = document.figure_png(static)
    assert png is not None and html.count("base64,") == 1  # the PNG is stored once
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.size[0] >= 900
    target = np.array([int(LOSS_COLOUR[i:i + 2], 16) for i in (1, 3, 5)])
    loss_pixels = np.all(np.abs(np.asarray(image, dtype=int) - target) <= 24, axis=-1).sum()
    assert loss_pixels > 500  # the loss curve is drawn

    # The dashboard's widgets stay (header, controls, figure, output panel, buttons),
    # the figure with its final data: a front end with widgets shows it without a kernel.
    box = _model(state, dashboard["data"]["application/vnd.jupyter.widget-view+json"]
                 ["model_id"])
    assert f"spotnb-live-{job_id}" in box["_dom_classes"]
    assert all(c.removeprefix("IPY_MODEL_") in state for c in box["children"])
    children = [_model(state, c) for c in box["children"]]
    header = children[0]["value"]
    assert "completed" in header and "interruptions 2" in header
    panel = next(c for c in children if "lines" in c)
    assert panel["lines"][-1][1].startswith("test accuracy")
    (figure,) = [state[c.removeprefix("IPY_MODEL_")] for c in box["children"]
                 if "plot_data" in _model(state, c)]
    names = [t["name"] for t in figure["state"]["plot_data"]]
    assert {"loss", "lr", "interruption", "CPU utilisation %"} <= set(names), names
    buffers = {tuple(b["path"]): b for b in figure["buffers"]}
    steps = _decode(buffers[("plot_data", names.index("loss"), "x")])
    finite = steps[np.isfinite(steps)]
    assert list(finite) == list(range(STEPS))  # every step, the gaps between instances

    # The picker shows the bundled data's numbers.
    picker = next(c for c in nb.cells if c.source.startswith("%spot_picker"))
    (result,) = [o for o in picker.outputs if o["output_type"] == "execute_result"]
    (table,) = [w["state"] for w in state.values()
                if w["state"].get("table_class") == "spotnb-picker-table"]
    rows = {r["id"]: r["cells"] for r in table["rows"]}
    for name in CHECKED_TYPES:
        want = shared_numbers(name)
        cells = rows[name]
        assert cells["ondemand"] == f"{want['ondemand']:.3f}"
        assert cells["spot"] == f"{want['spot']:.4f}"
        assert cells["interruption"] == want["interruption"]
    assert "sorted by job $ spot" in result["data"]["text/plain"]


def _iopub_until(kc: Any, predicate: Any, timeout: float) -> list[dict[str, Any]]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        seen.append(msg)
        if predicate(msg):
            return seen
    raise AssertionError(f"not seen in {timeout}s")


def test_the_stop_button_works_while_the_cell_follows_the_job(
        spotnb_home: Path, tmp_path: Path) -> None:
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        kc.execute_interactive("%load_ext spotnb", timeout=60)
        cell = kc.execute("%%spot_train --name long\nimport time\n"
                          "for i in range(600):\n    spot.log(i, loss=1 / (i + 1))\n"
                          "    time.sleep(0.1)\n")

        def stop_button(msg: dict[str, Any]) -> bool:
            state = msg["content"].get("data", {}).get("state", {})
            return msg["msg_type"] == "comm_open" and state.get("description") == "Stop job…"

        opened = _iopub_until(kc, stop_button, 60)
        comm_id = opened[-1]["content"]["comm_id"]
        # Wait until the job runs, then press Stop as JupyterLab does.
        _iopub_until(kc, lambda m: m["msg_type"] == "comm_msg" and "loss" in json.dumps(
            m["content"]["data"].get("state", {}), default=str), 90)
        click = kc.session.msg("comm_msg", {
            "comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}})
        kc.shell_channel.send(click)
        # The first click asks; the second, on "Confirm stop", stops the job.
        _iopub_until(kc, lambda m: m["msg_type"] == "comm_msg" and m["content"]["data"].get(
            "state", {}).get("description") == "Confirm stop", 60)
        kc.shell_channel.send(kc.session.msg("comm_msg", click["content"]))
        done = _iopub_until(kc, lambda m: m["parent_header"].get("msg_id") == cell
                            and m["msg_type"] == "error", 90)
        error = done[-1]["content"]
        assert error["ename"] == "SpotJobError" and "stopped" in error["evalue"]
        assert "%spot_stop button" in error["evalue"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    (job,) = spotnb.jobs()
    assert job.status == "stopped"


PROBE_CELL = """\
import threading
import ipywidgets as w
from spotnb.widgets import kernel
clicks = []
second = threading.Event()
def clicked(_b):
    clicks.append(1)
    if len(clicks) == 2:
        second.set()
probe = w.Button(description="probe")
probe.on_click(clicked)
print("subshell", kernel.serve_while_busy(probe))
display(probe)
second.wait(60)
"""


def test_the_kernel_stays_busy_after_a_click_while_the_cell_runs(tmp_path: Path) -> None:
    """JupyterLab shows the kernel's last busy or idle report as its status, whatever
    request it was about: after a click handled on the subshell, the running cell is
    reported busy again (the status bar does not say "Idle" while the cell runs)."""
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        cell = kc.execute(PROBE_CELL)
        opened = _iopub_until(kc, lambda m: m["msg_type"] == "comm_open" and m["content"][
            "data"].get("state", {}).get("description") == "probe", 60)
        comm_id = opened[-1]["content"]["comm_id"]
        # The comm opens when the button is made, before its messages are routed to the
        # subshell; a person clicks only once it is shown, after the routing.
        opened += _iopub_until(kc, lambda m: m["msg_type"] == "stream" and "subshell" in m[
            "content"].get("text", ""), 60)
        click = kc.session.msg("comm_msg", {
            "comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}})
        kc.shell_channel.send(click)
        first = click["header"]["msg_id"]
        seen = opened + _iopub_until(kc, lambda m: m["msg_type"] == "status" and m[
            "parent_header"].get("msg_id") == first and m["content"]["execution_state"] ==
            "idle", 60)
        second = kc.session.msg("comm_msg", click["content"])
        kc.shell_channel.send(second)
        ends = {cell, second["header"]["msg_id"]}
        idle: set[str] = set()

        def both_idle(m: dict[str, Any]) -> bool:
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                idle.add(m["parent_header"].get("msg_id"))
            return ends <= idle

        seen += _iopub_until(kc, both_idle, 60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert any("subshell True" in m["content"].get("text", "") for m in seen)
    statuses = [(m["content"]["execution_state"], m["parent_header"].get("msg_id"))
                for m in seen if m["msg_type"] == "status"]
    after_click = statuses.index(("idle", first))
    # Right after the click's idle, the cell is reported busy again...
    assert statuses[after_click + 1] == ("busy", cell), statuses
    # ... and once the cell has ended, the kernel reads idle.
    assert statuses[-1][0] == "idle", statuses


def test_tensorboard_logs_written_on_the_instance_can_be_fetched(
        spotnb_home: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    from spotnb.train.tb import TB_SYNC_NAME, download_logs

    handle = spotnb.submit(
        "from spotnb.train.tb import tensorboard\n"
        "writer = tensorboard(every='1s')\n"
        "for step in range(5):\n"
        "    writer.add_scalar('loss', 1 / (step + 1), step)\n"
        "writer.close()\n")
    result = handle.wait(timeout=120)
    assert result.status == "completed", result.reason
    events = [e for e in handle.events(follow=False)
              if e.type == "checkpoint" and e.data.get("kind") == "sync"]
    assert any(e.data.get("name") == TB_SYNC_NAME for e in events)  # enables the button
    (logdir,) = download_logs(handle, tmp_path / "tb")
    files = list(logdir.rglob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 0
