"""The instance agent: runs on every EC2 instance of a job, around the job agent.

The user data starts it as ``python -m spotnb.providers.aws.instance --job <store-uri>``.
On AWS there is no spotnb supervisor process (the Auto Scaling group replaces
instances by itself), so the duties of the local cloud's supervisor that need a live
process are done here, by whichever instance of the job is running. It writes to the
group's stream (``events/000000/``) under its instance id; the job agent
(``python -m spotnb.kernel_remote``) is its child and writes the attempt streams.

An instance's life, narrated::

    Step 1  who am I (IMDS), what is the job (spec.json)
    Step 2  report what happened while no instance ran: capacity failures from the
            group's scaling activities, predecessors that ended without a word
            (terminated in EC2: billed until their last event); then "launched"
            (at EC2's launch time, with the pool's spot and on-demand prices)
    Step 3  run the job agent; every POLL_SECONDS look at IMDS for the interruption
            notice ("notice" event), for Auto Scaling ending the instance through
            its termination hook (``autoscaling/target-lifecycle-state`` Terminated:
            the job moves to its warm standby, or, the instance marked so in the
            store, to another region, ``region-move``; the job agent reads it as its
            notice)
            and, in a standby group (resources.rebalancing), for a rebalance
            recommendation: an instance that runs the job (a node) then asks its
            group for a warm standby and moves the job to it once it is ready
            (providers/aws/standby.py). In a standby group, complete the launch hook
            once the job agent holds the lease (a node slot's) or, a warm standby,
            is ready, and the termination hook once it let go of the lease; every
            LIMITS_SECONDS look at the budget and deadline
            (over: control/stop.json, which the job agent obeys), every PRICE_SECONDS
            at the spot price ("price" event when it changed)
    Step 4  the job agent exited:
            result.json exists -> "terminated" (job-finished), then delete the job's
                secrets (SSM parameters), the launch template, the Auto Scaling group
                (which terminates this instance) and the job's IAM role (IAM may
                refuse its last step, DeleteRole, once the role's policy is gone: the
                next launch or `spotnb aws cleanup` deletes the empty role): no instance
                outlives its job (invariant 6); a multi-node job's security and
                placement groups too where AWS allows it yet (every node that sees
                the result does the same)
            after an interruption notice -> wait for EC2 to terminate the instance
            ended through the termination hook -> complete the hook's lifecycle
                action (the final save is durable and the lease released: the
                standby has the job), so Auto Scaling terminates the instance now,
                not at the end of the hook's wait; then wait for that
            a stop request it did not answer within STOP_GRACE_SECONDS -> "stopped"
                result, then as for a result
            otherwise (crash, lost lease) -> start it again; CRASH_LOOP_COUNT quick
                exits in a row -> "failed" result, then as for a result
    SIGTERM (EC2 shuts the instance down) -> "terminated", flush, exit; during the
            teardown of Step 4 the signal waits for the teardown to finish.

Step 2 is :mod:`.arrival`'s; the watches of Step 3 are :mod:`.watches`'s.

A failing store or API never ends this agent while its job agent runs (an instance
whose agent died is billed with nobody to end it: invariant 6). A watch that fails is
tried again at its next turn; what the agent cannot go on without (the spec, whether
the job has a result) is retried for STORE_PATIENCE_SECONDS. Should the agent still
die, the boot script starts it again (AGENT_TRIES times, then powers the instance
off), and the new agent adopts the job agent that still runs (its pid in
AGENT_PID_FILE) rather than start a second one. If the job's Auto Scaling group cannot
be deleted at the end, or EC2 does not end the instance within NOTICE_WAIT_LIMIT_SECONDS
of its notice, the instance powers itself off (its launch template makes a power-off a
termination).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from spotnb.protocol import backoff, layout, usage
from spotnb.protocol.events import GROUP_STREAM, Event, EventReader, EventWriter
from spotnb.protocol.events.fold import JobState, fold
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import NotFound, Store, open_store
from spotnb.providers.aws.arrival import announce, came_up, report_the_gap
from spotnb.providers.aws.jobprocess import AgentProcess, power_off, start_job_agent
from spotnb.providers.aws.resources import LIFECYCLE_HOOK_NAME, rebalancing
from spotnb.providers.aws.standby import HOOK_POLL_SECONDS, StandbyDriver
from spotnb.providers.aws.teardown import delete_job_resources
from spotnb.providers.aws.transfers import POLL_SECONDS as TRANSFER_POLL_SECONDS
from spotnb.providers.aws.transfers import AwayMeter
from spotnb.providers.aws.watches import (
    STOP_CHECK_SECONDS,
    complete_hook,
    watch_hooks,
    watch_limits,
    watch_notice,
    watch_price,
)
from spotnb.providers.imds import ImdsClient

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5
# While a lifecycle hook waits for this instance, the lease (and a standby's ready mark)
# is read every HOOK_POLL_SECONDS (providers/aws/standby.py): a GET per node slot (and a
# HEAD), for a minute or so; a ready standby's, until it takes the job over (to protect
# it from scale-in), every PROTECT_POLL_SECONDS (a GET per slot: 360/h, $0.00014/h per
# slot, only while it waits).
PROTECT_POLL_SECONDS = 10.0
# Budget and deadline are checked this often, from what this agent knows (the group's
# history read once at boot, and its own price): no request.
LIMITS_SECONDS = 5.0
# The group's events are few and each matters (launches, notices): written within this.
GROUP_FLUSH_SECONDS = 0.5
# How often the requests this agent made are reported (a `usage` event).
USAGE_SECONDS = 300.0
# Spot prices change a few times a day at most; AWS throttles DescribeSpotPriceHistory.
PRICE_SECONDS = 300.0
# As on the local cloud: time the job agent has to stop the cell after a stop request.
STOP_GRACE_SECONDS = 15.0
CRASH_LOOP_COUNT = 5
CRASH_LOOP_SECONDS = 30.0
# Between SIGTERM and power-off EC2 leaves a little time: flush within it.
TERMINATION_GRACE_SECONDS = 0.8
IDENTITY_ATTEMPTS = 20  # IMDS can be slow for the first seconds after boot
# What this agent cannot go on without (the spec; whether the job has a result once the
# job agent exited; the deletion of the group at the end) is retried this long through a
# store or API outage. The boot script's restarts (bootstrap.AGENT_TRIES) bound the whole.
STORE_PATIENCE_SECONDS = 300.0
# After an interruption notice EC2 ends a spot instance within two minutes; Auto Scaling
# ends one in its termination hook at the hook's timeout (imds.TERMINATION_HOOK_SECONDS)
# at most. Still alive this long after either: the instance powers itself off.
NOTICE_WAIT_LIMIT_SECONDS = 900.0
T = TypeVar("T")


def patiently(what: str, fn: Callable[[], T]) -> T:
    """``fn()`` through a store or API outage of STORE_PATIENCE_SECONDS (a missing
    object is no outage)."""
    return backoff.patiently(what, fn, STORE_PATIENCE_SECONDS, give_up_on=(NotFound,))


class InstanceAgent:
    """One instance's side of the job. See the module docstring."""

    def __init__(self, job_uri: str, imds: ImdsClient | None = None) -> None:
        self.job_uri = job_uri
        self.store: Store = open_store(job_uri)
        self.spec = JobSpec.from_json(patiently("reading the job's spec",
                                                lambda: self.store.get(layout.SPEC)))
        self.imds = imds or ImdsClient()
        self.identity: dict[str, str] = {}
        self.events: EventWriter | None = None
        self.reader = EventReader(self.store, batches=True)
        #: When a stop request was last looked for (monotonic; .watches).
        self.stop_checked = -STOP_CHECK_SECONDS
        self.history: list[Event] = []
        # The history folded (spotnb.protocol.events.fold): what the budget and deadline checks,
        # and the gap report, read.
        self.state = JobState(self.spec.resources.max_nodes)
        self.agent: AgentProcess | None = None
        #: The watches failing now (each said once, when it starts and stops failing).
        self._failing: set[str] = set()
        self.notice: dict[str, Any] | None = None
        #: Auto Scaling ends this instance through the group's termination hook; and
        #: why, when the job's move to another region does (``region-move``).
        self.hook_ending = False
        self.ending_reason: str | None = None
        #: The group's lifecycle hooks this instance has still to complete (a standby
        #: group: see resources.LAUNCH_HOOK_NAME and LIFECYCLE_HOOK_NAME).
        self.launch_hook_due = rebalancing(self.spec)
        self.end_hook_due = False
        #: In a standby group, an instance whose job agent holds the lease (a node
        #: slot's) is protected from scale-in: lowering the group's desired capacity
        #: (a standby that never launched, given back) may then end only a standby.
        self.protect_due = rebalancing(self.spec)
        self.protect_tries = 0
        #: The instance this one stands by for, if it is a warm standby (its launch
        #: came while that instance's claim stood).
        self.standby_for: str | None = None
        #: EC2's launch time of this instance (its age: its first hour is refunded
        #: if EC2 interrupts it).
        self.launched_at = time.time()
        #: Warm standbys in a standby group (providers/aws/standby.py), once this
        #: instance knows who it is.
        self.standbys: StandbyDriver | None = None
        self.stop_seen_at: float | None = None
        self.price: float | None = None
        self.tearing_down = threading.Event()
        #: How the group chooses among the job's types, and the types its scaling
        #: activities say had no spot capacity (read once, at boot: the announcement).
        self.spot_strategy = "price-capacity-optimized"
        self.no_capacity: set[str] = set()
        #: Outside the job's home: its checkpoint's crossings, billed (.transfers).
        self.away: AwayMeter | None = None

    # ----------------------------------------------------------------- the life

    def run(self) -> int:
        import spotnb

        log.info("spotnb %s from %s, job %s", spotnb.__version__, spotnb.__file__,
                 self.spec.job_id)
        # Step 1
        self.identity = self._whoami()
        iid = self.identity["instance_id"]
        # boto3 here and in the job agent: the instance's region unless told otherwise.
        os.environ.setdefault("AWS_DEFAULT_REGION", self.identity["region"])
        self.events = EventWriter(self.store, GROUP_STREAM, instance=iid,
                                  flush_seconds=GROUP_FLUSH_SECONDS)
        self.standbys = StandbyDriver(self.store, self.spec, self.imds, self.identity,
                                      self.emit_event, lambda: self.state.instances,
                                      lambda: self.launch_hook_due)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._has_result():
            log.info("job %s already has a result: tearing down", self.spec.job_id)
            self._teardown("job-finished")
            return 0
        # Step 2
        self.history = patiently("reading the job's events", self.reader.poll)
        self.state = fold(self.history, self.spec.resources.max_nodes)
        report_the_gap(self)
        if self.identity["region"] != self.spec.resources.region:  # away from the store
            self.away = AwayMeter(self.reader, self.history, home=self.spec.resources.region,
                                  region=self.identity["region"], instance_id=iid,
                                  emit=lambda kind, data: self.emit(kind, **data))
        announce(self)
        came_up(self)
        # Step 3 and 4
        crashes = 0
        while True:
            started = time.monotonic()
            code = self._run_agent()
            if self.away is not None:  # the last saves' crossings, before the end
                self._watched("billing the checkpoint's crossings", self.away.poll)
                if self.events is not None:
                    self._watched("writing the crossings", self.events.flush)
            if self._has_result():
                reason = "job-finished"
                break
            if self.end_hook_due:
                log.info("the job agent exited after Auto Scaling began to end this "
                         "instance: completing the termination hook")
                self.end_hook_due = False
                complete_hook(self, LIFECYCLE_HOOK_NAME)
            if self.notice is not None or self.hook_ending:
                log.info("the job agent exited after the interruption notice; waiting for "
                         "EC2 to terminate this instance")
                time.sleep(NOTICE_WAIT_LIMIT_SECONDS)
                power_off(f"still running {NOTICE_WAIT_LIMIT_SECONDS:g} s after the job "
                          "agent exited for the interruption notice")
                while True:  # the job is elsewhere: nothing more to run here
                    time.sleep(60)
            if self.stop_seen_at is not None or self._watched(
                    "looking for a stop request", lambda: self.store.exists(layout.STOP)):
                # A stop before the job agent took the lease: it exits without a word.
                self._write_result("stopped", self._stop_reason())
                reason = "stopped"
                break
            crashes = crashes + 1 if time.monotonic() - started < CRASH_LOOP_SECONDS else 1
            log.warning("the job agent exited with code %s without a result (%d in a row)",
                        code, crashes)
            if crashes >= CRASH_LOOP_COUNT:
                self._write_result("failed", (
                    f"the job agent crashed repeatedly ({crashes} times in a row within "
                    f"{CRASH_LOOP_SECONDS:g} s) on {iid}; see {os.getcwd()}/agent.log"))
                reason = "agent-crashed"
                break
        return 0 if self._teardown(reason) else 1

    def _whoami(self) -> dict[str, str]:
        for attempt in range(IDENTITY_ATTEMPTS):
            try:
                return dict(self.imds.identity())
            except OSError:
                if attempt == IDENTITY_ATTEMPTS - 1:
                    raise
                time.sleep(0.5)
        raise TypeError("unreachable; this is a spotnb bug")

    def _has_result(self) -> bool:
        return patiently("reading whether the job has a result",
                         lambda: self.store.exists(layout.RESULT))

    def _watched(self, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()``; if it fails, None (said when it starts and when it stops failing):
        a watch is tried again at its next turn, and the job agent goes on."""
        try:
            value = fn()
        except Exception as err:
            if what not in self._failing:
                self._failing.add(what)
                log.warning("%s failed (%s); trying again at its next turn", what, err,
                            exc_info=True)
            return None
        if what in self._failing:
            self._failing.discard(what)
            log.info("%s works again", what)
        return value

    def _run_agent(self) -> int:
        env = dict(os.environ)
        if self.standby_for is not None:  # said in its ready mark
            env[layout.STANDBY_FOR_ENV] = self.standby_for
        self.agent = agent = start_job_agent(self.job_uri, env)
        last_limits = last_price = last_usage = last_away = time.monotonic()
        last_hooks = 0.0
        while (code := agent.poll()) is None:
            time.sleep(POLL_SECONDS)
            now = time.monotonic()
            self._watched("watching for an interruption notice",
                          functools.partial(watch_notice, self))
            if (standbys := self.standbys) is not None:
                self._watched("the warm standby's watch", functools.partial(
                    standbys.poll, now, self.notice is not None, self.hook_ending,
                    self.launched_at))
            hooks_due = self.launch_hook_due or self.end_hook_due
            if (hooks_due or self.protect_due) and now - last_hooks >= (
                    HOOK_POLL_SECONDS if hooks_due else PROTECT_POLL_SECONDS):
                last_hooks = now
                self._watched("the lifecycle hooks' watch", functools.partial(watch_hooks, self))
            if now - last_usage >= USAGE_SECONDS:
                last_usage = now
                self._watched("reporting the requests made", self._report_usage)
            if now - last_limits >= LIMITS_SECONDS:
                last_limits = now
                self._watched("the stop, budget and deadline watch",
                              functools.partial(watch_limits, self))
            if self.away is not None and now - last_away >= TRANSFER_POLL_SECONDS:
                last_away = now
                self._watched("billing the checkpoint's crossings", self.away.poll)
            if now - last_price >= PRICE_SECONDS:
                last_price = now
                self._watched("the spot price's watch", functools.partial(watch_price, self))
            if self.stop_seen_at is not None and time.monotonic() - self.stop_seen_at > \
                    STOP_GRACE_SECONDS and agent.poll() is None:
                log.warning("the job agent did not stop within %gs; ending it",
                            STOP_GRACE_SECONDS)
                agent.terminate()
        return code

    # ---------------------------------------------------------- group stream

    def emit(self, type: str, **data: Any) -> None:
        """Write an event of this instance to the group's stream, and fold it."""
        if self.events is not None:
            # What the budget check counts: this instance's own events too.
            event = self.events.emit(type, **data)
            self.history.append(event)
            self.state.apply(event)

    def _report_usage(self) -> None:
        """A ``usage`` event: the requests this process made so far (spotnb.protocol.usage)."""
        self.emit("usage", process="instance-agent", requests=usage.snapshot())

    def emit_event(self, event: Event) -> None:
        """Write ``event`` (made by the caller) to the group's stream, and fold it."""
        if self.events is not None:
            self.events.emit_event(event)
            self.history.append(event)
            self.state.apply(event)

    # ---------------------------------------------------------------- the end

    def _stop_reason(self) -> str:
        try:
            req = json.loads(self.store.get(layout.STOP))
        except (NotFound, ValueError):
            req = {}
        detail = req.get("detail")
        return f"stop requested ({req.get('reason', 'requested')}" + (
            f": {detail})" if detail else ")")

    def _write_result(self, status: str, reason: str) -> None:
        body = {"status": status, "reason": reason, "time": time.time(), "by": "aws-instance",
                "instance_id": self.identity.get("instance_id")}
        if patiently("writing the job's result", lambda: self.store.put_if_absent(
                layout.RESULT, json.dumps(body).encode())) is not None:
            self.emit("result", status=status, reason=reason)
            self.emit("status", state=status, detail=reason)

    def _teardown(self, reason: str) -> bool:
        """Step 4: the job is over; delete its capacity group, template and role
        (:mod:`.teardown`). False if the group could not be deleted: the instance has
        then powered itself off."""
        self.tearing_down.set()
        self._watched("reporting the requests made", self._report_usage)
        ident = self.identity
        self.emit("instance", action="terminated", reason=reason,
                  instance_id=ident["instance_id"], instance_type=ident.get("instance_type"),
                  az=ident.get("az_id"),
                  pool=f"{ident.get('instance_type')}@{ident.get('az_id')}")
        if self.events is not None:
            self._watched("writing the job's last events", self.events.close)
        if not delete_job_resources(self.store, self.spec, ident["region"],
                                    STORE_PATIENCE_SECONDS):
            # The group would keep this instance: it ends itself (the group launches
            # another, which finds the result and deletes the group in turn).
            power_off("the job's Auto Scaling group could not be deleted")
            return False
        log.info("job %s is over (%s): its capacity group is deleted", self.spec.job_id,
                 reason)
        return True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """EC2 is shutting the instance down: say so, flush, go (on a thread, as the
        handler may interrupt a lock holder)."""
        if self.tearing_down.is_set():
            return  # Step 4 deletes the group, which terminates us: finish the teardown

        def shut() -> None:
            if self.agent is not None and self.agent.poll() is None:
                with contextlib.suppress(OSError):
                    self.agent.send_signal(signal.SIGTERM)
            ident = self.identity
            reason = "spot-interruption" if self.notice else \
                "terminated" if not self.hook_ending else self.ending_reason or (
                    "rebalanced" if self.standbys is not None and self.standbys.held_lease
                    else "standby-given-back")
            self.emit("instance", action="terminated", reason=reason,
                      instance_id=ident.get("instance_id"),
                      instance_type=ident.get("instance_type"), az=ident.get("az_id"),
                      pool=f"{ident.get('instance_type')}@{ident.get('az_id')}")
            if self.events is not None:
                with contextlib.suppress(Exception):
                    self.events.flush()
            os._exit(0)

        threading.Timer(TERMINATION_GRACE_SECONDS, os._exit, args=(0,)).start()
        threading.Thread(target=shut, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m spotnb.providers.aws.instance``."""
    parser = argparse.ArgumentParser(prog="python -m spotnb.providers.aws.instance",
                                     description="Run a spotnb job on this EC2 instance.")
    parser.add_argument("--job", required=True, help="the job's store URI (s3://...)")
    parser.add_argument("--log-level", default=os.environ.get("SPOTNB_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)
    os.environ["SPOTNB_ORIGIN"] = "instance-agent"  # the job agent sets its own
    return InstanceAgent(args.job).run()


if __name__ == "__main__":
    sys.exit(main())
