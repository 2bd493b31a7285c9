"""What a job has done, what is left, and what its breaks cost it: the header's figures,
as functions of the job's fold (:class:`~spotnb.protocol.events.fold.JobState`), which
keeps every fact they read, so that a replay after a kernel restart shows the same
numbers, and the text header, the dashboard, the record and the notifications agree:

* the step reached, of how many, the pace and the time left (``JobState.steps``: the
  total is the job's ``progress`` event: ``spot.progress(total=...)``, or the ``range``
  of the loop that calls ``spot.log``, which :func:`spotnb.train.looptotal.loop_total`
  finds on the instance);
* for each break (an interruption, a lost instance, an error retried, a multi-node
  job's training going back), the time it took (from the last step logged before it
  until the job logs a step beyond it: the notice, the wait, the boot, the restore and
  the redone steps), what the instances billed meanwhile, and the steps redone
  (:meth:`~spotnb.protocol.events.fold.JobState.lost_windows`);
* the attempt being launched while a replacement boots (:func:`launching`).

Cost so far is the job's own accounting (:func:`spotnb.client.jobs.summarize_state`);
the projection (:func:`projection`) adds the time left at the current spot price, and
compares it with on-demand for the same work: the useful instance-hours (without the
time the breaks took) at the on-demand price.
"""

from __future__ import annotations

import dataclasses

from spotnb.protocol.events.fold import JobState, savings_pct

__all__ = ["Projection", "launching", "projection"]


@dataclasses.dataclass(frozen=True)
class Projection:
    """The cost at the end of the job, if it keeps its current pace and price."""

    seconds_left: float
    cost_usd: float
    ondemand_usd: float

    @property
    def savings_pct(self) -> float | None:
        return savings_pct(self.cost_usd, self.ondemand_usd)


def launching(state: JobState) -> str | None:
    """The replacement being launched, if any, in words."""
    pending = state.launching
    if pending is None:
        return None
    booted = [n for n, a in state.attempts.items() if a.boot_time is not None]
    where = " ".join(str(p) for p in (pending.instance_type, pending.az) if p)
    verb = "waiting for capacity" if pending.waiting else "launching"
    who = f"attempt {max(booted, default=0) + 1}"
    if state.max_nodes > 1:  # which attempt number a node gets is its slot's
        who = "a replacement node" if len(booted) >= state.max_nodes else "a node"
    return f"{who}: {verb}" + (f" {where}" if where else "")


def projection(state: JobState, now: float, cost_usd: float, ondemand_cost_usd: float,
               spot_price: float | None, ondemand_price: float | None) -> Projection | None:
    """The cost at the end at the current pace and spot price, against on-demand for
    the same work (the instance-hours without the time the breaks took, plus the time
    left, at the on-demand price). None without a total or a pace."""
    left = state.steps.seconds_left()
    if left is None or spot_price is None or not ondemand_price:
        return None
    _lost_spot, lost_ondemand = state.lost_usd(now)
    useful_ondemand = max(0.0, ondemand_cost_usd - lost_ondemand)
    return Projection(seconds_left=left,
                      cost_usd=cost_usd + left / 3600.0 * spot_price,
                      ondemand_usd=useful_ondemand + left / 3600.0 * ondemand_price)
