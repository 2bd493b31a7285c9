"""The instance agent through its own failures, against the simulator: it never leaves
an instance billed with nobody to end it (invariant 6), and a crash of its own costs
the training nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import wait_until

import spotnb
from spotnb.protocol.events import metric_rows
from spotnb.protocol.events.fold import fold
from spotnb.providers.aws import AwsProvider, bootstrap
from spotnb.testing import AwsSimulator

# Trains until the gate exists, a checkpoint every 10 steps.
UNTIL_GATE = """
import os, time
ckpt = spot.Checkpoint(progress={{"n": 0}})
step = ckpt.restore()
while not (os.path.exists({gate!r}) and step >= 20):
    spot.log(step, loss=1.0 / (step + 1))
    time.sleep(0.05)
    ckpt.maybe_save(step)
    step += 1
"""


def processes(*words: str) -> list[int]:
    """The pids of the processes whose command line holds every one of ``words``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(w.encode() in argv for w in words):
            found.append(int(entry))
    return found


def test_an_instance_agent_that_dies_is_started_again_and_adopts_its_running_job_agent(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of the instance agent while the job trains: the boot script starts it
    again, and the new agent watches the job agent that still runs instead of starting
    a second one beside it: one attempt, no step redone, and the instance ends with
    the job."""
    monkeypatch.setattr(bootstrap, "AGENT_RETRY_SECONDS", 0)
    monkeypatch.setenv("SPOTNB_AWS_CAPACITY_POLL", "0.5")
    gate = tmp_path / "gate"
    with AwsSimulator(tmp_path / "sim") as sim:
        handle = spotnb.submit(UNTIL_GATE.format(gate=str(gate)), provider="aws",
                               instance_types=["g4dn.xlarge"], checkpoint_every="10 steps")
        inst = sim.wait_for_instance(handle.job_id)
        uri = handle.store.uri
        wait_until(lambda: handle.metrics().get("loss"), 120, "the first steps")
        (job_agent,) = wait_until(lambda: processes("spotnb.kernel_remote", uri), 60,
                                  "the job agent")
        (first,) = processes("spotnb.providers.aws.instance", uri)
        os.kill(first, signal.SIGKILL)
        boot_log = inst.dir / "bootstrap.log"
        wait_until(lambda: "the instance agent exited with" in boot_log.read_text(), 60,
                   "the boot script to see its agent die")
        wait_until(lambda: f"the job agent {job_agent} started before this instance agent "
                   "still runs" in boot_log.read_text(), 60, "the new agent to adopt it")
        assert processes("spotnb.kernel_remote", uri) == [job_agent], \
            "one job agent, the first"
        gate.touch()
        result = handle.wait(timeout=120)
        events = list(handle.events(follow=False))
        wait_until(lambda: inst.terminated, 60, "the instance to end with its job")
        wait_until(lambda: not AwsProvider().cleanup(dry_run=True), 30,
                   "nothing of the job left")
    assert result.status == "completed", (result.reason, result.error)
    state = fold(events)
    assert len(state.attempts) == 1 and state.redone_steps() == 0
    steps = [step for e in events for step, _t, _values in metric_rows(e)]
    assert steps == list(range(len(steps))), "every step once, in order"
