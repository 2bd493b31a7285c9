"""The Python API: submit a job, follow it, wait for its result. No IPython needed.

The magics call these functions; so can scripts and tests::

    handle = spotnb.submit(code, instance_types=["g5.xlarge"], outputs=["model"])
    for event in handle.events():   # follows until the job ends
        ...
    result = handle.wait()          # JobResult: status, outputs, attempts, cost

Everything is read back from the job's store prefix, so :func:`attach` in another
process (after a kernel restart) sees exactly what the submitting process saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import cloudpickle

from spotnb.client.jobindex import JobNotFound, JobRef, find_job, index_job, open_job
from spotnb.client.results import (
    Attempt,
    JobInfo,
    JobResult,
    instances_label,
    job_outcome,
    nodes_label,
    summarize,
    summarize_state,
)
from spotnb.client.validation import DEFAULT_INSTANCE_TYPES, prepare_job
from spotnb.protocol import layout
from spotnb.protocol.events import (
    Event,
    EventReader,
    log_state,
    metric_rows,
)
from spotnb.protocol.events.fold import JobState, JobStatus, fold
from spotnb.protocol.events.live import CONTROL_QUEUE, Follower, request_stop
from spotnb.protocol.events.queues import queue_for
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import NotFound, Store, open_store
from spotnb.providers import Provider, get_provider

__all__ = [
    "Attempt",
    "JobHandle",
    "JobInfo",
    "JobNotFound",
    "JobRef",
    "JobResult",
    "attach",
    "find_job",
    "jobs",
    "prepare",
    "submit",
    "summarize",
    "summarize_state",
]

log = logging.getLogger(__name__)

# How long a stop waits for the agent to wind down before the group is deleted.
STOP_GRACE_SECONDS = 30.0
# A result file without the agent's closing events: the agent died in between.
RESULT_WITHOUT_EVENTS_GRACE = 5.0
# After the job's result, its capacity group reports the last instance terminated: at
# once when the agent exits by itself, at the latest after the local cloud's stop grace
# (15 s) for one that does not. A followed log waits this long for that report.
GROUP_END_GRACE_SECONDS = 30.0
POLL_SECONDS = 0.25
# How often a process following a job checks that its capacity group is supervised.
SUPERVISION_CHECK_SECONDS = 10.0
# A follower waits this long for live events per poll (an SQS long poll each time).
FOLLOW_WAIT_SECONDS = 1.0
# While following, result.json is looked up this often (an S3 HEAD; the result event
# normally comes first, live: this is for an agent that died right after writing it);
# wait() looks every POLL_SECONDS at first, then less often.
RESULT_CHECK_SECONDS = 60.0
WAIT_MAX_SECONDS = 10.0


# -- submitting ----------------------------------------------------------------------

def submit(
    code: str,
    *,
    provider: str = "local",
    instance_types: Sequence[str] | str = DEFAULT_INSTANCE_TYPES,
    region: str | Sequence[str] = "us-east-1",
    max_price: float | None = None,
    name: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    outputs: Sequence[str] | str | None = None,
    checkpoint_every: float | str = "5m",
    max_restarts_on_error: int = 0,
    budget_usd: float | None = None,
    max_duration: float | str | None = None,
    keep_checkpoints: int = 3,
    simulate_interruptions: int | Sequence[float | str] | None = None,
    simulate_signals: Mapping[str, Any] | None = None,
    env: Mapping[str, str | None] | Sequence[str] | None = None,
    files: Mapping[str, str | os.PathLike[str]] | None = None,
    store: str | os.PathLike[str] | None = None,
    notify_url: str | None = None,
    nodes: int | str | tuple[int, int] = 1,
    procs_per_node: int = 1,
    peer_timeout: float | str = "2m",
    secrets: Mapping[str, str | None] | Sequence[str] | None = None,
    standby: bool = True,
    standby_first_hour: bool = False,
    allowed_regions: Sequence[str] | str | None = None,
) -> JobHandle:
    """Run ``code`` on a spot instance; return at once with a :class:`JobHandle`.

    Everything is checked before anything starts; bad input raises
    :class:`~spotnb.protocol.spec.SpecError` with the fix (its ``field`` names the argument).
    ``inputs`` maps names to values that are defined in the remote namespace before the
    code runs; ``outputs`` names variables whose values :meth:`JobHandle.wait` brings
    back. ``checkpoint_every`` is a time (``"5m"``) or a step count (``"500 steps"``)
    for ``Checkpoint.maybe_save``. ``simulate_interruptions`` (local cloud): a count, or
    times after launch. ``simulate_signals`` (local cloud): the rebalance recommendations'
    model, :class:`spotnb.protocol.signals.SignalModel`'s fields (``{"lead_median":
    600, "false_alarm": 0, "seed": "a"}``). ``env``: environment variables for the cell, as
    ``{"NAME": "value"}`` or ``["NAME=value"]``; a name without a value (``None``, or
    ``"NAME"``) passes that variable of this machine's environment through, on the local
    cloud only. Values are written into the job's spec: no secrets (those that look like one
    are refused: pass those as ``secrets``). ``secrets``: environment variables of the cell
    whose values are secrets (``["HF_TOKEN", "WANDB_API_KEY"]``, taken from this machine's
    environment, or ``{"HF_TOKEN": value}``): the values go to the provider's secret store
    (AWS: SSM Parameter Store), never into the spec, and are deleted with the job; a name
    whose variable is not set is refused.
    ``files`` maps paths relative to the remote working
    directory to local files (helper modules next to the notebook): they are importable
    in the cell. ``notify_url``: a Slack-compatible webhook the instance posts to when
    an attempt is interrupted and when the job ends (:mod:`spotnb.protocol.notify`); it travels
    as a secret.
    ``nodes`` (``4`` or ``"3:4"``: MIN:MAX) and ``procs_per_node`` make the job
    distributed: the cell runs as torchrun's workers on every node (``RANK``,
    ``WORLD_SIZE``, ... set), and goes on with MIN nodes while a lost node's
    replacement boots (:mod:`spotnb.kernel_remote.multinode`); ``peer_timeout`` bounds every wait on
    a peer. ``standby``: on a rebalance recommendation, start a warm standby that takes
    the job over at the interruption notice (billed to the job; README, "Warm
    standbys"); False replaces an instance only once it is gone. In an instance's first
    hour a standby is timed to be ready as the hour ends (EC2 interrupting the instance
    before then makes it free); ``standby_first_hour=True`` starts it at once.
    ``region``: a region, several (``["us-east-1", "us-west-2"]`` or
    ``"us-east-1,us-west-2"``; the first is home, where the job's store is), or
    ``"any"`` for the ``allowed_regions`` (default ``$SPOTNB_ALLOWED_REGIONS``), which a
    named region must be among when they are set (:mod:`spotnb.providers.regions`).
    """
    job = prepare_job(code, provider=provider, instance_types=instance_types, region=region,
                   max_price=max_price, name=name, inputs=inputs, outputs=outputs,
                   checkpoint_every=checkpoint_every,
                   max_restarts_on_error=max_restarts_on_error, budget_usd=budget_usd,
                   max_duration=max_duration, keep_checkpoints=keep_checkpoints,
                   simulate_interruptions=simulate_interruptions,
                   simulate_signals=simulate_signals, env=env, files=files,
                   store=store, notify_url=notify_url, nodes=nodes,
                   procs_per_node=procs_per_node, peer_timeout=peer_timeout,
                   secrets=secrets, standby=standby,
                   standby_first_hour=standby_first_hour, allowed_regions=allowed_regions)
    spec, job_store, prov = job.spec, job.store, job.provider
    warnings = job.warnings + _notice_warnings(
        prov, spec, inputs if isinstance(inputs, Mapping) else {})
    # Inputs first: an agent that can read spec.json can read everything it names.
    job_store.put(layout.INPUTS, job.inputs)
    if job.workdir is not None:
        job_store.put(layout.WORKDIR, job.workdir)
    job_store.put(layout.SPEC, spec.to_json().encode())
    try:
        # The agent long-polls it for followers and stop requests (spotnb.protocol.events.live).
        queue_for(job_store, spec.job_id, CONTROL_QUEUE).create()
    except Exception as err:
        log.warning("no control queue for job %s (%s): followers read its log", spec.job_id, err)
    try:
        prov.launch(spec, secrets=job.secret_values)
    except BaseException:
        with contextlib.suppress(Exception):
            queue_for(job_store, spec.job_id, CONTROL_QUEUE).delete()
        job_store.put_if_absent(layout.RESULT, json.dumps(
            {"status": "failed", "reason": "the capacity group could not be created",
             "time": time.time()}).encode())
        raise
    index_job(spec)
    log.info("submitted job %s (%s) to %s", spec.job_id, spec.name, spec.provider)
    handle = JobHandle(job_store, spec, prov)
    handle.warnings = warnings
    return handle


def _notice_warnings(prov: Provider, spec: JobSpec, inputs: Mapping[str, Any]
                     ) -> tuple[str, ...]:
    """Whether a checkpoint of the captured inputs would miss the interruption notice.

    A lower bound of the state (the inputs' tensors; the cell may create more) over the
    provider's expected upload bandwidth; see :mod:`spotnb.ckpt.notice`. Nothing to
    say when the bandwidth is unknown (the runtime warns after the first save).
    """
    from spotnb.ckpt.notice import NoticeFit, input_state_bytes

    mbps = prov.upload_mbps(spec)
    if mbps is None or not inputs:
        return ()
    fit = NoticeFit.at_rate(input_state_bytes(inputs.values()), mbps, prov.notice_seconds())
    if fit.fits:
        return ()
    text = f"the cell's inputs alone are large to checkpoint: {fit.advice()}"
    log.warning("job %s: %s", spec.job_id, text)
    return (text,)


def prepare(code: str, **options: Any) -> JobSpec:
    """The :class:`~spotnb.protocol.spec.JobSpec` that ``submit(code, **options)`` would launch.

    Runs every check :func:`submit` runs (and pickles the inputs), but writes and starts
    nothing. Raises :class:`~spotnb.protocol.spec.SpecError` for bad input, ``TypeError`` for an
    argument :func:`submit` does not have.
    """
    return prepare_job(code, **options).spec


# -- following -----------------------------------------------------------------------

class JobHandle:
    """A submitted job. Cheap to create; everything is read from the store."""

    def __init__(self, store: Store, spec: JobSpec, provider: Provider | None = None) -> None:
        self.store = store
        self.spec = spec
        self._provider = provider
        self._supervision_checked = -SUPERVISION_CHECK_SECONDS
        #: What ``submit`` found worth telling before the job ran (e.g. that its
        #: checkpoints may not fit in the interruption notice); empty for ``attach``.
        self.warnings: tuple[str, ...] = ()
        self._result_checked = -RESULT_CHECK_SECONDS

    def __repr__(self) -> str:
        return f"<JobHandle {self.job_id} {self.spec.name!r}>"

    @property
    def job_id(self) -> str:
        return self.spec.job_id

    @property
    def provider(self) -> Provider:
        if self._provider is None:
            self._provider = get_provider(self.spec.provider)
        return self._provider

    def keep_supervised(self, force: bool = False, follows: bool = True) -> str | None:
        """Make sure the job's capacity group is supervised (the provider restarts a
        supervisor that died; on AWS a caller that ``follows`` the job takes over its
        capacity watch); at most every SUPERVISION_CHECK_SECONDS unless ``force``.
        Returns what was done, or None."""
        now = time.monotonic()
        if not force and now - self._supervision_checked < SUPERVISION_CHECK_SECONDS:
            return None
        self._supervision_checked = now
        try:
            done = self.provider.ensure_supervised(self.job_id, *(
                (self.spec, self.store) if follows else ()))
        except Exception:
            log.warning("could not check the supervision of job %s", self.job_id,
                        exc_info=True)
            return None
        if done:
            log.warning("job %s: %s", self.job_id, done)
        return done

    def result_record(self) -> dict[str, Any] | None:
        """``result.json`` as written by the agent, or None while the job runs."""
        try:
            return dict(json.loads(self.store.get(layout.RESULT)))
        except NotFound:
            return None

    @property
    def status(self) -> str:
        """The job's state (:class:`~spotnb.protocol.events.JobStatus`' value, or a
        newer spotnb's, said as it is): :func:`job_outcome`'s."""
        return job_outcome(self.store, self.result_record(), self.spec.resources.max_nodes)[0]

    def events(self, follow: bool = True, timeout: float | None = None,
               batches: bool = False) -> Iterator[Event]:
        """Every event from the start; with ``follow``, then new ones until the job ends
        (see :meth:`event_batches`). ``batches`` gives ``metrics`` events as batches
        rather than one ``metric`` event per row."""
        for batch in self.event_batches(follow=follow, timeout=timeout, batches=batches):
            yield from batch

    def event_batches(self, follow: bool = True, timeout: float | None = None,
                      batches: bool = False) -> Iterator[list[Event]]:
        """The events as they are read, one non-empty list per read: the first holds
        the history so far.

        Following registers with the job's agent for live events (see
        :mod:`spotnb.protocol.events.live`): they arrive within about a second, at a fraction
        of what tailing the log would cost. Reads go on until the job has ended and
        its capacity group has reported each of its instances terminated, so that a
        followed log always ends the same way (the group reports the last termination
        a moment after the job's result). That wait is bounded, since a group that is
        gone reports nothing: :data:`GROUP_END_GRACE_SECONDS`.
        """
        if not follow:
            history = EventReader(self.store, batches=batches).poll()
            if history:
                yield history
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        result_seen = False  # the agent's result event
        group_read = False  # the group's events read from the log since that
        ended_at: float | None = None  # when the job's end was first seen
        state = JobState()  # what the group launched and has not terminated
        with Follower(self.store, self.job_id, batches=batches) as follower:
            while True:
                if not result_seen:
                    batch = follower.poll(wait=FOLLOW_WAIT_SECONDS)
                else:
                    # Only the log has the group's events (the live channel carries
                    # the attempts'): read it, after a pause while it has not reported
                    # every instance's end yet.
                    if group_read:
                        time.sleep(FOLLOW_WAIT_SECONDS)
                    batch, group_read = follower.read_log(), True
                state.apply_all(batch)
                result_seen = state.result is not None
                if batch:
                    yield batch
                if group_read and not state.running_instances():
                    return
                now = time.monotonic()
                if ended_at is None and (result_seen or self.result_written()):
                    ended_at = now
                # A result file without the agent's closing events: the agent died
                # between the two.
                grace = GROUP_END_GRACE_SECONDS if result_seen else RESULT_WITHOUT_EVENTS_GRACE
                if ended_at is not None and now - ended_at > grace:
                    return
                if deadline is not None and now > deadline:
                    return
                self.keep_supervised()

    def result_written(self) -> bool:
        """Whether result.json exists, looked up at most every RESULT_CHECK_SECONDS (an
        S3 HEAD each time)."""
        now = time.monotonic()
        if now - self._result_checked < RESULT_CHECK_SECONDS:
            return False
        self._result_checked = now
        return self.store.exists(layout.RESULT)

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job ends; its :class:`JobResult` (with outputs).

        Raises ``TimeoutError`` if ``timeout`` seconds pass first; the job keeps going.
        Looks for the result every second at first, then less often (one S3 HEAD each
        time, at most every WAIT_MAX_SECONDS).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_SECONDS
        while not self.store.exists(layout.RESULT):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {self.job_id} still runs after {timeout}s; it keeps running: "
                    f"wait again, or stop it with spotnb.attach({self.job_id!r}).stop()")
            self.keep_supervised()
            pause = delay if deadline is None else min(delay, max(0.0, deadline -
                                                                  time.monotonic()))
            time.sleep(pause)
            delay = min(delay * 1.5, WAIT_MAX_SECONDS)
        # The agent writes its closing events right after result.json; its capacity
        # group reports each instance's end (what it cost) a moment later. The cost
        # shown is the final one: wait for those reports (bounded, as for a followed
        # log: a group that is gone reports nothing).
        end = time.monotonic() + RESULT_WITHOUT_EVENTS_GRACE
        reader = EventReader(self.store, batches=True)
        events = reader.poll()
        state = fold(events)
        while state.result is None and time.monotonic() < end:
            time.sleep(POLL_SECONDS)
            new = reader.poll()
            events += new
            state.apply_all(new)
        end = time.monotonic() + GROUP_END_GRACE_SECONDS
        while state.running_instances() and time.monotonic() < end:
            time.sleep(POLL_SECONDS)
            new = reader.poll()
            events += new
            state.apply_all(new)
        return self.summary(with_outputs=True, events=sorted(events, key=lambda e: e.time))

    def summary(self, with_outputs: bool = False, events: list[Event] | None = None,
                state: JobState | None = None) -> JobResult:
        """Where the job stands now, from its full event history: ``state``, its events
        folded, or ``events``, or the log read now."""
        if state is None:
            if events is None:
                events = EventReader(self.store, batches=True).poll()
            state = fold(events, self.spec.resources.max_nodes)
        result = summarize_state(self.spec, state, self.result_record())
        return self.with_outputs(result) if with_outputs else result

    def with_outputs(self, result: JobResult) -> JobResult:
        """``result`` with the job's ``--out`` values, once it completed (they are
        unpickled here: a class this environment lacks raises)."""
        if result.status == "completed" and self.spec.outputs:
            outputs = cloudpickle.loads(self.store.get(layout.OUTPUTS))
            result = dataclasses.replace(result, outputs=dict(outputs))
        return result

    def metrics(self) -> dict[str, list[tuple[int, float]]]:
        """Every logged metric in the store as (step, value) pairs, in logging order.

        While nobody follows a running job its agent writes metrics about once a
        minute (each write is a billed request); :meth:`events` follows it live."""
        series: dict[str, list[tuple[int, float]]] = {}
        for event in EventReader(self.store, batches=True).poll():
            for step, _t, values in metric_rows(event):
                for key, value in values.items():
                    series.setdefault(key, []).append((step, value))
        return series

    def interrupt(self, node: int | None = None) -> None:
        """Deliver a spot interruption notice now: to node ``node`` of a multi-node job
        (its node slot, as the display numbers them), else to the first running
        instance. The job checkpoints and goes on without it; the group replaces it."""
        self.provider.interrupt(self.job_id, self._target(node, "interrupt"))

    def kill(self, node: int | None = None) -> None:
        """End node ``node`` (else the first running instance) at once, without a notice:
        a machine lost outright, the way to test a cell against one (local cloud only).
        The job goes on from its last checkpoint; the group replaces the node."""
        from spotnb.providers import ProviderError

        try:
            self.provider.kill(self.job_id, self._target(node, "kill"))
        except ProviderError as err:  # not simulated by this provider: bad input
            raise SpecError(str(err)) from None

    def _target(self, node: int | None, what: str) -> str | None:
        """The instance that node slot ``node`` runs on now (None: the first running)."""
        from spotnb.protocol import lease

        if self.store.exists(layout.RESULT):
            raise SpecError(f"job {self.job_id} has ended; there is no instance to {what}")
        if node is None:
            return None
        nodes = self.spec.resources.max_nodes
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
            raise SpecError(f"node {node!r}: job {self.job_id} has "
                            + (f"nodes 0 to {nodes - 1}" if nodes > 1 else "one node, node 0"))
        current = lease.read(self.store, node)
        if current is None or current[0].released:
            raise SpecError(f"node {node} of job {self.job_id} is not running now (it has "
                            "not joined yet, or left and its replacement has not)")
        return current[0].holder

    def stop(self, reason: str = "requested") -> None:
        """Stop the job: the cell is interrupted, the capacity group deleted."""
        request_stop(self.store, self.job_id, {"reason": reason, "time": time.time()})
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while not self.store.exists(layout.RESULT) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        self.provider.terminate(self.job_id)
        self.store.put_if_absent(layout.RESULT, json.dumps(
            {"status": "stopped", "reason": f"stop requested ({reason})",
             "time": time.time()}).encode())


def attach(job: str | None = None, store: str | None = None) -> JobHandle:
    """A handle on an existing job (after a kernel restart, from another process).

    ``job`` is a job id, a job's name or the end of its id (:func:`find_job`); None is
    the latest job. Without ``store``, a job submitted from this machine is found
    wherever it lives (local directory or bucket); otherwise it is looked up in
    ``store``.
    """
    ref = find_job(job, store)
    job_store, spec = open_job(ref.job_id, store)
    handle = JobHandle(job_store, spec)
    if not job_store.exists(layout.RESULT):
        handle.keep_supervised(force=True)
    return handle


def jobs(store: str | None = None) -> list[JobInfo]:
    """Every job in ``store`` (default: the local store plus every job submitted from
    this machine), oldest first."""
    root = open_store(store or layout.default_store_root())
    ids = set(root.list_children("jobs"))
    if store is None and layout.index_dir().is_dir():
        ids |= {p.stem for p in layout.index_dir().glob("*.json")}
    rows = []
    for job_id in sorted(ids):
        try:
            job_store, spec = open_job(job_id, store)
            rows.append(_job_info(job_store, spec))
        except JobNotFound:
            continue
        except Exception as err:  # a bucket gone or unreachable must not hide the rest
            log.warning("cannot read job %s: %s", job_id, err)
            continue
    return sorted(rows, key=lambda r: r.created)


# Bump when JobInfo or summarize() change what a listed row says.
_LISTING_VERSION = 7  # 7: a pruned trial's step from its fold (6: the region of a job
#                        that moved, and the transfer in its cost; 5: a sweep's pruned
#                        trial reads pruned; 4: a multi-node row's nodes and instances
#                        are its world's)


def _job_info(job_store: Store, spec: JobSpec) -> JobInfo:
    """One row of :func:`jobs`.

    Summarising reads the job's whole event log (a long run logs millions of metrics;
    on S3 that is thousands of GETs), so the row of an ended job is kept in
    ``$SPOTNB_HOME/index/listing/`` with the log's state (:func:`log_state`: one
    listing per stream) and reused while that state is unchanged. A running job's row
    depends on the time (its cost grows), so it is always computed.
    """
    cache = layout.index_dir() / "listing" / f"{spec.job_id}.json"
    state = log_state(job_store) if job_store.exists(layout.RESULT) else None
    if state is not None:
        try:
            cached = json.loads(cache.read_text())
            if cached["version"] == _LISTING_VERSION and cached["log"] == state:
                fields = dict(cached["row"])
                fields["metric"] = tuple(fields["metric"]) if fields.get("metric") else None
                return JobInfo(**fields)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # no cache, or one from another version: compute the row
    handle = JobHandle(job_store, spec)
    if state is None:
        handle.keep_supervised(force=True, follows=False)
    folded = fold(EventReader(job_store, batches=True).poll(), spec.resources.max_nodes)
    s = handle.summary(state=folded)
    metric = next(((str(k), float(v)) for k, v in s.metrics.items()
                   if isinstance(v, (int, float))), None)
    row = JobInfo(job_id=spec.job_id, name=spec.name, status=s.status,
                  attempts=len(s.attempts), interruptions=s.interruptions,
                  cost_usd=s.cost_usd, created=spec.created,
                  instance_type=instances_label(s, spec.resources.max_nodes > 1,
                                                spec.resources.region),
                  duration=s.duration, ondemand_cost_usd=s.ondemand_cost_usd, metric=metric,
                  nodes=nodes_label(spec.resources, s), reason=s.reason,
                  status_text=folded.pruned.at if s.status == JobStatus.PRUNED.value
                  and folded.pruned is not None else "")
    if state is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"version": _LISTING_VERSION, "log": state,
                                       "row": dataclasses.asdict(row)}))
            os.replace(tmp, cache)
        except OSError as err:
            log.debug("cannot cache the listing of job %s: %s", spec.job_id, err)
    return row
