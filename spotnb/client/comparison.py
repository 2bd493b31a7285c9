"""Runs side by side: what a comparison shows of each run, from the store or a record.

A *run* is one job: from the store (a job id, a name, the end of an id, or a
:class:`~spotnb.client.jobs.JobHandle`; live or ended) or from a record (a record's path or a
:class:`~spotnb.records.library.Record`: one run per job it holds). :func:`gather`
turns what the user named into :class:`Run` objects; each gives the same things,
whatever it comes from:

* its curves: each metric against step (:meth:`Run.points`, bounded, with a gap where
  another attempt took over), and its interruptions (:attr:`Run.marks`: the last step
  of each attempt that ended early, and the steps the next one redid);
* its facts (:class:`Facts`): status, parameters, final and best value of each metric,
  duration, cost, refunds, cost on-demand, saving, interruptions, steps redone.

A job from the store is replayed as ``%spot_attach`` replays it (one
:class:`~spotnb.protocol.events.live.Follower`: one LIST and a GET per log object, then
``result.json``), and a live one keeps following (:meth:`JobRun.poll`): comparing N
runs costs N re-attaches, no more. Its facts come from the fold of its events
(:class:`~spotnb.protocol.events.fold.JobState`, through
:func:`~spotnb.client.jobs.summarize_state`);
its curves from the dashboard's series (:class:`~spotnb.widgets.series.DashboardData`).
A record's come from its job records (:mod:`spotnb.records`): its stored curves, its
``breaks`` and its figures, so a record compares without the store it ran from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import JobState, savings_pct

if TYPE_CHECKING:
    from spotnb.client.jobs import JobHandle
    from spotnb.client.results import JobResult
    from spotnb.protocol.events import EventReader
    from spotnb.protocol.events.live import Follower
    from spotnb.records.library import Record
    from spotnb.widgets.series import DashboardData

__all__ = ["Facts", "JobRun", "Mark", "RecordRun", "Run", "gather", "higher_is_better"]

log = logging.getLogger(__name__)

# Metrics where a larger value is better (accuracy, F1, ...); any other is a loss or an
# error, better smaller. Matched against the last part of the name, case aside.
_HIGHER = re.compile(r"acc|f1|auc|score|reward|precision|recall|bleu|rouge|iou|map|"
                     r"throughput|samples_per|tokens_per|return", re.I)


# A live run whose attempt booted on an instance the fold has no launch of yet reads
# the log this often until it has (one LIST each; at most a few per instance).
UNKNOWN_INSTANCE_LOG_SECONDS = 2.0


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is the better one (by its name)."""
    return bool(_HIGHER.search(metric.rsplit("/", 1)[-1]))


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a run's attempt ended early: at ``step`` (its last logged; None if it
    logged none), at ``time`` (epoch seconds, None if unknown), how (``reason``: the
    fold's :class:`~spotnb.protocol.events.fold.EndReason` in words) and the steps the next
    attempt redid (None until known)."""

    attempt: int
    reason: str
    step: float | None
    time: float | None = None
    redone: int | None = None

    @property
    def text(self) -> str:
        """The hover text."""
        at = f" at step {self.step:.0f}" if self.step is not None else ""
        redone = "" if self.redone is None else \
            f"; {self.redone} step{'s' if self.redone != 1 else ''} redone"
        return f"attempt {self.attempt} {self.reason}{at}{redone}"


@dataclasses.dataclass
class Facts:
    """What the table of runs says of a run (None: not known)."""

    status: str = "?"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    final: dict[str, float] = dataclasses.field(default_factory=dict)
    best: dict[str, float] = dataclasses.field(default_factory=dict)
    duration_s: float | None = None
    #: What AWS bills (a :class:`~spotnb.client.jobs.JobResult`'s ``cost_usd``; of a
    #: running job, its instances until the newest event heard from each:
    #: :meth:`~spotnb.protocol.events.fold.JobState.cost_heard`, which never decreases).
    cost_usd: float | None = None
    ondemand_cost_usd: float | None = None
    savings_pct: float | None = None
    interruptions: int = 0
    redone_steps: int = 0
    #: What the instances EC2 interrupted in their first hour ran (not billed), and
    #: how many they were (the fold's ``refunded``).
    refunded_usd: float = 0.0
    refunded_instances: int = 0
    #: A sweep's trial that its pruner stopped: the step, and why in words.
    pruned_at: int | None = None
    reason: str = ""

    @property
    def gross_usd(self) -> float | None:
        """What the instances ran, refunds included (never decreases as a run goes on)."""
        return None if self.cost_usd is None else self.cost_usd + self.refunded_usd


class Run:
    """One run of a comparison (see the module docstring). ``key`` is unique within
    a comparison; ``label`` is what the legend and the table call it."""

    source = "run"

    def __init__(self, key: str, label: str, job_id: str | None, name: str) -> None:
        self.key = key
        self.label = label
        self.job_id = job_id
        self.name = name
        self.version = 0  # increases whenever what it shows changed
        # A live run takes events in a follower's thread while a display reads it.
        self.lock = threading.RLock()

    @property
    def live(self) -> bool:
        """Whether it may still change (a job being followed)."""
        return False

    def metric_names(self) -> list[str]:
        raise NotImplementedError

    def points(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """The metric's curve against step, bounded for display, with NaN where another
        attempt's segment starts (empty arrays if the run did not log it)."""
        raise NotImplementedError

    @property
    def marks(self) -> list[Mark]:
        raise NotImplementedError

    @property
    def facts(self) -> Facts:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"


def _final_and_best(names: Iterable[str], curve: Any
                    ) -> tuple[dict[str, float], dict[str, float]]:
    final, best = {}, {}
    for name in names:
        x, y = curve(name)
        keep = np.isfinite(y) & np.isfinite(x)
        if not keep.any():
            continue
        x, y = x[keep], y[keep]
        final[name] = float(y[int(np.argmax(x))])
        best[name] = float(y.max() if higher_is_better(name) else y.min())
    return final, best


class JobRun(Run):
    """A job from the store, replayed and (while it runs) followed."""

    source = "job"

    def __init__(self, handle: JobHandle, key: str, label: str,
                 max_buckets: int | None = None) -> None:
        from spotnb.widgets.series import DEFAULT_BUCKETS, DashboardData

        super().__init__(key, label, handle.job_id, handle.spec.name)
        self.handle = handle
        nodes = handle.spec.resources.max_nodes
        # One fold of every event, rows included: the job's facts, which the curves'
        # series read too (their markers).
        self.state = JobState(nodes)
        self.data: DashboardData = DashboardData(max_buckets=max_buckets or DEFAULT_BUCKETS,
                                                 log_lines=1, max_nodes=nodes,
                                                 state=self.state)
        self._follower: Follower | None = None
        self._reader: EventReader | None = None  # the log, read on from where it was
        self._log_read_at = -float("inf")
        self._result: dict[str, Any] | None = None
        self._ended = False
        self._facts: tuple[int, Facts] | None = None

    @property
    def live(self) -> bool:
        return not self._ended

    def replay(self, follow: bool = True) -> None:
        """Read the job's history (as a re-attach does); with ``follow`` and a job
        still running, stay registered for its live events (:meth:`poll`)."""
        from spotnb.protocol.events.live import Follower

        self._follower = Follower(self.handle.store, self.handle.job_id, live=follow,
                                  batches=True)
        self._reader = self._follower.reader
        self.poll(wait=0)
        if not follow and not self._ended:
            self._finish(read_result=False)

    def poll(self, wait: float = 1.0) -> bool:
        """Take the job's new events (waiting up to ``wait`` seconds for some); whether
        anything changed. The job's end closes the follower and reads its result."""
        follower = self._follower
        if follower is None or self._ended:
            return False
        batch = follower.poll(wait=wait)
        if follower.ended:
            batch += follower.poll(wait=0)  # the group's last events, as a re-attach
        elif self._instance_unknown() and \
                time.monotonic() - self._log_read_at >= UNKNOWN_INSTANCE_LOG_SECONDS:
            self._log_read_at = time.monotonic()
            batch += follower.read_log()
        with self.lock:
            self.add(batch)
            if follower.ended:
                self._finish(read_result=True)
                return True
        return bool(batch)

    def _instance_unknown(self) -> bool:
        """Whether an attempt booted on an instance whose launch the fold has not seen
        (the group's event is in the log, which a live follower reads once a minute):
        until it has, the cost leaves that instance out."""
        with self.lock:
            return any(a.instance_id is not None and a.instance_id not in
                       self.state.instances for a in self.state.attempts.values())

    def add(self, batch: list[Event]) -> None:
        """Events of the job, in the order a reader gives them."""
        if not batch:
            return
        self.data.add(batch)
        self.state.apply_all(batch)
        self.version += 1

    def read_log(self) -> bool:
        """Read what the job's log has that this run has not taken yet (the group's
        events: launches, ends, a sweep's own; an ended job's capacity group reports
        its instances' ends after its result), also after the job ended; whether
        anything came. The log is read on from where the run's reads left it."""
        follower = self._follower
        if follower is not None:
            batch = follower.read_log()
        else:
            if self._reader is None:
                self._reader = EventReader(self.handle.store, batches=True)
            batch = self._reader.poll()
        with self.lock:
            self.add(batch)
        return bool(batch)

    def _finish(self, read_result: bool) -> None:
        self._ended = True  # the reader stays: read_log reads on after the end
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.close()
        if read_result:
            self._result = self.handle.result_record()
        self.version += 1

    def close(self) -> None:
        """Stop following (idempotent); the run keeps what it read."""
        if not self._ended:
            self._finish(read_result=False)

    def metric_names(self) -> list[str]:
        with self.lock:
            return self.data.metric_names()

    def points(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            series = self.data.metrics.get(name)
            if series is None:
                return np.empty(0), np.empty(0)
            x, y, _t = series.points()
            return x, y

    @property
    def result(self) -> JobResult:
        """The job's summary as its events say (and ``result.json``, once it ended)."""
        from spotnb.client.results import summarize_state

        return summarize_state(self.handle.spec, self.state, self._result)

    @property
    def marks(self) -> list[Mark]:
        with self.lock:
            final = self._result is not None or self.state.final
            return [Mark(b.attempt, b.reason.value, b.step, b.time, b.redone)
                    for b in self.state.breaks(final=final)]

    @property
    def facts(self) -> Facts:
        with self.lock:
            return self._facts_now()

    def _facts_now(self) -> Facts:
        if self._facts is not None and self._facts[0] == self.version and self._ended:
            return self._facts[1]
        result = self.result
        names = self.metric_names()

        def full(name: str) -> tuple[np.ndarray, np.ndarray]:
            x, y, _t = self.data.metrics[name].points(full=True)
            return x, y

        final, best = _final_and_best(names, full)
        # Metrics only the fold saw (no step: not plotted) still have a final value.
        final = {**{k: float(v) for k, v in result.metrics.items()
                    if isinstance(v, (int, float)) and k not in final}, **final}
        final_state = self._result is not None or self.state.final
        pruned = self.state.pruned
        # The money as heard from the instances: it only grows while the job runs.
        billed, ondemand = self.state.cost_heard_usd()
        facts = Facts(
            status=result.status, params=dict(self.state.params), final=final, best=best,
            duration_s=result.duration, cost_usd=billed, ondemand_cost_usd=ondemand,
            savings_pct=savings_pct(billed, ondemand), interruptions=result.interruptions,
            redone_steps=self.state.redone_steps(),
            refunded_usd=self.state.refunded_usd(),
            refunded_instances=len(self.state.refunded()),
            pruned_at=None if pruned is None else pruned.step,
            reason=pruned.text if pruned is not None else
            (result.reason if final_state else ""))
        self._facts = (self.version, facts)
        return facts


class RecordRun(Run):
    """A job of a record: its stored curves, breaks and figures."""

    source = "record"

    def __init__(self, record: Record, job: Mapping[str, Any], key: str,
                 label: str) -> None:
        super().__init__(key, label, job.get("job_id"), str(job.get("name") or ""))
        self.record = record
        self.job = dict(job)
        self._curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, curve in (job.get("curves") or {}).items():
            steps = np.asarray(curve.get("step") or [], dtype=float)
            values = np.asarray([math.nan if v is None else v
                                 for v in curve.get("value") or []], dtype=float)
            n = min(len(steps), len(values))
            self._curves[str(name)] = (steps[:n], values[:n])

    def metric_names(self) -> list[str]:
        return list(self._curves)

    def points(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._curves.get(name, (np.empty(0), np.empty(0)))

    @property
    def marks(self) -> list[Mark]:
        out = []
        for b in self.job.get("breaks") or []:
            out.append(Mark(int(b.get("attempt") or 0), str(b.get("reason") or "ended"),
                            _float(b.get("step")), _epoch(b.get("time")),
                            None if b.get("redone") is None else int(b["redone"])))
        return out

    @property
    def facts(self) -> Facts:
        job = self.job
        final_metrics = {k: float(v) for k, v in (job.get("final_metrics") or {}).items()
                         if _float(v) is not None}
        final, best = _final_and_best(self._curves, self.points)
        params = {**self.record.parameters, **(job.get("params") or {})}
        return Facts(
            status=str(job.get("status") or "?"), params=params,
            final={**final_metrics, **final}, best=best,
            duration_s=_float(job.get("duration_s")), cost_usd=_float(job.get("cost_usd")),
            ondemand_cost_usd=_float(job.get("ondemand_cost_usd")),
            savings_pct=_float(job.get("savings_pct")),
            interruptions=int(job.get("interruptions") or 0),
            redone_steps=int(job.get("redone_steps") or 0),
            refunded_usd=_float(job.get("refunded_usd")) or 0.0,
            refunded_instances=int(job.get("refunded_instances") or 0),
            reason=str(job.get("reason") or ""))


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _epoch(value: Any) -> float | None:
    import datetime

    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _is_record_path(item: str) -> bool:
    return item.endswith(".ipynb") or ((os.sep in item or "/" in item) and Path(item).is_file())


def gather(items: Iterable[Any], store: str | None = None, follow: bool = True,
           max_buckets: int | None = None, taken: Iterable[str] = ()) -> list[Run]:
    """The runs of ``items``: job ids, names or ends of ids (found as ``%spot_attach``
    finds them, in ``store`` or the job index), :class:`~spotnb.client.jobs.JobHandle` objects,
    record paths (``.ipynb``) or :class:`~spotnb.records.library.Record` objects. Each
    job is replayed from its store (:meth:`JobRun.replay`); with ``follow``, a running
    one stays followed. Raises :class:`~spotnb.client.jobs.JobNotFound` or
    :class:`~spotnb.records.library.NotARecord` for what cannot be found. A run's key
    and label are unique among them and ``taken`` (the keys of runs shown already)."""
    from spotnb.client.jobs import JobHandle, attach

    runs: list[Run] = []
    used = set(taken)

    def unique(label: str) -> str:
        n, out = 1, label
        while out in used:
            n += 1
            out = f"{label} ({n})"
        used.add(out)
        return out

    pending: list[JobRun] = []
    try:
        for item in items:
            if isinstance(item, (str, os.PathLike)) and _is_record_path(os.fspath(item)):
                from spotnb.records.library import load_record

                item = load_record(item)
            # Records are imported only for a record (nbformat takes seconds to import):
            # an item cannot be one before.
            library = sys.modules.get("spotnb.records.library")
            if library is not None and isinstance(item, library.Record):
                jobs = item.jobs
                stem = item.path.name.removesuffix(".ipynb").removesuffix(".record")
                for job in jobs:
                    label = unique(stem if len(jobs) == 1 else f"{stem}: {job.get('name')}")
                    runs.append(RecordRun(item, job, label, label))
                continue
            handle = item if isinstance(item, JobHandle) else attach(str(item), store=store)
            label = unique(f"{handle.spec.name} {handle.job_id[-6:]}")
            run = JobRun(handle, label, label, max_buckets=max_buckets)
            pending.append(run)
            runs.append(run)
        for run in pending:
            run.replay(follow=follow)
    except BaseException:
        for run in pending:
            run.close()
        raise
    return runs


def follow_until_ended(runs: list[Run], on_change: Any = None, wait: float = 1.0,
                       stop: Any = None) -> None:
    """Poll the live runs of ``runs`` until every one has ended (or ``stop()`` says
    so), calling ``on_change()`` after each round in which something changed. Each
    round waits about ``wait`` seconds in all, shared between the live runs."""
    while True:
        live = [r for r in runs if isinstance(r, JobRun) and r.live]
        if not live or (stop is not None and stop()):
            return
        changed = False
        started = time.monotonic()
        for run in live:
            try:
                changed = run.poll(wait=wait / len(live)) or changed
            except Exception:  # a store out of reach now: try again next round
                log.warning("could not read the events of job %s", run.job_id,
                            exc_info=True)
        if changed and on_change is not None:
            on_change()
        if time.monotonic() - started < wait / 10:
            time.sleep(wait / 10)  # followers without a queue return at once
