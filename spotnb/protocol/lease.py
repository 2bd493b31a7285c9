"""The job's lease: exactly one agent works on a job at any time (DESIGN invariant 3).

``lease.json`` holds ``{"epoch", "holder", "heartbeat", "released", "ttl", "host",
"pid", "pid_started"}``. An agent takes the lease by compare-and-swap, bumping the
epoch; its attempt number *is* that epoch. It renews the heartbeat by compare-and-swap
every :data:`HEARTBEAT_SECONDS` while it works. Another agent may take the lease when:

* it was released (the holder finished, or parked after its final checkpoint);
* the holder is gone: its process on this host is dead, or its instance is terminated
  (the provider asks EC2, or the local cloud's records) -- no TTL to wait out;
* its heartbeat is older than the TTL the holder promised (``ttl``): the holder may be
  alive but unreachable or frozen.

The holder fences itself: it treats the lease as its own only while its last confirmed
renewal is younger than ``ttl - SAFETY_SECONDS`` on its own monotonic clock
(:meth:`HeldLease.status`), so a holder that was frozen or cut off from the store stops
writing before anyone else may take over; and a renewal that fails the compare-and-swap
means another agent has it (:class:`LeaseLost`): it stops for good, without writing.

Sequence on an interruption with notice::

    A1 holds epoch 1 -> notice -> final checkpoint durable -> A1 releases
    -> the group starts A2 -> A2 takes epoch 2 at once (no TTL wait)

Without notice (an instance killed outright) the replacement sees that the holder's
instance is gone and takes over at once. Only a holder that is alive but silent (a
frozen VM, a partition) costs the replacement a wait of up to ``ttl``.

Multi-node jobs (:mod:`spotnb.kernel_remote.multinode`): one lease per *node slot*,
``lease.json`` for slot 0 and ``lease.<k>.json`` for slot k
(:func:`spotnb.protocol.layout.lease_key`); exactly one agent works on each slot. Slot
k's epochs are k+1, k+1+stride, k+1+2*stride, ... with ``stride`` = the job's node
count, so every epoch (every attempt, and so every event stream) is unique job-wide and
has one writer. A single-node job is slot 0 with stride 1: epochs 1, 2, 3, ...
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from spotnb.protocol.layout import lease_key
from spotnb.protocol.store import NotFound, Store

__all__ = [
    "HEARTBEAT_SECONDS",
    "TTL_SECONDS",
    "HeldLease",
    "Lease",
    "LeaseLost",
    "Standing",
    "acquire",
    "read",
    "still_holds",
]

log = logging.getLogger(__name__)

# Renew every HEARTBEAT_SECONDS (one conditional PUT: 60/h = $0.0003/h on S3). A holder
# silent for its TTL is presumed dead; the TTL is three heartbeats so that a slow or
# failing store call or two does not cost the lease. Takeover after a crash does not
# wait for it: the replacement asks whether the holder is gone (see the docstring).
HEARTBEAT_SECONDS = 60.0
TTL_SECONDS = 180.0
# The holder stops writing this long before its TTL runs out on its own clock: room for
# a write already in flight and for clock skew between hosts (NTP keeps EC2 within ms).
# At most a third of the TTL.
SAFETY_SECONDS = 30.0
# Sets the TTL an agent promises (and so its heartbeat, a third of it): for tests and
# for jobs that must hand over faster from a frozen instance (at more requests).
ENV_TTL = "SPOTNB_LEASE_TTL"


def configured_ttl() -> float:
    """The TTL agents promise: ``$SPOTNB_LEASE_TTL`` seconds, else :data:`TTL_SECONDS`."""
    raw = os.environ.get(ENV_TTL)
    try:
        ttl = float(raw) if raw else TTL_SECONDS
    except ValueError:
        log.warning("ignoring %s=%r: not a number of seconds", ENV_TTL, raw)
        return TTL_SECONDS
    return ttl if ttl >= 3 else TTL_SECONDS


def heartbeat_seconds(ttl: float) -> float:
    """How often a holder that promised ``ttl`` renews: a third of it, at most
    :data:`HEARTBEAT_SECONDS` apart."""
    return min(HEARTBEAT_SECONDS, ttl / 3)


def safety_seconds(ttl: float) -> float:
    return min(SAFETY_SECONDS, ttl / 3)


def clock() -> float:
    """Seconds on a clock that keeps counting while this process is stopped and while
    the machine sleeps (Linux's boot clock; monotonic elsewhere): one clock for every
    process of the host."""
    return time.clock_gettime(_CLOCK)



_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


class LeaseLost(RuntimeError):
    """Another agent took the lease: stop without writing."""


class Standing(enum.Enum):
    """Where a holder stands, by its own clock and its last store round-trip."""

    HELD = "held"  # confirmed recently: write freely
    UNCONFIRMED = "unconfirmed"  # no confirmation for too long: write nothing until renewed
    LOST = "lost"  # another agent took it, or it was released: never write again


@dataclasses.dataclass(frozen=True)
class Lease:
    """A snapshot of ``lease.json``."""

    epoch: int
    holder: str
    heartbeat: float
    released: bool = False
    ttl: float = TTL_SECONDS
    host: str = ""
    pid: int = 0
    pid_started: float = 0.0
    slot: int = 0
    stride: int = 1

    @property
    def key(self) -> str:
        """The store key of this lease (its slot's)."""
        return lease_key(self.slot)

    def expired(self, now: float, ttl: float | None = None) -> bool:
        """Released, or silent for longer than its TTL (``ttl`` overrides it)."""
        return self.released or now - self.heartbeat > (self.ttl if ttl is None else ttl)

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Lease:
        raw = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


#: ``holder_gone(lease) -> bool``: whether the holder's instance is known to be gone
#: (terminated), asked of the provider by a replacement that finds the lease taken.
HolderGone = Callable[[Lease], bool]


def read(store: Store, slot: int = 0) -> tuple[Lease, str] | None:
    """The current lease of node slot ``slot`` and its ETag, or None if nobody ever
    took it."""
    try:
        data, etag = store.get_with_etag(lease_key(slot))
    except NotFound:
        return None
    return Lease.decode(data), etag


def still_holds(store: Store, epoch: int, holder: str, now: float | None = None,
                slot: int = 0) -> bool:
    """Whether ``holder`` still holds the lease at ``epoch`` (a fencing check from the
    store, for a process that cannot ask the holding agent). A heartbeat older than the
    lease's TTL less :data:`SAFETY_SECONDS` counts as lost: someone may take it now."""
    current = read(store, slot)
    if current is None:
        return False
    lease = current[0]
    now = time.time() if now is None else now
    return (lease.epoch == epoch and lease.holder == holder and not lease.released
            and now - lease.heartbeat < lease.ttl - safety_seconds(lease.ttl))


def _process_started(pid: int) -> float:
    """When ``pid`` started (seconds since boot, from /proc), 0.0 where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def process_gone(lease: Lease) -> bool | None:
    """Whether the holder's process is gone, if it ran on this host; None if unknown.

    Compares the start time too, so a reused pid is not mistaken for the holder.
    """
    if not lease.pid or lease.host != socket.gethostname():
        return None
    try:
        os.kill(lease.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # someone else's process now has that pid: the start time tells
    started = _process_started(lease.pid)
    if not started or not lease.pid_started:
        return None  # no /proc (not Linux): a live pid may or may not be the holder
    # A zombie (killed, not yet reaped) still has its /proc entry: it writes nothing.
    if _is_zombie(lease.pid):
        return True
    return abs(started - lease.pid_started) > 0.05


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class HeldLease:
    """A lease this process holds: renew it, release it, ask where it stands.

    Thread-safe: the heartbeat thread and the attempt's end may renew, bump and release
    at once. Each of them is one section under one lock (read the lease, build the next,
    compare-and-swap it, record the outcome), so the epoch never goes back and a
    released lease stays released.
    """

    def __init__(self, store: Store, lease: Lease, etag: str,
                 confirmed: float | None = None) -> None:
        self.store = store
        self.lease = lease
        self._etag = etag
        self._lock = threading.Lock()
        self._lost = False
        # Monotonic time at which the last successful write was *sent*: the lease was
        # ours from then for ``ttl`` seconds by anyone's clock.
        self._confirmed = clock() if confirmed is None else confirmed

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    def status(self) -> Standing:
        """HELD while confirmed within ``ttl - SAFETY_SECONDS`` on this process's
        monotonic clock (which keeps counting while the process is stopped)."""
        if self._lost or self.lease.released:
            return Standing.LOST
        if clock() - self._confirmed < self.lease.ttl - safety_seconds(self.lease.ttl):
            return Standing.HELD
        return Standing.UNCONFIRMED

    def confirmed_age(self) -> float:
        """Seconds since the lease was last confirmed in the store."""
        return clock() - self._confirmed

    def held_until(self) -> float | None:
        """When this holder stops counting the lease as its own if no renewal lands
        first (the end of HELD in :meth:`status`), on :func:`clock`: the same clock for
        every process of the host, so the kernel can fence itself by it while its agent
        is frozen (:mod:`spotnb.train.watchdog`). None once LOST (released or taken)."""
        if self._lost or self.lease.released:
            return None
        return self._confirmed + self.lease.ttl - safety_seconds(self.lease.ttl)

    def _swap(self, change: Callable[[Lease], Lease], *, final: bool = False) -> None:
        """Compare-and-swap ``change(current lease)`` in, as one atomic section: the new
        lease is built from the lease as it is inside the lock, so a renewal that raced
        a bump or a release can never write an older epoch or undo the release.
        LeaseLost if someone else changed the lease (or this holder gave it up). Store
        errors propagate (the lease is then merely unconfirmed). ``final``: this holder
        is LOST from here on, whatever the write's outcome (a release)."""
        with self._lock:
            if self._lost:
                raise LeaseLost(f"lease epoch {self.lease.epoch} was lost earlier")
            new = change(self.lease)
            sent = clock()
            try:
                etag = self.store.put_if_match(new.key, new.encode(), self._etag)
            finally:
                if final:
                    self._lost = True
            if etag is None:
                self._lost = True
                raise LeaseLost(f"lease epoch {self.lease.epoch} was taken by another agent")
            self.lease, self._etag, self._confirmed = new, etag, sent

    def renew(self) -> None:
        """Refresh the heartbeat; raise :class:`LeaseLost` if someone else took it (or
        this holder released it)."""
        self._swap(lambda lease: dataclasses.replace(lease, heartbeat=time.time()))

    def bump(self) -> None:
        """Start a new attempt under a new epoch, keeping the lease (retry in place)."""
        self._swap(lambda lease: dataclasses.replace(
            lease, epoch=lease.epoch + lease.stride, heartbeat=time.time(), released=False))

    def release(self) -> None:
        """Give the lease up so a replacement can take it at once. From here on this
        holder is LOST to itself, whether or not the write went through: the write and
        the loss are one section, so no renewal can come between them."""
        try:
            self._swap(lambda lease: dataclasses.replace(lease, released=True,
                                                         heartbeat=time.time()),
                       final=True)
        except LeaseLost:
            pass
        except Exception:
            log.warning("could not mark the lease released; the replacement waits until "
                        "it sees this instance gone", exc_info=True)


def acquire(store: Store, holder: str, now: float | None = None,
            ttl: float = TTL_SECONDS,
            holder_gone: HolderGone | None = None,
            slot: int = 0, stride: int = 1) -> HeldLease | None:
    """Try once to take the lease of node slot ``slot``; None if a live holder has it
    (or a racer won).

    A lease is free when nobody took it yet, it was released, its heartbeat is older
    than the TTL its holder promised, or ``holder_gone`` (the provider's check that the
    holder's instance is terminated) or the process check of :func:`process_gone` says
    the holder is gone. ``ttl`` is the TTL this holder promises; ``stride`` the job's
    node count (see the module docstring).
    """
    sent = clock()
    now = time.time() if now is None else now
    mine = Lease(epoch=slot + 1, holder=holder, heartbeat=now, ttl=ttl,
                 host=socket.gethostname(), pid=os.getpid(),
                 pid_started=_process_started(os.getpid()), slot=slot, stride=stride)
    current = read(store, slot)
    if current is None:
        etag = store.put_if_absent(mine.key, mine.encode())
    else:
        old, old_etag = current
        free = old.expired(now)
        why = "released" if old.released else "expired"
        if not free and process_gone(old):
            free, why = True, f"its process {old.pid} is gone"
        if not free and holder_gone is not None and old.holder != holder:
            try:
                if holder_gone(old):
                    free, why = True, f"its instance {old.holder} is gone"
            except Exception:
                log.debug("could not tell whether %s is gone", old.holder, exc_info=True)
        if not free:
            return None
        mine = dataclasses.replace(mine, epoch=old.epoch + stride)
        if not old.released:
            log.warning("taking over the lease from %s (epoch %d): %s", old.holder,
                        old.epoch, why)
        etag = store.put_if_match(mine.key, mine.encode(), old_etag)
    if etag is None:
        return None
    log.info("took the lease%s at epoch %d as %s",
             f" of node slot {slot}" if stride > 1 else "", mine.epoch, holder)
    return HeldLease(store, mine, etag, confirmed=sent)
