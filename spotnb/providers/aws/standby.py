"""Warm standbys on AWS: the side of the instance that runs the job (its instance agent,
:mod:`.instance`, drives this every poll).

A standby group (:func:`.resources.rebalancing`: ``policy.standby``) has room for one
instance more than the job's nodes and two lifecycle hooks. No Auto Scaling feature
launches the standby: capacity rebalancing would launch it at the recommendation, and
in an instance's first hour moving the job then forfeits that hour's refund
(:mod:`spotnb.protocol.billing`). The instance that got the recommendation drives its
group's own API instead, and makes no request before one. What to do and when is the
warm-standby policy's (:mod:`spotnb.protocol.standby`, the local cloud's too); this
module gathers its facts and carries its decisions out, with the same events and the
same given-back notification as the local cloud::

    Step 1  a rebalance recommendation (IMDS) on an instance whose job agent holds the
            lease (a multi-node job's: a node slot's, :func:`held_slot`); one that
            comes with the notice, or on a standby, starts none: the group replaces
            the instance once EC2 ended it
    Step 2  in the instance's first hour: wait until the standby would be ready as
            that hour ends ("standby-deferred"), unless ``policy.standby_first_hour``
    Step 3  the instance claims the standby in the store (:data:`CLAIM`,
            create-if-absent), which tells the standby whom it stands by for
            (:func:`claimed_for`, its "launched" event's ``standby_for``); a multi-node
            group has room for one standby at a time: a node whose claim another holds
            waits its turn (looks again every :data:`TURN_SECONDS`), a claim past its
            ``until`` (its node ended without letting go) is taken over
    Step 4  SetDesiredCapacity(nodes + 1): the group launches the standby, whose job
            agent warms up (:mod:`spotnb.kernel_remote.standby`) and says it is ready
            (``standby/<instance>.json``, with whom it stands by for); while it boots
            its mark is looked for (a LIST every HOOK_POLL_SECONDS; not the marks that
            were there when it was asked for)
    Step 5  ready: the job moves to it. This instance ends itself through the group's
            termination hook (TerminateInstanceInAutoScalingGroup, the desired
            capacity back to nodes), whose wait its job agent reads as its notice
            (final save; a node: every rank saves, the node leaves the world), lets go
            of the lease and the instance agent completes the hook; the standby takes
            the lease (the node's slot: it joins the world in its place)

    not ready within the launch hook's wait (LAUNCH_HOOK_SECONDS, scaled as the
            notice period is) -> given back: its launch hook ABANDONed while it waits
            there (Pending:Wait), else TerminateInstanceInAutoScalingGroup on it
            (:meth:`StandbyDriver._give_back`), never an instance that holds a node
            slot; the job's webhook told what it cost (a thread of its own: the
            webhook from the job's secrets, the cost from its log folded); never
            launched (no capacity) -> the desired capacity back to nodes
            (a late launch meanwhile is what Auto Scaling scales in: an instance that
            holds the lease is protected from scale-in by its instance agent,
            SetInstanceProtection)
    a notice while it boots -> this instance leaves the group (DetachInstances: EC2
            ends it, its first hour's refund holds); the standby is its replacement,
            and no other instance launches
    a notice and no standby booting (a single-node job) -> this instance leaves the
            group without lowering its desired capacity: the replacement launches now
            and boots during the notice period (:meth:`StandbyDriver._replace_at_notice`)

Instances of a group are interchangeable, and the protocol leans on that: whichever
instance is ready takes whichever slot is freed first (a node lost meanwhile: the
standby takes its slot and is its replacement). What must never happen is ending an
instance that holds a slot for a standby's sake, or two nodes moving to one standby:
the claim and :func:`held_slot` see to those.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from spotnb.protocol import billing, layout, lease
from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.notify import SEND_TIMEOUT_SECONDS
from spotnb.protocol.secretstore import NOTIFY_SECRET
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.standby import (
    Do,
    ReadyMark,
    Standby,
    at_notice,
    deferred_event,
    given_back_event,
    notify_given_back,
    on_recommendation,
    ready_event,
    while_booting,
)
from spotnb.protocol.store import NotFound, Store
from spotnb.providers.aws import _boto, parameters
from spotnb.providers.aws.resources import (
    LAUNCH_HOOK_NAME,
    LAUNCH_HOOK_SECONDS,
    STANDBY_BOOT_SECONDS,
    group_name,
    rebalancing,
)
from spotnb.providers.imds import TERMINATION_HOOK_SECONDS, ImdsClient, termination_hook_seconds

__all__ = ["CLAIM", "StandbyDriver", "claimed_for", "held_slot", "slot_holders"]

log = logging.getLogger(__name__)

#: The claim on the group's one standby (Step 3): ``{"for": instance, "slot": k,
#: "asked": t, "until": t'}``, created if absent, deleted by its instance when its
#: standby's story ends.
CLAIM = layout.STANDBY_CLAIM
# While a standby boots, its ready mark is looked for this often (a LIST, a GET once
# there: about 345 LISTs per standby, $0.002); a multi-node node whose claim another
# holds looks at that claim as often as TURN_SECONDS (a GET: 360/h = $0.00014/h, only
# while it waits its turn).
HOOK_POLL_SECONDS = 2.0
TURN_SECONDS = 10.0
# A standby that Auto Scaling will not end yet (its launch hook's wait) is asked again
# this many times, HOOK_POLL_SECONDS apart.
GIVE_BACK_TRIES = 60
# A standby launched earlier than its claim by more than this is not the claim's (a
# node, a replacement): instances' clocks agree within it (EC2's are NTP-synced).
CLOCK_SKEW_SECONDS = 5.0


def held_slot(store: Store, nodes: int, holder: str, first: int | None = None) -> int | None:
    """The node slot whose lease ``holder`` holds (not released), if any: slot
    ``first`` read first (an agent keeps its slot), then the others: one GET each."""
    order = list(range(nodes))
    if first is not None and first in order:
        order.remove(first)
        order.insert(0, first)
    for slot in order:
        current = lease.read(store, slot)
        if current is not None and current[0].holder == holder and not current[0].released:
            return slot
    return None


def slot_holders(store: Store, nodes: int) -> set[str]:
    """Who holds a node slot's lease (not released): one GET per slot."""
    found = set()
    for slot in range(nodes):
        current = lease.read(store, slot)
        if current is not None and not current[0].released:
            found.add(current[0].holder)
    return found


def claimed_for(store: Store, instance_id: str, launched: float) -> str | None:
    """The instance that ``instance_id`` (launched by EC2 at ``launched``) stands by for:
    the claim's (:data:`CLAIM`, one GET) if the claim was made before this launch and
    is not past its time; None for any other instance (a node, a replacement)."""
    try:
        said = json.loads(store.get(CLAIM))
    except (NotFound, ValueError):
        return None
    if not isinstance(said, dict):
        return None
    other, asked, until = said.get("for"), said.get("asked"), said.get("until")
    if not isinstance(other, str) or other == instance_id or \
            not isinstance(asked, (int, float)) or not isinstance(until, (int, float)):
        return None
    return other if asked - CLOCK_SKEW_SECONDS <= launched <= until else None


class StandbyDriver:
    """One instance's side of warm standbys (the module docstring). The instance agent
    calls :meth:`poll` every poll with what it knows; the driver makes the requests.

    ``emit`` writes an event to the group's stream; ``known`` names the instances the
    job knew when this one booted (their ready marks are not this one's standby's);
    ``lease_due`` says whether this instance's job agent may yet take the lease (the
    group's launch hook still waits for that)."""

    def __init__(self, store: Store, spec: JobSpec, imds: ImdsClient,
                 identity: dict[str, str], emit: Callable[[Event], None],
                 known: Callable[[], Collection[str]],
                 lease_due: Callable[[], bool]) -> None:
        self.store = store
        self.spec = spec
        self.imds = imds
        self.identity = identity
        self.emit = emit
        self.known = known
        self.lease_due = lease_due
        self.nodes = spec.resources.max_nodes
        self.enabled = rebalancing(spec)
        #: "none" (no recommendation yet), "deciding", "deferred" (until ``due``),
        #: "turn" (a multi-node node waiting for the group's one standby), "asked"
        #: (the group launches it), "giving-back" (not ready in time), "done".
        self.phase = "none"
        self.due: float | None = None
        self.asked: float | None = None
        self.standby_id: str | None = None
        #: The node slot this instance's job agent holds, once seen, and whether it was
        #: ever seen holding the lease (a standby given back never was): what
        #: :meth:`holds_lease` found, for the instance agent too.
        self.slot: int | None = None
        self.held_lease = False
        self.claimed = False
        self._marks_before: set[str] = set()
        self._give_back_tries = 0
        self._checked = -HOOK_POLL_SECONDS
        self._turn_said = False
        self._decide_at = 0.0

    @property
    def iid(self) -> str:
        return self.identity["instance_id"]

    def holds_lease(self) -> bool:
        """Whether this instance's job agent holds the lease (a node slot's) now: a GET
        per slot, the slot it held first (:attr:`slot`, :attr:`held_lease`)."""
        self.slot = held_slot(self.store, self.nodes, self.iid, self.slot)
        self.held_lease = self.held_lease or self.slot is not None
        return self.slot is not None

    # ---------------------------------------------------------------- the steps

    def poll(self, now: float, noticed: bool, ending: bool, launched_at: float) -> None:
        """One look: ``now`` (monotonic), whether EC2's notice came (``noticed``) or
        Auto Scaling ends this instance through its termination hook (``ending``),
        and EC2's launch time of this instance (its first hour)."""
        if not self.enabled or self.phase == "done":
            return
        if noticed and self.phase in ("none", "deciding", "deferred", "turn"):
            self._replace_at_notice()  # no standby boots for this instance
            return
        if self.phase == "none":
            try:
                recommended = self.imds.rebalance()
            except OSError:
                return
            if not recommended:
                return
            log.info("rebalance recommendation: %s", recommended)
            self.phase = "deciding"
        wall = time.time()
        if self.phase == "deferred":
            assert self.due is not None
            if noticed or ending or wall >= self.due:
                self._decide(wall, noticed or ending, launched_at, Standby.DUE)
            return
        if self.phase == "turn":
            if noticed or ending:
                log.info("no standby: the node ends before its turn came")
                self._done()
            elif now - self._checked >= TURN_SECONDS:
                self._checked = now
                self._ask()
            return
        if now - self._checked < HOOK_POLL_SECONDS:
            return
        self._checked = now
        if self.phase == "deciding":
            if now >= self._decide_at:
                self._decide(wall, noticed or ending, launched_at, Standby.NONE)
        elif self.phase == "asked":
            self._watch(wall, noticed, ending)
        elif self.phase == "giving-back":
            if noticed and at_notice(self.spec.policy, nodes=self.nodes, booting=True,
                                     runs_job=self.held_lease).do is Do.TAKEOVER:
                self._leave_at_notice()  # the standby is the replacement after all
            elif self._give_back(self.standby_id) or ending:
                self._done()
            else:
                self._give_back_tries += 1
                if self._give_back_tries >= GIVE_BACK_TRIES:
                    log.warning("could not give back the standby; `spotnb aws cleanup` "
                                "or the job's end removes it")
                    self._done()

    def _decide(self, wall: float, ending: bool, launched_at: float,
                standby: Standby) -> None:
        """Steps 1 and 2: whether this instance runs the job, and when its standby
        launches (the policy's :func:`~spotnb.protocol.standby.on_recommendation`;
        ``standby``: DUE once a deferral's time came)."""
        try:
            runs_job = self.holds_lease()
        except Exception:
            log.debug("reading the lease for a standby failed", exc_info=True)
            return  # the next look
        scale = billing.time_scale()
        decision = on_recommendation(self.spec.policy, ending=ending, runs_job=runs_job,
                                     standby=standby, age=(wall - launched_at) * scale,
                                     boot_seconds=STANDBY_BOOT_SECONDS)
        if decision.do is Do.LATER:
            # Its job agent has yet to take the lease (the instance agent knows: its
            # launch hook is still due), or this is a standby, recommended itself: once
            # it takes the job over it asks for its own; looked at again meanwhile.
            self.phase = "deciding"
            if not self.lease_due():
                self._decide_at = time.monotonic() + TURN_SECONDS
        elif decision.do is Do.DEFER:
            self.due = wall + decision.wait / scale
            self.phase = "deferred"
            log.info("standby waits %.0f market s: %s", decision.wait, decision.why)
            ident = self.identity
            self.emit(deferred_event(
                self.iid, wall, self.due, instance_type=ident["instance_type"],
                az=ident.get("az_id"), pool=f"{ident['instance_type']}@{ident.get('az_id')}"))
        elif decision.do is Do.LAUNCH:
            self._ask()
        else:
            log.info("no standby: %s", decision.why)
            self._done()

    def _ask(self) -> None:
        """Steps 3 and 4: the group launches the standby (desired capacity nodes + 1),
        once this node has the claim."""
        if not self._claim():
            self.phase = "turn"
            return
        self.phase = "asked"
        self.asked = time.time()
        self._checked = time.monotonic()
        try:  # the marks of standbys ready before this one was asked for: not this one's
            self._marks_before = set(self.store.list_keys("standby/"))
        except Exception:
            log.debug("listing the standbys' marks failed", exc_info=True)
        if not self._asg("set_desired_capacity", "asking the group for a standby",
                         DesiredCapacity=self.nodes + 1, HonorCooldown=False):
            self._done()
            return
        log.info("asked the group for a warm standby")

    def _hold_seconds(self) -> float:
        """How long a standby may take to be ready (LAUNCH_HOOK_SECONDS), in this
        instance's seconds (scaled as the termination hook's wait is)."""
        return LAUNCH_HOOK_SECONDS * termination_hook_seconds() / TERMINATION_HOOK_SECONDS

    def _watch(self, wall: float, noticed: bool, ending: bool) -> None:
        """Step 5: the standby boots (the policy's
        :func:`~spotnb.protocol.standby.while_booting`): a notice makes it the
        replacement; once it is ready the job moves to it; not ready in time, it is
        given back. Its hold counts in the termination hook's seconds, as the launch
        hook's wait does (the simulator scales both with its notice period)."""
        ready = None if noticed or ending else self._ready_standby()
        assert self.asked is not None
        hook_scale = termination_hook_seconds() / TERMINATION_HOOK_SECONDS
        decision = while_booting(instance_ending=noticed or ending, ready=ready is not None,
                                 waited=(wall - self.asked) / hook_scale,
                                 boot_seconds=STANDBY_BOOT_SECONDS)
        if decision.do is Do.TAKEOVER:
            if noticed:
                self._leave_at_notice()
            else:
                self._done()
        elif decision.do is Do.MOVE:
            assert ready is not None
            standby, mark = ready
            self.emit(ready_event(standby, self.iid, mark, wall, reported_by=self.iid))
            log.info("standby %s is ready: moving the job to it", standby)
            self.protect(False)  # ended on purpose, whatever AWS makes of protection
            if not self._asg("terminate_instance_in_auto_scaling_group",
                             "ending this instance for its standby", InstanceId=self.iid,
                             ShouldDecrementDesiredCapacity=True):
                self.protect(True)
                self.standby_id = standby
                self._start_giving_back()
                return
            self._done()
        elif decision.do is Do.GIVE_BACK:
            self._start_giving_back()

    def _start_giving_back(self) -> None:
        self.phase = "giving-back"
        self._give_back_tries = 0
        if self._give_back(self.standby_id):
            self._done()

    def _leave_at_notice(self) -> None:
        """A notice while the standby boots: EC2 ends this instance (free in its first
        hour); out of the group, it is not replaced by another: the standby is its
        replacement."""
        if self._asg("detach_instances", "leaving the group at the notice",
                     InstanceIds=[self.iid], ShouldDecrementDesiredCapacity=True):
            log.info("interruption notice: the standby booting is the replacement")
        self._done()

    def _replace_at_notice(self) -> None:
        """EC2's notice, and no standby booting for this instance (none was asked for,
        or it waited for the first hour's end or its turn): a single-node job's instance
        leaves its group without lowering its desired capacity (DetachInstances), so
        the group launches the replacement now, not after EC2 ended this one: it boots
        during the notice period and, finding the lease held, warms up as a standby
        (the local group starts one at such a notice the same way). EC2 still ends
        this instance as an interruption (its first hour refunded). A multi-node node's
        replacement launches after the loss, as on the local cloud; an instance that
        does not run the job (a standby) asks for none (the policy's
        :func:`~spotnb.protocol.standby.at_notice`)."""
        self._done()
        runs_job = self.held_lease
        if self.nodes == 1:  # a node's replacement comes after the loss: no read
            try:
                # This instance's job agent holds the lease, or has just let go of it
                # (a small state's final save can be durable before this look).
                current = lease.read(self.store)
            except Exception:
                log.debug("reading the lease at the notice failed", exc_info=True)
                return
            runs_job = current is not None and current[0].holder == self.iid
        decision = at_notice(self.spec.policy, nodes=self.nodes, booting=False,
                             runs_job=runs_job)
        if decision.do is not Do.REPLACE:
            log.info("no replacement at the notice: %s", decision.why)
            return
        if self._asg("detach_instances", "leaving the group at the notice",
                     InstanceIds=[self.iid], ShouldDecrementDesiredCapacity=False):
            log.info("interruption notice: the group launches the replacement now, to "
                     "boot during the notice period")

    def _ready_standby(self) -> tuple[str, ReadyMark] | None:
        """A standby launched for this instance that says it is ready (its mark in the
        store: one LIST, a GET once there), with what it said. Not a mark that was
        there when this one was asked for (an earlier move's standby, which may be
        taking another node's slot), nor one that says it stands by for another
        instance (``standby_for``: a standby given back late); a replacement's mark
        (a standby for no one) will do."""
        try:
            keys = self.store.list_keys("standby/")
        except Exception:
            log.debug("listing the standbys' marks failed", exc_info=True)
            return None
        known = self.known()
        for key in keys:
            other = key.rsplit("/", 1)[-1].removesuffix(".json")
            # Launched before this instance's boot: an earlier standby, not this one's.
            if other == self.iid or other in known or key in self._marks_before:
                continue
            try:
                mark = ReadyMark.parse(self.store.get(key))
            except Exception:
                mark = ReadyMark()
            if mark.standby_for not in (None, self.iid):
                self._marks_before.add(key)  # another's: not read again
                continue
            return other, mark
        return None

    def _give_back(self, standby: str | None) -> bool:
        """A standby not ready in time (or the move failed): ended, the group back to
        the job's nodes. Whether that is done (else it is tried again). Never an
        instance that holds a node slot: a standby does not before it is ready and
        moved to.

        How depends on where the standby is in its launch (its ``LifecycleState``):

        * ``Pending:Wait`` (the launch hook still waits for it, up to
          LAUNCH_HOOK_SECONDS after it launched, which may be long after it was asked
          for): the hook is completed with ``ABANDON``, which Auto Scaling answers by
          terminating it, then the desired capacity goes back to the nodes. Not
          ``TerminateInstanceInAutoScalingGroup``, which Auto Scaling may refuse before
          the instance is in service: its wait could outlast any retries, leaving a
          billed standby until the job's end.
        * ``Pending``/``Pending:Proceed`` (moments): tried again at the next look.
        * ``InService``: ``TerminateInstanceInAutoScalingGroup``, lowering the desired
          capacity with it.
        * not launched at all (no capacity): the desired capacity back to the nodes.
        """
        try:
            groups = _boto.client("autoscaling", self.identity["region"]) \
                .describe_auto_scaling_groups(
                    AutoScalingGroupNames=[group_name(self.spec.job_id)])
            members = {i["InstanceId"]: str(i.get("LifecycleState", ""))
                       for g in groups["AutoScalingGroups"] for i in g.get("Instances", ())
                       if i["InstanceId"] != self.iid}
            holding = slot_holders(self.store, self.nodes) if members else set()
        except Exception as err:
            log.warning("cannot find the standby to give back: %s", err)
            return False
        if standby is None:
            free = [m for m, state in members.items()
                    if m not in holding and not state.startswith("Terminat")]
            standby = free[0] if free else None
        if standby is None or members.get(standby, "").startswith("Terminat"):
            # It never launched (no capacity), or it is on its way out already.
            return self._asg("set_desired_capacity", "giving back the standby never "
                             "launched", DesiredCapacity=self.nodes, HonorCooldown=False)
        self.standby_id = standby
        state = members.get(standby, "")
        if state in ("Pending", "Pending:Proceed"):
            return False  # in a moment: Pending:Wait or InService
        log.info("standby %s (%s) not ready in time: giving it back", standby, state)
        if state == "Pending:Wait":
            if not self._asg("complete_lifecycle_action", "abandoning the standby's launch",
                             LifecycleHookName=LAUNCH_HOOK_NAME, InstanceId=standby,
                             LifecycleActionResult="ABANDON"):
                return False
            self._asg("set_desired_capacity", "the group back to its nodes",
                      DesiredCapacity=self.nodes, HonorCooldown=False)
        elif not self._asg("terminate_instance_in_auto_scaling_group",
                           "giving back the standby", InstanceId=standby,
                           ShouldDecrementDesiredCapacity=True):
            return False
        at = time.time()
        self.emit(given_back_event(standby, self.iid, at, reported_by=self.iid))
        self._tell_given_back(standby, at)
        return True

    def _tell_given_back(self, standby: str, at: float) -> None:
        """The job's webhook told that ``standby`` was given back, as the local cloud's
        group tells it (:func:`spotnb.protocol.standby.notify_given_back`), from a
        thread of its own: the webhook from the job's secrets (one GetParameters, the
        instance role may read them) and the standby's type, zone and cost from the
        job's log, folded (its launch is its own instance agent's event; one read of
        the log per standby given back)."""
        if NOTIFY_SECRET not in self.spec.secrets:
            return

        def tell() -> None:
            try:
                ssm = _boto.client("ssm", self.spec.resources.region)
                url = parameters.read(ssm, self.spec.job_id, [NOTIFY_SECRET])[NOTIFY_SECRET]
                state = fold(EventReader(self.store, batches=True).poll(), self.nodes)
            except Exception as err:  # a notification is an extra: never the job's
                log.warning("cannot tell the webhook that the standby was given back: %s",
                            type(err).__name__)
                return
            inst = state.instances.get(standby)
            notify_given_back(self.spec, url, instance_id=standby,
                              instance_type=inst.instance_type if inst else None,
                              az=inst.az if inst else None,
                              cost_usd=state.instance_cost(standby, end=at),
                              job_start=state.first_launch, wait=SEND_TIMEOUT_SECONDS)

        threading.Thread(target=tell, name="spotnb-given-back", daemon=True).start()

    def _done(self) -> None:
        """The standby's story is over for this instance: a multi-node node lets go of
        its claim (the next node's turn)."""
        self.phase = "done"
        self._release_claim()

    # --------------------------------------------------- the claim (multi-node)

    def _claim(self) -> bool:
        """Step 3: whether this instance may ask for the group's standby now (a
        single-node job's one instance always may: its claim only says whom the
        standby is for, :func:`claimed_for`)."""
        if self.claimed:
            return True
        wall = time.time()
        until = wall + self._hold_seconds() + GIVE_BACK_TRIES * HOOK_POLL_SECONDS \
            + TURN_SECONDS
        body = json.dumps({"for": self.iid, "slot": self.slot, "asked": wall,
                           "until": until}).encode()
        try:
            if self.store.put_if_absent(CLAIM, body) is not None:
                self.claimed = True
                return True
            raw, etag = self.store.get_with_etag(CLAIM)
            try:
                other = json.loads(raw)
            except ValueError:
                other = {}
            other = other if isinstance(other, dict) else {}
            other_until = other.get("until")
            if isinstance(other_until, (int, float)) and wall < other_until and \
                    self.nodes > 1:
                if not self._turn_said:
                    self._turn_said = True
                    log.info("a standby is on its way for %s (node slot %s): this node's "
                             "waits its turn", other.get("for"), other.get("slot"))
                return False
            # Past its time (its node ended without letting go of it), or a single-node
            # job's, whose instance that claimed it is gone.
            self.claimed = self.store.put_if_match(CLAIM, body, etag) is not None
        except NotFound:
            return False  # let go of meanwhile: the next look takes it
        except Exception:
            log.debug("claiming the group's standby failed", exc_info=True)
            return False
        return self.claimed

    def _release_claim(self) -> None:
        if not self.claimed:
            return
        self.claimed = False
        try:
            said = json.loads(self.store.get(CLAIM))
            if isinstance(said, dict) and said.get("for") == self.iid:
                self.store.delete(CLAIM)
        except NotFound:
            pass
        except Exception:
            log.debug("letting go of the standby claim failed; it expires", exc_info=True)

    # ---------------------------------------------------------------- requests

    def protect(self, protected: bool) -> bool:
        """Protect this instance from the group's scale-in (it runs the job: lowering
        the desired capacity, as a give-back does, must end a standby, never it), or
        take the protection off; whether Auto Scaling took it."""
        return self._asg("set_instance_protection", "protecting this instance from "
                         "scale-in" if protected else "lifting its scale-in protection",
                         InstanceIds=[self.iid], ProtectedFromScaleIn=protected)

    def _asg(self, call: str, what: str, **params: Any) -> bool:
        """One Auto Scaling request about the job's group (retried on throttling);
        whether it succeeded."""
        client = _boto.client("autoscaling", self.identity["region"])
        if call != "terminate_instance_in_auto_scaling_group":  # names only the instance
            params["AutoScalingGroupName"] = group_name(self.spec.job_id)
        try:
            _boto.with_backoff(lambda: getattr(client, call)(**params), what=what)
            return True
        except Exception as err:
            log.warning("%s failed: %s", what, err)
            return False
