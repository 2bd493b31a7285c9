"""The warm-standby policy, written once for every cloud: what a job's capacity group
does when EC2 recommends rebalancing one of its instances, and what it says.

A provider gathers the facts its own way (the local cloud's supervisor from its
processes, :mod:`spotnb.providers.local.standbys`; the AWS instance agent from the
instance metadata, the lease and its group, :mod:`spotnb.providers.aws.standby`), asks
the functions here, and carries the decision out with its own mechanism (processes;
Auto Scaling calls, the claim, lifecycle hooks). Nothing here reads a clock, the store
or the network: the same facts give the same decision on every cloud, and the events
and the notification a decision causes are built here too, so they read the same from
both clouds. Times are market seconds (the local cloud and the AWS simulator compress
time; 1:1 on EC2); a provider converts them to its own clock::

    a recommendation ──► on_recommendation()
        the job's policy has no standby .............. NOTHING
        the instance noticed or ending ............... NOTHING  (at_notice() decides)
        a standby already asked for it ............... NOTHING
        the instance does not run the job (yet) ...... LATER    (booting: once its agent
                                                                 holds the lease; a
                                                                 standby on hold: once
                                                                 it took the job over)
        its first hour, unless standby_first_hour .... DEFER    (standby_wait(): ready as
                                                                 the hour ends;
                                                                 "standby-deferred")
        otherwise, or the deferral's time came ....... LAUNCH
    a notice ──► at_notice()
        a standby boots for it ....................... TAKEOVER (the standby is its
                                                                 replacement)
        none, a single-node job's instance ........... REPLACE  (the replacement now: it
                                                                 boots during the
                                                                 notice period)
        none, a multi-node job's node ................ NOTHING  (replaced after the loss)
    the standby boots ──► while_booting()
        its instance noticed, ending or gone ......... TAKEOVER
        ready ("standby-ready") ...................... MOVE     (the instance ended
                                                                 through its termination
                                                                 hook; the job moves)
        not ready within its boot + HOLD ............. GIVE_BACK ("standby-given-back",
                                                                 and the job's webhook
                                                                 told what it cost)
        otherwise .................................... WAIT

Why the first hour waits: EC2 does not bill a spot instance that it interrupts in its
first hour (:mod:`spotnb.protocol.billing`); moving the job off it ends it on the
owner's behalf, which forfeits that. Standard library and the protocol only: the
instance side may import it too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from spotnb.protocol import billing
from spotnb.protocol.events import GROUP_STREAM, Event
from spotnb.protocol.notify import Notifier
from spotnb.protocol.spec import JobSpec, Policy

__all__ = ["DEFERRED", "GIVEN_BACK", "READY", "STANDBY_HOLD_SECONDS",
           "STANDBY_WARMUP_SECONDS", "Decision", "Do", "ReadyMark", "Standby",
           "at_notice", "deferred_event", "given_back_event", "notify_given_back",
           "on_recommendation", "ready_event", "standby_wait", "while_booting"]

# In an instance's first hour, a standby is launched to be ready as the hour ends: its
# boot plus this many market seconds of warm-up (kernel, imports, the checkpoint's
# download) before it.
STANDBY_WARMUP_SECONDS = 120.0
# A standby not ready within its boot plus this many market seconds is given back: its
# kernel or the cell's set-up is stuck, and a job that moved to it would wait there.
# Ready, it takes the job over at once: holding it for a notice instead billed ~18% of a
# stressed pool's job for a fifth of its interruptions caught warm (README, "Warm
# standbys"). On AWS the group's launch hook waits as long
# (spotnb.providers.aws.resources.LAUNCH_HOOK_SECONDS: EC2's boot and this).
STANDBY_HOLD_SECONDS = 600.0

# The ``instance`` events of a standby's story (the group's stream), by ``action``; a
# standby given back is ``terminated`` with this ``reason``.
DEFERRED = "standby-deferred"
READY = "standby-ready"
GIVEN_BACK = "standby-given-back"


class Do(enum.Enum):
    """What the group does now (see the module docstring)."""

    NOTHING = "nothing"  # no standby: now, or for this recommendation
    LATER = "later"  # ask again: the instance does not run the job yet
    DEFER = "defer"  # launch it in Decision.wait market seconds
    LAUNCH = "launch"  # launch (ask the group for) the standby now
    REPLACE = "replace"  # at a notice, with no standby: the replacement now
    TAKEOVER = "takeover"  # the standby booting is the instance's replacement
    MOVE = "move"  # the standby is ready: end the instance through its hook
    GIVE_BACK = "give-back"  # not ready in time: end the standby (billed)
    WAIT = "wait"  # the standby boots: look again


class Standby(enum.Enum):
    """Where the recommended instance's standby stands when the group decides."""

    NONE = "none"  # none asked for (the recommendation is new, or waited: LATER)
    DUE = "due"  # deferred for the first hour, and its time has come
    ASKED = "asked"  # one is launched (asked for) and boots, or is waiting its turn


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do, when (``wait``: market seconds from now, for :attr:`Do.DEFER`), and
    why, in words for the log."""

    do: Do
    wait: float = 0.0
    why: str = ""


def standby_wait(age: float, boot_seconds: float) -> float:
    """Market seconds a recommendation's standby waits before its launch, for an
    instance ``age`` market seconds old whose standby boots in ``boot_seconds``: so
    that it is ready as the first hour ends (0: launch it now)."""
    return max(0.0, billing.free_hour_left(age) - boot_seconds - STANDBY_WARMUP_SECONDS)


def on_recommendation(policy: Policy, *, ending: bool, runs_job: bool, standby: Standby,
                      age: float, boot_seconds: float) -> Decision:
    """A rebalance recommendation for an instance (or one looked at again: LATER, or
    its deferral's time come: ``standby`` is :attr:`Standby.DUE`).

    ``ending``: its interruption notice came (with the recommendation, or since), or
    its group ends it through its termination hook; ``runs_job``: its job agent holds
    the lease (a multi-node job's: a node slot's), not a standby still on hold nor an
    instance whose agent has yet to take it; ``age``: market seconds since EC2
    launched it; ``boot_seconds``: a standby's boot, in market seconds."""
    if not policy.standby:
        return Decision(Do.NOTHING, why="the job has no warm standbys")
    if ending:
        return Decision(Do.NOTHING, why="the instance ends (a notice, or its group ends "
                        "it): the group replaces it")
    if standby is Standby.ASKED:
        return Decision(Do.NOTHING, why="a standby was already asked for the instance")
    if not runs_job:
        return Decision(Do.LATER, why="the instance does not run the job yet")
    if standby is Standby.DUE or policy.standby_first_hour:
        return Decision(Do.LAUNCH, why="a standby for the recommendation")
    wait = standby_wait(age, boot_seconds)
    if wait > 0:
        return Decision(Do.DEFER, wait, why="in its first hour an interruption by EC2 is "
                        "free: the standby is timed to be ready as the hour ends")
    return Decision(Do.LAUNCH, why="a standby for the recommendation")


def at_notice(policy: Policy, *, nodes: int, booting: bool, runs_job: bool) -> Decision:
    """EC2's interruption notice for an instance: ``booting``, a standby was asked for it
    (it boots, warms up, or is being given back); ``runs_job`` as for
    :func:`on_recommendation`; ``nodes``: the job's (its MAX)."""
    if not policy.standby:
        return Decision(Do.NOTHING, why="the job has no warm standbys")
    if booting:
        return Decision(Do.TAKEOVER, why="the standby booting is the replacement")
    if nodes > 1:
        return Decision(Do.NOTHING, why="a node is replaced after its loss: its "
                        "replacement launched earlier would count in the world first")
    if not runs_job:
        return Decision(Do.NOTHING, why="the instance does not run the job")
    return Decision(Do.REPLACE, why="no standby boots: the replacement launches now, to "
                    "boot during the notice period")


def while_booting(*, instance_ending: bool, ready: bool, waited: float,
                  boot_seconds: float) -> Decision:
    """A standby asked for and not yet the job's: ``instance_ending``, the instance it
    stands by for got its notice, is ended through its termination hook or is gone;
    ``ready``, the standby said it is ready; ``waited``: market seconds since it was
    launched (asked for); ``boot_seconds``: its boot, in market seconds."""
    if instance_ending:
        return Decision(Do.TAKEOVER, why="its instance ends: the standby is the job's next")
    if ready:
        return Decision(Do.MOVE, why="the standby is ready: the job moves to it")
    if waited >= boot_seconds + STANDBY_HOLD_SECONDS:
        return Decision(Do.GIVE_BACK, why="the standby was not ready within its hold")
    return Decision(Do.WAIT)


# ------------------------------------------------------------------------- the events

@dataclasses.dataclass(frozen=True)
class ReadyMark:
    """What a standby's agent says in its ready mark (``standby/<instance>.json``,
    :func:`spotnb.protocol.layout.standby_ready_key`; written by
    :mod:`spotnb.kernel_remote.standby`): when it was ready, when its kernel started,
    and whom it stands by for where its instance knew (None: any)."""

    ready: float | None = None
    kernel_started: float | None = None
    standby_for: str | None = None

    @classmethod
    def parse(cls, raw: bytes | str) -> ReadyMark:
        """The mark's fields, each None where it is missing or not of its type."""
        try:
            said = json.loads(raw)
        except ValueError:
            said = None
        if not isinstance(said, dict):
            return cls()

        def number(value: Any) -> float | None:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return float(value) if ok else None

        other = said.get("standby_for")
        return cls(number(said.get("ready")), number(said.get("kernel_started")),
                   other if isinstance(other, str) and other else None)


def _event(instance_id: str, at: float, /, **data: Any) -> Event:
    return Event(type="instance", time=at, attempt=GROUP_STREAM, instance=instance_id,
                 data={"instance_id": instance_id, **data})


def deferred_event(instance_id: str, at: float, due: float, /, **where: Any) -> Event:
    """``standby-deferred``: the recommended instance's standby launches at ``due``
    (wall time), to be ready as its first hour ends. ``where``: the instance's type,
    zone and pool, as every instance event carries them (its id among them or not:
    the parameters are positional)."""
    return _event(instance_id, at, action=DEFERRED, **where, standby_due=due)


def ready_event(standby_id: str, standby_for: str | None, mark: ReadyMark, now: float, /,
                **extra: Any) -> Event:
    """``standby-ready``: the standby's kernel is started and its cell waits at its
    restore point; at the mark's time (``now`` if it has none). ``extra``: the
    standby's type, zone and pool where the group knows them; ``reported_by`` where
    another instance reports it."""
    return _event(standby_id, mark.ready if mark.ready is not None else now,
                  action=READY, **extra, standby_for=standby_for,
                  kernel_started=mark.kernel_started)


def given_back_event(standby_id: str, standby_for: str, at: float, /,
                     **extra: Any) -> Event:
    """The standby ended, not ready within its hold (``terminated``, reason
    ``standby-given-back``), billed to the job. ``extra``: its type, zone, pool and
    cost where the group knows them; ``reported_by`` where another instance reports
    it."""
    return _event(standby_id, at, action="terminated", reason=GIVEN_BACK, **extra,
                  standby_for=standby_for)


def notify_given_back(spec: JobSpec, url: str | None, *, instance_id: str,
                      instance_type: str | None, az: str | None, cost_usd: float,
                      job_start: float | None, wait: float = 0.0) -> None:
    """Tell the job's webhook (``url``; None: the job has none) that its standby
    ``instance_id`` was given back and what it cost: no agent of the job sees it (it
    never held the lease), so the group (the local cloud's supervisor; on AWS the
    instance that gave it back) tells it. Sent from the notifier's thread; ``wait``:
    seconds to wait for the send, at most. Never raises for the webhook."""
    if not url:
        return
    notifier = Notifier(url, spec.job_id, spec.name, max_nodes=spec.resources.max_nodes)
    notifier.where = " ".join(str(p) for p in (instance_type, az, instance_id) if p)
    notifier.job_start = job_start
    notifier.standby_given_back(cost_usd)
    notifier.close(timeout=wait)
