"""The instance agent through its own failures, against the simulator: it never leaves
an instance billed with nobody to end it (invariant 6), and a crash of its own costs
the training nothing. What is left at the end is what ``assert_nothing_left`` allows: an
ended job's empty role, which IAM may refuse the instance itself to delete."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import wait_until
from test_aws_provider import UNTIL_GATE, assert_nothing_left

import spotnb
from spotnb.protocol import layout
from spotnb.protocol.events import metric_rows
from spotnb.protocol.events.fold import fold
from spotnb.providers.aws import bootstrap
from spotnb.testing import AwsSimulator


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
        # (The store, not the log: a job nobody follows writes its log once a minute.)
        wait_until(lambda: handle.store.exists(f"{layout.CHECKPOINTS}/LATEST"), 120,
                   "the first steps' checkpoint")
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
        assert_nothing_left(sim)
    assert result.status == "completed", (result.reason, result.error)
    state = fold(events)
    assert len(state.attempts) == 1 and state.redone_steps() == 0
    steps = [step for e in events for step, _t, _values in metric_rows(e)]
    assert steps == list(range(len(steps))), "every step once, in order"


def test_an_s3_outage_as_the_job_ends_is_waited_out_and_nothing_is_left_billed(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 fails for the instance agent (503 SlowDown) when the job agent has written
    the result and exited: the agent does not die on its question "has the job a
    result?" (a dead agent left its instance to the boot script's restarts, then a
    failure report and a power-off, and the group launched a replacement to tear the
    job down); it asks again until S3 answers, then deletes the job's group, and the
    instance ends with no other launched."""
    monkeypatch.setenv("SPOTNB_AWS_CAPACITY_POLL", "0.5")
    gate = tmp_path / "gate"
    with AwsSimulator(tmp_path / "sim") as sim:
        handle = spotnb.submit(UNTIL_GATE.format(gate=str(gate)), provider="aws",
                               instance_types=["g4dn.xlarge"], checkpoint_every="10 steps")
        inst = sim.wait_for_instance(handle.job_id)
        # (The store, not the log: a job nobody follows writes its log once a minute.)
        wait_until(lambda: handle.store.exists(f"{layout.CHECKPOINTS}/LATEST"), 120,
                   "the first steps' checkpoint")
        boot_log = inst.dir / "bootstrap.log"
        outage = sim.server.s3_outage
        outage.start("instance-agent")
        gate.touch()
        # The job agent's result (S3 works for it). Not handle.wait() yet: it would wait
        # out its grace for the instance agent's report of the instance's end, which
        # the outage holds back.
        wait_until(lambda: handle.store.exists(layout.RESULT), 120, "the job's result")
        wait_until(lambda: "reading whether the job has a result failed" in
                   boot_log.read_text(), 120, "the instance agent to meet the outage")
        assert not inst.terminated, "the group is not deleted while S3 fails"
        outage.end()
        result = handle.wait(timeout=120)
        wait_until(lambda: inst.terminated, 120, "the instance to end with its job")
        assert_nothing_left(sim)
        events = list(handle.events(follow=False))
        launched = [i for i in sim.instances.values() if i.job_id == handle.job_id]
    assert result.status == "completed", (result.reason, result.error)
    assert outage.met > 0
    text = boot_log.read_text()
    assert "the instance agent exited with" not in text, text[-2000:]
    assert "step failed" not in text, "no boot failure was reported"
    assert len(launched) == 1, "no instance launched to tear the job down"
    state = fold(events)
    assert len(state.attempts) == 1 and len(state.instances) == 1
