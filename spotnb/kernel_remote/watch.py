"""Watching for the end from outside: the instance's interruption notices (IMDS) and
the job's stop request (the store).

:class:`NoticeWatcher` polls IMDS for ``spot/instance-action`` (or Auto Scaling's
``autoscaling/target-lifecycle-state`` of ``Terminated``: the group ends the instance
through a termination lifecycle hook, which waits as long as a notice) and the
rebalance recommendation and keeps the first of each; :class:`StopWatcher` keeps the first stop
request, read from ``control/stop.json`` or received on the control queue. Both only
say what is new; :func:`relay_notices` says what it means for the agent's attempt.

Auto Scaling ends an instance through its termination hook for one of two reasons: the
job moves to the instance's ready warm standby (``source`` ``auto-scaling``), or the job
moves to another of its regions and this node was left in the one it leaves
(``region-move``: the move marks the instance in the store first,
:func:`leaving_region`; one read, when the hook's end is first seen).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.kernel_remote import channel, standby
from spotnb.protocol import billing, layout
from spotnb.protocol.store import NotFound, Store
from spotnb.providers.imds import ImdsClient, termination_hook_seconds

if TYPE_CHECKING:
    from spotnb.kernel_remote.kernels import KernelSupervisor
    from spotnb.protocol.lease import HeldLease
    from spotnb.protocol.notify import Notifier
    from spotnb.protocol.spec import JobSpec


class Agent(Protocol):
    """What :func:`relay_notices` uses of the agent
    (:class:`spotnb.kernel_remote.agent.Agent`)."""

    spec: JobSpec
    kernels: KernelSupervisor
    node: Any
    notifier: Notifier
    paused_since: float | None

    @property
    def held(self) -> HeldLease | None: ...

    def emit(self, type: str, **data: Any) -> None: ...

    def flush_soon(self) -> None: ...

    def send(self, msg: channel.Message) -> None: ...

log = logging.getLogger(__name__)


def iso_utc(when: float) -> str:
    """``when`` (epoch seconds), as IMDS writes times."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def leaving_region(store: Store, instance_id: str) -> dict[str, Any] | None:
    """The job's move to another region's mark on ``instance_id``, a node it leaves in
    the region it leaves (``{"reason": "region-move", "region": <where the job goes>,
    "previous": ...}``), or None: Auto Scaling ends the instance for another reason
    (its warm standby), or the store cannot say."""
    try:
        mark = json.loads(store.get(layout.leaving_region_key(instance_id)) or b"{}")
    except NotFound:
        return None
    except Exception:
        log.debug("reading the region move's mark failed", exc_info=True)
        return None
    return mark if isinstance(mark, dict) else None


class NoticeWatcher:
    """The instance's interruption notice and rebalance recommendation, once each.
    ``leaving``: the region move's mark on this instance (:func:`leaving_region`), read
    when Auto Scaling's end is first seen."""

    def __init__(self, imds: ImdsClient,
                 leaving: Callable[[], dict[str, Any] | None] | None = None) -> None:
        self.imds = imds
        self.leaving = leaving
        #: The interruption notice (IMDS's ``instance-action``), once it appeared.
        self.notice: dict[str, Any] | None = None
        #: The rebalance recommendation, once it appeared.
        self.rebalance: dict[str, Any] | None = None

    def poll(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """One look at IMDS: (the notice, the rebalance recommendation), each only the
        first time it is seen (else None). An IMDS that fails says nothing new."""
        try:
            action = self.imds.instance_action()
            if action is None and self.notice is None and \
                    self.imds.target_lifecycle_state() == "Terminated":
                # Auto Scaling ends the instance (the job moves to its ready standby:
                # TerminateInstanceInAutoScalingGroup): its termination hook's wait is the notice,
                # and the final save's time.
                action = {"action": "terminate", "source": "auto-scaling",
                          "time": iso_utc(time.time() + termination_hook_seconds())}
                mark = self.leaving() if self.leaving is not None else None
                if mark is not None:  # the job moves to another region
                    action.update(source=billing.REGION_MOVE, region=mark.get("region"))
            rebalance = None if self.rebalance else self.imds.rebalance()
        except Exception:
            log.debug("IMDS poll failed", exc_info=True)
            return None, None
        new_action = new_rebalance = None
        if action and not self.notice:
            self.notice = new_action = action
        if rebalance and not self.rebalance:
            self.rebalance = new_rebalance = rebalance
        return new_action, new_rebalance


class StopWatcher:
    """The job's stop request (the first one counts)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: The stop request, once one came.
        self.requested: dict[str, Any] | None = None

    def read(self) -> dict[str, Any] | None:
        """The stop request in the store (``control/stop.json``), if any; a failing
        store says none."""
        try:
            raw = self.store.get(layout.STOP)
        except NotFound:
            return None
        except Exception:
            log.debug("reading the stop request failed", exc_info=True)
            return None
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            request = {}
        return request if isinstance(request, dict) else {}

    def request(self, request: dict[str, Any]) -> bool:
        """Keep ``request`` if it is the first; whether it was."""
        if self.requested is not None:
            return False
        self.requested = request
        return True

    def reason(self) -> str:
        """Why the job is stopping, from the request (its reason and detail)."""
        req = self.requested or {}
        reason = req.get("reason", "requested")
        detail = req.get("detail")
        return f"stop requested ({reason}{': ' + detail if detail else ''})"


def relay_notices(agent: Agent, action: dict[str, Any] | None,
                  rebalance: dict[str, Any] | None) -> None:
    """What a new notice (``action``) and recommendation (``rebalance``) mean for the
    attempt: each is logged and sent to the runtime, which saves at once (at the
    notice, its last save: it parks the cell); the notice also resumes a paused kernel
    (the save must run), lets a distributed job's rendezvous host vacate first and
    notifies. (A recommendation's warm standby is started by the capacity group.)"""
    # The termination first: when both arrive in one poll, the runtime's next save must
    # already know it is the last one (a rebalance save alone would wait for the upload
    # in flight and keep training).
    if action:
        moved = action.get("source") == "auto-scaling"
        agent.emit("notice", kind="instance-action", action=action.get("action"),
                   notice_time=action.get("time"), source=action.get("source"))
        if action.get("source") == billing.REGION_MOVE:
            what = (f"the job moves to {action.get('region') or 'another region'} (no "
                    f"capacity in this one): this instance ends at {action.get('time')}")
        elif moved:
            what = f"the warm standby is ready: moving to it (this instance ends at " \
                   f"{action.get('time')})"
        else:
            what = f"spot interruption notice: {action.get('action')} at {action.get('time')}"
        agent.emit("status", state="interrupted", detail=f"{what}; saving a checkpoint")
        agent.flush_soon()
        if agent.paused_since is None:
            for kernel in agent.kernels.all():
                kernel.resume()
        if agent.node is not None:
            agent.node.on_notice()  # a rendezvous host vacates first
        agent.send(channel.Notice(kind="instance-action", action=action.get("action"),
                                  time=action.get("time")))
        if agent.held is not None and not moved:  # a move is told by the standby
            agent.notifier.interrupted(agent.held.epoch, action.get("action"),
                                       action.get("time"))
    if rebalance:
        agent.emit("notice", kind="rebalance", action="rebalance",
                   notice_time=rebalance.get("noticeTime"))
        agent.flush_soon()
        agent.send(channel.Notice(kind="rebalance", action="rebalance",
                                  time=rebalance.get("noticeTime")))
        if agent.held is not None and not action and standby.wanted(agent.spec):
            agent.notifier.rebalance(agent.held.epoch)
