"""How a job's attempts ran and ended, and where the job broke off: the part of
:class:`~spotnb.protocol.events.fold.JobState` that reads its attempts (as
:class:`~spotnb.protocol.events.money.Money` is the part that reads its instances and
prices). The fold fills the attempts in (:meth:`JobState.apply`); :class:`Attempts`
answers from them:

* how each attempt ended, in words (:meth:`Attempts.end_reason`): its own events' say,
  else "lost" once the job ended or a later attempt took its node slot;
* the job's breaks (:class:`~spotnb.protocol.events.parts.Break`): each attempt that
  ended early and was followed by another of its node slot, with the last step it
  logged, where the training went on, the steps redone and the time the break took
  (:mod:`~spotnb.protocol.events.steps`); the spans without progress they made
  (:meth:`Attempts.lost_windows`) and what those cost (:meth:`Attempts.lost_usd`);
* the interruptions, the attempts running now, their metrics and errors, the steps
  redone where nodes joined, and how long a standby's takeover took.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from spotnb.protocol import layout
from spotnb.protocol.events.parts import (
    AttemptState,
    Break,
    EndReason,
    InstanceState,
    Join,
    StandbyState,
)
from spotnb.protocol.events.steps import Segment, Steps

__all__ = ["Attempts", "replaced_attempt"]


class Attempts:
    """The attempts of a job's fold and their ends (module docstring)."""

    max_nodes: int
    attempts: dict[int, AttemptState]
    instances: dict[str, InstanceState]
    noticed_instances: set[str]
    steps: Steps

    @property
    def final(self) -> bool:
        """Whether the job has ended (:attr:`JobState.final`)."""
        raise NotImplementedError("JobState says it")

    def outcome(self, result: Mapping[str, Any] | None = None) -> tuple[str, str]:
        """The job's status and reason (:meth:`JobState.outcome`)."""
        raise NotImplementedError("JobState says it")

    if TYPE_CHECKING:
        def billed(self, inst: InstanceState, start: float, stop: float) -> float:
            """What ``inst`` billed between ``start`` and ``stop`` (:meth:`Money.billed`)."""

    def end_reason(self, number: int, final: bool | None = None,
                   job_status: str | None = None) -> str:
        """How attempt ``number`` ended, in words: its own events' say, else, once the
        job ended (``final``; default: the fold's status) or a later attempt took its
        node slot, "lost" (or, a multi-node job's node still in the world at the end,
        "ended with the job (STATUS)")."""
        final = self.final if final is None else final
        a = self.attempts[number]
        if a.reason in (EndReason.COMPLETED, EndReason.FAILED, EndReason.STOPPED) and \
                a.result_status is not None:
            return a.result_status
        if a.reason is not EndReason.RUNNING:
            return a.reason.value
        stride = self.max_nodes
        slot = layout.node_slot(number, stride)
        replaced = any(n > number and layout.node_slot(n, stride) == slot
                       for n in self.attempts)
        if final and stride > 1 and not replaced:
            status = job_status or self.outcome()[0]
            return f"{EndReason.ENDED_WITH_JOB.value} ({status})"
        if final or replaced:
            return EndReason.LOST.value
        return EndReason.RUNNING.value

    def breaks(self, final: bool | None = None) -> list[Break]:
        """Each attempt that ended before the job did and was followed by another of
        its node slot (interrupted, lost, moved to its standby, or a user-code error
        retried), in attempt order: how and when it ended, the last step it logged, the
        step the training went on from and the steps redone (where the segment after
        its last began: :mod:`~spotnb.protocol.events.steps`), and the time it took.
        ``final``: the job has ended (default: the fold's status; an attempt with no
        word of its end is then lost)."""
        stride = self.max_nodes
        out = []
        for n in sorted(self.attempts):
            said = self.end_reason(n, final)
            reason = next((r for r in EndReason if r.value == said), None)
            if reason is None or not reason.early:
                continue
            slot = layout.node_slot(n, stride)
            if not any(m > n and layout.node_slot(m, stride) == slot for m in self.attempts):
                continue
            a = self.attempts[n]
            seg = self.steps.last_segment(n)
            after = self.steps.after(seg) if seg is not None else None
            lost_from, recovered = self._lost(a, seg, after)
            out.append(Break(attempt=n, reason=reason, time=a.last_time,
                             step=None if seg is None else seg.furthest,
                             resumed_at=None if after is None else after.first_step,
                             redone=None if after is None else after.redone,
                             lost_from=lost_from, recovered=recovered))
        return out

    def _lost(self, a: AttemptState, seg: Segment | None, after: Segment | None
              ) -> tuple[float | None, float | None]:
        """When the training stopped making progress at ``a``'s end, and when it passed
        where it had been (:class:`Break`)."""
        if seg is not None:
            return seg.furthest_time, None if after is None else after.passed
        if self.max_nodes > 1:
            # A node that never logged (only global rank 0 does): what losing it cost
            # is where the training went back (the segment after, its own window).
            return None, None
        segments = self.steps.segments
        if any(s.first_time <= a.last_time and s.last_time >= a.start for s in segments):
            return None, None  # others logged meanwhile (a peer node): no time of its own
        later = next((s for s in segments if s.first_time > a.start), None)
        return a.start, None if later is None else later.first_time

    def redone_steps(self) -> int:
        """Steps run again over the job: after every break, and wherever a multi-node
        job's training went back within an attempt (a peer lost, a node joined)."""
        return self.steps.redone()

    def interruptions(self, final: bool | None = None) -> int:
        """Instances the job was interrupted on: those that had an interruption notice
        (the group's, or an agent's), and those lost under it without one (an attempt
        that a later one of its node slot replaced with no word of its end)."""
        noticed = set(self.noticed_instances)
        noticed.update(str(a.instance) for a in self.attempts.values()
                       if a.reason is EndReason.INTERRUPTED)
        noticed.update(str(self.attempts[b.attempt].instance) for b in self.breaks(final)
                       if b.reason is EndReason.LOST)
        return len(noticed)

    def lost_windows(self, now: float) -> list[tuple[float, float]]:
        """The spans the job made no new progress in because of its breaks (each
        :class:`Break`'s, and each time a multi-node job's training went back within an
        attempt), merged where they overlap; one not caught up with runs until ``now``."""
        spans = [w for b in self.breaks() if (w := b.window(now)) is not None]
        spans += [w for s in self.steps.segments
                  if s.went_back and (w := s.window(now)) is not None]
        merged: list[tuple[float, float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def lost_seconds(self, now: float) -> float:
        """Wall-clock seconds the breaks took (:meth:`lost_windows`)."""
        return sum(end - start for start, end in self.lost_windows(now))

    def lost_usd(self, now: float) -> tuple[float, float]:
        """What the instances billed while the breaks took their time
        (:meth:`lost_windows`): at the spot price, and at the on-demand price."""
        spot = ondemand = 0.0
        for start, end in self.lost_windows(now):
            for inst in self.instances.values():
                lo, hi = max(start, inst.start), min(end, inst.end or now)
                if hi <= lo:
                    continue
                spot += self.billed(inst, lo, hi)
                ondemand += (inst.ondemand or 0.0) * (hi - lo) / 3600.0
        return spot, ondemand

    def resumed(self, attempt: int) -> Segment | None:
        """The first segment of rows ``attempt`` logged after a break (its window and
        steps redone are the break's), or None: it logged nothing yet, or what it
        logged follows no earlier rows."""
        seg = next((s for s in self.steps.segments if s.attempt == attempt), None)
        return seg if seg is not None and seg.previous is not None else None

    def join_redone(self, join: Join) -> int | None:
        """Steps redone where the world re-formed around nodes that joined: the steps
        the training went back where it went on after the join (0 if it went on past
        the save, or the job ended first); None until it went on."""
        after = min((s for s in self.steps.segments if s.serial >= join.started),
                    key=lambda s: s.serial, default=None)
        if after is not None:
            return after.redone or 0
        if self.steps.taken > join.taken or self.final:
            return 0
        return None

    def running_attempts(self) -> list[AttemptState]:
        """Attempts booted and not ended by their own events, their instance's end,
        or a later attempt of their node slot."""
        newest: dict[int, int] = {}
        for n in self.attempts:
            slot = layout.node_slot(n, self.max_nodes)
            newest[slot] = max(newest.get(slot, n), n)
        out = []
        for a in self.attempts.values():
            if a.boot_time is None or a.reason is not EndReason.RUNNING:
                continue
            if newest[layout.node_slot(a.number, self.max_nodes)] > a.number:
                continue
            inst = self.instances.get(a.instance_id or "")
            if inst is not None and inst.end is not None:
                continue
            out.append(a)
        return out

    def metrics(self) -> dict[str, float]:
        """The newest value of each metric (a later attempt's over an earlier's)."""
        out: dict[str, float] = {}
        for n in sorted(self.attempts):
            out.update(self.attempts[n].metrics)
        return out

    def error(self) -> dict[str, Any] | None:
        """The newest attempt's error that has one."""
        out = None
        for n in sorted(self.attempts):
            if self.attempts[n].error is not None:
                out = self.attempts[n].error
        return out

    def handover_seconds(self, sb: StandbyState) -> float | None:
        """How long a standby's takeover took: from the last event of the attempt it
        took over from (its final save durable, the lease released: that attempt's
        :attr:`Break.time`) to its own restore done; None until both are known. (The
        time the break cost the job's training is the break's own window.)"""
        if sb.attempt is None or sb.restored is None:
            return None
        slot = layout.node_slot(sb.attempt, self.max_nodes)
        earlier = [n for n in self.attempts
                   if n < sb.attempt and layout.node_slot(n, self.max_nodes) == slot]
        if not earlier:
            return None
        return max(0.0, sb.restored - self.attempts[max(earlier)].last_time)


def replaced_attempt(attempt: int, booted: Iterable[int], max_nodes: int) -> int | None:
    """The attempt that a boot of ``attempt`` replaces, among those ``booted`` before:
    a multi-node job's node slot's previous attempt (``max_nodes`` earlier; a node
    joining replaces none), else the newest earlier attempt that booted (None for the
    first boot)."""
    if max_nodes > 1:
        previous = attempt - max_nodes
        return previous if previous in set(booted) else None
    return max((a for a in booted if a < attempt), default=None)
