"""Warm standbys on the local cloud: the capacity group's side (:mod:`.group` calls it
every tick), launching, moving to and giving back standby instances as the warm-standby
policy (:mod:`spotnb.protocol.standby`, AWS's too) decides::

    a rebalance recommendation (the group published it) -> on_recommendation:
        LAUNCH  a standby instance launched for it (its agent finds the lease held and
                warms up: spotnb.kernel_remote.standby); DEFER  "standby-deferred",
                launched at its due time (kept in the instance's meta.json for a
                supervisor that adopts it); LATER  asked again every tick
    its notice -> at_notice: REPLACE  the replacement launched now (a standby, booting
                during the notice period); TAKEOVER  the standby booting is it
    the standby boots -> while_booting, every tick:
        ready ("standby-ready", once its agent said so in the store) -> MOVE  the old
                instance ended through its termination hook, as Auto Scaling does once a
                capacity-rebalancing replacement is in service; ended once its agent
                released the lease (:meth:`Standbys.hook_done`)
        not ready within its hold -> GIVE_BACK  terminated, billed to the job
                ("standby-given-back"), and the job's webhook told
        its instance noticed, ended or gone -> TAKEOVER  the job's next instance

A multi-node job's standby is one node's: it waits for that node's slot outside the
rendezvous (:class:`spotnb.kernel_remote.standby.NodeStandby`), and the node ended
through its termination hook is done once it released its slot's lease. A standby that
takes the slot of another node, lost meanwhile, is that node's replacement and no
longer on hold. Only a recommendation that comes before its node's notice starts one:
one that comes with the notice (in its tick) has nothing to warm ahead of, and a standby
launched then would only be the lost node's replacement, launched before the node is
gone (the world would count one node too many while it is).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from spotnb.protocol import layout, lease, secretstore
from spotnb.protocol.events import Event
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.standby import (
    GIVEN_BACK,
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
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.state import Settings

__all__ = ["Group", "Standbys"]

log = logging.getLogger(__name__)


class Group(Protocol):
    """What the standbys use of the capacity group (:class:`.group.Supervisor`)."""

    spec: JobSpec
    settings: Settings
    store: Store
    #: The instances the group keeps (launched, not ended), standbys included.
    running: list[LocalInstance]
    #: The job's nodes (1 for a single-node job).
    target: int
    first_launch: float | None

    def winding_down(self) -> bool:
        """Whether the job ends (a result, a stop): nothing more is launched."""

    def launch(self, now: float, standby_for: str | None = None) -> LocalInstance | None:
        """An instance in the first pool that can take it, logged as a standby for
        ``standby_for``; None without capacity."""

    def spawn(self, inst: LocalInstance, now: float) -> None:
        """Start its agent (its boot is over)."""

    def terminate(self, inst: LocalInstance, now: float, reason: str) -> float:
        """End it (no event); what it cost."""

    def forget(self, inst: LocalInstance) -> None:
        """No longer keep it (it ended)."""

    def emit_event(self, event: Event) -> None:
        """Write an event to the group's stream."""

    def moved(self, inst: LocalInstance) -> None:
        """The job moves off ``inst``: what the market foresaw for it leaves with it."""


class Standbys:
    """The group's warm standbys (see the module docstring)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        # Multi-node jobs: the instances recommended in this tick's step 4, whose standby
        # is decided at its end, once their notice did or did not come in the same tick.
        self.wanted: set[str] = set()

    # ------------------------------------------------------------ the instance's side

    def recommended(self, inst: LocalInstance, now: float, with_notice: bool) -> None:
        """The group published a recommendation for ``inst`` (``with_notice``: in the
        tick of its notice, which :meth:`at_notice` answers)."""
        if with_notice:
            return
        if self.group.target > 1:
            self.wanted.add(inst.id)  # decided at the end of its step 4: end_of_step
            return
        self._decide(inst, now, Standby.NONE)

    def step(self, inst: LocalInstance, now: float) -> None:
        """Step 4 of ``inst``'s tick, not under notice: a deferred standby due, or a
        recommendation asked again (LATER)."""
        if inst.standby_due is not None and now >= inst.standby_due:
            inst.standby_due = None
            inst.update_meta(standby_due=None)
            self._decide(inst, now, Standby.DUE)
        elif inst.standby_later:
            self.recommended(inst, now, with_notice=False)

    def end_of_step(self, inst: LocalInstance, now: float) -> None:
        """The end of ``inst``'s step 4: a multi-node job's recommendation of this tick
        is decided, its notice come or not."""
        if inst.id in self.wanted:
            self.wanted.discard(inst.id)
            self._decide(inst, now, Standby.NONE)

    def at_notice(self, inst: LocalInstance, now: float) -> None:
        """EC2's notice for ``inst`` (given in this tick, after this): with no standby
        booting for it, a single-node job's replacement launches now."""
        decision = at_notice(self.group.spec.policy, nodes=self.group.target,
                             booting=self._standby_of(inst) is not None,
                             runs_job=self._runs_job(inst))
        inst.standby_later = False
        if decision.do is Do.REPLACE and not self.group.winding_down():
            self._launch(inst, now)

    def _runs_job(self, inst: LocalInstance) -> bool:
        """Whether ``inst`` runs the job: its agent started, not a standby on hold."""
        return inst.started and not inst.on_hold

    def _standby_of(self, inst: LocalInstance) -> LocalInstance | None:
        return next((i for i in self.group.running if i.standby_for == inst.id), None)

    def _decide(self, inst: LocalInstance, now: float, standby: Standby) -> None:
        """The policy's :func:`~spotnb.protocol.standby.on_recommendation`, carried out."""
        group = self.group
        inst.standby_later = False
        if group.winding_down():
            return
        scale = group.settings.time_scale
        decision = on_recommendation(
            group.spec.policy, ending=inst.terminate_at is not None,
            runs_job=self._runs_job(inst),
            standby=Standby.ASKED if self._standby_of(inst) is not None else standby,
            age=inst.age(now), boot_seconds=group.settings.boot_seconds * scale)
        if decision.do is Do.LAUNCH:
            self._launch(inst, now)
        elif decision.do is Do.LATER:
            inst.standby_later = True
        elif decision.do is Do.DEFER and inst.standby_due is None:
            inst.standby_due = now + decision.wait / scale
            inst.update_meta(standby_due=inst.standby_due)  # for a supervisor that adopts it
            log.info("standby for %s waits %.0f market s: %s", inst.id, decision.wait,
                     decision.why)
            group.emit_event(deferred_event(inst.id, now, inst.standby_due,
                                            **inst.describe()))

    def _launch(self, inst: LocalInstance, now: float) -> None:
        standby = self.group.launch(now, standby_for=inst.id)
        if standby is None:
            return  # no capacity: the replacement launches after the loss, as without
        standby.standby_for = inst.id
        standby.on_hold = True
        if standby.boot_until <= now:
            self.group.spawn(standby, time.time())

    # ------------------------------------------------------------- the standby's side

    def mind(self, standby: LocalInstance, now: float) -> None:
        """A standby on hold, each tick (the policy's
        :func:`~spotnb.protocol.standby.while_booting`): the job's next instance once
        the instance it stands by for is noticed or gone; ready, the job moves to it;
        given back if it is not ready by the end of its hold."""
        group = self.group
        old = next((i for i in group.running if i.id == standby.standby_for), None)
        scale = group.settings.time_scale
        decision = while_booting(
            instance_ending=old is None or old.terminate_at is not None,
            ready=standby.standby_ready, waited=(now - standby.launched) * scale,
            boot_seconds=(standby.boot_until - standby.launched) * scale)
        if decision.do is Do.TAKEOVER:
            standby.on_hold = False  # the job's next instance now
        elif decision.do is Do.MOVE and old is not None:
            self._move(old, standby, now)
        elif decision.do is Do.GIVE_BACK and old is not None:
            self._give_back(standby, old, now)

    def _move(self, old: LocalInstance, standby: LocalInstance, now: float) -> None:
        """As Auto Scaling does once a capacity-rebalancing replacement is in service:
        end the at-risk instance through its termination hook. Its agent takes that
        for its notice (final save, lease released) and the standby takes the lease;
        the old instance ends once its lease is released (:meth:`hook_done`), else at
        the hook's timeout."""
        self.group.moved(old)
        old.end_through_hook(now, self.group.settings.notice_seconds)
        standby.on_hold = False  # the job's next instance now
        log.info("standby %s is ready: ending %s through its termination hook",
                 standby.id, old.id)

    def _give_back(self, standby: LocalInstance, old: LocalInstance, now: float) -> None:
        log.info("standby %s for %s not ready within its hold: giving it back",
                 standby.id, old.id)
        cost = self.group.terminate(standby, now, GIVEN_BACK)
        self.group.emit_event(given_back_event(standby.id, old.id, now, **standby.describe(),
                                               cost_usd=round(cost, 6)))
        self.group.forget(standby)
        self._notify_given_back(standby, cost)

    def _notify_given_back(self, standby: LocalInstance, cost: float) -> None:
        """Tell the job's webhook, if it has one (its secret on this machine)."""
        spec = self.group.spec
        if secretstore.NOTIFY_SECRET not in spec.secrets:
            return
        try:
            url = secretstore.read_local(spec.job_id, [secretstore.NOTIFY_SECRET])
        except Exception as err:  # a notification is an extra: never the group's tick
            log.warning("cannot read the job's webhook: %s", type(err).__name__)
            return
        # Sent from the notifier's own thread: the tick goes on.
        notify_given_back(spec, url.get(secretstore.NOTIFY_SECRET), instance_id=standby.id,
                          instance_type=standby.pool.instance_type, az=standby.pool.az,
                          cost_usd=cost, job_start=self.group.first_launch)

    # ------------------------------------------------------------------- the store

    def poll_store(self, inst: LocalInstance) -> None:
        """At the group's read of the store: a multi-node job's standby that took the
        slot of another node, lost meanwhile, is that node's replacement now, not on
        hold; a standby's ready mark, logged once (``standby-ready``)."""
        if inst.on_hold and self.group.target > 1 and inst.started and \
                self.slot_of(inst.id) is not None:
            log.info("standby %s took the place of a lost node", inst.id)
            inst.on_hold = False
        if inst.standby_for is not None and inst.started and not inst.standby_ready:
            try:
                raw = self.group.store.get(layout.standby_ready_key(inst.id))
            except NotFound:
                return
            inst.standby_ready = True
            self.group.emit_event(ready_event(inst.id, inst.standby_for,
                                              ReadyMark.parse(raw), time.time(),
                                              **inst.describe()))

    def hook_done(self, inst: LocalInstance) -> bool:
        """Whether the agent of ``inst``, ended through its termination hook, released
        the job's lease (or another holds it; a multi-node job's: of its node slot):
        its lifecycle action is complete."""
        try:
            if self.group.target > 1:
                return self.slot_of(inst.id) is None
            current = lease.read(self.group.store)
        except Exception:  # the hook's timeout ends it instead
            return False
        return current is not None and (current[0].holder != inst.id
                                        or current[0].released)

    def slot_of(self, instance_id: str) -> int | None:
        """The node slot whose lease ``instance_id`` holds (not released), if any: one
        read of each slot's lease (a multi-node job's standbys and moves only)."""
        for slot in range(self.group.target):
            current = lease.read(self.group.store, slot)
            if current is not None and current[0].holder == instance_id and \
                    not current[0].released:
                return slot
        return None
