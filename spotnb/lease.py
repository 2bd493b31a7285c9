"""The job's lease: exactly one agent works on a job at any time (DESIGN invariant 3).

``lease.json`` holds ``{"epoch", "holder", "heartbeat", "released"}``. An agent takes
the lease by compare-and-swap, bumping the epoch; its attempt number *is* that epoch.
It renews the heartbeat by compare-and-swap while it works. Another agent may take the
lease only when it was released or its heartbeat is older than the TTL (the holder's
instance is gone). An agent whose renewal fails has lost the lease (fencing): it stops
without writing a checkpoint, an output or a result.

Sequence on an interruption with notice::

    A1 holds epoch 1 -> notice -> final checkpoint durable -> A1 releases
    -> the group starts A2 -> A2 takes epoch 2 at once (no TTL wait)

Without notice (an instance killed outright) the replacement waits until the last
heartbeat is ``ttl`` old.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from spotnb.layout import LEASE
from spotnb.store import NotFound, Store

__all__ = ["Lease", "LeaseLost", "acquire", "read", "still_holds"]

log = logging.getLogger(__name__)

# Renew every HEARTBEAT_SECONDS; a holder silent for TTL_SECONDS is presumed dead.
# TTL is several heartbeats so a slow store call does not cost the lease.
HEARTBEAT_SECONDS = 2.0
TTL_SECONDS = 10.0


class LeaseLost(RuntimeError):
    """Another agent took the lease: stop without writing."""


@dataclasses.dataclass(frozen=True)
class Lease:
    """A snapshot of ``lease.json``."""

    epoch: int
    holder: str
    heartbeat: float
    released: bool = False

    def expired(self, now: float, ttl: float = TTL_SECONDS) -> bool:
        return self.released or now - self.heartbeat > ttl

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()


def read(store: Store) -> tuple[Lease, str] | None:
    """The current lease and its ETag, or None if nobody ever took it."""
    try:
        data, etag = store.get_with_etag(LEASE)
    except NotFound:
        return None
    return Lease(**json.loads(data)), etag


def still_holds(store: Store, epoch: int, holder: str) -> bool:
    """Whether ``holder`` still holds the lease at ``epoch`` (a fencing check)."""
    current = read(store)
    return (
        current is not None
        and current[0].epoch == epoch
        and current[0].holder == holder
        and not current[0].released
    )


class HeldLease:
    """A lease this process holds: renew it, release it, check it."""

    def __init__(self, store: Store, lease: Lease, etag: str) -> None:
        self.store = store
        self.lease = lease
        self._etag = etag

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def renew(self) -> None:
        """Refresh the heartbeat; raise :class:`LeaseLost` if someone else took it."""
        new = dataclasses.replace(self.lease, heartbeat=time.time())
        etag = self.store.put_if_match(LEASE, new.encode(), self._etag)
        if etag is None:
            raise LeaseLost(f"lease epoch {self.lease.epoch} was taken by another agent")
        self.lease, self._etag = new, etag

    def bump(self) -> None:
        """Start a new attempt under a new epoch, keeping the lease (retry in place)."""
        new = Lease(epoch=self.lease.epoch + 1, holder=self.lease.holder, heartbeat=time.time())
        etag = self.store.put_if_match(LEASE, new.encode(), self._etag)
        if etag is None:
            raise LeaseLost(f"lease epoch {self.lease.epoch} was taken by another agent")
        self.lease, self._etag = new, etag

    def release(self) -> None:
        """Give the lease up so a replacement can take it at once."""
        new = dataclasses.replace(self.lease, released=True, heartbeat=time.time())
        if self.store.put_if_match(LEASE, new.encode(), self._etag) is not None:
            self.lease = new


def acquire(store: Store, holder: str, now: float | None = None,
            ttl: float = TTL_SECONDS) -> HeldLease | None:
    """Try once to take the lease; None if a live holder has it (or a racer won)."""
    now = time.time() if now is None else now
    current = read(store)
    if current is None:
        lease = Lease(epoch=1, holder=holder, heartbeat=now)
        etag = store.put_if_absent(LEASE, lease.encode())
    else:
        old, old_etag = current
        if not old.expired(now, ttl):
            return None
        lease = Lease(epoch=old.epoch + 1, holder=holder, heartbeat=now)
        etag = store.put_if_match(LEASE, lease.encode(), old_etag)
    if etag is None:
        return None
    log.info("took the lease at epoch %d as %s", lease.epoch, holder)
    return HeldLease(store, lease, etag)
