"""What the local cloud's capacity group keeps outside the job's store: its record,
``group.json`` (its supervisor, its state, a result the store would not take yet), and
how it rides out the store's outages.

The store may fail (a full or read-only disk, a bucket out of reach): the supervisor
(:mod:`.group`) keeps its local duties (notices, terminations) and retries the store every
tick; an agent that gave up on the store (exit code :data:`AGENT_EXIT_STORE`) is
replaced only after a backoff (:data:`STORE_BACKOFF_SECONDS` doubling), never in a storm.
A result it must write (crash loop, stop) waits in ``group.json`` (``pending_result``)
until the store takes it, this supervisor's or the next one's; after
:data:`STORE_OUTAGE_SECONDS` without the store the supervisor exits, saying so in
``group.json``, and the next spotnb command that looks at the job starts a new one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from spotnb.protocol.backoff import Backoff
from spotnb.protocol.layout import RESULT
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store, StoreError, open_store
from spotnb.providers.local.pools import Emit
from spotnb.providers.local.state import GROUP_FILE, ProcessRecord, read_json, write_json

__all__ = ["AGENT_EXIT_STORE", "SUPERVISOR_KILL_GRACE_SECONDS", "GroupFile", "has_result",
           "supervisor_alive"]

log = logging.getLogger(__name__)

# How long the store may fail before the supervisor gives up (and says so in group.json).
STORE_OUTAGE_SECONDS = 900.0
# An agent that exited because the store failed is replaced after this, doubling up to
# STORE_MAX_BACKOFF_SECONDS: a new instance would meet the same store.
STORE_BACKOFF_SECONDS = 5.0
STORE_MAX_BACKOFF_SECONDS = 120.0
# Grace for a supervisor killed from outside: on SIGTERM it ends its instances first.
SUPERVISOR_KILL_GRACE_SECONDS = 5.0
# The agent's exit code when it gave up on the store (spotnb.kernel_remote.agent).
AGENT_EXIT_STORE = 4


class GroupFile:
    """The group's ``group.json`` under ``home`` and its view of the store's health.
    ``adopt``: a new supervisor of the job, which carries on from the record (when the
    group first started: the markets replay from then; a result still to write)."""

    def __init__(self, home: Path, spec: JobSpec, store: Store, adopt: bool) -> None:
        self.home = home
        self.spec = spec
        self.store = store
        previous = (read_json(home / GROUP_FILE) or {}) if adopt else {}
        self.started = float(previous.get("started") or time.time())
        self.pending_result: dict[str, Any] | None = previous.get("pending_result")
        self.failing_since: float | None = None
        #: Before the next instance, after an agent gave up on the store.
        self.backoff = Backoff(STORE_BACKOFF_SECONDS, STORE_MAX_BACKOFF_SECONDS)

    def write(self, state: str, **fields: Any) -> None:
        """``group.json`` now: ``state`` (ready, store-unavailable, result-pending,
        exited) and ``fields``."""
        write_json(self.home / GROUP_FILE, {
            "job_id": self.spec.job_id, "store_uri": self.store.uri, "state": state,
            "started": self.started, "log": str(self.home / "supervisor.log"),
            "pending_result": self.pending_result,
            "store_unavailable_since": self.failing_since, **fields,
        })

    def store_works(self) -> None:
        """A tick met no store error."""
        if self.failing_since is not None:
            log.warning("the store works again after %.0f s", time.time() - self.failing_since)
            self.failing_since = None
            self.write("ready", supervisor=ProcessRecord.of(os.getpid()).to_dict())

    def store_fails(self, err: BaseException) -> bool:
        """A tick met a store error: whether to give up (it has lasted
        STORE_OUTAGE_SECONDS); else the next tick tries again."""
        now = time.time()
        if self.failing_since is None:
            self.failing_since = now
            log.warning("the job's store fails (%s); retrying every tick", err)
            self.write("store-unavailable", supervisor=ProcessRecord.of(os.getpid()).to_dict(),
                       store_unavailable_since=now, store_error=str(err))
        elif now - self.failing_since > STORE_OUTAGE_SECONDS:
            log.error("the store has failed for %.0f s (%s); giving up: the next spotnb "
                      "command that looks at the job restarts its supervision",
                      now - self.failing_since, err)
            return True
        return False

    def write_result(self, emit: Emit, status: str, reason: str, **extra: Any) -> None:
        """Write result.json unless the job already has one, and say so in the log
        (``emit``: the group's events).

        If the store fails, the result waits in ``group.json`` (``pending_result``) and
        every tick tries again, this supervisor's or the next one's (the error is
        raised: the tick's).
        """
        body = {"status": status, "reason": reason, **extra, "time": time.time(),
                "by": "local-cloud"}
        self.pending_result = {"status": status, "reason": reason, **extra}
        try:
            written = self.store.put_if_absent(RESULT, json.dumps(body).encode())
        except (StoreError, OSError):
            self.write("result-pending", supervisor=ProcessRecord.of(os.getpid()).to_dict())
            raise
        self.pending_result = None
        if written is not None:
            log.info("wrote the job's result: %s (%s)", status, reason)
            emit("result", None, status=status, reason=reason, **extra)


def supervisor_alive(info: dict[str, Any]) -> bool:
    """Whether the supervisor a ``group.json`` (``info``) records is alive."""
    record = ProcessRecord.from_dict(info.get("supervisor"))
    return record is not None and record.alive()


def has_result(store_uri: Any) -> bool:
    """Whether the job's store (``store_uri``) holds its result (a store out of reach:
    not as far as anyone can tell)."""
    if not store_uri:
        return False
    try:
        return open_store(str(store_uri)).exists(RESULT)
    except StoreError:
        return False
