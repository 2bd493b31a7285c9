"""What the local cloud refuses before anything starts (:meth:`LocalProvider.validate
<spotnb.providers.local.LocalProvider.validate>`): an instance type it has no spot pool
for in the job's regions, a ``max_price`` below every price it has, a malformed
``simulate_interruptions``; each a :class:`~spotnb.protocol.spec.SpecError` that names
the fix.
"""

from __future__ import annotations

from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.providers import catalog

__all__ = ["check_max_price", "check_simulation", "check_type"]


def check_type(instance_type: str, regions: tuple[str, ...]) -> None:
    """An instance type the catalog offers in one of the job's regions at least (it runs
    where it is offered); SpecError naming where it is offered otherwise."""
    catalog.check_type_name(instance_type)
    if any(catalog.pools(instance_type, region) for region in regions):
        return
    if len(regions) == 1:
        catalog.check_instance_type(instance_type, regions[0])  # raises, naming the fix
    where = catalog.regions(instance_type)
    raise SpecError(
        f"{instance_type} has no spot pool in any of the job's regions "
        f"({', '.join(regions)}) in spotnb's catalog ({catalog.DATA_DATE['catalog']}); "
        + (f"regions that have it: {', '.join(where)}. Add one of them to the job's "
           "regions (--region), or choose another type with %spot_picker." if where else
           "no region has a spot price for it: pick another type with %spot_picker."))


def check_max_price(max_price: Any, instance_types: tuple[str, ...],
                    regions: tuple[str, ...]) -> None:
    """A positive price at or above the lowest spot price the local cloud has for the
    types in the regions: else the job would never start."""
    if isinstance(max_price, bool) or not isinstance(max_price, (int, float)) or max_price <= 0:
        raise SpecError(f"max_price must be a positive price in USD per hour, not {max_price!r}")
    lowest = min(
        (min(p for _, p in catalog.price_trace(t, region, pool.az).points), pool.name)
        for region in regions for t in instance_types for pool in catalog.pools(t, region)
    )
    if max_price < lowest[0]:
        raise SpecError(
            f"max_price ${max_price:g}/h is below every spot price the local cloud has for "
            f"{', '.join(instance_types)} in {', '.join(regions)} (lowest "
            f"${lowest[0]:.4f}/h in {lowest[1]}): the job would never start. Raise "
            "max_price or leave it unset."
        )


def check_simulation(sim: dict[str, Any] | None) -> None:
    """``simulate_interruptions``: ``{'count': N}`` or ``{'schedule': [seconds, ...]}``."""
    if sim is None:
        return
    usage = ("simulate_interruptions must be {'count': N} or {'schedule': [seconds, ...]}, "
             f"not {sim!r}")
    if not isinstance(sim, dict) or not set(sim) <= {"count", "schedule"} or not sim:
        raise SpecError(usage)
    count = sim.get("count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise SpecError(usage)
    schedule = sim.get("schedule", [])
    if not isinstance(schedule, (list, tuple)) or any(
            isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in schedule):
        raise SpecError(usage)
