"""The ``spotnb`` command, as a user meets it: real jobs of the local cloud, jobs found by
id, name or the end of their id, `spotnb run` on real kernels, cleanup, the catalog."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from helpers import wait_until
from nbformat.v4 import new_code_cell, new_notebook

import spotnb
from spotnb.client.cli import main
from spotnb.protocol import layout
from spotnb.protocol.events import EventWriter
from spotnb.protocol.spec import JobSpec, Policy, Resources
from spotnb.protocol.store import open_store
from spotnb.providers.local import LocalProvider

pytestmark = pytest.mark.slow

TICKING = textwrap.dedent("""
    import time
    for i in range(TICKS):
        print(f"tick {i}", flush=True)
        spot.log(i, x=float(i))
        time.sleep(0.2)
""")


@pytest.fixture
def cloud(spotnb_home: Path, monkeypatch: pytest.MonkeyPatch, private_tmpdir: Path) -> Path:
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "1")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    return spotnb_home


def wait_for_first_metric(handle: spotnb.JobHandle, timeout: float = 120) -> None:
    """Until the cell has logged (it runs, not merely booted). Followed live: an
    unwatched job writes its metrics to the store once a minute."""
    live = handle.events(timeout=timeout)
    assert any(e.type == "metric" for e in live), "the job logged no metric"
    live.close()


def group_exited(job_id: str) -> bool:
    group = LocalProvider().group(job_id)
    return group is not None and not group["alive"]


def ended_job(home: Path, job_id: str, name: str, lines: int = 3) -> str:
    """A completed job's store prefix, as its agent and group leave it (no process)."""
    store = open_store(home / "store").child(f"jobs/{job_id}")
    spec = JobSpec(job_id=job_id, name=name, code="print('hi')", provider="local",
                   resources=Resources(("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time())
    store.put(layout.SPEC, spec.to_json().encode())
    events = EventWriter(store, 1, "i-1")
    events.emit("status", state="booting", detail="attempt 1", instance_type="g4dn.xlarge")
    for i in range(lines):
        events.emit("stream", name="stdout", text=f"line {i} of {name}\n")
    events.emit("result", status="completed", reason="the cell finished")
    events.close()
    store.put(layout.RESULT, json.dumps({"status": "completed", "reason": ""}).encode())
    return job_id


# -- real jobs --------------------------------------------------------------------------

def test_jobs_interrupt_and_logs_follow_a_job_to_its_end(
        cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handle = spotnb.submit(TICKING, name="ticker", inputs={"TICKS": 50})
    wait_for_first_metric(handle)

    def listed() -> str:
        assert main(["jobs"]) == 0
        return capsys.readouterr().out

    # The store has the job's "running" a moment after its first row came live.
    listing = wait_until(lambda: (out := listed()) and "running" in out and out, 60,
                         "spotnb jobs to list the job as running", interval=0.5)
    assert handle.job_id in listing and "ticker" in listing

    assert main(["interrupt", "ticker"]) == 0  # by name
    assert "notice delivered" in capsys.readouterr().out
    assert main(["logs", handle.job_id, "-f"]) == 0
    log = capsys.readouterr().out
    # Without checkpoints the cell starts over on the replacement: tick 0 twice.
    assert log.count("tick 0") == 2 and "tick 49" in log
    assert "notice: instance-action terminate" in log
    lines = log.splitlines()
    completed = max(i for i, line in enumerate(lines) if "completed" in line)
    assert completed > max(i for i, line in enumerate(lines) if line == "tick 49")
    # Following ends with the job's end: after its result, the group's report that
    # each instance it launched is terminated (the last one a moment after the result).
    launched = re.findall(r"instance launched: (i-\w+)", log)
    terminated = re.findall(r"instance terminated: (i-\w+)", log)
    assert len(launched) == 2 and sorted(terminated) == sorted(launched)
    assert "instance terminated" in lines[-1] and "job-finished" in lines[-1]
    # The followed log is the whole log: read again, it has the same lines (in time
    # order; live, a line can come a moment late, after the lines of another stream).
    wait_until(lambda: group_exited(handle.job_id), 60, "the group to exit")
    assert main(["logs", handle.job_id]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(lines)
    assert main(["jobs"]) == 0
    assert "completed" in capsys.readouterr().out


def test_stop_ends_the_job_and_cleanup_lists_exactly_what_it_does(
        cloud: Path, private_tmpdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    handle = spotnb.submit(TICKING, inputs={"TICKS": 1000})
    wait_for_first_metric(handle)
    assert main(["stop", handle.job_id[-6:]]) == 0
    out = capsys.readouterr().out
    assert f"job {handle.job_id} stopped" in out
    assert handle.status == "stopped"
    wait_until(lambda: group_exited(handle.job_id), 60, "the group to exit")

    # What killed agents leave in the temporary directory: a socket nobody listens on,
    # and the kernel's connection file with its key. A live one must stay.
    dead = private_tmpdir / "spotnb-dead1234"
    dead.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(dead / "agent.sock"))
    (dead / "k1.json").write_text('{"key": "secret"}')
    live = private_tmpdir / "spotnb-live1234"
    live.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(live / "agent.sock"))
    listener.listen()
    try:
        assert main(["cleanup", "--dry-run"]) == 0
        planned = capsys.readouterr().out.splitlines()
        assert planned[-1] == f"{len(planned) - 1} item(s); remove them with `spotnb cleanup`"
        assert not any("would kill" in line for line in planned), planned  # nothing runs
        assert any(f"logs of finished job {handle.job_id}" in line for line in planned)
        assert any(str(dead) in line for line in planned)
        assert not any(str(live) in line for line in planned)
        assert dead.exists()  # a dry run changes nothing

        assert main(["cleanup"]) == 0
        done = capsys.readouterr().out.splitlines()
        assert done == [line.replace("would ", "did ", 1) for line in planned[:-1]]
        assert not dead.exists() and live.exists()
        assert not (cloud / "cloud" / "groups" / handle.job_id).exists()
        assert handle.summary().status == "stopped"  # the history stays in the store

        assert main(["cleanup", "--dry-run"]) == 0
        assert capsys.readouterr().out == "nothing left over\n"
    finally:
        listener.close()


def test_an_unknown_job_is_a_clear_error(cloud: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["logs", "no-such-job"]) == 2
    err = capsys.readouterr().err
    assert "no job 'no-such-job'" in err and "spotnb jobs" in err


# -- finding jobs ----------------------------------------------------------------------

def test_jobs_are_found_by_id_name_or_the_end_of_their_id(
        spotnb_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = ended_job(spotnb_home, "20250101-000000-aaaaaa", "digits")
    second = ended_job(spotnb_home, "20250101-000001-bbbbbb", "digits")
    solo = ended_job(spotnb_home, "20250101-000002-cccccc", "digits-mine")

    assert main(["logs", "digits-mine"]) == 0  # the name `spotnb jobs` lists
    assert "line 0 of digits-mine" in capsys.readouterr().out
    assert main(["logs", "bbbbbb"]) == 0  # the end of an id
    assert "line 2 of digits" in capsys.readouterr().out
    assert main(["logs", first]) == 0  # the whole id
    capsys.readouterr()
    assert main(["logs"]) == 0  # the latest job
    assert "digits-mine" in capsys.readouterr().out

    # An ambiguous name lists the candidates and says what to give instead.
    assert main(["logs", "digits"]) == 2
    err = capsys.readouterr().err
    assert "'digits' matches 2 jobs" in err and first in err and second in err
    assert "completed" in err and "Give the id" in err

    # The API resolves the same way.
    assert spotnb.attach("digits-mine").job_id == solo
    assert spotnb.attach("aaaaaa").job_id == first
    with pytest.raises(spotnb.JobNotFound) as found:
        spotnb.attach("digits")
    assert [c.job_id for c in found.value.candidates] == [first, second]


def test_stopping_an_ended_job_says_it_has_ended(
        spotnb_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job_id = ended_job(spotnb_home, "20250101-000000-dddddd", "done")
    assert main(["stop", "done"]) == 0
    out = capsys.readouterr().out
    assert "already ended (completed)" in out and "stopped" not in out
    assert spotnb.attach(job_id).status == "completed"


def test_a_pruned_trial_reads_pruned_wherever_its_status_is_read(
        spotnb_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep's pruner writes ``pruned`` into the trial's log, then stops the job,
    whose result.json then says ``stopped``: the status every reader gives is the
    fold's, ``pruned``, also where only result.json used to be read."""
    from spotnb.client.jobs import find_job
    from spotnb.sweep.trials import tell_job

    job_id = ended_job(spotnb_home, "20250101-000000-eeeeee", "trial-3")
    twin = ended_job(spotnb_home, "20250101-000001-ffffff", "trial-3")
    handle = spotnb.attach(job_id)
    tell_job(handle, "pruned", step=140, metric="val_loss", value=0.44521,
             sweep="sweep-1", trial=3)
    handle.store.put(layout.RESULT, json.dumps(
        {"status": "stopped", "reason": "pruned by its sweep"}).encode())

    assert handle.status == "pruned"
    assert spotnb.attach(job_id).status == "pruned"
    assert find_job(job_id).status() == "pruned"
    assert find_job(twin).status() == "completed"
    assert main(["logs", "trial-3"]) == 2  # the candidates, each with its status
    err = capsys.readouterr().err
    assert re.search(rf"{job_id}  trial-3  \(submitted [^)]*, pruned\)", err), err
    assert main(["stop", job_id]) == 0
    out = capsys.readouterr().out
    assert "already ended (pruned)" in out and "stopped" not in out
    assert handle.summary().status == "pruned"
    assert main(["jobs"]) == 0  # the listing says where, from the fold's pruned event
    assert re.search(rf"{job_id}\s+trial-3\s+pruned at step 140\s", capsys.readouterr().out)


def test_kill_says_the_kill_is_requested_not_done(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`spotnb kill` only asks: the job's local group ends the instance at its next
    tick. The message says so, not "killed"."""
    from spotnb.client import cli

    asked: list[int | None] = []

    class Handle:
        job_id = "20250101-000000-eeeeee"

        def kill(self, node: int | None = None) -> None:
            asked.append(node)

    monkeypatch.setattr(cli, "_job", lambda args: Handle())
    assert main(["kill", "eeeeee", "--node", "1"]) == 0
    out = capsys.readouterr().out
    assert asked == [1]
    assert out.startswith("kill requested for node 1 of job 20250101-000000-eeeeee")
    assert "next tick" in out and "killed" not in out


# -- help, pipes, the catalog -----------------------------------------------------------

def test_help_is_written_for_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "train in Jupyter on spot GPU instances" in text
    assert "prints" not in text and "notebook-layer" not in text
    assert "catalog" in text and "JOB is a job's id, its name, or the end of its id" in text
    for command in ("logs", "stop", "interrupt"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "JOB  a job id, its name, or the end of its id" in re.sub(
            r"\s+", " ", capsys.readouterr().out).replace("JOB a job", "JOB  a job")


def test_a_closed_pipe_ends_the_command_quietly(spotnb_home: Path) -> None:
    # `spotnb catalog | head -1`: the reader is gone before the command writes.
    proc = subprocess.Popen([sys.executable, "-m", "spotnb.client.cli", "catalog", "--all"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert proc.returncode == 141


def test_catalog_lists_the_types_by_gpu_and_region(capsys: pytest.CaptureFixture[str]) -> None:
    # The unknown-type error points here; the command must exist.
    with pytest.raises(spotnb.SpecError, match="`spotnb catalog`"):
        spotnb.prepare("x = 1", instance_types=["g9.nonexistent"])
    assert main(["catalog", "--gpu", "a10g", "--region", "us-west-2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = re.split(r"\s{2,}", lines[0])
    assert header[:2] == ["TYPE", "GPUS"] and "SPOT $/H" in header
    rows = [dict(zip(header, re.split(r"\s{2,}", line), strict=True))
            for line in lines[1:] if line.startswith("g")]
    assert rows and all(r["TYPE"].startswith("g5.") and "A10G" in r["GPUS"] for r in rows)
    spots = [float(r["SPOT $/H"]) for r in rows]
    assert spots == sorted(spots)  # cheapest first
    assert "in us-west-2" in lines[-1]

    assert main(["catalog", "--gpu", "t4", "--min-gpus", "4"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("g4")]
    assert rows and all(int(row.split()[1]) >= 4 for row in rows)

    assert main(["catalog", "--gpu", "voodoo"]) == 1
    assert "GPU models there: " in capsys.readouterr().out
    assert main(["catalog", "--region", "mars-1"]) == 2
    assert "--region: no prices for 'mars-1'" in capsys.readouterr().err


# -- spotnb run -------------------------------------------------------------------------

def _notebook(path: Path, *cells: str) -> Path:
    nb = new_notebook(cells=[new_code_cell(source) for source in cells], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, path)
    return path


def _spotnb(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it: its own process, the kernel's output included."""
    return subprocess.run([sys.executable, "-m", "spotnb.client.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_run_names_jobs_after_the_notebook_and_ends_with_the_error(
        cloud: Path, tmp_path: Path) -> None:
    logged = ended_job(cloud, "20250101-000000-eeeeee", "earlier", lines=30)
    path = _notebook(tmp_path / "experiment.ipynb",
                     "%load_ext spotnb",
                     f"%spot_logs {logged}",
                     "%%spot_train\nprint('remote hello')",
                     "print('local output')\nraise ValueError('boom')")
    run = _spotnb("run", str(path))
    assert run.returncode == 1, run.stderr
    assert "spotnb run: cell 4 [4] failed: ValueError: boom\n    print('local output')" \
        in run.stderr
    assert "without encryption" not in run.stderr + run.stdout  # IPC, not TCP

    (job,) = [r for r in spotnb.jobs() if r.job_id != logged]
    assert (job.name, job.status) == ("experiment-3", "completed")
    executed = nbformat.read(tmp_path / "experiment.executed.ipynb", as_version=4)
    # %spot_logs writes the history as one output, not one per line.
    streams = [o for o in executed.cells[1].outputs if o["output_type"] == "stream"]
    assert len(streams) == 1 and streams[0]["text"].count("line ") == 30


def test_run_timeout_stops_the_cells_job_and_says_so(cloud: Path, tmp_path: Path) -> None:
    path = _notebook(tmp_path / "forever.ipynb",
                     "%load_ext spotnb",
                     "%%spot_train --name forever\nimport time\nwhile True:\n"
                     "    print('tick', flush=True)\n    time.sleep(0.5)")
    run = _spotnb("run", str(path), "--timeout", "15")
    assert run.returncode == 1, run.stderr
    (job,) = spotnb.jobs()
    assert f"spotnb run: cell 2 [2] ran longer than --timeout 15 s and was stopped; its " \
           f"job {job.job_id} was stopped too" in run.stderr
    assert "Here is a preview" not in run.stderr and "['%%spot_train" not in run.stderr
    result = spotnb.attach(job.job_id).summary()
    assert result.status == "stopped" and "spotnb run --timeout" in result.reason
    executed = nbformat.read(tmp_path / "forever.executed.ipynb", as_version=4)
    last = executed.cells[1].outputs[-1]
    assert last["output_type"] == "error" and last["ename"] == "CellTimeoutError"
    wait_until(lambda: group_exited(job.job_id), 60, "the group to exit")
