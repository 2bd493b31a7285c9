"""A sweep: the cell run once per parameter set, each run a spot job with its own resume.

:func:`sweep` checks everything (:mod:`spotnb.sweep.space`, then the first trial's job
through :func:`spotnb.client.jobs.prepare`), saves the sweep in the store and returns a
:class:`Sweep` whose *driver* (a thread) runs it:

1. It asks the Optuna study for a trial, and submits the cell as a job with the
   trial's parameters among the cell's inputs (:func:`spotnb.client.jobs.submit`: a spot job
   like any other, with its own resume, and without its own notifications), while
   fewer than ``parallel`` trials run and the budget allows one more (below).
2. It follows every running trial as ``%spot_attach`` does (one
   :class:`~spotnb.client.comparison.JobRun` each: its curves, and its facts from the fold),
   reports each new value of the sweep's metric to the trial (``Trial.report``), and
   stops a trial's job at once when the study's pruner says so: the job's instance
   ends.
3. A trial is over when its job has ended and the fold says its instance is gone, so
   that at no time do more than ``parallel`` trials' instances run; the study is told
   how it ended (the metric's last value; pruned; failed).
4. At the end (every trial over, the budget spent, or :meth:`Sweep.stop`) it posts
   one summary notification (trials completed, pruned and failed; the best parameters
   and value; the cost and the saving), when given a webhook: the trials post none.

*The budget* covers the whole sweep: what every trial has cost, from each job's fold.
A trial is not started when the spend so far, what the running trials will cost yet
and its own cost (both judged by the mean cost of the trials over) would pass it; once
the spend reaches it, the running trials are stopped, as a job's own budget stops it.
Each trial's job also gets what is left as its own budget, so a sweep whose driver is
gone does not spend past it either.

*In the store* (``sweeps/<id>/`` beside ``jobs/``): ``sweep.json`` (the cell, the
space, the settings, written once), ``search.pkl`` (the study's sampler and pruner,
for a driver that takes over) and ``state.json`` (every trial: parameters, job id,
state, value; the driver's heartbeat). Only the driver writes ``state.json``, by
compare-and-swap, so a second driver never runs beside it: :func:`attach_sweep`
follows a sweep whose driver is alive, and takes over one whose heartbeat is older
than :data:`HEARTBEAT_STALE_SECONDS` (its kernel restarted): the running trials are
followed on, the trials not yet started are started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from spotnb.client.comparison import JobRun
from spotnb.protocol import layout
from spotnb.protocol.store import NotFound, Store, open_store
from spotnb.sweep.space import Space, import_optuna

__all__ = [
    "HEARTBEAT_SECONDS",
    "HEARTBEAT_STALE_SECONDS",
    "TRIAL_STATES",
    "Sweep",
    "SweepNotFound",
    "Trial",
    "TrialRun",
    "trial_label",
]

log = logging.getLogger(__name__)

# The driver rewrites state.json at least this often while trials run, as its heartbeat:
# 360 PUTs an hour, $0.0018/h on S3, once per sweep (not per trial).
HEARTBEAT_SECONDS = 10.0
# A heartbeat older than this: the driver is gone (its kernel restarted or closed).
HEARTBEAT_STALE_SECONDS = 45.0
# One round of the driver: the live trials' followers share this wait for events.
ROUND_SECONDS = 1.0
# After a trial's job ended, its capacity group reports the instance terminated: at
# once when the agent exits by itself, at the latest after the local cloud's stop
# grace (15 s). The next trial waits for that report this long, at most.
INSTANCE_END_GRACE_SECONDS = 30.0
# Sweep.stop waits this long for the running trials' jobs to end (a job's own stop
# waits up to 30 s for its agent, then deletes the group).
STOP_WAIT_SECONDS = 60.0

SWEEPS_PREFIX = "sweeps"
DEFINITION_KEY = "sweep.json"
STATE_KEY = "state.json"
SEARCH_KEY = "search.pkl"

#: A trial's states: waiting (not started), running, then one of the others.
TRIAL_STATES = ("waiting", "running", "completed", "pruned", "failed", "stopped",
                "skipped")


class SweepNotFound(LookupError):
    """No sweep matches what was asked for."""

    def __init__(self, query: str, where: str) -> None:
        self.query, self.where = query, where
        super().__init__(f"no sweep {query!r} in {where}: give a sweep's id (sweep-...) "
                         "or its name, as spotnb.sweeps() lists them")


@dataclasses.dataclass
class Trial:
    """One trial: its parameters, its job, how it stands."""

    number: int
    params: dict[str, Any]
    job_id: str | None = None
    state: str = "waiting"
    #: The sweep's metric at the trial's end (its last value), as the study was told.
    value: float | None = None
    #: The step at which it was pruned.
    pruned_at: int | None = None
    reason: str = ""

    @property
    def over(self) -> bool:
        return self.state not in ("waiting", "running")


class TrialRun(JobRun):
    """A trial's job in the comparison: its facts say ``pruned`` for a pruned trial
    and carry the trial's parameters."""

    source = "trial"

    def __init__(self, handle: Any, trial: Trial, label: str) -> None:
        super().__init__(handle, label, label)
        self.trial = trial

    @property
    def facts(self) -> Any:
        facts = super().facts
        status = "pruned" if self.trial.state == "pruned" else facts.status
        return dataclasses.replace(facts, status=status,
                                   params={**self.trial.params, **facts.params})


def trial_label(trial: Trial) -> str:
    params = ", ".join(f"{k}={v}" for k, v in trial.params.items())
    return f"t{trial.number} {params}".strip()


def new_sweep_id() -> str:
    return "sweep-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def store_root(store: str | os.PathLike[str] | None) -> Store:
    return open_store(os.fspath(store) if store is not None else layout.default_store_root())


class Sweep:
    """A sweep (module docstring): :attr:`trials`, :attr:`runs` (one
    :class:`TrialRun` per started trial), :meth:`wait`, :meth:`stop`, :meth:`best`;
    shown in a notebook as the comparison of its trials, followed live."""

    def __init__(self, root: Store, definition: dict[str, Any], trials: list[Trial],
                 search: dict[str, Any] | None = None) -> None:
        self.root = root
        self.definition = definition
        self.sweep_id: str = definition["sweep_id"]
        self.name: str = definition["name"]
        self.store = root.child(f"{SWEEPS_PREFIX}/{self.sweep_id}")
        self.trials = trials
        self.runs: dict[int, TrialRun] = {}
        self.status = "running"
        self.reason = ""
        self.ended_at: float | None = None
        self.summary_sent: bool | None = None
        self._search = search or {}
        self._study: Any = None
        self._optuna_trials: dict[int, Any] = {}
        self._reported: dict[int, int] = {}
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
    def direction(self) -> str:
        return str(self.definition["direction"])

    def counts(self) -> dict[str, int]:
        """How many trials are in each state."""
        with self._lock:
            out = dict.fromkeys(TRIAL_STATES, 0)
            for t in self.trials:
                out[t.state] += 1
            return out

    def cost(self) -> tuple[float, float]:
        """What the trials have cost so far, and the same instance time on-demand
        (each trial's from the fold of its job's events)."""
        spent = ondemand = 0.0
        for run in list(self.runs.values()):
            facts = run.facts
            spent += facts.cost_usd or 0.0
            ondemand += facts.ondemand_cost_usd or 0.0
        return spent, ondemand

    def best(self) -> Trial | None:
        """The completed trial with the best value of the metric (None: none yet)."""
        done = [t for t in self.trials if t.state == "completed" and t.value is not None]
        if not done:
            return None
        pick = max if self.direction == "maximize" else min
        return pick(done, key=lambda t: t.value)  # type: ignore[arg-type,return-value]

    def listen(self, callback: Callable[[str, Any], None]) -> None:
        """``callback(what, obj)`` on each change: ``("run", TrialRun)`` for a trial
        started (or found on attach), ``("change", None)`` after a round in which
        something changed, ``("end", None)`` once the sweep is over. Called from the
        driver's thread."""
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
        return self.status != "running"

    def __repr__(self) -> str:
        c = self.counts()
        parts = [f"{n} {s}" for s, n in c.items() if n]
        return f"<spotnb Sweep {self.sweep_id} {self.name!r}: {', '.join(parts)}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from spotnb.sweep.view import SweepView

        return SweepView(self)._repr_mimebundle_(**kwargs)

    # -- control ------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the sweep is over (or ``timeout``); whether it is."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.ended

    def stop(self, reason: str = "requested") -> None:
        """Stop the sweep: no trial is started any more, the running ones are stopped.
        (A sweep driven by another process is only no longer followed here.)"""
        # The reason first: the driver reads it once it sees the stop.
        self.reason = f"stop requested ({reason})"
        self._stop.set()
        self.wait(STOP_WAIT_SECONDS)

    # -- the driver ---------------------------------------------------------------------

    def start(self, drive: bool) -> None:
        """Run the driver (``drive``) or a follower of another process's driver."""
        self.driving = drive
        self._thread = threading.Thread(target=self._run, name=f"spotnb-{self.sweep_id}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self.driving:
                self._prepare_study()
            while True:
                # A follower's stop ends the following; the driver elsewhere goes on.
                if not self.driving and (self._stop.is_set() or self._watch()):
                    break
                changed = self._round()
                if self.driving and self._schedule():
                    changed = True
                if self.driving:
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
        elapsed = time.monotonic() - started
        if elapsed < ROUND_SECONDS / 4:
            self._stop.wait(ROUND_SECONDS / 4 - elapsed)
        return changed

    def _prepare_study(self) -> None:
        """The Optuna study: made new, or (taking over) rebuilt from the trials over."""
        optuna = import_optuna()
        space: Space = self._search["space"]
        pruner = self._search.get("pruner")
        if space.kind == "study" and self._search.get("study") is not None:
            self._study = self._search["study"]  # the user's own: its trials show there
        else:
            # Only enqueued trials run where the space is not a study's: the sampler
            # never samples then.
            sampler = (self._search.get("sampler") if space.kind == "study"
                       else optuna.samplers.RandomSampler(seed=0))
            # A study of our own is no news to the cell's output ("A new study created
            # in memory ..." at Optuna's INFO); the user's own logging is left as it is.
            verbosity = optuna.logging.get_verbosity()
            optuna.logging.set_verbosity(max(verbosity, optuna.logging.WARNING))
            try:
                self._study = optuna.create_study(
                    study_name=self.sweep_id, direction=self.direction, sampler=sampler,
                    pruner=pruner or optuna.pruners.NopPruner())
            finally:
                optuna.logging.set_verbosity(verbosity)
        distributions = space.fixed_distributions()
        for trial in self.trials:
            if trial.over and trial.state != "skipped":
                self._add_frozen(trial, distributions)
        if space.kind != "study":
            for trial in self.trials:
                if trial.state == "waiting":
                    self._study.enqueue_trial(trial.params)

    def _add_frozen(self, trial: Trial, distributions: dict[str, Any]) -> None:
        """A trial that ended before this driver, told to its study (pruners compare
        with them)."""
        optuna = import_optuna()
        TrialState = optuna.trial.TrialState
        state = {"completed": TrialState.COMPLETE, "pruned": TrialState.PRUNED}.get(
            trial.state, TrialState.FAIL)
        if state == TrialState.COMPLETE and trial.value is None:
            state = TrialState.FAIL
        run = self.runs.get(trial.number)
        steps = self._curve(run) if run is not None else []
        with contextlib.suppress(ValueError):
            self._study.add_trial(optuna.trial.create_trial(
                params=trial.params,
                distributions={k: distributions[k] for k in trial.params
                               if k in distributions},
                value=trial.value if state == TrialState.COMPLETE else None,
                state=state, intermediate_values=dict(steps)))

    def _curve(self, run: JobRun) -> list[tuple[int, float]]:
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
        spent, _ondemand = self.cost()
        budget = self.budget_usd
        if self._stop.is_set() or (budget is not None and spent >= budget):
            why = self.reason or f"the sweep's budget of ${budget:g} is spent"
            self.reason = why
            for trial in self._running():
                changed = self._stop_trial(trial, why) or changed
            for trial in self.trials:
                if trial.state == "waiting":
                    trial.state, trial.reason = "skipped", why
                    changed = True
            return changed
        while self._occupied() < self.parallel:
            waiting = [t for t in self.trials if t.state == "waiting"]
            space: Space = self._search["space"]
            if not waiting and (space.kind != "study" or len(self.trials) >= space.n_trials):
                break
            if budget is not None:
                costs = {t.number: self.runs[t.number].facts.cost_usd or 0.0
                         for t in self.trials if t.number in self.runs}
                over = [costs[t.number] for t in self.trials
                        if t.number in self._over_at]
                estimate = sum(over) / len(over) if over else 0.0
                # The trials still running will cost about as much as those over did.
                to_come = sum(max(estimate - costs[t.number], 0.0) for t in self.trials
                              if t.number in costs and t.number not in self._over_at)
                if spent + to_come + estimate > budget:
                    why = (f"the next trial would pass the sweep's budget of ${budget:g} "
                           f"(spent ${spent:.4f}, a trial costs ${estimate:.4f})")
                    self.reason = why
                    for trial in self.trials:
                        if trial.state == "waiting":
                            trial.state, trial.reason = "skipped", why
                    if space.kind == "study":
                        self._stop.set()  # no more trials are asked for
                    return True
            self._start_trial(waiting[0] if waiting else None, spent)
            changed = True
        return changed

    def _start_trial(self, trial: Trial | None, spent: float) -> None:
        """Ask the study for the trial (with ``trial``'s parameters, enqueued for a
        grid or a list), submit its job, and follow it."""
        from spotnb.client.jobs import submit

        space: Space = self._search["space"]
        asked = self._study.ask(space.fixed_distributions())
        if trial is None:
            trial = Trial(len(self.trials), dict(asked.params))
            self.trials.append(trial)
        options = dict(self._search.get("submit") or {})
        budget = self.budget_usd
        if budget is not None:
            options["budget_usd"] = max(budget - spent, 1e-6)
        inputs = {**(self._search.get("inputs") or {}), **trial.params}
        try:
            handle = submit(self.definition["code"], inputs=inputs,
                            files=self._search.get("files"),
                            name=f"{self.name}-t{trial.number}", **options)
        except Exception as err:  # capacity, a store out of reach: this trial fails
            log.warning("trial %d of sweep %s could not start: %s", trial.number,
                        self.sweep_id, err)
            trial.state, trial.reason = "failed", f"could not start: {err}"
            self._study.tell(asked, state=import_optuna().trial.TrialState.FAIL)
            return
        trial.job_id, trial.state = handle.job_id, "running"
        self._optuna_trials[trial.number] = asked
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
            asked = self._optuna_trials.get(trial.number)
            run = self.runs.get(trial.number)
            if asked is None or run is None or trial.number in self._stopping:
                continue
            last = self._reported.get(trial.number, -1)
            new = [(s, v) for s, v in self._curve(run) if s > last]
            if not new:
                continue
            for step, value in new:
                asked.report(value, step)
            self._reported[trial.number] = new[-1][0]
            if run.live and asked.should_prune():
                step = new[-1][0]
                trial.pruned_at = step
                self._stop_trial(trial, f"pruned at step {step} ({self.metric} "
                                        f"{new[-1][1]:.4g})", pruned=True)
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
            threading.Thread(target=_stop_job, args=(run.handle, why), daemon=True,
                             name=f"spotnb-stop-{trial.job_id}").start()
        return True

    def _close_over(self) -> bool:
        """Trials whose job ended and whose instance is gone: over, told to the study."""
        changed = False
        optuna = import_optuna()
        TrialState = optuna.trial.TrialState
        for trial in [t for t in self.trials if t.state in ("running", "pruned")
                      and t.number in self.runs and t.number not in self._over_at]:
            run = self.runs[trial.number]
            if run.live:
                continue
            if not self._instance_gone(run):
                continue
            self._over_at[trial.number] = time.time()
            facts = run.facts
            asked = self._optuna_trials.pop(trial.number, None)
            if trial.state == "pruned":
                if asked is not None:
                    self._study.tell(asked, state=TrialState.PRUNED)
            elif facts.status == "completed":
                trial.state = "completed"
                trial.value = facts.final.get(self.metric)
                if asked is not None:
                    if trial.value is None:
                        self._study.tell(asked, state=TrialState.FAIL)
                    else:
                        self._study.tell(asked, trial.value)
                elif self._study is not None:
                    self._add_frozen(trial, self._search["space"].fixed_distributions())
            else:
                trial.state = "stopped" if facts.status == "stopped" else "failed"
                trial.reason = trial.reason or run.result.reason
                if asked is not None:
                    self._study.tell(asked, state=TrialState.FAIL)
            changed = True
        return changed

    def _instance_gone(self, run: TrialRun) -> bool:
        """Whether the trial's job has no instance left (its log read on from where
        the run left it, into the run's one fold), or its group had the grace to
        report one gone."""
        ended_at = self._ended_seen.setdefault(run.trial.number, time.monotonic())
        run.read_log()
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
        spent, ondemand = self.cost()
        best = self.best()
        return {"version": 1, "status": self.status, "reason": self.reason,
                "ended_at": self.ended_at, "heartbeat": time.time(),
                "driver": f"{socket.gethostname()}:{os.getpid()}",
                "cost_usd": spent, "ondemand_cost_usd": ondemand,
                "best": None if best is None else dataclasses.asdict(best),
                "summary_sent": self.summary_sent,
                "trials": [dataclasses.asdict(t) for t in self.trials]}

    def _save(self, force: bool = False) -> None:
        """Write ``state.json`` (by compare-and-swap: another driver that took over
        makes this one a follower)."""
        if not force and time.monotonic() - self._beat < HEARTBEAT_SECONDS:
            return
        self._beat = time.monotonic()
        data = json.dumps(self.state_dict()).encode()
        if self._etag is None:
            self._etag = self.store.put_if_absent(STATE_KEY, data)
            if self._etag is None:
                raise RuntimeError(f"sweep {self.sweep_id} already has a driver")
            return
        etag = self.store.put_if_match(STATE_KEY, data, self._etag)
        if etag is None:
            log.warning("another process took over sweep %s; following it", self.sweep_id)
            self.driving = False
            return
        self._etag = etag

    def _watch(self) -> bool:
        """As a follower: take the driver's new trials; take over from a driver gone
        quiet. Whether the sweep is over. (One GET a round: on S3, $0.0014 an hour.)"""
        try:
            data, etag = self.store.get_with_etag(STATE_KEY)
        except NotFound:
            return False
        state = json.loads(data)
        with self._lock:
            for number, raw in enumerate(state["trials"]):
                trial = Trial(**raw)
                if number < len(self.trials):
                    self.trials[number].__dict__.update(dataclasses.asdict(trial))
                else:
                    self.trials.append(trial)
        for trial in self.trials:
            if trial.job_id and trial.number not in self.runs:
                from spotnb.client.jobs import attach

                self._follow_trial(trial, attach(trial.job_id))
        self.status, self.reason = state["status"], state.get("reason", "")
        self.ended_at = state.get("ended_at")
        self.summary_sent = state.get("summary_sent")
        if self.status != "running":
            return not any(run.live for run in self.runs.values())
        if time.time() - float(state.get("heartbeat") or 0) > HEARTBEAT_STALE_SECONDS:
            log.info("sweep %s: its driver is gone; this process drives it", self.sweep_id)
            self._etag = etag
            self.driving = True
            self._take_over()
        return False

    def _take_over(self) -> None:
        """The study rebuilt from the trials over; those the old driver left running are
        followed to their end (without pruning: their Optuna trials were the old
        driver's) and told to the study then."""
        self._prepare_study()


def _stop_job(handle: Any, why: str) -> None:
    try:
        handle.stop(reason=why)
    except Exception:
        log.warning("could not stop job %s", handle.job_id, exc_info=True)
