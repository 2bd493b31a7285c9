"""Every output line is kept or accounted for, and shown in order.

The dashboard keeps the first and the last lines of a long output and says in place
how many it left out and how to print them all (the saved notebook and its record hold
the same); a follower attached after an instance was lost sees the output its
checkpoint carried, in order, after a line that says where it came from; milestones of
the capacity group (a standby booting) come before the attempt's news that follows
them.
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_reliability import booted, kernel_of
from test_widgets import _view, dashboard

import spotnb
from spotnb.client import display
from spotnb.client.display import JobView
from spotnb.protocol.events import Event


def test_a_long_output_keeps_its_first_and_last_lines_and_says_what_it_left_out() -> None:
    board = dashboard()
    board.stream("stdout", "".join(f"line {i}\n" for i in range(1000)))
    board.flush()
    board.view = _view([], now=0.0)
    text = board._repr_mimebundle_()["text/plain"]
    lines = text.splitlines()
    first = lines.index("line 0")
    assert lines[first:first + 50] == [f"line {i}" for i in range(50)]  # the set-up
    gap = lines[first + 50]
    assert "750 lines left out here" in gap and "%spot_logs job-1" in gap
    assert lines[first + 51:] == [f"line {i}" for i in range(800, 1000)]
    # The live panel and the HTML form (what a record shows) say the same, in place.
    panel = board.panel.lines
    assert panel[50][0] == "spotnb" and "750 lines left out here" in panel[50][1]
    assert "750 lines left out here" in board._repr_mimebundle_()["text/html"]
    assert "1,000 lines" in board.panel.caption


def test_a_short_output_is_kept_whole_without_a_marker() -> None:
    board = dashboard()
    board.stream("stdout", "".join(f"line {i}\n" for i in range(250)))
    board.flush()
    assert [text for _, text in board.panel.lines] == [f"line {i}" for i in range(250)]
    assert board.panel.caption == ""


def _status(t: float, attempt: int, state: str, detail: str = "") -> Event:
    return Event("status", t, attempt, f"i-{attempt}", {"state": state, "detail": detail})


def test_only_an_attempts_news_makes_the_follower_read_the_log() -> None:
    view = JobView(job_id="job-1", name="t", created=0.0)
    saving = [_status(1, 1, "checkpointing"), _status(2, 1, "running", "running the cell")]
    assert not display._older_news_possible(saving, view)
    line = Event("stream", 3, 1, "i-1", {"name": "stdout", "text": "x\n"})
    assert not display._older_news_possible([line], view)
    assert display._older_news_possible([_status(4, 2, "booting")], view)
    restored = _status(5, 2, "running", "restored checkpoint of step 59 in 0.1s")
    assert display._older_news_possible([restored], view)


class Recording:
    """A renderer that records what the cell would show, in order."""

    def __init__(self, on_first_events: Any) -> None:
        self.shown: list[str] = []
        self.on_first_events = on_first_events

    def events(self, batch: list[Event]) -> None:
        if self.on_first_events is not None:
            hook, self.on_first_events = self.on_first_events, None
            hook()

    def update(self, view: JobView) -> None:
        pass

    def stream(self, name: str, text: str) -> None:
        self.shown += text.splitlines()

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        pass

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        self.shown.append(f"[spotnb] {text}")

    def finished(self, view: JobView, result: Any) -> None:
        pass

    def detached(self, view: JobView) -> None:
        pass


# Staged as tests/test_reliability.py stages a lost log: attempt 1's agent cannot write
# its log (its store fails; the kernel's does not), so its lines reach the store only
# in the checkpoint at step 39; then the agent is SIGKILLed. Attempt 2 waits for a file
# before its restore, so that the follower has read the log as attempt 1 left it
# before the restore records what the checkpoint carried.
LINES = textwrap.dedent("""
    import os, time
    os.environ.pop("SPOTNB_LOCAL_STORE_FAULT", None)
    state = {"w": 0}
    ckpt = spot.Checkpoint(state=state)
    gate = FAULTED if spot.attempt == 1 else GO
    while not os.path.exists(gate):
        time.sleep(0.05)
    for step in range(ckpt.restore(), STEPS):
        state["w"] += step
        print(f"step {step}", flush=True)
        if step == 39:
            ckpt.save(step)
            ckpt.wait()
            while spot.attempt == 1:  # killed here
                time.sleep(1)
""")


@pytest.mark.slow  # two attempts on the local cloud
def test_a_follower_attached_after_a_kill_sees_the_lost_attempts_output_in_order(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import json

    from helpers import wait_until

    from spotnb.providers.local.state import instance_dir

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    switch, faulted, go = tmp_path / "fault", tmp_path / "faulted", tmp_path / "go"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    handle = spotnb.submit(LINES, inputs={"STEPS": 60, "GO": str(go),
                                          "FAULTED": str(faulted)})
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    agent_log = instance_dir(str(boot.instance)) / "agent.log"
    switch.write_text("read-only")
    wait_until(lambda: "Read-only file system (simulated)" in agent_log.read_text(),
               120, "the agent's writes to fail")
    faulted.touch()
    checkpoints = handle.store.child("checkpoints")
    wait_until(lambda: checkpoints.exists("LATEST") and
               json.loads(checkpoints.get("LATEST"))["step"] == 39, 120, "the save at 39")
    agent = psutil.Process(boot.data["pid"])
    kernel = kernel_of(agent.pid)
    agent.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs([kernel], timeout=30)
    assert not alive, "the kernel outlived its agent"
    switch.unlink()
    assert not any(e.type == "stream" and e.attempt == 1 for e in handle.events(follow=False))
    renderer = Recording(on_first_events=go.touch)
    outcome = display.follow(handle, renderer)
    assert isinstance(outcome, display.Finished)
    assert outcome.result.status == "completed", outcome.result.reason
    steps = [line for line in renderer.shown if line.startswith("step ")]
    assert steps == [f"step {i}" for i in range(60)]
    recovered = [i for i, line in enumerate(renderer.shown)
                 if "recovered from its checkpoint" in line]
    assert len(recovered) == 1
    # The line says where the recovered lines came from, right before them.
    assert renderer.shown[recovered[0] + 1] == "step 0"


def test_the_groups_news_before_an_attempts_live_news_is_shown_before_it(
        spotnb_home: Path) -> None:
    # The capacity group's events reach a follower only through the log; an attempt's
    # come live, at once. A group event older than an attempt's live boot (here: a pool
    # without capacity, skipped before the replacement started) is shown before it.
    import json
    import time

    from spotnb.client.jobs import JobHandle
    from spotnb.protocol import layout
    from spotnb.protocol.events import EventWriter
    from spotnb.protocol.events.live import WATCHERS_PREFIX
    from spotnb.protocol.events.queues import open_queue, pack
    from spotnb.protocol.spec import JobSpec, Policy, Resources
    from spotnb.protocol.store import open_store

    store = open_store(spotnb_home / "store").child("jobs/20260101-000000-cccccc")
    spec = JobSpec(job_id="20260101-000000-cccccc", name="order", code="x", provider="local",
                   resources=Resources(instance_types=("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time() - 5)
    store.put(layout.SPEC, spec.to_json().encode())
    group = EventWriter(store, 0)
    group.emit("instance", action="launched", instance_id="i-1", instance_type="g4dn.xlarge",
               az="use1-az1", pool="g4dn.xlarge@use1-az1", price=0.2, ondemand=0.526)
    group.close()
    first = EventWriter(store, 1, "i-1")
    first.emit("status", state="booting", detail="attempt 1", instance_type="g4dn.xlarge",
               az="use1-az1")
    first.emit("checkpoint", phase="durable", step=0, id="c0", bytes=10)
    first.emit("status", state="interrupted", detail="the instance was terminated")
    first.close()

    def replacement() -> None:
        # Runs after the follower's first read of the log, as the job goes on: the
        # group writes its news to the log, then the replacement boots and sends its
        # own live (and writes its log, with the result, as the job ends).
        group = EventWriter(store, 0)
        group.emit("instance", action="capacity_error", reason="InsufficientInstanceCapacity",
                   detail="none", instance_id=None, instance_type="g4dn.xlarge",
                   az="use1-az2", pool="g4dn.xlarge@use1-az2")
        group.close()
        second = EventWriter(store, 2, "i-2", flush_seconds=3600)
        second.emit("status", state="booting", detail="attempt 2",
                    instance_type="g4dn.xlarge", az="use1-az1")
        (registration,) = store.list_keys(WATCHERS_PREFIX)
        queue = open_queue(json.loads(store.get(registration))["queue"])
        lines, _ = second.unwritten(frozenset({"status"}))
        queue.send(pack({"op": "events", "stream": "000002", "lines": lines}))
        second.emit("result", status="completed", reason="the cell finished")
        second.close()
        store.put(layout.RESULT, json.dumps({"status": "completed", "attempt": 2,
                                             "reason": "the cell finished"}).encode())

    renderer = Recording(on_first_events=replacement)
    outcome = display.follow(JobHandle(store, spec), renderer)
    assert isinstance(outcome, display.Finished)
    capacity = next(i for i, line in enumerate(renderer.shown) if "no spot capacity" in line)
    resumed = next(i for i, line in enumerate(renderer.shown) if line.startswith(
        "[spotnb] attempt 2:"))
    assert capacity < resumed, renderer.shown
