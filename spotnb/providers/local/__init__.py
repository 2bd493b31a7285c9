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
are refused with :class:`~spotnb.protocol.spec.SpecError` before anything starts):

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
    For ``simulate_interruptions={"count": N}``: an attempt is interrupted at its first
    sign of life after its first durable checkpoint, or this many seconds after that
    checkpoint; without a checkpoint, this many seconds after the cell's first output
    (three times as long after the cell started, while it shows nothing). Default 20.
``SPOTNB_LOCAL_STOP_GRACE`` [stop_grace]
    Seconds the agent has to finish by itself after a stop request (or after writing
    the result) before its instance is terminated. Default 15.
``SPOTNB_LOCAL_AGENT_CMD`` [agent_cmd]
    The command an instance runs instead of ``python -m spotnb.kernel_remote``
    (``--job <store-uri>`` is appended). For tests and for debugging agents.
``SPOTNB_LOCAL_INSTANCE_ENV`` [instance_env]
    Comma-separated names (or ``PREFIX*``) of this machine's environment variables that
    every local instance gets, like variables baked into an AMI. Default none.

An instance's metadata service gives the rebalance recommendation as EC2's does: some
minutes before its notice, with it, not at all, or with no notice after it, drawn by
:mod:`.signals` (the job's ``simulate_signals``, else the model's defaults, figures
from AWS's documentation and field reports); leads are market time.

An instance starts with a clean environment, as an EC2 instance does: not the user's
credentials, tokens or other variables, only what runs the same Python and spotnb
(``PATH``, ``HOME``, locale, ``PYTHONPATH``, the library path, ``SPOTNB_*``); see
:func:`.state.instance_base_environment`. A job passes more on purpose with
``env=`` (``%%spot_train --env NAME[=VALUE]``). A job's secrets (``--secret NAME``)
are kept in ``$SPOTNB_HOME/secrets/<job-id>.json`` (mode 0600, outside the store;
:mod:`spotnb.protocol.secretstore`), which the agent reads at its start; the file is deleted
when the job's supervisor ends, by ``terminate`` and by ``cleanup``.

``cleanup`` plans before it acts (:meth:`LocalProvider.cleanup_plan`): the dry run
prints the plan, the real run carries it out, action for action.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from spotnb.protocol import secretstore
from spotnb.protocol.layout import RESULT, SPEC
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import StoreError, file_lock, open_store, upload_mbps
from spotnb.providers import PoolPrice, Provider, ProviderError, catalog
from spotnb.providers.local.state import (
    CONTROL_DIR,
    ENV_CLOUD_MARK,
    ENV_INSTANCE_MARK,
    ENV_JOB_MARK,
    ENV_SOCKET_DIR,
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

__all__ = ["CleanupAction", "LocalProvider", "Settings", "abandoned_socket_dirs"]

log = logging.getLogger(__name__)

# How long launch() waits for the supervisor to report that it is up.
LAUNCH_TIMEOUT_SECONDS = 10.0
# How long terminate() lets the supervisor end its instances before doing it itself.
TERMINATE_TIMEOUT_SECONDS = 10.0
# Grace for a supervisor killed from outside: on SIGTERM it ends its instances first.
SUPERVISOR_KILL_GRACE_SECONDS = 5.0
_POLL_SECONDS = 0.05
# A supervisor is no process of an instance, also when an instance's reaper starts it
# (spotnb.providers.local.reaper): it is started without the instance's variables.
_INSTANCE_VARIABLES = (ENV_INSTANCE_MARK, ENV_JOB_MARK, ENV_CLOUD_MARK, ENV_SOCKET_DIR)


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

    def launch(self, spec: JobSpec, secrets: Mapping[str, str] | None = None) -> None:
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
        if spec.secrets:
            secretstore.write_local(spec.job_id, secretstore.values_for(spec.secrets, secrets))
        self._start_supervisor(spec.job_id, store.uri, adopt=False)

    def read_secrets(self, spec: JobSpec) -> dict[str, str]:
        """See the contract: from the job's 0600 file."""
        if not spec.secrets:
            return {}
        return secretstore.read_local(spec.job_id, spec.secrets)

    def _start_supervisor(self, job_id: str, store_uri: str, adopt: bool) -> None:
        """Start the job's supervisor and wait until it says it is up; ProviderError
        (after killing what was started) if it does not."""
        home = group_dir(job_id)
        log_path = home / "supervisor.log"
        cmd = [sys.executable, "-m", "spotnb.providers.local.group", "--job", store_uri]
        if adopt:
            cmd.append("--adopt")
        deadline = time.monotonic() + LAUNCH_TIMEOUT_SECONDS
        env = {k: v for k, v in os.environ.items() if k not in _INSTANCE_VARIABLES}
        with open(log_path, "ab") as out:
            starter = subprocess.Popen(cmd, cwd=home, env=env, stdin=subprocess.DEVNULL,
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
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
        if not store_uri:
            return None
        if _has_result(store_uri):
            return self._close_books(job_id, str(store_uri))
        with file_lock(home / "restart.lock"):
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

    def _close_books(self, job_id: str, store_uri: str) -> str | None:
        """A job that ended while its supervisor was gone: its instances were never
        logged as terminated, its group never as exited. A supervisor started with
        ``--adopt`` does both (it ends what is left, finds the result, and exits)."""
        home = group_dir(job_id)
        with file_lock(home / "restart.lock"):
            info = read_json(home / GROUP_FILE) or {}
            if _alive(info) or info.get("state") == "exited":
                return None
            log.info("job %s ended while its supervisor was gone; closing its books",
                     job_id)
            try:
                self._start_supervisor(job_id, store_uri, adopt=True)
            except ProviderError as err:
                log.warning("could not log the end of job %s's instances: %s", job_id, err)
                return None
        return "logged the end of the job's instances (its supervisor had died)"

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

    def kill(self, job_id: str, instance: str | None = None) -> None:
        """See the contract: the supervisor SIGKILLs the instance's agent and everything
        it started at once (no notice, no grace), as a machine lost outright."""
        self._fault(job_id, "kill", instance)

    def freeze(self, job_id: str, instance: str | None = None) -> None:
        """Freeze the instance (SIGSTOP of the agent and everything it started): a node
        gone silent, not dead. Nothing answers; its peers go on without it after the
        job's peer timeout. The group ends it when the job ends."""
        self._fault(job_id, "freeze", instance)

    def recommend(self, job_id: str, instance: str | None = None) -> None:
        """Publish a rebalance recommendation for the instance, as EC2 would: the job
        saves at once and its group starts a warm standby (a false alarm unless an
        interruption follows; :meth:`interrupt` gives the notice)."""
        self._fault(job_id, "recommend", instance)

    def _fault(self, job_id: str, kind: str, instance: str | None) -> None:
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        if info is None or not _alive(info):
            raise ProviderError(f"job {job_id} has no running capacity group to {kind}")
        _request(home, kind, instance=instance)
        log.info("requested a %s of job %s's instance %s", kind, job_id,
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
        secretstore.delete_local(job_id)
        if info is not None:
            _write_stopped_result(info.get("store_uri"))

    def cleanup(self, dry_run: bool = False) -> list[str]:
        """See the contract. The dry run and the real run describe the same
        :meth:`cleanup_plan`, action for action: ``would ...`` or ``did ...``."""
        done = []
        for action in self.cleanup_plan():
            if not dry_run:
                action.apply()
            done.append(f"{'would' if dry_run else 'did'} {action.what}")
        return done

    def cleanup_plan(self) -> list[CleanupAction]:
        """Everything a cleanup does now, in order: kill what is left of jobs that ended
        or lost their supervisor, then remove their directories, then the socket
        directories that killed agents left in the temporary directory. A running job
        (its supervisor alive, no result) is left alone.
        """
        kills: list[CleanupAction] = []
        removals: list[CleanupAction] = []
        live_jobs = set()
        covered: set[int] = set()  # pids some action already kills
        instances_of: dict[str, list[Path]] = {}
        for home in _subdirs(instances_dir()):
            job = (read_json(home / "meta.json") or {}).get("job_id")
            instances_of.setdefault(str(job), []).append(home)
        groups = {home.name: home for home in _subdirs(groups_dir())}
        for job_id in sorted(set(groups) | set(instances_of) - {"None"}):
            info = (read_json(groups[job_id] / GROUP_FILE) if job_id in groups else None) or {}
            alive = _alive(info)
            finished = _has_result(info.get("store_uri") or _instance_store(instances_of,
                                                                                 job_id))
            if alive and not finished:
                live_jobs.add(job_id)
                continue
            # Step 1: processes. A supervisor still up after its job's result, then the
            # instance processes that outlived their group.
            supervisor = ProcessRecord.from_dict(info.get("supervisor")) if alive else None
            if supervisor is not None:
                covered |= _family(supervisor)
                kills.append(CleanupAction(
                    f"stop the capacity group of job {job_id} (pid {supervisor.pid}): its "
                    "job has a result", _kill_action(supervisor, SUPERVISOR_KILL_GRACE_SECONDS)))
            for home in instances_of.get(job_id, []):
                record = ProcessRecord.from_dict(read_json(home / "pid.json"))
                if record is not None and record.alive() and record.pid not in covered:
                    covered |= _family(record)
                    kills.append(CleanupAction(
                        f"kill orphan instance {home.name} of job {job_id} (pid {record.pid})",
                        _kill_action(record, 1.0)))
            # Step 2: its directories in the local cloud (the job's history stays in
            # its store: `spotnb logs` still shows it).
            dirs = ([groups[job_id]] if job_id in groups else []) + instances_of.get(job_id, [])
            if secretstore.local_path(job_id).exists():
                dirs.append(secretstore.local_path(job_id))
            count = len(instances_of.get(job_id, []))
            instances = f"{count} instance director{'y' if count == 1 else 'ies'}"
            if job_id not in groups:
                what = f"the {instances} of job {job_id} (its capacity group is gone)"
            elif finished and not alive:
                what = (f"the logs of finished job {job_id} (its capacity group and "
                        f"{instances}; its history stays in its store)")
            else:
                why = "its job has a result" if finished else "its supervisor is gone"
                what = f"capacity group {job_id} ({why}) and its {instances}"
            removals.append(CleanupAction(f"remove {what}", _remove_action(dirs)))
        for path in _subfiles(secretstore.local_dir()):
            job_id = path.name.removesuffix(".json")
            if job_id not in groups and job_id not in instances_of:
                removals.append(CleanupAction(
                    f"remove the secrets of job {job_id} (it has no capacity group)",
                    _remove_action([path])))
        for home in instances_of.get("None", []):
            removals.append(CleanupAction(f"remove the unreadable instance directory {home}",
                                          _remove_action([home])))
        for proc, instance_id, job_id in marked_processes():
            if job_id in live_jobs or proc.pid in covered:
                continue
            kills.append(CleanupAction(
                f"kill orphan process {proc.pid} of instance {instance_id} (job {job_id})",
                _kill_processes_action(proc)))
        for path in abandoned_socket_dirs():
            removals.append(CleanupAction(
                f"remove {path}, left by a killed agent (it holds its kernel's connection "
                "file, with the kernel's key)", _remove_action([path])))
        return kills + removals

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
        secretstore.delete_local(job_id)


@dataclasses.dataclass(frozen=True)
class CleanupAction:
    """One step of a cleanup: ``what`` it does, in words, and ``apply`` to do it."""

    what: str
    apply: Callable[[], None]


def _family(record: ProcessRecord) -> set[int]:
    """The pids of a recorded process and its descendants (killing it kills them)."""
    proc = record.process()
    if proc is None:
        return set()
    try:
        return {proc.pid, *(child.pid for child in proc.children(recursive=True))}
    except psutil.Error:
        return {proc.pid}


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _instance_store(instances_of: dict[str, list[Path]], job_id: str) -> str | None:
    """The job's store URI from one of its instances' records (its group may be gone)."""
    for home in instances_of.get(job_id, []):
        uri = (read_json(home / "meta.json") or {}).get("store_uri")
        if uri:
            return str(uri)
    return None


def _subfiles(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.json") if p.is_file()) if path.is_dir() else []


def _kill_action(record: ProcessRecord, grace: float) -> Callable[[], None]:
    def apply() -> None:
        kill_tree(record, grace=grace)  # verifies the pid is still that process first
    return apply


def _kill_processes_action(proc: Any) -> Callable[[], None]:
    def apply() -> None:
        kill_processes([proc], grace=1.0)
    return apply


def _remove_action(paths: list[Path]) -> Callable[[], None]:
    def apply() -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return apply


# The agent keeps the runtime's socket and its kernel's sockets and connection file
# (which holds the kernel's key) in a directory made with tempfile.mkdtemp(prefix=...).
AGENT_SOCKET_DIR_PREFIX = "spotnb-"


def abandoned_socket_dirs() -> list[Path]:
    """This user's agent socket directories in the temporary directory that no live
    process uses: left by agents that were killed (a clean exit removes its own).

    A directory counts once it holds the agent's socket or a kernel connection file
    (an agent binds its socket as it starts), and is abandoned when none of its sockets
    is bound any more (``/proc/net/unix``). Where that cannot be read, nothing is
    reported: a live agent's directory must never be removed.
    """
    bound = _bound_unix_sockets()
    if bound is None:
        return []
    found = []
    me = os.getuid()
    for path in sorted(Path(tempfile.gettempdir()).glob(AGENT_SOCKET_DIR_PREFIX + "*")):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != me:
                continue
            names = [p.name for p in path.iterdir()]
        except OSError:
            continue
        if "agent.sock" not in names and not any(re.fullmatch(r"k\d+\.json", n) for n in names):
            continue
        if any(str(path / name) in bound for name in names):
            continue
        found.append(path)
    return found


def _bound_unix_sockets() -> set[str] | None:
    """The paths of every bound Unix socket on this machine, or None if unknown."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    # Num RefCount Protocol Flags Type St Inode [Path]
    return {parts[7] for line in lines if len(parts := line.split(None, 7)) == 8}


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
