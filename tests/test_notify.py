"""Notifications: a Slack-compatible webhook told from the instance, tested against a
real HTTP server on loopback.

The webhook is a secret: the tests also check that its URL appears in no spec, event,
record or remote cell line (it travels as the job's secret, spotnb.protocol.secretstore).
"""

from __future__ import annotations

import http.server
import json
import logging
import shlex
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.getipython import get_ipython
from IPython.testing.globalipapp import start_ipython

import spotnb
from spotnb.protocol import layout, notify
from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.secretstore import NOTIFY_SECRET
from spotnb.protocol.spec import SpecError
from spotnb.records import job_record

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


def _interrupted_job() -> list[Event]:
    """A job's events: attempt 1 on i-1 ($0.20/h spot, $0.50/h on-demand) logs steps
    0-40 and gets a notice at 100 s; its replacement i-2 boots at 200 s and resumes at
    step 31 (the checkpoint of step 30) at 230 s."""
    t0 = 1_800_000_000.0

    def launched(instance: str, at: float) -> Event:
        return Event("instance", t0 + at, 0, instance,
                     {"action": "launched", "instance_id": instance, "pool": "g4dn@a",
                      "price": 0.2, "ondemand": 0.5, "instance_type": "g4dn.xlarge"})

    def row(attempt: int, step: int, at: float) -> Event:
        return Event("metric", t0 + at, attempt, f"i-{attempt}",
                     {"step": step, "t": t0 + at, "values": {"loss": 1.0 / (step + 1)}})

    events = [launched("i-1", 0), Event("status", t0 + 5, 1, "i-1", {"state": "booting"})]
    events += [row(1, step, 10 + 2 * step) for step in range(41)]
    events += [Event("notice", t0 + 100, 1, "i-1", {"kind": "instance-action"}),
               launched("i-2", 150),
               Event("instance", t0 + 120, 0, "i-1",
                     {"action": "terminated", "instance_id": "i-1"}),
               Event("status", t0 + 200, 2, "i-2", {"state": "booting"}),
               row(2, 31, 230)]
    return events


def test_start_resume_and_end_say_what_the_job_costs_from_its_fold(hook: Hook) -> None:
    """The start names the price and the saving; a replacement's first step says
    where it resumed, what the interruption cost (from the replaced attempt's last
    word to this first step, at the instances' spot price) and the steps redone; the
    end gives the job's duration, cost, saving, interruptions and steps redone. The
    figures are the fold's (the same the notebook shows)."""
    events = _interrupted_job()
    t0 = events[0].time
    seen = fold(events[:2])
    n = notify.Notifier(hook.url, "job-1", "run a", job_state=lambda: seen)
    n.where = "g4dn.xlarge use1-az4 i-1"
    n.started(1)
    n.close()  # the next one's messages come after it
    resumed = notify.Notifier(hook.url, "job-1", "run a", job_state=lambda: fold(events),
                              clock=lambda: t0 + 300)
    resumed.where = "g4dn.xlarge use1-az6 i-2"
    resumed.started(2)  # a replacement: said at its first step
    resumed.saw_metrics([[31, t0 + 230, {"loss": 0.03}]])
    resumed.ended("completed", "the cell finished", 2)
    for sender in (n, resumed):
        sender.close()
    start, resume, end = (b["text"] for b in hook.wait_for(3))
    assert start.startswith(":arrow_forward: spotnb job *run a* (`job-1`) started on "
                            "g4dn.xlarge use1-az4 i-1: spot $0.2000/h, 60% under "
                            "on-demand ($0.5000/h)"), start
    # The break's window as the fold (and the header) says it, until this first step:
    # from attempt 1's last row at its furthest step (step 40, at 90 s) to attempt 2's
    # first step (at 230 s): 140 s, in which i-1 billed 30 s (to its end at 120 s) and
    # i-2 80 s (from its launch at 150 s), 110 s at $0.20/h; steps 31-40 run again.
    assert "resumed on attempt 2, g4dn.xlarge use1-az6 i-2, from step 31: the " \
           "interruption has cost 0:02:20 of training and $0.0061 so far, 10 steps " \
           "redone" in resume, resume
    assert "job running" in resume
    # At 300 s: i-1 billed 0-120 s, i-2 150-300 s, 270 s at $0.20/h spot, $0.50/h
    # on-demand.
    assert "completed on attempt 2: the cell finished\nran 0:05:00 · cost $0.0150 (60% " \
           "under on-demand $0.0375) · 1 interruption · 10 steps redone" in end, end
    assert "job running 0:05:00" in end


def test_an_instance_ec2_interrupted_in_its_first_hour_is_not_billed_in_the_summary() -> None:
    """The same job, its first instance ended by EC2 (``spot-interruption``) 120 s after
    its launch: AWS bills nothing for it, and the summary says why the cost is lower."""
    events = _interrupted_job()
    t0 = events[0].time
    events = [Event(e.type, e.time, e.attempt, e.instance,
                    {**e.data, "reason": "spot-interruption"})
              if e.data.get("action") == "terminated" else e for e in events]
    text = notify.job_summary(fold(events), t0 + 300)
    # i-2 only: 150-300 s at $0.20/h; on-demand still counts both (0-120, 150-300 s).
    assert text == ("ran 0:05:00 · cost $0.0083 (78% under on-demand $0.0375) · "
                    "1 interruption (1 in the first hour of an instance: not billed) · "
                    "10 steps redone"), text


def test_a_retry_in_place_is_no_resume_and_a_failing_figure_costs_only_the_figures(
        hook: Hook) -> None:
    """An attempt retried in place after an error in the cell (the same agent, the same
    instance) is not announced as a resume after an interruption; a message whose
    figures cannot be made goes without them, and the messages after it still go."""
    events = _interrupted_job()
    n = notify.Notifier(hook.url, "job-1", "run a", job_state=lambda: fold(events))
    n.started(1)
    n.started(2)  # retried in place
    n.saw_metrics([[31, events[-1].time, {"loss": 0.03}]])
    n.close()

    def broken() -> Any:
        raise ValueError("a log this version cannot fold")

    # A log that cannot be read; then one read whose figures cannot be made.
    for state, status, why in ((broken, "completed", "the cell finished"),
                               (object, "stopped", "stopped by the user")):
        ending = notify.Notifier(hook.url, "job-1", "run a", job_state=state)
        ending.ended(status, why, 2)
        ending.close()
    texts = [b["text"] for b in hook.wait_for(3)]
    assert not any("resumed" in text for text in texts), texts
    assert texts[0].startswith(":arrow_forward:")
    assert texts[1].startswith(":white_check_mark: spotnb job *run a* (`job-1`) completed")
    assert texts[2].startswith(":octagonal_sign: spotnb job *run a* (`job-1`) stopped on "
                               "attempt 2: stopped by the user\n")


def test_a_failing_or_hanging_webhook_costs_a_bounded_wait_and_never_the_url(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(notify, "SEND_TIMEOUT_SECONDS", 0.2)
    hung = Hook(hang=True)
    refused = Hook(status=500)
    try:
        with caplog.at_level(logging.WARNING, logger="spotnb.protocol.notify"):
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
    # Two agents send them (attempt 1: the start and the notice; attempt 2: the
    # resume and the end): told apart by what they begin with, not their order.
    bodies = hook.wait_for(4)  # (and a standby's, if it came while the lease was held)
    while not any(b["text"].startswith(":white_check_mark:") for b in bodies):
        bodies = hook.wait_for(len(bodies) + 1)
    by_icon = {b["text"].split(" ", 1)[0]: b for b in bodies}
    started, interrupted = by_icon[":arrow_forward:"], by_icon[":warning:"]
    resumed, ended = by_icon[":arrows_counterclockwise:"], by_icon[":white_check_mark:"]
    assert "*notified*" in started["text"] and "% under on-demand" in started["text"]
    assert "attempt 1 interrupted by a spot interruption notice" in interrupted["text"]
    assert "*notified*" in interrupted["text"] and "CPU" in interrupted["text"]
    assert "resumed on attempt 2" in resumed["text"], resumed
    assert "the interruption has cost" in resumed["text"] and "redone" in resumed["text"]
    assert ended["text"].startswith(":white_check_mark: spotnb job *notified*")
    assert "1 interruption" in ended["text"] and "job running" in ended["text"]
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


def test_a_standby_given_back_is_notified_with_its_cost(
        spotnb_home: Path, hook: Hook, monkeypatch: pytest.MonkeyPatch) -> None:
    # A false alarm 2 s after launch; at 600x the standby's hold is 1 s after its boot.
    # The instances run the local cloud's stand-in agent, which never warms up as a
    # standby: the standby is not ready by the end of its hold and is given back (a
    # ready one would take the job over).
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "600")
    monkeypatch.setenv("SPOTNB_LOCAL_AGENT_CMD", shlex.join(
        [sys.executable, str(Path(__file__).with_name("local_cloud_agent.py"))]))
    handle = spotnb.submit(CELL, name="held", notify_url=hook.url, standby_first_hour=True,
                           simulate_signals={"false_alarms": [2], "false_alarm": 0})
    try:
        bodies = hook.wait_for(1)
        while not any("standby given back" in b["text"] for b in bodies):
            bodies = hook.wait_for(len(bodies) + 1)
    finally:
        handle.stop()
    (text,) = [b["text"] for b in bodies if "standby given back" in b["text"]]
    state = fold(EventReader(handle.store).poll())
    (sb,) = state.standbys.values()
    assert text.split("\n")[0].endswith(
        f"*held* (`{handle.job_id}`): standby given back (not ready in time): "
        f"${state.instance_cost(sb.instance_id):.3f}"), text
    assert "job running" in text


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
    started, ended = sorted((b["text"] for b in hook.wait_for(2)),
                            key=lambda text: text.startswith(":white_check_mark:"))
    assert "*quiet*" in ended and "*quiet*" in started and "started on" in started
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


def _standby_job() -> list[Event]:
    """A job whose i-1 ($0.20/h) gets a recommendation at 100 s: standby i-2 launches,
    is ready at 130 s; the notice at 200 s; attempt 1's last word (its final save, the
    lease released) at 203 s; i-2 takes over and restores at 209.2 s. Then a false
    alarm on i-2 at 400 s: standby i-3, given back at 472 s."""
    t0 = 1_800_000_000.0

    def group(at: float, instance: str, **data: Any) -> Event:
        return Event("instance", t0 + at, 0, instance, {"instance_id": instance,
                                                         "pool": "g4dn@a", **data})

    def launched(at: float, instance: str, **data: Any) -> Event:
        return group(at, instance, action="launched", price=0.2, ondemand=0.5, **data)

    return [launched(0, "i-1"), Event("status", t0 + 5, 1, "i-1", {"state": "booting"}),
            launched(100, "i-2", standby_for="i-1"),
            group(130, "i-2", action="standby-ready", standby_for="i-1",
                  kernel_started=t0 + 120),
            Event("notice", t0 + 200, 1, "i-1", {"kind": "instance-action"}),
            Event("status", t0 + 203, 1, "i-1", {"state": "interrupted"}),
            Event("status", t0 + 204, 2, "i-2", {"state": "booting"}),
            Event("standby", t0 + 204, 2, "i-2", {"phase": "took-over", "lease_at": t0 + 204,
                                                  "read_bytes": 10}),
            Event("standby", t0 + 209.2, 2, "i-2", {"phase": "restored", "step": 40}),
            group(210, "i-1", action="terminated"),
            launched(400, "i-3", standby_for="i-2"),
            group(472, "i-3", action="terminated", reason="standby-given-back",
                  standby_for="i-2")]


def test_a_standby_that_found_the_lease_free_is_billed_as_one_until_its_attempt() -> None:
    """A standby launched at a notice whose agent found the lease already released (it
    took the job over cold, with no ``took-over`` event) stood by until its attempt's
    first event, not for the rest of its life."""
    t0 = 1_800_000_000.0
    events = [Event("instance", t0, 0, "i-1", {"instance_id": "i-1", "pool": "g4dn@a",
                                               "action": "launched", "price": 0.2,
                                               "ondemand": 0.5}),
              Event("status", t0 + 5, 1, "i-1", {"state": "booting"}),
              Event("notice", t0 + 100, 1, "i-1", {"kind": "instance-action"}),
              Event("instance", t0 + 100, 0, "i-2", {"instance_id": "i-2", "pool": "g4dn@a",
                                                     "action": "launched", "price": 0.2,
                                                     "ondemand": 0.5, "standby_for": "i-1"}),
              Event("status", t0 + 190, 2, "i-2", {"state": "booting"}),
              Event("instance", t0 + 220, 0, "i-1", {"instance_id": "i-1",
                                                     "action": "terminated"}),
              Event("status", t0 + 3700, 2, "i-2", {"state": "running"})]
    state = fold(events)
    assert state.standbys_cost(t0 + 3700) == pytest.approx(0.2 * 90 / 3600)


def test_a_standby_s_story_is_the_fold_s_in_the_log_and_the_notifications(
        hook: Hook) -> None:
    from spotnb.client.display import JobView, milestone

    events = _standby_job()
    view = JobView(job_id="job-1", name="run a", created=events[0].time)
    lines = []
    for e in events:
        view.apply(e)
        lines.append(milestone(e, view))
    # i-3 billed 72 s at $0.20/h ($0.004); i-2 billed 104 s before the lease was its.
    assert [line for line in lines if line and ("standby" in line or "handed" in line)] == [
        "rebalance recommendation: standby booting", "standby ready",
        "handed over in 6.2 s", "rebalance recommendation: standby booting",
        "standby given back (not ready in time): $0.004"]
    state = fold(events)
    assert state.standbys_cost(events[-1].time) == pytest.approx(0.2 * (104 + 72) / 3600)
    n = notify.Notifier(hook.url, "job-1", "run a", job_state=lambda: state)
    n.where = "g4dn.xlarge use1-az6 i-2"
    n.rebalance(1)
    n.standby_ready()
    n.handed_over(2)
    n.close()
    texts = [b["text"] for b in hook.wait_for(3)]
    assert "attempt 1: rebalance recommendation: standby booting" in texts[0], texts
    assert "standby ready on g4dn.xlarge use1-az6 i-2" in texts[1], texts
    assert "handed over to the standby in 6.2 s (attempt 2)" in texts[2], texts
