"""The local cloud's capacity group: a supervisor process that keeps a job's instances
running (one; a multi-node job's ``max_nodes``).

Run as ``python -m spotnb.providers.local.group --job <store-uri>`` (the provider does
this, detached). It reads ``spec.json`` from the job's store prefix, writes the group's
events to stream 0 (``events/000000/``), and loops every :data:`TICK_SECONDS` until the
job ends. It plays both EC2 (instances, markets, interruptions) and the Auto Scaling
group (replace what was lost, whether or not anyone is watching).

A job's life, as the supervisor sees it::

    launch: pick a pool -> i-1 launched -> boot delay -> agent process spawned
    rebalance recommendation -> a warm standby launched (.standbys) -> once it is
        ready, the old instance ended through its termination hook (its agent saves
        and releases the lease; ended once released); given back if not ready within
        its hold (a multi-node job's: a standby for the recommended node, which takes
        that node's slot and joins the world in its place)
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

Each instance's turn in a tick (its boot, its agent's exit, faults asked for, the market,
EC2's recommendation and notice, the end of its notice period) is :mod:`.lifecycle`'s.

The store may fail (a full or read-only disk, a bucket out of reach): the supervisor
keeps its local duties (notices, terminations), retries the store every tick, and keeps
a result it must write in ``group.json`` meanwhile (:mod:`.groupfile`).

Supervisor death (a crash, SIGKILL, a laptop that rebooted): a new supervisor, started
``--adopt``, takes over the instances still running and carries on (:mod:`.adoption`):
the job resumes as after an interruption.

Which pool an instance launches in, at what price, is :mod:`.pools`' to say (the
group's region, :mod:`.failover`; there the spec's types in order, cheapest AZ first; a
pool without capacity or above ``max_price`` skipped with a ``capacity_error`` event);
when no pool can launch the group retries every :data:`CAPACITY_RETRY_SECONDS`, forever
(until stop, budget or deadline), and after repeated such rounds moves to the job's
next region (its nodes left there get a ``region-move`` notice).

Multi-node jobs: the group keeps ``max_nodes`` instances, each with its own metadata
service (its own notices), launched and replaced one by one exactly as the one instance
of a single-node job; the job ends for all of them with its result.

When EC2 wants an instance back (interruptions, rebalance recommendations, their
causes and leads) is :mod:`.interruptions`' to say; warm standbys are :mod:`.standbys`'
(the policy: :mod:`spotnb.protocol.standby`, AWS's too). The group acts on both.

Faults without notice, on request: ``LocalProvider.kill`` (the agent and everything it
started SIGKILLed at once; ``terminated`` with reason ``killed``, then replaced) and
``LocalProvider.freeze`` (SIGSTOPped: a node gone silent, ``frozen``; ended with the job).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from spotnb.protocol import secretstore
from spotnb.protocol.events import GROUP_STREAM, Event, EventReader, EventWriter
from spotnb.protocol.events.fold import JobState, fold
from spotnb.protocol.events.live import request_stop
from spotnb.protocol.layout import RESULT, SPEC, STOP
from spotnb.protocol.limits import limit_reached
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import NotFound, Store, StoreError, open_store
from spotnb.providers.failover import notice_end
from spotnb.providers.local import control, lifecycle
from spotnb.providers.local.adoption import take_over
from spotnb.providers.local.groupfile import AGENT_EXIT_STORE, GroupFile
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.interruptions import Interruptions
from spotnb.providers.local.pools import Pools
from spotnb.providers.local.standbys import Standbys
from spotnb.providers.local.state import (
    CONTROL_DIR,
    ProcessRecord,
    Settings,
    group_dir,
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
AGENT_MODULE = ("-m", "spotnb.kernel_remote")


@dataclasses.dataclass
class _Finish:
    """Why the group is winding down, and until when the agent may finish by itself."""

    kind: str  # "result" (the job ended), "stop" (stop.json) or "failed" (crash loop)
    deadline: float
    reason: str = ""
    detail: str = ""


class Supervisor:
    """Keeps a job's instances running; see the module docstring."""

    def __init__(self, store: Store, spec: JobSpec, settings: Settings, home: Path,
                 adopt: bool = False) -> None:
        self.store = store
        self.spec = spec
        self.settings = settings
        self.home = home
        (home / CONTROL_DIR).mkdir(parents=True, exist_ok=True)
        self.events = EventWriter(store, attempt=GROUP_STREAM, flush_seconds=GROUP_FLUSH_SECONDS)
        self.record = GroupFile(home, spec, store, adopt)
        self.instances: list[LocalInstance] = []
        # The instances the group keeps (launched, not ended): at most ``target``.
        self.running: list[LocalInstance] = []
        self.target = spec.resources.max_nodes
        self.first_launch: float | None = None
        # The group's own events folded: what the budget and deadline checks read (the
        # fold's cost is the one every view shows; spotnb's requests cost nothing here).
        self.state = JobState(spec.resources.max_nodes)
        self.next_launch_at = 0.0
        self.next_store_poll = 0.0
        self.crashes = 0
        self.finish: _Finish | None = None
        self.terminate_requested: str | None = None
        # Faults without notice (and recommendations) asked for: (instance id, "kill",
        # "freeze" or "recommend").
        self.faults_requested: list[tuple[str, str]] = []
        self.interruptions = Interruptions(spec, settings, store)
        # The markets replay from the group's first start, across supervisors.
        self.pools = Pools(spec, settings, store, self.record.started, self.interruptions,
                           self.emit)
        self.standbys = Standbys(self)
        if adopt:
            self._adopt(time.time())

    def _adopt(self, now: float) -> None:
        """Take over from a supervisor of this job that died (:mod:`.adoption`).

        Step 1  what the group did so far, from its event stream: first launch,
                interruptions already served, instances already ended.
        Step 2  each instance still on record: adopted, or what is left of it ended
                (``lost-while-unsupervised``).
        """
        history = fold((e for e in EventReader(self.store, batches=True).poll()
                        if e.attempt == GROUP_STREAM), self.spec.resources.max_nodes)
        self.state = history
        if history.first_launch is not None:
            self.first_launch = history.first_launch
        self.interruptions.resume(history, self.first_launch, now)
        if not self.store.exists(RESULT):  # else it only logs the instances' end
            self.emit("status", None, state="launching",
                      detail="the local cloud's supervisor of this job was restarted; "
                             "taking over its instances")
        adopted = take_over(self.spec, self.pools, self.emit, history.terminated, now,
                            KILL_GRACE_SECONDS)
        for inst in adopted:
            self.interruptions.adopted(inst, now)
            self.instances.append(inst)
            self.running.append(inst)
        self.pools.resume(history, adopted)  # in the region it ran in

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Supervise until the job ends; return the process exit code."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        me = ProcessRecord.of(os.getpid())
        self.record.write("ready", supervisor=me.to_dict())
        log.info("capacity group for job %s is up (pid %d)", self.spec.job_id, me.pid)
        code = 0
        try:
            while True:
                try:
                    if not self._tick(time.time()):
                        # The job is over: its secrets go with its group.
                        secretstore.delete_local(self.spec.job_id)
                        break
                    self.record.store_works()
                except (StoreError, OSError) as err:
                    if self.record.store_fails(err):
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
                        self.end(inst, time.time(), "group-ended")
                    except Exception:
                        log.exception("could not end instance %s", inst.id)
            self.interruptions.stop_following()
            self.events.close()
            self.record.write("exited", supervisor=me.to_dict(), exit_code=code,
                              cost_usd=round(self.cost(time.time()), 6))
        log.info("capacity group for job %s exited (cost $%.4f)", self.spec.job_id,
                 self.cost(time.time()))
        return code

    def _on_signal(self, signum: int, frame: object) -> None:
        self.terminate_requested = f"the supervisor received {signal.Signals(signum).name}"

    def _tick(self, now: float) -> bool:
        """One step of the loop; False when the group is done."""
        self._read_control()
        if self.record.pending_result is not None:
            # A result the store would not take earlier (crash loop, stop): first.
            self._write_result(**self.record.pending_result)
        if self.terminate_requested:
            log.info("terminating the group (%s)", self.terminate_requested)
            for inst in self.running:
                self.end(inst, now, "group-terminated")
            self.running = []
            self._write_result("stopped", "the capacity group was terminated",
                               detail=self.terminate_requested)
            return False
        if now >= self.next_store_poll:
            self.next_store_poll = now + STORE_POLL_SECONDS
            self._poll_store(now)
        if self.finish is None:
            self._check_limits(now)
        # Nodes of a region the group left, still going at the tick's start: the new
        # region's launches wait for the next tick (the log then says each in order).
        leaving = self.pools.leaving(self.running)
        for inst in list(self.running):
            lifecycle.step(self, inst, now)
        if self.finish is not None:
            return self._step_finishing(now)
        # One launch a tick at most: a capacity error waits CAPACITY_RETRY_SECONDS.
        if len(self.running) < self.target and now >= self.next_launch_at and not leaving:
            launched = self.launch(now)
            if launched is not None and launched.boot_until <= now:
                # No boot delay: start the agent now rather than a tick later.
                self.spawn(launched, time.time())
        return True

    def _read_control(self) -> None:
        """Carry out what the provider asked (:mod:`.control`)."""
        for req in control.take(self.home):
            if req.kind == "terminate":
                self.terminate_requested = "terminated through the provider"
            elif not self.running or (req.instance and
                                      all(i.id != req.instance for i in self.running)):
                log.warning("%s requested for %s, which is not running; ignored", req.kind,
                            req.instance or "the first instance")
            elif req.kind == "interrupt":
                self.interruptions.requested.append(str(
                    req.instance or self.interruptions.first_uninterrupted(self.running)))
            else:
                self.faults_requested.append((req.instance or self.running[0].id, req.kind))

    def _poll_store(self, now: float) -> None:
        if self.store.exists(RESULT):
            if self.finish is None or self.finish.kind == "stop":
                self.finish = _Finish("result", now + self.settings.stop_grace, "job-finished")
            return
        if self.finish is None:
            stop = self._read_stop()
            if stop is not None:
                self._begin_stop(now, stop)
        self.pools.bill(self.interruptions.track_progress(list(self.running)),
                        self.instances)
        for inst in self.running:
            self.standbys.poll_store(inst)

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

    def agent_exited(self, inst: LocalInstance, now: float, code: int | None) -> None:
        """The agent of ``inst`` exited by itself (:mod:`.lifecycle`'s step 2, or it
        could not start): the job's end, its instance's a little before its termination
        time, a store it gave up on (the next launch backs off), or a crash (a crash
        loop fails the job)."""
        lived = now - (inst.running_since or now)
        self.forget(inst)
        self.next_launch_at = now
        if self.store.exists(RESULT):
            self.end(inst, now, "job-finished", exit_code=code)
            self.finish = _Finish("result", now, "job-finished")
            return
        if inst.terminate_at is not None:  # gone a little before its termination time
            self.end(inst, now, "rebalanced" if inst.notice_reason == "rebalanced"
                     else notice_end(inst.notice_reason), exit_code=code)
            self.crashes = 0
            return
        if self.finish is not None:
            self.end(inst, now, "stopped", exit_code=code)
            return
        log_path = inst.log_path
        if code == AGENT_EXIT_STORE:
            # The store failed the agent: another instance now would meet the same.
            delay = self.record.backoff.next()
            log.warning("agent on %s gave up on the store; launching again in %.0f s",
                        inst.id, delay)
            self.end(inst, now, "agent-exited", exit_code=code)
            self.next_launch_at = now + delay
            return
        log.warning("agent on %s exited with code %s after %.1fs without a result; see %s",
                    inst.id, code, lived, log_path)
        self.end(inst, now, "agent-exited", exit_code=code)
        self.crashes = self.crashes + 1 if lived < CRASH_LOOP_SECONDS else 0
        if self.crashes >= CRASH_LOOP_COUNT:
            self.finish = _Finish("failed", now)  # first: no more launches, store or not
            self._write_result(
                "failed",
                f"the agent crashed repeatedly ({self.crashes} instances in a row exited "
                f"within {CRASH_LOOP_SECONDS:g} s without a result); see {log_path}",
            )

    def end(self, inst: LocalInstance, now: float, reason: str, **extra: Any) -> None:
        """Terminate an instance and say so."""
        cost = self.terminate(inst, now, reason)
        self.emit("instance", inst.id, action="terminated", reason=reason, **inst.describe(),
                  cost_usd=round(cost, 6), **extra)

    # ------------------------------------------------------------------- launch

    def forget(self, inst: LocalInstance) -> None:
        """The group no longer keeps ``inst`` (it ended): a replacement may launch."""
        if inst in self.running:
            self.running.remove(inst)

    def terminate(self, inst: LocalInstance, now: float, reason: str) -> float:
        """End ``inst`` as EC2 does (its processes, its metadata service); what it cost.
        The event saying so is the caller's."""
        cost = inst.terminate(now, KILL_GRACE_SECONDS, reason)
        log.info("instance %s terminated (%s), cost $%.6f", inst.id, reason, cost)
        return cost

    def winding_down(self) -> bool:
        """Whether the job ends (a result, a stop, a crash loop): nothing launches."""
        return self.finish is not None

    def moved(self, inst: LocalInstance) -> None:
        """The job moves off ``inst`` to its standby (:mod:`.standbys`)."""
        self.interruptions.moved(inst, self.first_launch,
                                 self.interruptions.first_uninterrupted(self.running))

    def launch(self, now: float, standby_for: str | None = None) -> LocalInstance | None:
        """Start an instance in the first pool that can take it (:mod:`.pools`); None if
        none can (the group tries again in CAPACITY_RETRY_SECONDS). ``standby_for``: a
        warm standby for that instance (logged as such)."""
        inst = self.pools.launch(now, len(self.instances) + 1, self.running, self.target,
                                 standby_for)
        if inst is None:
            if standby_for is None:  # the next round, at once in another region
                moved = self.pools.failed_round(now, self.running)
                self.next_launch_at = now if moved else now + CAPACITY_RETRY_SECONDS
            return None
        self.instances.append(inst)
        self.running.append(inst)
        if self.first_launch is None:
            self.first_launch = now
        return inst

    def spawn(self, inst: LocalInstance, now: float) -> None:
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
            self.agent_exited(inst, now, 127)
            return
        assert inst.proc is not None
        log.info("agent for %s started (pid %d)", inst.id, inst.proc.pid)

    # ---------------------------------------------------------- stop, limits, end

    def cost(self, now: float) -> float:
        """USD spent so far: the job's cost as its fold says it (the group's events:
        each instance at its pool's price as the group reported it), the one every
        view shows."""
        return self.state.cost_usd(now)

    def _check_limits(self, now: float) -> None:
        reached = limit_reached(self.spec.policy, self.state, now)
        if reached is not None:
            figures = {"cost_usd": reached.cost_usd} if reached.cost_usd is not None else {}
            self._request_stop(now, reached.reason, reached.detail, **figures)

    def _request_stop(self, now: float, reason: str, detail: str, **figures: Any) -> None:
        log.info("stopping the job: %s", detail)
        body = {"reason": reason, "detail": detail, "time": now, "by": "local-cloud",
                **figures}
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
                    self.end(inst, now, reason)
            self.running = []
        if self.finish.kind == "stop":
            self._write_result("stopped", self.finish.reason, detail=self.finish.detail)
        return False

    def _write_result(self, status: str, reason: str, **extra: Any) -> None:
        """Write result.json unless the job already has one (:mod:`.groupfile`)."""
        self.record.write_result(self.emit, status, reason, **extra)

    # ------------------------------------------------------------------- output

    def emit(self, type: str, instance: str | None, at: float | None = None,
             **data: Any) -> None:
        """An event of the group about ``instance`` (at ``at``, else now):
        :meth:`emit_event`."""
        self.emit_event(Event(type=type, time=time.time() if at is None else at,
                              attempt=GROUP_STREAM, instance=instance, data=data))

    def emit_event(self, event: Event) -> None:
        """Write ``event`` to the group's stream, and fold it into the group's state
        (what the budget and deadline checks read)."""
        self.events.emit_event(event)
        self.state.apply(event)


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
