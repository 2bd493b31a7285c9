"""Notebooks in real kernels (nbclient) running real jobs on the local cloud.

Each test builds a notebook under ``tmp_path`` (or copies an example there), runs it
head-less the way ``spotnb run`` does, and checks what its reader would see. (The
quickstart is run once, for its record: ``tests/test_records.py``.) The
kernels inherit ``SPOTNB_HOME`` from the ``spotnb_home`` fixture, which fails a test
that leaves a kernel, an agent or a capacity group behind.
"""

from __future__ import annotations

import queue
import re
import shutil
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client.manager import start_new_kernel
from nbformat.v4 import new_code_cell, new_notebook

import spotnb
from spotnb.client import cli
from spotnb.client.notebook import run_notebook
from spotnb.protocol.events import FINAL_STATES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@pytest.fixture(autouse=True)
def _no_random_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the interruptions a test asks for: the Spot Advisor hazard is off.
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")


def _write_notebook(path: Path, *cells: str) -> Path:
    nb = new_notebook(cells=[new_code_cell(source) for source in cells], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)
    return path


def _texts(cell: Any) -> list[str]:
    """Every output of a cell as text (streams, text/plain, tracebacks), in order."""
    texts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            texts.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            texts.append(out["data"].get("text/plain", ""))
        elif out["output_type"] == "error":
            texts.append(_ANSI.sub("", "\n".join(out["traceback"])))
    return texts


def _executed(path: Path) -> Any:
    return nbformat.read(path, as_version=4)


def test_variables_modules_and_outputs_cross_to_the_instance_and_back(
        spotnb_home: Path, tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("def double(x):\n    return 2 * x\n")
    path = _write_notebook(
        tmp_path / "roundtrip.ipynb",
        "%load_ext spotnb",
        "factor = 7\nunused = object()",
        # `factor` is never declared: the analysis finds it; `helper_mod` lives next
        # to the notebook and is shipped; `clf` is a trained object that comes back.
        "%%spot_train --out clf,answer --name roundtrip\n"
        "import os\n"
        "import helper_mod\n"
        "from sklearn.datasets import load_iris\n"
        "from sklearn.linear_model import LogisticRegression\n"
        "X, y = load_iris(return_X_y=True)\n"
        "clf = LogisticRegression(max_iter=1000).fit(X, y)\n"
        "answer = helper_mod.double(factor * 3)\n"
        "print('remote answer', answer, 'pid', os.getpid())\n"
        "answer + 0.5",
        "import os\n"
        "from sklearn.datasets import load_iris\n"
        "print(type(clf).__name__, round(clf.score(*load_iris(return_X_y=True)), 2), answer,"
        " 'pid', os.getpid())",
    )
    run = run_notebook(path)
    assert run.ok, run.failure
    nb = _executed(run.output)
    train, after = nb.cells[2], nb.cells[3]
    text = "".join(_texts(train))
    assert "[spotnb] shipping inputs factor" in text and "unused" not in text
    assert "files helper_mod.py" in text
    remote_pid = re.search(r"remote answer 42 pid (\d+)", text)
    assert remote_pid, text
    # The remote cell's last value is displayed once, like a local cell's Out[n].
    results = [o for o in train.outputs if o["output_type"] == "execute_result"]
    assert [r["data"]["text/plain"] for r in results] == ["42.5"]
    local = re.search(r"LogisticRegression 0\.9\d 42 pid (\d+)", "".join(_texts(after)))
    assert local, _texts(after)
    assert local.group(1) != remote_pid.group(1)  # it really ran elsewhere


def test_a_remote_exception_shows_the_cells_line_and_fails_the_job(
        spotnb_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_notebook(
        tmp_path / "failing.ipynb",
        "%load_ext spotnb",
        "x = 1",
        "%%spot_train --name failing\n"
        "a = 1\n"
        "b = 0\n"
        "a / b\n"
        "print('not reached')",
        "print('not run')",
    )
    assert cli.main(["run", str(path)]) == 1
    err = capsys.readouterr().err
    assert "spotnb run: cell 3 [3] failed: SpotJobError" in err
    assert "%%spot_train --name failing" in err

    nb = _executed(tmp_path / "failing.executed.ipynb")
    (error,) = [o for o in nb.cells[2].outputs if o["output_type"] == "error"]
    tb = _ANSI.sub("", "\n".join(error["traceback"]))
    # Line 1 is the %%spot_train line, as in the notebook; In[3] is the notebook's count.
    assert "Cell In[3], line 4" in tb
    assert "----> 4 a / b" in tb
    assert "ZeroDivisionError: division by zero" in tb
    assert "failed on attempt 1" in tb
    streams = [o["text"] for o in nb.cells[2].outputs if o["output_type"] == "stream"]
    assert not any("not reached" in text for text in streams)
    assert not nb.cells[3].get("outputs")

    (job,) = spotnb.jobs()
    assert job.status == "failed"


def _run_until_idle(kc: Any, code: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Execute ``code`` and return its iopub messages until the kernel is idle."""
    msg_id = kc.execute(code)
    messages: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)
    raise AssertionError(f"{code!r} did not finish in {timeout}s")


def _message_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for msg in messages:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            parts.append(content["text"])
        elif msg["msg_type"] in ("display_data", "execute_result", "update_display_data"):
            parts.append(content["data"].get("text/plain", "") + "\n")
        elif msg["msg_type"] == "error":
            parts.append("\n".join(content["traceback"]))
    return "".join(parts)


def test_kernel_restart_mid_job_then_attach_shows_everything(
        spotnb_home: Path, tmp_path: Path) -> None:
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        _run_until_idle(kc, "%load_ext spotnb")
        go = tmp_path / "go"
        _run_until_idle(kc, f"GO = {str(go)!r}")
        msg_id = kc.execute(
            "%%spot_train --out total --name restarted\n"
            "import os, time\n"
            "total = 0\n"
            "for i in range(16):\n"
            "    print(f'tick {i}', flush=True)\n"
            "    total += i\n"
            "    while i == 3 and not os.path.exists(GO):\n"
            "        time.sleep(0.1)  # the test lets the job go on after the restart\n"
            "    time.sleep(0.05)\n"
            "f'total {total}'")
        # Wait for the job's output to reach the notebook, then restart the kernel.
        # The text display writes it to the cell's stream; the dashboard (widgets render
        # in a kernel) to its output panel, a widget state update.
        deadline = time.monotonic() + 90
        seen = ""
        while "tick 2" not in seen and time.monotonic() < deadline:
            with_timeout = kc.get_iopub_msg(timeout=90)
            if with_timeout["parent_header"].get("msg_id") != msg_id:
                continue
            if with_timeout["msg_type"] == "stream":
                seen += with_timeout["content"]["text"]
            elif with_timeout["msg_type"] == "comm_msg":
                seen += str(with_timeout["content"]["data"].get("state", ""))
        assert "tick 2" in seen
        (job,) = spotnb.jobs()
        assert job.status not in FINAL_STATES
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)

        _run_until_idle(kc, "%load_ext spotnb")
        go.touch()
        attached = _run_until_idle(kc, f"%spot_attach {job.job_id}")
        text = _message_text(attached)
        ticks = [int(t) for t in re.findall(r"^tick (\d+)$", text, re.M)]
        # The complete history from the first line, then the rest as it came.
        assert ticks[:16] == list(range(16)), text
        assert "attempt 1: starting" in text
        results = [m for m in attached if m["msg_type"] == "execute_result"]
        assert [r["content"]["data"]["text/plain"] for r in results] == ["'total 120'"]
        status = [m for m in attached if m["msg_type"] in ("display_data", "update_display_data")
                  and m["content"]["data"].get("text/plain", "").startswith("spotnb job")]
        assert "completed" in status[-1]["content"]["data"]["text/plain"]
        assert "total\n120" in _message_text(_run_until_idle(kc, "print('total'); print(total)"))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert spotnb.attach(job.job_id).status == "completed"


def test_multinode_notebook_trains_on_two_nodes_through_an_interruption(
        spotnb_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copy(REPO / "notebooks" / "multinode.ipynb", tmp_path / "multinode.ipynb")
    out = tmp_path / "executed" / "multinode.ipynb"
    code = cli.main(["run", str(tmp_path / "multinode.ipynb"), "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert f"the executed copy is {out}" in capsys.readouterr().out
    nb = _executed(out)
    train = next(c for c in nb.cells if c.source.startswith("%%spot_train"))
    text = "".join(_texts(train))
    assert "rank 0 of 2" in text and "rank 1 of 2" in text, text
    status = [t for t in _texts(train) if t.startswith("spotnb job")][-1]
    assert "completed" in status and "interruptions 1" in status, status
    (job,) = spotnb.jobs()
    assert (job.status, job.interruptions) == ("completed", 1)
    assert re.fullmatch(r"[12] nodes? \(1:2\)", job.nodes), job.nodes
    # The display tells it in nodes and worlds: the second node joins (it is no
    # replacement), the world forms at 2; the header shows the world.
    assert re.search(r"node 1 \(attempt 2\): joining, g4dn\.xlarge", text), text
    assert "world formed: 2 nodes, world size 2 (--nodes 1:2)" in text, text
    assert "spot interruption notice" in text and "every rank saves a checkpoint" in text
    assert "resuming on a replacement" not in text, text
    assert re.search(r"[12] nodes? \(--nodes 1:2\), world size [12]", status), status
    # The record names every node's instance; the cost bills every instance the group
    # launched (both nodes and the replacement) for its seconds from launch to
    # termination (the on-demand equivalent: one constant price per instance).
    (record,) = [o["metadata"]["spotnb"]["job"] for o in train.outputs
                 if "job" in (o.get("metadata") or {}).get("spotnb", {})]
    nodes = record["nodes"]
    assert (nodes["min"], nodes["max"], nodes["worlds"][0]["nodes"]) == (1, 2, 2), nodes
    assert {i["node"] for i in nodes["instances"]} == {0, 1}, nodes
    from spotnb.client.jobs import summarize
    from spotnb.protocol.events import GROUP_STREAM, EventReader

    handle = spotnb.attach(job.job_id)
    events = list(EventReader(handle.store).replay())
    result = summarize(handle.spec, events, handle.result_record())
    group = [e for e in events if e.attempt == GROUP_STREAM and e.type == "instance"]
    launched = {e.data["instance_id"]: e for e in group if e.data.get("action") == "launched"}
    ended = {e.data["instance_id"]: e.time for e in group
             if e.data.get("action") == "terminated"}
    end_of_job = max(e.time for e in events)
    assert len(launched) >= 3, launched
    seconds = {i: ended.get(i, end_of_job) - e.time for i, e in launched.items()}
    assert result.ondemand_cost_usd == pytest.approx(
        sum(e.data["ondemand"] * seconds[i] / 3600 for i, e in launched.items()))
    assert result.cost_usd > max(e.data["price"] * seconds[i] / 3600
                                 for i, e in launched.items())
    report = "".join(_texts(nb.cells[-1]))
    assert re.search(r"final loss \d\.\d+", report), report
