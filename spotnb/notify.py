"""Notifications to a Slack-compatible webhook, sent from the instance.

A job given a ``notify_url`` (``%%spot_train --notify URL``,
``SpotMagics.notify_url``, ``spotnb.submit(notify_url=...)``) posts a message when an
attempt is interrupted (the spot notice) and when the job ends (completed, failed or
stopped). The agent on the instance sends them, so they come with the notebook closed.
Each says what happened and where the run stands, as researchers get it from their
training scripts in Slack: the step of the total, the last metrics, GPU (or CPU)
utilisation and memory, the instance, the time running.

The body is ``{"text": ...}`` with Slack's ``mrkdwn`` (``*bold*``), which Slack,
Mattermost, Rocket.Chat and Microsoft Teams' incoming webhooks accept.

A notification never blocks or fails the job: messages are queued and posted by one
background thread with a bounded timeout, a failure is logged (without the URL) and
dropped, and at the end the agent waits at most :data:`DRAIN_SECONDS` for the queue.
The URL is a secret (DESIGN invariant 7): it travels as the job's secret
``SPOTNB_NOTIFY_URL`` (:mod:`spotnb.secretstore`: the provider's secret store, read by
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
from collections.abc import Iterable
from typing import Any

from spotnb import layout

__all__ = ["DRAIN_SECONDS", "SEND_TIMEOUT_SECONDS", "Notifier", "check_url", "redact"]

log = logging.getLogger(__name__)

#: One POST may take this long: a webhook that hangs costs the job a thread, no more.
SEND_TIMEOUT_SECONDS = 5.0
#: At the end of the job the agent waits this long, at most, for messages in flight.
DRAIN_SECONDS = 2 * SEND_TIMEOUT_SECONDS
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
    :meth:`interrupted` and :meth:`ended`; :meth:`close` waits for the last messages.
    """

    def __init__(self, url: str | None, job_id: str, name: str, max_nodes: int = 1) -> None:
        self.url = url
        self.max_nodes = max_nodes  # a multi-node job's MAX: its notices are a node's
        self.job_id = job_id
        self.name = name
        self.where = ""  # instance type, zone, id
        self.started = time.time()
        self.step: int | None = None
        self.total: int | None = None
        self.metrics: dict[str, float] = {}
        self.sys: dict[str, Any] = {}
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- what the agent relays -------------------------------------------------------

    def saw_metrics(self, rows: Iterable[Any]) -> None:
        """Rows of ``spot.log``: ``[step, time, {name: value}]`` each."""
        for step, _t, values in rows:
            self.step = step
            self.metrics.update(values)

    def saw_sys(self, sample: dict[str, Any]) -> None:
        """A GPU/CPU sample (the ``sys`` event's data)."""
        self.sys = sample

    def saw_total(self, total: Any) -> None:
        """The run's total number of steps (``spot.progress`` or the loop's range)."""
        if isinstance(total, int) and total > 0:
            self.total = total

    # -- messages --------------------------------------------------------------------

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

    def ended(self, status: str, reason: str, attempt: int) -> None:
        """The job ended on this attempt: completed, failed or stopped."""
        icon = {"completed": ":white_check_mark:", "failed": ":x:",
                "stopped": ":octagonal_sign:"}.get(status, ":information_source:")
        self._post(f"{icon} spotnb job *{self.name}* (`{self.job_id}`) {status} on "
                   f"attempt {attempt}: {reason}")

    def _post(self, headline: str) -> None:
        if not self.url:
            return
        body = {"text": "\n".join([headline, *self._details()])}
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="spotnb-notify",
                                            daemon=True)
            self._thread.start()
        self._queue.put(body)

    def _details(self) -> list[str]:
        progress = []
        if self.step is not None:
            progress.append(f"step {self.step + 1} of {self.total}" if self.total
                            else f"step {self.step}")
        progress += [f"{k} {v:.4g}" for k, v in list(self.metrics.items())[:_METRICS_SHOWN]
                     if isinstance(v, (int, float))]
        machine = []
        if self.sys:
            kind = "GPU" if self.sys.get("kind") == "gpu" else "CPU"
            if self.sys.get("util") is not None:
                machine.append(f"{kind} {float(self.sys['util']):.0f}% busy")
            used, total = self.sys.get("mem_used"), self.sys.get("mem_total")
            if used is not None and total:
                label = "GPU memory" if kind == "GPU" else "RAM"
                machine.append(f"{label} {used / 2**30:.1f} of {total / 2**30:.1f} GiB")
        running = int(time.time() - self.started)
        machine.append(f"{self.where or 'instance'}, up {running // 3600}:"
                       f"{running % 3600 // 60:02d}:{running % 60:02d}")
        return [" · ".join(part) for part in (progress, machine) if part]

    def _send_loop(self) -> None:
        while True:
            body = self._queue.get()
            try:
                if body is None:
                    return
                self._send(body)
            finally:
                self._queue.task_done()

    def _send(self, body: dict[str, Any]) -> None:
        assert self.url is not None
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "spotnb"})
        try:
            with urllib.request.urlopen(request, timeout=SEND_TIMEOUT_SECONDS) as reply:
                reply.read(1024)
            self.sent += 1
        except (OSError, urllib.error.URLError, ValueError) as err:
            # Never the URL: its path is the secret. Dropped, not retried: the job goes on.
            self.failed += 1
            log.warning("notification to %s failed: %s", redact(self.url),
                        getattr(err, "reason", None) or type(err).__name__)

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Wait up to ``timeout`` seconds for the messages queued so far."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
