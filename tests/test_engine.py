"""End to end on the local cloud: real supervisor, real agents, real kernels.

Each test submits real training code through the public API and checks what a user
would notice: the result, the history, the cost, the processes left behind.
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
from typing import Any

import psutil
import pytest
from helpers import run_uninterrupted, wait_until

import spotnb
from spotnb.protocol import layout
from spotnb.protocol.events import Event
from spotnb.protocol.events.fold import EndReason, JobState, fold
from spotnb.protocol.spec import SpecError

pytestmark = pytest.mark.slow

TORCH_TRAINING = textwrap.dedent("""
    import hashlib, time
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
    ckpt = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched)
    start = ckpt.restore()
    for step in range(start, STEPS):
        idx = torch.randint(0, len(X), (64,))
        loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        spot.log(step, loss=loss.item())
        time.sleep(STEP_SECONDS)
        ckpt.maybe_save(step)
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    accuracy = (model(X).argmax(1) == y).float().mean().item()
    print(f"accuracy {accuracy:.3f}")
""")

PYTHON_TRAINING = textwrap.dedent("""
    import random, time

    random.seed(1)
    state = {"w": [0.0] * 8}
    ckpt = spot.Checkpoint(state=state)
    start = ckpt.restore()
    w = state["w"]
    for step in range(start, STEPS):
        i = random.randrange(len(w))
        w[i] += random.gauss(0, 1) * 0.1
        spot.log(step, norm=sum(x * x for x in w))
        time.sleep(STEP_SECONDS)
        ckpt.maybe_save(step)
    weights = list(w)
""")


@pytest.fixture
def cloud(spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The local cloud with a short notice period and no simulated hazard."""
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    return spotnb_home


def follow(handle: spotnb.JobHandle, on_event: Callable[[Event], None],
           timeout: float = 240) -> list[Event]:
    """Follow a job's events to the end, calling ``on_event`` for each."""
    seen = []
    for event in handle.events(timeout=timeout):
        seen.append(event)
        on_event(event)
    return seen


def steps_by_attempt(events: list[Event]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if e.type == "metric":
            out.setdefault(e.attempt, []).append(e.data["step"])
    return out


def live_processes(home: Path) -> list[psutil.Process]:
    procs = []
    for p in psutil.process_iter(["environ", "cmdline"]):
        try:
            if (p.info["environ"] or {}).get("SPOTNB_HOME") == str(home) \
                    and p.pid != os.getpid():
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return procs


def wait_no_processes(home: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while live_processes(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_processes(home), "the instance or its group outlived the job"


class Interrupter:
    """Delivers notices from the outside at chosen moments of a job."""

    def __init__(self, handle: spotnb.JobHandle) -> None:
        self.handle = handle
        self.delivered: list[tuple[int, str]] = []

    def __call__(self, event: Event, why: str) -> None:
        if any(a == event.attempt for a, _ in self.delivered):
            return  # one notice per attempt
        self.delivered.append((event.attempt, why))
        threading.Thread(target=self.handle.interrupt, daemon=True).start()


def test_torch_training_with_three_interruptions_is_bitwise_identical(
        cloud: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inputs = {"STEPS": 160, "STEP_SECONDS": 0.03}
    common = dict(instance_types=["g4dn.xlarge"], inputs=inputs,
                  outputs=["digest", "accuracy"], checkpoint_every="20 steps")

    # The uninterrupted run: the same code in a plain process (no job), beside the
    # interrupted one.
    baseline: dict[str, Any] = {}
    uninterrupted = threading.Thread(target=lambda: baseline.update(run_uninterrupted(
        TORCH_TRAINING, {**inputs, "STEP_SECONDS": 0}, ["digest", "accuracy"], tmp_path)))
    uninterrupted.start()

    # Attempt 2 is interrupted while a checkpoint uploads: the cell itself asks the
    # local cloud for the notice right after its first save starts (the notice then
    # lands within a second), over a network slow enough that the upload takes
    # seconds (about 5.5 s for this state). The notice period leaves the forced save
    # time to upload beside it: the instance's link is shared by its uploads, so the
    # forced save is durable after up to two uploads' worth (about 11 s), then commits.
    # Only attempt 2's instance has the slow link (the kernel's uploads read the
    # setting as they start): at 0.01 MB/s everywhere every other save took 5.5 s too,
    # the forced ones 11 s (the test took 65 s, 37 s of it in those uploads).
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "20")
    during_upload = TORCH_TRAINING.replace("start = ckpt.restore()\n", (
        "start = ckpt.restore()\n"
        "if spot.attempt == 2:\n"
        "    import os\n"
        "    os.environ['SPOTNB_LOCAL_UPLOAD_MBPS'] = '0.01'\n")).replace(
        "    ckpt.maybe_save(step)\n", (
        "    if ckpt.maybe_save(step) and spot.attempt == 2 and not spot.interrupt_pending:\n"
        "        from spotnb.providers.local import LocalProvider\n"
        "        if not globals().get('_asked'):\n"
        "            _asked = True\n"
        "            LocalProvider().interrupt(spot.job_id)\n"))
    assert during_upload.count("spot.attempt == 2") == 2
    handle = spotnb.submit(during_upload, name="interrupted", **common)
    interrupt = Interrupter(handle)
    in_flight: dict[int, str] = {}

    def on_event(e: Event) -> None:
        if e.type == "checkpoint" and e.data.get("phase") == "begin":
            in_flight[e.attempt] = e.data["id"]
        if e.type == "checkpoint" and e.data.get("phase") == "durable":
            in_flight.pop(e.attempt, None)
        if e.type == "notice" and e.attempt == 2 and e.data["kind"] == "instance-action":
            interrupt.delivered.append((2, "during an upload"))
        if e.type != "metric" or e.attempt == 2:
            return
        if e.attempt in (1, 3) and e.data["step"] >= 25 * e.attempt:
            interrupt(e, "between checkpoints")

    events = follow(handle, on_event)
    result = handle.wait(timeout=60)
    uninterrupted.join(timeout=300)
    assert baseline, "the uninterrupted run failed (see the output)"
    assert [why for _, why in interrupt.delivered] == [
        "between checkpoints", "during an upload", "between checkpoints"]
    assert result.status == "completed", (result.reason, result.error)
    assert result.interruptions == 3
    assert len(result.attempts) == 4
    assert [a.end_reason for a in result.attempts] == [
        "interrupted", "interrupted", "interrupted", "completed"]
    # Bitwise: the same weights as the run that was never interrupted.
    assert result.outputs["digest"] == baseline["digest"]
    assert result.outputs["accuracy"] == baseline["accuracy"] > 0.8
    # With a notice and steps much shorter than it, no step is done twice.
    by_attempt = steps_by_attempt(events)
    steps = [s for attempt in by_attempt.values() for s in attempt]
    assert sorted(steps) == list(range(160)), (
        {a: (min(s), max(s)) for a, s in by_attempt.items() if s},
        [(e.attempt, e.data) for e in events if e.type == "metric"
         and steps.count(e.data["step"]) > 1])
    # The notice of attempt 2 landed between a checkpoint's begin and its durability.
    a2 = [e for e in events if e.attempt == 2 and e.type in ("checkpoint", "notice")]
    kinds = [(e.type, e.data.get("phase")) for e in a2]
    notice_at = kinds.index(("notice", None))
    assert ("checkpoint", "begin") in kinds[:notice_at]
    assert kinds[notice_at - 1] == ("checkpoint", "begin") or \
        kinds[:notice_at].count(("checkpoint", "begin")) > \
        kinds[:notice_at].count(("checkpoint", "durable"))
    assert result.cost_usd > 0 and result.ondemand_cost_usd > result.cost_usd
    wait_no_processes(cloud)


def test_pure_python_training_survives_interruptions(cloud: Path, tmp_path: Path) -> None:
    inputs = {"STEPS": 160, "STEP_SECONDS": 0.05}  # time for three interruptions
    handle = spotnb.submit(PYTHON_TRAINING, simulate_interruptions=3, inputs=inputs,
                           outputs=["weights"], checkpoint_every="10 steps")
    baseline = run_uninterrupted(PYTHON_TRAINING, {**inputs, "STEP_SECONDS": 0},
                                 ["weights"], tmp_path)
    result = handle.wait(timeout=180)
    assert result.status == "completed", (result.reason, result.error)
    assert result.interruptions == 3
    assert result.outputs["weights"] == baseline["weights"]
    assert result.metrics["norm"] == baseline["metrics"]["norm"]
    wait_no_processes(cloud)


def test_the_agent_logs_a_recommendation_when_it_came_before_any_notice(
        cloud: Path) -> None:
    # A recommendation at launch and no interruption after it (a false alarm); then an
    # interruption asked for, once the agent has logged the recommendation.
    handle = spotnb.submit(PYTHON_TRAINING, inputs={"STEPS": 100_000, "STEP_SECONDS": 0.05},
                           checkpoint_every="1000 steps",
                           simulate_signals={"false_alarms": [0], "false_alarm": 0})

    def notices() -> list[tuple[int, str]]:
        return [(e.attempt, e.data["kind"]) for e in handle.events(follow=False)
                if e.type == "notice"]

    try:
        wait_until(notices, 60, "the agent to log the recommendation")
        assert notices() == [(1, "rebalance")]
        handle.interrupt()
        wait_until(lambda: len(notices()) > 1, 60, "the agent to log the notice")
    finally:
        handle.stop()
    assert notices()[:2] == [(1, "rebalance"), (1, "instance-action")]
    reasons = [e.data["reason"] for e in handle.events(follow=False)
               if e.attempt == 0 and e.type == "instance" and e.data["action"] == "rebalance"]
    assert reasons[:2] == ["false-alarm", "requested"]
    assert handle.wait(timeout=60).status == "stopped"
    wait_no_processes(cloud)


def test_hard_kill_redoes_at_most_the_steps_since_the_last_checkpoint(cloud: Path) -> None:
    # The first attempt's uploads take about a second each (its simulated link; the
    # kernel's uploads read the setting as they start), and its steps 0.03 s: the kill
    # finds an upload in flight. The replacement saves at disk speed and does not pause
    # (the pauses and uploads were 4.5 s of its 120 steps).
    slow_first = TORCH_TRAINING.replace("start = ckpt.restore()\n", (
        "start = ckpt.restore()\n"
        "if spot.attempt == 1:\n"
        "    import os\n"
        "    os.environ['SPOTNB_LOCAL_UPLOAD_MBPS'] = '0.05'\n"
        "else:\n"
        "    STEP_SECONDS = 0\n"))
    assert slow_first != TORCH_TRAINING
    inputs = {"STEPS": 150, "STEP_SECONDS": 0.03}
    handle = spotnb.submit(slow_first, inputs=inputs, outputs=["digest"],
                           checkpoint_every="30 steps")
    killed: list[int] = []
    sockets: list[Path] = []  # the killed agent's socket directory
    durable: dict[int, int] = {}
    in_flight: dict[int, bool] = {}

    def on_event(e: Event) -> None:
        if e.type == "checkpoint" and e.data.get("phase") == "durable":
            durable[e.attempt] = e.data["step"]
            in_flight[e.attempt] = False
        if e.type == "checkpoint" and e.data.get("phase") == "begin":
            in_flight[e.attempt] = True
        # Kill the whole instance (agent and kernel, no notice) mid-upload of its
        # second checkpoint.
        if not killed and e.attempt == 1 and in_flight.get(1) and 1 in durable:
            boot = next(x for x in events_so_far if x.attempt == 1
                        and x.type == "status" and x.data.get("state") == "booting")
            agent = psutil.Process(boot.data["pid"])
            sockets.append(Path(agent.environ()["SPOTNB_AGENT_SOCKET_DIR"]))
            assert sockets[0].is_dir()
            for p in [*agent.children(recursive=True), agent]:
                p.send_signal(signal.SIGKILL)
            killed.append(durable[1])

    events_so_far: list[Event] = []

    def record(e: Event) -> None:
        events_so_far.append(e)
        on_event(e)

    follow(handle, record)
    result = handle.wait(timeout=60)
    assert result.status == "completed", (result.reason, result.error)
    assert killed, "the test never found an upload in flight"
    by_attempt = steps_by_attempt(events_so_far)
    # The replacement resumed from the last *complete* checkpoint, not the one cut off.
    assert by_attempt[2][0] == killed[0] + 1
    # Redone: exactly the steps the killed attempt did after its last complete
    # checkpoint, never more.
    redone = set(by_attempt[1]) & set(by_attempt[2])
    assert redone == {s for s in by_attempt[1] if s > killed[0]}
    assert [a.end_reason for a in result.attempts] == ["lost", "completed"]
    wait_no_processes(cloud)
    # The killed agent's socket directory (its kernel's connection file, with the
    # kernel's key) went with its instance; no `spotnb cleanup` needed.
    assert not sockets[0].exists()


SUBMIT_AND_EXIT = """
import spotnb, sys
h = spotnb.submit(sys.argv[1], inputs={"STEPS": 80, "STEP_SECONDS": 0.03},
                  outputs=["weights"], checkpoint_every="10 steps",
                  simulate_interruptions=1)
print(h.job_id)
"""


def test_job_completes_after_the_submitting_process_exits(cloud: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SUBMIT_AND_EXIT, PYTHON_TRAINING],
                         capture_output=True, text=True, timeout=120, check=True)
    job_id = out.stdout.strip()
    result_file = cloud / "store" / "jobs" / job_id / layout.RESULT
    # Nobody attached: only watch the file the agent writes at the end.
    deadline = time.monotonic() + 180
    while not result_file.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert json.loads(result_file.read_text())["status"] == "completed"
    handle = spotnb.attach(job_id)
    events = list(handle.events(follow=False))
    assert sum(1 for e in events if e.type == "notice"
               and e.data["kind"] == "instance-action") == 1
    assert sorted({s for v in steps_by_attempt(events).values() for s in v}) == list(range(80))
    result = handle.wait(timeout=30)
    assert result.status == "completed" and len(result.outputs["weights"]) == 8
    assert [r.job_id for r in spotnb.jobs()] == [job_id]
    wait_no_processes(cloud)


def test_jobs_lists_an_ended_job_from_its_cache_until_its_log_changes(cloud: Path) -> None:
    from spotnb.protocol.events import EventWriter

    handle = spotnb.submit("x = 1")
    assert handle.wait(timeout=120).status == "completed"
    wait_no_processes(cloud)  # the group has written its last events
    (row,) = spotnb.jobs()
    assert (row.job_id, row.status, row.attempts) == (handle.job_id, "completed", 1)
    cache = cloud / "index" / "listing" / f"{handle.job_id}.json"
    cached = json.loads(cache.read_text())
    assert cached["row"]["cost_usd"] == row.cost_usd > 0
    # The listing comes from the cache while the log is unchanged...
    cached["row"]["status"] = "from-the-cache"
    cache.write_text(json.dumps(cached))
    assert [r.status for r in spotnb.jobs()] == ["from-the-cache"]
    # ...and from the events again once anything is added to it.
    late = EventWriter(handle.store, 0, None)
    late.emit("status", state="completed", detail="a late event")
    late.close()
    (again,) = spotnb.jobs()
    assert again.status == "completed" and again.attempts == 1


def test_user_error_fails_with_the_remote_traceback_and_no_retry(cloud: Path) -> None:
    code = "x = 1\ny = 2\nraise ValueError('bad batch size')\n"
    handle = spotnb.submit(code)
    result = handle.wait(timeout=120)
    assert result.status == "failed"
    assert result.error is not None and result.error["ename"] == "ValueError"
    tb = "\n".join(result.error["traceback"])
    assert "bad batch size" in tb and "line 3" in tb
    assert len(result.attempts) == 1
    wait_no_processes(cloud)
    # The cost wait() reports right after the end is the final one, not the cost
    # before the group billed the instance's last moments.
    assert result.cost_usd == handle.summary().cost_usd


def test_a_kernel_that_dies_fails_the_job_with_its_exit_reason(
        cloud: Path, tmp_path: Path) -> None:
    # What the out-of-memory killer does to a kernel; a child it started goes with it.
    # The kernel dies once the test has seen its output arrive (not after a sleep).
    go = tmp_path / "go"
    code = textwrap.dedent(f"""
        import os, pathlib, signal, subprocess, time
        child = subprocess.Popen(["sleep", "300"])
        print("started", child.pid, flush=True)
        deadline = time.monotonic() + 120
        while not pathlib.Path({str(go)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    handle = spotnb.submit(code)
    live = handle.events(timeout=120)
    started = next((e for e in live if e.type == "stream"
                    and e.data["text"].startswith("started")), None)
    live.close()
    assert started is not None, "the cell's output never arrived"
    go.touch()
    result = handle.wait(timeout=120)
    assert result.status == "failed"
    assert result.error is not None and result.error["ename"] == "KernelDied"
    assert "killed by signal 9 SIGKILL (out of memory?)" in result.error["evalue"]
    assert len(result.attempts) == 1
    child = int(started.data["text"].split()[1])
    wait_no_processes(cloud)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_user_error_retried_when_the_policy_allows(cloud: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # The save before the error takes 2 s to upload (the instance's simulated
    # bandwidth): it is durable before the error is recorded, and the retry resumes
    # from it (it was cut off with the kernel, and the retry failed the same way).
    monkeypatch.setenv("SPOTNB_LOCAL_UPLOAD_MBPS", "0.5")
    code = textwrap.dedent("""
        tries = {"n": 0}
        ckpt = spot.Checkpoint(tries=tries, padding=bytes(1_000_000))
        ckpt.restore()
        tries["n"] += 1
        ckpt.save(0)
        if tries["n"] < 2:
            raise RuntimeError("flaky data loader")
        answer = tries["n"]
    """)
    result = spotnb.submit(code, max_restarts_on_error=1, outputs=["answer"]).wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs["answer"] == 2
    assert [a.end_reason for a in result.attempts] == ["error (retried)", "completed"]
    wait_no_processes(cloud)


def test_two_agents_on_one_job_only_one_works(cloud: Path, tmp_path: Path) -> None:
    from spotnb.protocol.spec import JobSpec, Policy, Resources
    from spotnb.protocol.store import LocalStore

    store = LocalStore(tmp_path / "job")
    spec = JobSpec(job_id="j-two", name="two", code="import time\ntime.sleep(3)\nvalue = 42",
                   provider="local", resources=Resources(("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time(), outputs=("value",))
    store.put(layout.INPUTS, __import__("cloudpickle").dumps({}))
    store.put(layout.SPEC, spec.to_json().encode())
    env = {**os.environ, "SPOTNB_IMDS_ENDPOINT": "http://127.0.0.1:9"}  # no IMDS here
    agents = [subprocess.Popen([sys.executable, "-m", "spotnb.kernel_remote", "--job",
                                store.uri], cwd=tmp_path, env=env,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = [a.communicate(timeout=120)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], logs
    assert store.list_children("events/") == ["000001"], "exactly one attempt was written"
    assert json.loads(store.get(layout.RESULT))["status"] == "completed"
    assert json.loads(store.get(layout.LEASE))["epoch"] == 1


def test_bad_input_is_refused_before_anything_starts(cloud: Path) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"code": "for i in range(3)\n    pass"}, "does not compile"),
        ({"code": "x = 1", "instance_types": ["g9.superlarge"]}, "g9.superlarge"),
        ({"code": "x = 1", "max_price": 0}, "max_price"),
        ({"code": "x = 1", "inputs": {"lock": threading.Lock()}}, "'lock'"),
        ({"code": "x = 1", "provider": "gcp"}, "unknown provider"),
    ]
    for kwargs, words in cases:
        with pytest.raises(SpecError, match=words):
            spotnb.submit(**kwargs)  # type: ignore[arg-type]
    assert not (cloud / "store" / "jobs").exists() or \
        not list((cloud / "store" / "jobs").iterdir())
    assert not live_processes(cloud)


SEES = textwrap.dedent("""
    import os
    seen = {name: os.environ.get(name) for name in NAMES}
""")


def test_an_instance_sees_what_an_aws_instance_sees(
        cloud: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's credentials and settings stay on the user's side, as they would with
    # an EC2 instance (which has only the job's role); variables passed on purpose come.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + "Q" * 16)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t" * 7)
    monkeypatch.setenv("MY_PROJECT_SETTING", "only-here")
    monkeypatch.setenv("HF_TOKEN", "hf_" + "t" * 30)
    names = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MY_PROJECT_SETTING", "HF_TOKEN",
             "WANDB_MODE", "SPOTNB_HOME", "PATH", "HOME"]
    handle = spotnb.submit(SEES, inputs={"NAMES": names}, outputs=["seen"],
                           env={"WANDB_MODE": "offline", "HF_TOKEN": None})
    result = handle.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    seen = result.outputs["seen"]
    assert seen["AWS_ACCESS_KEY_ID"] is None and seen["AWS_SECRET_ACCESS_KEY"] is None
    assert seen["MY_PROJECT_SETTING"] is None
    assert seen["WANDB_MODE"] == "offline"  # a value, from the spec
    assert seen["HF_TOKEN"] == "hf_" + "t" * 30  # a name: this machine's value
    assert seen["SPOTNB_HOME"] == str(cloud) and seen["PATH"] and seen["HOME"]
    # A variable passed by name is not written into the spec (only its name is).
    spec = handle.store.get(layout.SPEC).decode()
    assert '"HF_TOKEN": null' in spec and "hf_ttt" not in spec
    wait_no_processes(cloud)


CHECKPOINTS_WITHOUT_METRICS = textwrap.dedent("""
    import time
    state = {"step": 0}
    ckpt = spot.Checkpoint(state=state)
    ckpt.restore()
    while state["step"] < STEPS:
        state["step"] += 1
        time.sleep(0.1)
        ckpt.maybe_save(state["step"])
    done = state["step"]
""")


def test_simulated_interruptions_need_no_spot_log(cloud: Path) -> None:
    # The cell checkpoints but never logs a metric: it is interrupted all the same.
    handle = spotnb.submit(CHECKPOINTS_WITHOUT_METRICS, inputs={"STEPS": 50},
                           outputs=["done"], checkpoint_every="10 steps",
                           simulate_interruptions=1)
    result = handle.wait(timeout=180)
    assert result.status == "completed", (result.reason, result.error)
    assert result.interruptions == 1 and len(result.attempts) == 2
    assert result.outputs["done"] == 50
    wait_no_processes(cloud)


QUIET_THEN_TICKING = textwrap.dedent("""
    import time
    time.sleep(PAUSE)  # imports, data loading: nothing to show yet
    for i in range(TICKS):
        print(f"tick {i}", flush=True)
        time.sleep(0.2)
""")


def test_a_cell_without_checkpoints_is_interrupted_after_it_shows_output(
        cloud: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Counted from the cell's first output, not from the instance's start: slow imports
    # on a busy machine do not use up the time before the interruption.
    monkeypatch.setenv("SPOTNB_LOCAL_INTERRUPT_AFTER", "3")
    handle = spotnb.submit(QUIET_THEN_TICKING, inputs={"PAUSE": 2, "TICKS": 30},
                           simulate_interruptions=1)
    result = handle.wait(timeout=180)
    assert result.status == "completed", (result.reason, result.error)
    assert result.interruptions == 1
    events = list(handle.events(follow=False))
    notice = next(e for e in events if e.type == "notice" and e.attempt == 1)
    first_tick = next(e for e in events if e.type == "stream" and e.attempt == 1)
    assert notice.time >= first_tick.time + 3
    wait_no_processes(cloud)


GATED_TRAINING = textwrap.dedent("""
    import os, time

    state = {"w": 0.0}
    ckpt = spot.Checkpoint(state=state)
    for step in range(ckpt.restore(), STEPS):
        state["w"] += 1.0
        spot.log(step, w=state["w"])
        ckpt.maybe_save(step)
        while step == GATE_STEP and not os.path.exists(GATE):
            time.sleep(0.05)
        time.sleep(0.05)
""")


@pytest.mark.timeout(300)
def test_a_standby_whose_prefetch_fails_still_runs_the_cell_with_its_inputs(
        cloud: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standby's checkpoint download fails (here: every checkpoint damaged, as a full
    disk or a bad object would): it still bootstraps its kernel and says it is ready,
    and after the takeover the cell runs with the job's inputs from the final save.
    (Before, the warm-up gave up with its kernel connected but never bootstrapped, and
    the cell ran there without its inputs: a NameError.)"""
    from spotnb.providers.local import LocalProvider

    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "30")  # the final save waits on us
    gate = tmp_path / "gate"
    handle = spotnb.submit(GATED_TRAINING, checkpoint_every="1 steps",
                           standby_first_hour=True,
                           inputs={"STEPS": 12, "GATE": str(gate), "GATE_STEP": 3})
    store_root = Path(handle.store.root)
    try:
        # Step 3 saved and durable (read in the store: the log is written once a
        # minute); the cell waits at its gate, so no save comes after.
        from spotnb.ckpt.checkpoints import CHECKPOINT_FORMATS, CheckpointStore

        ckpts = CheckpointStore(handle.store, prefix=layout.CHECKPOINTS,
                                formats=CHECKPOINT_FORMATS)
        newest = wait_until(lambda: (m := ckpts.latest()) is not None and m.step == 3 and m,
                            120, "the checkpoint of step 3")
        # Its data damaged (the standby prefetches the newest; older ones are being
        # pruned meanwhile and are left alone).
        for entry in newest.files:
            (store_root / layout.CHECKPOINTS / newest.id / entry.name).write_bytes(b"damaged")
        LocalProvider().recommend(handle.job_id)

        def standby_ready() -> bool:
            return any(e.attempt == 0 and e.type == "instance"
                       and e.data.get("action") == "standby-ready"
                       for e in handle.events(follow=False))

        wait_until(standby_ready, 120, "the standby ready despite its failed prefetch")
        gate.touch()  # the old cell goes on: its final save, then the takeover
        result = handle.wait(timeout=120)
    finally:
        gate.touch()
        handle.stop()
    assert result.status == "completed", (result.reason, result.error)
    state = fold(handle.events(follow=False))
    (sb,) = state.standbys.values()
    assert sb.attempt == 2 and state.attempts[2].last_step == 11
    assert state.breaks()[0].reason is EndReason.MOVED
    wait_no_processes(cloud)


@pytest.mark.timeout(150)
def test_a_warm_standby_takes_the_job_over_once_ready_with_no_step_redone(
        cloud: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rebalance recommendation once the first attempt has checkpoints: the group
    # starts a standby and, once it is ready, ends the old instance through its
    # termination hook (Auto Scaling's capacity rebalancing): the old agent saves and
    # releases the lease, and the standby trains on from that save.
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "20")
    handle = spotnb.submit(PYTHON_TRAINING, inputs={"STEPS": 100_000, "STEP_SECONDS": 0.05},
                           checkpoint_every="10 steps", standby_first_hour=True,
                           simulate_signals={"false_alarms": [8], "false_alarm": 0})
    state = JobState()

    def trained_after_takeover() -> bool:
        return any(sb.restored is not None and (state.attempts[sb.attempt].last_step or 0)
                   > (state.attempts[sb.attempt].first_step or 0) + 5
                   for sb in state.standbys.values() if sb.attempt is not None)

    try:
        for e in handle.events(timeout=120):  # followed: the log is written live
            state.apply(e)
            if trained_after_takeover():
                break
    finally:
        handle.stop()
    assert handle.wait(timeout=60).status == "stopped"
    assert trained_after_takeover()
    events = list(handle.events(follow=False))
    state = fold(events)

    def group(action: str) -> list[Event]:
        return [e for e in events if e.attempt == 0 and e.type == "instance"
                and e.data.get("action") == action]

    (sb,) = state.standbys.values()
    first = group("launched")[0].data["instance_id"]
    assert sb.standby_for == first and not group("notice")  # no interruption came
    (moved,) = [e for e in group("terminated") if e.instance == first]
    assert moved.data["reason"] == "rebalanced"
    # Warm before the old instance ended: its kernel started, its cell waited at restore().
    assert sb.kernel_started is not None and sb.kernel_started < moved.time
    assert sb.ready is not None and sb.given_back is None
    assert sb.attempt == 2 and [b.redone for b in state.breaks()] == [0], state.breaks()
    assert state.breaks()[0].resumed_at == state.breaks()[0].step + 1
    # A move, not an interruption: the job left the instance before EC2 took it.
    assert state.breaks()[0].reason is EndReason.MOVED and state.interruptions() == 0
    handover = state.handover_seconds(sb)
    assert handover is not None and handover < 30
    assert [text for _, text in sb.story(state)] == [
        "rebalance recommendation: standby booting", "standby ready",
        f"handed over in {handover:.1f} s"]
    assert len(group("launched")) == 2  # no replacement besides the standby
    wait_no_processes(cloud)


def _stopped_by_the_record(handle: spotnb.JobHandle, gate: Path) -> None:
    """Write the job's stop request, the record only (no control message: as its agent
    finds it at its next look), open ``gate`` (the kernel's end follows) and check the
    job ended stopped, for the request's reason."""
    handle.store.put_if_absent(layout.STOP, json.dumps(
        {"reason": "user", "detail": "by the test", "time": time.time(),
         "by": "test"}).encode())
    gate.touch()
    result = handle.wait(timeout=120)
    assert result.status == "stopped", (result.status, result.reason)
    assert "by the test" in result.reason


def test_a_cell_that_ends_in_an_error_after_a_stop_request_is_stopped(
        cloud: Path, tmp_path: Path) -> None:
    # A stop can end the cell before the agent read the request (the group ending the
    # instance, or a stop whose message never came: the agent reads stop.json once a
    # minute). The job was stopped: its result says so, not the error that followed.
    gate = tmp_path / "gate"
    code = textwrap.dedent(f"""
        import os, time
        print("waiting", flush=True)
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.05)
        raise RuntimeError("the kernel went with the instance")
    """)
    handle = spotnb.submit(code, name="stopped-then-died")
    seen = threading.Event()
    threading.Thread(target=follow, daemon=True, args=(
        handle, lambda e: seen.set() if e.type == "stream" else None)).start()
    assert seen.wait(120), "the cell never started"
    _stopped_by_the_record(handle, gate)


def test_a_kernel_that_dies_starting_after_a_stop_request_is_stopped(
        cloud: Path, tmp_path: Path) -> None:
    # A stop's interrupt can reach a kernel still starting (before IPython's SIGINT
    # handler: it dies of the signal), or the instance's end can take it: the job was
    # stopped, not "failed: the kernel could not start" (a sweep stopped elsewhere read
    # its trial failed so). The kernel is held at its start by the job's own
    # sitecustomize until the stop request is in the store, then dies.
    hook = tmp_path / "hook"
    hook.mkdir()
    started, gate = tmp_path / "kernel-starting", tmp_path / "gate"
    (hook / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, signal, time
        open({str(started)!r}, "w").close()
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # before IPython: KeyboardInterrupt ends it
    """))
    handle = spotnb.submit("print('never')", name="stopped-while-starting",
                           env={"PYTHONPATH": str(hook)})
    wait_until(started.exists, 120, "the job's kernel to start")
    _stopped_by_the_record(handle, gate)
    wait_no_processes(cloud)
