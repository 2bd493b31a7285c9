"""Lease keeping: the agent takes the job's lease, renews it, and writes only while
it holds it (DESIGN invariant 3).

:class:`LeaseKeeper` holds the lease once taken (:func:`take_lease`), says whether
this agent may still act (:meth:`LeaseKeeper.check`: :class:`Fenced` once the lease
is lost or the instance is being terminated), and guards every write of the agent's
(:meth:`LeaseKeeper.write`: only while the lease is HELD). :class:`Heartbeat` is the
store loop's renewal, retried with backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from spotnb.protocol import layout, lease
from spotnb.protocol.backoff import Backoff
from spotnb.protocol.lease import Standing
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store, StoreError, retrying, transient

log = logging.getLogger(__name__)

T = TypeVar("T")

#: While it waits for a lease (a node slot), an agent asks the provider whether a
#: holder's instance is gone (on AWS one DescribeInstances: free, but rate-limited) at
#: most this often per holder. A replacement that boots while its predecessor is in its
#: two-minute notice period asks 24 times, not 240 (the wait loop runs every 0.5 s), and
#: a multi-node job's replacement, which finds every slot held, as often per slot; a
#: holder that is gone is found within this (its lease is usually released before).
HOLDER_GONE_RECHECK_SECONDS = 5.0
# A failing store is retried with backoff (spotnb.protocol.store.retrying); the lease's
# heartbeat backs off from STORE_RETRY_SECONDS up to STORE_MAX_RETRY_SECONDS. After
# spotnb.protocol.store.outage_limit() without a success the attempt gives up (exit code
# EXIT_STORE: the group backs off before it starts another instance).
STORE_RETRY_SECONDS = 0.5
STORE_MAX_RETRY_SECONDS = 30.0


class Fenced(Exception):
    """This agent lost the lease, or its instance is being terminated: stop without
    writing anything more (the job is another agent's now)."""


def retry_store(fn: Callable[[], T], what: str,
                check: Callable[[], None] | None = None) -> T:
    """:func:`spotnb.protocol.store.retrying`: ``fn()`` retried while the store fails."""
    return retrying(fn, what, check=check)


def holder_gone_check(spec: JobSpec) -> lease.HolderGone | None:
    """The provider's check that a lease holder's instance is terminated, if it has one."""
    try:
        from spotnb.providers import get_provider

        check = getattr(get_provider(spec.provider), "instance_gone", None)
    except Exception:
        log.debug("no provider check for gone instances", exc_info=True)
        return None
    if check is None:
        return None
    return lambda held: bool(check(spec.job_id, held.holder))


def rechecked(check: lease.HolderGone | None,
              seconds: float) -> lease.HolderGone | None:
    """``check``, asked about one holder at most once every ``seconds`` (the answers
    in between are "not gone"); a holder found gone stays gone."""
    if check is None:
        return None
    asked: dict[str, float] = {}
    found_gone: set[str] = set()

    def gone(held: lease.Lease) -> bool:
        if held.holder in found_gone:
            return True
        now = time.monotonic()
        if held.holder in asked and now - asked[held.holder] < seconds:
            return False
        asked[held.holder] = now
        if check(held):
            found_gone.add(held.holder)
            return True
        return False

    return gone


def free_slot(store: Store, spec: JobSpec, instance: str,
              gone: lease.HolderGone | None) -> lease.HeldLease | None:
    """One try at the job's lease (a distributed job's: of the first free node slot):
    the lease, or None while live agents hold every slot. Store errors are raised."""
    slots = spec.resources.max_nodes if spec.resources.distributed else 1
    for slot in range(slots):
        held = lease.acquire(store, holder=instance, holder_gone=gone,
                             ttl=lease.configured_ttl(), slot=slot, stride=slots)
        if held is not None:
            return held
    return None


def take_lease(store: Store, spec: JobSpec, instance: str) -> lease.HeldLease | None:
    """Wait for the lease (a distributed job's: of the first free node slot); None
    if the job ended or was stopped meanwhile."""
    gone = rechecked(holder_gone_check(spec), HOLDER_GONE_RECHECK_SECONDS)
    while True:
        try:
            if store.exists(layout.RESULT) or store.exists(layout.STOP):
                log.info("job ended while waiting for the lease; exiting without writing")
                return None
            held = free_slot(store, spec, instance, gone)
            if held is not None and store.exists(layout.RESULT):
                # The previous holder finished the job and released the lease.
                held.release()
                return None
        except Exception as err:
            if not transient(err):
                raise
            log.warning("the store failed while taking the lease (%s); retrying", err)
            held = None
        if held is not None:
            return held
        time.sleep(0.5)


class LeaseKeeper:
    """The lease this agent holds, and whether it may still act on it.

    ``on_lost``: what fencing off does besides raising the flag (the agent stops
    writing and kills its kernels).
    """

    def __init__(self, on_lost: Callable[[], None]) -> None:
        self.held: lease.HeldLease | None = None
        #: The lease was lost: another agent took the job.
        self.fenced = threading.Event()
        #: The instance is being terminated (SIGTERM).
        self.terminating = threading.Event()
        self._on_lost = on_lost

    def fence_off(self) -> None:
        """Another agent took the job: write nothing more (``on_lost``)."""
        self.fenced.set()
        self._on_lost()

    def check(self) -> None:
        """Raise :class:`Fenced` unless this agent may still act for the job."""
        # Terminating: the kernel is killed under the cell, and what fails then is no
        # result of the job's; the replacement runs the attempt again. Released (after
        # the final checkpoint) or lost: the job is another agent's.
        held = self.held
        if (self.fenced.is_set() or self.terminating.is_set()
                or (held is not None and held.status() is Standing.LOST)):
            raise Fenced()

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried with backoff while the store fails; StoreUnavailable after
        the outage limit. Fenced if the lease is lost meanwhile."""
        return retry_store(fn, what, check=self.check)

    def renew_or_fence(self, step: Callable[[], None]) -> None:
        """Renew (or bump) the lease now, retrying a failing store; Fenced if lost."""
        try:
            self.retry(step, "renewing the lease")
        except lease.LeaseLost:
            self.fence_off()
            raise Fenced() from None

    def write(self, fn: Callable[[], T], what: str) -> T:
        """A write of this agent's (errors, result): only while the lease is HELD."""
        def guarded() -> T:
            self.check()
            held = self.held
            if held is not None and held.status() is not Standing.HELD:
                raise StoreError(f"not writing {what}: the lease is not confirmed")
            return fn()
        return self.retry(guarded, f"writing {what}")

    def standing(self) -> tuple[bool, bool]:
        """(held, unknown): the answer to the runtime's ``fence`` question. UNCONFIRMED
        (the store did not answer the last renewals) is not LOST: the runtime asks
        again until the lease is confirmed or lost."""
        held = self.held
        standing = held.status() if held is not None else Standing.LOST
        fenced = self.fenced.is_set()
        return (standing is Standing.HELD and not fenced,
                standing is Standing.UNCONFIRMED and not fenced)

    def held_until(self) -> float | None:
        """Until when the lease counts as held unless renewed (None: none)."""
        held = self.held
        return None if held is None else held.held_until()

    def heartbeat(self) -> Heartbeat:
        """The store loop's renewals of this lease."""
        return Heartbeat(self)


class Heartbeat:
    """The lease's renewal every :func:`lease.heartbeat_seconds`; a failure is retried
    sooner, with backoff."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self.keeper = keeper
        held = keeper.held
        self.every = lease.heartbeat_seconds(held.lease.ttl if held else lease.TTL_SECONDS)
        self.due = time.monotonic() + self.every
        self._retry = Backoff(STORE_RETRY_SECONDS, STORE_MAX_RETRY_SECONDS)

    def beat(self, now: float) -> bool:
        """Renew if due; False once the lease is lost (fenced off)."""
        held = self.keeper.held
        if held is None or now < self.due or held.status() is Standing.LOST:
            return True
        try:
            held.renew()
            self.due = now + self.every
            self._retry.reset()
        except lease.LeaseLost:
            self.keeper.fence_off()
            return False
        except Exception as err:
            delay = self._retry.next()
            log.warning("renewing the lease failed (%s); retrying in %.1f s", err, delay)
            self.due = now + delay
        return True
