"""Randomized fault schedules against real jobs on the local cloud (issue 12).

Each schedule is drawn from a seed: a handful of faults at random moments of a job's
life, among

* ``agent``: SIGKILL the job's agent (the instance's kernel dies with it);
* ``kernel``: SIGKILL the kernel (what the out-of-memory killer does; the job's policy
  retries it in place, ``max_restarts_on_error``);
* ``freeze``: SIGSTOP the agent for a few seconds, then SIGCONT;
* ``supervisor``: SIGKILL the local cloud's supervisor (the next look at the job
  restarts it);
* ``store``: every write to the store fails (read-only or full) for a few seconds;
* ``notice``: a spot interruption notice;
* ``save-kill``: SIGKILL the agent as soon as the next save is durable, a
  ``spot.Checkpoint`` or a synced directory's snapshot (what the framework
  integrations save): the log lacks what the steps before it logged and printed,
  which the save carries.

After the schedule the job must complete, and:

* its result is bitwise the result of the same code run without faults;
* every metric step and every printed line is in the log (invariant 8);
* no attempt wrote to its stream after the next attempt took the lease (invariant 3,
  as the local store's file times show);
* no process is left behind (the ``spotnb_home`` fixture checks it).

CI runs FAST_SEEDS; ``SPOTNB_FAULT_SOAK=N pytest tests/faults -m soak`` runs N more
seeds (by hand; benchmarks/RESULTS.md has the figures of the last soak).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

import spotnb
from spotnb.events import Event, parse_chunk
from spotnb.events.live import Follower
from spotnb.events.writer import StreamObject, read_object
from spotnb.providers.local import LocalProvider
from spotnb.store import LocalStore, NotFound
from spotnb.syncdir import sync_name

pytestmark = pytest.mark.slow

FAST_SEEDS = (11, 23, 37)
SOAK = int(os.environ.get("SPOTNB_FAULT_SOAK", "0"))
STEPS = 240
KINDS = ("agent", "kernel", "freeze", "supervisor", "store", "notice", "save-kill")
# A save-kill waits at most this long for the next save to be durable.
SAVE_WAIT_SECONDS = 60.0

# Two savers, as a cell with a framework has: spot.Checkpoint (the job's policy: every
# 20 steps) and a synced directory the code writes its own state to (steps 9, 29, ...;
# a framework's integration snapshots it so); it resumes from the newer.
CELL = """
import json, os, random, time
random.seed(5)
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
        version, internal, gauss = snap["rng"]
        random.setstate((version, tuple(internal), gauss))
for step in range(start, STEPS):
    state["w"] += random.random()
    spot.log(step, w=state["w"])
    print(f"step {step}")
    time.sleep(0.03)
    ckpt.maybe_save(step)
    if step % 20 == 9:
        with open(saved + ".tmp", "w") as f:
            json.dump({"step": step, "w": state["w"], "rng": random.getstate()}, f)
        os.replace(saved + ".tmp", saved)
        out.save(step)
total = state["w"]
"""


def expected_total() -> float:
    """The job's result without any fault: the same loop, here."""
    rng = random.Random(5)
    w = 0.0
    for _ in range(STEPS):
        w += rng.random()
    return w


@dataclasses.dataclass
class Fault:
    at: float  # seconds after the job's first metric
    kind: str
    duration: float = 0.0


def draw(seed: int) -> list[Fault]:
    rng = random.Random(seed)
    faults = [Fault(at=rng.uniform(0.5, 6.0), kind=rng.choice(KINDS),
                    duration=rng.uniform(1.0, 10.0)) for _ in range(rng.randint(2, 4))]
    return sorted(faults, key=lambda f: f.at)


class Attacker:
    """Applies a schedule to a running job, finding its processes as they are now."""

    def __init__(self, handle: spotnb.JobHandle, switch: Path) -> None:
        self.handle = handle
        self.switch = switch
        self.provider = LocalProvider()
        self.events: list[Event] = []
        self.done: list[str] = []

    def agent(self) -> psutil.Process | None:
        boots = [e for e in self.events if e.type == "status"
                 and e.data.get("state") == "booting"]
        for boot in reversed(boots):
            try:
                proc = psutil.Process(boot.data["pid"])
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    return proc
            except (psutil.Error, KeyError):
                continue
        return None

    def latest(self) -> tuple[bytes | None, ...]:
        """The LATEST pointers of the job's checkpoints and synced directory."""
        found = []
        for key in ("checkpoints/LATEST", f"sync/{sync_name('out')}/LATEST"):
            try:
                found.append(self.handle.store.get(key))
            except NotFound:
                found.append(None)
        return tuple(found)

    def apply(self, fault: Fault) -> None:
        if fault.kind == "save-kill":
            before = self.latest()
            deadline = time.monotonic() + SAVE_WAIT_SECONDS
            while self.latest() == before and time.monotonic() < deadline:
                time.sleep(0.02)  # a condition: the next save is durable
        agent = self.agent()
        if fault.kind in ("agent", "save-kill") and agent is not None:
            agent.kill()
        elif fault.kind == "kernel" and agent is not None:
            for child in agent.children():
                if any("ipykernel" in part for part in child.cmdline()):
                    child.kill()
        elif fault.kind == "freeze" and agent is not None:
            agent.suspend()
            time.sleep(fault.duration)  # the length of the freeze being staged
            agent.resume()
        elif fault.kind == "supervisor":
            group = self.provider.group(self.handle.job_id)
            if group is not None and group["alive"]:
                os.kill(group["supervisor"]["pid"], signal.SIGKILL)
        elif fault.kind == "store":
            self.switch.write_text(random.choice(["read-only", "full"]))
            time.sleep(fault.duration)  # the length of the outage being staged
            self.switch.unlink()
        elif fault.kind == "notice":
            try:
                self.handle.interrupt()
            except Exception:
                return  # no instance right now (between two): nothing to interrupt
        self.done.append(fault.kind)


def run_schedule(seed: int, home: Path, switch: Path) -> None:
    schedule = draw(seed)
    # A killed kernel fails its attempt like an error in the cell (it is what the
    # out-of-memory killer does); the policy retries those here.
    handle = spotnb.submit(CELL, inputs={"STEPS": STEPS}, outputs=["total"],
                           checkpoint_every="20 steps", max_restarts_on_error=len(schedule))
    attacker = Attacker(handle, switch)
    started: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        with Follower(handle.store, handle.job_id) as follower:
            while not stop.is_set() and not follower.ended:
                for e in follower.poll(wait=0.5):
                    attacker.events.append(e)
                    if e.type == "metric" and not started:
                        started.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for fault in schedule:
            while not started and watcher.is_alive():
                time.sleep(0.05)
            if not started:
                break  # the job ended before it logged (it cannot here, but be safe)
            delay = started[0] + fault.at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the moment of the fault, drawn from the seed
            attacker.apply(fault)
    finally:
        if switch.exists():
            switch.unlink()
    result = spotnb.attach(handle.job_id).wait(timeout=600)
    stop.set()
    watcher.join(timeout=30)
    context = f"seed {seed}: {[(f.kind, round(f.at, 1)) for f in schedule]}"
    assert result.status == "completed", (context, result.reason, result.error)
    assert result.outputs["total"] == expected_total(), context
    events = list(handle.events(follow=False))
    steps = {e.data["step"] for e in events if e.type == "metric"}
    assert steps == set(range(STEPS)), (context, sorted(set(range(STEPS)) - steps))
    printed = {line for e in events if e.type == "stream"
               for line in str(e.data.get("text", "")).splitlines()}
    unprinted = [s for s in range(STEPS) if f"step {s}" not in printed]
    assert unprinted == [], (context, "lines missing", unprinted)
    # No attempt wrote after the next one took over (the files' times tell).
    store = LocalStore(handle.store.uri.removeprefix("file://"))
    boots = {e.attempt: e.time for e in events if e.type == "status"
             and e.data.get("state") == "booting"}
    for attempt in sorted(boots):
        successor = boots.get(attempt + 1)
        if successor is None:
            continue
        late = [k for k in store.list_keys(f"events/{attempt:06d}/")
                if (store.root / k).stat().st_mtime > successor + 1.0
                and not replayed(store, k, attempt)]
        assert late == [], (context, attempt, late)


def replayed(store: LocalStore, key: str, attempt: int) -> bool:
    """Whether a chunk of ``attempt``'s stream holds only what a checkpoint carried and
    a later attempt (the lease's holder) appended for it."""
    events = parse_chunk(read_object(store, StreamObject.parse(key)))  # type: ignore[arg-type]
    return bool(events) and all(int(e.data.get("replayed_by") or 0) > attempt
                                for e in events)


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_a_job_survives_a_random_fault_schedule(seed: int, spotnb_home: Path,
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    switch = tmp_path / "store-fault"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LEASE_TTL", "9")
    run_schedule(seed, spotnb_home, switch)


@pytest.mark.soak
@pytest.mark.skipif(not SOAK, reason="soak: set SPOTNB_FAULT_SOAK=N to run N schedules")
@pytest.mark.parametrize("seed", range(1000, 1000 + SOAK))
def test_soak(seed: int, spotnb_home: Path, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> None:
    switch = tmp_path / "store-fault"
    monkeypatch.setenv("SPOTNB_LOCAL_STORE_FAULT", str(switch))
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LEASE_TTL", "9")
    run_schedule(seed, spotnb_home, switch)
