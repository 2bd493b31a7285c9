"""The widgets in real kernels: an executed notebook keeps them, and buttons act while
the cell is busy.

The quickstart is executed with nbclient (as ``spotnb run`` does); its saved widget
state must hold the dashboard's figure with its traces and final data, in a form a
front end can load, next to the static figure output; the picker in it must show the
numbers of the bundled data (``../shared/data/``, read here independently).
"""

from __future__ import annotations

import base64
import csv
import json
import queue
import re
import shutil
import time
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
from conftest import SHARED_DATA
from jupyter_client.manager import start_new_kernel

import spotnb
from spotnb.notebook import run_notebook
from spotnb.widgets.picker import picker_rows

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

REPO = Path(__file__).resolve().parents[1]
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


def test_executed_quickstart_keeps_the_dashboard_the_picker_and_a_static_figure(
        spotnb_home: Path, tmp_path: Path) -> None:
    for name in ("quickstart.ipynb", "digits_data.py"):
        shutil.copy(REPO / "notebooks" / name, tmp_path / name)
    run = run_notebook(tmp_path / "quickstart.ipynb")
    assert run.ok, run.failure
    nb = nbformat.read(run.output, as_version=4)
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]

    # One figure (its saved state carries plotly.js: one per dashboard, not per plot).
    (figure,) = [w for w in state.values() if "_widget_data" in w["state"]]
    assert "plotly" in figure["state"]["_esm"][:100_000].lower()
    data = figure["state"]["_widget_data"]
    names = [t.get("name") for t in data]
    assert {"loss", "loss, redone", "interruption", "spot $/h", "CPU utilisation %",
            "RAM used %", "max price (= on-demand)", "on-demand"} <= set(names), names
    # The final data, not the data at display time: the loss curve's 300 steps.
    buffers = {tuple(b["path"]): b for b in figure["buffers"]}
    loss = names.index("loss")
    steps = _decode(buffers[("_widget_data", loss, "x", "buffer")])
    assert list(steps) == list(range(STEPS))
    assert np.all(np.isfinite(_decode(buffers[("_widget_data", loss, "y", "buffer")])))
    marks = _decode(buffers[("_widget_data", names.index("interruption"), "x", "buffer")])
    assert len(marks) == 2 and 0 < marks[0] < marks[1] < STEPS
    shapes = figure["state"]["_widget_layout"]["shapes"]
    assert len(shapes) == 12 and {s["xref"] for s in shapes} == {"x", "x2", "x3"}
    # Every saved buffer has a home: a front end can load this state.
    for b in figure["buffers"]:
        _resolve(figure["state"], b["path"])

    train = next(c for c in nb.cells if c.source.startswith("%%spot_train"))
    kinds = [sorted(o.get("data", {})) for o in train.outputs
             if o["output_type"] == "display_data"]
    # The dashboard, its static figure, and the job's record line (spotnb.records).
    assert kinds == [["application/vnd.jupyter.widget-view+json", "text/plain"],
                     ["application/vnd.plotly.v1+json", "text/html", "text/plain"],
                     ["text/plain"]], kinds
    dashboard, static, record = (o for o in train.outputs if o["output_type"] == "display_data")
    assert record["metadata"]["spotnb"]["job"]["interruptions"] == 2
    # Without widgets the dashboard reads as text: status, then the output panel.
    text = dashboard["data"]["text/plain"]
    assert text.startswith("spotnb job") and "completed" in text
    assert text.count("spot interruption notice") == 2 and "test accuracy" in text
    assert dashboard["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] in state
    fig = static["data"]["application/vnd.plotly.v1+json"]
    static_loss = next(t for t in fig["data"] if t.get("name") == "loss")
    x = static_loss["x"]
    n = len(base64.b64decode(x["bdata"])) // 8 if isinstance(x, dict) else len(x)
    assert n == STEPS
    assert "cdn.plot.ly" in static["data"]["text/html"]

    # The picker shows the bundled data's numbers.
    picker = next(c for c in nb.cells if c.source.startswith("%spot_picker"))
    (result,) = [o for o in picker.outputs if o["output_type"] == "execute_result"]
    tables = [w["state"]["value"] for w in state.values()
              if "spotnb-picker-table" in str(w["state"].get("value", ""))]
    assert len(tables) == 1
    for name in CHECKED_TYPES:
        want = shared_numbers(name)
        row = re.search(rf"<tr data-type='{re.escape(name)}'.*?</tr>", tables[0])
        assert row, name
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(0))
        assert cells[6] == f"{want['ondemand']:.3f}" and cells[7] == f"{want['spot']:.4f}"
        assert cells[9] == want["interruption"].replace(">", "&gt;").replace("<", "&lt;")
        assert name in result["data"]["text/plain"] or "more" in result["data"]["text/plain"]


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
            return msg["msg_type"] == "comm_open" and state.get("description") == "Stop"

        opened = _iopub_until(kc, stop_button, 60)
        comm_id = opened[-1]["content"]["comm_id"]
        # Wait until the job runs, then press Stop as JupyterLab does.
        _iopub_until(kc, lambda m: m["msg_type"] == "comm_msg" and "loss" in json.dumps(
            m["content"]["data"].get("state", {}), default=str), 90)
        kc.shell_channel.send(kc.session.msg("comm_msg", {
            "comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}}))
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


def test_tensorboard_logs_written_on_the_instance_can_be_fetched(
        spotnb_home: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    from spotnb.tb import TB_SYNC_NAME, download_logs

    handle = spotnb.submit(
        "from spotnb.tb import tensorboard\n"
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
