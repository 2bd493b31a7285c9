"""The local cloud's capacity group: a supervisor process that keeps a job's instances
running (one; a multi-node job's ``max_nodes``).

Run as ``python -m spotnb.providers.local.group --job <store-uri>`` (the provider does
this, detached). It reads ``spec.json`` from the job's store prefix, writes the group's
events to stream 0 (``events/000000/``), and loops every :data:`TICK_SECONDS` until the
job ends. It plays both EC2 (instances, markets, interruptions) and the Auto Scaling
group (replace what was lost, whether or not anyone is watching).

A job's life, as the supervisor sees it::

    launch: pick a pool -> i-1 launched -> boot delay -> agent process spawned
    rebalance recommendation -> a warm standby launched -> once it is ready, the old
        instance ended through its termination hook (its agent saves and releases the
        lease; ended once released); given back if not ready within STANDBY_HOLD_SECONDS
        (a multi-node job's: a standby for the recommended node, which takes that
        node's slot and joins the world in its place)
    interruption: (a recommendation minutes before, or none) -> notice
        (spot/instance-action) -> notice period
        -> SIGTERM the instance's process group, 1 s, SIGKILL -> terminated
        -> launch a replacement i-2 (back to "launch")
    agent exits with result.json in the store -> job-finished -> supervisor exits
    agent exits without a result -> instance failed -> replace it; the 5th such exit in
        a row within 30 s of starting -> result "failed" -> supervisor exits
    control/stop.json (notebook, CLI, or the budget/deadline check here) -> no new
        instances; the agent has stop_grace (15 s) to finish by itself -> terminate it
        -> result "stopped" unless the agent wrote one -> supervisor exits

The store may fail (a full or read-only disk, a bucket out of reach): the supervisor
keeps its local duties (notices, terminations) and retries the store every tick; an
agent that gave up on the store (exit code 4) is replaced only after a backoff
(:data:`STORE_BACKOFF_SECONDS` doubling), never in a storm. A result it must write
(crash loop, stop) waits in ``group.json`` (``pending_result``) until the store takes
it; after :data:`STORE_OUTAGE_SECONDS` without the store the supervisor exits, saying
so in ``group.json``, and the next spotnb command that looks at the job starts a new one.

Supervisor death (a crash, SIGKILL, a laptop that rebooted): any spotnb entry point
that finds the job without a result and without a live supervisor starts a new one
with ``--adopt`` (:meth:`spotnb.providers.local.LocalProvider.ensure_supervised`), and
so does an instance whose supervisor is gone when it boots or when its agent ends
(:mod:`.reaper`). It takes over the instances still running (their metadata service
comes back on the same port, notices included), ends those whose termination was due
and those it cannot adopt, writes a pending result, and carries on: the job resumes as
after an interruption.

Pools are tried in the spec's order of instance types, cheapest AZ first (at the
current market price). A pool without simulated capacity, or above ``max_price``, is
skipped with a ``capacity_error`` event; when no pool can launch the group retries
every :data:`CAPACITY_RETRY_SECONDS`, forever (until stop, budget or deadline).

Multi-node jobs: the group keeps ``max_nodes`` instances, each with its own metadata
service (its own notices), launched and replaced one by one exactly as the one instance
of a single-node job; the job ends for all of them with its result. A warm standby is
one node's: it waits for that node's slot outside the rendezvous
(:class:`spotnb.kernel_remote.standby.NodeStandby`), and the node ended through its
termination hook is done once it released its slot's lease. A standby that takes the
slot of another node, lost meanwhile, is that node's replacement and no longer on hold.
Only a recommendation that comes before its node's notice starts one: one that comes
with the notice (in its tick) has nothing to warm ahead of, and a standby launched then
would only be the lost node's replacement, launched before the node is gone (the world
would count one node too many while it is).

Recommendations on request (``LocalProvider.recommend``: reason ``requested``, no
notice follows) come at the next tick, for tests that must aim them at a moment.

Interruptions: on request (``LocalProvider.interrupt``: reason ``requested``; of one
named instance, or of the first running one not yet under notice; every request read in
a tick is its own notice); the
spec's ``simulate_interruptions`` ``{"count": N}`` (reason ``simulated``: once an
instance's attempt has a durable checkpoint and any later event, or after
``interrupt_after`` seconds after the first output of a cell without any checkpoint;
see ``_simulated_due``) or
``{"schedule": [s, ...]}``
(reason ``scheduled``, seconds since the first launch); the market price rising above
``max_price`` (``price``); and the Spot Advisor's interruption rate (``hazard``).

Rebalance recommendations (:mod:`.signals`: the job's ``simulate_signals`` or the
model's defaults): for each interruption the group knows ahead (``hazard``,
``scheduled``, ``price``), one ``lead`` before its notice (market seconds over
``time_scale``; no earlier than the instance's launch) or none (``no_recommendation``);
false alarms, recommendations no notice follows, at ``false_alarms_per_interruption``
times the instance's Spot Advisor rate (with ``hazard``) and the schedule's rate over
its span, and at the model's ``false_alarms`` times; an interruption nobody could know
ahead (``requested``, ``simulated``) brings its recommendation with its notice, as
EC2's sometimes does. Each is published at the instance's metadata service and logged
as an ``instance`` event with action ``rebalance`` and the reason it stands for
(``false-alarm`` for a false alarm).

Faults without notice, on request: ``LocalProvider.kill`` (the agent and everything it
started SIGKILLed at once; ``terminated`` with reason ``killed``, then replaced) and
``LocalProvider.freeze`` (SIGSTOPped: a node gone silent, ``frozen``; ended with the job).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import random
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from spotnb.protocol import billing, layout, lease, secretstore
from spotnb.protocol.backoff import Backoff
from spotnb.protocol.events import GROUP_STREAM, Event, EventReader, EventWriter, codec
from spotnb.protocol.events.fold import fold
from spotnb.protocol.events.live import Follower, request_stop
from spotnb.protocol.layout import RESULT, SPEC, STOP
from spotnb.protocol.signals import SignalModel
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import NotFound, Store, StoreError, open_store
from spotnb.providers import catalog
from spotnb.providers.catalog import Pool
from spotnb.providers.local.imds import iso_utc
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.market import Market
from spotnb.providers.local.state import (
    CONTROL_DIR,
    GROUP_FILE,
    ProcessRecord,
    Settings,
    az_name,
    group_dir,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
    write_json,
)

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
# The group's events are few and each matters to a follower (launches, notices): write
# them within this long.
GROUP_FLUSH_SECONDS = 0.5
# The store is read less often than the local control directory: on S3 it costs requests.
STORE_POLL_SECONDS = 0.5
CAPACITY_RETRY_SECONDS = 3.0
# EC2 gives a terminated instance's OS a moment; the local cloud gives the agent 1 s.
KILL_GRACE_SECONDS = 1.0
# Five agents in a row that die within 30 s of starting, without a result, is a broken
# job or agent, not bad luck: give up rather than burn money replacing instances.
CRASH_LOOP_COUNT = 5
CRASH_LOOP_SECONDS = 30.0
# The Spot Advisor's buckets are "per month"; its month is taken as 30 days.
MONTH_SECONDS = 30 * 86400.0
# How long the store may fail before the supervisor gives up (and says so in group.json).
STORE_OUTAGE_SECONDS = 900.0
# An agent that exited because the store failed is replaced after this, doubling up to
# STORE_MAX_BACKOFF_SECONDS: a new instance would meet the same store.
STORE_BACKOFF_SECONDS = 5.0
STORE_MAX_BACKOFF_SECONDS = 120.0
# The agent's exit code when it gave up on the store (spotnb.kernel_remote.agent).
AGENT_EXIT_STORE = 4
# simulate_interruptions={"count": N}, for a cell that saves no checkpoint and shows
# nothing yet (still importing, loading data): wait this many times interrupt_after.
QUIET_CELL_FACTOR = 3
# The interruptions the group knows ahead (their recommendation can come earlier).
FORESEEN = ("hazard", "scheduled", "price")
# A warm standby (spec.policy.standby) that is not ready within its boot plus this many
# market seconds is given back (its kernel or the cell's set-up is stuck: a job that
# moved to it would wait there). Ready, it takes the job over at once (as the AWS
# instance agent does through its group's API): holding it for a notice instead billed
# ~18% of a stressed pool's job for a fifth of its interruptions caught warm (README,
# "Warm standbys").
STANDBY_HOLD_SECONDS = 600.0
# In an instance's first hour, a standby on a recommendation is launched to be ready as the
# hour ends (its boot plus this many market seconds of warm-up before it), not at once:
# EC2 interrupting the instance before then makes all of it free (protocol/billing.py),
# and moving the job off it would forfeit that (policy.standby_first_hour: at once).
# The AWS instance agent times it alike (spotnb.protocol.billing).
STANDBY_WARMUP_SECONDS = billing.STANDBY_WARMUP_SECONDS
# The events that show a cell got past its imports: output, or metrics (one row or a batch).
AGENT_MODULE = ("-m", "spotnb.kernel_remote")


@dataclasses.dataclass
class _Finish:
    """Why the group is winding down, and until when the agent may finish by itself."""

    kind: str  # "result" (the job ended), "stop" (stop.json) or "failed" (crash loop)
    deadline: float
    reason: str = ""
    detail: str = ""


def _family(inst: LocalInstance) -> list[psutil.Process]:
    """An instance's agent and its descendants (kernels included), while it runs."""
    if inst.proc is not None and inst.proc.poll() is None:
        pid = inst.proc.pid
    elif inst.adopted is not None and inst.adopted.alive():
        pid = inst.adopted.pid
    else:
        return []
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class Supervisor:
    """Keeps a job's instances running; see the module docstring."""

    def __init__(self, store: Store, spec: JobSpec, settings: Settings, home: Path,
                 adopt: bool = False) -> None:
        self.store = store
        self.spec = spec
        self.settings = settings
        self.home = home
        self.control = home / CONTROL_DIR
        self.control.mkdir(parents=True, exist_ok=True)
        self.events = EventWriter(store, attempt=GROUP_STREAM, flush_seconds=GROUP_FLUSH_SECONDS)
        previous = (read_json(home / GROUP_FILE) or {}) if adopt else {}
        # The market replays from the group's first start, across supervisors.
        self.started = float(previous.get("started") or time.time())
        self.pending_result: dict[str, Any] | None = previous.get("pending_result")
        self.store_failing_since: float | None = None
        self.store_backoff = Backoff(STORE_BACKOFF_SECONDS, STORE_MAX_BACKOFF_SECONDS)
        self.markets: dict[str, Market] = {}
        self.instances: list[LocalInstance] = []
        # The instances the group keeps (launched, not ended): at most ``target``.
        self.running: list[LocalInstance] = []
        self.target = spec.resources.max_nodes
        self.first_launch: float | None = None
        self.next_launch_at = 0.0
        self.next_store_poll = 0.0
        self.reported_pools: set[str] = set()  # capacity errors already reported
        self.crashes = 0
        self.finish: _Finish | None = None
        self.terminate_requested: str | None = None
        # The instances an interruption was asked for and not yet given (every request
        # counts: two in one tick are two notices, to two instances).
        self.interrupt_requested: list[str] = []
        # Faults without notice asked for: (instance id, "kill" or "freeze").
        self.faults_requested: list[tuple[str, str]] = []
        # Multi-node jobs: the instances recommended in this tick's step 4, whose standby
        # starts at its end unless their notice came in the same tick (_step).
        self.standby_wanted: set[str] = set()

        sim = spec.simulate_interruptions or {}
        self.sim_count = int(sim.get("count", 0))
        self.sim_done = 0
        self.schedule = sorted(float(s) for s in sim.get("schedule", ()))
        self.schedule_next = 0
        # Simulated interruptions wait for progress after a checkpoint: follow the job
        # live (the local queue is free), as a notebook would.
        self.reader = (Follower(store, spec.job_id, batches=True,
                                quiet_log_seconds=STORE_POLL_SECONDS)
                       if self.sim_count else None)
        seed = settings.seed
        self.rng = random.Random(f"{seed}:{spec.job_id}") if seed is not None else random.Random()
        self._init_signals()
        if adopt:
            self._adopt(time.time())

    def _init_signals(self) -> None:
        """The job's signal model, and the false alarms that come at fixed times."""
        self.signals = SignalModel.from_dict(self.spec.simulate_signals)
        seed = self.signals.seed or self.settings.seed
        # Every draw has its own generator, named by what it is for: the same seed gives
        # the same draws whatever order the ticks meet them in.
        self.signal_seed = (f"{seed}:{self.spec.job_id}" if seed is not None
                            else secrets.token_hex(8))
        self.recommended: set[tuple[str, int]] = set()  # interruptions recommended for
        self.signal_leads: dict[tuple[str, int], float | None] = {}
        self.false_alarm_rngs: dict[int, random.Random] = {}  # by instance index
        times = list(self.signals.false_alarms)
        if self.schedule and self.schedule[-1] > 0:
            # A scheduled rate of interruptions brings its false alarms over its span.
            rng = self._signal_rng("schedule-false-alarms")
            rate = len(self.schedule) / self.schedule[-1]
            t = 0.0
            while (gap := self.signals.false_alarm_gap(rng, rate)) is not None and \
                    (t := t + gap) < self.schedule[-1]:
                times.append(t)
        self.false_alarm_times = sorted(times)
        self.false_alarm_next = 0

    def _signal_rng(self, name: str) -> random.Random:
        return random.Random(f"{self.signal_seed}:{name}")

    def _adopt(self, now: float) -> None:
        """Take over from a supervisor of this job that died (see the module docstring).

        Step 1  what the group did so far, from its event stream: first launch,
                simulated interruptions already served, instances already ended.
        Step 2  each instance still on record: its first process alive -> adopt it
                (same IMDS endpoint, same notice); gone, never recorded or not
                adoptable -> end what is left of it ("lost-while-unsupervised",
                :meth:`_lose`).
        """
        history = fold(e for e in EventReader(self.store, batches=True).poll()
                       if e.attempt == GROUP_STREAM)
        ended = history.terminated
        if history.first_launch is not None:
            self.first_launch = history.first_launch
        reasons = [reason for _instance, reason in history.group_notices]
        self.sim_done = min(self.sim_count, reasons.count("simulated"))
        self.schedule_next = min(len(self.schedule), reasons.count("scheduled"))
        self.recommended.update(("scheduled", i) for i in range(self.schedule_next))
        if self.first_launch is not None:
            self.false_alarm_next = sum(1 for t in self.false_alarm_times
                                        if self.first_launch + t <= now)
        if self.sim_done >= self.sim_count:
            self._stop_following()
        if not self.store.exists(RESULT):  # else it only logs the instances' end
            self._emit("status", None, state="launching",
                       detail="the local cloud's supervisor of this job was restarted; "
                              "taking over its instances")
        from spotnb.providers.local import LocalProvider

        for meta in LocalProvider().instances(self.spec.job_id):
            instance_id = meta.get("instance_id")
            if meta.get("state") == "terminated" or instance_id in ended:
                continue
            pool = next((p for p in catalog.pools(meta["instance_type"],
                                                  self.spec.resources.region)
                         if p.az == meta.get("az")), None)
            record = ProcessRecord.from_dict(read_json(Path(meta["dir"]) / "pid.json"))
            if pool is None or record is None or not record.alive():
                self._lose(meta, record)
                continue
            try:
                inst = LocalInstance.adopt(meta, pool, self._market(pool), now)
            except OSError as e:
                log.warning("cannot adopt %s (its metadata endpoint: %s); ending it",
                            instance_id, e)
                self._lose(meta, record)
                continue
            log.info("adopted instance %s (agent pid %d)", inst.id, record.pid)
            if inst.rebalance_at is not None:  # what its recommendation stood for is lost
                self.recommended.update({("hazard", inst.index), ("price", inst.index)})
            self._plan_signals(inst, now)
            self.instances.append(inst)
            self.running.append(inst)

    def _lose(self, meta: dict[str, Any], record: ProcessRecord | None) -> None:
        """End an instance on record that this supervisor cannot adopt (Step 2): its
        first process gone, never recorded (the supervisor died between starting it
        and writing its ``pid.json``) or its metadata endpoint taken. Whatever still
        runs of it (its reaper, an agent, what they started) is ended, as EC2 ends an
        instance: left running, it would work on the job with no metadata service and
        no supervisor to end it."""
        instance_id = str(meta.get("instance_id"))
        if record is not None:
            kill_tree(record, KILL_GRACE_SECONDS)
        strays = [proc for proc, instance, _ in marked_processes(self.spec.job_id)
                  if instance == instance_id]
        if strays:
            log.warning("ending %d process(es) of instance %s, which no supervisor "
                        "adopted", len(strays), instance_id)
            kill_processes(strays, KILL_GRACE_SECONDS)
        with contextlib.suppress(OSError):
            path = Path(meta["dir"]) / "meta.json"
            write_json(path, {**(read_json(path) or {}), "state": "terminated",
                              "reason": "lost-while-unsupervised"})
        self._emit("instance", instance_id, action="terminated",
                   reason="lost-while-unsupervised", instance_id=instance_id,
                   instance_type=meta.get("instance_type"), az=meta.get("az"),
                   pool=meta.get("pool"))

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Supervise until the job ends; return the process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        me = ProcessRecord.of(os.getpid())
        self._write_group("ready", supervisor=me.to_dict())
        log.info("capacity group for job %s is up (pid %d)", self.spec.job_id, me.pid)
        code = 0
        try:
            while True:
                try:
                    if not self._tick(time.time()):
                        # The job is over: its secrets go with its group.
                        secretstore.delete_local(self.spec.job_id)
                        break
                    self._store_works()
                except (StoreError, OSError) as err:
                    if self._store_fails(err):
                        code = 1
                        break
                time.sleep(TICK_SECONDS)
        except Exception:
            log.exception("the capacity-group supervisor crashed; ending its instances")
            code = 1
        finally:
            for inst in self.instances:
                if inst.ended is None:
                    try:
                        self._end(inst, time.time(), "group-ended")
                    except Exception:
                        log.exception("could not end instance %s", inst.id)
            self._stop_following()
            self.events.close()
            self._write_group("exited", supervisor=me.to_dict(), exit_code=code,
                              cost_usd=round(self.cost(time.time()), 6))
        log.info("capacity group for job %s exited (cost $%.4f)", self.spec.job_id,
                 self.cost(time.time()))
        return code

    def _store_works(self) -> None:
        if self.store_failing_since is not None:
            log.warning("the store works again after %.0f s",
                        time.time() - self.store_failing_since)
            self.store_failing_since = None
            self._write_group("ready", supervisor=ProcessRecord.of(os.getpid()).to_dict())

    def _store_fails(self, err: BaseException) -> bool:
        """A tick met a store error: go on, unless it has lasted STORE_OUTAGE_SECONDS."""
        now = time.time()
        if self.store_failing_since is None:
            self.store_failing_since = now
            log.warning("the job's store fails (%s); retrying every tick", err)
            self._write_group("store-unavailable",
                              supervisor=ProcessRecord.of(os.getpid()).to_dict(),
                              store_unavailable_since=now, store_error=str(err))
        elif now - self.store_failing_since > STORE_OUTAGE_SECONDS:
            log.error("the store has failed for %.0f s (%s); giving up: the next spotnb "
                      "command that looks at the job restarts its supervision",
                      now - self.store_failing_since, err)
            return True
        return False

    def _on_signal(self, signum: int, frame: object) -> None:
        self.terminate_requested = f"the supervisor received {signal.Signals(signum).name}"

    def _tick(self, now: float) -> bool:
        """One step of the loop; False when the group is done."""
        self._read_control()
        if self.pending_result is not None:
            # A result the store would not take earlier (crash loop, stop): first.
            self._write_result(**self.pending_result)
        if self.terminate_requested:
            log.info("terminating the group (%s)", self.terminate_requested)
            for inst in self.running:
                self._end(inst, now, "group-terminated")
            self.running = []
            self._write_result("stopped", "the capacity group was terminated",
                               detail=self.terminate_requested)
            return False
        if now >= self.next_store_poll:
            self.next_store_poll = now + STORE_POLL_SECONDS
            self._poll_store(now)
        if self.finish is None:
            self._check_limits(now)
        for inst in list(self.running):
            self._step(inst, now)
        if self.finish is not None:
            return self._step_finishing(now)
        # One launch a tick at most: a capacity error waits CAPACITY_RETRY_SECONDS.
        if len(self.running) < self.target and now >= self.next_launch_at:
            launched = self._launch(now)
            if launched is not None and launched.boot_until <= now:
                # No boot delay: start the agent now rather than a tick later.
                self._spawn(launched, time.time())
        return True

    def _read_control(self) -> None:
        try:
            names = sorted(os.listdir(self.control))
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith("."):
                continue
            path = self.control / name
            kind = name.split("-", 1)[0]
            if kind == "terminate":
                self.terminate_requested = "terminated through the provider"
            elif kind == "interrupt":
                if not self.running:
                    log.warning("interrupt requested, but no instance is running; ignored")
                else:
                    target = (read_json(path) or {}).get("instance")
                    if target and all(i.id != target for i in self.running):
                        log.warning("interrupt requested for %s, which is not running; "
                                    "ignored", target)
                    else:
                        self.interrupt_requested.append(
                            str(target) if target else self._first_uninterrupted())
            elif kind in ("kill", "freeze", "recommend"):
                target = (read_json(path) or {}).get("instance")
                if not self.running or (target and all(i.id != target for i in self.running)):
                    log.warning("%s requested for %s, which is not running; ignored", kind,
                                target or "the first instance")
                else:
                    self.faults_requested.append((str(target or self.running[0].id), kind))
            else:
                log.warning("ignoring unknown control request %s", name)
            path.unlink(missing_ok=True)

    def _first_uninterrupted(self) -> str:
        """An interruption of "the first running" instance: the first one that is not
        under notice and not already asked for (else the first running)."""
        for inst in self.running:
            if inst.terminate_at is None and inst.id not in self.interrupt_requested:
                return inst.id
        return self.running[0].id

    def _poll_store(self, now: float) -> None:
        if self.store.exists(RESULT):
            if self.finish is None or self.finish.kind == "stop":
                self.finish = _Finish("result", now + self.settings.stop_grace, "job-finished")
            return
        if self.finish is None:
            stop = self._read_stop()
            if stop is not None:
                self._begin_stop(now, stop)
        if self.reader is not None:
            self._track_progress(list(self.running))
        for inst in self.running:
            if inst.standby_until is not None and self.target > 1 and inst.started and \
                    self._slot_of(inst.id) is not None:
                # It took the slot of another node, lost meanwhile (a kill, a notice
                # before its own node's): that node's replacement now, not on hold.
                log.info("standby %s took the place of a lost node", inst.id)
                inst.standby_until = None
            if inst.standby_for is not None and inst.started and not inst.standby_ready:
                self._standby_ready(inst)

    def _read_stop(self) -> dict[str, Any] | None:
        try:
            raw = self.store.get(STOP)
        except NotFound:
            return None
        try:
            stop = json.loads(raw)
        except ValueError:
            stop = {}
        return stop if isinstance(stop, dict) else {}

    def _begin_stop(self, now: float, stop: dict[str, Any]) -> None:
        reason = str(stop.get("reason") or "stop requested")
        self.finish = _Finish("stop", now + self.settings.stop_grace, reason,
                              str(stop.get("detail") or ""))
        log.info("stop requested (%s); the agent has %gs to finish", reason,
                 self.settings.stop_grace)

    # ---------------------------------------------------------------- instances

    def _step(self, inst: LocalInstance, now: float) -> None:
        # Step 1: boot. The agent starts once the simulated boot delay is over.
        if not inst.started:
            if inst.terminate_at is None and self.finish is None and now >= inst.boot_until:
                self._spawn(inst, now)
                if inst not in self.running:  # the agent could not even be started
                    return
        # Step 2: an agent that exited by itself, or a fault asked for (kill, freeze).
        elif (code := inst.exit_code()) is not None:
            self._agent_exited(inst, now, code)
            return
        elif any(i == inst.id for i, _ in self.faults_requested):
            kinds = {k for i, k in self.faults_requested if i == inst.id}
            self.faults_requested = [f for f in self.faults_requested if f[0] != inst.id]
            if "kill" in kinds:
                self._kill(inst, now)
                return
            if "recommend" in kinds and inst.terminate_at is None and self.finish is None:
                self._recommend(inst, now, "requested")
            if "freeze" in kinds:
                self._freeze(inst)
        if inst.standby_until is not None:
            self._mind_standby(inst, now)
            if inst not in self.running:
                return
        # Step 3: the market moves.
        if inst.next_price_change is not None and now >= inst.next_price_change:
            price = inst.market.price_at(now)
            if price != inst.price:
                inst.price = price
                self._emit_price(inst)
            inst.next_price_change = inst.market.next_change_after(now)
        # Step 4: does EC2 want the instance back? First its recommendation, if one is
        # due: one with no lead comes in the tick of its notice, before it.
        if inst.terminate_at is None and self.finish is None:
            self._signal(inst, now)
            if inst.standby_due is not None and now >= inst.standby_due:
                inst.standby_due = None
                inst.update_meta(standby_due=None)
                self._start_standby(inst, now, defer=False)
            reason = self._interruption_due(inst, now)
            if reason is not None:
                self._notice(inst, now, reason)
        elif inst.id in self.interrupt_requested:
            # Already under notice, or winding down.
            self.interrupt_requested = [i for i in self.interrupt_requested if i != inst.id]
        if inst.id in self.standby_wanted:  # a multi-node job's recommendation (step 2, 4)
            self.standby_wanted.discard(inst.id)
            if inst.terminate_at is None:  # its notice did not come with it
                self._start_standby(inst, now)
        # Step 5: the notice period is over (or, ended through the termination hook, the
        # agent handed the lease over).
        if inst.notice_reason == "rebalanced" and inst.terminate_at is not None and (
                now >= inst.terminate_at or self._hook_done(inst)):
            self._end(inst, now, "rebalanced")
            self._forget(inst)
            return
        if inst.terminate_at is not None and now >= inst.terminate_at:
            self._end(inst, now, "spot-interruption")
            self._forget(inst)
            self.crashes = 0
            self.next_launch_at = now

    def _plan_signals(self, inst: LocalInstance, now: float) -> None:
        """What of an instance's signals is known at its launch: its first drawn false
        alarm, and when the market takes it back at ``max_price``."""
        rng = self.false_alarm_rngs[inst.index] = self._signal_rng(f"false-alarm:{inst.index}")
        gap = self.signals.false_alarm_gap(rng, self._hazard_rate(inst.pool))
        inst.next_false_alarm = None if gap is None else now + gap
        max_price = self.spec.resources.max_price
        if max_price is not None:
            inst.price_risk_at = inst.market.next_above(now, max_price)

    def _foreseen(self, inst: LocalInstance) -> list[tuple[str, int, float]]:
        """The interruptions of ``inst`` the group knows ahead: (reason, the draw's
        number, the notice's wall time)."""
        found = []
        if inst.hazard_at is not None:
            found.append(("hazard", inst.index, inst.hazard_at))
        if inst.price_risk_at is not None:
            found.append(("price", inst.index, inst.price_risk_at))
        if (self.schedule_next < len(self.schedule) and self.first_launch is not None
                and inst.id == self._first_uninterrupted()):
            found.append(("scheduled", self.schedule_next,
                          self.first_launch + self.schedule[self.schedule_next]))
        return found

    def _signal(self, inst: LocalInstance, now: float) -> None:
        """Publish the recommendations of ``inst`` that are due (see the module
        docstring)."""
        for reason, number, notice_at in self._foreseen(inst):
            key = (reason, number)
            if key in self.recommended:
                continue
            if key not in self.signal_leads:
                lead = self.signals.draw(self._signal_rng(f"{reason}:{number}"))
                self.signal_leads[key] = (None if lead is None
                                          else lead / self.settings.time_scale)
            lead = self.signal_leads[key]
            if lead is not None and now >= notice_at - lead:
                self.recommended.add(key)
                self._recommend(inst, now, reason)
        if inst.next_false_alarm is not None and now >= inst.next_false_alarm:
            gap = self.signals.false_alarm_gap(self.false_alarm_rngs[inst.index],
                                               self._hazard_rate(inst.pool))
            inst.next_false_alarm = None if gap is None else now + gap
            self._recommend(inst, now, "false-alarm")
        if (self.false_alarm_next < len(self.false_alarm_times) and self.first_launch
                is not None and now >= self.first_launch
                + self.false_alarm_times[self.false_alarm_next]
                and inst.id == self._first_uninterrupted()):
            self.false_alarm_next += 1
            self._recommend(inst, now, "false-alarm")

    def _recommend(self, inst: LocalInstance, now: float, reason: str,
                   at_notice: bool = False) -> None:
        """A rebalance recommendation for ``inst`` at its metadata service, and in the
        log; then a warm standby for it (on AWS the job's instance agent asks its Auto
        Scaling group for one). ``at_notice``: the recommendation comes with the notice;
        a multi-node job's standby starts at the end of the instance's step 4, unless its
        notice came in the same tick (see the module docstring)."""
        inst.recommend_rebalance(now)
        log.info("rebalance recommendation for %s (%s)", inst.id, reason)
        self._emit("instance", inst.id, at=now, action="rebalance", reason=reason,
                   **inst.describe(), notice_time=iso_utc(now))
        if self.target > 1:
            if not at_notice:  # with its notice: no standby (the module docstring)
                self.standby_wanted.add(inst.id)
            return
        self._start_standby(inst, now, defer=not at_notice)

    def _start_standby(self, inst: LocalInstance, now: float, defer: bool = True) -> None:
        """Launch a standby for ``inst`` (spotnb.kernel_remote.standby): a job whose
        policy allows it, an instance that runs the job (not a standby still on hold),
        none standing by for it yet, the job not winding down. A multi-node job's
        standby is one node's: it joins the world in that node's place once the node
        has left it (spotnb.kernel_remote.standby.NodeStandby). In the instance's first
        hour the launch waits to be ready as the hour ends
        (:data:`STANDBY_WARMUP_SECONDS`), unless ``defer`` is False (the recommendation
        came with the notice: the instance is EC2's to end, free or not)."""
        if (not self.spec.policy.standby or self.finish is not None
                or not inst.started or inst.standby_until is not None
                or any(i.standby_for == inst.id for i in self.running)):
            return
        if defer and self._defer_standby(inst, now):
            return
        standby = self._launch(now, standby_for=inst.id)
        if standby is None:
            return  # no capacity: the replacement launches after the loss, as without
        standby.standby_for = inst.id
        standby.standby_until = (standby.boot_until
                                 + STANDBY_HOLD_SECONDS / self.settings.time_scale)
        if standby.boot_until <= now:
            self._spawn(standby, time.time())

    def _defer_standby(self, inst: LocalInstance, now: float) -> bool:
        """Whether the standby for ``inst`` waits (its launch time set, and said once):
        launched now, it would move the job off ``inst`` inside its first hour."""
        if self.spec.policy.standby_first_hour:
            return False
        scale = self.settings.time_scale
        ahead = self.settings.boot_seconds * scale + STANDBY_WARMUP_SECONDS
        wait = billing.free_hour_left(inst.age(now)) - ahead
        if wait <= 0:
            inst.standby_due = None
            return False
        if inst.standby_due is None:
            inst.standby_due = now + wait / scale
            inst.update_meta(standby_due=inst.standby_due)  # for a supervisor that adopts it
            log.info("standby for %s waits %.0f market s: in its first hour an "
                     "interruption by EC2 is free", inst.id, wait)
            self._emit("instance", inst.id, at=now, action="standby-deferred",
                       **inst.describe(), standby_due=inst.standby_due)
        return True

    def _mind_standby(self, inst: LocalInstance, now: float) -> None:
        """A standby not yet the job's instance. It becomes that when the instance it
        stands by for is noticed or gone, or, once it is ready, when the job moves to it
        (:meth:`_move_to_standby`, through the old instance's termination hook); it is given
        back (terminated, billed to the job) if it is not ready by the end of its hold."""
        old = next((i for i in self.running if i.id == inst.standby_for), None)
        if old is None or old.terminate_at is not None:
            inst.standby_until = None  # the job's next instance now
            return
        if inst.standby_ready:
            self._move_to_standby(old, inst, now)
            return
        if now >= (inst.standby_until or now):
            log.info("standby %s for %s not ready within its hold: giving it back",
                     inst.id, old.id)
            self._end(inst, now, "standby-given-back", standby_for=old.id)
            self._forget(inst)
            self._notify_given_back(inst, inst.cost(now))

    def _move_to_standby(self, old: LocalInstance, standby: LocalInstance,
                         now: float) -> None:
        """As Auto Scaling does once a capacity-rebalancing replacement is in service:
        end the at-risk instance through its termination hook. Its agent takes that
        for its notice (final save, lease released) and the standby takes the lease;
        the old instance ends once its lease is released (:meth:`_hook_done`), else at
        the hook's timeout. An interruption the schedule foresaw for it (its
        recommendation came) leaves with it: the job is no longer there."""
        for reason, number, _ in self._foreseen(old):
            if reason == "scheduled" and (reason, number) in self.recommended:
                self.schedule_next = max(self.schedule_next, number + 1)
        old.end_through_hook(now, self.settings.notice_seconds)
        standby.standby_until = None  # the job's next instance now
        log.info("standby %s is ready: ending %s through its termination hook",
                 standby.id, old.id)

    def _hook_done(self, inst: LocalInstance) -> bool:
        """Whether the agent of ``inst``, ended through its termination hook, released
        the job's lease (or another holds it; a multi-node job's: of its node slot):
        its lifecycle action is complete."""
        try:
            if self.target > 1:
                return self._slot_of(inst.id) is None
            current = lease.read(self.store)
        except Exception:  # the hook's timeout ends it instead
            return False
        return current is not None and (current[0].holder != inst.id
                                        or current[0].released)

    def _slot_of(self, instance_id: str) -> int | None:
        """The node slot whose lease ``instance_id`` holds (not released), if any: one
        read of each slot's lease (a multi-node job's standbys and moves only)."""
        for slot in range(self.target):
            current = lease.read(self.store, slot)
            if current is not None and current[0].holder == instance_id and \
                    not current[0].released:
                return slot
        return None

    def _notify_given_back(self, inst: LocalInstance, cost: float) -> None:
        """Tell the job's webhook, if it has one, that a standby was given back: no
        instance sees it (on AWS, Auto Scaling gives it back)."""
        if secretstore.NOTIFY_SECRET not in self.spec.secrets:
            return
        from spotnb.protocol.notify import Notifier

        try:
            url = secretstore.read_local(self.spec.job_id, [secretstore.NOTIFY_SECRET])
        except Exception as err:  # a notification is an extra: never the group's tick
            log.warning("cannot read the job's webhook: %s", type(err).__name__)
            return
        notifier = Notifier(url.get(secretstore.NOTIFY_SECRET), self.spec.job_id,
                            self.spec.name)
        notifier.where = f"{inst.pool.instance_type} {inst.pool.az} {inst.id}"
        notifier.job_start = self.first_launch
        notifier.standby_given_back(cost)
        notifier.close(timeout=0)  # sent from its own thread: the tick goes on

    def _standby_ready(self, inst: LocalInstance) -> None:
        """Log a standby's readiness once its agent said so in the store."""
        try:
            raw = self.store.get(layout.standby_ready_key(inst.id))
        except NotFound:
            return
        try:
            said = json.loads(raw)
        except ValueError:
            said = {}
        inst.standby_ready = True
        ready = said.get("ready") if isinstance(said, dict) else None
        self._emit("instance", inst.id, at=float(ready) if isinstance(ready, (int, float))
                   else time.time(), action="standby-ready", **inst.describe(),
                   standby_for=inst.standby_for,
                   kernel_started=said.get("kernel_started") if isinstance(said, dict)
                   else None)

    def _kill(self, inst: LocalInstance, now: float) -> None:
        """A machine lost outright: SIGKILL the agent and everything it started at once
        (no notice, no grace); the group replaces it as after an interruption."""
        family = _family(inst)
        for proc in family:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        log.info("killed instance %s without notice (requested)", inst.id)
        self._end(inst, now, "killed")
        self._forget(inst)
        self.next_launch_at = now

    def _freeze(self, inst: LocalInstance) -> None:
        """A node gone silent: SIGSTOP the agent and everything it started."""
        for proc in _family(inst):
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        log.info("froze instance %s (requested)", inst.id)
        self._emit("instance", inst.id, action="frozen", **inst.describe())

    def _interruption_due(self, inst: LocalInstance, now: float) -> str | None:
        if inst.id in self.interrupt_requested:
            self.interrupt_requested = [i for i in self.interrupt_requested if i != inst.id]
            return "requested"
        max_price = self.spec.resources.max_price
        if max_price is not None and inst.price > max_price:
            return "price"
        if (self.schedule_next < len(self.schedule) and self.first_launch is not None
                and now >= self.first_launch + self.schedule[self.schedule_next]):
            self.schedule_next += 1
            return "scheduled"
        if self.sim_done < self.sim_count and self._simulated_due(inst, now):
            self.sim_done += 1
            return "simulated"
        if inst.hazard_at is not None and now >= inst.hazard_at:
            return "hazard"
        return None

    def _simulated_due(self, inst: LocalInstance, now: float) -> bool:
        """Whether to interrupt ``inst`` for ``simulate_interruptions={"count": N}``.

        Step 1: after the attempt's first durable checkpoint, at its next sign of life
        (output, a metric, a CPU sample: about a second), or ``interrupt_after`` seconds
        after the checkpoint. Not only after a metric: a cell need not call spot.log.
        Step 2: an attempt without a checkpoint, ``interrupt_after`` seconds after the
        cell's first output or metric (its imports and data loading are then done: on
        a busy machine they alone can take longer than that), or
        :data:`QUIET_CELL_FACTOR` times as long after the cell started, if it shows
        nothing. Never counted from the instance's start: a slow boot is not the cell's.
        Both are the events' own times: the simulated interruption comes that long
        after the cell showed something, however late the supervisor read of it.
        """
        limit = self.settings.interrupt_after
        if inst.durable_at is not None:
            return inst.progressed or now - inst.durable_at >= limit
        if inst.first_output is not None:
            return now - inst.first_output >= limit
        return inst.cell_started is not None and \
            now - inst.cell_started >= QUIET_CELL_FACTOR * limit

    def _track_progress(self, instances: list[LocalInstance]) -> None:
        """Watch each instance's attempt: its cell's start, its first durable checkpoint,
        and any event after that (one read of the log for all of them)."""
        assert self.reader is not None
        by_id = {inst.id: inst for inst in instances}
        for event in self.reader.poll(wait=0):
            inst = by_id.get(event.instance or "")
            if inst is None or event.attempt == GROUP_STREAM:
                continue
            body = codec.peek(event)
            if (isinstance(body, codec.Status) and body.state == "running"
                    and inst.cell_started is None):
                inst.cell_started = event.time
            if codec.is_output(event) and inst.first_output is None:
                inst.first_output = event.time
            if (isinstance(body, codec.CheckpointEvent) and body.durable
                    and inst.durable_at is None):
                inst.durable_at = event.time
            elif inst.durable_at is not None and event.time > inst.durable_at:
                inst.progressed = True
        if self.sim_done >= self.sim_count:
            self._stop_following()  # nothing left to simulate: stop reading the log

    def _stop_following(self) -> None:
        reader, self.reader = self.reader, None
        if reader is not None:
            reader.close()

    def _notice(self, inst: LocalInstance, now: float, reason: str) -> None:
        """Interrupt like EC2: the notice now, the termination after the notice period."""
        if reason not in FORESEEN:  # nobody knew it ahead: the recommendation comes with it
            self._recommend(inst, now, reason, at_notice=True)
        elif self.target == 1:
            # No recommendation now (none was drawn, or its standby waits for the first
            # hour's end): the replacement still launches at the notice, to boot during
            # the notice period, as on AWS (the noticed instance leaves its group); none
            # if a standby already boots for it (_start_standby).
            self._start_standby(inst, now, defer=False)
        inst.notice(now, self.settings.notice_seconds, reason)
        assert inst.terminate_at is not None
        log.info("interruption notice for %s (%s); terminating at %s", inst.id, reason,
                 iso_utc(inst.terminate_at))
        self._emit("instance", inst.id, action="notice", reason=reason, **inst.describe(),
                   notice_time=iso_utc(now), termination_time=iso_utc(inst.terminate_at),
                   price=inst.price)

    def _agent_exited(self, inst: LocalInstance, now: float, code: int | None) -> None:
        lived = now - (inst.running_since or now)
        self._forget(inst)
        self.next_launch_at = now
        if self.store.exists(RESULT):
            self._end(inst, now, "job-finished", exit_code=code)
            self.finish = _Finish("result", now, "job-finished")
            return
        if inst.terminate_at is not None:  # gone a little before its termination time
            self._end(inst, now, "rebalanced" if inst.notice_reason == "rebalanced"
                      else "spot-interruption", exit_code=code)
            self.crashes = 0
            return
        if self.finish is not None:
            self._end(inst, now, "stopped", exit_code=code)
            return
        log_path = inst.log_path
        if code == AGENT_EXIT_STORE:
            # The store failed the agent: another instance now would meet the same.
            delay = self.store_backoff.next()
            log.warning("agent on %s gave up on the store; launching again in %.0f s",
                        inst.id, delay)
            self._end(inst, now, "agent-exited", exit_code=code)
            self.next_launch_at = now + delay
            return
        log.warning("agent on %s exited with code %s after %.1fs without a result; see %s",
                    inst.id, code, lived, log_path)
        self._end(inst, now, "agent-exited", exit_code=code)
        self.crashes = self.crashes + 1 if lived < CRASH_LOOP_SECONDS else 0
        if self.crashes >= CRASH_LOOP_COUNT:
            self.finish = _Finish("failed", now)  # first: no more launches, store or not
            self._write_result(
                "failed",
                f"the agent crashed repeatedly ({self.crashes} instances in a row exited "
                f"within {CRASH_LOOP_SECONDS:g} s without a result); see {log_path}",
            )

    def _end(self, inst: LocalInstance, now: float, reason: str, **extra: Any) -> None:
        """Terminate an instance and say so."""
        cost = inst.terminate(now, KILL_GRACE_SECONDS, reason)
        log.info("instance %s terminated (%s), cost $%.6f", inst.id, reason, cost)
        self._emit("instance", inst.id, action="terminated", reason=reason, **inst.describe(),
                   cost_usd=round(cost, 6), **extra)

    # ------------------------------------------------------------------- launch

    def _market(self, pool: Pool) -> Market:
        market = self.markets.get(pool.name)
        if market is None:
            market = Market(pool, self.started, self.settings.time_scale, seed=self.spec.job_id)
            self.markets[pool.name] = market
        return market

    def _candidates(self, now: float) -> list[Pool]:
        """Pools in launch order: the spec's types in order, cheapest AZ first right now."""
        ordered = []
        region = self.spec.resources.region
        for instance_type in self.spec.resources.instance_types:
            type_pools = catalog.pools(instance_type, region)
            ordered += sorted(type_pools, key=lambda p: (self._market(p).price_at(now), p.az))
        return ordered

    def _forget(self, inst: LocalInstance) -> None:
        """The group no longer keeps ``inst`` (it ended): a replacement may launch."""
        if inst in self.running:
            self.running.remove(inst)

    def _launch(self, now: float, standby_for: str | None = None) -> LocalInstance | None:
        """Start an instance in the first pool that can take it; None if none can.
        ``standby_for``: a warm standby for that instance (logged as such)."""
        try:  # capacity shortages may be switched on and off while the job runs
            settings = Settings.load()
        except SpecError as e:
            log.warning("keeping the previous local cloud settings: %s", e)
            settings = self.settings
        max_price = self.spec.resources.max_price
        for pool in self._candidates(now):
            price = self._market(pool).price_at(now)
            if max_price is not None and price > max_price:
                self._capacity_error(pool, now, "SpotMaxPriceTooLow", (
                    f"Your Spot request price of {max_price} is lower than the minimum "
                    f"required Spot request fulfillment price of {price}."))
            elif not settings.has_capacity(pool.instance_type, pool.az):
                self._capacity_error(pool, now, "InsufficientInstanceCapacity", (
                    f"We currently do not have sufficient {pool.instance_type} capacity in "
                    f"the Availability Zone you requested ({az_name(pool.region, pool.az)})."))
            else:
                return self._start_instance(pool, now, settings, standby_for)
        if standby_for is None:
            self.next_launch_at = now + CAPACITY_RETRY_SECONDS
        return None

    def _capacity_error(self, pool: Pool, now: float, code: str, message: str) -> None:
        if pool.name in self.reported_pools:
            return  # reported once per wait; the retries would only repeat it
        if not self.reported_pools:
            self._emit("status", None, at=now, state="waiting_for_capacity",
                       detail=f"no spot capacity in {pool.name} ({code}); trying other pools")
        self.reported_pools.add(pool.name)
        log.info("cannot launch in %s: %s", pool.name, code)
        self._emit("instance", None, at=now, action="capacity_error", reason=code, detail=message,
                   instance_id=None, instance_type=pool.instance_type, az=pool.az,
                   pool=pool.name)

    def _start_instance(self, pool: Pool, now: float, settings: Settings,
                        standby_for: str | None = None) -> LocalInstance:
        inst = LocalInstance.create(
            pool, self._market(pool), index=len(self.instances) + 1, now=now,
            boot_seconds=settings.boot_seconds, hazard_at=self._hazard_time(pool, now),
            job_id=self.spec.job_id, store_uri=self.store.uri)
        self._plan_signals(inst, now)
        self.instances.append(inst)
        self.running.append(inst)
        self.reported_pools.clear()
        if self.first_launch is None:
            self.first_launch = now
        replacing = (f" (replacement #{inst.index - self.target})"
                     if inst.index > self.target else "")
        if standby_for is not None:
            replacing = f" (standby for {standby_for}: rebalance recommendation)"
        extra = {} if standby_for is None else {"standby_for": standby_for}
        # Stamped with the tick's time, like the capacity errors before them: schedules
        # and budgets count from it, and readers see the events in this order.
        self._emit("status", None, at=now, state="launching", instance_type=pool.instance_type,
                   az=pool.az, detail=f"launching {pool.instance_type} in {pool.az}{replacing}")
        self._emit("instance", inst.id, at=now, action="launched", **inst.describe(),
                   price=inst.price, ondemand=pool.ondemand, region=pool.region,
                   az_name=az_name(pool.region, pool.az), time_scale=inst.market.time_scale,
                   **extra)
        self._emit_price(inst)
        log.info("launched %s in %s at $%.4f/h; %s", inst.id, pool.name, inst.price,
                 inst.market.source)
        return inst

    def _hazard_time(self, pool: Pool, now: float) -> float | None:
        """When the Spot Advisor's interruption rate takes this instance (or None).

        The bucket's upper bound (``<5%`` -> 5, ``>20%`` -> 100) is read as interruptions
        per month, a constant hazard rate in market time, hence ``time_scale`` faster in
        real time.
        """
        rate = self._hazard_rate(pool)
        return now + self.rng.expovariate(rate) if rate else None

    def _hazard_rate(self, pool: Pool) -> float:
        """Interruptions per real second at the pool's Spot Advisor rate (0 without
        ``hazard`` or a bucket)."""
        if not self.settings.hazard:
            return 0.0
        bucket = catalog.interruption_bucket(pool.instance_type, pool.region)
        if bucket is None:
            return 0.0
        return bucket.max_pct / 100.0 / MONTH_SECONDS * self.settings.time_scale

    def _spawn(self, inst: LocalInstance, now: float) -> None:
        cmd = [*(self.settings.agent_cmd or (sys.executable, *AGENT_MODULE)),
               "--job", self.store.uri]
        # The job's env names without a value are this machine's variables, passed on
        # purpose (the agent sets those with a value in the kernel's environment).
        passed = [*self.settings.instance_env,
                  *(name for name, value in self.spec.env.items() if value is None)]
        # The agent reads the job's log (its start notification names the price this
        # instance launched at): what the group said of it is written before it starts,
        # as on EC2, where the launch precedes the boot. One try: a failing store is
        # the writer's to retry, and never holds the launch up.
        self.events.flush()
        try:
            inst.spawn(cmd, self.spec.job_id, now, passed, grace=KILL_GRACE_SECONDS,
                       hook_seconds=self.settings.notice_seconds)
        except OSError as e:
            # A missing interpreter or agent: the same outcome as an agent that crashed.
            log.error("cannot start the agent %s: %s", cmd, e)
            self._agent_exited(inst, now, 127)
            return
        assert inst.proc is not None
        log.info("agent for %s started (pid %d)", inst.id, inst.proc.pid)

    # ---------------------------------------------------------- stop, limits, end

    def cost(self, now: float) -> float:
        """USD spent so far: each instance's market price over the time it existed."""
        return sum(i.cost(now) for i in self.instances)

    def _check_limits(self, now: float) -> None:
        policy = self.spec.policy
        if policy.budget_usd is not None:
            cost = self.cost(now)
            if cost > policy.budget_usd:
                self._request_stop(now, "budget", (
                    f"the job has cost ${cost:.4f}, above its budget of "
                    f"${policy.budget_usd:.4f}"))
                return
        if policy.max_duration is not None and self.first_launch is not None:
            elapsed = now - self.first_launch
            if elapsed > policy.max_duration:
                self._request_stop(now, "deadline", (
                    f"the job has run {elapsed:.0f} s since its first instance, above its "
                    f"limit of {policy.max_duration:g} s"))

    def _request_stop(self, now: float, reason: str, detail: str) -> None:
        log.info("stopping the job: %s", detail)
        body = {"reason": reason, "detail": detail, "time": now, "by": "local-cloud"}
        request_stop(self.store, self.spec.job_id, body)
        # Someone may have asked to stop first: their reason wins.
        self._begin_stop(now, self._read_stop() or body)

    def _step_finishing(self, now: float) -> bool:
        assert self.finish is not None
        if self.running:
            if now < self.finish.deadline and any(
                    inst.started and inst.exit_code() is None for inst in self.running):
                return True  # the agents may still finish by themselves
            reason = "job-finished" if self.store.exists(RESULT) else "stopped"
            for inst in self.running:
                if inst.ended is None:
                    self._end(inst, now, reason)
            self.running = []
        if self.finish.kind == "stop":
            self._write_result("stopped", self.finish.reason, detail=self.finish.detail)
        return False

    def _write_result(self, status: str, reason: str, **extra: Any) -> None:
        """Write result.json unless the job already has one, and say so in the log.

        If the store fails, the result waits in ``group.json`` (``pending_result``) and
        every tick tries again, this supervisor's or the next one's.
        """
        body = {"status": status, "reason": reason, **extra, "time": time.time(),
                "by": "local-cloud"}
        self.pending_result = {"status": status, "reason": reason, **extra}
        try:
            written = self.store.put_if_absent(RESULT, json.dumps(body).encode())
        except (StoreError, OSError):
            self._write_group("result-pending",
                              supervisor=ProcessRecord.of(os.getpid()).to_dict())
            raise
        self.pending_result = None
        if written is not None:
            log.info("wrote the job's result: %s (%s)", status, reason)
            self._emit("result", None, status=status, reason=reason, **extra)

    # ------------------------------------------------------------------- output

    def _emit(self, type: str, instance: str | None, at: float | None = None,
              **data: Any) -> None:
        self.events.emit_event(Event(type=type, time=time.time() if at is None else at,
                                     attempt=GROUP_STREAM, instance=instance, data=data))

    def _emit_price(self, inst: LocalInstance) -> None:
        now = time.time()
        # Which real prices these are: the history's source and the moment replayed.
        replayed = datetime.datetime.fromtimestamp(inst.market.history_time(now),
                                                   datetime.timezone.utc)
        self._emit("price", inst.id, at=now, pool=inst.pool.name,
                   instance_type=inst.pool.instance_type, az=inst.pool.az, price=inst.price,
                   ondemand=inst.pool.ondemand, price_source=inst.market.source,
                   history_time=replayed.isoformat(timespec="seconds"),
                   history_scale=inst.market.time_scale)

    def _write_group(self, state: str, **fields: Any) -> None:
        write_json(self.home / GROUP_FILE, {
            "job_id": self.spec.job_id, "store_uri": self.store.uri, "state": state,
            "started": self.started, "log": str(self.home / "supervisor.log"),
            "pending_result": self.pending_result,
            "store_unavailable_since": self.store_failing_since, **fields,
        })


def _detach() -> None:
    """Fork; the parent exits at once, the child leads a new session.

    The provider waits for the parent, so the supervisor is nobody's child: it outlives
    the notebook kernel and is never left a zombie there.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() > 0:
        os._exit(0)
    os.setsid()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spotnb.providers.local.group",
        description="The local cloud's capacity-group supervisor for one job.")
    parser.add_argument("--job", required=True, help="the job's store URI (its prefix)")
    parser.add_argument("--foreground", action="store_true",
                        help="do not detach (for debugging)")
    parser.add_argument("--adopt", action="store_true",
                        help="take over from a supervisor of this job that died")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        store = open_store(args.job)
        spec = JobSpec.from_json(store.get(SPEC))
    except (StoreError, SpecError, ValueError, KeyError, TypeError) as e:
        log.error("cannot read the job's spec.json in %s: %s", args.job, e)
        return 2
    try:
        settings = Settings.load()
        home = group_dir(spec.job_id)
    except SpecError as e:
        log.error("cannot start the capacity group: %s", e)
        return 2
    home.mkdir(parents=True, exist_ok=True)
    if not args.foreground:
        _detach()
    return Supervisor(store, spec, settings, home, adopt=args.adopt).run()


if __name__ == "__main__":
    sys.exit(main())
