"""An instance's turn in the local cloud's capacity group: what happens to it in each
tick of the supervisor (:class:`.group.Supervisor` calls :func:`step` for every instance
it keeps), as EC2 plays it::

    Step 1  boot: the agent starts once the simulated boot delay is over
    Step 2  an agent that exited by itself (the group's to answer:
            ``Supervisor.agent_exited``), or a fault asked for: killed outright, frozen,
            a rebalance recommendation (:mod:`.control`)
            (a warm standby on hold is minded here: :mod:`.standbys`)
    Step 3  the market moves: a new spot price, said in the log
    Step 4  does EC2 want the instance back? its recommendations that are due, then its
            notice (:mod:`.interruptions` says when; a notice nobody foresaw brings its
            recommendation in the same tick)
    Step 5  the notice period is over (or, ended through its termination hook, the
            agent handed the lease over): terminated, and a replacement may launch
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from spotnb.providers.failover import notice_end
from spotnb.providers.local.imds import iso_utc
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.interruptions import FORESEEN, Interruptions
from spotnb.providers.local.pools import Pools
from spotnb.providers.local.standbys import Standbys
from spotnb.providers.local.state import Settings

__all__ = ["Group", "send_signals", "step"]

log = logging.getLogger(__name__)


class Group(Protocol):
    """What an instance's turn uses of the capacity group (:class:`.group.Supervisor`)."""

    settings: Settings
    #: The instances the group keeps (launched, not ended).
    running: list[LocalInstance]
    #: Faults (and recommendations) asked for: (instance id, "kill", "freeze" or
    #: "recommend").
    faults_requested: list[tuple[str, str]]
    first_launch: float | None
    #: Agents in a row that exited soon after they started, without a result.
    crashes: int
    next_launch_at: float
    standbys: Standbys
    interruptions: Interruptions
    pools: Pools

    def winding_down(self) -> bool:
        """Whether the job ends (a result, a stop, a crash loop): nothing launches."""

    def spawn(self, inst: LocalInstance, now: float) -> None:
        """Start its agent (its boot is over)."""

    def agent_exited(self, inst: LocalInstance, now: float, code: int | None) -> None:
        """Its agent exited by itself: the job's end, a crash, or a store it gave up on."""

    def end(self, inst: LocalInstance, now: float, reason: str, **extra: Any) -> None:
        """Terminate it and say so."""

    def forget(self, inst: LocalInstance) -> None:
        """No longer keep it (it ended): a replacement may launch."""

    def emit(self, type: str, instance: str | None, at: float | None = None,
             **data: Any) -> None:
        """Write an event to the group's stream."""


def step(group: Group, inst: LocalInstance, now: float) -> None:
    """``inst``'s turn in the group's tick (module docstring)."""
    # Step 1: boot. The agent starts once the simulated boot delay is over.
    if not inst.started:
        if inst.terminate_at is None and not group.winding_down() and now >= inst.boot_until:
            group.spawn(inst, now)
            if inst not in group.running:  # the agent could not even be started
                return
    # Step 2: an agent that exited by itself, or a fault asked for (kill, freeze).
    elif (code := inst.exit_code()) is not None:
        group.agent_exited(inst, now, code)
        return
    elif any(i == inst.id for i, _ in group.faults_requested):
        kinds = {k for i, k in group.faults_requested if i == inst.id}
        group.faults_requested = [f for f in group.faults_requested if f[0] != inst.id]
        if "kill" in kinds:
            _kill(group, inst, now)
            return
        if "recommend" in kinds and inst.terminate_at is None and not group.winding_down():
            _recommend(group, inst, now, "requested")
        if "freeze" in kinds:
            _freeze(group, inst)
    if inst.on_hold:
        group.standbys.mind(inst, now)
        if inst not in group.running:
            return
    # Step 3: the market moves.
    if inst.next_price_change is not None and now >= inst.next_price_change:
        price = inst.market.price_at(now)
        if price != inst.price:
            inst.price = price
            group.pools.emit_price(inst)
        inst.next_price_change = inst.market.next_change_after(now)
    # Step 4: does EC2 want the instance back? First its recommendation, if one is
    # due: one with no lead comes in the tick of its notice, before it.
    if inst.terminate_at is None and not group.winding_down():
        send_signals(group, inst, now)
        group.standbys.step(inst, now)
        reason = group.interruptions.notice_due(inst, now, group.first_launch)
        if reason is not None:
            _notice(group, inst, now, reason)
    else:  # already under notice, or winding down: no interruption to give it
        group.interruptions.withdraw(inst.id)
    # A multi-node job's recommendation (step 2, 4), its notice come with it or not.
    group.standbys.end_of_step(inst, now)
    # Step 5: the notice period is over (or, ended through the termination hook, the
    # agent handed the lease over).
    if inst.notice_reason == "rebalanced" and inst.terminate_at is not None and (
            now >= inst.terminate_at or group.standbys.hook_done(inst)):
        group.end(inst, now, "rebalanced")
        group.forget(inst)
        return
    if inst.terminate_at is not None and now >= inst.terminate_at:
        group.end(inst, now, notice_end(inst.notice_reason))
        group.forget(inst)
        group.crashes = 0
        group.next_launch_at = now


def send_signals(group: Group, inst: LocalInstance, now: float) -> None:
    """Publish the recommendations of ``inst`` that are due (:mod:`.interruptions`)."""
    first = group.interruptions.first_uninterrupted(group.running)
    for reason in group.interruptions.recommendations_due(inst, now, group.first_launch,
                                                          first):
        _recommend(group, inst, now, reason)


def _recommend(group: Group, inst: LocalInstance, now: float, reason: str,
               with_notice: bool = False) -> None:
    """A rebalance recommendation for ``inst`` at its metadata service, and in the
    log; then its warm standby (:mod:`.standbys`; on AWS the job's instance agent
    asks its Auto Scaling group for one). ``with_notice``: the recommendation comes
    in the tick of the notice."""
    inst.recommend_rebalance(now)
    log.info("rebalance recommendation for %s (%s)", inst.id, reason)
    group.emit("instance", inst.id, at=now, action="rebalance", reason=reason,
               **inst.describe(), notice_time=iso_utc(now))
    group.standbys.recommended(inst, now, with_notice)


def _kill(group: Group, inst: LocalInstance, now: float) -> None:
    """A machine lost outright: SIGKILL the agent and everything it started at once
    (no notice, no grace); the group replaces it as after an interruption."""
    inst.kill_now()
    log.info("killed instance %s without notice (requested)", inst.id)
    group.end(inst, now, "killed")
    group.forget(inst)
    group.next_launch_at = now


def _freeze(group: Group, inst: LocalInstance) -> None:
    """A node gone silent: SIGSTOP the agent and everything it started."""
    inst.freeze()
    log.info("froze instance %s (requested)", inst.id)
    group.emit("instance", inst.id, action="frozen", **inst.describe())


def _notice(group: Group, inst: LocalInstance, now: float, reason: str) -> None:
    """Interrupt like EC2: the notice now, the termination after the notice period.
    A single-node job's replacement launches at the notice, to boot during the
    notice period, as on AWS (the noticed instance leaves its group), unless a
    standby already boots for it (:meth:`.Standbys.at_notice`)."""
    if reason not in FORESEEN:  # nobody knew it ahead: the recommendation comes with it
        _recommend(group, inst, now, reason, with_notice=True)
    group.standbys.at_notice(inst, now)
    inst.notice(now, group.settings.notice_seconds, reason)
    assert inst.terminate_at is not None
    log.info("interruption notice for %s (%s); terminating at %s", inst.id, reason,
             iso_utc(inst.terminate_at))
    group.emit("instance", inst.id, action="notice", reason=reason, **inst.describe(),
               notice_time=iso_utc(now), termination_time=iso_utc(inst.terminate_at),
               price=inst.price)
