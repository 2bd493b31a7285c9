"""The order in which EC2 Auto Scaling tries a mixed-instances group's pools, by its
allocation strategy, as the simulator plays it (:mod:`spotnb.testing.autoscaling`):
by price under ``price-capacity-optimized`` and ``lowest-price`` (the bundled
catalog's spot price of the pool, else the type's on-demand price), in a drawn order
under ``capacity-optimized`` (capacity decides there, never the list's order), and in
the list's order only under ``capacity-optimized-prioritized`` and on-demand's
``prioritized``, as Auto Scaling documents."""

from __future__ import annotations

import random

__all__ = ["PRIORITIZED", "pool_order"]

#: Allocation strategies that honour the overrides' order (priority).
PRIORITIZED = ("capacity-optimized-prioritized", "prioritized")


def pool_order(pools: list[tuple[str, str, str]], strategy: str, spot: bool, region: str,
               rng: random.Random) -> list[tuple[str, str, str]]:
    """The order in which Auto Scaling tries ``pools`` ((type, subnet, AZ id), in the
    policy's order) under allocation ``strategy``: see the module docstring."""
    from spotnb.providers import catalog

    if strategy in PRIORITIZED:
        return list(pools)
    if strategy == "capacity-optimized":
        drawn = list(pools)
        rng.shuffle(drawn)
        return drawn

    def price(pool: tuple[str, str, str]) -> float:
        instance_type, _, az_id = pool
        if spot:
            found = [p.spot for p in catalog.pools(instance_type, region)
                     if p.az == az_id and p.spot is not None]
            if not found:
                found = [p.spot for p in catalog.pools(instance_type, region)
                         if p.spot is not None]
            if found:
                return float(min(found))
        ondemand = catalog.ondemand_price(instance_type, region)
        return float(ondemand) if ondemand is not None else float("inf")

    return sorted(pools, key=price)  # stable: equal prices keep the subnets' order
