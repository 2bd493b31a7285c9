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
    Comma-separated instance types (``g5.xlarge``), pools (``g5.xlarge@use1-az4``),
    regions (``us-east-1``) or types in a region (``g5.xlarge@us-east-1``) that have no
    spot capacity: launches there fail with ``InsufficientInstanceCapacity``, and the
    simulated Spot placement scores there are 1. Instances already running there go on
    (EC2 takes capacity back by interrupting them: ``interrupt``, the hazard). Read
    again at every launch, so the config file can switch a shortage on and off while a
    job runs. A name the catalog does not know is refused.
``SPOTNB_LOCAL_NO_CAPACITY_SECONDS`` [no_capacity_seconds]
    How long the shortage of ``no_capacity`` lasts: this many real seconds from the
    start of each job's capacity group, then the capacity is back. Unset: for as long
    as ``no_capacity`` names it.
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

Regions: the market has every region of the bundled catalog, each pool (a type in an
AZ) with a price trace of its own (:func:`spotnb.providers.catalog.price_trace`, whose
``source`` every ``price`` event names): the real price history of that type in that
region where the bundled history has it (p2 and p3 types in us-east-1, us-east-2,
us-west-2, eu-west-1 and eu-central-1, p3 in eu-west-2 too, from 2019-12 to 2020-03;
g5.12xlarge and g5.48xlarge in us-east-1, g4dn.2xlarge in us-west-1, g4ad.2xlarge in
eu-central-1, p2.8xlarge in ap-northeast-1 on 2022-05-31: ``spotnb/data/SOURCES.md``),
else the shape of a related type's longest real trace scaled to the pool's catalog spot
price in that region. A job with several regions starts in the one with the lowest
expected cost among those with capacity, and moves to the next after repeated launches
without capacity (:mod:`.failover`); every region reads and writes the job's one store,
and the checkpoint's crossings are billed as AWS would bill them.

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

``cleanup`` plans before it acts (:mod:`.cleanup`): the dry run prints the plan, the
real run carries it out, action for action. What a job is refused before it starts:
:mod:`.checks`.
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotnb.protocol import secretstore
from spotnb.protocol.layout import RESULT, SPEC
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import Store, StoreError, file_lock, open_store, upload_mbps
from spotnb.providers import PoolPrice, Provider, ProviderError, catalog
from spotnb.providers.local import control
from spotnb.providers.local.checks import check_max_price, check_simulation, check_type
from spotnb.providers.local.cleanup import CleanupAction, abandoned_socket_dirs, cleanup_plan
from spotnb.providers.local.groupfile import (
    SUPERVISOR_KILL_GRACE_SECONDS,
    has_result,
    supervisor_alive,
)
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
    instances_dir,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
)

__all__ = ["CleanupAction", "LocalProvider", "Settings", "abandoned_socket_dirs"]

log = logging.getLogger(__name__)

# How long launch() waits for the supervisor to report that it is up.
LAUNCH_TIMEOUT_SECONDS = 10.0
# How long terminate() lets the supervisor end its instances before doing it itself.
TERMINATE_TIMEOUT_SECONDS = 10.0
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
            check_type(instance_type, res.regions)
        if res.max_price is not None:
            check_max_price(res.max_price, res.instance_types, res.regions)
        check_simulation(spec.simulate_interruptions)
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
        if info is not None and supervisor_alive(info):
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
            if info is not None and info.get("state") == "ready" and supervisor_alive(info):
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

    def ensure_supervised(self, job_id: str, spec: JobSpec | None = None,
                          store: Store | None = None) -> str | None:
        """See the contract: if the job has no result and its supervisor is gone (killed,
        crashed, a reboot), start a new one that adopts its instances. If that fails,
        end the job with a failed result that says why. Returns what was done, or None.
        """
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        if info is None or supervisor_alive(info):
            return None
        store_uri = info.get("store_uri")
        if not store_uri:
            return None
        if has_result(store_uri):
            return self._close_books(job_id, str(store_uri))
        with file_lock(home / "restart.lock"):
            info = read_json(home / GROUP_FILE) or info
            if supervisor_alive(info) or has_result(store_uri):
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
            if supervisor_alive(info) or info.get("state") == "exited":
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
        if info is None or not supervisor_alive(info):
            raise ProviderError(f"job {job_id} has no running capacity group to interrupt")
        control.send(home, "interrupt", instance=instance)
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
        if info is None or not supervisor_alive(info):
            raise ProviderError(f"job {job_id} has no running capacity group to {kind}")
        control.send(home, kind, instance=instance)
        log.info("requested a %s of job %s's instance %s", kind, job_id,
                 instance or "(the first running)")

    def terminate(self, job_id: str) -> None:
        home = group_dir(job_id)
        info = read_json(home / GROUP_FILE)
        supervisor = ProcessRecord.from_dict(info.get("supervisor")) if info else None
        # Step 1: ask the supervisor, which ends its instances and writes the result.
        if supervisor is not None and supervisor.alive():
            control.send(home, "terminate")
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
        """Everything a cleanup does now, in order (:func:`.cleanup.cleanup_plan`)."""
        return cleanup_plan()

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
        return None if info is None else {**info, "alive": supervisor_alive(info)}

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
