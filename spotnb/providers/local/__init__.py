"""The local cloud: spotnb's embedded default provider, a simulated EC2 spot market.

It is a simulator, not a mock. Each "instance" (:mod:`.instance`) is a real detached
process running the same agent as on AWS (``python -m spotnb.kernel_remote --job
<store-uri>``), with its own IMDSv2 metadata service (:mod:`.imds`) that announces
interruptions exactly like EC2. Each job gets a capacity group: a detached supervisor
process (:mod:`.group`) that keeps one instance running and replaces interrupted ones by
itself, on a market that replays real spot price history (:mod:`.market`). State lives
under ``$SPOTNB_HOME/cloud`` (:mod:`.state`). Provider methods follow the contract in
:mod:`spotnb.providers`.

Settings (``$SPOTNB_HOME/cloud/config.json`` keys in brackets; the environment
variable wins over the file; unknown keys are ignored with a warning; invalid values
are refused with :class:`~spotnb.spec.SpecError` before anything starts):

``SPOTNB_LOCAL_TIME_SCALE`` [time_scale]
    Market time compression: market seconds per real second. Default 60 (an hour of
    price history replays in a minute).
``SPOTNB_LOCAL_NOTICE_SECONDS`` [notice_seconds]
    Real seconds between the interruption notice and termination. Default EC2's two
    minutes divided by the time scale (2 s at the default scale).
``SPOTNB_LOCAL_BOOT_SECONDS`` [boot_seconds]
    Simulated boot time before the agent starts. Default 0.
``SPOTNB_LOCAL_NO_CAPACITY`` [no_capacity]
    Comma-separated instance types (``g5.xlarge``) or pools (``g5.xlarge@use1-az4``)
    that have no spot capacity: launches there fail with
    ``InsufficientInstanceCapacity``. Read again at every launch, so the config file can
    switch a shortage on and off while a job runs.
``SPOTNB_LOCAL_HAZARD`` [hazard]
    1 (default) or 0: interrupt instances at the Spot Advisor rate of their pool (the
    bucket's upper bound, read as interruptions per month, time-compressed).
``SPOTNB_LOCAL_SEED`` [seed]
    Makes the hazard draws reproducible (combined with the job id). Unset: random.
``SPOTNB_LOCAL_INTERRUPT_AFTER`` [interrupt_after]
    For ``simulate_interruptions={"count": N}``: seconds an instance runs before its
    interruption when its attempt writes no checkpoint. Default 20.
``SPOTNB_LOCAL_STOP_GRACE`` [stop_grace]
    Seconds the agent has to finish by itself after a stop request (or after writing
    the result) before its instance is terminated. Default 15.
``SPOTNB_LOCAL_AGENT_CMD`` [agent_cmd]
    The command an instance runs instead of ``python -m spotnb.kernel_remote``
    (``--job <store-uri>`` is appended). For tests and for debugging agents.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spotnb import catalog
from spotnb.layout import RESULT, SPEC
from spotnb.providers import PoolPrice, Provider, ProviderError
from spotnb.providers.local.state import (
    CONTROL_DIR,
    GROUP_FILE,
    ProcessRecord,
    Settings,
    check_job_id,
    group_dir,
    groups_dir,
    instances_dir,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
    write_json,
)
from spotnb.spec import JobSpec, SpecError
from spotnb.store import StoreError, open_store, upload_mbps

__all__ = ["LocalProvider", "Settings"]

log = logging.getLogger(__name__)

# How long launch() waits for the supervisor to report that it is up.
LAUNCH_TIMEOUT_SECONDS = 10.0
# How long terminate() lets the supervisor end its instances before doing it itself.
TERMINATE_TIMEOUT_SECONDS = 10.0
# Grace for a supervisor killed from outside: on SIGTERM it ends its instances first.
SUPERVISOR_KILL_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05


class LocalProvider(Provider):
    """The local cloud. See the contract in :mod:`spotnb.providers`."""

    name = "local"

    def validate(self, spec: JobSpec) -> None:
        Settings.load()
        check_job_id(spec.job_id)
        res = spec.resources
        if not res.instance_types:
            raise SpecError("no instance type given: name at least one, e.g. 'g5.xlarge', "
                            "or pick one with %spot_picker")
        for instance_type in res.instance_types:
            catalog.check_instance_type(instance_type, res.region)
        if res.max_price is not None:
            _check_max_price(res.max_price, res.instance_types, res.region)
        _check_simulation(spec.simulate_interruptions)
        try:
            open_store(spec.store_uri)
        except StoreError as e:
            raise SpecError(str(e)) from None

    def upload_mbps(self, spec: JobSpec) -> float | None:
        # The simulated network (SPOTNB_LOCAL_UPLOAD_MBPS), which instances inherit;
        # without it uploads go at the local disk's speed: no figure to judge by.
        return upload_mbps()

    def launch(self, spec: JobSpec) -> None:
        self.validate(spec)
        store = open_store(spec.store_uri)
        store.put_if_absent(SPEC, spec.to_json().encode())
        home = group_dir(spec.job_id)
        info = read_json(home / GROUP_FILE)
        if info is not None and _alive(info):
            raise ProviderError(
                f"job {spec.job_id} already has a running capacity group (supervisor pid "
                f"{info['supervisor']['pid']}); stop that job first, or remove leftovers "
                "with `spotnb cleanup`"
            )
        if home.exists():
            # A previous group of this job is gone; so must its instances be.
            self._kill_instances(spec.job_id)
            shutil.rmtree(home, ignore_errors=True)
        (home / CONTROL_DIR).mkdir(parents=True)
        self._start_supervisor(spec.job_id, store.uri, adopt=False)

    def _start_supervisor(self, job_id: str, store_uri: str, adopt: bool) -> None:
        """Start the job's supervisor and wait until it says it is up; ProviderError
        (after killing what was started) if it does not."""
        home = group_dir(job_id)
        log_path = home / "supervisor.log"
        cmd = [sys.executable, "-m", "spotnb.providers.local.group", "--job", store_uri]
        if adopt:
            cmd.append("--adopt")
        deadline = time.monotonic() + LAUNCH_TIMEOUT_SECONDS
        with open(log_path, "ab") as out:
            starter = subprocess.Popen(cmd, cwd=home, stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        # Step 1: the starter process checks the job and forks the supervisor off.
        try:
            code = starter.wait(timeout=LAUNCH_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            starter.kill()
            starter.wait()
            code = None
        if code != 0:
            if not adopt:
                self._abandon(job_id)
            raise ProviderError(
                f"the local cloud could not start the capacity group for job {job_id}: "
                f"{_tail(log_path)} (log: {log_path})")
        # Step 2: the supervisor says it is up.
        while time.monotonic() < deadline:
            info = read_json(home / GROUP_FILE)
            if info is not None and info.get("state") == "ready" and _alive(info):
                log.info("local capacity group for job %s is up", job_id)
                return
            if info is not None and info.get("state") == "exited" and not adopt:
                break
            time.sleep(_POLL_SECONDS)
        if not adopt:
            self._abandon(job_id)
        raise ProviderError(
            f"the local cloud's capacity group for job {job_id} did not start within "
            f"{LAUNCH_TIMEOUT_SECONDS:g} s: {_tail(log_path)} (log: {log_path})")

    def ensure_supervised(self, job_id: str) -> str | None:
        """See the contract: if the job has no result and its supervisor is gone (killed,
        crashed, a reboot), start a new one that adopts its instances. If that fails,
        end the job with a failed result that says why. Returns what was done, or None.
        """
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        if info is None or _alive(info):
            return None
        store_uri = info.get("store_uri")
        if not store_uri or _has_result(store_uri):
            return None
        with _locked(home / "restart.lock"):
            info = read_json(home / GROUP_FILE) or info
            if _alive(info) or _has_result(store_uri):
                return None  # another process restarted it, or the job ended
            log.warning("the supervisor of job %s is gone; starting a new one", job_id)
            try:
                self._start_supervisor(job_id, str(store_uri), adopt=True)
            except ProviderError as err:
                reason = (f"the local cloud's supervisor of this job died and could not be "
                          f"restarted: {err}")
                _write_result(store_uri, "failed", reason)
                for killed in self._kill_instances(job_id):
                    log.warning("killed leftover %s", killed)
                return reason
        return "restarted the job's supervisor (it had died); the job carries on"

    def interrupt(self, job_id: str, instance: str | None = None) -> None:
        """Give the job's instance (a multi-node job's ``instance``, else its first
        running one) an interruption notice, as EC2 would."""
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        if info is None or not _alive(info):
            raise ProviderError(f"job {job_id} has no running capacity group to interrupt")
        _request(home, "interrupt", instance=instance)
        log.info("requested an interruption of job %s's instance %s", job_id,
                 instance or "(the first running)")

    def terminate(self, job_id: str) -> None:
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        supervisor = ProcessRecord.from_dict(info.get("supervisor")) if info else None
        # Step 1: ask the supervisor, which ends its instances and writes the result.
        if supervisor is not None and supervisor.alive():
            _request(home, "terminate")
            deadline = time.monotonic() + TERMINATE_TIMEOUT_SECONDS
            while supervisor.alive() and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
            # Step 2: it did not answer: kill it (SIGTERM first: it ends instances then).
            if supervisor.alive():
                log.warning("the supervisor of job %s did not exit; killing it", job_id)
                kill_tree(supervisor, grace=SUPERVISOR_KILL_GRACE_SECONDS)
        # Step 3: whatever is left of the job's instances.
        for killed in self._kill_instances(job_id):
            log.warning("killed leftover %s", killed)
        if info is not None:
            _write_stopped_result(info.get("store_uri"))

    def cleanup(self, dry_run: bool = False) -> list[str]:
        done: list[str] = []
        live_jobs = set()
        described: set[int] = set()  # pids already in the list (dry run: still alive)
        verb = "would" if dry_run else "did"
        for home in sorted(groups_dir().iterdir()) if groups_dir().is_dir() else []:
            info = read_json(home / GROUP_FILE) or {}
            job_id = str(info.get("job_id") or home.name)
            alive = _alive(info)
            finished = _has_result(info.get("store_uri"))
            if alive and not finished:
                live_jobs.add(job_id)
                continue
            if finished and not alive:
                # A group that ended properly leaves only its logs: history, not a
                # leftover. A real cleanup clears them too.
                if not dry_run:
                    done.append(f"did remove the logs of finished job {job_id}")
                    shutil.rmtree(home, ignore_errors=True)
                continue
            why = "its job has a result" if finished else "its supervisor is gone"
            done.append(f"{verb} remove capacity group {job_id} ({why})")
            if not dry_run:
                supervisor = ProcessRecord.from_dict(info.get("supervisor"))
                if supervisor is not None:
                    kill_tree(supervisor, grace=SUPERVISOR_KILL_GRACE_SECONDS)
                done += [f"did kill {k}" for k in self._kill_instances(job_id)]
                shutil.rmtree(home, ignore_errors=True)
        for home in sorted(instances_dir().iterdir()) if instances_dir().is_dir() else []:
            meta = read_json(home / "meta.json") or {}
            if meta.get("job_id") in live_jobs:
                continue
            record = ProcessRecord.from_dict(read_json(home / "pid.json"))
            if record is not None and record.alive():
                done.append(f"{verb} kill orphan instance {home.name} (job "
                            f"{meta.get('job_id')}, pid {record.pid})")
                described.add(record.pid)
                if not dry_run:
                    kill_tree(record)
            if not dry_run:
                shutil.rmtree(home, ignore_errors=True)
        for proc, instance_id, job_id in marked_processes():
            if job_id in live_jobs or proc.pid in described:
                continue
            done.append(f"{verb} kill orphan process {proc.pid} of instance {instance_id} "
                        f"(job {job_id})")
            if not dry_run:
                kill_processes([proc], grace=1.0)
        return done

    def prices(self, instance_type: str, region: str) -> PoolPrice:
        catalog.check_instance_type(instance_type, region)
        found = catalog.pools(instance_type, region)
        cheapest = found[0]
        return PoolPrice(
            instance_type=instance_type, region=region, az=cheapest.az, spot=cheapest.spot,
            ondemand=catalog.ondemand_price(instance_type, region),
            source=(f"spotnb's bundled catalog ({catalog.DATA_DATE['catalog']}); cheapest of "
                    f"{len(found)} AZs"),
        )

    def instance_gone(self, job_id: str, instance_id: str) -> bool:
        """See the contract: the instance's record says it was terminated."""
        meta = read_json(instances_dir() / instance_id / "meta.json")
        return meta is not None and meta.get("state") == "terminated"

    # -- inspection (for the CLI and tests)

    def group(self, job_id: str) -> dict[str, Any] | None:
        """The capacity group's record (``group.json``) with ``alive``, or None."""
        info = read_json(group_dir(job_id) / GROUP_FILE)
        return None if info is None else {**info, "alive": _alive(info)}

    def instances(self, job_id: str) -> list[dict[str, Any]]:
        """The records (``meta.json``) of the job's instances, oldest first."""
        found = []
        for home in instances_dir().iterdir() if instances_dir().is_dir() else []:
            meta = read_json(home / "meta.json")
            if meta is not None and meta.get("job_id") == job_id:
                found.append({**meta, "dir": str(home)})
        return sorted(found, key=lambda m: m.get("launched", 0.0))

    # -- helpers

    def _kill_instances(self, job_id: str) -> list[str]:
        """Kill the job's instance processes still alive; describe each one killed."""
        killed = []
        for meta in self.instances(job_id):
            record = ProcessRecord.from_dict(read_json(Path(meta["dir"]) / "pid.json"))
            if record is not None and kill_tree(record):
                killed.append(f"instance {meta['instance_id']} (pid {record.pid})")
        for proc, instance_id, _ in marked_processes(job_id):
            killed.append(f"process {proc.pid} of instance {instance_id}")
            kill_processes([proc], grace=1.0)
        return killed

    def _abandon(self, job_id: str) -> None:
        """Undo a failed launch: whatever was started is killed; the log stays."""
        info = read_json(group_dir(job_id) / GROUP_FILE)
        supervisor = ProcessRecord.from_dict(info.get("supervisor")) if info else None
        if supervisor is not None:
            kill_tree(supervisor, grace=SUPERVISOR_KILL_GRACE_SECONDS)
        self._kill_instances(job_id)


def _alive(info: dict[str, Any]) -> bool:
    record = ProcessRecord.from_dict(info.get("supervisor"))
    return record is not None and record.alive()


def _request(home: Path, kind: str, **fields: Any) -> None:
    write_json(home / CONTROL_DIR / f"{kind}-{time.time_ns()}.json",
               {"kind": kind, "time": time.time(), "pid": os.getpid(), **fields})


def _has_result(store_uri: Any) -> bool:
    if not store_uri:
        return False
    try:
        return open_store(str(store_uri)).exists(RESULT)
    except StoreError:
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Any:
    """An exclusive lock on ``path`` (processes of this machine)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_result(store_uri: Any, status: str, reason: str) -> None:
    try:
        open_store(str(store_uri)).put_if_absent(RESULT, json.dumps(
            {"status": status, "reason": reason, "time": time.time(),
             "by": "local-cloud"}).encode())
    except (StoreError, OSError) as e:
        log.warning("cannot write the result of %s: %s", store_uri, e)


def _write_stopped_result(store_uri: Any) -> None:
    """After a forced terminate the job cannot go on: record that, unless it ended."""
    if not store_uri:
        return
    body = {"status": "stopped", "reason": "the capacity group was terminated",
            "time": time.time(), "by": "local-cloud"}
    with contextlib.suppress(StoreError):
        open_store(str(store_uri)).put_if_absent(RESULT, json.dumps(body).encode())


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) or "the log is empty"


def _check_max_price(max_price: Any, instance_types: tuple[str, ...], region: str) -> None:
    if isinstance(max_price, bool) or not isinstance(max_price, (int, float)) or max_price <= 0:
        raise SpecError(f"max_price must be a positive price in USD per hour, not {max_price!r}")
    lowest = min(
        (min(p for _, p in catalog.price_trace(t, region, pool.az).points), pool.name)
        for t in instance_types for pool in catalog.pools(t, region)
    )
    if max_price < lowest[0]:
        raise SpecError(
            f"max_price ${max_price:g}/h is below every spot price the local cloud has for "
            f"{', '.join(instance_types)} in {region} (lowest ${lowest[0]:.4f}/h in "
            f"{lowest[1]}): the job would never start. Raise max_price or leave it unset."
        )


def _check_simulation(sim: dict[str, Any] | None) -> None:
    if sim is None:
        return
    usage = ("simulate_interruptions must be {'count': N} or {'schedule': [seconds, ...]}, "
             f"not {sim!r}")
    if not isinstance(sim, dict) or not set(sim) <= {"count", "schedule"} or not sim:
        raise SpecError(usage)
    count = sim.get("count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise SpecError(usage)
    schedule = sim.get("schedule", [])
    if not isinstance(schedule, (list, tuple)) or any(
            isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in schedule):
        raise SpecError(usage)
