"""The kernel's watchdog: a kernel whose agent falls silent stops itself.

The agent pings every second or so, with the time until which its lease counts as held
(``until``: its last confirmed renewal plus the TTL less the safety margin,
:meth:`spotnb.protocol.lease.HeldLease.held_until`). A kernel whose agent falls silent
(frozen) stops itself (SIGSTOP to its process group) at that time, before any other
agent may take the job over whatever the lease's TTL, or after ``AGENT_SILENT_SECONDS``
of silence when it knows no such time (:func:`spotnb.train.agentchannel.watchdog_verdict`),
so that nothing trains that nobody records. The agent resumes it once it has confirmed
its lease, or kills it if it lost it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

from spotnb.protocol import lease as lease_mod
from spotnb.train.agentchannel import AgentChannel, watchdog_verdict

__all__ = ["Watchdog"]

_logger = logging.getLogger(__name__)

# The watchdog looks at least this often (and at the lease's time exactly), and looks
# again this much later before it stops the kernel.
_WATCHDOG_SECONDS = 1.0
_RECHECK_SECONDS = 0.1
_PAST_SECONDS = 0.25


class Watchdog:
    """What the kernel knows of its agent's life (when it last heard from it, until when
    its lease counts as held), and the thread that stops the kernel while it is silent.
    See the module docstring."""

    def __init__(self) -> None:
        #: When the agent last said anything (monotonic).
        self.heard = time.monotonic()
        #: The agent has pinged: the watchdog is armed (an agent that never pings, such
        #: as a test's, is never taken for a frozen one), and it answers questions.
        self.pinged = False
        #: Until when the agent's lease counts as held (spotnb.protocol.lease.clock),
        #: from its pings; None while it holds none.
        self.until: float | None = None

    def on_message(self) -> None:
        """The agent said something."""
        self.heard = time.monotonic()

    def on_ping(self, until: float | None) -> None:
        """The agent pinged, its lease held until ``until``."""
        self.until = until
        self.pinged = True

    def start(self, chan: AgentChannel, stop: threading.Event) -> None:
        """Watch the agent at the end of ``chan`` until ``stop`` is set or it is gone."""
        threading.Thread(target=self._watch, args=(chan, stop), name="spotnb-watchdog",
                         daemon=True).start()

    def _watch(self, chan: AgentChannel, stop: threading.Event) -> None:
        """Stop this kernel (its whole process group) while the agent is silent: at the
        time its lease stops counting as held, or after AGENT_SILENT_SECONDS."""
        while not stop.wait(self._wait()):
            if chan.broken:
                return
            # Only a kernel the agent started leads its own process group: never stop
            # anything else (a test, a script that happens to have the variables set).
            if not self.pinged or os.getpgrp() != os.getpid():
                continue
            if self._verdict() is None:
                continue
            # Resumed by the agent just now? Its pings wait in the socket, with the
            # renewed time: let the reader take them before deciding.
            if stop.wait(_RECHECK_SECONDS):
                return
            why = self._verdict()
            if why is None:
                continue
            _logger.error("%s: stopping this kernel until it answers (nothing may train "
                          "that is not recorded)", why)
            with contextlib.suppress(OSError):
                os.killpg(os.getpgrp(), signal.SIGSTOP)
            # Resumed (SIGCONT from the agent): give it time to speak again.
            self.heard = time.monotonic()

    def _verdict(self) -> str | None:
        return watchdog_verdict(time.monotonic() - self.heard, self.until,
                                lease_mod.clock())

    def _wait(self) -> float:
        """Until the watchdog's next look: at the lease's time, at the latest in
        _WATCHDOG_SECONDS; past that time, every _PAST_SECONDS (for the agent's
        silence)."""
        until = self.until
        if until is None:
            return _WATCHDOG_SECONDS
        left = until - lease_mod.clock()
        return min(_WATCHDOG_SECONDS, left) if left > 0.01 else _PAST_SECONDS
