"""The metric rows of ``spot.log`` on their way to the agent.

``spot.log`` appends a row to :data:`ROWS` (no lock on the hot path); the session's
metrics thread drains it every 0.2 s (:meth:`MetricRows.drain`), converts the values
with ``float()`` (off the cell's thread: ``float()`` of a CUDA tensor waits for the
GPU) and sends them in batches. The rows sent are kept until the agent says the event
log has them (:class:`~spotnb.kernel_remote.channel.Durable`): a checkpoint carries
those that are not yet (DESIGN invariant 8, :mod:`spotnb.train.carry`). Standalone,
without an agent, the rows are kept for ``spot.history``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from spotnb.kernel_remote import channel

__all__ = ["MAX_UNACKED_ROWS", "ROWS", "MetricRows"]

_logger = logging.getLogger(__name__)

# At most this many metric rows per channel message, to keep lines reasonably short.
_ROWS_PER_MESSAGE = 2000
# Rows kept for the next checkpoint while the log has not confirmed them (each ~200 B).
MAX_UNACKED_ROWS = 1_000_000

#: Rows logged by ``spot.log`` and not sent yet: ``(step, time, {name: value})``.
#: Appending to a deque is atomic under the GIL, so the hot path takes no lock.
ROWS: collections.deque[tuple[Any, float, dict[str, Any]]] = collections.deque()


class MetricRows:
    """The rows of this process's session: sent, and kept until durable in the log
    (``remote``), or kept as its history (standalone). See the module docstring."""

    def __init__(self, *, remote: bool) -> None:
        self.remote = remote
        #: Standalone: every row logged so far (``spot.history``).
        self.history: list[tuple[int, float, dict[str, float]]] = []
        #: Rows sent to the agent and not yet confirmed durable in the event log.
        self.unacked: collections.deque[list[Any]] = collections.deque()
        self._unacked_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._bad_metrics: set[str] = set()

    def durable_until(self, t: float) -> None:
        """The agent wrote every row up to time ``t`` into the event log."""
        with self._unacked_lock:
            unacked = self.unacked
            while unacked and unacked[0][1] <= t:
                unacked.popleft()

    def not_durable(self) -> list[list[Any]]:
        """The rows sent that the log has not confirmed ([] standalone)."""
        with self._unacked_lock:
            return list(self.unacked) if self.remote else []

    def drain(self, send: Callable[[channel.Message], None] | None) -> None:
        """Convert the rows logged so far and ``send`` them (None: no agent to send them
        to, keep them as the history)."""
        with self._drain_lock:
            rows = []
            popleft = ROWS.popleft
            for _ in range(len(ROWS)):
                try:
                    raw = popleft()
                except IndexError:
                    break  # another session's drain took them (one left running)
                row = self._convert(raw)
                if row is not None:
                    rows.append(row)
            if not rows:
                return
            if send is None:
                self.history.extend((r[0], r[1], r[2]) for r in rows)
                return
            for i in range(0, len(rows), _ROWS_PER_MESSAGE):
                send(channel.Metrics(rows=rows[i:i + _ROWS_PER_MESSAGE]))
            if self.remote:
                with self._unacked_lock:
                    self.unacked.extend(rows)
                    while len(self.unacked) > MAX_UNACKED_ROWS:
                        self.unacked.popleft()

    def _convert(self, row: tuple[Any, float, dict[str, Any]]) -> list[Any] | None:
        # float() of a 0-d CUDA tensor waits for the GPU: that is why it happens here.
        step, t, metrics = row
        try:
            step = int(step)
        except Exception:
            self._warn_bad("step", step)
            return None
        values: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                if hasattr(value, "detach"):
                    value = value.detach()  # float() of a tensor needing grad warns
                values[name] = float(value)
            except Exception:
                self._warn_bad(name, value)
        return [step, t, values]

    def _warn_bad(self, name: str, value: Any) -> None:
        if name not in self._bad_metrics:
            self._bad_metrics.add(name)
            _logger.warning("spot.log: %s=%r is not a number and was dropped; log a number "
                            "or a one-element tensor (e.g. loss.item() or loss)",
                            name, type(value).__name__)
