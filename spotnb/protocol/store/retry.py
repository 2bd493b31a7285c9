"""A failing store delays, it never fails or storms (ARCHITECTURE invariant 4):
:func:`retrying` waits out a store's outage with backoff, up to :func:`outage_limit`."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from spotnb.protocol.backoff import Backoff
from spotnb.protocol.store import NotFound, StoreError, StoreUnavailable

__all__ = ["OUTAGE_ENV", "outage_limit", "retrying", "transient"]

_log = logging.getLogger(__name__)

# A store that fails is retried with backoff from RETRY_SECONDS up to MAX_RETRY_SECONDS
# apart; after OUTAGE_SECONDS without a success the caller gives up (StoreUnavailable).
# SPOTNB_STORE_OUTAGE_SECONDS changes it (tests, or a job that should wait longer).
RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0
OUTAGE_SECONDS = 900.0
OUTAGE_ENV = "SPOTNB_STORE_OUTAGE_SECONDS"

T = TypeVar("T")


def transient(err: BaseException) -> bool:
    """Whether a store error may go away by itself (a full or read-only disk, S3 down):
    any OSError or StoreError but a missing key."""
    return isinstance(err, (OSError, StoreError)) and not isinstance(
        err, (NotFound, StoreUnavailable))


def outage_limit() -> float:
    """How long :func:`retrying` waits for a failing store, in seconds."""
    try:
        return float(os.environ.get(OUTAGE_ENV) or OUTAGE_SECONDS)
    except ValueError:
        return OUTAGE_SECONDS


def retrying(fn: Callable[[], T], what: str, check: Callable[[], None] | None = None) -> T:
    """``fn()``, retried with backoff while the store fails transiently (see
    :func:`transient`); :class:`StoreUnavailable` once it has failed for
    :func:`outage_limit` seconds. ``check`` runs before every try (it may raise to
    stop, e.g. when the caller lost the job's lease)."""
    started = time.monotonic()
    delays = Backoff(RETRY_SECONDS, MAX_RETRY_SECONDS)
    limit = outage_limit()
    while True:
        if check is not None:
            check()
        try:
            return fn()
        except Exception as err:
            if not transient(err):
                raise
            if time.monotonic() - started > limit:
                raise StoreUnavailable(f"{what} failed for {limit:g} s: {err}") from err
            delay = delays.next()
            _log.warning("%s failed (%s); retrying in %.1f s", what, err, delay)
            time.sleep(delay)

