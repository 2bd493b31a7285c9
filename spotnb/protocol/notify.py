"""Notifications to a Slack-compatible webhook, sent from the instance.

A job given a ``notify_url`` (``%%spot_train --notify URL``,
``SpotMagics.notify_url``, ``spotnb.submit(notify_url=...)``) posts a message when it
starts (the instance, its spot price and the saving against on-demand), when an
attempt is interrupted (the spot notice), when it resumes (from which step, what the
interruption cost in time and money, the steps redone) and when it ends (completed,
failed or stopped: how long it ran, its cost and saving, its interruptions, its final
metrics). The agent on the instance sends them, so they come with the notebook closed.
Each says what happened and where the run stands, as researchers get it from their
training scripts in Slack: the step of the total, the last metrics, GPU (or CPU)
utilisation and memory, the instance, the job's time running.

The job-wide figures (cost, saving, interruptions, steps redone) are the fold's
(:class:`spotnb.protocol.events.fold.JobState`), the same the notebook shows: the agent hands
the notifier a function that folds the job's log, called once per message that needs
it (a start, a resume, the end), never per step.

:func:`post` sends one message at once, outside any job: a sweep's summary, from the
notebook's kernel that drives it (:mod:`spotnb.sweep`), whose trials send none.

The body is ``{"text": ...}`` with Slack's ``mrkdwn`` (``*bold*``), which Slack,
Mattermost, Rocket.Chat and Microsoft Teams' incoming webhooks accept.

A notification never blocks or fails the job: messages are queued and posted by one
background thread with a bounded timeout, a failure is logged (without the URL) and
dropped, and at the end the agent waits at most :data:`DRAIN_SECONDS` for the queue (the
end message reads the job's log first, then posts). A message whose figures cannot be
made is sent without them.
The URL is a secret (DESIGN invariant 7): it travels as the job's secret
``SPOTNB_NOTIFY_URL`` (:mod:`spotnb.protocol.secretstore`: the provider's secret store, read by
the agent, not given to the cell), and nowhere else: not in the spec, events, logs or
records.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from spotnb.protocol import layout
from spotnb.protocol.events import Event
from spotnb.protocol.events.fold import savings_pct

if TYPE_CHECKING:
    from spotnb.protocol.events.fold import JobState

__all__ = ["DRAIN_SECONDS", "SEND_TIMEOUT_SECONDS", "Notifier", "check_url", "post", "redact",
           "send"]

log = logging.getLogger(__name__)

#: One POST may take this long: a webhook that hangs costs the job a thread, no more.
SEND_TIMEOUT_SECONDS = 5.0
#: Reading the job's log for a message's figures: this attempt's own events are flushed
#: first, for this long at most.
FLUSH_SECONDS = 5.0
#: At the end of the job the agent waits this long, at most, for messages in flight: the
#: end message's read of the log (a flush and a replay of the job's log) and two posts.
DRAIN_SECONDS = 30.0
# Metrics a message lists, at most.
_METRICS_SHOWN = 4


def check_url(url: str) -> str | None:
    """What is wrong with ``url`` as a webhook, or None if nothing."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.netloc:
        return ("the notification URL must be an http(s) URL of a Slack-compatible "
                "incoming webhook, e.g. https://hooks.slack.com/services/T000/B000/XXXX")
    return None


def redact(url: str) -> str:
    """The URL as logs may show it: scheme and host only (its path is the secret)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}/…"


class Notifier:
    """The sender of one job's notifications (see the module docstring).

    ``url`` None makes every method a no-op. The agent feeds it what it relays
    (:meth:`saw_metrics`, :meth:`saw_sys`, :meth:`saw_total`) and calls
    :meth:`started`, :meth:`interrupted` and :meth:`ended`; :meth:`close` waits for the
    last messages. ``job_state``: the job's events folded now (None if the log cannot
    be read), for the job-wide figures.
    """

    def __init__(self, url: str | None, job_id: str, name: str, max_nodes: int = 1,
                 job_state: Callable[[], JobState | None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self.job_state = job_state
        self.clock = clock
        self.max_nodes = max_nodes  # a multi-node job's MAX: its notices are a node's
        self.job_id = job_id
        self.name = name
        self.where = ""  # instance type, zone, id
        self.since = clock()  # this agent started
        self.job_start: float | None = None  # the job's first launch, once the log says
        self.step: int | None = None
        self.total: int | None = None
        self.metrics: dict[str, float] = {}
        self.sys: dict[str, Any] = {}
        self.sent = 0
        self.failed = 0
        self._resuming: int | None = None  # an attempt that resumed and logged no row yet
        self._started_here = False  # this agent (one instance) started an attempt
        self._queue: queue.Queue[Callable[[], dict[str, Any]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- what the agent relays -------------------------------------------------------

    def saw_metrics(self, rows: Iterable[Any]) -> None:
        """Rows of ``spot.log``: ``[step, time, {name: value}]`` each."""
        first: tuple[int, float] | None = None
        for step, t, values in rows:
            first = first or (step, t)
            self.step = step
            self.metrics.update(values)
        if first is not None and self._resuming is not None:
            attempt, self._resuming = self._resuming, None
            self._resumed(attempt, *first)

    def saw_sys(self, sample: dict[str, Any]) -> None:
        """A GPU/CPU sample (the ``sys`` event's data)."""
        self.sys = sample

    def saw_total(self, total: Any) -> None:
        """The run's total number of steps (``spot.progress`` or the loop's range)."""
        if isinstance(total, int) and total > 0:
            self.total = total

    # -- messages --------------------------------------------------------------------

    def started(self, attempt: int) -> None:
        """Attempt ``attempt`` runs the cell. The job's first says so with its price;
        a later one (a replacement) says so at its first step, when what the
        interruption cost is known."""
        if not self.url:
            return
        if self._started_here:
            return  # a retry in place after an error in the cell: no interruption to tell
        self._started_here = True
        if attempt > self.max_nodes:
            self._resuming = attempt  # a replacement instance's agent
            return
        if attempt != 1:
            return  # another node joining the job's first world: the job's start is one
        where, nodes = self.where, f" on {self.max_nodes} nodes" if self.max_nodes > 1 else ""

        def price(state: JobState) -> str:
            inst = next((i for i in state.instances.values()
                         if where and i.instance_id in where), None) or \
                next(iter(state.instances.values()), None)
            if inst is None or not inst.price:
                return ""
            text = f": spot ${inst.price:.4f}/h"
            saving = savings_pct(inst.price, inst.ondemand or 0.0)
            if saving is not None:
                text += f", {saving:.0f}% under on-demand (${inst.ondemand:.4f}/h)"
            return text

        def headline() -> str:
            return (f":arrow_forward: spotnb job *{self.name}* (`{self.job_id}`) started"
                    f"{nodes} on {where or 'its instance'}{self._figures(price)}")

        self._post(headline)

    def _resumed(self, attempt: int, step: int, t: float) -> None:
        """Attempt ``attempt`` logged its first row (``step`` at ``t``)."""
        who = f"attempt {attempt}"
        if self.max_nodes > 1:
            who = f"node {layout.node_slot(attempt, self.max_nodes)} ({who})"
        where = self.where or "a replacement"

        def cost(state: JobState) -> str:
            figures = resume_cost(state, attempt, step, t)
            if figures is None:
                return ""
            stopped, usd, redone = figures
            return (f": the interruption has cost {_clock(stopped)} of training and "
                    f"${usd:.4f} so far, {redone} step{'s' if redone != 1 else ''} redone")

        def headline() -> str:
            return (f":arrows_counterclockwise: spotnb job *{self.name}* "
                    f"(`{self.job_id}`) resumed on {who}, {where}, from step {step}"
                    f"{self._figures(cost)}")

        self._post(headline)

    def interrupted(self, attempt: int, action: str | None, when: str | None) -> None:
        """The spot notice reached this attempt."""
        notice = f"spot interruption notice ({action or 'terminate'}"
        notice += f" at {when})" if when else ")"
        if self.max_nodes > 1:
            slot = layout.node_slot(attempt, self.max_nodes)
            self._post(f":warning: spotnb job *{self.name}* (`{self.job_id}`): node {slot} "
                       f"(attempt {attempt}) interrupted by a {notice}; every rank saves a "
                       "checkpoint, and the job goes on without the node while its "
                       "replacement boots")
            return
        self._post(f":warning: spotnb job *{self.name}* (`{self.job_id}`): attempt "
                   f"{attempt} interrupted by a {notice}; it saves a checkpoint and "
                   "resumes on a replacement instance")

    def rebalance(self, attempt: int) -> None:
        """A rebalance recommendation reached attempt ``attempt``: it saves at once, and
        the capacity group starts a warm standby."""
        self._post(f":hourglass: spotnb job *{self.name}* (`{self.job_id}`): attempt "
                   f"{attempt}: rebalance recommendation: standby booting")

    def standby_ready(self) -> None:
        """This instance's standby waits at the cell's restore point."""
        self._post(f":hourglass: spotnb job *{self.name}* (`{self.job_id}`): standby "
                   f"ready on {self.where or 'its instance'}")

    def handed_over(self, attempt: int) -> None:
        """This standby restored the job as attempt ``attempt``: how long the handover
        took, as the fold says (:meth:`JobState.handover_seconds`)."""
        def headline() -> str:
            def seconds(state: JobState) -> str:
                sb = next((b for b in state.standbys.values() if b.attempt == attempt),
                          None)
                took = None if sb is None else state.handover_seconds(sb)
                return "" if took is None else f" in {took:.1f} s"

            return (f":arrows_counterclockwise: spotnb job *{self.name}* "
                    f"(`{self.job_id}`): handed over to the standby{self._figures(seconds)}"
                    f" (attempt {attempt})")

        self._post(headline)

    def standby_given_back(self, cost_usd: float) -> None:
        """The capacity group gave a standby back: it was not ready within its hold."""
        self._post(f":hourglass: spotnb job *{self.name}* (`{self.job_id}`): standby given "
                   f"back (not ready in time): ${cost_usd:.3f}")

    def ended(self, status: str, reason: str, attempt: int) -> None:
        """The job ended on this attempt: completed, failed or stopped."""
        icon = {"completed": ":white_check_mark:", "failed": ":x:",
                "stopped": ":octagonal_sign:"}.get(status, ":information_source:")
        when = self.clock()

        def headline() -> str:
            facts = self._figures(lambda state: "\n" + job_summary(state, when))
            return (f"{icon} spotnb job *{self.name}* (`{self.job_id}`) {status} on "
                    f"attempt {attempt}: {reason}{facts}")

        self._post(headline)

    def _figures(self, make: Callable[[JobState], str]) -> str:
        """``make``'s text from the job's fold now, or "" (no log to read, or figures
        that cannot be made: the message goes without them)."""
        state = self._state()
        if state is None:
            return ""
        try:
            return make(state)
        except Exception:
            log.warning("a notification's figures could not be made", exc_info=True)
            return ""

    def _state(self) -> JobState | None:
        if self.job_state is None:
            return None
        try:
            state = self.job_state()
        except Exception:  # the figures are extras: never the message, never the job
            log.warning("the job's log could not be read for a notification", exc_info=True)
            return None
        start = getattr(state, "first_launch", None)
        if isinstance(start, (int, float)):
            self.job_start = float(start)
        return state

    def _post(self, headline: str | Callable[[], str]) -> None:
        """Queue a message. A headline that needs the job's log (a function) is made in
        the sending thread: the fold's read never holds up the agent's thread that
        called. The progress is taken now; the machine line when it is sent."""
        if not self.url:
            return
        progress = self._progress()

        def body() -> dict[str, Any]:
            try:
                text = headline() if callable(headline) else headline
            except Exception:  # the figures are extras: the message goes without them
                log.warning("a notification's figures could not be made", exc_info=True)
                text = f"spotnb job *{self.name}* (`{self.job_id}`)" + (
                    "" if callable(headline) else f": {headline}")
            machine = self._machine()
            return {"text": "\n".join([text, *(p for p in (progress, machine) if p)])}

        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="spotnb-notify",
                                            daemon=True)
            self._thread.start()
        self._queue.put(body)

    def _progress(self) -> str:
        progress = []
        if self.step is not None:
            progress.append(f"step {self.step + 1} of {self.total}" if self.total
                            else f"step {self.step}")
        progress += [f"{k} {v:.4g}" for k, v in list(self.metrics.items())[:_METRICS_SHOWN]
                     if isinstance(v, (int, float))]
        return " · ".join(progress)

    def _machine(self) -> str:
        machine = []
        if self.sys:
            kind = "GPU" if self.sys.get("kind") == "gpu" else "CPU"
            if self.sys.get("util") is not None:
                machine.append(f"{kind} {float(self.sys['util']):.0f}% busy")
            used, total = self.sys.get("mem_used"), self.sys.get("mem_total")
            if used is not None and total:
                label = "GPU memory" if kind == "GPU" else "RAM"
                machine.append(f"{label} {used / 2**30:.1f} of {total / 2**30:.1f} GiB")
        if self.job_start is not None:
            running = f"job running {_clock(self.clock() - self.job_start)}"
        else:
            running = f"attempt running {_clock(self.clock() - self.since)}"
        machine.append(f"{self.where or 'instance'}, {running}")
        return " · ".join(machine)

    def _send_loop(self) -> None:
        while True:
            body = self._queue.get()
            try:
                if body is None:
                    return
                self._send(body())
            finally:
                self._queue.task_done()

    def _send(self, body: dict[str, Any]) -> None:
        assert self.url is not None
        if send(self.url, body):
            self.sent += 1
        else:
            self.failed += 1

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Wait up to ``timeout`` seconds for the messages queued so far."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)


def send(url: str, body: dict[str, Any]) -> bool:
    """POST ``body`` (``{"text": ...}``) to the webhook ``url`` once, within
    :data:`SEND_TIMEOUT_SECONDS`; whether it was taken. A failure is logged without the
    URL (its path is the secret) and not retried."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "spotnb"})
    try:
        with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_SECONDS) as reply:
            reply.read(1024)
        return True
    except (OSError, urllib.error.URLError, ValueError) as err:
        log.warning("notification to %s failed: %s", redact(url),
                    getattr(err, "reason", None) or type(err).__name__)
        return False


def post(url: str, text: str) -> bool:
    """One message (Slack's ``mrkdwn``) to ``url`` now: a sweep's summary, say."""
    return send(url, {"text": text})


def _clock(seconds: float) -> str:
    """``H:MM:SS``."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def job_summary(state: JobState, now: float) -> str:
    """The job as a whole, one line: how long it ran, what it cost and saved, its
    interruptions and steps redone."""
    start = state.first_launch or state.first_time or now
    cost, ondemand = state.cost_usd(now), state.cost(now)[1]
    parts = [f"ran {_clock(now - start)}", f"cost ${cost:.4f}"]
    saving = savings_pct(cost, ondemand)
    if saving is not None:
        parts[-1] += f" ({saving:.0f}% under on-demand ${ondemand:.4f})"
    n = state.interruptions()
    parts.append(f"{n} interruption{'s' if n != 1 else ''}")
    free = len(state.refunded())
    if free:
        parts[-1] += f" ({free} in the first hour of an instance: not billed)"
    redone = state.redone_steps()
    if redone:
        parts.append(f"{redone} step{'s' if redone != 1 else ''} redone")
    return " · ".join(parts)


def resume_cost(state: JobState, attempt: int, step: int, t: float
                ) -> tuple[float, float, int] | None:
    """What the break before ``attempt`` cost when it logged its first row (``step`` at
    ``t``), as the fold says it (:meth:`JobState.resumed`): the time it took so far
    (from the last row at the furthest step before it until ``t``, or until a step
    beyond it), the instances' cost over that time, and the steps redone. None when no
    row was logged before it. The row is folded in first where the log does not hold
    it yet (the agent has it in hand before its log does). A multi-node job's figure
    counts every instance of the cluster over that time, the survivors' included (they
    trained on at N-1 meanwhile: an upper bound); only global rank 0's node logs rows,
    so a replacement node that does not host it sends no resume message."""
    if not any(s.attempt == attempt for s in state.steps.segments):
        state.apply(Event("metric", t, attempt, None, {"step": step, "t": t, "values": {}}))
    seg = state.resumed(attempt)
    window = None if seg is None else seg.window(t)
    if seg is None:
        return None
    start, end = window if window is not None else (t, t)
    return end - start, state.cost_between(start, end), seg.redone or 0
