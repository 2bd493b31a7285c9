"""When EC2 says an instance is at risk: the rebalance recommendation and the notice.

EC2 sends a spot instance two signals, both read from its metadata service:

* the **interruption notice** (``spot/instance-action``), two minutes before the
  instance is stopped or terminated, on a best-effort basis;
* the **rebalance recommendation** (``events/recommendations/rebalance``), "a signal
  that notifies you when a Spot Instance is at elevated risk of interruption. The
  signal can arrive sooner than the two-minute Spot Instance interruption notice";
  "It is not always possible for Amazon EC2 to send the rebalance recommendation
  signal before the two-minute Spot Instance interruption notice. Therefore, the
  rebalance recommendation signal can arrive along with the two-minute interruption
  notice"; "Events are emitted on a best effort basis" (AWS documentation, "EC2
  instance rebalance recommendations",
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html).

How much earlier and how often for nothing, AWS does not say. Field reports (not AWS
figures) give: often 10-20 minutes before the notice and up to hours, sometimes
together with it; in one cluster's 17-hour log, 21 of 30 recommendations were never
followed by a termination, and 6 of 15 terminations had no recommendation first.

:class:`SignalModel` turns those reports into draws. Its defaults, each a choice made
to match the reports, not a fit to data:

* ``no_recommendation`` = 6/15 = 0.4: the share of notices with no recommendation;
* ``false_alarm`` = 21/30 = 0.7: the share of recommendations no notice follows;
  with the first, 1.4 false alarms per interruption
  (:attr:`SignalModel.false_alarms_per_interruption`), which come as a Poisson process
  at 1.4 times the instance's interruption rate;
* the lead of a recommendation before its notice: with probability ``together`` = 0.1
  none (both at once), else log-normal with median ``lead_median`` = 15 minutes and
  ``lead_sigma`` = 0.6 (of these leads 43% fall in 10-20 minutes, 12% over 30
  minutes, 1% over an hour, 3% under 5 minutes), capped at ``lead_max`` = 3 hours.

Leads are in **market seconds** (EC2's time); the local cloud divides them by its
``time_scale``, as it does the notice period. The model is the default of every
local-cloud job and can be set per job (``simulate_signals``,
:meth:`SignalModel.from_dict`); a job's draws are reproducible with a ``seed``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping
from typing import Any

from spotnb.protocol.errors import SpecError

__all__ = ["SignalModel", "check_signals"]

MINUTE = 60.0
HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class SignalModel:
    """The rebalance recommendations of a spot instance; see the module docstring."""

    #: median lead of a recommendation before its notice (market seconds)
    lead_median: float = 15 * MINUTE
    #: log-normal spread of the lead (0: every lead is ``lead_median``)
    lead_sigma: float = 0.6
    #: longest lead (market seconds)
    lead_max: float = 3 * HOUR
    #: probability a recommendation comes together with its notice (lead 0)
    together: float = 0.1
    #: share of recommendations that no notice follows (below 1)
    false_alarm: float = 0.7
    #: share of notices with no recommendation first
    no_recommendation: float = 0.4
    #: false alarms at these real seconds since the job's first launch, besides the
    #: drawn ones (for tests: a recommendation that is certain and no notice follows)
    false_alarms: tuple[float, ...] = ()
    #: makes the job's draws reproducible (with the job id); None: the local cloud's seed
    seed: str | None = None

    def __post_init__(self) -> None:
        for name in ("lead_median", "lead_sigma", "lead_max"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                raise _bad(name, "a non-negative number", value)
        for name in ("together", "no_recommendation"):
            value = getattr(self, name)
            if not _number(value) or not 0 <= value <= 1:
                raise _bad(name, "a probability from 0 to 1", value)
        if not _number(self.false_alarm) or not 0 <= self.false_alarm < 1:
            raise _bad("false_alarm", "a probability from 0 to below 1", self.false_alarm)
        if not isinstance(self.false_alarms, tuple) or any(
                not _number(t) or t < 0 for t in self.false_alarms):
            raise _bad("false_alarms", "a list of seconds since launch", self.false_alarms)
        if self.seed is not None and not isinstance(self.seed, str):
            raise _bad("seed", "text", self.seed)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SignalModel:
        """The model a job's ``simulate_signals`` describes (None: the defaults)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise SpecError(f"simulate_signals must be a dict of {', '.join(_FIELDS)}, "
                            f"not {raw!r}", field="simulate_signals")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise SpecError(f"simulate_signals has no {', '.join(map(str, unknown))}; it "
                            f"takes {', '.join(_FIELDS)}", field="simulate_signals")
        fields = dict(raw)
        if "false_alarms" in fields:
            times = fields["false_alarms"]
            if not isinstance(times, (list, tuple)):
                raise _bad("false_alarms", "a list of seconds since launch", times)
            fields["false_alarms"] = tuple(sorted(times))
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; :meth:`from_dict` reads it back."""
        return {**dataclasses.asdict(self), "false_alarms": list(self.false_alarms)}

    @property
    def false_alarms_per_interruption(self) -> float:
        """False alarms per interruption that give ``false_alarm`` as their share of all
        recommendations (0.6 recommendations per interruption are followed, by default)."""
        followed = 1.0 - self.no_recommendation
        return followed * self.false_alarm / (1.0 - self.false_alarm)

    def draw(self, rng: random.Random) -> float | None:
        """For one interruption: its recommendation's lead before the notice (market
        seconds; 0 for both at once), or None when no recommendation comes first.
        Always takes three numbers from ``rng``, whatever it returns."""
        skip, together, spread = rng.random(), rng.random(), rng.gauss(0.0, 1.0)
        if skip < self.no_recommendation:
            return None
        if together < self.together:
            return 0.0
        return min(self.lead_median * math.exp(self.lead_sigma * spread), self.lead_max)

    def false_alarm_gap(self, rng: random.Random, interruption_rate: float) -> float | None:
        """Time to the next false alarm of an instance interrupted at
        ``interruption_rate`` (per unit of time; the answer is in the same unit), or
        None if none ever comes."""
        rate = self.false_alarms_per_interruption * interruption_rate
        return rng.expovariate(rate) if rate > 0 else None


_FIELDS = tuple(f.name for f in dataclasses.fields(SignalModel))


def check_signals(raw: Any) -> dict[str, Any] | None:
    """``simulate_signals`` as a spec holds it (every field, normalised) or None;
    SpecError naming the field for anything else."""
    if raw is None:
        return None
    return SignalModel.from_dict(raw).to_dict()


def _number(value: Any) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and math.isfinite(value))


def _bad(name: str, what: str, value: Any) -> SpecError:
    return SpecError(f"simulate_signals: {name} must be {what}, not {value!r}",
                     field="simulate_signals")
