"""Shared fixtures: an isolated SPOTNB_HOME per test, and no process left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

LEFTOVER_GRACE_SECONDS = 20.0
# The data files as the project received them (beside the checkout, where it has them);
# else the copy the package ships (a fresh clone elsewhere: CI).
SHARED_DATA = next(p for p in (Path(__file__).resolve().parents[1].parent / "shared" / "data",
                                Path(__file__).resolve().parents[1] / "spotnb" / "data")
                    if (p / "aws_gpu_catalog.csv").exists())
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
# Debian's Chromium, headless and with no network of its own (the machine has none).
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]

# One compute thread per process: the suite runs three workers on a machine of a few
# cores, and a test's notebook kernel, instances and reference run train beside each
# other; torch's default (a thread per core, each spinning while it waits) then
# oversubscribes the cores: the GPT example's step took 0.5 s instead of 0.03 s on two
# busy cores. Set before anything imports torch; the processes the tests start inherit
# it, and the local cloud lets it through to its instances (as a variable baked into
# an AMI: SPOTNB_LOCAL_INSTANCE_ENV), as does the AWS simulator (a machine variable),
# so a reference computed here and a job's result agree bitwise as before.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
for _name in THREAD_VARIABLES:
    os.environ.setdefault(_name, "1")
os.environ.setdefault("SPOTNB_LOCAL_INSTANCE_ENV", ",".join(THREAD_VARIABLES))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests first. Two workers take the next test as each frees up: a
    four-minute test collected late leaves the other worker idle for most of it at
    the end of the suite (longest processing time first packs the two much tighter).
    The ``slow`` tests go first, the longest bound (``timeout`` mark, else the
    suite's) first among them; the sort is stable, so the rest keep their order."""
    def weight(item: pytest.Item) -> float:
        if item.get_closest_marker("slow") is None:
            return 0.0
        bound = item.get_closest_marker("timeout")
        if bound is not None and bound.args:
            return -float(bound.args[0])
        return -float(item.config.getini("timeout") or 1)

    items.sort(key=weight)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test marked ``xdist_group`` that pytest-xdist's ``--dist loadgroup`` did
    not group (it suffixes the ids of grouped tests with ``@<group>``): its module's
    fixtures, meant to be made once, would be made on every worker that runs a part
    of it, silently (pytest 9.2 with pytest-xdist 3.8 did that)."""
    if (getattr(item.config.option, "loadgroup", False)
            and item.get_closest_marker("xdist_group") and "@" not in item.nodeid):
        pytest.fail(f"pytest-xdist ignored this test's xdist_group mark under pytest "
                    f"{pytest.__version__}: set up with `bash scripts/setup.sh`, which "
                    "installs the versions constraints.txt allows", pytrace=False)


def _spotnb_processes(home: Path) -> list[psutil.Process]:
    """Processes of the local cloud that belong to ``home`` (agents, supervisors, kernels)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            env = proc.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid == os.getpid():
            continue
        if env.get("SPOTNB_HOME") != str(home) or not ("spotnb" in cmd or "ipykernel" in cmd):
            continue
        # A zombie has exited: only its exit status is left for a parent to collect (in
        # a container whose init never reaps, an orphan's stays until the container ends).
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.fixture(autouse=True)
def _waits_look_at_the_result_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """``JobHandle.wait`` looks for the result every 0.25 s at first, then backs off to
    one look every 10 s (an S3 HEAD each on AWS): a test would wait up to 10 s past its
    job's end, 5 s on average. Here the looks are free (a local directory, the
    simulator): every 0.25 s, so that a test waits on its job's end, not on a back-off.
    (Notebook kernels follow their jobs live, not through ``wait``.)"""
    from spotnb.client import jobs

    monkeypatch.setattr(jobs, "WAIT_MAX_SECONDS", jobs.POLL_SECONDS)


@pytest.fixture
def spotnb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh SPOTNB_HOME; fails the test if a local-cloud process outlives it."""
    home = tmp_path / "spotnb-home"
    home.mkdir()
    monkeypatch.setenv("SPOTNB_HOME", str(home))
    yield home
    # A finished job's group and agent exit by themselves within moments.
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (leftovers := _spotnb_processes(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    assert not leftovers, f"processes outlived the test: {[p.info['cmdline'] for p in leftovers]}"


@pytest.fixture
def private_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary directory of the test's own, for this process and the processes it
    starts (agents make their socket directories there): `spotnb cleanup` then sees
    this test's leftovers only. Short, as Unix socket paths must be."""
    path = Path(tempfile.mkdtemp(prefix="sn-"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _processes_under(base: Path) -> list[psutil.Process]:
    """Processes whose SPOTNB_HOME lies below ``base`` (every test's home does)."""
    found = []
    for proc in psutil.process_iter(["pid", "environ", "cmdline"]):
        try:
            home = (proc.info["environ"] or {}).get("SPOTNB_HOME", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        # base/..., not a sibling whose name starts the same (pytest-4 and pytest-41).
        if proc.pid != os.getpid() and (home + os.sep).startswith(str(base) + os.sep):
            found.append(proc)
    return found


@pytest.fixture(scope="session", autouse=True)
def no_local_cloud_process_survives_the_suite(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the whole suite, no process of any test's local cloud is left running."""
    base = tmp_path_factory.getbasetemp()
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_SECONDS
    while (leftovers := _processes_under(base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in leftovers:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    assert not leftovers, (
        f"local-cloud processes outlived the test suite: "
        f"{[' '.join(p.info['cmdline'] or []) for p in leftovers]}")


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """AWS on the simulator (moto in server mode) for one test module: its endpoint,
    with the AWS environment (fake credentials, endpoint URL) set while it runs."""
    from spotnb.testing import MotoServer, aws_environment

    server = MotoServer().start()
    # moto's backends are global to the process: forget what other modules' servers made.
    server.reset()
    try:
        with aws_environment(server.endpoint):
            yield server.endpoint
    finally:
        server.stop()
