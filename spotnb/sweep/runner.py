"""A sweep's driver: the cell run once per parameter set, each run a spot job with its
own resume.

:func:`spotnb.sweep.sweep` checks everything, saves the sweep in the store
(:mod:`spotnb.sweep.state`) and returns a :class:`Sweep` whose *driver* (a thread) runs
it:

1. It asks the Optuna study for a trial, and submits the cell as a job with the
   trial's parameters among the cell's inputs (:func:`spotnb.client.jobs.submit`: a spot
   job like any other, with its own resume, and without its own notifications), while
   fewer than ``parallel`` trials run and the budget allows one more
   (:mod:`spotnb.sweep.budget`). The trial's parameters go into the job's log as a
   ``params`` event, so every view of the job (comparison, records) shows them.
2. It follows every running trial as ``%spot_attach`` does (one
   :class:`~spotnb.client.comparison.JobRun` each: its curves, and its facts from the
   fold), reports each new value of the sweep's metric to the trial (``Trial.report``),
   and when the study's pruner says so writes a ``pruned`` event into the job's log
   (the step and the metric's value: the job then reads ``pruned`` everywhere) and
   stops the job: its instance ends at once.
3. A trial is over when its job has ended and the fold says its instance is gone, so
   that at no time do more than ``parallel`` trials' instances run; the study is told
   how it ended (the metric's last value, the objective; pruned; failed). A trial
   that ended having logged rows but never the metric stops the sweep
   (:mod:`spotnb.sweep.metric`).
4. At the end (every trial over, the budget spent, a stop: :meth:`Sweep.stop`, or a
   stop request in the store) it posts one summary notification (trials completed,
   pruned and failed; the best parameters and objective; the cost, the refunds and the
   saving), when given a webhook: the trials post none.

Only the driver writes the sweep's ``state.json``, by compare-and-swap, so a second
driver never runs beside it: :func:`spotnb.sweep.attach_sweep` follows a sweep whose
driver is alive; one whose driver is gone (its heartbeat stale: *abandoned*) is
followed as it is, and driven on only when asked (``resume``): the running trials are
then followed on, the trials not yet started are started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from spotnb.protocol.store import Store
from spotnb.sweep.budget import Budget, SweepCost
from spotnb.sweep.metric import trials_without
from spotnb.sweep.space import Space
from spotnb.sweep.state import (
    HEARTBEAT_SECONDS,
    TRIAL_STATES,
    Trial,
    liveness,
    put_state,
    read_state,
    stop_request,
    sweep_prefix,
    trial_label,
)
from spotnb.sweep.study import Curve, SweepStudy
from spotnb.sweep.trials import STOP_WAIT_SECONDS, TrialRun, stop_in_store, stop_job, tell_job

__all__ = ["Sweep"]

log = logging.getLogger(__name__)

# One round of the driver: the live trials' followers share this wait for events; a
# stop request in the store is read once a round (3,600 GETs an hour on S3, $0.0014/h).
ROUND_SECONDS = 1.0
# After a trial's job ended, its capacity group reports the instance terminated: at
# once when the agent exits by itself, at the latest after the local cloud's stop
# grace (15 s). The next trial waits for that report this long, at most.
INSTANCE_END_GRACE_SECONDS = 30.0


class Sweep:
    """A sweep (module docstring): :attr:`trials`, :attr:`runs` (one
    :class:`TrialRun` per started trial), :meth:`wait`, :meth:`stop`, :meth:`best`;
    shown in a notebook as its analysis and the comparison of its trials
    (:class:`spotnb.widgets.sweep.SweepView`), followed live."""

    def __init__(self, root: Store, definition: dict[str, Any], trials: list[Trial],
                 search: dict[str, Any] | None = None) -> None:
        self.root = root
        self.definition = definition
        self.sweep_id: str = definition["sweep_id"]
        self.name: str = definition["name"]
        self.store = sweep_prefix(root, self.sweep_id)
        self.trials = trials
        self.runs: dict[int, TrialRun] = {}
        #: running, completed, stopped, failed; abandoned (read from a store whose
        #: driver is gone: :func:`spotnb.sweep.state.liveness`).
        self.status = "running"
        self.reason = ""
        #: A word on the sweep while it runs (a trial logs no --metric yet).
        self.warning = ""
        self.ended_at: float | None = None
        self.summary_sent: bool | None = None
        self._search = search or {}
        self._study = SweepStudy(self._search, self.sweep_id, self.direction, self._curve)
        self._stopping: set[int] = set()
        self._over_at: dict[int, float] = {}
        self._ended_seen: dict[int, float] = {}  # trial -> when its job's end was seen
        self._etag: str | None = None
        self._beat = 0.0
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._listeners: list[Callable[[str, Any], None]] = []
        self.driving = False
        self.may_take_over = False
        self.driver_error: BaseException | None = None

    # -- what it holds ----------------------------------------------------------------

    @property
    def metric(self) -> str:
        return str(self.definition["metric"])

    @property
    def parallel(self) -> int:
        return int(self.definition["parallel"])

    @property
    def budget_usd(self) -> float | None:
        value = self.definition.get("budget_usd")
        return None if value is None else float(value)

    @property
    def budget(self) -> Budget:
        return Budget(self.budget_usd)

    @property
    def direction(self) -> str:
        return str(self.definition["direction"])

    def counts(self) -> dict[str, int]:
        """How many trials are in each state."""
        with self._lock:
            out = dict.fromkeys(TRIAL_STATES, 0)
            for t in self.trials:
                out[t.state] = out.get(t.state, 0) + 1
            return out

    def cost(self) -> SweepCost:
        """What the trials have cost so far, each from its job's fold: billed, refunded
        and the same instance time on-demand."""
        return SweepCost.of([run.facts for run in list(self.runs.values())])

    def best(self) -> Trial | None:
        """The completed trial with the best objective (None: none yet)."""
        done = [t for t in self.trials if t.state == "completed" and t.value is not None]
        if not done:
            return None
        pick = max if self.direction == "maximize" else min
        return pick(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]

    def listen(self, callback: Callable[[str, Any], None]) -> None:
        """``callback(what, obj)`` on each change: ``("run", TrialRun)`` for a trial
        started (or found on attach), ``("change", None)`` after a round in which
        something changed, ``("end", None)`` once the sweep is over (or no longer
        followed here). Called from the driver's thread."""
        with self._lock:
            self._listeners.append(callback)
            runs = list(self.runs.values())
        for run in runs:
            callback("run", run)

    def _tell(self, what: str, obj: Any = None) -> None:
        for callback in list(self._listeners):
            try:
                callback(what, obj)
            except Exception:
                log.exception("a sweep listener failed")

    @property
    def ended(self) -> bool:
        """Whether it is over (abandoned counts as not over: it can be resumed)."""
        return self.status not in ("running", "abandoned")

    @property
    def abandoned(self) -> bool:
        return self.status == "abandoned"

    def __repr__(self) -> str:
        c = self.counts()
        parts = [f"{n} {s}" for s, n in c.items() if n]
        return f"<spotnb Sweep {self.sweep_id} {self.name!r}: {', '.join(parts)}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from spotnb.widgets.sweep import SweepView

        return SweepView(self)._repr_mimebundle_(**kwargs)

    # -- control ------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the sweep is over, or no longer followed here (or ``timeout``);
        whether the thread is done."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stop(self, reason: str = "requested") -> None:
        """End the sweep for good, wherever its driver runs: no trial is started any
        more, the running ones are stopped, and the store says ``stopped`` (a later
        attach starts nothing)."""
        self.reason = f"stop requested ({reason})"  # first: the driver reads it
        if self.driving:
            self._stop.set()
        else:
            stop_in_store(self.store, reason)
            self._stop.set()  # this follower ends too
        self.wait(STOP_WAIT_SECONDS)

    def detach(self) -> None:
        """No longer follow the sweep here (a sweep driven here goes on being driven)."""
        if not self.driving:
            self._stop.set()

    # -- the driver ---------------------------------------------------------------------

    def start(self, drive: bool, take_over: bool = False) -> None:
        """Run the driver (``drive``), or a follower of another process's driver that
        drives on where that one is gone only with ``take_over``."""
        self.driving = drive
        self.may_take_over = take_over
        self._thread = threading.Thread(target=self._run, name=f"spotnb-{self.sweep_id}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.driving:
                self._study.prepare(self.trials)
            while True:
                # A follower's stop ends the following; the driver elsewhere goes on.
                if not self.driving and (self._stop.is_set() or self._watch()):
                    break
                changed = self._round()
                if self.driving:
                    self._take_stop_request()
                    changed = self._schedule() or changed
                    self._save(force=changed)
                if changed:
                    self._tell("change")
                if self.driving and self._finished():
                    self._end()
                    break
        except BaseException as err:  # a bug, or the store out of reach for good
            log.exception("sweep %s stopped", self.sweep_id)
            self.driver_error = err
            self.status, self.reason = "failed", f"the driver failed: {err}"
            with contextlib.suppress(Exception):
                self._save(force=True)
        finally:
            for run in list(self.runs.values()):
                run.close()
            self._tell("end")

    def _round(self) -> bool:
        """Follow the running trials for about :data:`ROUND_SECONDS`; whether anything
        changed."""
        live = [run for run in self.runs.values() if run.live]
        changed = False
        started = time.monotonic()
        for run in live:
            try:
                changed = run.poll(wait=ROUND_SECONDS / len(live)) or changed
            except Exception:  # a store out of reach now: try again next round
                log.warning("could not read the events of job %s", run.job_id,
                            exc_info=True)
        if self.driving:
            changed = self._prune() or changed
            changed = self._close_over() or changed
            changed = self._check_metric() or changed
        elapsed = time.monotonic() - started
        if elapsed < ROUND_SECONDS / 4:
            self._stop.wait(ROUND_SECONDS / 4 - elapsed)
        return changed

    def _take_stop_request(self) -> None:
        """A stop asked for through the store (another process): the sweep ends."""
        if self._stop.is_set():
            return
        try:
            request = stop_request(self.store)
        except Exception:  # the store out of reach now: read it next round
            log.debug("could not read the stop request of sweep %s", self.sweep_id,
                      exc_info=True)
            return
        if request is not None:
            self.reason = f"stop requested ({request.get('reason') or 'requested'})"
            self._stop.set()

    def _curve(self, trial: Trial) -> Curve:
        """The trial's values of the sweep's metric, from its job's curve."""
        run = self.runs.get(trial.number)
        if run is None:
            return []
        with run.lock:
            series = run.data.metrics.get(self.metric)
            if series is None:
                return []
            x, y, _t = series.points(full=True)
        return [(int(s), float(v)) for s, v in zip(x, y, strict=True)
                if math.isfinite(s) and math.isfinite(v)]

    def _running(self) -> list[Trial]:
        return [t for t in self.trials if t.state == "running"]

    def _occupied(self) -> int:
        """Trials whose instance may still run: started, and not yet over (a pruned
        trial's until its instance is gone)."""
        return sum(1 for t in self.trials
                   if t.number in self.runs and t.number not in self._over_at)

    def _schedule(self) -> bool:
        """Start trials while fewer than ``parallel`` run and the budget allows; stop
        everything when the budget is spent or a stop was asked for."""
        changed = False
        spent = self.cost().billed_usd
        budget = self.budget
        if self._stop.is_set() or budget.spent_out(spent):
            self.reason = self.reason or budget.spent_text()
            for trial in self._running():
                changed = self._stop_trial(trial, self.reason) or changed
            return self._skip_waiting(self.reason) or changed
        while self._occupied() < self.parallel:
            waiting = [t for t in self.trials if t.state == "waiting"]
            space: Space = self._search["space"]
            if not waiting and (space.kind != "study" or len(self.trials) >= space.n_trials):
                break
            costs = {t.number: self.runs[t.number].facts.cost_usd or 0.0
                     for t in self.trials if t.number in self.runs}
            why = budget.room_for_next(spent, costs, set(self._over_at))
            if why is not None:
                self.reason = why
                if space.kind == "study":
                    self._stop.set()  # no more trials are asked for
                return self._skip_waiting(why) or True
            self._start_trial(waiting[0] if waiting else None, spent)
            changed = True
        return changed

    def _skip_waiting(self, why: str) -> bool:
        changed = False
        for trial in self.trials:
            if trial.state == "waiting":
                trial.state, trial.reason = "skipped", why
                changed = True
        return changed

    def _start_trial(self, trial: Trial | None, spent: float) -> None:
        """Ask the study for the trial (with ``trial``'s parameters, enqueued for a
        grid or a list), submit its job, and follow it."""
        from spotnb.client.jobs import submit

        asked = self._study.ask()
        if trial is None:
            trial = Trial(len(self.trials), dict(asked.params))
            self.trials.append(trial)
        options = dict(self._search.get("submit") or {})
        left = self.budget.left(spent)
        if left is not None:
            options["budget_usd"] = left
        inputs = {**(self._search.get("inputs") or {}), **trial.params}
        try:
            handle = submit(self.definition["code"], inputs=inputs,
                            files=self._search.get("files"),
                            name=f"{self.name}-t{trial.number}", **options)
        except Exception as err:  # capacity, a store out of reach: this trial fails
            log.warning("trial %d of sweep %s could not start: %s", trial.number,
                        self.sweep_id, err)
            trial.state, trial.reason = "failed", f"could not start: {err}"
            self._study.failed_to_start(asked)
            return
        trial.job_id, trial.state = handle.job_id, "running"
        self._study.started(trial.number, asked)
        try:  # the job's own facts name its parameters (comparisons, records)
            tell_job(handle, "params", params=dict(trial.params), source="sweep")
        except Exception:
            log.warning("could not write the parameters of trial %d into job %s",
                        trial.number, handle.job_id, exc_info=True)
        self._follow_trial(trial, handle)

    def _follow_trial(self, trial: Trial, handle: Any) -> TrialRun:
        run = TrialRun(handle, trial, trial_label(trial))
        run.replay(follow=True)
        with self._lock:
            self.runs[trial.number] = run
        self._tell("run", run)
        return run

    def _prune(self) -> bool:
        """Report each running trial's new values of the metric; stop those the
        pruner prunes."""
        changed = False
        for trial in self._running():
            run = self.runs.get(trial.number)
            if run is None or trial.number in self._stopping:
                continue
            prune = self._study.report(trial)
            if prune is not None and run.live:
                step, value = prune
                trial.pruned_at = step
                try:  # the job's own fact first: it then reads pruned everywhere
                    tell_job(run.handle, "pruned", step=step, metric=self.metric,
                              value=value, sweep=self.sweep_id, trial=trial.number)
                    run.read_log()
                except Exception:
                    log.warning("could not write the pruning of job %s", run.job_id,
                                exc_info=True)
                self._stop_trial(trial, f"pruned at step {step} ({self.metric} "
                                        f"{value:.4g})", pruned=True)
                changed = True
        return changed

    def _stop_trial(self, trial: Trial, why: str, pruned: bool = False) -> bool:
        """Stop a trial's job now (its instance ends), in a thread of its own: a stop
        waits for the agent to wind down."""
        if trial.number in self._stopping:
            return False
        self._stopping.add(trial.number)
        trial.reason = why
        if pruned:
            trial.state = "pruned"  # shown at once; the job's end follows
        run = self.runs.get(trial.number)
        if run is not None:
            threading.Thread(target=stop_job, args=(run.handle, why), daemon=True,
                             name=f"spotnb-stop-{trial.job_id}").start()
        return True

    def _close_over(self) -> bool:
        """Trials whose job ended and whose instance is gone: over, told to the study."""
        changed = False
        for trial in [t for t in self.trials if t.state in ("running", "pruned")
                      and t.number in self.runs and t.number not in self._over_at]:
            run = self.runs[trial.number]
            if run.live or not self._instance_gone(run):
                continue
            self._over_at[trial.number] = time.time()
            facts = run.facts
            if trial.state == "pruned" or facts.status == "pruned":
                trial.state = "pruned"
            elif facts.status == "completed":
                trial.state = "completed"
                trial.value = facts.final.get(self.metric)
            else:
                trial.state = "stopped" if facts.status == "stopped" else "failed"
                trial.reason = trial.reason or facts.reason
            self._study.ended(trial)
            changed = True
        return changed

    def _check_metric(self) -> bool:
        """A trial that ended having logged rows but never the sweep's metric stops the
        sweep (every trial would end so: none could be judged); one still running that
        logged rows without it yet is a warning (:mod:`spotnb.sweep.metric`)."""
        if self._stop.is_set():
            return False
        logged = [(t.number, self.runs[t.number].metric_names()
                   + list(self.runs[t.number].facts.final),
                   t.number in self._over_at and t.state in ("completed", "failed"))
                  for t in self.trials if t.number in self.runs]
        stop, warning = trials_without(self.metric, logged)
        if stop:
            self.reason = stop
            self._stop.set()
            return True
        changed = warning != self.warning
        self.warning = warning
        return changed

    def _instance_gone(self, run: TrialRun) -> bool:
        """Whether the trial's job has no instance left (read from its log now), or
        its group had the grace to report one gone."""
        ended_at = self._ended_seen.setdefault(run.trial.number, time.monotonic())
        run.read_log()  # the group's last events: its instances' ends
        if not run.state.running_instances():
            return True
        return time.monotonic() - ended_at > INSTANCE_END_GRACE_SECONDS

    def _finished(self) -> bool:
        space: Space = self._search["space"]
        if any(not t.over for t in self.trials):
            return False
        if any(t.number not in self._over_at and t.number in self.runs
               for t in self.trials):
            return False
        if space.kind == "study" and not self._stop.is_set():
            return len(self.trials) >= space.n_trials
        return True

    def _end(self) -> None:
        c = self.counts()
        self.status = "stopped" if (self._stop.is_set() or c["skipped"]) else "completed"
        if self.status == "completed":
            self.reason = "every trial is over"
        self.warning = ""
        self.ended_at = time.time()
        self._save(force=True)
        url = self._search.get("notify_url")
        if url:
            from spotnb.protocol.notify import post
            from spotnb.sweep.view import summary_text

            self.summary_sent = post(url, summary_text(self, markdown=True))
        with contextlib.suppress(Exception):
            self._save(force=True)

    # -- the store ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        cost = self.cost()
        best = self.best()
        return {"version": 1, "status": self.status, "reason": self.reason,
                "warning": self.warning, "ended_at": self.ended_at,
                "heartbeat": time.time(),
                "driver": f"{socket.gethostname()}:{os.getpid()}",
                "cost_usd": cost.cost_usd, "billed_usd": cost.billed_usd,
                "refunded_usd": cost.refunded_usd,
                "refunded_instances": cost.refunded_instances,
                "ondemand_cost_usd": cost.ondemand_usd,
                "best": None if best is None else dataclasses.asdict(best),
                "summary_sent": self.summary_sent,
                "trials": [dataclasses.asdict(t) for t in self.trials]}

    def _save(self, force: bool = False) -> None:
        """Write ``state.json`` (by compare-and-swap: another driver that took over
        makes this one a follower)."""
        if not force and time.monotonic() - self._beat < HEARTBEAT_SECONDS:
            return
        self._beat = time.monotonic()
        etag = put_state(self.store, self.state_dict(), self._etag)
        if etag is None and self._etag is None:
            raise RuntimeError(f"sweep {self.sweep_id} already has a driver")
        if etag is None:
            log.warning("another process took over sweep %s; following it", self.sweep_id)
            self.driving = False
            return
        self._etag = etag

    def _watch(self) -> bool:
        """As a follower: take the driver's new trials; take over from a driver gone
        quiet when allowed. Whether the following is over. (One GET a round: on S3,
        $0.0014 an hour.)"""
        found = read_state(self.store)
        if found is None:
            return False
        state, etag = found
        with self._lock:
            for number, raw in enumerate(state["trials"]):
                trial = Trial.from_dict(raw)
                if number < len(self.trials):
                    self.trials[number].__dict__.update(dataclasses.asdict(trial))
                else:
                    self.trials.append(trial)
        for trial in self.trials:
            if trial.job_id and trial.number not in self.runs:
                from spotnb.client.jobs import attach

                self._follow_trial(trial, attach(trial.job_id))
        self.status, self.reason = liveness(state), state.get("reason", "")
        self.warning = state.get("warning", "")
        self.ended_at = state.get("ended_at")
        self.summary_sent = state.get("summary_sent")
        live = any(run.live for run in self.runs.values())
        if self.ended:
            return not live
        if self.abandoned:
            if not self.may_take_over:
                return not live  # shown as it stands; its trials followed to their end
            log.info("sweep %s: its driver is gone; this process drives it", self.sweep_id)
            self._etag = etag
            self.status = "running"
            self.driving = True
            self._study.prepare(self.trials)
        return False


