"""Notifications: a Slack-compatible webhook told from the instance, tested against a
real HTTP server on loopback.

The webhook is a secret: the tests also check that its URL appears in no spec, event,
record or remote cell line (it travels as the job's secret, spotnb.secretstore).
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.getipython import get_ipython
from IPython.testing.globalipapp import start_ipython

import spotnb
from spotnb import layout, notify
from spotnb.events import EventReader
from spotnb.records import job_record
from spotnb.secretstore import NOTIFY_SECRET
from spotnb.spec import SpecError

# A cell that checkpoints every 5 steps and logs for a few seconds: long enough for a
# simulated interruption to land mid-run.
CELL = """
import time
ckpt = spot.Checkpoint(progress={"seen": 0})
for step in range(ckpt.restore(), 40):
    spot.log(step, loss=1.0 / (step + 1))
    time.sleep(0.1)
    ckpt.maybe_save(step)
"""


class Hook:
    """A webhook on loopback that keeps what it is sent; ``hang`` makes it never
    answer (until the test ends), ``status`` is its reply's."""

    def __init__(self, status: int = 200, hang: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.got = threading.Condition()
        self.release = threading.Event()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with hook.got:
                    hook.bodies.append(json.loads(body))
                    hook.got.notify_all()
                if hang:
                    hook.release.wait()
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_args: Any) -> None: ...

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, count: int) -> list[dict[str, Any]]:
        """The bodies once ``count`` have come (bounded by the suite's timeout)."""
        with self.got:
            self.got.wait_for(lambda: len(self.bodies) >= count)
            return list(self.bodies)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    h = Hook()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def _no_random_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")


# -- the sender ------------------------------------------------------------------------

def test_a_notification_is_slack_json_with_progress_and_machine_stats(hook: Hook) -> None:
    n = notify.Notifier(hook.url, "job-1", "run a")
    n.where = "g5.xlarge use1-az4 i-123"
    n.saw_total(300)
    n.saw_metrics([[148, 0.0, {"loss": 0.5}], [149, 0.0, {"loss": 0.25, "lr": 0.01}]])
    n.saw_sys({"kind": "gpu", "util": 87.0, "mem_used": 6 << 30, "mem_total": 24 << 30})
    n.interrupted(2, "terminate", "2026-01-01T00:00:00Z")
    n.ended("completed", "the cell finished", 3)
    n.close()
    first, last = hook.wait_for(2)
    assert set(first) == {"text"}
    assert "*run a*" in first["text"] and "attempt 2 interrupted" in first["text"]
    assert "terminate at 2026-01-01T00:00:00Z" in first["text"]
    for part in ("step 150 of 300", "loss 0.25", "lr 0.01", "GPU 87% busy",
                 "GPU memory 6.0 of 24.0 GiB", "g5.xlarge use1-az4 i-123"):
        assert part in last["text"], part
    assert last["text"].startswith(":white_check_mark: spotnb job *run a* (`job-1`) "
                                   "completed on attempt 3")
    assert n.sent == 2 and n.failed == 0
    # A multi-node job's notice is a node's: the others go on without it.
    node = notify.Notifier(hook.url, "job-2", "run b", max_nodes=3)
    node.interrupted(5, "terminate", None)
    node.close()
    text = hook.wait_for(3)[-1]["text"]
    assert "node 1 (attempt 5) interrupted" in text, text
    assert "goes on without the node while its replacement boots" in text, text


def test_a_failing_or_hanging_webhook_costs_a_bounded_wait_and_never_the_url(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(notify, "SEND_TIMEOUT_SECONDS", 0.2)
    hung = Hook(hang=True)
    refused = Hook(status=500)
    try:
        with caplog.at_level(logging.WARNING, logger="spotnb.notify"):
            for url in (hung.url, refused.url):
                n = notify.Notifier(url, "job-1", "x")
                n.ended("failed", "boom", 1)
                n.close(timeout=5)  # returns once the send gave up
                assert n.failed == 1 and n.sent == 0
    finally:
        hung.close()
        refused.close()
    assert len(caplog.records) == 2
    assert all("secret" not in r.getMessage() for r in caplog.records)
    assert "http://127.0.0.1/…" in caplog.records[0].getMessage()


def test_without_a_url_nothing_is_sent() -> None:
    n = notify.Notifier(None, "job-1", "x")
    n.ended("completed", "done", 1)
    n.close()
    assert n.sent == n.failed == 0 and n._thread is None


def test_a_bad_url_is_refused_before_anything_starts(spotnb_home: Path) -> None:
    with pytest.raises(SpecError, match="http\\(s\\) URL of a Slack-compatible"):
        spotnb.submit("x = 1", notify_url="hooks.slack.com/services/T0")
    assert not (spotnb_home / "store").exists() or not list(
        (spotnb_home / "store").rglob("spec.json"))


# -- from the instance, on the local cloud ------------------------------------------------

def test_the_instance_notifies_an_interruption_and_the_end(spotnb_home: Path,
                                                            hook: Hook) -> None:
    handle = spotnb.submit(CELL, name="notified", notify_url=hook.url,
                           checkpoint_every="5 steps", simulate_interruptions=1)
    result = handle.wait(timeout=240)
    assert result.status == "completed", result.reason
    interrupted, ended = hook.wait_for(2)
    assert "attempt 1 interrupted by a spot interruption notice" in interrupted["text"]
    assert "*notified*" in interrupted["text"] and "CPU" in interrupted["text"]
    assert ended["text"].startswith(":white_check_mark: spotnb job *notified*")
    # The total comes from the loop's range, found by spot.log on the instance.
    assert "step 40 of 40" in ended["text"] and "loss 0.025" in ended["text"]
    events = EventReader(handle.store).poll()
    assert [(e.data["total"], e.data["source"]) for e in events
            if e.type == "progress"] == [(40, "range"), (40, "range")]

    # The URL travels as the job's secret: not in its spec.
    assert handle.spec.secrets == (NOTIFY_SECRET,)
    assert hook.url not in handle.store.get(layout.SPEC).decode()
    assert "/B0/secret" not in json.dumps([e.data for e in events])
    record = job_record(handle)
    assert record["options"]["notify"] is True
    assert "/B0/secret" not in json.dumps(record) and record["options"]["secrets"] == []


def test_an_unreachable_webhook_does_not_fail_the_job(spotnb_home: Path) -> None:
    dead = Hook()
    url = dead.url
    dead.close()  # nothing listens there now
    handle = spotnb.submit("spot.log(0, loss=1.0)", notify_url=url)
    result = handle.wait(timeout=120)
    assert result.status == "completed", result.reason


# -- the magic ---------------------------------------------------------------------------

@pytest.fixture
def ip(spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "spotnb")
    monkeypatch.chdir(tmp_path)
    yield shell
    magics = shell.magics_manager.registry["SpotMagics"]
    magics.notify_url = None
    magics.last_job = None


def test_the_magic_takes_the_url_but_the_remote_cell_never_quotes_it(
        ip: Any, hook: Hook, capsys: pytest.CaptureFixture[str]) -> None:
    ip.user_ns["webhook"] = hook.url
    ip.run_cell_magic("spot_train", "--detach --name quiet --notify $webhook", "x = 1\n")
    (job,) = spotnb.jobs()
    handle = spotnb.attach(job.job_id)
    assert handle.spec.secrets == (NOTIFY_SECRET,)
    assert hook.url not in handle.spec.code and "--notify [redacted]" in handle.spec.code
    assert handle.wait(timeout=120).status == "completed"
    (ended,) = hook.wait_for(1)
    assert "*quiet*" in ended["text"]
    # %spot_config shows that a URL is set, not the URL.
    magics = ip.magics_manager.registry["SpotMagics"]
    magics.notify_url = hook.url
    capsys.readouterr()
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        ip.run_line_magic("spot_config", "")
    shown = out.outputs[0].data["text/plain"]
    assert "SpotMagics.notify_url" in shown and "(set; a secret, not shown)" in shown
    assert hook.url not in shown
