"""Faults found by attack (issue 12), one regression test each, on the local cloud.

Each test stages one fault that an attacker found (an agent SIGKILLed or frozen, a
kernel killed while parked, a store that fails, a supervisor that dies, a cell that
leaves processes behind) and checks what a user would notice: no metric step missing
from the history, no job left without a result, no process left behind, no write by an
agent that lost the lease.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from helpers import StartupHold, replayed, run_uninterrupted, wait_until
from test_engine import live_processes, steps_by_attempt, wait_no_processes

import spotnb
from spotnb.protocol import lease
from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.events.live import Follower
from spotnb.protocol.store import LocalStore

pytestmark = pytest.mark.slow

# Logs every step, checkpoints every CKPT steps; the digest of `w` is the result.
COUNTING = textwrap.dedent("""
    import random, time
    random.seed(7)
    state = {"w": 0.0}
    ckpt = spot.Checkpoint(state=state)
    for step in range(ckpt.restore(), STEPS):
        state["w"] += random.random()
        spot.log(step, w=state["w"])
        time.sleep(STEP_SECONDS)
        if step % CKPT == CKPT - 1:
            ckpt.save(step)
    total = state["w"]
""")


@pytest.fixture
def cloud(spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    return spotnb_home


def events_of(handle: spotnb.JobHandle) -> list[Event]:
    """What the job's log holds now (written every minute, and at once on what is
    urgent: a status change, a checkpoint, a notice)."""
    return list(handle.events(follow=False))


def wait_event(handle: spotnb.JobHandle, match: Callable[[Event], bool], what: str,
               timeout: float = 120.0) -> Event:
    """The first event of the job, old or new, that ``match`` accepts: the job is
    followed live, as a notebook follows it."""
    deadline = time.monotonic() + timeout
    with Follower(handle.store, handle.job_id) as follower:
        while time.monotonic() < deadline:
            for event in follower.poll(wait=1.0):
                if match(event):
                    return event
    raise AssertionError(f"timed out waiting for {what}")


def is_metric(e: Event) -> bool:
    return e.type == "metric"


def is_durable(e: Event) -> bool:
    return e.type == "checkpoint" and e.data.get("phase") == "durable"


def booted(handle: spotnb.JobHandle, attempt: int) -> Event | None:
    return next((e for e in events_of(handle) if e.attempt == attempt
                 and e.type == "status" and e.data.get("state") == "booting"), None)


def kernel_of(agent_pid: int) -> psutil.Process:
    """The agent's kernel: its child running ipykernel (once it is started)."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(agent_pid).children():
            if any("ipykernel" in part for part in child.cmdline()):
                return child
        return None
    return wait_until(find, 120, "the kernel process")


def all_steps(events: list[Event]) -> set[int]:
    return {s for steps in steps_by_attempt(events).values() for s in steps}


def test_the_last_rows_of_a_fast_cell_reach_the_log(cloud: Path) -> None:
    # A cell that logs as fast as it can and ends: its last rows are still in the
    # agent's socket when the cell's execution ends.
    rows = 120_000
    code = f"for step in range({rows}):\n    spot.log(step, loss=1.0 / (step + 1))\n"
    handle = spotnb.submit(code)
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.reason, result.error)
    steps = [s for s, _ in handle.metrics()["loss"]]
    assert len(steps) == rows and steps[-1] == rows - 1
    assert result.metrics["loss"] == 1.0 / rows
    wait_no_processes(cloud)


def test_a_sigkilled_agent_loses_no_metric_step(
        cloud: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The agent dies with rows it never wrote, although the checkpoint after them is
    # durable. Staged exactly: the agent's writes fail (its store is "read-only") while
    # the kernel's do not (the cell drops the fault variable), so the kernel commits
    # checkpoints whose rows the log lacks; then the agent is SIGKILLed. The kernel dies
    # with it (PR_SET_PDEATHSIG), and the replacement records the rows the restored
    # checkpoint carried: no step is missing, none is there twice.
    switch = tmp_path / "agent-store-fault"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    inputs = {"STEPS": 240, "STEP_SECONDS": 0.02, "CKPT": 40}
    code = "import os\nos.environ.pop('SPOTNB_LOCAL_STORE_FAULT', None)\n" + COUNTING
    handle = spotnb.submit(code, inputs=inputs, outputs=["total"])
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    first = wait_event(handle, is_durable, "a first checkpoint").data["step"]
    from spotnb.providers.local.state import instance_dir

    agent_log = instance_dir(str(boot.instance)) / "agent.log"
    latest = handle.store.child("checkpoints")
    switch.write_text("read-only")
    wait_until(lambda: "Read-only file system (simulated)" in agent_log.read_text(),
               120, "the agent's writes to fail")
    # Two more checkpoints become LATEST (the kernel writes) whose rows the log lacks.
    wait_until(lambda: json.loads(latest.get("LATEST"))["step"] >= first + 80,
               120, "newer checkpoints than the log's rows")
    agent = psutil.Process(boot.data["pid"])
    kernel = kernel_of(agent.pid)
    agent.send_signal(signal.SIGKILL)
    _, alive = psutil.wait_procs([kernel], timeout=30)
    assert not alive, "the kernel outlived its agent"
    switch.unlink()
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.reason, result.error)
    events = events_of(handle)
    rows = [s for e in events if e.type == "metric" for s in [e.data["step"]]]
    assert set(rows) == set(range(240)), "metric steps are missing"
    for attempt in {e.attempt for e in events if e.type == "metric"}:
        logged = [e.data["step"] for e in events if e.type == "metric" and e.attempt == attempt]
        assert len(logged) == len(set(logged)), f"attempt {attempt} has a step twice"
    replayed = [e for e in events if e.type == "metric" and e.data.get("replayed_by")]
    assert replayed and all(e.attempt == 1 for e in replayed)
    baseline = run_uninterrupted(COUNTING, {**inputs, "STEP_SECONDS": 0}, ["total"], tmp_path)
    assert result.outputs["total"] == baseline["total"]
    wait_no_processes(cloud)


def test_a_frozen_agent_writes_nothing_once_another_took_over(
        cloud: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # SIGSTOP the agent for longer than the lease's TTL while a second agent waits for
    # the job (what a racing or rebalancing instance does). The frozen agent's kernel
    # stops itself before the second agent may take over (a short TTL included: with a
    # watchdog fixed at 15 s it trained 60-74 steps after the takeover); the second
    # agent takes over after the TTL and finishes the job; once resumed, the frozen
    # agent writes nothing and its kernel is killed.
    monkeypatch.setenv(lease.ENV_TTL, "6")
    # One checkpoint (step 19), then none: a save would wait for the frozen agent's
    # fencing answer and so hold the cell; only the watchdog may stop the training.
    trace = tmp_path / "steps.txt"  # every step each kernel ran, with its time
    inputs = {"STEPS": 600, "STEP_SECONDS": 0.02, "CKPT": 20, "TRACE": str(trace)}
    code = COUNTING.replace("    time.sleep(STEP_SECONDS)\n", "    time.sleep(STEP_SECONDS)\n"
                            "    with open(TRACE, 'a') as f:\n"
                            "        f.write(f'{spot.attempt} {step} {time.time()}\\n')\n")
    code = code.replace("if step % CKPT == CKPT - 1:", "if step == CKPT - 1:")
    handle = spotnb.submit(code, inputs=inputs, outputs=["total"])
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    wait_event(handle, is_durable, "a first checkpoint")
    agent = psutil.Process(boot.data["pid"])
    kernel = kernel_of(agent.pid)
    agent.suspend()
    try:
        env = {**os.environ, "SPOTNB_IMDS_ENDPOINT": "http://127.0.0.1:9"}
        racer = subprocess.Popen([sys.executable, "-m", "spotnb.kernel_remote", "--job",
                                  handle.store.uri], cwd=tmp_path, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # The kernel stopped itself once its agent fell silent.
        wait_until(lambda: kernel.status() == psutil.STATUS_STOPPED, 120, "the kernel to stop")
        took_over = wait_until(lambda: booted(handle, 2), 120, "the second agent to take over")
    finally:
        agent.resume()
    stderr = racer.communicate(timeout=240)[1]
    assert racer.returncode == 0, stderr
    result = handle.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    events = events_of(handle)
    late = [e for e in events if e.attempt == 1 and e.time > took_over.time]
    assert late == [], f"the fenced agent wrote {len(late)} event(s) after the takeover"
    ran = [line.split() for line in trace.read_text().splitlines()]
    trained_late = [int(step) for attempt, step, at in ran
                    if attempt == "1" and float(at) >= took_over.time]
    assert trained_late == [], (f"the frozen agent's kernel trained {len(trained_late)} "
                                "step(s) after the next attempt held the lease")
    store = LocalStore(handle.store.uri.removeprefix("file://"))
    # (A chunk the next attempt appended for it, holding what the checkpoint carried,
    # is not the frozen agent's write.)
    chunks = [store.root / k for k in store.list_keys("events/000001/")
              if not replayed(store, k, 1)]
    assert all(p.stat().st_mtime <= took_over.time + 0.5 for p in chunks)
    assert all_steps(events) == set(range(600)), "metric steps are missing"
    psutil.wait_procs([kernel, agent], timeout=60)
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE
    wait_no_processes(cloud)


def test_a_parked_attempt_whose_kernel_dies_writes_nothing(
        cloud: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # After the final checkpoint the agent has released the lease: the death of its
    # kernel is not an error of the job's (the replacement carries on).
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "20")
    inputs = {"STEPS": 200, "STEP_SECONDS": 0.02, "CKPT": 1000}
    code = COUNTING.replace("time.sleep(STEP_SECONDS)",
                            "time.sleep(STEP_SECONDS)\n    ckpt.maybe_save(step)")
    handle = spotnb.submit(code, inputs=inputs, outputs=["total"], max_restarts_on_error=1)
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    wait_event(handle, is_metric, "a metric")
    handle.interrupt()
    wait_event(handle, lambda e: e.type == "status" and "waiting for the instance to be "
               "terminated" in e.data.get("detail", ""), "the attempt to park")
    kernel_of(boot.data["pid"]).send_signal(signal.SIGKILL)
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.reason, result.error)
    store = LocalStore(handle.store.uri.removeprefix("file://"))
    assert store.list_keys("errors/") == [], "a parked agent recorded an error"
    assert [a.end_reason for a in result.attempts] == ["interrupted", "completed"]
    wait_no_processes(cloud)


def test_a_store_that_fails_for_a_while_loses_nothing_and_starts_no_storm(
        cloud: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    switch = tmp_path / "store-fault"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    # The agent meets the fault at its lease's next renewal: a 60 s lease renews every
    # 20 s (the default's minute was most of this test's time), and a renewal that
    # fails is retried for 40 s before the lease would lapse: the outage below lasts
    # one failed renewal and one retry.
    monkeypatch.setenv("SPOTNB_LEASE_TTL", "60")
    inputs = {"STEPS": 400, "STEP_SECONDS": 0.02, "CKPT": 50}
    handle = spotnb.submit(COUNTING, inputs=inputs, outputs=["total"])
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    wait_event(handle, is_metric, "a metric")
    from spotnb.providers.local.state import instance_dir

    agent_log = instance_dir(str(boot.instance)) / "agent.log"

    def logged(words: str) -> Callable[[], bool]:
        return lambda: agent_log.read_text(errors="replace").count(words) > 0

    # Writes fail (reads work) until the agent has met the failure, then a full disk
    # until a checkpoint has failed too; then the store heals.
    switch.write_text("read-only")
    wait_until(logged("Read-only file system (simulated)"), 120, "the agent to meet the fault")
    switch.write_text("full")
    wait_until(logged("No space left on device (simulated)"), 120, "a failed write on a full disk")
    switch.unlink()
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.reason, result.error)
    events = events_of(handle)
    assert all_steps(events) == set(range(400)), "metric steps were dropped"
    launches = [e for e in events if e.type == "instance" and e.data["action"] == "launched"]
    assert len(launches) == 1, "the outage made the group launch other instances"
    wait_no_processes(cloud)


def test_jobs_resume_after_their_supervisor_dies(
        cloud: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from spotnb.providers.local import LocalProvider

    hold = StartupHold(tmp_path, monkeypatch)
    # Case 1: the supervisor dies, then the agent: the next look at the job restarts
    # supervision and the job resumes on a new instance.
    inputs = {"STEPS": 150, "STEP_SECONDS": 0.02, "CKPT": 20}
    first = spotnb.submit(COUNTING, inputs=inputs, outputs=["total"])
    # Case 2: the supervisor dies right after a notice, while the replacement it
    # launched at the notice boots: held at the first instruction of its first process,
    # the supervisor is gone before that process ran a line of its own (issue 40: it
    # then never saw its supervisor die). The parked agent must still be terminated,
    # the replacement must find its metadata service, and nothing may outlive the job.
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "3")
    code = COUNTING.replace("time.sleep(STEP_SECONDS)",
                            "time.sleep(STEP_SECONDS)\n    ckpt.maybe_save(step)")
    second = spotnb.submit(code, inputs={**inputs, "CKPT": 1000}, outputs=["total"])
    provider = LocalProvider()
    for handle in (first, second):
        wait_event(handle, is_metric, "a metric")

    boot = booted(first, 1)
    assert boot is not None
    os.kill(provider.group(first.job_id)["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: not provider.group(first.job_id)["alive"], 120, "the supervisor to die")
    agent = psutil.Process(boot.data["pid"])
    for proc in [*agent.children(recursive=True), agent]:
        proc.kill()

    hold.arm(second.job_id)
    second.interrupt()
    hold.held()  # the replacement launched at the notice
    # The interruption notice (a rebalance recommendation, which may come a poll
    # before it, is not one: killing the supervisor then would lose the request).
    wait_event(second, lambda e: e.type == "notice" and e.data.get("kind") == "instance-action",
               "the notice")
    os.kill(provider.group(second.job_id)["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: not provider.group(second.job_id)["alive"], 120, "the supervisor to die")
    hold.release()

    results = [spotnb.attach(h.job_id).wait(timeout=240) for h in (first, second)]
    assert [r.status for r in results] == ["completed", "completed"], results
    assert all(all_steps(events_of(h)) == set(range(150)) for h in (first, second))
    assert [a.end_reason for a in results[1].attempts] == ["interrupted", "completed"]
    for handle in (first, second):  # every instance the group launched has ended
        assert fold(events_of(handle)).running_instances() == []
    wait_no_processes(cloud)
    launched = [e.data["instance_id"] for e in events_of(second)
                if e.type == "instance" and e.data.get("action") == "launched"]
    assert results[1].attempts[1].instance_id == launched[1], "the replacement ran " \
        "without its metadata service"


def test_an_instance_no_supervisor_can_adopt_is_ended_not_left_running(cloud: Path) -> None:
    # The supervisor dies between starting an instance's first process and recording it
    # (pid.json): staged by removing the record, then killing the supervisor. The next
    # look at the job starts one that cannot adopt the instance: it ends it, as its log
    # says, rather than leaving it to run the job with no metadata service and no
    # supervisor, and the job resumes on a replacement.
    from spotnb.providers.local import LocalProvider
    from spotnb.providers.local.state import instance_dir

    handle = spotnb.submit(COUNTING, inputs={"STEPS": 150, "STEP_SECONDS": 0.02, "CKPT": 20},
                           outputs=["total"])
    wait_event(handle, is_durable, "a first checkpoint")
    boot = booted(handle, 1)
    assert boot is not None
    agent = psutil.Process(boot.data["pid"])
    provider = LocalProvider()
    (instance_dir(str(boot.instance)) / "pid.json").unlink()
    os.kill(provider.group(handle.job_id)["supervisor"]["pid"], signal.SIGKILL)
    wait_until(lambda: not provider.group(handle.job_id)["alive"], 120, "the supervisor to die")
    assert provider.ensure_supervised(handle.job_id) is not None  # the next look
    # The new supervisor took over (or ended) the instances on record before it said
    # it was up: this one is ended by now.
    assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
    result = handle.wait(timeout=240)
    assert result.status == "completed", (result.reason, result.error)
    assert [a.end_reason for a in result.attempts] == ["lost", "completed"]
    ended = [e for e in events_of(handle) if e.type == "instance"
             and e.data.get("action") == "terminated" and e.instance == boot.instance]
    assert [e.data["reason"] for e in ended] == ["lost-while-unsupervised"]
    wait_no_processes(cloud)


def test_processes_a_cell_starts_end_with_its_job(cloud: Path) -> None:
    # A child in its own session and a double-forked daemon: both escape the kernel's
    # process group, neither may outlive the job, whether it completes or fails.
    code = textwrap.dedent("""
        import os, subprocess, sys, time
        session = subprocess.Popen(["sleep", "600"], start_new_session=True)
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                time.sleep(600)
            os._exit(0)
        daemon = int(os.read(r, 32))
        pids = [session.pid, daemon]
        if FAIL:
            raise RuntimeError("the cell failed")
    """)
    for fail in (False, True):
        handle = spotnb.submit(code, inputs={"FAIL": fail}, outputs=["pids"])
        result = handle.wait(timeout=120)
        assert result.status == ("failed" if fail else "completed"), result.error
        wait_no_processes(cloud)
        strays = [p for p in live_processes(cloud) if "sleep" in " ".join(p.cmdline())
                  or p.pid in result.outputs.get("pids", [])]
        assert strays == []
    for proc in psutil.process_iter(["cmdline"]):
        assert proc.info["cmdline"] != ["sleep", "600"] or \
            proc.environ().get("SPOTNB_HOME") != str(cloud)


def test_lease_renewals_from_two_threads_never_fence_the_holder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "job")
    held = lease.acquire(store, "i-a")
    assert held is not None
    errors: list[BaseException] = []

    def renew() -> None:
        for _ in range(200):
            try:
                held.renew()
            except BaseException as e:  # LeaseLost is the bug
                errors.append(e)
                return

    threads = [threading.Thread(target=renew) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert lease.still_holds(store, 1, "i-a")


def test_the_event_writer_keeps_events_through_a_failing_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotnb.protocol.events import EventWriter

    switch = tmp_path / "fault"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    store = LocalStore(tmp_path / "job")
    writer = EventWriter(store, 1, flush_seconds=3600)
    writer.emit("metric", step=0, t=0.0, values={"x": 0.0})
    switch.write_text("full")
    writer.emit("metric", step=1, t=1.0, values={"x": 1.0})
    assert writer.flush() is False and writer.failing_since is not None
    writer.emit("metric", step=2, t=2.0, values={"x": 2.0})
    switch.unlink()
    assert writer.close(timeout=30)
    steps = [e.data["step"] for e in EventReader(store).poll()]
    assert steps == [0, 1, 2]


# Saves its state with spot.Checkpoint (steps 19, 59, ...) and in a synced directory
# (steps 39, 79, ...: what a framework's integration does), prints a line and logs a
# row every step, and resumes from whichever is newer. Attempt 1 stops moving after
# the Checkpoint of step 59, attempt 2 after the snapshot of step 79, so that the test
# kills each right after that save, exactly.
TWO_SAVERS = textwrap.dedent("""
    import json, os, time
    state = {"w": 0.0}
    ckpt = spot.Checkpoint(state=state)
    out = spot.sync_dir("out", every=None)
    start = ckpt.restore()
    saved = os.path.join("out", "state.json")
    if os.path.exists(saved):
        with open(saved) as f:
            snap = json.load(f)
        if snap["step"] + 1 > start:
            start, state["w"] = snap["step"] + 1, snap["w"]
    for step in range(start, STEPS):
        state["w"] += step
        spot.log(step, w=state["w"])
        print(f"step {step} w={state['w']}")
        time.sleep(STEP_SECONDS)
        if step % 40 == 19:
            ckpt.save(step)
        if step % 40 == 39:
            with open(saved + ".tmp", "w") as f:
                json.dump({"step": step, "w": state["w"]}, f)
            os.replace(saved + ".tmp", saved)
            out.save(step)
        while (spot.attempt, step) in ((1, 59), (2, 79)):
            time.sleep(0.05)  # the test kills this attempt now
    total = state["w"]
""")


def test_a_kill_after_a_save_loses_no_row_and_no_output_line(
        cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Nobody follows the job, so its agent writes its log once a minute: when the agent
    # is SIGKILLed right after a save, the log lacks the rows and lines of the steps
    # before it. The checkpoint (attempt 1) and the synced directory's snapshot
    # (attempt 2: what the framework integrations save) carry them, and the next
    # attempt records them in the log: every step's row and line, each exactly once.
    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.client import cli
    from spotnb.train.syncdir import sync_name

    steps = 120
    handle = spotnb.submit(TWO_SAVERS, inputs={"STEPS": steps, "STEP_SECONDS": 0.01},
                           outputs=["total"])
    checkpoints = CheckpointStore(handle.store, "checkpoints")
    snapshots = CheckpointStore(handle.store, f"sync/{sync_name('out')}")

    def kill_after(attempt: int, saved: Callable[[], bool]) -> None:
        boot = wait_until(lambda: booted(handle, attempt), 120, f"attempt {attempt}")
        wait_until(saved, 120, f"attempt {attempt}'s save", interval=0.02)
        agent = psutil.Process(boot.data["pid"])
        kernel = kernel_of(agent.pid)
        agent.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs([kernel], timeout=30)
        assert not alive, "the kernel outlived its agent"

    def newest(cs: CheckpointStore) -> Callable[[], bool]:
        def check() -> bool:
            manifest = cs.latest()
            return manifest is not None and (manifest.metadata.get("step", manifest.step)
                                             in (59, 79))
        return check

    kill_after(1, newest(checkpoints))
    kill_after(2, newest(snapshots))
    result = handle.wait(timeout=300)
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs["total"] == sum(range(steps))
    assert len(result.attempts) == 3

    # Every step's row, each once per attempt that ran it: attempt 1 ran 0-59 (and
    # its rows reached the log through the checkpoint), attempt 2 ran 60-79 (through
    # the snapshot), attempt 3 the rest.
    events = events_of(handle)
    by_attempt = steps_by_attempt(events)
    assert sorted(by_attempt[1]) == list(range(60)), by_attempt[1]
    assert sorted(by_attempt[2]) == list(range(60, 80)), by_attempt[2]
    assert sorted(by_attempt[3]) == list(range(80, steps))
    assert [s for s, _ in handle.metrics()["w"]] == list(range(steps))
    # The killed attempts' own saves are in their history, once each.
    durable = [(e.attempt, e.data.get("kind", "state"), e.data.get("step"), e.data["id"])
               for e in events if e.type == "checkpoint" and e.data.get("phase") == "durable"]
    assert {(1, "state", 59), (2, "sync", 79)} <= {d[:3] for d in durable}, durable
    assert len({d[3] for d in durable}) == len(durable), durable
    # Every line printed, once, in `spotnb logs`.
    capsys.readouterr()
    assert cli.main(["logs", handle.job_id]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("step ")]
    assert printed == [f"step {s} w={sum(range(s + 1))}.0" for s in range(steps)]
    wait_no_processes(cloud)
