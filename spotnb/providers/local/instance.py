"""One local-cloud instance: its metadata service, its agent process, its record on disk.

This is the "EC2" half of the local cloud: it creates, boots, warns and terminates an
instance. *When* to do which is the capacity group's business (:mod:`.group`,
:mod:`.interruptions`, :mod:`.standbys`).

An instance lives in ``instances/<instance_id>/`` under the cloud directory:
``meta.json`` (what and where it is, its state: enough for a new supervisor to adopt
it, see :meth:`LocalInstance.adopt`), ``pid.json`` (the
:class:`~.state.ProcessRecord` of the instance's first process, :mod:`.reaper`, whose
child the agent is), ``agent.log`` (the agent's stdout and stderr), and the
agent's working directory itself.

Terminating an instance ends every process it started, however detached (a new
session, a double fork, a child started with ``env={}``): they stay below the
instance's first process, a child subreaper that ends its tree when the agent ends
(:mod:`.reaper`); the instance's process tree is ended, then every process that still
carries the instance's marker variable or runs in its directory
(:func:`~.state.marked_processes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from spotnb.protocol import billing
from spotnb.providers.catalog import Pool
from spotnb.providers.imds import ENV_HOOK_SECONDS
from spotnb.providers.local.imds import ImdsServer, InstanceIdentity, iso_utc
from spotnb.providers.local.market import Market
from spotnb.providers.local.state import (
    ProcessRecord,
    az_name,
    instance_base_environment,
    instance_dir,
    instance_environment,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
    write_json,
)

__all__ = ["LocalInstance"]

log = logging.getLogger(__name__)

AGENT_LOG = "agent.log"
REAPER_MODULE = "spotnb.providers.local.reaper"


@dataclasses.dataclass
class LocalInstance:
    """A simulated spot instance (mutable: the group updates it as it lives)."""

    id: str
    index: int  # 1 for the job's first instance, 2 for its first replacement, ...
    pool: Pool
    market: Market
    imds: ImdsServer
    dir: Path
    launched: float
    boot_until: float
    price: float
    next_price_change: float | None
    hazard_at: float | None
    proc: subprocess.Popen[bytes] | None = None
    # An agent started by an earlier supervisor of the job (this one adopted it).
    adopted: ProcessRecord | None = None
    running_since: float | None = None
    notice_reason: str | None = None
    terminate_at: float | None = None
    ended: float | None = None
    end_reason: str | None = None
    cell_started: float | None = None  # when its attempt started running the cell
    first_output: float | None = None  # the cell's first output or metric
    durable_at: float | None = None  # first durable checkpoint of its attempt
    progressed: bool = False  # any event of its attempt after that checkpoint
    rebalance_at: float | None = None  # its last rebalance recommendation
    standby_due: float | None = None  # a standby waiting for its first hour to end
    standby_later: bool = False  # a recommendation asked again (it did not run the job)
    next_false_alarm: float | None = None  # when its next drawn false alarm comes
    price_risk_at: float | None = None  # when the price first rises above max_price
    # A warm standby: the instance it stands by for, and whether it is on hold (not yet
    # the job's instance: given back if it is not ready within its hold).
    standby_for: str | None = None
    on_hold: bool = False
    standby_ready: bool = False

    @classmethod
    def create(cls, pool: Pool, market: Market, index: int, now: float, boot_seconds: float,
               hazard_at: float | None, **meta: Any) -> LocalInstance:
        """RunInstances: a new instance id, its directory and its metadata service."""
        instance_id = "i-" + secrets.token_hex(9)[:17]
        home = instance_dir(instance_id)
        home.mkdir(parents=True)
        identity = InstanceIdentity(
            instance_id=instance_id, instance_type=pool.instance_type, region=pool.region,
            az=az_name(pool.region, pool.az), az_id=pool.az,
            ami_id="ami-" + hashlib.sha256(f"spotnb-local-{pool.region}".encode()).hexdigest()[:17],
            launched=now,
        )
        inst = cls(
            id=instance_id, index=index, pool=pool, market=market,
            imds=ImdsServer(identity).start(), dir=home, launched=now,
            boot_until=now + boot_seconds, price=market.price_at(now),
            next_price_change=market.next_change_after(now), hazard_at=hazard_at,
        )
        write_json(home / "meta.json", {
            **inst.describe(), **meta, "region": pool.region, "az_name": identity.az,
            "launched": now, "imds_endpoint": inst.imds.endpoint, "state": "pending",
            "price_source": market.source, "index": index, "boot_until": now + boot_seconds,
            "hazard_at": hazard_at, "ami_id": identity.ami_id,
        })
        return inst

    @classmethod
    def adopt(cls, meta: dict[str, Any], pool: Pool, market: Market,
              now: float) -> LocalInstance:
        """Take over an instance that an earlier supervisor of the job started.

        Its metadata service comes back on the same endpoint (the agent knows only that
        one) with the same notice state. Raises OSError if the port is taken.
        """
        instance_id = str(meta["instance_id"])
        identity = InstanceIdentity(
            instance_id=instance_id, instance_type=pool.instance_type, region=pool.region,
            az=az_name(pool.region, pool.az), az_id=pool.az,
            ami_id=str(meta.get("ami_id") or "ami-local"),
            launched=float(meta["launched"]),
        )
        port = int(str(meta["imds_endpoint"]).rsplit(":", 1)[1])
        imds = ImdsServer(identity, port=port).start()
        home = instance_dir(instance_id)
        inst = cls(
            id=instance_id, index=int(meta.get("index") or 1), pool=pool, market=market,
            imds=imds, dir=home, launched=float(meta["launched"]),
            boot_until=float(meta.get("boot_until") or meta["launched"]),
            price=market.price_at(now), next_price_change=market.next_change_after(now),
            hazard_at=meta.get("hazard_at"),
            adopted=ProcessRecord.from_dict(read_json(home / "pid.json")),
            running_since=meta.get("running_since"),
        )
        if meta.get("rebalance_at") is not None:
            inst.rebalance_at = float(meta["rebalance_at"])
            imds.set_rebalance(inst.rebalance_at)
        if meta.get("standby_due") is not None and meta.get("terminate_at") is None:
            inst.standby_due = float(meta["standby_due"])
        if meta.get("terminate_at") is not None:
            inst.notice_reason = meta.get("notice_reason")
            inst.terminate_at = float(meta["terminate_at"])
            imds.set_instance_action(inst.terminate_at)
        inst.update_meta(adopted_at=now)
        return inst

    @property
    def log_path(self) -> Path:
        return self.dir / AGENT_LOG

    def describe(self) -> dict[str, Any]:
        """The fields every instance event carries."""
        return {"instance_id": self.id, "instance_type": self.pool.instance_type,
                "az": self.pool.az, "pool": self.pool.name}

    def spawn(self, cmd: list[str], job_id: str, now: float, passed: Sequence[str] = (),
              grace: float = 1.0, hook_seconds: float | None = None) -> None:
        """Boot: start the agent, detached, in the instance directory, below the
        instance's first process (:mod:`.reaper`; ``grace``: what it gives the agent's
        leftovers between SIGTERM and SIGKILL). Raises OSError.

        The agent gets a clean environment, as on EC2 (:func:`.state.instance_base_environment`):
        none of this machine's variables but the basics and ``passed`` (names or
        ``PREFIX*``). ``hook_seconds``: the wait of the group's termination hook (its
        notice period, in the local cloud's compressed time)."""
        env = {**instance_base_environment(os.environ, passed),
               "SPOTNB_IMDS_ENDPOINT": self.imds.endpoint,
               **instance_environment(self.id, job_id)}
        if hook_seconds is not None:
            env[ENV_HOOK_SECONDS] = f"{hook_seconds:g}"
        self.running_since = now
        # The instance's first process (its "OS"): ends the agent's whole tree when the
        # agent ends, however it ended or its descendants detached, and asks for a
        # supervisor if this one (named: its pid) is gone (spotnb.providers.local.reaper).
        # Started with the same interpreter as the agent's default.
        cmd = [sys.executable, "-m", REAPER_MODULE, f"{grace:g}", str(os.getpid()), "--",
               *cmd]
        try:
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(
                    cmd, cwd=self.dir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            with open(self.log_path, "a") as out:
                out.write(f"spotnb local cloud: cannot start the agent {cmd}: {e}\n")
            raise
        # If it already exited there is nothing to record; the group sees the exit next tick.
        with contextlib.suppress(psutil.Error):
            write_json(self.dir / "pid.json", ProcessRecord.of(self.proc.pid, cmd).to_dict())
        self.update_meta(state="running", pid=self.proc.pid, command=cmd, running_since=now)

    @property
    def started(self) -> bool:
        """Whether its agent was started (by this supervisor or an earlier one)."""
        return self.proc is not None or self.adopted is not None

    def exit_code(self) -> int | None:
        """The agent's exit code once it has exited by itself, else None (-1 for an
        adopted agent, whose code nobody can read)."""
        if self.proc is not None:
            return self.proc.poll()
        if self.adopted is not None:
            return None if self.adopted.alive() else -1
        return None

    def recommend_rebalance(self, now: float) -> None:
        """EC2's rebalance recommendation: the instance is at elevated risk."""
        self.rebalance_at = now
        self.imds.set_rebalance(now)
        self.update_meta(rebalance_at=now)

    def notice(self, now: float, notice_seconds: float, reason: str) -> None:
        """EC2's interruption notice (``spot/instance-action``); a rebalance
        recommendation is :meth:`recommend_rebalance`'s."""
        self.notice_reason = reason
        self.terminate_at = now + notice_seconds
        self.imds.set_instance_action(self.terminate_at)
        self.update_meta(state="marked-for-termination", notice_reason=reason,
                         termination_time=iso_utc(self.terminate_at), notice_at=now,
                         terminate_at=self.terminate_at)

    def end_through_hook(self, now: float, hook_seconds: float) -> None:
        """Auto Scaling's end of an instance whose standby is in service (capacity
        rebalancing): ``autoscaling/target-lifecycle-state`` becomes ``Terminated`` and
        the termination lifecycle hook waits up to ``hook_seconds`` (the agent reads it
        as its notice: final save, lease released)."""
        self.notice_reason = "rebalanced"
        self.terminate_at = now + hook_seconds
        self.imds.set_target_lifecycle_state("Terminated")
        self.update_meta(state="terminating", notice_reason="rebalanced",
                         termination_time=iso_utc(self.terminate_at), notice_at=now,
                         terminate_at=self.terminate_at)

    def terminate(self, now: float, grace: float, reason: str) -> float:
        """SIGTERM the agent and its descendants, ``grace`` seconds, SIGKILL; stop the
        metadata service. Returns what the instance cost."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                family = [psutil.Process(self.proc.pid)]
                family += family[0].children(recursive=True)
            except psutil.NoSuchProcess:
                family = []
            kill_processes(family, grace)
        if self.proc is not None:
            self.proc.wait()  # reap it: the group is its parent
        if self.adopted is not None:
            kill_tree(self.adopted, grace)
        # Whatever the instance started that left the agent's tree (a new session, a
        # double fork whose parent died with the agent) still carries its marker.
        strays = [proc for proc, instance, _ in marked_processes() if instance == self.id]
        if strays:
            log.info("ending %d process(es) that instance %s started", len(strays), self.id)
            kill_processes(strays, grace)
        self.imds.stop()
        self.ended, self.end_reason = now, reason
        self.update_meta(state="terminated", reason=reason, ended=now)
        return self.cost(now)

    def family(self) -> list[psutil.Process]:
        """Its agent and the agent's descendants (kernels included), while it runs."""
        if self.proc is not None and self.proc.poll() is None:
            pid = self.proc.pid
        elif self.adopted is not None and self.adopted.alive():
            pid = self.adopted.pid
        else:
            return []
        try:
            root = psutil.Process(pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill_now(self) -> None:
        """A machine lost outright: SIGKILL its agent and everything the agent started
        at once (no notice, no grace). Ending it is :meth:`terminate`'s."""
        for proc in self.family():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def freeze(self) -> None:
        """A node gone silent: SIGSTOP its agent and everything the agent started."""
        for proc in self.family():
            with contextlib.suppress(psutil.Error):
                proc.suspend()

    def age(self, now: float) -> float:
        """Market seconds since its launch (the local cloud compresses time)."""
        return (now - self.launched) * self.market.time_scale

    def cost(self, now: float) -> float:
        """What it billed until ``now`` (or its end): its pool's price over the time it
        ran, nothing if EC2 (the market) interrupted it in its first hour."""
        end = self.ended if self.ended is not None else now
        if self.ended is not None and billing.free_of_charge(self.end_reason, self.age(end)):
            return 0.0
        return self.market.cost(self.launched, end)

    def update_meta(self, **fields: Any) -> None:
        path = self.dir / "meta.json"
        write_json(path, {**(read_json(path) or {}), **fields})
