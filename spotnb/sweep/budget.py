"""A sweep's money: what its trials cost (:class:`SweepCost`), and its budget, one
limit for all its trials, judged from their folded costs.

*Cost* is what the trials' instances ran at their pools' spot prices, as billed while
they run; *refunded* is the part of it that EC2 gives back (an instance it interrupted
in its first hour: :mod:`spotnb.protocol.billing`); *billed* is the difference, what
AWS charges. The cost and the refund never decrease as a sweep goes on, where the
amount billed drops when a refund comes: a view shows the first two, and the third
named as such.

What every trial has cost is its job's fold (what AWS bills: refunds taken off). The
driver asks :meth:`Budget.spent_out` each round: once the spend reaches the limit, the
running trials are stopped, as a job's own budget stops it. Before it starts a trial it
asks :meth:`Budget.room_for_next`: the spend so far, what the running trials will cost
yet and the new trial's own cost, the last two judged by the mean cost of the trials
over, must stay under the limit. Each trial's job also gets what is left as its own
budget (:meth:`Budget.left`), so a sweep whose driver is gone does not spend past it
either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set
from typing import Any

__all__ = ["Budget", "SweepCost"]

# A trial's job is never given a budget of 0 (refused as bad input): this little.
_MIN_JOB_BUDGET_USD = 1e-6


@dataclasses.dataclass(frozen=True)
class SweepCost:
    """The trials' money so far (module docstring), each trial's from its job's fold."""

    billed_usd: float
    refunded_usd: float
    ondemand_usd: float
    refunded_instances: int = 0

    @classmethod
    def of(cls, facts: Sequence[Any]) -> SweepCost:
        """The sum of the trials' :class:`~spotnb.client.comparison.Facts` (each from
        its job's fold)."""
        return cls(sum(f.cost_usd or 0.0 for f in facts), sum(f.refunded_usd for f in facts),
                   sum(f.ondemand_cost_usd or 0.0 for f in facts),
                   sum(f.refunded_instances for f in facts))

    @property
    def cost_usd(self) -> float:
        """What the instances ran, refunds included: never decreases."""
        return self.billed_usd + self.refunded_usd

    @property
    def savings_pct(self) -> float | None:
        """What is billed, against the same instance time on-demand (None before any)."""
        if self.ondemand_usd <= 0:
            return None
        return 100.0 * (1.0 - self.billed_usd / self.ondemand_usd)

    def text(self) -> str:
        """``cost $0.0067; $0.0046 refunded: EC2 interrupted 3 instances in their first
        hour; billed $0.0021, 91% under on-demand ($0.0230)``."""
        out = f"cost ${self.cost_usd:.4f}"
        if self.refunded_usd > 0 or self.refunded_instances:
            n = self.refunded_instances
            out += (f"; ${self.refunded_usd:.4f} refunded: EC2 interrupted {n} "
                    f"instance{'s' if n != 1 else ''} in {'their' if n != 1 else 'its'} "
                    f"first hour; billed ${self.billed_usd:.4f}")
        if self.savings_pct is not None:
            out += (f", {self.savings_pct:.0f}% under on-demand "
                    f"(${self.ondemand_usd:.4f})")
        return out


@dataclasses.dataclass(frozen=True)
class Budget:
    """The sweep's budget in USD (``limit`` None: no budget)."""

    limit: float | None

    def spent_out(self, spent: float) -> bool:
        """Whether the spend has reached the limit."""
        return self.limit is not None and spent >= self.limit

    def spent_text(self) -> str:
        return f"the sweep's budget of ${self.limit:g} is spent"

    def room_for_next(self, spent: float, costs: Mapping[int, float],
                      over: Set[int]) -> str | None:
        """Why the next trial may not start (None: it may). ``costs``: each started
        trial's cost so far, by number; ``over``: the numbers of the trials over."""
        if self.limit is None:
            return None
        done = [costs[n] for n in over if n in costs]
        estimate = sum(done) / len(done) if done else 0.0
        # The trials still running will cost about as much as those over did.
        to_come = sum(max(estimate - cost, 0.0) for n, cost in costs.items()
                      if n not in over)
        if spent + to_come + estimate <= self.limit:
            return None
        return (f"the next trial would pass the sweep's budget of ${self.limit:g} "
                f"(spent ${spent:.4f}, a trial costs ${estimate:.4f})")

    def left(self, spent: float) -> float | None:
        """What a new trial's job may spend at most (None: no budget)."""
        if self.limit is None:
            return None
        return max(self.limit - spent, _MIN_JOB_BUDGET_USD)
