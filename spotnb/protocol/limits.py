"""When a job's own limits stop it: its budget (``policy.budget_usd``: the job's cost as
its fold says it, the cost every view shows) and its deadline (``policy.max_duration``:
seconds since its first instance launched). One rule for whoever watches the job: the
local cloud's capacity group checks it every tick (:mod:`spotnb.providers.local.group`),
each AWS instance's agent at its watch's turn (:mod:`spotnb.providers.aws.instance`).
"""

from __future__ import annotations

import dataclasses

from spotnb.protocol.events.fold import JobState
from spotnb.protocol.spec import Policy

__all__ = ["LimitReached", "limit_reached"]


@dataclasses.dataclass(frozen=True)
class LimitReached:
    """A limit the job passed: ``reason`` (``budget`` or ``deadline``, as a stop request
    names it), ``detail`` in words, and the cost it had (``cost_usd``: the budget's)."""

    reason: str
    detail: str
    cost_usd: float | None = None


def limit_reached(policy: Policy, state: JobState, now: float) -> LimitReached | None:
    """The first of ``policy``'s limits the job (its events folded: ``state``) has
    passed at ``now``, the budget before the deadline; None while it is within both."""
    if policy.budget_usd is not None:
        cost = state.cost_usd(now)
        if cost > policy.budget_usd:
            return LimitReached("budget", f"the job has cost ${cost:.4f}, above its budget "
                                          f"of ${policy.budget_usd:.4f}", cost)
    first = state.first_launch
    if policy.max_duration is not None and first is not None:
        elapsed = now - first
        if elapsed > policy.max_duration:
            return LimitReached("deadline", (
                f"the job has run {elapsed:.0f} s since its first instance, above its "
                f"limit of {policy.max_duration:g} s"))
    return None
