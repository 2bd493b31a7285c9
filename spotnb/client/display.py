"""The notebook side of following a job: a follow loop and the renderers it drives.

:func:`follow` replays a job's event log from the start and then tails it until the
job ends, keeping a :class:`JobView` (what a display shows, derived from events only)
and telling a :class:`Renderer` what to show. It returns a typed outcome:
:class:`Finished` (with the :class:`~spotnb.client.jobs.JobResult` and the remote cell's
last value) or :class:`Detached` (the user interrupted the cell; the job keeps
running). The loop never prints: rendering is the renderer's job, so the text
display here and a widget dashboard are interchangeable.

:class:`TextRenderer` is the plain display: one display handle updated in place (the
status), the remote kernel's stdout/stderr written to the cell's streams, its rich
outputs re-displayed, and milestones (interruptions, resumes) as lines in the stream,
where they sit between the output lines they explain.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import re
import sys
import time
from typing import Any, Protocol

from spotnb.client.jobs import (
    FOLLOW_WAIT_SECONDS,
    RESULT_WITHOUT_EVENTS_GRACE,
    JobHandle,
    JobResult,
    summarize,
)
from spotnb.client.progress import Progress
from spotnb.protocol import layout
from spotnb.protocol.events import (
    FINAL_STATES,
    GROUP_STREAM,
    Event,
    codec,
    expand,
    metric_columns,
    metric_names,
)
from spotnb.protocol.events.fold import JobState
from spotnb.protocol.events.live import Follower

__all__ = [
    "Detached",
    "Finished",
    "Header",
    "JobView",
    "RemoteValue",
    "Renderer",
    "SpotJobError",
    "TextRenderer",
    "detach_text",
    "follow",
    "header",
    "milestone",
    "status_lines",
]

# The status display is redrawn at most this often (and on every milestone): often
# enough for the elapsed time and the cost to tick, rarely enough for a notebook file.
REFRESH_SECONDS = 1.0


@dataclasses.dataclass
class JobView:
    """What a display of a job shows, derived from its events only."""

    job_id: str
    name: str
    created: float
    state: str = "submitted"
    detail: str = ""
    attempt: int = 0
    instance_id: str | None = None
    instance_type: str | None = None
    az: str | None = None
    spot_price: float | None = None
    ondemand_price: float | None = None
    step: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    interruptions: int = 0
    cost_usd: float = 0.0
    ondemand_cost_usd: float = 0.0
    elapsed: float = 0.0
    last_milestone: str = ""
    # The remote cell's last value (an ``execute_result`` MIME bundle), if any.
    execute_result: dict[str, Any] | None = None
    outputs: tuple[str, ...] = ()
    reason: str = ""
    detached: bool = False
    # Steps, pace, time left and what interruptions took (spotnb.client.progress).
    progress: Progress = dataclasses.field(default_factory=Progress)
    # spotnb's own AWS requests at list price, part of cost_usd (None: not accounted),
    # and what cost_usd includes, in words (the JobResult's, where it says).
    requests_usd: float | None = None
    cost_includes: str | None = None
    # When the figures were last accounted: the live clock, or the job's end.
    now: float = 0.0
    # A multi-node job's node counts (``--nodes MIN:MAX``; 1:1 for one node), and its
    # world as the ``world`` events say: nodes and processes now, and each change as
    # (time, nodes, processes). ``world_changed`` is the ``world`` event just applied
    # if it changed the world (its milestone says how), else None.
    min_nodes: int = 1
    max_nodes: int = 1
    world_nodes: int = 0
    world_size: int = 0
    worlds: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    world_changed: Event | None = None
    # Attempts whose last output a later attempt recovered from their checkpoint.
    recovered: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.progress.max_nodes = self.max_nodes
        # The job's story is the fold's (spotnb.protocol.events.fold), which the progress keeps.
        self.worlds = self.progress.state.worlds

    @property
    def folded(self) -> JobState:
        """The job's events folded."""
        return self.progress.state

    @property
    def multinode(self) -> bool:
        """Whether the job may run on more than one node."""
        return self.max_nodes > 1

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def savings_pct(self) -> float | None:
        if self.ondemand_cost_usd <= 0:
            return None
        return 100.0 * (1.0 - self.cost_usd / self.ondemand_cost_usd)

    def apply(self, event: Event) -> None:
        """Update the view with one event (a ``metrics`` batch: as with each of its rows
        in turn, in bulk)."""
        if codec.is_batch(event):
            self._metrics(event)
            return
        if codec.is_row(event):  # the hot path: read as it is, no body built
            self.progress.apply(event)
            self.world_changed = None
            self.step = event.data.get("step", self.step)
            self.metrics.update(event.data.get("values") or {})
            return
        body = event.body
        worlds = len(self.worlds)
        self.progress.apply(event)
        self.world_changed = None
        if isinstance(body, codec.World):
            # Every node of a round says the same: only a change is news. A node's
            # stream read late may bring an older round's report: not news either.
            if len(self.worlds) > worlds:
                _t, self.world_nodes, self.world_size = self.worlds[-1]
                self.world_changed = event
        elif isinstance(body, codec.Status) and event.attempt != GROUP_STREAM:
            if body.state == "booting" and event.attempt >= self.attempt:
                if event.attempt > self.attempt:
                    self.execute_result = None  # the cell runs again from the top
                self.attempt = event.attempt
                self.instance_id = event.instance
                self.instance_type = body.instance_type or self.instance_type
                self.az = body.az or self.az
            if event.attempt >= self.attempt:
                self.state = body.state or self.state
                self.detail = body.detail
        elif isinstance(body, codec.Status) and (not self.attempt or
                                                 self.state == "interrupted"):
            # The group's own states: waiting for capacity, launching a replacement.
            self.state = body.state or self.state
            self.detail = body.detail
        elif isinstance(body, codec.Instance) and body.launched:
            self.spot_price = body.price if "price" in event.data else self.spot_price
            self.ondemand_price = body.ondemand if "ondemand" in event.data \
                else self.ondemand_price
            self.instance_type = body.instance_type or self.instance_type
        elif isinstance(body, codec.Price) and body.instance_type in (None, self.instance_type):
            self.spot_price = body.price if "price" in event.data else self.spot_price
            self.ondemand_price = body.ondemand or self.ondemand_price
        elif isinstance(body, codec.Display) and body.execute_result:
            self.execute_result = {"data": body.data, "metadata": body.metadata}
        elif isinstance(body, codec.Result):
            self.state = body.status if body.status is not None else self.state
            self.reason = body.reason

    def _metrics(self, event: Event) -> None:
        steps, times, columns = metric_columns(event)
        if len(steps) != len(times):  # a damaged batch: what its rows say, row by row
            for row in expand(event):
                self.apply(row)
            return
        if not len(steps):
            return
        self.progress.apply(event)
        self.step = steps[-1]
        for name in metric_names(columns):  # new names in the order the rows name them
            rows, values = columns[name]
            n = min(len(values), len(steps) if rows is None else len(rows))
            if n:
                self.metrics[name] = values[n - 1]

    def account(self, result: JobResult) -> None:
        """Take the cost, interruptions and duration from a summary."""
        self.cost_usd = result.cost_usd
        self.ondemand_cost_usd = result.ondemand_cost_usd
        self.interruptions = result.interruptions
        self.elapsed = result.duration
        self.requests_usd = getattr(result, "requests_usd", None)
        self.cost_includes = getattr(result, "cost_includes", None)
        self.now = self.created + result.duration if result.status in FINAL_STATES \
            else time.time()
        if result.status in FINAL_STATES:
            self.state, self.reason = result.status, result.reason
            self.metrics = {**self.metrics, **result.metrics}
            self.outputs = tuple(sorted(result.outputs))


def milestone(event: Event, view: JobView | None = None) -> str | None:
    """A line for the events a user wants to see in the log: interruptions, resumes,
    retries, capacity fallbacks, warnings. None for every other event.

    One line per event: an interruption is its notice's line, a resume its boot's line.
    What happens in between (the final checkpoint, the restore) is status, which the
    display's header shows; a rebalance recommendation that comes with the notice says
    nothing more. ``view``, the state so far, tells which attempt had a notice.
    """
    body = codec.peek(event)
    if view is not None and view.multinode:
        text = _node_milestone(event, view)
        if text is not None:
            return text
    if view is not None and (text := _standby_milestone(event, body, view.folded)):
        return text
    if isinstance(body, codec.Status) and event.attempt != GROUP_STREAM:
        state, detail = body.state, body.detail
        if state == "booting" and not body.retrying:
            where = " ".join(str(p) for p in (body.instance_type, body.az) if p)
            verb = "starting" if event.attempt == 1 else (
                "resuming on a replacement instance" if _has_checkpoint(view) else
                "starting again from the beginning on a replacement instance (no "
                "checkpoint was saved)")
            return f"attempt {event.attempt}: {verb}, {where} ({event.instance})"
        if state == "interrupted" and not detail.startswith(
                ("spot interruption notice", "final checkpoint")):
            if view is not None and any(i.attempt == event.attempt and i.noticed
                                        for i in view.progress.interruptions):
                return None  # the notice's line said it (the termination follows it)
            return f"attempt {event.attempt}: {detail}"
        if state == "stopped":
            return detail
        return None
    if isinstance(body, codec.Notice):
        if body.moved:
            return (f"attempt {event.attempt}: {_moving_to(event, view)}; saving a "
                    "checkpoint, then the standby trains on from it")
        if body.interruption:
            when = _clock_of(body.notice_time)
            then = ("saving a checkpoint, then resuming on a replacement"
                    if _has_checkpoint(view) else
                    "no checkpoint yet: unless the cell saves one before the instance "
                    "goes, the next attempt starts from the beginning")
            return (f"attempt {event.attempt}: spot interruption notice for {event.instance} "
                    f"({body.action} at {when}); {then}")
        if view is not None and any(i.attempt == event.attempt and i.noticed
                                    for i in view.progress.interruptions):
            return None
        return (f"attempt {event.attempt}: rebalance recommendation for {event.instance}: "
                "it is at elevated risk of interruption; saving a checkpoint")
    if isinstance(body, codec.Instance) and body.standby_deferred:
        due = datetime.datetime.fromtimestamp(body.standby_due or event.time)
        return (f"rebalance recommendation for {event.instance} in its first hour: its "
                f"standby starts at {due.strftime('%H:%M:%S')}, to be ready as the hour "
                "ends (EC2 interrupting it before then makes it free)")
    if isinstance(body, codec.Instance) and body.boot_failed:
        last = next((line for line in reversed(body.log)
                     if not line.startswith("spotnb-boot:")), "")
        then = ("the job fails" if body.failures and body.limit and
                body.failures >= body.limit else "Auto Scaling launches another instance")
        count = f" ({body.failures} of {body.limit} in a row)" if body.failures else ""
        return (f"{body.instance_id or event.instance} failed to boot{count}: {body.reason}"
                f"{': ' + last if last else ''}; {then}. `%spot_logs` shows its log's end")
    if isinstance(body, codec.Instance) and body.capacity_error:
        return (f"no spot capacity for {body.instance_type} in {body.az}: "
                "trying the next pool")
    if isinstance(body, codec.Warning):
        return f"warning: {body.text}"
    if isinstance(body, codec.Error) and body.retrying:
        return (f"attempt {event.attempt} failed with {body.ename}: {body.evalue}; "
                "retrying (max_restarts_on_error)")
    return None


def _has_checkpoint(view: JobView | None) -> bool:
    """Whether the job has a durable checkpoint (the fold's); without a view, assumed."""
    return view is None or bool(view.folded.checkpoints)


def _standby_milestone(event: Event, body: codec.Body | None, state: JobState
                       ) -> str | None:
    """A warm standby's news as the fold tells it (:meth:`StandbyState.story`): booting,
    ready, handed over in so many seconds, or given back at its cost."""
    if isinstance(body, codec.Instance) and (body.standby_for or body.standby_ready):
        instance = body.instance_id or event.instance
    elif isinstance(body, codec.Standby) and body.phase == "restored":
        instance = event.instance
    else:
        return None
    sb = state.standbys.get(str(instance))
    if sb is None:
        return None
    return next((text for t, text in sb.story(state) if t == event.time), None)


def _moving_to(event: Event, view: JobView | None) -> str:
    """An attempt's instance ended because its warm standby is ready (capacity
    rebalancing), in words: naming the standby where the fold knows it."""
    standby = None if view is None else next(
        (sb.instance_id for sb in view.folded.standbys.values()
         if sb.standby_for == event.instance), None)
    return f"its warm standby{f' {standby}' if standby else ''} is ready: moving to it"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _node_milestone(event: Event, view: JobView) -> str | None:
    """A multi-node job's milestones in its own terms: nodes join, are noticed or lost,
    and the world re-forms (None: the single-node wording applies, or nothing to say).

    A node is a node slot (``layout.node_slot``): attempts 1..MAX are the slots' first
    instances joining, later attempts replacements joining in a lost node's place.
    """
    body = codec.peek(event)
    if isinstance(body, codec.World):
        if view.world_changed is not event:
            return None
        nodes, size = view.world_nodes, view.world_size
        now = f"{_plural(nodes, 'node')}, world size {size}"
        if len(view.worlds) < 2:
            return f"world formed: {now} (--nodes {view.min_nodes}:{view.max_nodes})"
        before = view.worlds[-2][1]
        if nodes > before:
            return f"world re-formed at {now}: {_plural(nodes - before, 'node')} joined"
        if nodes < before:
            waiting = (" while a replacement boots" if nodes < view.max_nodes else "")
            return (f"world re-formed at {now}: going on without "
                    f"{_plural(before - nodes, 'lost node')}{waiting}")
        return f"world re-formed at {now}"
    if isinstance(body, codec.Joined):
        who = ", ".join(map(str, body.nodes)) or "a new node"
        who = f"node {who}" if body.nodes else who
        return (f"{who} joined: world {body.world_size}, {_plural(body.redone, 'step')} "
                f"redone (saved at step {body.saved_step} before re-forming)")
    if event.attempt == GROUP_STREAM:
        return None
    slot = layout.node_slot(event.attempt, view.max_nodes)
    who = f"node {slot} (attempt {event.attempt})"
    if isinstance(body, codec.Status) and body.state == "booting" and not body.retrying:
        where = " ".join(str(p) for p in (body.instance_type, body.az) if p)
        standby = view.folded.standbys.get(str(event.instance))
        how = ("joining" if event.attempt <= view.max_nodes
               else "its warm standby joining in its place"
               if standby is not None and standby.standby_for
               else "a replacement instance joining in the lost node's place")
        return f"{who}: {how}, {where} ({event.instance})"
    if isinstance(body, codec.Notice) and body.moved:
        return (f"{who}: {_moving_to(event, view)}; every rank saves a checkpoint, then "
                "the standby joins the world in its place")
    if isinstance(body, codec.Notice) and not body.interruption and not any(
            i.attempt == event.attempt and i.noticed for i in view.progress.interruptions):
        return (f"{who}: rebalance recommendation for {event.instance}: it is at elevated "
                "risk of interruption; every rank saves a checkpoint")
    if isinstance(body, codec.Notice) and body.interruption:
        when = _clock_of(body.notice_time)
        return (f"{who}: spot interruption notice for {event.instance} ({body.action} "
                f"at {when}); every rank saves a checkpoint, then "
                + _without_one(view))
    if isinstance(body, codec.Status) and body.state == "interrupted" and \
            not body.detail.startswith(("spot interruption notice", "final checkpoint")):
        if any(i.attempt == event.attempt and i.noticed
               for i in view.progress.interruptions):
            return None  # the notice's line said it (the termination follows it)
        return f"{who} lost: {body.detail}; " + _without_one(view)
    return None


def _without_one(view: JobView) -> str:
    """What the job does once one node of the current world is gone."""
    left = (view.world_nodes or view.max_nodes) - 1
    if left >= view.min_nodes:
        return f"the job goes on with {_plural(left, 'node')} while a replacement boots"
    return (f"the job waits for a replacement ({_plural(left, 'node')} left, at least "
            f"{view.min_nodes} needed)")


# -- outcomes --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Finished:
    """The job ended: its result (with outputs) and the remote cell's last value.

    ``outputs_error`` says why the outputs could not be loaded here (a class whose
    module this environment lacks), in which case ``result.outputs`` is empty.
    """

    result: JobResult
    execute_result: dict[str, Any] | None
    outputs_error: str | None = None


@dataclasses.dataclass(frozen=True)
class Detached:
    """The user interrupted the follow loop; the job keeps running."""

    job_id: str


class Renderer(Protocol):
    """What :func:`follow` asks of a display. Every method must return quickly.

    The magics create one renderer per followed job, with no arguments
    (``SpotMagics.renderer_class``), and pass it to :func:`follow`.

    Two optional methods, for displays that plot (the widget dashboard): ``start(handle)``
    is called once with the job's :class:`~spotnb.client.jobs.JobHandle` before anything else,
    and ``events(batch)`` with every batch of events as read (every poll, maybe empty),
    before the calls above for the same events; metrics come in it as ``metrics``
    batches (:func:`spotnb.protocol.events.metric_columns` reads them; ``metric_rows`` gives
    their rows). ``events`` may raise ``KeyboardInterrupt`` to detach, like the
    notebook's stop button.
    """

    def update(self, view: JobView) -> None:
        """Redraw the status (called at most every second, and on milestones)."""

    def stream(self, name: str, text: str) -> None:
        """Remote ``stdout``/``stderr`` text."""

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        """A remote ``display_data``, ``update_display_data`` or ``clear_output``."""

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        """An interruption, a resume, a retry (see :func:`milestone`)."""

    def finished(self, view: JobView, result: JobResult) -> None:
        """The job ended; ``view`` holds the final numbers."""

    def detached(self, view: JobView) -> None:
        """The user interrupted the cell; the job keeps running."""


def follow(handle: JobHandle, renderer: Renderer,
           refresh_seconds: float = REFRESH_SECONDS) -> Finished | Detached:
    """Replay ``handle``'s events from the start, then follow them until the job ends.

    A ``KeyboardInterrupt`` (the notebook's stop button) ends the loop and returns
    :class:`Detached`; nothing is done to the job.
    """
    spec = handle.spec
    view = JobView(job_id=spec.job_id, name=spec.name, created=spec.created,
                   min_nodes=spec.resources.min_nodes, max_nodes=spec.resources.max_nodes)
    # Metric batches stay batches: the view and the renderers take them in bulk (a
    # day's history of a million rows replays in about a second).
    follower = Follower(handle.store, spec.job_id, batches=True)
    control: list[Event] = []
    start = getattr(renderer, "start", None)
    on_events = getattr(renderer, "events", None)
    try:
        if start is not None:
            start(handle)
        renderer.update(view)
        last_draw = time.monotonic()
        result_seen_at: float | None = None
        # A job that had ended is replayed from its log in the first poll: that is its
        # whole history, so the result is summarized from it rather than read again
        # (a day of metrics is read once, not twice).
        history: list[Event] | None = None
        first = True
        while True:
            batch = follower.poll(wait=FOLLOW_WAIT_SECONDS)
            ended = follower.ended
            if ended:
                batch += follower.poll(wait=0)  # the group's last events
                if first:
                    history = batch
            if not first and _older_news_possible(batch, view):
                # News that the log may hold older news for: the capacity group's
                # events (a standby booting) come only through the log, and a restore
                # has just written there what the lost attempt's checkpoint carried
                # (its last output). Read them now and show everything in time order.
                batch += follower.read_log()
                batch.sort(key=lambda e: e.time)
            first = False
            if on_events is not None:
                on_events(batch)
            changed = _apply(batch, view, control, renderer)
            if ended:
                break
            if result_seen_at is None and handle.result_written():
                result_seen_at = time.monotonic()
            if result_seen_at is not None and \
                    time.monotonic() - result_seen_at > RESULT_WITHOUT_EVENTS_GRACE:
                break  # the agent died after writing its result
            handle.keep_supervised()
            if changed or time.monotonic() - last_draw >= refresh_seconds:
                view.account(summarize(spec, control, None))
                renderer.update(view)
                last_draw = time.monotonic()
        outputs_error = None
        try:
            result = handle.summary(with_outputs=True, events=history)
        except Exception as err:  # unpickling runs arbitrary code; report, don't crash
            outputs_error = f"{type(err).__name__}: {err}"
            result = handle.summary(events=history)
    except KeyboardInterrupt:
        view.detached = True
        renderer.detached(view)
        return Detached(spec.job_id)
    finally:
        follower.close()
    view.account(result)
    renderer.finished(view, result)
    return Finished(result, view.execute_result, outputs_error)


def _older_news_possible(batch: list[Event], view: JobView) -> bool:
    """Whether ``batch`` (live) holds an attempt's milestone-bearing news (a boot, a
    notice, an interruption, a restore, a standby's handover, an error, the result):
    the log is then read at once, so that the group's events before it (written only
    there) and the output a restore recovered come first. A save's two statuses
    (checkpointing, then running again) are not news: they cost no extra read."""
    state = view.state
    for event in batch:
        if event.attempt == GROUP_STREAM or not codec.is_control(event):
            continue
        body = codec.peek(event)
        if isinstance(body, codec.Status):
            saving = body.state == "checkpointing" or (
                body.state == "running" and state == "checkpointing")
            state = body.state
            if saving:
                continue
        if event.type in ("usage", "price"):
            continue
        return True
    return False


def _apply(batch: list[Event], view: JobView, control: list[Event],
           renderer: Renderer) -> bool:
    """Feed ``batch`` to the view and the renderer; whether a milestone was seen."""
    changed = False
    for event in batch:
        view.apply(event)
        body = codec.peek(event)
        if codec.is_control(event):
            control.append(event)
        if isinstance(body, codec.Stream) and event.data.get("replayed_by") and \
                event.attempt not in view.recovered:
            # Output the attempt's instance did not live to log, which its checkpoint
            # carried and a later attempt recorded: said once, before those lines.
            view.recovered.add(event.attempt)
            renderer.milestone(view, event, f"attempt {event.attempt}: its last output, "
                                            "recovered from its checkpoint (its instance "
                                            "was lost before it logged it):")
            changed = True
        if isinstance(body, codec.Stream):
            renderer.stream(body.name, body.text)
        elif isinstance(body, codec.Display) and not body.execute_result:
            metadata = ({"wait": body.wait} if body.kind == "clear_output"
                        else body.metadata)
            renderer.rich(body.kind, body.data, metadata, body.display_id)
        text = milestone(event, view)
        if text is not None:
            view.last_milestone = text
            renderer.milestone(view, event, text)
            changed = True
    return changed


# -- what the notebook shows -------------------------------------------------------------

class SpotJobError(Exception):
    """A job ended failed or stopped. IPython shows :meth:`_render_traceback_`: the
    remote traceback, whose line numbers are the ``%%spot_train`` cell's own."""

    def __init__(self, result: JobResult, cell_number: int | None = None) -> None:
        self.result = result
        self.cell_number = cell_number
        super().__init__(f"job {result.job_id} {result.status}: {result.reason}")

    def _render_traceback_(self) -> list[str]:
        r = self.result
        lines: list[str] = []
        error = r.error or {}
        for line in error.get("traceback") or []:
            if self.cell_number is not None:
                # The remote kernel counts its own cells; show the notebook's number.
                line = re.sub(r"(Cell(?:\x1b\[[0-9;]*m)*\s*(?:\x1b\[[0-9;]*m)*In\s*\[)\d+(\])",
                              rf"\g<1>{self.cell_number}\g<2>", line)
            lines.append(line)
        attempt = r.attempts[-1].number if r.attempts else None
        where = f" on attempt {attempt}" if attempt else ""
        if r.status == "failed":
            tail = (f"spotnb: job {r.job_id} failed{where}: {r.reason}. Its instance was "
                    "terminated; fix the cell and run it again"
                    + (", or allow retries with --max-restarts-on-error N." if error else "."))
        else:
            tail = (f"spotnb: job {r.job_id} was stopped{where}: {r.reason}. "
                    f"Its instance was terminated; `%spot_logs {r.job_id}` shows its history.")
        return [*lines, "", tail]


class RemoteValue:
    """The remote cell's last value, displayed like a local cell's ``Out[n]``."""

    def __init__(self, bundle: dict[str, Any]) -> None:
        self.data = dict(bundle.get("data") or {})
        self.metadata = dict(bundle.get("metadata") or {})

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None,
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.data, self.metadata

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", "<remote value>"))


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _clock_of(iso_time: Any) -> str:
    """``2026-11-23T06:43:20Z`` as local clock time (``06:43:20``); else as given."""
    try:
        when = datetime.datetime.fromisoformat(str(iso_time).replace("Z", "+00:00"))
    except ValueError:
        return str(iso_time)
    return when.astimezone().strftime("%H:%M:%S")


def _metric_text(view: JobView, limit: int = 4) -> str:
    parts = []
    for key, value in list(view.metrics.items())[:limit]:
        parts.append(f"{key} {value:.4g}" if isinstance(value, (int, float)) else f"{key} {value}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Header:
    """What a job's header says, as short texts that a display lays out (see
    :func:`header`); empty strings are facts not known (yet)."""

    attempt: str
    where: str
    price: str
    step: str
    fraction: float | None
    pace: str
    metrics: str
    elapsed: str
    cost: str
    ondemand: str
    saving: str
    projected: str
    cost_note: str
    interruptions: str
    lost: str
    #: A multi-node job's world: ``"2 nodes (--nodes 2:3), world size 4"``.
    world: str = ""


def header(view: JobView) -> Header:
    """The header's facts (see :mod:`spotnb.client.progress` for how each is computed)."""
    p = view.progress
    now = view.now or time.time()
    attempt = f"attempt {view.attempt}" if view.attempt else ""
    if view.multinode:  # the nodes come and go on their own: the world says it
        attempt = (p.launching or "") if not view.final else ""
    elif p.launching and not view.final:
        attempt = p.launching if not attempt else f"{attempt} ended; {p.launching}"
    price = ""
    running = p.running_prices() if view.multinode and not view.final else None
    if running is not None:  # every node's instance bills
        spot_rate, ondemand_rate, count = running
        price = f"spot ${spot_rate:.4f}/h for {_plural(count, 'instance')}"
        if ondemand_rate:
            price += f" (on-demand ${ondemand_rate:.4f}/h)"
    elif view.spot_price is not None:
        price = f"spot ${view.spot_price:.4f}/h"
        if view.ondemand_price:
            price += f" (on-demand ${view.ondemand_price:.4f}/h)"
    step = fraction_text = ""
    fraction = None
    if view.step is not None:
        step = f"step {view.step}"
        if p.total:
            fraction = min(1.0, (view.step + 1) / p.total)
            step = f"step {view.step + 1} of {p.total}"
            fraction_text = f" ({100 * fraction:.0f}%)"
    pace = ""
    rate, left = p.rate(), p.seconds_left()
    if rate is not None and not view.final:
        pace = f"{rate:.3g} steps/s"
        if left is not None:
            pace += f", {_clock(left)} left"
    saving = f"saving {view.savings_pct:.0f}%" if view.savings_pct is not None else ""
    projected = ""
    if not view.final:
        rates = ((view.spot_price, view.ondemand_price) if running is None
                 else running[:2])  # a multi-node job: every node bills the time left
        proj = p.projection(now, view.cost_usd, view.ondemand_cost_usd, *rates)
        if proj is not None:
            projected = (f"projected ${proj.cost_usd:.4f} at the end vs "
                         f"${proj.ondemand_usd:.4f} on-demand for the same work")
            if proj.savings_pct is not None:
                projected += f" (saving {proj.savings_pct:.0f}%)"
    note = view.cost_includes or ("instances billed per second from launch (boot "
                                  "included) to termination")
    lost = ""
    if p.interruptions:
        lost_usd, _ = p.lost_usd(now)
        redone = p.redone_steps()
        lost = (f"took {_clock(p.lost_seconds(now))} and ${lost_usd:.4f}; "
                f"{redone} step{'s' if redone != 1 else ''} redone")
    return Header(
        attempt=attempt,
        where=" ".join(x for x in (view.instance_type, view.az) if x),
        price=price, step=step + fraction_text, fraction=fraction, pace=pace,
        metrics=_metric_text(view, limit=3), elapsed=_clock(view.elapsed),
        cost=f"cost ${view.cost_usd:.4f}",
        ondemand=f"on-demand ${view.ondemand_cost_usd:.4f} for the same instance-hours",
        saving=saving, projected=projected, cost_note=note,
        interruptions=f"interruptions {view.interruptions}", lost=lost,
        world=_world_text(view))


def _world_text(view: JobView) -> str:
    if not view.multinode:
        return ""
    nodes = f"{view.min_nodes}:{view.max_nodes}"
    if not view.world_nodes:
        return f"world not formed yet (--nodes {nodes})"
    return (f"{_plural(view.world_nodes, 'node')} (--nodes {nodes}), "
            f"world size {view.world_size}")


def status_lines(view: JobView) -> list[str]:
    """The status as a few text lines (the dashboard's header shows the same facts)."""
    h = header(view)
    state = view.state.replace("_", " ") + (" (detached)" if view.detached else "")

    def line(*parts: str) -> str:
        return " · ".join(part for part in parts if part)

    lines = [line(f"spotnb job {view.job_id} {view.name!r}", state, h.attempt, h.where,
                  h.price)]
    if h.world:
        lines.append(h.world)
    if h.step or h.metrics:
        lines.append(line(h.step, h.pace, h.metrics))
    money = line(h.elapsed, h.cost, h.ondemand, h.saving)
    lines.append(line(money, h.interruptions + (f" ({h.lost})" if h.lost else "")))
    if h.projected:
        lines.append(h.projected)
    if view.final:
        tail = view.reason
        if view.outputs:
            tail += f"; outputs set in the notebook: {', '.join(view.outputs)}"
        lines.append(tail)
    elif view.detail:
        lines.append(view.detail)
    return lines


_STATE_COLOURS = {"completed": "#1a7f37", "failed": "#cf222e", "stopped": "#9a6700",
                  "pruned": "#6e7781",
                  "interrupted": "#bc4c00"}


def status_bundle(view: JobView) -> dict[str, str]:
    """The status display as a MIME bundle (text and HTML)."""
    lines = status_lines(view)
    colour = _STATE_COLOURS.get(view.state, "#0969da")
    body = "<br>".join(html.escape(line) for line in lines)
    return {
        "text/plain": "\n".join(lines),
        "text/html": (f'<div style="border-left:4px solid {colour};padding:4px 8px;'
                      f'font-family:monospace;font-size:90%">{body}</div>'),
    }


class TextRenderer:
    """The plain display: see the module docstring. Works in any IPython front end."""

    def __init__(self) -> None:
        self._handle: Any = None

    def update(self, view: JobView) -> None:
        from IPython.display import display

        bundle = status_bundle(view)
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)

    def stream(self, name: str, text: str) -> None:
        out = sys.stderr if name == "stderr" else sys.stdout
        out.write(text)
        out.flush()

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        from IPython.display import clear_output, display

        sys.stdout.flush()
        if kind == "clear_output":
            clear_output(wait=bool(metadata.get("wait", False)))
            self._handle = None  # the status went with it; the next update redraws it
        elif kind == "update_display_data" and display_id:
            display(data, raw=True, metadata=metadata, display_id=display_id, update=True)
        else:
            display(data, raw=True, metadata=metadata, display_id=display_id or None)

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        when = datetime.datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
        sys.stdout.write(f"[spotnb {when}] {text}\n")
        sys.stdout.flush()
        self.update(view)

    def finished(self, view: JobView, result: JobResult) -> None:
        self.update(view)

    def detached(self, view: JobView) -> None:
        self.update(view)
        sys.stderr.write(detach_text(view))
        sys.stderr.flush()


def detach_text(view: JobView) -> str:
    """What to tell the user after detaching from a job (one line)."""
    return (f"Detached from job {view.job_id}: it keeps running on its spot instance, "
            f"and keeps costing. Follow it again with `%spot_attach {view.job_id}`; "
            f"stop it with `%spot_stop {view.job_id}`.\n")
