"""A trial's job, as the sweep deals with it: followed (:class:`TrialRun`), told what the
sweep decided (:func:`tell_job`: its parameters, its pruning, as events in its log, so
that its fold and every view of it say them), stopped, and what trials cost; and a
sweep ended from outside its driver (:func:`stop_in_store`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from spotnb.client.comparison import JobRun
from spotnb.protocol.store import Store
from spotnb.sweep.budget import SweepCost
from spotnb.sweep.state import (
    HEARTBEAT_STALE_SECONDS,
    Trial,
    end_in_store,
    liveness,
    read_state,
    request_stop,
)

__all__ = ["STOP_WAIT_SECONDS", "TrialRun", "jobs_cost", "stop_in_store", "stop_job",
           "tell_job"]

log = logging.getLogger(__name__)

# A stop waits this long for the running trials' jobs to end (a job's own stop waits up
# to 30 s for its agent, then deletes the group).
STOP_WAIT_SECONDS = 60.0
# How often a stop from outside reads whether the driver has ended the sweep.
_STATE_POLL_SECONDS = 1.0


class TrialRun(JobRun):
    """A trial's job, followed: a :class:`~spotnb.client.comparison.JobRun` (its facts
    from its fold: the parameters from its ``params`` event, ``pruned`` from its
    ``pruned`` one) that knows its :class:`~spotnb.sweep.state.Trial`."""

    source = "trial"

    def __init__(self, handle: Any, trial: Trial, label: str) -> None:
        super().__init__(handle, label, label)
        self.trial = trial


def tell_job(handle: Any, kind: str, **data: Any) -> None:
    """An event of the sweep's in a trial's job log: the group's stream, which several
    processes write (its capacity group, followers' usage); one PUT."""
    from spotnb.protocol.events import GROUP_STREAM, EventWriter

    writer = EventWriter(handle.store, GROUP_STREAM, flush_seconds=3600)
    writer.emit(kind, **data)
    if not writer.close(timeout=10):
        log.warning("could not write the %s event of job %s", kind, handle.job_id)


def stop_job(handle: Any, why: str) -> None:
    """Stop a trial's job (its instance deleted); a failure is logged."""
    try:
        handle.stop(reason=why)
    except Exception:
        log.warning("could not stop job %s", handle.job_id, exc_info=True)


def jobs_cost(job_ids: list[str]) -> SweepCost:
    """What the trials' jobs cost, each from the fold of its whole log (a sweep ended
    from outside its driver: the cost its driver last wrote is older)."""
    from spotnb.client.jobs import attach, summarize_state
    from spotnb.protocol.events import EventReader
    from spotnb.protocol.events.fold import fold

    billed = refunded = ondemand = 0.0
    refunds = 0
    for job_id in job_ids:
        try:
            handle = attach(job_id)
            state = fold(EventReader(handle.store, batches=True).poll(),
                         handle.spec.resources.max_nodes)
            result = summarize_state(handle.spec, state, handle.result_record())
        except Exception:  # a job out of reach: its cost is not counted
            log.warning("could not read the cost of job %s", job_id, exc_info=True)
            continue
        billed += result.cost_usd
        ondemand += result.ondemand_cost_usd
        refunded += state.refunded_usd()
        refunds += len(state.refunded())
    return SweepCost(billed, refunded, ondemand, refunds)


def stop_in_store(prefix: Store, reason: str) -> list[str]:
    """End a sweep for good from outside its driver (``spotnb stop SWEEP``): a stop
    request for the driver wherever it runs, every running trial's job stopped, and
    a sweep whose driver is gone ended in ``state.json``. The ids of the jobs stopped."""
    from spotnb.client.jobs import attach

    request_stop(prefix, reason)
    found = read_state(prefix)
    trials = [Trial.from_dict(raw) for raw in (found[0] if found else {}).get("trials") or []]
    handles = []
    for trial in trials:
        if trial.job_id and trial.state in ("running", "pruned"):
            with contextlib.suppress(Exception):
                handle = attach(trial.job_id)
                if handle.result_record() is None:
                    handles.append(handle)
    threads = [threading.Thread(target=stop_job, args=(h, reason), daemon=True)
               for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STOP_WAIT_SECONDS)
    # A driver alive ends the sweep itself at its next round; one gone cannot.
    deadline = time.monotonic() + HEARTBEAT_STALE_SECONDS
    while time.monotonic() < deadline:
        found = read_state(prefix)
        if found is None or liveness(found[0]) != "running":
            break
        time.sleep(_STATE_POLL_SECONDS)
    end_in_store(prefix, f"stop requested ({reason})",
                 cost=jobs_cost([t.job_id for t in trials if t.job_id]))
    return [h.job_id for h in handles]
