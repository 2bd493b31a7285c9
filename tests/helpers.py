"""Helpers the test modules share (imported as ``from helpers import ...``: pytest puts
``tests/`` on ``sys.path``, as for ``conftest``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

from spotnb.protocol.events import Event, parse_chunk
from spotnb.protocol.events.writer import StreamObject, read_object
from spotnb.protocol.store import LocalStore

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout: float, message: str, *,
               interval: float = 0.1) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something true,
    and return that; fail with ``message`` after ``timeout`` seconds. A wait on a
    condition, never on a duration: the bound is for a test that would otherwise hang,
    not a timing the test relies on."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {message}")
        time.sleep(interval)


def replayed(store: LocalStore, key: str, attempt: int) -> bool:
    """Whether a chunk of ``attempt``'s stream holds only what a checkpoint carried and
    a later attempt (the lease's holder) appended for it (a restore writes what the
    saving attempt's log lacked into that attempt's own stream)."""
    events = parse_chunk(read_object(store, StreamObject.parse(key)))  # type: ignore[arg-type]
    return bool(events) and all(int(e.data.get("replayed_by") or 0) > attempt
                                for e in events)


class StartupHold:
    """Holds the next local-cloud instance a job starts at the first instruction of its
    first process (the reaper), for as long as a test needs: a process descheduled right
    after its launch, made exact (``tests/faults/startup_hold/sitecustomize.py``).

    Made before the jobs are launched (their processes inherit the search path and the
    gate); :meth:`arm` names the job, :meth:`held` waits until its next instance's
    reaper has stopped itself, :meth:`release` resumes it.
    """

    HOOK_DIR = Path(__file__).resolve().parent / "faults" / "startup_hold"

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = tmp / "startup-hold"
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            [str(self.HOOK_DIR), *([path] if path else [])]))
        monkeypatch.setenv("SPOTNB_TEST_HOLD", str(self.gate))
        self.proc: psutil.Process | None = None

    def arm(self, job_id: str) -> None:
        """Hold the next instance that ``job_id`` starts."""
        Path(f"{self.gate}.armed").write_text(job_id)

    def held(self, timeout: float = 120.0) -> psutil.Process:
        """The held reaper, once it has stopped itself."""
        pid_file = Path(f"{self.gate}.pid")
        pid = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout,
                             "an instance's first process to start and hold"))
        proc = psutil.Process(pid)
        wait_until(lambda: proc.status() == psutil.STATUS_STOPPED, timeout,
                   "the held process to stop")
        self.proc = proc
        return proc

    def release(self) -> None:
        """Let the held process go on."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


# A cell's code run uninterrupted, as a plain process: ``spot`` reduced to what an
# uninterrupted run does with it (never restores, saves nothing that matters), its
# logged metrics kept (their last values: what a job's result reports).
PLAIN_SPOT = """
import os, sys
class _Checkpoint:
    def __init__(self, **state): pass
    def restore(self): return 0
    def maybe_save(self, step): return False
    def save(self, step=None): pass
class spot:
    Checkpoint = _Checkpoint
    attempt = 1
    interrupt_pending = False
    last = {}
    @staticmethod
    def log(step, **values): spot.last.update(values)
"""


def run_uninterrupted(code: str, inputs: dict[str, Any], outputs: list[str],
                      tmp: Path, timeout: float = 300) -> dict[str, Any]:
    """The outputs of ``code`` (a cell) run once without a job: one plain Python
    process with ``inputs`` as its globals, in the environment a local instance gives
    its kernel (so a seeded result is the job's, bitwise); the last value of each
    logged metric under ``"metrics"``. What an interrupted job's result is compared
    with, at a fraction of an uninterrupted job's cost (no supervisor, agent, kernel or
    log). A cell's own pauses (``STEP_SECONDS``) may be given as 0 here."""
    from spotnb.providers.local.state import Settings, instance_base_environment

    out = tmp / f"uninterrupted-{time.monotonic_ns()}.pkl"
    given = "".join(f"{k} = {v!r}\n" for k, v in inputs.items())
    script = (f"{PLAIN_SPOT}{given}{code}\n"
              "import pickle\n"
              f"with open({str(out)!r}, 'wb') as f:\n"
              f"    pickle.dump({{**{{n: globals()[n] for n in {list(outputs)!r}}}, "
              "'metrics': spot.last}, f)\n")
    env = instance_base_environment(os.environ, Settings.load().instance_env)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    with out.open("rb") as f:
        return dict(pickle.load(f))


def beside(fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
    """``fn(*args, **kwargs)`` on a thread of its own, started now; its future. For an
    uninterrupted reference that needs nothing of the job it is compared with (a
    notebook run without spotnb's instance): it runs while the job waits on boots and
    notices, instead of after it. The asyncio loop that nbclient makes for the thread is
    closed when ``fn`` returns (left to the garbage collector, its sockets raise
    ResourceWarnings: errors under the suite's ``filterwarnings``)."""
    def run() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            try:
                loop = asyncio.get_event_loop_policy().get_event_loop()
            except RuntimeError:  # fn made none
                pass
            else:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
                asyncio.set_event_loop(None)

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="beside")
    future = pool.submit(run)
    pool.shutdown(wait=False)  # the thread ends with fn
    return future


def shared_dir(tmp_path: Path) -> Path:
    """A directory that every test of this test run sees, on every pytest-xdist worker:
    the run's base temporary directory (``tmp_path`` is ``<base>/<test>N``, under
    pytest-xdist ``<base>/popen-gwN/<test>N``). For what tests compute once and share
    (an uninterrupted reference run)."""
    base = tmp_path.parent
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


class Watch:
    """A job followed live, as a notebook follows it (a context manager): its agents
    then send their events within a second. Unwatched, they write their log about once
    a minute, so a test that waits for a step by reading the log (``metrics()``) waits
    on that flush, up to a minute each time. ``events``: every event seen so far."""

    def __init__(self, handle: Any) -> None:
        from spotnb.protocol.events.live import Follower

        self.follower = Follower(handle.store, handle.job_id)
        self.events: list[Event] = []

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.follower.close()

    def until(self, found: Callable[[list[Event]], T | None], timeout: float,
              what: str) -> T:
        """Follow until ``found(events)`` returns something true, and return that; fail
        with ``what`` after ``timeout`` seconds (a bound, as for :func:`wait_until`)."""
        deadline = time.monotonic() + timeout
        while True:
            value = found(self.events)
            if value:
                return value
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            self.events.extend(self.follower.poll(wait=0.5))

    def steps(self, name: str = "loss") -> list[int]:
        """The steps of metric ``name`` seen so far, in the order they came."""
        return [int(e.data["step"]) for e in self.events
                if e.type == "metric" and name in e.data.get("values", {})]


def spot_group(sim: Any, name: str, instance_types: list[str], *, desired: int,
               max_size: int = 1, min_size: int = 0, image: str | None = None,
               subnets: int | None = 1, tags: dict[str, str] | None = None,
               region: str | None = None) -> Any:
    """A spot group made by hand on the AWS simulator ``sim`` (the administrator's
    requests), as spotnb's launch makes one: a launch template of ``image`` (the
    region's Deep Learning AMI by default) and a ``MixedInstancesPolicy`` of spot
    ``instance_types`` over the first ``subnets`` subnets (None: all), tagged with
    ``tags`` (default: the spotnb job tag ``name``). Its Auto Scaling client."""
    from spotnb.providers.aws.resources import TAG_JOB, mixed_instances_policy

    region = region or sim.region
    ec2, asg = sim.admin_client("ec2", region), sim.admin_client("autoscaling", region)
    tags = tags if tags is not None else {TAG_JOB: name}
    template = ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"ImageId": image or sim.images[region]},
        TagSpecifications=[{"ResourceType": "launch-template", "Tags": [
            {"Key": k, "Value": v} for k, v in tags.items()]}])[
        "LaunchTemplate"]["LaunchTemplateId"]
    found = [s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]]
    asg.create_auto_scaling_group(
        AutoScalingGroupName=name, MinSize=min_size, MaxSize=max_size,
        DesiredCapacity=desired, VPCZoneIdentifier=",".join(found[:subnets]),
        Tags=[{"Key": k, "Value": v, "PropagateAtLaunch": True} for k, v in tags.items()],
        MixedInstancesPolicy=mixed_instances_policy(
            template_id=template, instance_types=tuple(instance_types), max_price=None,
            ondemand=False, strategy="price-capacity-optimized"))
    return asg
