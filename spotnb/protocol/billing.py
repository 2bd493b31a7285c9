"""What AWS bills for a spot instance that ended, beyond its seconds at the spot price.

EC2 User Guide, "Billing for interrupted Spot Instances": a Linux spot instance that
Amazon EC2 interrupts in its first hour is not charged at all; after its first hour it is
charged for the seconds it ran. One that its owner (or Auto Scaling on the owner's
behalf: a capacity-rebalancing move, a scale-in) stops or terminates is charged for its
seconds whenever that happens. Every view of a job's cost reads this through the event
fold (:mod:`spotnb.protocol.events.fold`), and the local cloud plays the same rule.
"""

from __future__ import annotations

import os

# How long the refund lasts, in the market's seconds (the local cloud compresses time).
FREE_HOUR_SECONDS = 3600.0

# The termination reason of an instance that EC2 took back (the group's, the instance
# agent's, or another node's report of it).
EC2_INTERRUPTION = "spot-interruption"
# The notice and end of a node that the job's move to another region leaves behind (the
# group's, on the owner's behalf: billed).
REGION_MOVE = "region-move"


def free_of_charge(reason: str | None, market_seconds: float) -> bool:
    """Whether an instance that ended for ``reason`` after ``market_seconds`` of running
    costs nothing: EC2 interrupted it within its first hour."""
    return reason == EC2_INTERRUPTION and market_seconds < FREE_HOUR_SECONDS


def free_hour_left(market_seconds: float) -> float:
    """Market seconds left of an instance's first hour, the part in which an
    interruption by EC2 refunds everything it ran (0 once it is over)."""
    return max(0.0, FREE_HOUR_SECONDS - market_seconds)


# Market seconds a real second on an instance that a simulator runs (the AWS simulator's
# compressed time: its instance agents read an instance's age in market time); unset on
# EC2, where it is 1.
ENV_TIME_SCALE = "SPOTNB_TIME_SCALE"


def time_scale() -> float:
    """Market seconds a real second here (:data:`ENV_TIME_SCALE`; 1 on EC2)."""
    try:
        scale = float(os.environ.get(ENV_TIME_SCALE, "1") or 1)
    except ValueError:
        return 1.0
    return scale if scale > 0 else 1.0
