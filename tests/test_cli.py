"""The ``spotnb`` command on real jobs of the local cloud."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

import spotnb
from spotnb.cli import main

pytestmark = pytest.mark.slow

TICKING = textwrap.dedent("""
    import time
    for i in range(TICKS):
        print(f"tick {i}", flush=True)
        spot.log(i, x=float(i))
        time.sleep(0.2)
""")


@pytest.fixture
def cloud(spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "1")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    return spotnb_home


def wait_for_state(handle: spotnb.JobHandle, state: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while handle.status != state and time.monotonic() < deadline:
        time.sleep(0.2)
    assert handle.status == state


def test_jobs_interrupt_and_logs_follow_a_job_to_its_end(
        cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handle = spotnb.submit(TICKING, name="ticker", inputs={"TICKS": 25})
    wait_for_state(handle, "running")
    assert main(["jobs"]) == 0
    listing = capsys.readouterr().out
    assert handle.job_id in listing and "ticker" in listing and "running" in listing

    assert main(["interrupt", handle.job_id]) == 0
    assert "notice delivered" in capsys.readouterr().out
    assert main(["logs", handle.job_id, "-f"]) == 0
    log = capsys.readouterr().out
    # Without checkpoints the cell starts over on the replacement: tick 0 twice.
    assert log.count("tick 0") == 2 and "tick 24" in log
    assert "notice: instance-action terminate" in log
    assert "completed" in log.splitlines()[-1]
    assert main(["jobs"]) == 0
    assert "completed" in capsys.readouterr().out


def test_stop_ends_the_job_and_leaves_nothing_behind(
        cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handle = spotnb.submit(TICKING, inputs={"TICKS": 1000})
    wait_for_state(handle, "running")
    assert main(["stop", handle.job_id]) == 0
    assert "stopped" in capsys.readouterr().out
    assert handle.status == "stopped"
    assert main(["cleanup", "--dry-run"]) == 0
    assert "nothing left over" in capsys.readouterr().out


def test_an_unknown_job_is_a_clear_error(cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "no-such-job"]) == 2
    err = capsys.readouterr().err
    assert "no job 'no-such-job'" in err and "spotnb jobs" in err
