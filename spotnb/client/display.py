"""The notebook side of following a job: a follow loop and the renderers it drives.

:func:`follow` replays a job's event log from the start and then tails it until the
job ends, keeping one fold of its events (:class:`~spotnb.protocol.events.fold.JobState`,
applied incrementally: the view, the dashboard and the result all read it) in a
:class:`~spotnb.client.view.JobView`, and telling a :class:`Renderer` what to show. It
returns a typed outcome: :class:`Finished` (with the
:class:`~spotnb.client.jobs.JobResult` and the remote cell's last value) or
:class:`Detached` (the user interrupted the cell; the job keeps running). The loop never
prints: rendering is the renderer's job, so the text display here and a widget
dashboard are interchangeable. The header's facts are :mod:`spotnb.client.status`, the
lines between the output :mod:`spotnb.client.milestones`.

:class:`TextRenderer` is the plain display: one display handle updated in place (the
status), the remote kernel's stdout/stderr written to the cell's streams, its rich
outputs re-displayed, and milestones (interruptions, resumes) as lines in the stream,
where they sit between the output lines they explain.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from spotnb.client.jobs import FOLLOW_WAIT_SECONDS, RESULT_WITHOUT_EVENTS_GRACE, JobHandle
from spotnb.client.milestones import milestone, milestones
from spotnb.client.results import JobResult, summarize_state
from spotnb.client.status import Header, header, status_bundle, status_lines
from spotnb.client.view import JobView
from spotnb.protocol.events import GROUP_STREAM, Event, codec
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
    "milestones",
    "status_bundle",
    "status_lines",
]

# The status display is redrawn at most this often (and on every milestone): often
# enough for the elapsed time and the cost to tick, rarely enough for a notebook file.
REFRESH_SECONDS = 1.0


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
    #: The job's events folded, as the loop kept them (the record reads it).
    state: JobState | None = None


@dataclasses.dataclass(frozen=True)
class Detached:
    """The user interrupted the follow loop; the job keeps running."""

    job_id: str


class Renderer(Protocol):
    """What :func:`follow` asks of a display. Every method must return quickly.

    The magics create one renderer per followed job, with no arguments
    (``SpotMagics.renderer_class``), and pass it to :func:`follow`.

    Two optional methods, for displays that plot (the widget dashboard):
    ``start(handle, state)`` is called once with the job's
    :class:`~spotnb.client.jobs.JobHandle` and the loop's fold of its events (which the
    loop applies every event to: a renderer reads it, never applies to it) before
    anything else, and ``events(batch)`` with every batch of events as read (every
    poll, maybe empty), before the calls above for the same events; metrics come in it
    as ``metrics`` batches (:func:`spotnb.protocol.events.metric_columns` reads them;
    ``metric_rows`` gives their rows). ``events`` may raise ``KeyboardInterrupt`` to
    detach, like the notebook's stop button.
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
           refresh_seconds: float = REFRESH_SECONDS,
           on_events: Callable[[list[Event]], None] | None = None) -> Finished | Detached:
    """Replay ``handle``'s events from the start, then follow them until the job ends.

    One fold of the job's events is kept, applied as they come (the view's: the
    renderer reads it, the result is summarized from it: the log is read once).
    ``on_events``: called with every batch as read, as the renderer's ``events``
    (the record's curves gather them). A ``KeyboardInterrupt`` (the notebook's stop
    button) ends the loop and returns :class:`Detached`; nothing is done to the job.
    """
    spec = handle.spec
    state = JobState(spec.resources.max_nodes)
    view = JobView(job_id=spec.job_id, name=spec.name, created=spec.created,
                   min_nodes=spec.resources.min_nodes, max_nodes=spec.resources.max_nodes,
                   folded=state)
    # Metric batches stay batches: the view and the renderers take them in bulk (a
    # day's history of a million rows replays in about a second).
    follower = Follower(handle.store, spec.job_id, batches=True)
    start = getattr(renderer, "start", None)
    listeners = [f for f in (getattr(renderer, "events", None), on_events) if f is not None]
    try:
        if start is not None:
            start(handle, state)
        renderer.update(view)
        last_draw = time.monotonic()
        result_seen_at: float | None = None
        first = True
        while True:
            batch = follower.poll(wait=FOLLOW_WAIT_SECONDS)
            ended = follower.ended
            if ended:
                batch += follower.read_log()  # the group's last events (new ones only)
            if not first and (ended or _older_news_possible(batch, view)):
                # News that the log may hold older news for: the capacity group's
                # events (a standby booting) come only through the log, and a restore
                # has just written there what the lost attempt's checkpoint carried
                # (its last output). Read them now and show everything in time order.
                if not ended:
                    batch += follower.read_log()
                batch.sort(key=lambda e: e.time)
            first = False
            for listener in listeners:
                listener(batch)
            changed = _apply(batch, view, renderer)
            if ended:
                break
            if result_seen_at is None and handle.result_written():
                result_seen_at = time.monotonic()
            if result_seen_at is not None and \
                    time.monotonic() - result_seen_at > RESULT_WITHOUT_EVENTS_GRACE:
                # The agent died after writing its result: what the log has is all.
                last = follower.read_log()
                for listener in listeners:
                    listener(last)
                _apply(last, view, renderer)
                break
            handle.keep_supervised()
            if changed or time.monotonic() - last_draw >= refresh_seconds:
                view.account(summarize_state(spec, state, None))
                renderer.update(view)
                last_draw = time.monotonic()
        view.record = handle.result_record()
        result = summarize_state(spec, state, view.record)
        outputs_error = None
        try:
            result = handle.with_outputs(result)
        except Exception as err:  # unpickling runs arbitrary code; report, don't crash
            outputs_error = f"{type(err).__name__}: {err}"
    except KeyboardInterrupt:
        view.detached = True
        renderer.detached(view)
        return Detached(spec.job_id)
    finally:
        follower.close()
    view.account(result)
    renderer.finished(view, result)
    return Finished(result, view.execute_result, outputs_error, state)


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
        if isinstance(body, (codec.Usage, codec.Price)):
            continue
        return True
    return False


def _apply(batch: list[Event], view: JobView, renderer: Renderer) -> bool:
    """Fold ``batch`` into the view and tell the renderer; whether a milestone was
    seen."""
    changed = False
    for event in batch:
        view.apply(event)
        body = codec.peek(event)
        if isinstance(body, codec.Stream) and body.replayed_by is not None and \
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
        for about, text in milestones(event, view):
            view.last_milestone = text
            renderer.milestone(view, about, text)
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
